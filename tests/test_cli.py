"""The `plait` command: env, run (failures, bad input), check, and a one-process script."""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def plait(*args, timeout=180, cwd=None, env=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "plait.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=env)


def test_env_json_parses():
    out = plait("env", "--format", "json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    cpu = next(a for a in info["accelerators"] if a["name"] == "cpu")
    assert cpu["available"] and cpu["backend"] == "gloo"
    assert info["backends"]["gloo"] is True
    assert info["versions"]["torch"]


def test_a_reader_that_stops_early_ends_the_report_quietly():
    """`plait schedule --format json | head -1`: the reader closes the pipe before the report is
    written. The command ends as a process stopped by SIGPIPE does (141), with nothing on
    stderr, not a BrokenPipeError traceback and a second error from Python's exit."""
    read, write = os.pipe()
    os.close(read)  # a reader that has already gone: the first write fails
    try:
        out = subprocess.run([sys.executable, "-m", "plait.cli", "schedule", "--pp", "2", "-m",
                              "2", "--format", "json"], stdout=write, stderr=subprocess.PIPE,
                             text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write)
    assert out.returncode == 141, out.stderr
    assert out.stderr == "", out.stderr


def test_launcher_variables_left_in_the_shell_are_named(tmp_path):
    """`python train.py` in a shell that kept WORLD_SIZE and RANK from another job (no
    MASTER_ADDR: no launcher started it): one ValueError naming the variables and both fixes,
    not torch's "Mesh should not be bigger than default world size 1"."""
    script = tmp_path / "train.py"
    script.write_text("import plait\nplait.init()\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=180, cwd=tmp_path,
                         env={**env, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "RANK": "1"})
    assert out.returncode == 1, out.stderr
    assert ("ValueError: WORLD_SIZE=2 and RANK=1 are set but MASTER_ADDR is not, so no "
            "launcher started this process") in out.stderr, out.stderr
    assert ("unset WORLD_SIZE RANK LOCAL_RANK to run one process, or start it with plait run "
            "--nproc 2") in out.stderr, out.stderr


def test_help_teaches():
    out = plait("--help")
    assert out.returncode == 0
    for word in ("run", "check", "env", "demo", "examples:"):
        assert word in out.stdout
    assert "--plan" in plait("run", "--help").stdout


def test_a_timeout_names_the_flag_that_raises_it():
    """Workers stopped by --timeout: one line naming the ranks and the flag, exit 1."""
    out = plait("check", "--plan", "dp=2", "--steps", "100000", "--timeout", "0.5")
    assert out.returncode == 1, out.stderr
    assert "still running after" in out.stderr, out.stderr
    assert "raise --timeout (now 0.5s)" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    # the stage it stopped in, said on stdout as it started (not a terminal: plain lines)
    assert out.stdout.startswith("plait check: [1/3] test, 100000 steps on one device (the "
                                 "reference) (0.0s elapsed)\n"), out.stdout
    assert "done in" not in out.stdout  # the error, not "done", is the last word


FAILING = """
import os, signal, time
import torch.distributed as dist
import plait
run = plait.init()
run.print("started")
if run.rank == 1:
    time.sleep(0.5)  # rank 0 waits in the barrier: it loses its peer mid-collective
    if os.environ.get("HOW") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("HOW") == "segv":
        import ctypes
        ctypes.string_at(0)  # a crash in native code
    raise RuntimeError("rank one exploded")
dist.barrier()
"""


def test_the_worker_store_port_is_outside_the_ephemeral_range(tmp_path):
    """Worker rank 0 binds MASTER_PORT seconds after torchrun's agent picked it: a port below
    the ephemeral range cannot be given meanwhile to an outgoing connection (the other ranks'
    retrying connects to it among them), which made rank 0 fail with 'Address already in
    use'."""
    from plait.store import ephemeral_range, unclaimable_port

    low, _ = ephemeral_range()
    picked = unclaimable_port()
    assert picked is not None and 1024 <= picked < low
    script = tmp_path / "port.py"
    script.write_text("import os\nprint('port', os.environ['MASTER_PORT'])\n")
    out = plait("run", "--nproc", "2", str(script))
    assert out.returncode == 0, out.stderr
    ports = {int(line.split()[-1]) for line in out.stdout.splitlines() if "port" in line}
    assert len(ports) == 1 and next(iter(ports)) < low, out.stdout


@pytest.mark.parametrize("how", ["raise", *[pytest.param(h, marks=pytest.mark.slow)
                                           for h in ("kill", "segv")]])
def test_failing_rank_shown_once(tmp_path, how):
    """The rank that failed is the one shown, once; rank 0's consequent 'connection closed'
    error (its peer went away during the barrier) is not put on the screen."""
    script = tmp_path / "bad.py"
    script.write_text(FAILING)
    out = plait("run", "--nproc", "2", str(script), env={"HOW": how})
    assert out.returncode != 0
    assert "started" in out.stdout
    for consequence in ("Connection closed", "Connection reset", "[rank0]"):
        assert consequence not in out.stderr, out.stderr
    if how == "raise":
        *shown, last = out.stderr.strip().splitlines()
        assert "\n".join(shown).count("RuntimeError: rank one exploded") == 1, out.stderr
        assert "rank 1 failed" in out.stderr
        # the last line carries the message too: a log's tail or a CI summary shows it
        assert "; rank 1: RuntimeError: rank one exploded; per-rank logs in " in last, last
        # Rank 1 may be stopped by torchrun while it exits; rank 0 may exit on the lost
        # connection first: either way rank 1 is the failure named.
        assert re.search(r"failed: rank 1 \(RuntimeError, (exit code 1|stopped while "
                         r"exiting)\)(;|$)", out.stderr, re.M), out.stderr
    elif how == "kill":
        assert "failed: rank 1 (killed by SIGKILL, no traceback)" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr, out.stderr
    else:  # the Python stack the rank crashed in, from faulthandler, in place of a traceback
        assert "failed: rank 1 (killed by SIGSEGV)" in out.stderr, out.stderr
        assert re.search(r"--- rank 1 failed ---\nFatal Python error: Segmentation fault\n"
                         r"Current thread .*\n.* in string_at\n.*bad.py\", line \d+ in <module>",
                         out.stderr), out.stderr


def test_the_same_error_on_every_rank_is_summarised_alike(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("import plait\nrun = plait.init()\nrun.print('started')\n"
                      "raise ValueError('bad setting, the same on every rank')\n")
    out = plait("run", "--nproc", "2", str(script))
    assert out.returncode != 0
    *shown, last = out.stderr.strip().splitlines()  # the traceback once, then the last line
    assert "\n".join(shown).count("ValueError: bad setting, the same on every rank") == 1, shown
    assert ": ValueError: bad setting, the same on every rank; per-rank logs in " in last, last
    assert "rank 0 (ValueError" in out.stderr and "rank 1 (ValueError" in out.stderr, out.stderr


@pytest.mark.parametrize("args, fragment", [
    (["run", "--nproc", "0", "x.py"], "--nproc 0"),
    (["run", "--nproc", "2", "does_not_exist.py"], "does not exist"),
    (["run", "--nproc", "2", "SCRIPT", "--plan", "dp=3"], "!= world size 2"),
    (["run", "--nproc", "2", "SCRIPT", "--plan", "dp=two"], "must be an integer"),
    (["check", "--plan", "tp=3,dp=x"], "must be an integer"),
    (["check", "--plan", "dp=2,clip=nan"], "grad_clip=nan must be a finite number"),
    (["check", "--plan", "fsdp=2,zero=1"], "write dp_shard=2,zero=1"),
    (["check", "--plan", "dp=1,dp=2"], "dp is given twice"),
])
def test_bad_input_is_one_clear_line(tmp_path, args, fragment):
    script = tmp_path / "ok.py"
    script.write_text("print('should not run')\n")
    args = [str(script) if a == "SCRIPT" else a for a in args]
    out = plait(*args, cwd=tmp_path)
    assert out.returncode == 2
    assert fragment in out.stderr
    assert "should not run" not in out.stdout
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("command", [
    ["run", "--nproc", "2", "SCRIPT", "--plan", "PLAN"],
    ["check", "--plan", "PLAN"],
    ["comm", "--plan", "PLAN"],
    ["plan", "--model", "test", "--cluster", "cpu", "--global-batch", "8", "--plan", "PLAN"],
])
@pytest.mark.parametrize("name, content, fragment", [
    ("p.json", '{"dp": 2, "sp": "no"}', "sp='no' must be true or false"),
    ("p.yaml", "plan: 5\n", "'plan' must hold a mapping"),
    ("p.yaml", "dp: [2\n", "is not valid YAML"),
    ("p.yaml", "dp: 2\noptions: {split_point: [layers.1]}\n", "did you mean 'split_points'"),
])
def test_bad_plan_file_is_one_line_exit_2(tmp_path, capsys, command, name, content, fragment):
    """Every command that takes --plan refuses a bad plan file in one line, before any work."""
    from plait.cli import main

    script = tmp_path / "ok.py"
    script.write_text("print('should not run')\n")
    (tmp_path / name).write_text(content)
    subs = {"SCRIPT": str(script), "PLAN": str(tmp_path / name)}
    assert main([subs.get(a, a) for a in command]) == 2
    out = capsys.readouterr()
    assert fragment in out.err and str(tmp_path / name) in out.err, out.err
    assert len(out.err.strip().splitlines()) == 1 and not out.out, out


def test_port_in_use_is_refused(tmp_path):
    import socket

    script = tmp_path / "ok.py"
    script.write_text("print('should not run')\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = plait("run", "--nproc", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", str(script))
    assert out.returncode == 2 and f"port {port}" in out.stderr and "in use" in out.stderr




def test_readme_script_one_process_and_launched():
    """examples/train.py is the README's script: the same file on one process and on two."""
    script = ROOT / "examples" / "train.py"
    small = ["--model", "test", "--steps", "4", "--batch-size", "8", "--seq-len", "16"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    single = subprocess.run([sys.executable, str(script), *small], capture_output=True,
                            text=True, timeout=120, env=env)
    assert single.returncode == 0, single.stderr
    launched = plait("run", "--nproc", "2", str(script), "--plan", "dp=2", *small)
    assert launched.returncode == 0, launched.stderr
    final = {}
    for name, out in (("single", single.stdout), ("dp2", launched.stdout)):
        line = next(ln for ln in out.splitlines() if ln.startswith("FINAL"))
        final[name] = (float(line.split()[1]), int(line.split()[2]))
    assert final["single"][1] == 1 and final["dp2"][1] == 2
    assert abs(final["single"][0] - final["dp2"][0]) < 1e-4
    assert launched.stdout.count("run summary") == 1  # printed by rank 0 only


def test_check_command_json():
    out = plait("check", "--plan", "dp=2", "--steps", "2", "--format", "json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["ok"] and data["world_size"] == 2 and len(data["losses_parallel"]) == 2


def test_only_rank_0s_uncaught_exception_is_held_back():
    """plait run holds back rank 0's uncaught exception (torch's excepthook writes it with a
    '[rank0]: ' prefix on every line, from its 'Traceback' line) until it knows the cause;
    the script's own lines, '[rank0]: '-prefixed ones included, are shown as they come."""
    import io

    from plait.launch import _pump

    stream = io.StringIO("[default0]:[rank0]: step 5 loss 2.0\n[default0]:hello\n"
                         "[default0]:[rank0]: Traceback (most recent call last):\n"
                         "[default0]:[rank0]:   File \"x.py\", line 1\n[default0]:\n"
                         "[default0]:[rank0]: RuntimeError: boom\n[default0]:after\n"
                         "torchrun's own line\n")
    out, keep, held = io.StringIO(), [], []
    _pump(stream, out, keep, held)
    assert out.getvalue() == "[rank0]: step 5 loss 2.0\nhello\nafter\n"
    assert held[0].startswith("[rank0]: Traceback") and held[-1] == "[rank0]: RuntimeError: boom\n"
    assert keep == ["torchrun's own line\n"]


def test_a_line_torchrun_tailed_in_pieces_is_shown_without_its_header_inside():
    """torchrun's tail reads a line rank 0 is still writing as two pieces, each with the
    '[default0]:' header: the second header is not shown in the middle of the line."""
    import io

    from plait.launch import _pump

    stream = io.StringIO("[default0]:step 1/5 | loss 4.88 | ETA 0:00:02[default0]:\n"
                         "[default0]:step 5/5 | lo[default0]:ss 4.85\n")
    out, keep = io.StringIO(), []
    _pump(stream, out, keep)
    assert out.getvalue() == "step 1/5 | loss 4.88 | ETA 0:00:02\nstep 5/5 | loss 4.85\n"


def test_the_failure_summary_names_exceptions_not_placeholders():
    from plait.launch import exception_name

    assert exception_name("[rank1]: Traceback ...\n[rank1]: plait.checkpoint.errors."
                          "CheckpointError: checkpoint x\n") == "CheckpointError"
    assert exception_name("NoneType: None\n") is None  # a report made outside an exception
    assert exception_name("killed\n") is None


def test_the_exception_line_is_the_one_after_the_frames():
    """The run's last line quotes the exception as raised: the first line after the frames
    (not the last line, which a message of several lines would give), cut when long."""
    from plait.launch import exception_line

    tb = ('[rank1]: Traceback (most recent call last):\n[rank1]:   File "t.py", line 3, in f\n'
          '[rank1]:     raise ValueError(msg)\n[rank1]: ValueError: lr 5 is too big\n'
          '[rank1]: use 1e-3\n')
    assert exception_line(tb) == "ValueError: lr 5 is too big"
    cut = exception_line(tb.replace("lr 5", "x" * 400), limit=40)
    assert cut == "ValueError: " + "x" * 25 + "..."
    assert exception_line("NoneType: None\n") is None  # a report made outside an exception
    assert exception_line("Fatal Python error: Segmentation fault\n\nCurrent thread:\n"
                          '  File "bad.py", line 4 in <module>\n') is None


def test_every_rank_raising_names_each_exception_whatever_the_timing():
    """When every rank raises, torchrun's SIGTERM may reach a rank while it exits on its own
    error: that rank is named with its exception, not as killed."""
    from plait.launch import failure_summary

    tb = {r: f"[rank{r}]: Traceback ...\n[rank{r}]: ValueError: bad\n" for r in (0, 1)}
    records = [{"rank": 0, "exitcode": 1}, {"rank": 1, "exitcode": -15, "signal": "SIGTERM"}]
    assert failure_summary(records, tb) == (
        0, "failed: rank 0 (ValueError, exit code 1), rank 1 (ValueError, stopped while exiting)")
    records[1]["signal"] = "SIGABRT"
    assert failure_summary(records, tb)[1].endswith("rank 1 (ValueError, then killed by SIGABRT)")
    # Rank 0 lost its peer and exited before torchrun stopped rank 1, which was exiting on
    # its own error: rank 1 is the failure, rank 0 comes after it.
    lost = {0: "[rank0]: Traceback ...\n[rank0]: RuntimeError: [gloo] Connection closed by peer\n",
            1: tb[1]}
    timing = [{"rank": 0, "exitcode": 1}, {"rank": 1, "exitcode": -15, "signal": "SIGTERM"}]
    assert failure_summary(timing, lost) == (
        1, "failed: rank 1 (ValueError, stopped while exiting); "
           "then lost the connection to it: rank(s) [0]")
    del tb[1]  # a rank stopped without an error of its own is not a failure
    records[1]["signal"] = "SIGTERM"
    assert failure_summary(records, tb)[1] == ("failed: rank 0 (ValueError, exit code 1); "
                                               "then stopped: rank(s) [1]")


@pytest.mark.parametrize("fmt", ["text", "table", "json"])
def test_every_report_takes_one_spelling_of_format(fmt):
    """`plait plan` and `plait comm` print tables (`--format table`), `plait check` and the
    rest text (`--format text`): each takes both spellings and json, so a flag learnt on one
    report is not refused by another."""
    from plait.cli import build_parser

    parser = build_parser()
    for argv in (["env"], ["doctor"], ["check", "--plan", "dp=2"], ["plan"], ["schedule"],
                 ["comm", "--plan", "dp=2"], ["bench", "comm"],
                 ["export", "ckpt", "--to", "m.safetensors"]):
        assert parser.parse_args([*argv, "--format", fmt]).format == fmt, argv


@pytest.mark.parametrize("command, canonical, aliases, dest", [
    (["plan"], "--global-batch", ("--batch-size", "--batch"), "global_batch"),
    (["plan"], "--seq", ("--seq-len",), "seq"),
    (["check", "--plan", "dp=2"], "--global-batch", ("--batch-size", "--batch"), "batch_size"),
    (["check", "--plan", "dp=2"], "--seq", ("--seq-len",), "seq_len"),
    (["comm", "--plan", "dp=2"], "--global-batch", ("--batch-size", "--batch"), "global_batch"),
    (["comm", "--plan", "dp=2"], "--replica-batch", (), "replica_batch"),
    (["comm", "--plan", "dp=2"], "--seq", ("--seq-len",), "seq"),
])
def test_one_spelling_per_flag_and_the_others_as_aliases(command, canonical, aliases, dest):
    """The global batch is --global-batch and the sequence --seq on every command (plait.init's
    global_batch= and seq=); the spellings some commands used before still parse to the same
    value, and the help lists the canonical one, naming the others in its text."""
    from plait.cli import build_parser

    parser = build_parser()
    for flag in (canonical, *aliases):
        assert getattr(parser.parse_args([*command, flag, "48"]), dest) == 48, flag
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices[command[0]].format_help()
    listed = re.findall(r"^  (-[-\w]+)", text, re.M)
    assert canonical in listed and not set(aliases) & set(listed), listed
    assert all(alias in text for alias in aliases), text


def test_demo_takes_the_canonical_flags():
    from plait.demo import parse_args

    args = parse_args(["--global-batch", "16", "--seq", "64"])
    assert (args.batch_size, args.seq_len) == (16, 64)
    assert parse_args(["--batch-size", "16", "--seq-len", "64"]) == args
