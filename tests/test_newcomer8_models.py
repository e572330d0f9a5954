"""A newcomer's models where the loss or the randomness spans the whole batch
(``tests/_newcomer8_models.py``), each under plait's layouts against torch alone on one
device (losses each step, every parameter after 3 AdamW steps):

* the CLIP-style two-tower model under a pipeline: a forward whose first input is not the one
  its blocks run on is refused on every rank; with the blocks' input first it trains as one
  device accumulating over the pipeline's microbatches;
* InfoNCE and a mixture of experts' balance loss over ``run.all_gather`` under
  ``grad_accum=2``: one device accumulating over the same parts, not one device's loss over
  the whole batch, and plait says so;
* a diffusion U-Net whose loop draws the noise, and a masked autoencoder whose forward draws
  its mask, under data parallelism (every replica draws from one stream) and ``tp=2``;
* a GRU encoder-decoder on dict batches with targets of different lengths (-100 padded)
  under ``dp=2,grad_accum=2`` and ``fsdp=2`` (``tp`` and ``pp`` refuse it by name)."""

from __future__ import annotations

from typing import Any

import pytest

from plait.spawn import run_distributed
from tests import _newcomer8_models as M
from tests.test_newcomer7_models import _assert_clip_trains_as_one_device
from tests.test_newcomer_models import _assert_trains_as_one_device


def _by_plan(results: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["case"], r["plan"]): r for r in results}


def _max_diff(got: dict[str, Any], want: dict[str, Any]) -> float:
    return max((got["state"][k] - w).abs().max().item() for k, w in want["state"].items())


def _assert_warned_parts(result: dict[str, Any], parts: str) -> None:
    assert len(result["warnings"]) == 1, result["warnings"]
    said = result["warnings"][0]
    assert "gathers rows with run.all_gather" in said and parts in said, said
    assert "set grad_accum=1" in said, said


# One 2-rank spawn for the default tests: each job is a few AdamW steps.
_JOBS = [("clip", "pp=2"), ("clip_ids", "pp=2"), ("moe", "dp=2,grad_accum=2"),
         ("mae", "tp=2"), ("mae", "dp=2"), ("unet_own", "dp=2"), ("unet_global", "dp=2"),
         ("seq2seq", "dp=2,grad_accum=2")]


@pytest.fixture(scope="module")
def ranks() -> list[list[dict[str, Any]]]:
    return run_distributed(M.train, 2, _JOBS, timeout=240)


def test_whole_batch_losses_under_a_pipeline_and_grad_accum(
        ranks: list[list[dict[str, Any]]]) -> None:
    # forward(pixels, ids) with the blocks on ids: the second stage ran the forward with the
    # hidden states as pixels and failed alone ("The size of tensor a (6) must match ...")
    # while the first waited for it until gloo's timeout; every rank now refuses at the first
    # step. With ids first the pipeline's 2 microbatches each compute InfoNCE over their rows,
    # as grad_accum=2 does: one device accumulating over those parts, which plait now says.
    for results in ranks:  # every rank refuses with the same line
        said = _by_plan(results)[("clip", "pp=2")]["refused"]
        assert "runs on TwoTower.forward's input 'ids', not on its first input 'pixels'" in said
        assert "forward(self, ids, pixels, ...)" in said and "pp=1" in said, said
    got = _by_plan(ranks[0])
    _assert_parts(got, [(("clip_ids", "pp=2"), 1, 2, "microbatches=2"),
                        (("moe", "dp=2,grad_accum=2"), 2, 2, "grad_accum=2")])


def _assert_parts(got: dict[tuple[str, str], dict[str, Any]],
                  cases: list[tuple[tuple[str, str], int, int, str]]) -> None:
    """Each case ``(job, dp, parts, named)``: warned, naming ``named``, and one device
    accumulating over the ``parts`` parts, not one device's loss over the whole batch."""
    for key, dp, parts, named in cases:
        _assert_warned_parts(got[key], named)
        whole, want = M.reference_parts(key[0]), M.reference_parts(key[0], dp, parts)
        if key[0].startswith("clip"):
            # Accumulating sums the parts' gradients in another order, which Adam's first
            # steps scale up on a near-zero gradient: 6e-5 of blocks.1.mlp.2.weight's size,
            # where the whole batch's training is 5.7e-2 off.
            _assert_clip_trains_as_one_device(got[key], want, 1e-4)
            # fewer negatives per loss: 1.13 of 4.99 off the whole batch's first loss
            assert abs(got[key]["losses"][0] - whole["losses"][0]) > 0.5
        else:
            _assert_trains_as_one_device(got[key], want)
            # the balance loss over half the tokens: 2e-3 off, 2e-2 in the parameters
            assert _max_diff(got[key], whole) > 1e-2


def test_randomness_drawn_in_the_loop_and_in_the_forward(
        ranks: list[list[dict[str, Any]]]) -> None:
    # tp ranks of a replica draw the MAE's mask from one stream for the same rows: one
    # device's training. Data replicas draw for their own rows from that same stream, so
    # row k of every replica gets one mask (or noise): one device drawing for rows / dp rows
    # and repeating them. Drawing for the global batch and taking this replica's rows (the
    # loop's noise below) is one device's training.
    got = _by_plan(ranks[0])
    for key in _JOBS[3:7]:
        assert got[key]["warnings"] == [], (key, got[key]["warnings"])
    _assert_trains_as_one_device(got[("mae", "tp=2")], M.reference_drawn("mae"))
    _assert_trains_as_one_device(got[("unet_global", "dp=2")], M.reference_drawn("unet_global"))
    for case in ("mae", "unet_own"):
        result = got[(case, "dp=2")]
        _assert_trains_as_one_device(result, M.reference_drawn(case, per_replica=2))
        assert _max_diff(result, M.reference_drawn(case)) > 1e-2, case


def test_a_gru_encoder_decoder_with_padded_targets_trains_as_one_device(
        ranks: list[list[dict[str, Any]]]) -> None:
    # Targets of 2 to 6 tokens, -100 after them: each part's mean cross-entropy weighed by its
    # labelled tokens is one device's mean over the global batch's, so grad_accum is exact
    # here (no loss over gathered rows, no warning).
    got = _by_plan(ranks[0])[("seq2seq", "dp=2,grad_accum=2")]
    assert got["warnings"] == [], got["warnings"]
    _assert_trains_as_one_device(got, M.reference_parts("seq2seq"))


@pytest.mark.slow
def test_the_other_layouts() -> None:
    jobs = [("moe", "dp_shard=2,zero=3,grad_accum=2"), ("mae", "fsdp=2"),
            ("clip", "dp=2,grad_accum=2"), ("seq2seq", "fsdp=2"), ("seq2seq", "tp=2"),
            ("seq2seq", "pp=2")]
    got = _by_plan(run_distributed(M.train, 2, jobs, timeout=300)[0])
    _assert_trains_as_one_device(got[("seq2seq", "fsdp=2")], M.reference_parts("seq2seq"))
    said = got[("seq2seq", "tp=2")]["refused"]
    assert "recurrent layers (encoder, decoder) are not split over tp" in said, said
    said = got[("seq2seq", "pp=2")]["refused"]
    assert "no nn.ModuleList, nn.Sequential or nn.ModuleDict of blocks" in said, said
    _assert_parts(got, [(("clip", "dp=2,grad_accum=2"), 2, 2, "grad_accum=2")])
    _assert_warned_parts(got[jobs[0]], "grad_accum=2")
    _assert_trains_as_one_device(got[jobs[0]], M.reference_parts("moe", 2, 2))
    assert got[jobs[1]]["warnings"] == []
    _assert_trains_as_one_device(got[jobs[1]], M.reference_drawn("mae", per_replica=2))
    # One data rank: run.all_gather is the rows themselves, and the loss warned about once,
    # as a loss over the parts (not as a scalar that is not a mean over its labels).
    jobs = [("moe", "grad_accum=2"), ("clip", "grad_accum=2")]
    got = _by_plan(run_distributed(M.train, 1, jobs, timeout=300)[0])
    for key in jobs:
        _assert_warned_parts(got[key], "grad_accum=2")
        want = M.reference_parts(key[0], 1, 2)
        if key[0] == "clip":
            _assert_clip_trains_as_one_device(got[key], want, 1e-4)
        else:
            _assert_trains_as_one_device(got[key], want)
    # A pipeline of 2 stages x 2 data replicas, the blocks' input first.
    got = _by_plan(run_distributed(M.train, 4, [("clip_ids", "dp=2,pp=2")], timeout=300)[0])
    _assert_warned_parts(got[("clip_ids", "dp=2,pp=2")], "microbatches=2")
    _assert_clip_trains_as_one_device(got[("clip_ids", "dp=2,pp=2")],
                                      M.reference_parts("clip_ids", 2, 2), 1e-4)


def test_the_planner_is_told_before_any_layout() -> None:
    # pp_refusal (what plan="auto" and `plait plan` ask before proposing a pipeline) sees the
    # blocks' input on the user's example, as the first step does.
    from plait.parallel.pipeline import pp_refusal
    from plait.parallel.tp_example import Example
    from plait.plan import Plan
    from tests import _newcomer7_models as N

    data = N.Pairs()
    example = Example(kwargs=N.collate_pairs([data[i] for i in range(4)])[0])
    said = pp_refusal(N.TwoTower(), Plan.from_string("pp=2"), example=example)
    assert said is not None and "input 'ids', not on its first input 'pixels'" in said, said
    assert pp_refusal(M.IdsFirst(), Plan.from_string("pp=2"), example=example) is None
