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

Everything else (restarts, multi-node rendezvous, worker monitoring) is torchrun's.
"""

from __future__ import annotations

import argparse
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
from dataclasses import dataclass, field
from pathlib import Path

from .accelerators import Accelerator
from .plan import Plan
from .runtime import accelerator_from_argv, plan_from_argv


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
    extra_env: dict[str, str] = field(default_factory=dict)


def slurm_defaults(env: dict[str, str]) -> dict[str, object]:
    """Nodes, node rank and rendezvous host from a SLURM allocation (empty outside one)."""
    if "SLURM_JOB_ID" not in env or "SLURM_NNODES" not in env:
        return {}
    out: dict[str, object] = {"nnodes": int(env["SLURM_NNODES"]),
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


def validate(cfg: LaunchConfig) -> None:
    """Raise ValueError with one clear line for anything that would fail after launch."""
    if cfg.nproc < 1:
        raise ValueError(f"--nproc {cfg.nproc}: need at least 1 process per node")
    if cfg.nnodes < 1:
        raise ValueError(f"--nnodes {cfg.nnodes}: need at least 1 node")
    if not 0 <= cfg.node_rank < cfg.nnodes:
        raise ValueError(f"--node-rank {cfg.node_rank} must be in [0, {cfg.nnodes - 1}]")
    if cfg.max_restarts < 0:
        raise ValueError(f"--max-restarts {cfg.max_restarts} must be >= 0")
    if not cfg.module and not Path(cfg.script).is_file():
        raise ValueError(f"script {cfg.script!r} does not exist (run from the folder that holds "
                         f"it, or give its path; use -m for a module)")
    if cfg.nnodes > 1 and not cfg.rdzv_endpoint:
        raise ValueError(f"--nnodes {cfg.nnodes} needs --rdzv-endpoint HOST:PORT (the same on "
                         f"every node)")
    if cfg.rdzv_endpoint:
        host, _, port = cfg.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--rdzv-endpoint {cfg.rdzv_endpoint!r} must be HOST:PORT")
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
                 f"--rdzv-endpoint={cfg.rdzv_endpoint}"]
    else:
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}"]
    if cfg.module:
        args.append("-m")
    return args + [cfg.script, *cfg.script_args]


_PREFIX = re.compile(r"^\[[^\]]*\d+\]:")


def _pump(stream, out, keep: list[str]) -> None:
    """Echo rank 0's tee'd lines without torchrun's ``[default0]:`` prefix; keep the rest."""
    for line in iter(stream.readline, ""):
        if _PREFIX.match(line):
            out.write(_PREFIX.sub("", line, count=1))
            out.flush()
        else:
            keep.append(line)
    stream.close()


def _failures(log_dir: str) -> list[tuple[int, str]]:
    """(global rank, traceback) of each failed worker, from the per-rank error/stderr logs."""
    found: dict[int, str] = {}
    for path in Path(log_dir).rglob("error.json"):
        try:
            data = json.loads(path.read_text())
            msg = data["message"]
            text = msg.get("extraInfo", {}).get("py_callstack") if isinstance(msg, dict) else msg
            found[int(path.parent.name)] = text or str(msg)
        except (ValueError, KeyError, OSError):
            continue
    for path in Path(log_dir).rglob("stderr.log"):
        rank = int(path.parent.name) if path.parent.name.isdigit() else -1
        if rank in found:
            continue
        text = path.read_text(errors="replace")
        if "Traceback (most recent call last)" in text:
            found[rank] = text[text.rindex("Traceback (most recent call last)"):]
    return sorted(found.items())


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


def launch(cfg: LaunchConfig) -> int:
    """Start the job; return its exit code (0 when every worker succeeded)."""
    validate(cfg)
    if accelerator_from_argv(list(cfg.script_args)) == "tpu":
        from .accelerators.tpu import TPUAccelerator

        TPUAccelerator.prepare_launch(cfg.nnodes, cfg.nproc)
    own_logs = cfg.log_dir is None
    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="plait-run-")
    env = {**os.environ, **cfg.extra_env, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(cfg, log_dir)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1, start_new_session=True)
    kept_out: list[str] = []
    kept_err: list[str] = []
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, sys.stdout, kept_out)),
             threading.Thread(target=_pump, args=(proc.stderr, sys.stderr, kept_err))]
    for t in pumps:
        t.start()
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun forwards it to the workers
        code = proc.wait()
    for t in pumps:
        t.join()
    if code != 0:
        failures = _failures(log_dir)
        root = root_cause(failures)
        if root is not None and root[0] != 0:  # rank 0's traceback was already echoed live
            rank, tb = root
            tb = re.sub(r"(?m)^\[rank\d+\]: ?", "", tb)  # torch's per-line rank prefix
            sys.stderr.write(f"\n--- rank {rank} failed ---\n{tb.rstrip()}\n")
        ranks = [r for r, _ in failures]
        if ranks:
            sys.stderr.write(f"plait run: worker(s) {ranks} failed (exit {code}); "
                             f"per-rank logs in {log_dir}\n")
            own_logs = False
        else:
            sys.stderr.write("".join(kept_err[-40:]))
            sys.stderr.write(f"plait run: torchrun exited with {code}; per-rank logs in "
                             f"{log_dir}\n")
            own_logs = False
    if own_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    return code


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes per node (default: the number of GPUs, else 1)")
    parser.add_argument("--nnodes", type=int, default=None, help="nodes (default: 1, or SLURM's)")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's index")
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="rendezvous address for multi-node jobs (default: local, free port)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the whole group this many times on failure (default: 0)")
    parser.add_argument("--log-dir", default=None,
                        help="keep every rank's stdout/stderr here (default: temporary, removed "
                             "after a successful run)")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="treat the script as a Python module (like python -m)")
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
    nnodes = args.nnodes or int(slurm.get("nnodes", 1))
    cfg = LaunchConfig(script=args.script, script_args=tuple(args.script_args), nproc=nproc,
                       nnodes=nnodes,
                       node_rank=(args.node_rank if args.node_rank is not None
                                  else int(slurm.get("node_rank", 0))),
                       rdzv_endpoint=args.rdzv_endpoint or (slurm.get("rdzv_endpoint")
                                                             if nnodes > 1 else None),
                       max_restarts=args.max_restarts, module=args.module,
                       log_dir=args.log_dir)
    return launch(cfg)
