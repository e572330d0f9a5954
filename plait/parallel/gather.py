"""A differentiable all-gather over the data axes, for losses that read the whole batch.

A contrastive loss (CLIP, SimCLR, InfoNCE) compares every row with every other row of the
batch: under data parallelism each rank holds only its slice, and a loss over that slice alone
has fewer negatives and is not the loss one device computes on the global batch. Gathering the
embeddings from every data rank, with a gradient that flows back to the rank that computed each
row, restores it: each rank computes the loss of its own rows against every row of the global
batch, and plait's usual weighting of the ranks' losses by their row counts gives the global
mean.

The gradient: rank r's loss reads every rank's rows, so the gradient of the rows rank s
computed is the sum over ranks of what their losses send back to those rows (a reduce-scatter
with a sum). Data parallelism then averages the parameter gradients over the ranks, which the
loss scaling accounts for: the summed gradient is what one device's backward gives.

torch's differentiable collectives (``torch.distributed.nn.functional.all_gather``) are
deprecated in favour of the functional collectives, which have no backward. The backward
all-reduces the gathered gradient and keeps this rank's rows: twice the bytes of the
reduce-scatter it stands for, but one path on every backend (gloo has no reduce-scatter) and for
uneven row counts; the embeddings a contrastive loss gathers are small beside the gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from .._torch_compat import is_fake


def _sizes(rows: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """Every rank's row count (the last batch of an epoch may leave the ranks uneven)."""
    mine = torch.tensor([rows], dtype=torch.long, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(n) for n in torch.cat(every).tolist()]


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's ``t`` (``sizes``: every rank's row count) along dim 0;
    backward: the sum over ranks of the gradient of this rank's rows."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: dist.ProcessGroup, sizes: list[int]
                ) -> torch.Tensor:
        ctx.group, ctx.sizes, ctx.rank = group, sizes, dist.get_rank(group)
        longest = max(sizes)
        padded = t.contiguous()
        if t.shape[0] < longest:  # all_gather needs one shape on every rank
            padded = torch.cat([padded, padded.new_zeros((longest - t.shape[0], *t.shape[1:]))])
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        start = sum(ctx.sizes[:ctx.rank])
        rows = slice(start, start + ctx.sizes[ctx.rank])
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total[rows].clone(), None, None


class _AllGatherAlone(torch.autograd.Function):
    """``t`` itself, as the gather of one data rank's rows is, under an autograd node named as
    a gather: plait's check that a scalar loss is a mean over its rows
    (:mod:`plait.mean_probe`) leaves a loss over gathered rows alone, and on one data rank
    (``grad_accum`` alone) the loss is the same loss over every row."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def all_gather_rows(t: torch.Tensor, group: dist.ProcessGroup | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (rows first) from every rank of ``group`` concatenated in rank order, with a
    gradient, and the places of this rank's rows among them (a long tensor: the labels of a
    contrastive loss that matches each row with itself); ``t`` itself when there is no group
    or one rank.

    Under gradient accumulation and a pipeline's microbatches each call gathers the
    micro-batch's rows of every rank, not the global batch's, so a row's place is not its
    index in the global batch: the returned places are right in every layout.

    A DTensor (a tensor-parallel output, e.g. sharded over tp on its last dim) is gathered
    over ``group`` shard by shard and keeps its layout over tp; one sharded over tp on its
    rows cannot be (its rows' order would interleave the two axes)."""
    if t.ndim == 0:
        raise ValueError("all_gather needs a tensor with rows (dim 0 is the batch), got a "
                         "0-dim tensor; gather the per-row values the loss compares")
    if isinstance(t, DTensor):
        if any(isinstance(p, Shard) and p.dim % t.ndim == 0 for p in t.placements):
            raise ValueError(f"all_gather got a DTensor sharded on its rows over tp "
                             f"(placements {t.placements}): its rows' order over the data ranks "
                             f"would interleave the tp shards; gather t.full_tensor() or "
                             f"t.redistribute(placements=[Replicate()]) instead")
        local, index = all_gather_rows(t.to_local(), group)
        return (DTensor.from_local(local, t.device_mesh, t.placements, run_check=False),
                index)
    rows = t.shape[0]
    if group is None or dist.get_world_size(group) == 1:
        return _AllGatherAlone.apply(t), torch.arange(rows, device=t.device)
    ranks = dist.get_world_size(group)
    if t.device.type == "meta" or is_fake(t):
        # A shape check (a pipeline's first-step shape inference, plait's fake-tensor passes)
        # runs the loss without the other ranks: the gathered shape, no communication.
        start = dist.get_rank(group) * rows
        return torch.cat([t] * ranks), torch.arange(start, start + rows, device=t.device)
    sizes = _sizes(rows, group, t.device)
    start = sum(sizes[:dist.get_rank(group)])
    return (_AllGather.apply(t, group, sizes),
            torch.arange(start, start + rows, device=t.device))
