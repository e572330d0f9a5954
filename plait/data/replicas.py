"""Do the data replicas train on different rows?

``run.loader`` gives each data replica its own rows of every global batch. A script that
iterates a ``DataLoader`` of its own (without a ``DistributedSampler``), or draws its batches
from the same seed on every rank, hands every replica the same rows instead: the job then
trains on 1/dp of the data it means to, each row counted dp times, at dp times the cost.
Nothing fails and the loss looks right, so the first step compares a fingerprint of each
replica's batch (four numbers per rank, one all-gather over the data ranks) and warns when
they are all equal.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from .._torch_compat import pytree


def fingerprint(batch: Any) -> torch.Tensor:
    """Four float64 numbers that two different batches almost never share: over every tensor in
    ``batch``, the sum of its values, of their squares, of each value weighted by its position
    (so that reordered rows differ), and the element count. Computed where the batch is."""
    total = torch.zeros(4, dtype=torch.float64)
    for t in pytree()[0](batch)[0]:
        if not isinstance(t, torch.Tensor) or t.is_complex():
            continue
        flat = t.detach().reshape(-1).double()
        weight = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64) % 97 + 1
        parts = torch.stack([flat.sum(), (flat * flat).sum(), (flat * weight).sum(),
                             torch.tensor(float(flat.numel()), device=flat.device,
                                          dtype=torch.float64)])
        total += parts.cpu()
    return total


def warn_if_replicas_share_rows(batch: Any, group: Any, dp: int, device: torch.device) -> bool:
    """Compare ``batch``'s fingerprint across the ``dp`` data ranks of ``group`` (a collective:
    every rank calls it) and warn on global rank 0 when every replica holds the same rows.
    Returns whether they do. A batch holding no tensor is not judged."""
    mine = fingerprint(batch).to(device, torch.float32 if device.type == "mps" else None)
    gathered = [torch.empty_like(mine) for _ in range(dp)]
    dist.all_gather(gathered, mine, group=group)
    same = mine[3] > 0 and all(torch.equal(g, gathered[0]) for g in gathered[1:])
    if same and dist.get_rank() == 0:
        warnings.warn(f"plait: the {dp} data replicas got the same batch at the first step: "
                      f"each trains on the rows the others do, so the job sees 1/{dp} of the "
                      f"data at {dp}x the cost. Load batches with run.loader(dataset, "
                      f"batch_size=<global batch>), which gives each replica its own rows (or "
                      f"a DataLoader with torch.utils.data.DistributedSampler(dataset, "
                      f"num_replicas=run.dp_size, rank=run.dp_rank))",
                      UserWarning, stacklevel=3)
    return bool(same)
