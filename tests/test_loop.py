"""The loop a user writes around plait, against a plain one-process loop over the same global
batches: epochs of a variable-length dataset padded by a collate_fn (a new loader each epoch),
AdamW with parameter groups chosen by name, an LR scheduler, clipping, a save mid-epoch resumed
under another layout."""

from __future__ import annotations

import pytest

from plait.spawn import WorkerError, run_distributed
from tests import _workers_loop as L

REL = 1e-6


def _assert_losses(want: list[float], got: list[float]) -> None:
    assert len(got) == len(want), (want, got)
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert abs(a - b) <= REL * abs(a), (step, a, b)


def test_epochs_resume_mid_epoch_and_move_layouts(tmp_path):
    """ZeRO-1 steps a sharded copy of the optimizer; the scheduler's warning that its own
    optimizer never stepped is not the user's concern (nothing is skipped: the losses match)."""
    ref = L.reference()
    _assert_losses(ref, run_distributed(L.epoch_loop, 2, "dp_shard=2,zero=3", timeout=120)[0][0])
    folder = str(tmp_path / "ckpt")
    first, caught = run_distributed(L.epoch_loop, 2, "dp_shard=2,zero=1", save_after=3,
                                    folder=folder, timeout=120)[0]
    assert not [w for w in caught if "lr_scheduler.step()" in w], caught
    assert not [w for w in caught if "got the same batch" in w], caught  # run.loader shards
    # Resumed in epoch 1 (of 2 batches each), under a pipeline: its stages take one shape.
    rest = run_distributed(L.epoch_loop, 2, "pp=2,mb=2", folder=folder, resume=True,
                           length=L.SEQ, timeout=120)[0][0]
    _assert_losses(ref, first + rest)


def test_a_pipeline_refuses_a_batch_of_another_shape():
    """Its stages receive into buffers sized at the first step: a shorter batch read stale
    rows."""
    with pytest.raises(WorkerError, match=r"pipeline parallelism \(pp=2\) sets its stages up "
                                          r"for one input shape: this batch's inputs are "
                                          r"\(8, \d\), the stages were set up for \(8, 8\)"):
        run_distributed(L.epoch_loop, 2, "pp=2,mb=2", timeout=120)


def test_an_optimizer_built_before_parallelize_is_refused():
    """ZeRO-3 and tensor parallelism replace the parameters: it would step the old copies and
    leave the model as it was."""
    with pytest.raises(WorkerError, match=r"the optimizer holds 12 tensor\(s\) that are not "
                                          r"the model's parameters and misses 12 .* build it "
                                          r"after, on the returned model"):
        run_distributed(L.optimizer_made_first, 2, "dp_shard=2,zero=3", timeout=120)


def test_replicas_handed_the_same_rows_are_warned_about():
    """A DataLoader the script iterates itself, without a DistributedSampler, gives every data
    replica the same rows: nothing fails, the job trains on half its data at twice the cost.
    The first step says so (on rank 0, once); with the sampler, or on a tensor-parallel pair
    (one replica: the same rows are meant), it says nothing."""
    same = "the 2 data replicas got the same batch at the first step"
    warned = run_distributed(L.own_dataloader, 2, "dp=2", False, timeout=120)
    said = [w for w in warned[0] if same in w]
    assert len(said) == 1 and "DistributedSampler" in said[0], warned  # the first step only
    assert not [w for w in warned[1] if same in w]  # rank 0 only
    for plan, sampler in (("dp_shard=2,zero=2", True), ("tp=2", False)):
        caught = run_distributed(L.own_dataloader, 2, plan, sampler, timeout=120)
        assert not [w for r in caught for w in r if "got the same batch" in w], (plan, caught)
