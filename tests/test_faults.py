"""Faults around a job: signals, orphans, restarts, ranks that die without a traceback, and
the rendezvous stores' listening address. Real `plait run` / `plait check` processes."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from plait.lifecycle import descendants
from plait.lifecycle import running as alive
from plait.spawn import run_distributed
from tests import _workers_faults as w
from tests._ranks import free_port, listening, routable_interface

ROOT = Path(__file__).resolve().parents[1]

LONG = """
import time
import torch, torch.distributed as dist
import plait
run = plait.init()
run.print("ready")
for i in range(100000):
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(0.05)
"""

EXIT3 = """
import sys, time
import torch.distributed as dist
import plait
run = plait.init()
if run.rank == 1:
    sys.exit(3)
time.sleep(1)
dist.barrier()
"""

KILL9 = """
import os, signal
import torch, torch.nn as nn, torch.distributed as dist
import plait
run = plait.init(log_every=100)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
model = run.parallelize(nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 9):
    run.step(model, (torch.randn(2, 4), torch.randn(2, 4)), nn.functional.mse_loss, opt)
    if step == 4 and run.rank == 1 and attempt == 0:
        os.kill(os.getpid(), signal.SIGKILL)
t = torch.ones(1)
dist.all_reduce(t)
run.print(f"attempt {attempt} sum {t.item():.0f}")
run.close()
"""


def _as_a_terminal_starts_it() -> None:
    """SIGINT at its default in the child, as a shell's foreground job has it: a suite run as a
    background job (``cmd &`` in a script) inherits SIGINT ignored, which ``plait run`` keeps
    ignored on purpose, and the Ctrl-C case would then wait for nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(*args, cwd, env=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "plait.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_a_terminal_starts_it)


def wait_for_line(proc, word, timeout=150.0):
    """Read stdout (in a thread) until a line containing ``word``: the job is up."""
    seen = threading.Event()
    lines = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if word in line:
                seen.set()

    threading.Thread(target=read, daemon=True).start()
    if not seen.wait(timeout):
        proc.kill()
        raise AssertionError(f"no {word!r} from the job: {''.join(lines)[-500:]}")
    return lines  # the reader keeps appending the job's later lines


def store_sockets(pids) -> dict[int, str]:
    """{port: address} of a job's rendezvous stores: every socket torchrun listens on (it runs
    no collectives) and the workers' MASTER_PORT store."""
    agents, ports = [], set()
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            env = Path(f"/proc/{pid}/environ").read_text().split("\0")
        except OSError:
            continue
        if "plait.torchrun" in cmd:
            agents.append(pid)
        ports |= {int(e.split("=", 1)[1]) for e in env if e.startswith("MASTER_PORT=")}
    socks = listening(pids)
    return {**listening(agents), **{p: socks.get(p) for p in ports}}


linux_only = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


def _signal_job(tmp_path, sig, check_sockets=False):
    script = tmp_path / "long.py"
    script.write_text(LONG)
    # Where torch's default would put gloo's sockets on a routable address (the interface
    # GLOO_SOCKET_IFNAME names, else the host name's address), a single-node job keeps them on
    # loopback all the same.
    routable = routable_interface() if check_sockets else None
    proc = start("run", "--nproc", "2", str(script), cwd=tmp_path,
                 env={"GLOO_SOCKET_IFNAME": routable} if routable else None)
    wait_for_line(proc, "ready")
    job = descendants(proc.pid)
    if check_sockets:
        stores = store_sockets(job)
        assert len(stores) >= 2, stores  # torchrun's store and the workers' store
        every = listening(job)  # the stores, and each worker's gloo pairs
        assert len(every) > len(stores), every
        assert set(every.values()) == {"127.0.0.1"}, every
    sent = time.monotonic()
    os.kill(proc.pid, sig)
    proc.wait(timeout=60)
    while alive(job) and time.monotonic() - sent < 60:
        time.sleep(0.05)
    gone = time.monotonic() - sent
    err = proc.stderr.read()
    print(f"{signal.Signals(sig).name}: every process of the job gone {gone:.2f} s after it")
    assert not alive(job), f"orphans: {alive(job)}"
    assert gone < 30
    return proc.returncode, err


@linux_only
@pytest.mark.parametrize("sig, code", [
    (signal.SIGTERM, 143),
    (signal.SIGINT, 130),
    pytest.param(signal.SIGHUP, 129, marks=pytest.mark.slow),
])
def test_signal_to_plait_run_stops_every_worker(tmp_path, sig, code):
    rc, err = _signal_job(tmp_path, sig, check_sockets=sig == signal.SIGTERM)
    assert rc == code, err
    assert err.strip().splitlines() == [err.strip()] and "stopped by" in err, err


@linux_only
@pytest.mark.skipif(routable_interface() is None, reason="no interface outside 127.0.0.0/8")
def test_spawned_workers_listen_on_loopback_only(monkeypatch):
    """plait check/comm/bench workers: gloo's sockets on 127.0.0.1 although the environment
    names a routable interface (as torch's default, the host name's address, often is)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", routable_interface())
    for socks in run_distributed(w.listening_sockets, 2, timeout=120):
        assert socks and set(socks.values()) == {"127.0.0.1"}, socks


@linux_only
def test_sigkill_of_plait_run_leaves_no_orphan(tmp_path):
    rc, _ = _signal_job(tmp_path, signal.SIGKILL)
    assert rc == -signal.SIGKILL


@linux_only
@pytest.mark.slow
def test_sigterm_to_plait_check_stops_its_workers(tmp_path):
    proc = start("check", "--plan", "dp=2", "--steps", "100000", cwd=tmp_path)
    deadline = time.monotonic() + 120
    while len(alive(descendants(proc.pid))) < 3 and time.monotonic() < deadline:  # 2 ranks
        time.sleep(0.2)
    job = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    sent = time.monotonic()
    while alive(job) and time.monotonic() - sent < 30:
        time.sleep(0.05)
    assert not alive(job)
    assert proc.returncode == 143
    assert proc.stderr.read().strip() == "plait check: stopped by SIGTERM"


def test_rank_that_exits_without_traceback_is_named(tmp_path):
    script = tmp_path / "exit3.py"
    script.write_text(EXIT3)
    proc = start("run", "--nproc", "2", str(script), cwd=tmp_path)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert "rank 1 (exit code 3, no traceback)" in err, err


def test_restart_after_kill9_of_a_rank(tmp_path):
    """torch 2.13's torchrun keeps its workers' store across restarts: without plait's fix the
    restarted ranks read dead peers' addresses (``Gloo connectFullMesh failed``)."""
    script = tmp_path / "kill9.py"
    script.write_text(KILL9)
    proc = start("run", "--nproc", "2", "--max-restarts", "1", str(script), cwd=tmp_path)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "attempt 1 sum 2" in out
    # rank 1 died after step 4; rank 0 notes step 4 unless torchrun stops it first (then 3)
    assert re.search(r"finished after 1 restart\(s\); [34] step\(s\) redone", err), err


@pytest.mark.slow
def test_second_node_that_never_comes_is_one_line(tmp_path):
    script = tmp_path / "long.py"
    script.write_text(LONG)
    proc = start("run", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                 f"127.0.0.1:{free_port()}", "--rdzv-timeout", "5",
                 str(script), cwd=tmp_path)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 1
    last = err.strip().splitlines()[-1]
    assert "did not join" in last and "--rdzv-timeout 5 s" in last, err
    assert "Traceback" not in err


TWO_NODES = """
import torch, torch.nn as nn
import plait
run = plait.init(plan="dp=2", log_every=1)
model = run.parallelize(nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 8))
for x, y in run.loader(data, batch_size=4):
    loss = run.step(model, (x, y), nn.functional.mse_loss, opt)
print(f"rank {run.rank} of {run.world_size} loss {loss:.6f}", flush=True)
"""


@pytest.mark.slow
def test_two_nodes_on_one_host_train_together(tmp_path):
    """Two `plait run` agents, one process each, meet at one rendezvous endpoint and train one
    dp=2 job; the node whose worker is not rank 0 says where rank 0 prints (torchrun's c10d
    rendezvous numbers nodes by host and process id, so which node that is is not chosen)."""
    script = tmp_path / "two.py"
    script.write_text(TWO_NODES)
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [start("run", "--nnodes", "2", "--node-rank", str(n), "--rdzv-endpoint", endpoint,
                   str(script), cwd=tmp_path) for n in (0, 1)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    lines = [out for out, _ in outs]
    losses = {m.group(1) for out in lines for m in re.finditer(r"of 2 loss (\S+)", out)}
    assert len(losses) == 1, lines  # one job: both ranks hold the same averaged loss
    silent = [out for out in lines if "step 1 |" not in out]
    assert len(silent) == 1 and "runs rank 1 of 2; rank 0 runs on" in silent[0], lines


def test_node_note_only_where_rank_0_is_not():
    from plait.lifecycle import node_note

    env = {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "gpu01"}
    assert node_note(0, 8, env, "gpu01") is None
    assert node_note(4, 8, {**env, "LOCAL_RANK": "1"}, "gpu02") is None
    assert node_note(4, 4, env, "gpu01") is None  # one node
    note = node_note(4, 8, env, "gpu02")
    assert note is not None and "gpu02) runs ranks 4..7 of 8; rank 0 runs on gpu01" in note


PREEMPT = """
import sys, time, torch, torch.nn as nn
import plait
run = plait.init(log_every=1000, checkpoint=sys.argv[1], every=100000)
model = run.parallelize(nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
run.print("ready")
for step in range(1, 100000):
    run.step(model, (torch.randn(4, 8), torch.randn(4, 8)), nn.functional.mse_loss, opt)
    time.sleep(0.02)
"""


@linux_only
def test_sigterm_saves_a_final_checkpoint_on_every_rank_at_one_step(tmp_path):
    """Preemption: ranks get SIGTERM at slightly different moments; all finish the same step,
    save a checkpoint of it together and leave; `plait run` exits 143."""
    script = tmp_path / "preempt.py"
    script.write_text(PREEMPT)
    proc = start("run", "--nproc", "2", str(script), str(tmp_path / "ckpt"), cwd=tmp_path)
    lines = wait_for_line(proc, "ready")
    time.sleep(1)
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=90)
    err = proc.stderr.read()
    assert proc.returncode == 143, err
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))
    assert len(saved) == 1 and int(saved[0][5:]) >= 1, (saved, err)
    time.sleep(0.5)  # the reader thread drains the last lines
    stopped = re.search(r"step (\d+): stopping on SIGTERM, saving a final checkpoint",
                        "".join(lines))
    assert stopped and int(stopped.group(1)) == int(saved[0][5:])


@linux_only
@pytest.mark.slow  # SIGTERM saving a final checkpoint on every rank runs by default
def test_ctrl_c_on_one_process_saves_a_final_checkpoint_and_exits_130(tmp_path):
    """`python train.py` with checkpointing on, stopped by Ctrl-C: the step finishes, a final
    checkpoint of it is saved and the process exits 130 with one line, not a KeyboardInterrupt
    traceback from wherever the step was (a periodic save included); under --format json the
    last line on stdout is the error event saying so."""
    script = tmp_path / "preempt.py"
    script.write_text(PREEMPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ckpt"), "--format",
                             "json"], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_a_terminal_starts_it)
    lines = wait_for_line(proc, "ready")
    time.sleep(1)
    os.kill(proc.pid, signal.SIGINT)
    proc.wait(timeout=90)
    err = proc.stderr.read()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))
    assert len(saved) == 1 and int(saved[0][5:]) >= 1, (saved, err)
    time.sleep(0.5)  # the reader thread drains the last lines
    stopped = re.search(r"step (\d+): stopping on SIGINT, saving a final checkpoint",
                        "".join(lines))
    assert stopped and int(stopped.group(1)) == int(saved[0][5:]), "".join(lines)
    last = json.loads(lines[-1])
    assert last["event"] == "error" and last["exit_code"] == 130, lines[-1]
    assert last["error"] == "stopped by SIGINT", lines[-1]


RESUME = """
import os, signal, sys
import torch
import plait
from plait.data import TextDataset
from plait.models.transformer import build, lm_loss
torch.manual_seed(0)  # the clean and the killed job are one run
run = plait.init("dp=2", checkpoint=sys.argv[1], every=2, keep=2, log_every=1)
model = run.parallelize(build("test"))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
kill = len(sys.argv) > 2 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
for batch in run.loader(TextDataset(seq_len=16), batch_size=8, steps=8):
    loss = run.step(model, batch, lm_loss, opt)
    if kill and run.steps_done == 5 and run.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)   # mid-run, one step after the save at step 4
info = run.finish()
run.print(f"FINAL {info['final_loss']!r}")
"""


@pytest.mark.slow
def test_kill9_restart_resumes_from_the_checkpoint_and_matches(tmp_path):
    """kill -9 of one rank under --max-restarts 1, checkpoints every 2 steps: the job finishes,
    says what it redid, and its final loss is bitwise the uninterrupted run's."""
    script = tmp_path / "resume.py"
    script.write_text(RESUME)
    finals = {}
    for name, extra in (("clean", []), ("killed", ["kill"])):
        proc = start("run", "--nproc", "2", "--max-restarts", "1", str(script),
                     str(tmp_path / f"ckpt-{name}"), *extra, cwd=tmp_path)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        finals[name] = next(line for line in out.splitlines() if line.startswith("FINAL"))
        if extra:
            # rank 1 died after step 5, saved at 4; rank 0 notes step 5 unless stopped first
            assert re.search(r"finished after 1 restart\(s\); [01] step\(s\) redone", err), err
    assert finals["clean"] == finals["killed"]


def test_a_stop_that_closed_its_run_is_not_ended_by_the_deadline():
    """After the run reached its stop and closed (``uninstall``), a process that lives on (a
    notebook's kernel, a script catching the ``SystemExit``) is not ended when the grace period
    runs out; one that never reached the stop is (exit 128 + the signal)."""
    code = ("import signal, time\n"
            "from plait.lifecycle import StopRequest\n"
            "stop = StopRequest(grace=0.3).install()\n"
            "stop._handle(signal.SIGTERM, None)\n"
            "{close}"
            "time.sleep(1.5)\n"
            "print('alive')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    closed = subprocess.run([sys.executable, "-c", code.format(close="stop.uninstall()\n")],
                            capture_output=True, text=True, timeout=60, env=env)
    assert closed.returncode == 0 and closed.stdout.strip() == "alive", closed
    stuck = subprocess.run([sys.executable, "-c", code.format(close="")],
                           capture_output=True, text=True, timeout=60, env=env)
    assert stuck.returncode == 128 + signal.SIGTERM and "alive" not in stuck.stdout, stuck
