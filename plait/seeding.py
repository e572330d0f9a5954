"""The run's seed and random stream: the script's own, the same on every rank.

A script seeds as it does on one device, ``torch.manual_seed(s)`` before ``plait.init()``, and
``s`` is the run's seed: a sweep over ``s`` is a sweep of runs. ``plait.init(seed=None)`` (the
default) takes rank 0's ``torch.initial_seed()`` (``s`` after ``torch.manual_seed(s)``, a
random 64-bit value in a script that never seeds, so that one varies run to run as on one
device) and rank 0's random state, and gives both to every rank: the replicas build the same
weights and draw the same numbers. ``plait.init(seed=k)`` seeds every rank with ``k``.

``run.parallelize`` leaves the random stream where building the model left it, as one device
never resets it between building the model and training: what laying out draws (the
planner's measurements, a layout's checks running the blocks) is undone, and every rank
continues from rank 0's state. A second model built after that call draws on from the first
one's draws, as on one device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

# torch.manual_seed takes any integer from -2**63 to 2**64 - 1 and keeps it as an unsigned
# 64-bit value (torch.initial_seed() of manual_seed(-1) is 2**64 - 1)
_LOW, _HIGH = -(2**63), 2**64


def check_seed(seed: object) -> None:
    """Refuse a seed ``torch.manual_seed`` cannot take, naming it."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or not _LOW <= seed < _HIGH:
        raise ValueError(f"seed={seed!r}: use an integer from 0 to 2**64 - 1, or leave it out "
                         f"(None) for the seed the script set with torch.manual_seed")


def _shared(values: list[object], share: bool) -> list[object]:
    """``values`` as rank 0 holds them, on every rank of the job (``share``; as they are
    without it: PyTorch/XLA SPMD's one process per host has no collective before its mesh)."""
    if share and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(values, src=0)
    return values


def start(seed: int | None, share: bool = True) -> int:
    """Seed every rank for the run and return its seed (0 to 2**64 - 1).

    ``seed`` given: ``torch.manual_seed(seed)`` on every rank. None: rank 0's
    ``torch.initial_seed()`` seeds every device's generator, and rank 0's CPU random state
    follows it, so the script's stream goes on where it was on rank 0 (a model built before
    ``plait.init`` drew from it) and every rank holds the same."""
    check_seed(seed)
    if seed is not None:
        torch.manual_seed(seed)
        return torch.initial_seed()
    chosen, state = _shared([torch.initial_seed(), torch.get_rng_state()], share)
    assert isinstance(chosen, int) and isinstance(state, torch.Tensor)
    torch.manual_seed(chosen)
    torch.set_rng_state(state)
    return chosen


@contextmanager
def kept_stream(device: torch.device, share: bool = True) -> Iterator[None]:
    """Lay a model out inside this: the CPU state and ``device``'s (a GPU's) are put back
    after it, to where building the model left them, and then every rank takes rank 0's CPU
    state, so that they draw alike even where the script drew on one rank only."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        yield
    (state,) = _shared([torch.get_rng_state()], share)
    assert isinstance(state, torch.Tensor)
    torch.set_rng_state(state)
