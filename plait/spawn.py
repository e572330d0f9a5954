"""Run a function on N local processes in a real process group, with a hard timeout.

Used by the test suite, `plait check`, `plait comm` and the benchmarks: every multi-process
thing plait does on one machine without torchrun goes through here, so a hang anywhere becomes a
``TimeoutError`` naming the stuck ranks instead of a stalled CI job.

Why not ``torch.multiprocessing.spawn``: it has no timeout, and a rank stuck in a collective
stalls it forever. Here the parent hosts the rendezvous store itself (``TCPStore`` on port 0, so
the OS picks a free port and there is no race for it), waits with a deadline, and kills the
whole group when any rank fails or time runs out.

Workers start from a fork server that has imported torch once (``forkserver`` on Linux;
``spawn`` elsewhere): a fresh interpreter importing torch costs seconds of CPU per rank,
which on a 2-core machine is most of a short job. The server is a clean process that has run
no torch op and started no thread pool, so forking it is as safe as a fresh start; each worker
is handed the caller's environment as it is at the call, as ``spawn`` would give it.

Workers leave with ``os._exit`` after reporting: a DDP reducer still alive at interpreter
teardown can deadlock on the GIL (its teardown joins a gloo thread that is waiting for the GIL;
on a 2-core machine this hangs a few exits in a dozen), and a worker that has reported has nothing
left to do.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, NamedTuple

from .lifecycle import die_with_parent
from .store import loopback_interface, loopback_store

HOST = "127.0.0.1"  # the store listens here only (plait.store)


class WorkerError(RuntimeError):
    """A worker raised; carries the rank, its formatted traceback and, when the rank raised a
    Python exception, that exception's type name and message (sent by the worker beside the
    traceback, so nothing has to be parsed back out of it)."""

    def __init__(self, rank: int, tb: str, kind: str | None = None, message: str = ""):
        super().__init__(f"rank {rank} failed:\n{tb}")
        self.rank = rank
        self.traceback = tb
        self.kind = kind
        self.message = message

    def final(self) -> tuple[str, str] | None:
        """(exception type, message) of the error the rank raised, or None (a rank that died
        without a Python error)."""
        return (self.kind, self.message) if self.kind else None


class _Failure(NamedTuple):
    """What a failed worker sends back: its traceback, and the exception's type name and
    message (``kind`` None for a rank that died without a Python error)."""

    traceback: str
    kind: str | None = None
    message: str = ""


# What a worker raises for bad input (a model factory that returns the wrong thing, a plan that
# does not fit the model): said in one line, like the same mistake caught before the start.
USER_ERRORS = ("ValueError", "TypeError")


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn a worker's ValueError or TypeError into a ValueError in this process, with the
    worker's message (and the rank, when not 0): the CLI prints it as one line and exits 2;
    a worker that crashed in any other way keeps its traceback."""
    try:
        yield
    except WorkerError as exc:
        final = exc.final()
        if final is None or final[0] not in USER_ERRORS:
            raise
        where = f" (rank {exc.rank})" if exc.rank else ""
        raise ValueError(final[1] + where) from None


def _worker(fn: Callable, rank: int, world_size: int, port: int, backend: str, args: tuple,
            kwargs: dict, queue: Any, threads: int, env: dict[str, str],
            parent: int, stdout_to_stderr: bool = False) -> None:
    code = 0
    try:
        if stdout_to_stderr:  # the descriptor: C code's and subprocesses' output too
            sys.stdout.flush()
            os.dup2(2, 1)
        # The caller killed (even with SIGKILL): no orphaned rank. Under the fork server the
        # direct parent is the server, which lives on while any worker does: watch the caller.
        die_with_parent(parent)
        # A rank that dies in native code (an abort in a collective, a crash in an op) prints
        # the Python stack it died in, beside torch's own line, instead of only an exit code.
        faulthandler.enable()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to act on
        os.environ.update(env)
        # torchrun's variables, so code that reads them (plait.init) sees a normal launch.
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                           "MASTER_ADDR": HOST, "MASTER_PORT": str(port)})
        lo = loopback_interface()
        if lo is not None:  # gloo's sockets on 127.0.0.1 only (see loopback_interface)
            os.environ["GLOO_SOCKET_IFNAME"] = lo
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        store = dist.TCPStore(HOST, port, world_size, is_master=False,
                              timeout=timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=120))
        result = fn(rank, world_size, *args, **kwargs)
        payload = pickle.dumps(("ok", rank, result))
        del result
        gc.collect()  # free DDP/FSDP modules before the group goes (a live reducer can hang exit)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        # The notes plait adds to an error (what a pipeline stage received, ...) go with its
        # message: a ValueError or TypeError reaches the user as that message alone.
        said = "\n".join([str(exc), *getattr(exc, "__notes__", [])])
        error = _Failure(traceback.format_exc(), type(exc).__name__, said)
        payload = pickle.dumps(("error", rank, error))
        code = 1
    queue.put(payload)
    queue.close()
    queue.join_thread()
    _run_exit_finalizers()
    os._exit(code)


def _run_exit_finalizers() -> None:
    """What a multiprocessing child runs as it returns and ``os._exit`` skips: its finalizers
    (``multiprocessing.util``'s, those of priority 0 and up; object teardown, where a live
    reducer can hang, stays skipped). Among them the unlinking of the named semaphores the rank
    created, which it shares with the caller's resource tracker: torch.compile's kernel wait
    creates one (the lock of its progress bar, tqdm's, made even when the bar is off), and
    without this the caller's tracker warns "There appear to be N leaked semaphore objects" at
    its exit, one per rank; and the shutdown of inductor's compile-worker pool."""
    from multiprocessing import util

    util._run_finalizers(0)  # type: ignore[attr-defined]


def _watchdog_report(store: Any) -> str:
    """The hang watchdog's report, when it is what ended the workers (plait.diagnostics)."""
    base = "plait/watchdog/0"
    try:  # the latest Run's keys (see plait.diagnostics.watchdog.start)
        runs = int(store.get(f"{base}/runs/0")) if store.check([f"{base}/runs/0"]) else 1
        key = f"{base}/report" if runs <= 1 else f"{base}/run{runs}/report"
        return "\n" + store.get(key).decode() if store.check([key]) else ""
    except Exception:  # noqa: BLE001 - no report to add
        return ""


# What a rank raises when a peer died first: its own traceback says nothing of the cause.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "Socket Timeout", "Timed out waiting", "gloo/transport")


def _first_cause(errors: dict[int, _Failure], queue: Any, procs: list[Any], done: set[int],
                 wait: float = 3.0) -> WorkerError:
    """The error to show once a rank failed: its peers fail next, with a dropped connection,
    and the first report to arrive may be one of those. Waits up to ``wait`` seconds for the
    other ranks' reports and names the rank whose error is not a dropped peer, or one that
    died without a report (torch aborts a process whose collective received the wrong size:
    ranks that ran different collectives)."""
    deadline = time.monotonic() + wait
    done = set(done)
    while len(errors) + len(done) < len(procs) and time.monotonic() < deadline:
        try:
            status, rank, value = pickle.loads(queue.get(timeout=0.2))
        except queue_mod.Empty:
            continue
        if status == "error":
            errors[rank] = value
        else:
            done.add(rank)
    for r, p in enumerate(procs):
        if r not in errors and r not in done and not p.is_alive() and p.exitcode:
            errors[r] = _Failure(_died_without_error(p.exitcode))
    causes = [r for r, e in errors.items()
              if not any(p in e.traceback for p in _PEER_GONE)]
    rank = min(causes) if causes else min(errors)
    after = sorted(r for r in errors if r != rank)
    tb, kind, message = errors[rank]
    if after:
        tb += (f"\n(rank{'s' if len(after) > 1 else ''} {', '.join(map(str, after))} failed "
               f"too, after rank {rank})")
    return WorkerError(rank, tb, kind, message)


def _start_without_sigint(procs: list[Any]) -> None:
    """Start the workers with SIGINT ignored (a disposition that survives exec, and under which
    Python installs no KeyboardInterrupt handler): a terminal's Ctrl-C reaches the whole process
    group, but only the parent should act on it, by stopping the workers; otherwise every rank
    prints its own KeyboardInterrupt traceback."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        for p in procs:
            p.start()
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


# What the fork server imports once, so that no worker has to: torch and the distributed
# pieces plait's layouts use (about 1.5 s of CPU each, per rank, in a fresh interpreter).
_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor.parallel",
            "torch.distributed.fsdp", "torch.distributed.pipelining",
            "torch.distributed.checkpoint", "torch._dynamo", __name__.rpartition(".")[0])


def _died_without_error(code: int) -> str:
    """What a rank that exited with ``code`` and no Python error most likely ran into."""
    said = f"process exited with code {code} without a Python error"
    try:
        name = signal.Signals(-code).name if code < 0 else ""
    except ValueError:
        name = ""
    if name == "SIGABRT":
        return (f"{said} ({name}; torch printed why on stderr, above, and the Python stack it "
                f"died in). A process that aborts in a collective ran different collectives "
                f"than its peers: often a forward that took a branch on some ranks only, "
                f"leaving parameters without gradients there; add find_unused to the plan "
                f"(e.g. dp=2,find_unused=true)")
    if name in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE"):
        return (f"{said} ({name}: a crash in native code, torch's or an extension's; the "
                f"Python stack it died in is on stderr, above)")
    if name == "SIGKILL":
        return (f"{said} (SIGKILL: killed from outside, most often by the kernel when the "
                f"machine ran out of memory; see `dmesg`)")
    return f"{said}{f' ({name})' if name else ''}"


def _context() -> Any:
    """``forkserver`` with ``_PRELOAD`` imported in the server, on Linux; else ``spawn``
    (macOS: a process that has loaded Apple's frameworks, as importing torch does there, is
    not safe to fork). The preload list only matters before the server starts (the first call
    in this process); a module that fails to import there is imported by the worker that needs
    it."""
    if not sys.platform.startswith("linux") or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
                    backend: str = "gloo", threads: int = 1, env: dict[str, str] | None = None,
                    stdout_to_stderr: bool = False, **kwargs: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh processes.

    The default process group is initialised before ``fn`` runs and destroyed after. Returns the
    per-rank results (picklable values; tensors come back by value). Raises ``WorkerError`` with
    the first failing rank's traceback, or ``TimeoutError`` naming the ranks still running after
    ``timeout`` seconds. ``fn`` must be importable (a module-level function).
    ``stdout_to_stderr``: what the workers write on stdout (a user's model code printing) goes
    to stderr, for a command whose stdout is a JSON report alone (``--format json``).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")

    store = loopback_store(0, world_size + 1, timeout=timedelta(seconds=60))
    port = store.port
    ctx = _context()
    queue = ctx.Queue()
    # The whole environment, as it is now: a fork server's children inherit the server's.
    env = {**os.environ, **(env or {})}
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(fn, rank, world_size, port, backend, args, kwargs, queue, threads,
                               env, os.getpid(), stdout_to_stderr))
             for rank in range(world_size)]
    _start_without_sigint(procs)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stuck = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {stuck} of {world_size} still running after "
                                   f"{timeout:g}s: a hung collective, or work (start-up "
                                   f"included) that needs longer than the timeout")
            try:
                status, rank, value = pickle.loads(queue.get(timeout=min(remaining, 1.0)))
            except queue_mod.Empty:  # check for workers that died without reporting
                dead = [r for r, p in enumerate(procs)
                        if r not in results and not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    time.sleep(0.5)  # let a report that is in flight arrive first
                    if queue.empty():
                        raise WorkerError(dead[0], _died_without_error(procs[dead[0]].exitcode)
                                          + _watchdog_report(store)) from None
                continue
            if status == "error":
                raise _first_cause({rank: value}, queue, procs, set(results))
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        queue.close()
        del store
    return [results[r] for r in range(world_size)]
