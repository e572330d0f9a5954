"""Models plait cannot name, against one device: a model's own class-weighted loss under a
pipeline, and cross-attention from one input to another under context parallelism (models
in ``tests/_workers_anysem.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from plait.spawn import WorkerError, run_distributed
from tests import _workers_anysem as A

PIPELINE = "pp=2,microbatches=2"


def _assert_as_one_device(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Each step's loss and every parameter after the last within 1e-5 of one device's (the
    full state holds the buffers too)."""
    assert "refused" not in got, got
    for a, b in zip(want["losses"], got["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (got["plan"], want["losses"], got["losses"])
    assert set(want["state"]) <= set(got["state"])
    for name, w in want["state"].items():
        diff = (got["state"][name] - w).abs().max().item()
        assert diff <= 1e-5 * max(w.abs().max().item(), 1e-3), (got["plan"], name, diff)


def _check_taggers(ranks: list[list[dict[str, Any]]]) -> None:
    """Job 0 (the loss module the model holds) evaluates and trains as one device, silently;
    job 1 (the weighted loss made in forward) is warned about once on every rank, with the
    fix, though it was evaluated before its first step."""
    exact, warned = ranks[0]
    want = A.tagger_reference(inline=False)
    _assert_as_one_device(exact, want)
    # run.evaluate before the first step: one device's loss of the first batch
    assert abs(exact["evaluated"] - want["losses"][0]) <= 1e-5 * want["losses"][0], exact
    for rank in ranks:
        assert rank[0]["warnings"] == [], rank[0]["warnings"]
        said = rank[1]["warnings"]
        assert len(said) == 1 and "the model's own loss (output.loss) is not the mean" in said[0]
        assert "(sum, count)" in said[0] and "pp=2" in said[0], said
    # What it warns about: the first step already off one device's loss.
    want = A.tagger_reference(inline=True)["losses"][0]
    assert abs(warned["losses"][0] - want) > 1e-4 * want, (warned["losses"], want)


def test_a_models_own_weighted_loss_under_a_pipeline() -> None:
    # loss_fn=None with a class-weighted nn.CrossEntropyLoss the model holds: each microbatch's
    # mean was weighed by its count of labels, 1.1% off one device's loss at a step and 1.0%
    # off in a parameter under pp=2,microbatches=2 (3.7% under dp=2 with it), with nothing
    # said; a weighted loss made in forward was not warned about either.
    ranks = run_distributed(A.train_taggers, 2, [(False, PIPELINE), (True, PIPELINE)],
                            timeout=180)
    _check_taggers(ranks)


@pytest.mark.slow
def test_a_models_own_weighted_loss_under_a_pipeline_with_data_replicas() -> None:
    plan = f"dp=2,{PIPELINE}"
    ranks = run_distributed(A.train_taggers, 4, [(False, plan), (True, plan)], timeout=300)
    _check_taggers(ranks)


def _check_held(ranks: list[list[dict[str, Any]]]) -> None:
    """Each holder's loss module is found: evaluated and trained as one device, silently."""
    for exact in ranks[0]:
        want = A.tagger_reference(exact["holder"])
        _assert_as_one_device(exact, want)
        assert abs(exact["evaluated"] - want["losses"][0]) <= 1e-5 * want["losses"][0], exact
    for rank in ranks:
        for job in rank:
            assert job["warnings"] == [], (job["holder"], job["warnings"])


def test_a_models_own_weighted_loss_held_outside_the_last_stage() -> None:
    # The loss module held by the stem (registered before the blocks) or two levels down in
    # the first block, both the first stage's modules, and called after the blocks: the last
    # stage held a stand-in there, which refused the call ("embed.loss_fct is called on a
    # pipeline stage that does not hold it"); in a first run.step, not run.evaluate, both
    # ranks hung in the schedule instead. One held by a wrapper, registered first, was found.
    # One kept in an nn.ModuleDict of the stem, or an nn.ModuleList of the first block, and
    # indexed there failed on the last stage: "'PipelineSkip' object is not subscriptable".
    jobs = [(holder, PIPELINE) for holder in A.HOLDERS]
    _check_held(run_distributed(A.train_taggers, 2, jobs, timeout=180))


@pytest.mark.slow
def test_a_models_own_weighted_loss_held_outside_the_last_stage_with_data_replicas() -> None:
    # The ModuleDict and ModuleList holders keep a projection beside the loss module that no
    # forward uses, as on one device: data replicas need find_unused for it, as under dp=2 alone.
    jobs = [(holder, f"dp=2,{PIPELINE}" + (",find_unused" if holder in A.UNUSED else ""))
            for holder in A.HOLDERS]
    _check_held(run_distributed(A.train_taggers, 4, jobs, timeout=300))


def test_a_pipeline_stage_parameter_no_forward_uses_is_told_find_unused() -> None:
    # A stage's parameter no forward uses (the stem's unused projection) left DDP's reducer
    # waiting: the second step died with torch's advice to pass find_unused_parameters to DDP,
    # which a plait user cannot do. Said as under data parallelism alone: the plan's fix.
    with pytest.raises(WorkerError, match=r"parameters of \w+ \(\S*losses.proj.weight, "
                                          r"\S*losses.proj.bias\) got no gradient on this "
                                          r"rank.*add find_unused to the plan \(e.g. "
                                          r"'dp_replicate=2,pp=2,microbatches=2,find_unused'\)"):
        run_distributed(A.train_taggers, 4, [("dict", f"dp=2,{PIPELINE}")], timeout=180)


def test_cross_attention_to_a_second_input_trains_as_one_device_under_cp() -> None:
    # An encoder-decoder plait cannot name (forward(src, tgt), no config): both inputs are
    # cut at the same positions and the keys gathered whole, so its cross-attention is one
    # device's, as are a model reading two inputs as one sequence and one projecting its
    # keys and values on a path of their own. None of them is refused.
    # A source and a target of two lengths cannot be cut alike: refused, naming the input
    # (it was told its "per-row targets (a class per sequence) are not per-token").
    names = ("seq2seq", "two_input", "projected_kv")
    got = run_distributed(A.train_sequences, 2,
                          [(n, "cp=2") for n in (*names, "seq2seq/lengths")], timeout=180)[0]
    for result in got[:-1]:
        _assert_as_one_device(result, A.sequence_reference(result["name"]))
    said = got[-1]["refused"]
    assert "batch[0]['tgt'] has 8 positions" in said and "first input has 4" in said, said
    assert "give both one length" in said, said


def test_transformers_own_plan_returns_no_attention_weights_under_tp() -> None:
    # Under tp=2 each rank's eager attention computes its own heads' weights only: transformers'
    # own plan returned them as each layer's output_attentions, (4, 2, 16, 16) where one
    # device returns (4, 4, 16, 16). Now none, as the model's SDPA form and plait's inferred
    # plan return; the hidden states are one device's. The plan names the weights' place in
    # the attention's output, as an inferred plan does; the SDPA form's plan names none.
    for got in run_distributed(A.hf_attentions, 2, "tp=2", timeout=180):
        assert got["head_outputs"] == {"model.layers.*.self_attn": (1,)}, got
        assert got["sdpa_head_outputs"] == {}, got
        assert got["one_device"] == [(4, 4, 16, 16)] * 2, got
        assert got["attentions"] == [], got
        assert got["hidden"] < 1e-5, got
