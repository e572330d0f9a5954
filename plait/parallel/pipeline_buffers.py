"""Pipeline parallelism: buffers every stage holds, which the forward writes.

A stage module is a shallow copy of the model, so the root module's own buffers, and those of
modules without parameters (kept on every stage), are on every stage: a count of the tokens
seen, an EMA of the features, the running statistics of a BatchNorm without affine weights. The
model's forward runs on every stage, and each writes its copy, but only one stage computes it
from the one-device values: what the forward writes before the blocks sees the model's input
on the first stage only (a later stage has the previous stage's hidden states there), what it
writes after them the last block's output on the last stage only. The copies then differ, and
a checkpoint or ``run.full_state_dict`` took whichever copy its rank order or DCP's balancing of
the writes picked (measured: an EMA of the embedded features 1.8 relative away from one
device's, a token count 16 times one device's).

So the stage whose part of the forward writes a buffer owns it, as one meta-device forward at
the first step shows (:func:`buffer_owners`: the blocks' stage around each write; before the
first block, the first stage; after the last, the last stage). Other stages put back what their
forward wrote (:func:`foreign_kept`), and after each training step the owner's copy is broadcast
to the other pipeline ranks (:func:`broadcast_owned`), so every rank holds the one-device value
for a checkpoint, an export and the next step. A stage that reads a buffer another stage writes
sees its value as of the step's start.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.batchnorm import _NormBase

from .units import by_canonical_name


def every_stage_buffers(stages: list[nn.Module]) -> list[str]:
    """The names of the buffers that every stage module in ``stages`` (all of the pipeline's)
    holds as one tensor: the root's own and those of modules without parameters."""
    held = [{id(b): n for n, b in s.named_buffers(remove_duplicate=False)} for s in stages]
    if len(held) < 2:
        return []
    common = set(held[0]).intersection(*held[1:])
    return sorted(held[0][i] for i in common)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def buffer_owners(replica: nn.Module, path: str, bounds: list[tuple[int, int]],
                  names: list[str], x: Any, kwargs: dict[str, Any]) -> dict[str, int]:
    """{buffer name: the stage whose part of the forward writes it} for the ``names`` that one
    training forward of ``replica`` (a meta-device copy of the model) on ``x``/``kwargs`` writes.

    A write is placed by the blocks around it: inside block i or after it (before the next),
    block i's stage; before the first block, the first stage. ``bounds``: each stage's
    (first block, end). A buffer written in several stages' parts goes to the last of them.
    A forward that does not run on meta tensors yields nothing."""
    if not names:
        return {}
    container = replica.get_submodule(path) if path else replica
    blocks = list(container._modules.values())
    owners_of = [next(s for s, (a, b) in enumerate(bounds) if a <= i < b)
                 for i in range(len(blocks))]
    wanted = set(names)

    def snapshot() -> dict[str, tuple[int, int]]:
        return {n: (id(b), b._version) for n, b in replica.named_buffers(remove_duplicate=False)
                if n in wanted}

    where = [0]  # the stage whose part of the forward runs now
    seen = [snapshot()]
    owners: dict[str, int] = {}

    def mark(stage: int) -> None:
        now = snapshot()
        for n, v in now.items():
            if seen[0].get(n) != v:
                owners[n] = stage
        seen[0] = now

    def before(i: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            mark(where[0])  # written since the last block (or before the first)
            where[0] = owners_of[i]
        return hook

    def after(module: nn.Module, args: Any, out: Any) -> None:
        mark(where[0])

    # BatchNorm's kernel writes its running statistics without moving their version.
    norms = {id(m): [f"{n}.{k}".lstrip(".") for k in m._buffers]
             for n, m in replica.named_modules(remove_duplicate=False)
             if isinstance(m, _NormBase) and m.track_running_stats}

    def norm_called(module: nn.Module, args: Any, out: Any) -> None:
        if module.training:
            for n in norms.get(id(module), []):
                if n in wanted:
                    owners[n] = where[0]

    handles = []
    for i, block in enumerate(blocks):
        if block is not None:
            handles.append(block.register_forward_pre_hook(before(i)))
            handles.append(block.register_forward_hook(after))
    handles += [m.register_forward_hook(norm_called) for m in replica.modules()
                if id(m) in norms]
    was_training = [(m, m.training) for m in replica.modules()]
    replica.train()
    try:
        with torch.no_grad():
            replica(x, **kwargs)
        mark(where[0])  # after the last block
    except Exception:  # noqa: BLE001 - not runnable on meta: nothing is known
        return {}
    finally:
        for h in handles:
            h.remove()
        for m, mode in was_training:
            m.training = mode
    return owners


def named_buffer(module: nn.Module, name: str) -> torch.Tensor:
    """The buffer ``name`` (the model's name for it) of a laid-out stage module."""
    return by_canonical_name(module.named_buffers(remove_duplicate=False), name, "buffer")


@contextlib.contextmanager
def foreign_kept(buffers: list[torch.Tensor]) -> Iterator[None]:
    """Put ``buffers`` (those another stage owns) back as they were after a stage's forward.
    Through ``.data``, as :func:`plait.parallel.pipeline._buffers_kept`: a forward may have
    saved them for its backward."""
    if not buffers:
        yield
        return
    saved = [(b, _local(b).detach().clone()) for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                _local(buffer).data.copy_(value)


def broadcast_owned(owned: list[tuple[torch.Tensor, int]], group: dist.ProcessGroup) -> None:
    """Give every pipeline rank of ``group`` the owner's copy of each buffer: ``owned`` lists
    (this rank's copy, the owner's rank in ``group``), in the same order on every rank."""
    for buffer, owner in owned:
        dist.broadcast(_local(buffer), group_src=owner, group=group)
