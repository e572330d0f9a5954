"""Module-level worker functions for multi-process tests (spawned processes import them)."""

import time

import torch
import torch.distributed as dist


def all_reduce_rank(rank, world_size):
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    return t


def faulthandler_on(rank, world):
    import faulthandler

    return faulthandler.is_enabled()


def crash_on_rank(rank, world, bad):
    """Die of SIGSEGV on rank ``bad`` (a read of address 0, as a crash in native code); the
    others wait for it in a barrier."""
    if rank == bad:
        import ctypes

        ctypes.string_at(0)
    import torch.distributed as dist

    dist.barrier()


def fail_on_rank(rank, world_size, bad):
    if rank == bad:
        raise RuntimeError(f"boom on rank {rank}")
    time.sleep(60)  # the parent must kill the survivors


def bad_value_on_rank(rank, world_size, bad):
    if rank == bad:
        raise ValueError("bad plan\nKeyError: 'wq' reads like a traceback's last line")
    time.sleep(60)


def hang(rank, world_size):
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    time.sleep(120)


def report_pid_then_sleep(rank, world_size, folder):
    """Say where this rank runs (its pid and environment), then wait to be killed."""
    import json
    import os
    from pathlib import Path

    facts = {"pid": os.getpid(), "marker": os.environ.get("PLAIT_TEST_MARKER")}
    Path(folder, f"{rank}.json").write_text(json.dumps(facts))
    time.sleep(120)


_LOCKS: list = []


def hold_a_process_lock(rank, world_size):
    """Keep a multiprocessing lock (a named semaphore) alive to the end, as a library's class
    attribute does (tqdm's lock, which torch.compile's kernel wait creates)."""
    import multiprocessing

    _LOCKS.append(multiprocessing.get_context().RLock())
    return rank
