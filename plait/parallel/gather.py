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

from .._torch_compat import is_fake


def _sizes(rows: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """Every rank's row count (the last batch of an epoch may leave the ranks uneven)."""
    mine = torch.tensor([rows], dtype=torch.long, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(n) for n in torch.cat(every).tolist()]


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's ``t`` along dim 0; backward: the sum over ranks of the
    gradient of this rank's rows."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        sizes = _sizes(t.shape[0], group, t.device)
        ctx.group, ctx.sizes, ctx.rank = group, sizes, dist.get_rank(group)
        longest = max(sizes)
        padded = t.contiguous()
        if t.shape[0] < longest:  # all_gather needs one shape on every rank
            padded = torch.cat([padded, padded.new_zeros((longest - t.shape[0], *t.shape[1:]))])
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        start = sum(ctx.sizes[:ctx.rank])
        rows = slice(start, start + ctx.sizes[ctx.rank])
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total[rows].clone(), None


def all_gather_rows(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``t`` (rows first) from every rank of ``group`` concatenated in rank order, with a
    gradient; ``t`` itself when there is no group or one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return t
    if t.ndim == 0:
        raise ValueError("all_gather needs a tensor with rows (dim 0 is the batch), got a "
                         "0-dim tensor; gather the per-row values the loss compares")
    if t.device.type == "meta" or is_fake(t):
        # A shape check (a pipeline's first-step shape inference, plait's fake-tensor passes)
        # runs the loss without the other ranks: the gathered shape, no communication.
        return torch.cat([t] * dist.get_world_size(group))
    return _AllGather.apply(t, group)
