"""Buffers a forward writes (BatchNorm's running statistics, an EMA, a step counter) under data
parallelism and pipelines: what every rank reads and saves after training is the same, and is
what one device holds under the layout's semantics (rank 0's under DDP)."""

from __future__ import annotations

import pytest
import torch

from plait.checkpoint.export import model_tensors
from plait.spawn import run_distributed
from tests import _workers_buffers as W


@pytest.mark.parametrize("model", ["bnema", "rootstats"])
def test_ddp_full_state_dict_and_save_hold_rank_0s_buffers_on_every_rank(model, tmp_path):
    """dp=2 (DDP) on a model with BatchNorm and an EMA after the blocks (``bnema``), and one
    with a token counter and two EMAs on its root module (``rootstats``), 3 SGD steps. DDP
    broadcasts rank 0's buffers before each forward, so after the last step rank 1 still
    holds the EMA and the statistics of its own rows; ``run.full_state_dict`` on both ranks,
    and the checkpoint, hold rank 0's, which the next forward of every rank would read."""
    folder = str(tmp_path / "ckpt")
    rank0, rank1 = run_distributed(W.ddp_reads, 2, model, folder, timeout=180)
    differ = [n for n, b in rank0["own"].items() if not torch.equal(b, rank1["own"][n])]
    assert differ, "rank 1's buffers should be its own after the last step"
    assert rank0["losses"] == rank1["losses"]
    assert rank0["state"].keys() == rank1["state"].keys()
    for name, want in rank0["state"].items():
        assert torch.equal(rank1["state"][name], want), name
    saved = model_tensors(folder)[0]
    for name, own in rank0["own"].items():
        if name not in rank0["state"]:  # a non-persistent buffer is not in the state dict
            continue
        want = own.float() if own.is_floating_point() else own
        assert torch.equal(rank0["state"][name], want), name
        assert torch.equal(saved[name].to(want.dtype), want), name


def _assert_trains_as(got: dict, want: dict, label: str) -> None:
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in
               zip(got["losses"], want["losses"], strict=True)), (label, got["losses"],
                                                                  want["losses"])
    assert got["state"].keys() == want["state"].keys(), label
    worst = {k: (got["state"][k].float() - v.float()).abs().max().item()
             for k, v in want["state"].items()}
    assert max(worst.values()) < 1e-5, (label, {k: w for k, w in worst.items() if w >= 1e-5})


def _layouts(plans: dict[str, tuple[int, int, str]], world: int) -> None:
    """Each plan, on every rank: losses, every parameter and every buffer of
    ``run.full_state_dict`` after 3 AdamW steps against :func:`W.by_hand` (replicas,
    microbatches per replica, what BatchNorm's statistics become)."""
    ranks = run_distributed(W.layouts, world, list(plans), timeout=300)
    for plan, (replicas, micro, norms) in plans.items():
        want = W.by_hand(replicas, micro, norms)
        for rank, out in enumerate(ranks):
            _assert_trains_as(out[plan], want, f"{plan} rank {rank}")


def test_buffers_the_forward_writes_under_pipelines_and_zero3_world_2():
    """An EMA read by the forward, a forward count and a BatchNorm, under a 1F1B and a ZB-V
    pipeline and under ZeRO-3: one device's losses, parameters and buffers (under ZeRO-3,
    rank 0's EMA and count at each step, the ranks' mean of BatchNorm's statistics)."""
    _layouts({"pp=2,mb=2": (1, 2, "rank0"),
              "pp=2,schedule=zbv,v=2,mb=2": (1, 2, "rank0"),
              "dp_shard=2,zero=3": (2, 1, "mean")}, 2)


@pytest.mark.slow
def test_buffers_the_forward_writes_under_pipelines_over_data_replicas_world_4():
    """The same model at world 4: pp=2 over ZeRO-3 replicas and over DDP replicas, 1F1B and
    ZB-V, against one device doing what the layout's semantics say (DDP: rank 0's BatchNorm
    statistics; FSDP2: their mean)."""
    _layouts({"dp_shard=2,zero=3,pp=2,mb=2": (2, 2, "mean"),
              "dp_shard=2,zero=1,pp=2,schedule=zbv,v=2,mb=2": (2, 2, "mean"),
              "dp_shard=2,zero=3,pp=2,schedule=zbv,v=2,mb=2": (2, 2, "mean"),
              "dp=2,pp=2,mb=2": (2, 2, "rank0"),
              "dp=2,pp=2,schedule=zbv,v=2,mb=2": (2, 2, "mean")}, 4)
