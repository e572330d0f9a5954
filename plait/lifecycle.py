"""How a worker process joins a job and leaves it.

* ``die_with_parent``: a worker (or torchrun) whose launcher is killed, even with SIGKILL, gets
  SIGTERM instead of training on as an orphan.
* ``job_store``: the store a worker of a single-node torchrun job joins, on 127.0.0.1 only, and
  one per restart attempt.
* ``StopRequest``: SIGTERM (a cluster's preemption notice) or Ctrl-C becomes a request that the
  training loop honours at the next step boundary, all ranks at the same step, so that a final
  checkpoint can be written; a second signal, or the grace period running out, ends the process
  at once.
* ``node_note``: on a multi-node job, the line a node whose workers do not include rank 0
  prints, so that its terminal does not look hung.
* ``children`` / ``descendants`` / ``running``: a job's process tree, to stop it and to check
  that nothing of it outlived a stop (Linux ``/proc``).

Only the variables torchrun defines for its workers are read (``TORCHELASTIC_*``, ``MASTER_*``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .store import LOOPBACK, loopback_store

if TYPE_CHECKING:
    import torch.distributed as dist

_PR_SET_PDEATHSIG = 1
ATTEMPT_FILE = "plait-steps.json"


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGTERM) -> None:
    """Get ``sig`` when the parent process exits; at once if it already has.

    ``parent_pid`` is the direct parent by default. Linux delivers the signal itself when the
    direct parent dies (``PR_SET_PDEATHSIG``). Another process (a worker forked by a fork server
    watches the caller that asked for it, not the server) is watched by a daemon thread: on
    Linux it waits on a pidfd, which wakes it the moment that process exits; elsewhere (or on a
    kernel without pidfds) it checks once a second.
    """
    direct = os.getppid()
    parent = direct if parent_pid is None else parent_pid
    if parent == direct and sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # it died before the watch was set up
            os.kill(os.getpid(), sig)
        return
    fd = None
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(parent)
        except ProcessLookupError:  # already gone
            os.kill(os.getpid(), sig)
            return
        except OSError:  # a kernel without pidfds (Linux before 5.3): poll instead
            fd = None

    def wait() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has exited
        else:
            while _exists(parent):
                time.sleep(1.0)
        os.kill(os.getpid(), sig)

    threading.Thread(target=wait, name="plait-parent-watch", daemon=True).start()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every process (Linux /proc; empty elsewhere)."""
    out = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            out[int(entry.parent.name)] = int(entry.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (Linux /proc; empty elsewhere)."""
    return [child for child, parent in _parents().items() if parent == pid]


def descendants(pid: int) -> list[int]:
    """Every process started under ``pid``, at any depth (Linux /proc; empty elsewhere)."""
    kids: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        kids.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        found = kids.get(todo.pop(), [])
        out += found
        todo += found
    return out


def running(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running: neither gone nor a zombie (Linux /proc)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            out.append(pid)
    return out


def under_torchrun(env: Mapping[str, str]) -> bool:
    return "TORCHELASTIC_RUN_ID" in env


def job_store(rank: int, world_size: int, env: Mapping[str, str],
              timeout: timedelta = timedelta(seconds=300)) -> dist.Store | None:
    """The store for ``init_process_group`` under torchrun, or None for torch's own env://.

    * torchrun sharing its agent's store with the workers (plain ``torchrun``; torch 2.13 keeps
      that store across restarts): the keys of each restart attempt get their own prefix, so the
      ranks of a restarted group do not read the dead ranks' addresses.
    * worker rank 0 hosting the store (``plait run``) on a single node: it listens on
      127.0.0.1 only, and every rank connects there whatever name MASTER_ADDR gives the host.
    """
    if not under_torchrun(env) or "MASTER_PORT" not in env:
        return None
    import torch.distributed as dist  # here: `plait run`'s launcher never imports torch

    port = int(env["MASTER_PORT"])
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        client = dist.TCPStore(env["MASTER_ADDR"], port, world_size, is_master=False,
                               timeout=timeout)
        return dist.PrefixStore(f"/plait/attempt_{attempt}", client)
    if env.get("LOCAL_WORLD_SIZE") != str(world_size):
        return None  # several nodes: the store must be reachable from the others
    if rank == 0:
        return loopback_store(port, world_size, timeout=timeout)
    return dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=timeout)


def node_note(rank: int, world_size: int, env: Mapping[str, str], host: str) -> str | None:
    """What the first worker of a node without rank 0 says once at start, else None.

    Only rank 0 prints progress, the run summary and the ledger, and torchrun's c10d rendezvous
    numbers the nodes by host name and process id, not by ``--node-rank``: the terminal a user
    watches may hold no rank 0 and would stay silent for the whole run."""
    local = int(env.get("LOCAL_WORLD_SIZE", str(world_size)))
    if rank == 0 or local >= world_size or int(env.get("LOCAL_RANK", "0")) != 0:
        return None
    where = env.get("MASTER_ADDR", "another node")
    ranks = f"rank {rank}" if local == 1 else f"ranks {rank}..{rank + local - 1}"
    return (f"plait: this node ({host}) runs {ranks} of {world_size}; "
            f"rank 0 runs on {where} and prints the progress, the run summary and the ledger "
            f"there (torchrun numbers the nodes by host name, not by --node-rank)")


class AttemptRecord:
    """The steps one attempt of a restarted job ran: ``{"first": F, "last": L}``, kept by global
    rank 0 in torchrun's log folder for this attempt (beside the error file torchrun names), so
    that ``plait run`` can say how many steps a restart redid. Only with ``--max-restarts``."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def for_worker(cls, rank: int, env: Mapping[str, str]) -> AttemptRecord | None:
        if rank != 0 or int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) < 1 \
                or "TORCHELASTIC_ERROR_FILE" not in env:
            return None
        return cls(Path(env["TORCHELASTIC_ERROR_FILE"]).parent / ATTEMPT_FILE)

    def write(self, first: int, last: int) -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"first": first, "last": last}))
            os.replace(tmp, self.path)  # a kill -9 mid-write leaves the previous record
        except OSError:
            pass


def steps_redone(attempt_dirs: list[Path]) -> tuple[int, list[str]] | None:
    """From each attempt's record (global rank 0's local folder ``0``): the steps redone over
    all restarts, and a phrase per restart; None without records."""
    records = []
    for folder in attempt_dirs:
        try:
            records.append(json.loads((folder / "0" / ATTEMPT_FILE).read_text()))
        except (OSError, ValueError):
            records.append(None)
    if len(records) < 2 or any(r is None for r in records):
        return None
    total, phrases = 0, []
    for before, after in zip(records, records[1:], strict=False):
        total += max(0, before["last"] - after["first"])
        phrases.append(f"attempt reached step {before['last']}, the next resumed at step "
                       f"{after['first']}")
    return total, phrases


class StopRequest:
    """A SIGTERM and SIGINT handler that asks the training loop to stop at the next step boundary.

    ``requested`` turns True on the first signal, ``signum`` says which; a thread then ends the
    process with exit code 128 + the signal if it is still alive after ``grace`` seconds
    (torchrun kills its workers 30 s after its own SIGTERM). A second signal ends it at once.
    SIGINT is taken only where Python's own Ctrl-C handler is in place (a terminal's foreground
    job), not where it is ignored (a background job, ``plait run``'s workers): there Ctrl-C
    would otherwise raise KeyboardInterrupt wherever the step was, a save included.
    The deadline is called off by :meth:`uninstall` (the run reached its stop and closed): a
    process that lives on after the run (a notebook's kernel, a script that catches the
    ``SystemExit``) is not ended under it.
    """

    def __init__(self, grace: float = 25.0):
        self.grace = grace
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._closed = threading.Event()

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle)
        return self

    def uninstall(self) -> None:
        self._closed.set()
        if self._previous and threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
            self._previous = {}

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            os._exit(128 + signum)
        self.requested = True
        self.signum = signum
        if signum == signal.SIGINT:  # someone at a terminal: say what happens, and how to hurry
            os.write(2, f"plait: Ctrl-C: stopping after this step with a final checkpoint "
                        f"(at most {self.grace:g} s); Ctrl-C again stops at once\n".encode())

        def deadline() -> None:
            if not self._closed.wait(self.grace):
                os._exit(128 + signum)

        threading.Thread(target=deadline, name="plait-stop-deadline", daemon=True).start()
