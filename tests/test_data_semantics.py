"""What the loader hands each rank, against one device running the same script: the global batch
(``batch_size`` is the job's, split over the data replicas only), the items an epoch leaves
over, the per-epoch order, tensor- and pipeline-parallel peers holding the same batch, loader
workers, and a script's own DataLoader. Real processes on gloo, each run under a timeout."""

from __future__ import annotations

import pytest

from plait.spawn import WorkerError, run_distributed
from tests import _workers_data as D

REL = 1e-6


def _global_batches(ranks: list[dict]) -> list[list[int]]:
    """Each step's global batch as the data replicas hold it: their rows, in data-rank order
    (one rank per replica; its peers are checked to hold the same)."""
    by_replica: dict[int, dict] = {}
    for r in ranks:
        peer = by_replica.setdefault(r["dp_rank"], r)
        assert peer["ids"] == r["ids"], "ranks of one data replica got other rows"
        for a, b in zip(peer["inputs"], r["inputs"], strict=True):
            assert a.equal(b), "ranks of one data replica got other tensors"
    steps = len(ranks[0]["ids"])
    return [sum((by_replica[d]["ids"][s] for d in sorted(by_replica)), []) for s in range(steps)]


def test_peers_of_one_replica_loading_other_rows_are_refused():
    """A DistributedSampler left at torch's defaults splits the data over the world, so the
    tensor-parallel (or pipeline) peers of one replica train on other rows than each other:
    TP then sums partial products of different inputs, a pipeline scores one row's outputs
    against another's labels, and nothing fails. The first step refuses it on every rank;
    the sampler over the data ranks is accepted."""
    for plan, peers in (("tp=2", "tensor-parallel"), ("pp=2,mb=2", "pipeline")):
        with pytest.raises(WorkerError, match=rf"the 2 ranks of data replica 0 \(ranks \[0, 1\], "
                                              rf"its {peers} peers\) got different batches at "
                                              rf"the first step.*over all 2 ranks, not the 1 "
                                              rf"data replica: give it num_replicas=run\.dp_size, "
                                              rf"rank=run\.dp_rank"):
            run_distributed(D.own_sampler, 2, plan, {}, timeout=120)
    right = {"num_replicas": "dp_size", "rank": "dp_rank"}
    tp, pp = (run_distributed(D.own_sampler, 2, plan, right, timeout=120)
              for plan in ("tp=2", "pp=2,mb=2"))
    assert tp[0] == tp[1] and pp[0] == pp[1]


STEPS = 5  # epochs 0 and 1 whole (2 global batches of 8 out of 22 items), then half of epoch 2


def test_every_layout_trains_one_devices_global_batches():
    """``batch_size`` is the global batch: one device takes all of it, dp=2 (with gradient
    accumulation) splits it between the replicas in order, tensor- and pipeline-parallel peers
    hold the same rows (dict batches of variable-length rows padded by the user's collate_fn).
    Each epoch draws 16 distinct items and leaves 6 over, in a new order each epoch: no item
    counts twice in an epoch. The losses are one device's (the same script, and a plain torch
    loop over the same rows)."""
    one = run_distributed(D.trace, 1, "single", STEPS, timeout=120)
    want = _global_batches(one)
    epochs = [sum(want[e * 2:e * 2 + 2], []) for e in range(2)]
    for ids in epochs:
        assert len(ids) == len(set(ids)) == 2 * D.BATCH and set(ids) <= set(range(D.ITEMS))
    assert epochs[0] != epochs[1]
    assert all(len(ids) == D.BATCH for ids in want)
    plain = D.one_device_losses(want)
    for a, b in zip(plain, one[0]["losses"], strict=True):
        assert abs(a - b) <= REL * abs(a), (plain, one[0]["losses"])
    for plan, length in (("dp=2,accum=2", None), ("tp=2", None), ("pp=2,mb=2", 8)):
        ranks = run_distributed(D.trace, 2, plan, STEPS, length=length, timeout=120)
        assert _global_batches(ranks) == want, plan
        for r in ranks:
            assert all(abs(a - b) <= REL * abs(a)
                       for a, b in zip(plain, r["losses"], strict=True)), (plan, r["losses"])
