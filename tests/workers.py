"""Module-level worker functions for multi-process tests (spawned processes import them)."""

import time

import torch
import torch.distributed as dist


def all_reduce_rank(rank, world_size):
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    return t


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
