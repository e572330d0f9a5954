"""`plait run`: a thin layer over torchrun (``torch.distributed.run``).

What it adds, and why:

* **Checks before any worker starts**: the script exists, ``--nproc`` is positive, the script's
  ``--plan`` parses and fits ``nproc x nnodes``, a rendezvous port the user named is free. Each
  failure is one line and a non-zero exit, with nothing started.
* **Standalone by default**: one node on 127.0.0.1 with a port the OS picks (never a fixed one).
* **SLURM**: inside an allocation, nodes, node rank and the rendezvous host come from SLURM's
  variables unless given on the command line.
* **One traceback, once**: workers' output is written per rank to a log folder; rank 0's is
  echoed live (progress), and when a worker fails its traceback is printed once — the first
  failing rank's — instead of once per rank interleaved with torchrun's own report.
* **JSON Lines for programs** (``--format json``): the script gets ``--format json`` on its
  command line, which ``plait.init`` reads as it reads ``--plan``, and then writes one event
  per line; the launcher keeps stdout one JSON object per line (the script's own prints become
  ``output`` events) and ends a failed run with an ``error`` event. Tracebacks, warnings and
  the launcher's notes stay on stderr.

Everything else (restarts, multi-node rendezvous, worker monitoring) is torchrun's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeAlias, TypedDict

from .argv import accelerator_from_argv, format_from_argv, plan_from_argv
from .lifecycle import children, steps_redone
from .outputs import FORMATS, as_event, json_error, writable_folder
from .plan import Plan
from .store import loopback_interface

if TYPE_CHECKING:  # the launcher imports torch only for a script's --accelerator
    from .accelerators import Accelerator


@dataclass(frozen=True)
class LaunchConfig:
    script: str                    # path of the training script, or a module with module=True
    script_args: tuple[str, ...] = ()
    nproc: int = 1                 # processes per node
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None   # HOST:PORT; None = standalone on a free local port
    max_restarts: int = 0
    module: bool = False           # run `python -m script`
    log_dir: str | None = None     # where per-rank logs go (default: a temporary folder)
    rdzv_timeout: float = 600.0    # seconds to wait for every node to join (multi-node)
    extra_env: dict[str, str] = field(default_factory=dict)
    # "json": JSON Lines on stdout (see the module docstring); "text" (or "table"): as printed.
    format: str = "text"


class SlurmDefaults(TypedDict, total=False):
    """What a SLURM allocation says about the launch; each key only where SLURM sets it."""
    nnodes: int
    node_rank: int
    rdzv_endpoint: str          # HOST:PORT


def slurm_defaults(env: dict[str, str]) -> SlurmDefaults:
    """Nodes, node rank and rendezvous host from a SLURM allocation (empty outside one)."""
    if "SLURM_JOB_ID" not in env or "SLURM_NNODES" not in env:
        return {}
    out: SlurmDefaults = {"nnodes": int(env["SLURM_NNODES"]),
                          "node_rank": int(env.get("SLURM_NODEID", "0"))}
    host = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", ""))
    if host:
        out["rdzv_endpoint"] = f"{host}:{env.get('MASTER_PORT', '29500')}"
    return out


def _first_slurm_host(nodelist: str) -> str | None:
    """First host of a SLURM node list: ``gpu[03-05,07],cpu1`` -> ``gpu03``."""
    if not nodelist:
        return None
    match = re.match(r"([^\[,]+)(?:\[([^\]]+)\])?", nodelist)
    if not match:
        return None
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _module_exists(name: str) -> bool:
    """Whether ``python -m name`` started here finds the top-level package (not imported)."""
    top = name.split(".")[0]
    if not top.isidentifier():
        return False
    found = importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path])
    return found is not None or importlib.util.find_spec(top) is not None


def validate(cfg: LaunchConfig) -> None:
    """Raise ValueError with one clear line for anything that would fail after launch."""
    if cfg.nproc < 1:
        raise ValueError(f"--nproc {cfg.nproc}: need at least 1 process per node")
    if cfg.nnodes < 1:
        raise ValueError(f"--nnodes {cfg.nnodes}: need at least 1 node")
    if not 0 <= cfg.node_rank < cfg.nnodes:
        raise ValueError(f"--node-rank {cfg.node_rank} must be in [0, {cfg.nnodes - 1}]: "
                         f"--nnodes {cfg.nnodes} numbers the nodes 0 to {cfg.nnodes - 1}")
    if not cfg.rdzv_timeout > 0:
        raise ValueError(f"--rdzv-timeout {cfg.rdzv_timeout} must be a positive number of "
                         f"seconds")
    if cfg.max_restarts < 0:
        raise ValueError(f"--max-restarts {cfg.max_restarts} must be >= 0")
    if cfg.module and not _module_exists(cfg.script):
        raise ValueError(f"-m {cfg.script}: no module named {cfg.script.split('.')[0]!r} here "
                         f"or on the Python path (check the name, or run from its folder)")
    if cfg.log_dir is not None:
        writable_folder(Path(cfg.log_dir), f"--log-dir {cfg.log_dir}", create=True)
    if not cfg.module and not Path(cfg.script).is_file():
        raise ValueError(f"script {cfg.script!r} does not exist (run from the folder that holds "
                         f"it, or give its path; use -m for a module)")
    if cfg.nnodes > 1 and not cfg.rdzv_endpoint:
        raise ValueError(f"--nnodes {cfg.nnodes} needs --rdzv-endpoint HOST:PORT (the same on "
                         f"every node)")
    if cfg.rdzv_endpoint:
        host, _, port = cfg.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--rdzv-endpoint {cfg.rdzv_endpoint!r} must be HOST:PORT, e.g. "
                             f"--rdzv-endpoint gpu01:29400 (the same on every node)")
        if not 0 < int(port) < 65536:
            raise ValueError(f"--rdzv-endpoint {cfg.rdzv_endpoint}: port {port} is not in "
                             f"1..65535")
        local = host in ("127.0.0.1", "localhost", socket.gethostname())
        if local and cfg.node_rank == 0 and _port_in_use("127.0.0.1", int(port)):
            raise ValueError(f"port {port} on {host} is already in use; pick another with "
                             f"--rdzv-endpoint {host}:PORT, or leave it out for a free one")
    plan_text = plan_from_argv(list(cfg.script_args))
    acc = _script_accelerator(cfg)
    if plan_text is not None and plan_text != "auto":  # auto is chosen with the model
        plan = Plan.load(plan_text)
        if acc is not None and acc.spmd:  # XLA: degrees count devices, checked at init
            from .parallel.xla_spmd import plan_problems

            if plan_problems(plan):
                raise ValueError("plan cannot run on XLA: " + "; ".join(plan_problems(plan)))
        else:
            plan.validate(cfg.nproc * cfg.nnodes)


def _script_accelerator(cfg: LaunchConfig) -> Accelerator | None:
    """The accelerator the script's ``--accelerator`` names, checked before anything starts."""
    name = accelerator_from_argv(list(cfg.script_args))
    if name is None:
        return None
    from .accelerators import get_accelerator

    acc = get_accelerator(name)  # ValueError: why it is missing, and `plait doctor`
    if acc.spmd and cfg.nproc != 1:
        raise ValueError(f"--nproc {cfg.nproc} with --accelerator {name}: under XLA SPMD one "
                         f"process per host drives all of its devices; use --nproc 1 (and "
                         f"--nnodes for more hosts)")
    return acc


def torchrun_args(cfg: LaunchConfig, log_dir: str) -> list[str]:
    args = [f"--nproc-per-node={cfg.nproc}", f"--nnodes={cfg.nnodes}",
            f"--max-restarts={cfg.max_restarts}", f"--log-dir={log_dir}",
            "--redirects=3", "--tee=3", "--local-ranks-filter=0"]
    if cfg.rdzv_endpoint:
        args += [f"--node-rank={cfg.node_rank}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={cfg.rdzv_endpoint}",
                 f"--rdzv-conf=join_timeout={max(1, round(cfg.rdzv_timeout))}"]
    else:  # plait.torchrun binds a free loopback port and puts it in place of the 0
        args += ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
    if cfg.module:
        args.append("-m")
    # "--": the script's arguments are never read as torchrun's. torchrun takes them as the
    # rest of its command line, yet its argparse still looks at each "--x" first and refuses
    # one that abbreviates two of its flags ("--nproc", "--max", "--log": "ambiguous option").
    return args + ["--", cfg.script, *script_argv(cfg)]


def script_argv(cfg: LaunchConfig) -> list[str]:
    """The script's arguments: the user's, and ``--format json`` when the launch asks for
    JSON and they do not already say it (how ``plait.init`` in the script learns it: an
    argument, as ``--plan`` is)."""
    args = list(cfg.script_args)
    if cfg.format == "json" and format_from_argv(args) != "json":
        args += ["--format", "json"]
    return args


def output_format(own: str | None, script_args: list[str]) -> str:
    """The format of a run: ``plait run``'s own ``--format``, else the script's (``plait run
    train.py --format json`` asks for JSON as ``plait run --format json train.py`` does)."""
    return own or format_from_argv(script_args) or "text"


_PREFIX = re.compile(r"^\[[^\]]*\d+\]:")
# torch's excepthook writes a rank's uncaught exception with this prefix on every line.
_EXCEPTION_LINE = re.compile(r"^\[rank\d+\]: ?")


def _pump(stream, out, keep: list[str], held: list[str] | None = None,
          events: bool = False) -> None:
    """Echo rank 0's tee'd lines without torchrun's ``[default0]:`` prefix; keep the rest.

    ``events`` (``--format json``, on stdout): each line as an event (plait.outputs.as_event),
    so that what the script prints itself does not break the JSON Lines; a worker's own
    ``error`` event is left out (the launcher ends the run with its own).

    ``held``: rank 0's uncaught-exception lines go there instead of the screen. When another
    rank fails first, rank 0's exception is a consequence (its peer closed the connection),
    and the failure report shows the rank that caused it; when rank 0 is the cause, the report
    shows rank 0's traceback."""
    holding = False  # inside an uncaught exception's lines: from its "[rankN]: Traceback"
    for line in iter(stream.readline, ""):
        found = _PREFIX.match(line)
        if found:
            # torchrun's tail reads a log line that is still being written in pieces and heads
            # each piece ("...ETA 0:00:02[default0]:\n"): the rank's header inside the line goes.
            text = line[found.end():].replace(found.group(0), "")
            if held is not None:
                if _EXCEPTION_LINE.sub("", text, count=1).startswith("Traceback ("):
                    holding = holding or bool(_EXCEPTION_LINE.match(text))
                holding = holding and (bool(_EXCEPTION_LINE.match(text)) or not text.strip())
                if holding:
                    held.append(text)
                    continue
            if events:
                text = as_event(text)
                if text.startswith('{"event": "error"'):
                    # the worker's own (plait.json_stdout): the launcher's error event, which
                    # names the rank that failed first, is the run's last line
                    continue
                text += "\n"
            out.write(text)
            out.flush()
        else:
            keep.append(line)
    stream.close()


def _attempts(log_dir: str) -> list[Path]:
    """torchrun's per-attempt log folders (``<run>/attempt_N``), in order."""
    found = [p for p in Path(log_dir).glob("*/attempt_*") if p.name[8:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[8:]))


def _failures(log_dir: str) -> list[tuple[int, str]]:
    """(local rank, traceback) of each failed worker of the last attempt, from the per-rank
    error/stderr logs."""
    attempts = _attempts(log_dir)
    where = attempts[-1] if attempts else Path(log_dir)
    found: dict[int, str] = {}
    for path in where.rglob("error.json"):
        try:
            data = json.loads(path.read_text())
            msg = data["message"]
            text = msg.get("extraInfo", {}).get("py_callstack") if isinstance(msg, dict) else msg
            found[int(path.parent.name)] = text or str(msg)
        except (ValueError, KeyError, OSError):
            continue
    for path in where.rglob("stderr.log"):
        rank = int(path.parent.name) if path.parent.name.isdigit() else -1
        if rank in found:
            continue
        text = path.read_text(errors="replace")
        if "Traceback (most recent call last)" in text:
            found[rank] = text[text.rindex("Traceback (most recent call last)"):]
        elif (crash := native_crash_stack(text)) is not None:
            found[rank] = crash
        elif (said := _error_line(text)) is not None:
            found[rank] = said
    return sorted(found.items())


def _error_line(text: str) -> str | None:
    """The one-line refusal a rank ended with instead of a traceback: its argparse's
    (``train.py: error: unrecognized arguments: --format json``) or plait.init's (``plait:
    error: ...``), when that is the last line of its stderr; else None."""
    lines = [line for line in text.splitlines() if line.strip()]
    last = _EXCEPTION_LINE.sub("", lines[-1]) if lines else ""
    return last if re.match(r"[\w./-]+: error: ", last) else None


def native_crash_stack(text: str) -> str | None:
    """The Python stack a rank died in, from the ``faulthandler`` dump in its stderr (a crash
    in native code leaves no traceback): the ``Fatal Python error`` line and the frames of the
    thread that crashed, most recent first; None without a dump."""
    start = text.rfind("Fatal Python error:")
    if start < 0:
        return None
    dump = text[start:]
    head = dump.splitlines()[0]
    current = dump.find("Current thread")
    if current < 0:
        return head
    frames = dump[current:].split("\n\n", 1)[0].rstrip()
    return f"{head}\n{frames}"


# Errors a rank raises because *another* rank died (its peer closed the connection): they are
# consequences, not the cause, and are not the traceback the user needs to see.
_CONSEQUENCES = ("Connection closed by peer", "remote worker crashing", "Connection reset by peer",
                 "communicator was aborted", "Broken pipe")


def root_cause(failures: list[tuple[int, str]]) -> tuple[int, str] | None:
    """The failure to show: the lowest rank whose error is not a consequence of another's."""
    for rank, tb in failures:
        if not any(marker in tb for marker in _CONSEQUENCES):
            return rank, tb
    return failures[0] if failures else None


def describe_exit(record: dict) -> str:
    """``exit code 3`` or ``killed by SIGKILL`` for one of plait.torchrun's failure records."""
    if record.get("signal"):
        return f"killed by {record['signal']}"
    return f"exit code {record.get('exitcode')}"


def _raised(traceback: str) -> str | None:
    """The line that names the raised exception: the first unindented one after the last frame
    (a message of several lines, such as torch's "Could not run 'aten::...'" listing a dispatch
    key per line, ends with lines of its own, and a note added to it comes after it too); None
    when the text holds no frame."""
    lines = [_EXCEPTION_LINE.sub("", line, count=1).rstrip() for line in traceback.splitlines()]
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    after = lines[frames[-1] + 1:] if frames else []
    return next((line for line in after if line and not line[0].isspace()), None)


def exception_name(traceback: str) -> str | None:
    """The exception's class name (``CheckpointError`` from ``plait.checkpoint.errors.
    CheckpointError: ...``), or None when the traceback names none."""
    last = _raised(traceback) or next(
        (_EXCEPTION_LINE.sub("", line).strip() for line in reversed(traceback.splitlines())
         if _EXCEPTION_LINE.sub("", line).strip()), "")
    name = last.split(":", 1)[0].rsplit(".", 1)[-1]
    # "NoneType: None" is what a report recorded outside an exception (the watchdog's) holds.
    ok = name.isidentifier() and name[0].isupper() and name != "NoneType"
    return name if ok else None


def exception_line(traceback: str, limit: int = 300) -> str | None:
    """The raised exception as its traceback's own line says it (``ValueError: the learning
    rate 5 is too big``), cut at ``limit`` characters, so that the run's last line carries the
    message and not only the exception's name. None when the text holds no frame (a watchdog's
    report) or its last frame raised nothing (a native crash's stack)."""
    said = _raised(traceback)
    if said is None or exception_name(said) is None:
        return None
    return said if len(said) <= limit else said[:limit - 3] + "..."


def failure_summary(records: list[dict], tracebacks: dict[int, str]) -> tuple[int | None, str]:
    """(the rank that failed first, one line naming every failed rank and how it ended).

    torchrun stops the other workers with SIGTERM once one fails: those are listed as stopped,
    not as failures, unless they had raised an error of their own first (the same error on
    every rank: a bad checkpoint, a bad argument). Each failed rank is named with its
    exception and how its process ended (``CheckpointError, exit code 1``; a native abort
    while exiting after it shows as ``CheckpointError, then killed by SIGABRT``, torchrun's
    SIGTERM reaching it while it exits as ``CheckpointError, stopped while exiting``); a rank
    without a traceback (``sys.exit(3)``, ``os._exit``, a signal) by its exit code or signal.
    A rank that exited on losing its peer (the failed rank's connection closed under it) is
    listed after the failure, whichever of the two exited first.
    """
    if not records:
        return None, ""

    def own_error(r: dict) -> bool:
        tb = tracebacks.get(r["rank"])
        return tb is not None and not any(m in tb for m in _CONSEQUENCES)

    def lost_peer(r: dict) -> bool:
        tb = tracebacks.get(r["rank"])
        return tb is not None and not own_error(r)

    # A rank whose error says its peer went away (gloo's "Connection closed by peer") failed
    # because another did; when it exits before torchrun stops it is a matter of timing.
    causes = [r for r in records if (r.get("signal") != "SIGTERM" or own_error(r))
              and not lost_peer(r)] or records
    with_tb = [r for r in causes if own_error(r)]
    first = (with_tb or [r for r in causes if r["rank"] not in tracebacks] or causes)[0]
    parts = []
    for r in causes:
        name = exception_name(tracebacks[r["rank"]]) if r["rank"] in tracebacks else None
        if name is None:
            how = describe_exit(r) + ("" if r["rank"] in tracebacks else ", no traceback")
        elif r.get("signal") == "SIGTERM":
            # torchrun stopping the job after another rank's failure, while this one exited
            # on its own error: when it lands is a matter of timing, not a second fault.
            how = f"{name}, stopped while exiting"
        elif r.get("signal"):
            how = f"{name}, then {describe_exit(r)}"
        else:
            how = f"{name}, {describe_exit(r)}"
        parts.append(f"rank {r['rank']} ({how})")
    after = sorted(r["rank"] for r in records
                   if r not in causes and lost_peer(r) and r.get("signal") != "SIGTERM")
    stopped = sorted(r["rank"] for r in records if r not in causes and r["rank"] not in after)
    line = "failed: " + ", ".join(parts)
    if after:
        line += f"; then lost the connection to it: rank(s) {after}"
    if stopped:
        line += f"; then stopped: rank(s) {stopped}"
    return first["rank"], line


# What signal.signal takes and returns (typeshed's own name for it is private).
_SignalHandler: TypeAlias = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class _Forwarder:
    """Ctrl-C, SIGTERM and SIGHUP to ``plait run`` stop the whole job, then it exits.

    torchrun runs in its own session (so a terminal's Ctrl-C reaches only ``plait run``, once):
    the first signal is passed on to it as SIGTERM, on which torchrun sends SIGTERM to its
    workers, waits up to 30 s for them (time for a final checkpoint) and exits. If it is still
    running ``grace`` seconds later, or a second signal arrives, its workers' process groups
    and torchrun itself are killed. A signal that was ignored when ``plait run`` started
    (``nohup`` ignores SIGHUP) stays ignored.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, proc: subprocess.Popen, grace: float = 40.0):
        self.proc = proc
        self.grace = grace
        self.signum: int | None = None
        self.started = 0.0
        self.workers: list[int] = []  # torchrun's children when the signal came
        self._previous: dict[int, _SignalHandler] = {}

    def __enter__(self) -> _Forwarder:
        for sig in self.SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            self._kill()
            return
        self.signum = signum
        self.started = time.monotonic()
        self.workers = children(self.proc.pid)
        try:
            self.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            return
        timer = threading.Timer(self.grace, self._kill)
        timer.daemon = True
        timer.start()

    def _kill(self) -> None:
        """SIGKILL torchrun's workers (each in its own session) and torchrun."""
        for pid in {*children(self.proc.pid), *self.workers}:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def reap(self) -> None:
        """After torchrun ended on a forwarded signal: SIGKILL what is left of the workers it
        had then (a worker torchrun failed to stop would keep the output pipes open, and
        ``plait run`` would wait on them for ever)."""
        for pid in self.workers:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)


def launch(cfg: LaunchConfig) -> int:
    """Start the job; return its exit code (0 when every worker succeeded)."""
    validate(cfg)
    if accelerator_from_argv(list(cfg.script_args)) == "tpu":
        from .accelerators.tpu import TPUAccelerator

        TPUAccelerator.prepare_launch(cfg.nnodes, cfg.nproc)
    own_logs = cfg.log_dir is None
    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="plait-run-")
    report = os.path.join(log_dir, f"plait-failures-{os.getpid()}.json")
    env = {**os.environ, **cfg.extra_env, "PYTHONUNBUFFERED": "1"}
    lo = loopback_interface()
    if cfg.nnodes == 1 and lo is not None:
        # One node: gloo's sockets listen on 127.0.0.1 only (torch's one way to say so, see
        # plait.store.loopback_interface).
        env["GLOO_SOCKET_IFNAME"] = lo
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    # A rank that dies in native code (a segfault, an abort in a collective) writes the Python
    # stack it died in to its log, beside the exit code torchrun reports.
    env.setdefault("PYTHONFAULTHANDLER", "1")
    cmd = [sys.executable, "-m", "plait.torchrun", str(os.getpid()), report,
           *torchrun_args(cfg, log_dir)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1, start_new_session=True)
    kept_out: list[str] = []
    kept_err: list[str] = []
    # Rank 0's uncaught exception: shown by _explain_failure when rank 0 caused the failure;
    # after a restart that then finished, it was a failed attempt's, kept in that attempt's log.
    held: list[str] = []
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, sys.stdout, kept_out, None,
                                                  cfg.format == "json")),
             threading.Thread(target=_pump, args=(proc.stderr, sys.stderr, kept_err, held))]
    for t in pumps:
        t.start()
    waiting = None
    if cfg.nnodes > 1:
        waiting = threading.Thread(target=_report_waiting, args=(cfg, log_dir, proc),
                                   daemon=True)
        waiting.start()
    with _Forwarder(proc) as forward:
        code = proc.wait()
    if forward.signum is not None:
        forward.reap()
    for t in pumps:
        t.join()
    restarts = max(0, len(_attempts(log_dir)) - 1)
    if forward.signum is not None:
        name = signal.Signals(forward.signum).name
        sys.stderr.write(f"plait run: stopped by {name}; every worker ended "
                         f"{time.monotonic() - forward.started:.1f} s later\n")
        _error_event(cfg, f"stopped by {name}", 128 + forward.signum)
        shutil.rmtree(log_dir, ignore_errors=True) if own_logs else None
        return 128 + forward.signum
    if code != 0:
        said, rank, tb = _explain_failure(cfg, log_dir, report, kept_err + held, code,
                                          rank0_held=bool(held))
        _error_event(cfg, said, code, rank=rank, traceback=tb, log_dir=log_dir)
        own_logs = False
    elif held and not restarts:  # an exception that did not fail the job: shown as it came
        sys.stderr.write("".join(held))
    elif restarts:
        redone = steps_redone(_attempts(log_dir))
        detail = "" if redone is None else (f"; {redone[0]} step(s) redone ("
                                            + "; ".join(redone[1]) + ")")
        sys.stderr.write(f"plait run: finished after {restarts} restart(s){detail}; "
                         f"per-attempt logs in {log_dir}\n")
        own_logs = False
    if own_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    return code


def _report_waiting(cfg: LaunchConfig, log_dir: str, proc: subprocess.Popen,
                    every: float = 15.0) -> None:
    """Multi-node: say that the job waits for the other nodes, until its workers start."""
    start = time.monotonic()
    while proc.poll() is None and not _attempts(log_dir):
        time.sleep(1.0)
        waited = time.monotonic() - start
        if waited >= every and int(waited) % int(every) == 0:
            sys.stderr.write(f"plait run: node {cfg.node_rank} waits for the other "
                             f"{cfg.nnodes - 1} node(s) to join at {cfg.rdzv_endpoint} "
                             f"({waited:.0f} s of --rdzv-timeout {cfg.rdzv_timeout:g})\n")
            sys.stderr.flush()


def _error_event(cfg: LaunchConfig, message: str, code: int, **fields: object) -> None:
    """``--format json``: the run's last line, an ``error`` event (exit code, and where known
    the rank that failed first and the per-rank logs)."""
    if cfg.format == "json":
        command = "demo" if cfg.script == "plait.demo" and cfg.module else "run"
        print(json_error(command, message, code, **fields), flush=True)


def _explain_failure(cfg: LaunchConfig, log_dir: str, report: str, kept_err: list[str],
                     code: int, rank0_held: bool = False
                     ) -> tuple[str, int | None, str | None]:
    """Print the root cause's traceback once and one line naming every failed rank. Rank 0's
    traceback was shown live unless it came through torch's excepthook (``rank0_held``).
    Returns that line (without ``plait run: ``), the rank that failed first and its traceback
    (each None when not known)."""
    try:
        records = json.loads(Path(report).read_text())
    except (OSError, ValueError):
        records = []
    if isinstance(records, dict):  # the launcher itself failed (rendezvous, endpoint)
        error = str(records.get("launcher_error"))
        if error.startswith("RendezvousTimeoutError"):
            error = (f"the other node(s) did not join at {cfg.rdzv_endpoint} within "
                     f"--rdzv-timeout {cfg.rdzv_timeout:g} s; start the same command on every "
                     f"node (--nnodes {cfg.nnodes}, --node-rank 0..{cfg.nnodes - 1})")
        said = error.splitlines()[0] if error else error
        sys.stderr.write(f"plait run: {said}\n")
        return said, None, None
    tracebacks = dict(_failures(log_dir))
    first, line = failure_summary(records, tracebacks)
    if first is None:  # no report: show the end of torchrun's own output
        root = root_cause(sorted(tracebacks.items()))
        first = root[0] if root else None
    tb = None
    if first is not None and first in tracebacks:
        tb = re.sub(r"(?m)^\[rank\d+\]: ?", "", tracebacks[first]).rstrip()  # torch's prefix
    if tb is not None and (first != 0 or rank0_held):
        sys.stderr.write(f"\n--- rank {first} failed ---\n{tb.rstrip()}\n")
    if not line and tracebacks:
        line = f"worker(s) {sorted(tracebacks)} failed (exit {code})"
    elif not line:
        sys.stderr.write("".join(kept_err[-40:]))
        line = f"torchrun exited with {code}"
    raised = exception_line(tb) if tb is not None else None
    if raised is not None:  # the message itself, on the line a log's tail or CI shows
        line = f"{line}; rank {first}: {raised}"
    sys.stderr.write(f"plait run: {line}; per-rank logs in {log_dir}\n")
    return line, first, tb


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="processes per node (default: the number of GPUs, else 1)")
    parser.add_argument("--nnodes", type=int, default=None, metavar="N",
                        help="nodes (machines) in the job (default: 1, or SLURM's)")
    parser.add_argument("--node-rank", type=int, default=None, metavar="I",
                        help="this node's index, 0 to --nnodes - 1 (default: 0, or SLURM's)")
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="rendezvous address for multi-node jobs (default: local, free port)")
    parser.add_argument("--rdzv-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="multi-node: seconds to wait for every node to join (default: "
                             "600)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="times to restart the whole group on failure (default: 0)")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="keep every rank's stdout/stderr here (default: temporary, removed "
                             "after a successful run)")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="treat the script as a Python module (like python -m)")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="text for people, json for programs: JSON Lines on stdout, one "
                        "event per line; the script gets --format json, which plait.init "
                        "reads (default: text, or the script's own --format)")
    parser.add_argument("script", help="training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments for the script, e.g. --plan dp=2,tp=2")


def command(args: argparse.Namespace) -> int:
    slurm = slurm_defaults(dict(os.environ))
    nproc = args.nproc
    if nproc is None:
        from .accelerators import get_accelerator

        acc = get_accelerator()
        nproc = acc.device_count() if acc.name != "cpu" else 1
    nnodes = args.nnodes if args.nnodes is not None else slurm.get("nnodes", 1)
    # said by the failure line of plait.cli too, in JSON when either asks for it
    args.format = output_format(args.format, list(args.script_args))
    cfg = LaunchConfig(script=args.script, script_args=tuple(args.script_args), nproc=nproc,
                       nnodes=nnodes,
                       node_rank=(args.node_rank if args.node_rank is not None
                                  else slurm.get("node_rank", 0)),
                       rdzv_endpoint=args.rdzv_endpoint or (slurm.get("rdzv_endpoint")
                                                             if nnodes > 1 else None),
                       max_restarts=args.max_restarts, module=args.module,
                       rdzv_timeout=args.rdzv_timeout,
                       log_dir=args.log_dir, format=args.format)
    return launch(cfg)
