"""Does each rank hold the batch it should?

``run.loader`` gives each data replica its own rows of every global batch, and the same rows to
every rank of one replica (its tensor-, context- and pipeline-parallel peers). A script that
loads its own batches can get either wrong without anything failing:

* a ``DataLoader`` without a ``DistributedSampler`` (or batches drawn from the same seed on
  every rank) hands every replica the same rows: the job trains on 1/dp of the data it means
  to, each row counted dp times, at dp times the cost. The loss looks right, so it is warned
  about.
* a ``DistributedSampler`` left at torch's defaults splits the data over the *world*, so the
  peers of one replica get different rows: tensor parallelism then sums products of different
  inputs, a pipeline scores one row's outputs against another row's labels. That trains
  something else, so it is refused.

The first step compares a fingerprint of every rank's batch (five numbers per rank, one
all-gather over the world).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from .._torch_compat import pytree
from ..warn import user_stacklevel


def fingerprint(batch: Any) -> torch.Tensor:
    """Four float64 numbers that two different batches almost never share: over every tensor in
    ``batch``, the sum of its values, of their squares, of each value weighted by its position
    (so that reordered rows differ), and the element count. Computed where the batch is."""
    total = torch.zeros(4, dtype=torch.float64)
    for t in pytree()[0](batch)[0]:
        if not isinstance(t, torch.Tensor) or t.is_complex():
            continue
        # NaN and infinities as numbers of their own: a NaN would make every sum NaN, and
        # every batch holding one alike.
        flat = torch.nan_to_num(t.detach().reshape(-1).double(), nan=-1.5, posinf=-2.5,
                                neginf=-3.5)
        weight = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64) % 97 + 1
        parts = torch.stack([flat.sum(), (flat * flat).sum(), (flat * weight).sum(),
                             torch.tensor(float(flat.numel()), device=flat.device,
                                          dtype=torch.float64)])
        total += parts.cpu()
    return total


_PEERS = {"tp": "tensor-parallel", "cp": "context-parallel", "pp": "pipeline"}


def check_rank_batches(batch: Any, dp_rank: int, dp: int, peer_axes: dict[str, int],
                       device: torch.device) -> bool:
    """Compare ``batch``'s fingerprint across every rank of the job (a collective over the
    default group: every rank calls it). Raises ValueError on every rank when the ranks of one
    data replica (``dp_rank`` says which this rank is in; ``peer_axes``: the sizes of the other
    mesh axes) hold different batches, and warns on global rank 0 when every one of the ``dp``
    replicas holds the same rows. Returns whether they do. A batch holding no tensor is not
    judged."""
    mine = torch.cat([fingerprint(batch), torch.tensor([float(dp_rank)], dtype=torch.float64)])
    mine = mine.to(device, torch.float32 if device.type == "mps" else None)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    rows = torch.stack(gathered).cpu()
    replicas: dict[int, list[int]] = {}
    for rank, row in enumerate(rows):
        replicas.setdefault(int(row[4]), []).append(rank)
    for replica, ranks in sorted(replicas.items()):
        if any(not _same(rows[r, :4], rows[ranks[0], :4]) for r in ranks[1:]):
            peers = " and ".join(_PEERS[a] for a in _PEERS if peer_axes.get(a, 1) > 1)
            raise ValueError(
                f"plait: the {len(ranks)} ranks of data replica {replica} (ranks {ranks}, its "
                f"{peers or 'other'} peers) got different batches at the first step: every "
                f"rank of a replica must load the same rows, or the layout trains something "
                f"else (tensor parallelism sums products of different inputs, a pipeline "
                f"scores one row's outputs against another's labels). A DistributedSampler "
                f"left at torch's defaults splits the data over all {len(rows)} ranks, not "
                f"the {dp} data {'replicas' if dp > 1 else 'replica'}: give it "
                f"num_replicas=run.dp_size, rank=run.dp_rank, "
                f"or load with run.loader(dataset, batch_size=<global batch>). Randomness in "
                f"the dataset (augmentation) must come from the item's index, not from each "
                f"process's generator")
    heads = [rows[ranks[0]] for _, ranks in sorted(replicas.items())]
    same = (dp > 1 and bool(heads[0][3] > 0)
            and all(_same(h[:4], heads[0][:4]) for h in heads[1:]))
    if same and dist.get_rank() == 0:
        warnings.warn(f"plait: the {dp} data replicas got the same batch at the first step: "
                      f"each trains on the rows the others do, so the job sees 1/{dp} of the "
                      f"data at {dp}x the cost. Load batches with run.loader(dataset, "
                      f"batch_size=<global batch>), which gives each replica its own rows (or "
                      f"a DataLoader with torch.utils.data.DistributedSampler(dataset, "
                      f"num_replicas=run.dp_size, rank=run.dp_rank)). A tensor the loop draws "
                      f"itself (a GAN's noise, torch.randn(...)) is the same on every rank, "
                      f"which plait seeds alike: draw it in the dataset's __getitem__, where "
                      f"each item gets draws of its own",
                      UserWarning, stacklevel=user_stacklevel())
    return same


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal fingerprints, a NaN equal to a NaN (sums that overflowed to both infinities):
    the same batch gives the same fingerprint on every rank that loaded it."""
    return bool(torch.isclose(a, b, rtol=0.0, atol=0.0, equal_nan=True).all())
