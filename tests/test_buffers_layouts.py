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
