"""Tensor + sequence parallelism on shapes of model plait must get right or refuse clearly.

A residual added outside a block that returns a tuple (``h = h + layer(h)[0]``, the Hugging
Face style of many layers) or a mapping: sequence parallelism refuses it by name, on one stack
and on two, before anything is sharded (it used to fail later on a shape mismatch); a pipeline
adds zero for a block another stage holds (it used to add its input again, training another
model without an error). An image model whose forward's input is not called ``pixel_values``
(a convolution stem, then blocks over the patches): checked on images and trained under SP as
one device, or, where no guessed size fits, refused naming the input tried. An
encoder-decoder with a source of 48 tokens and a target of 16, and two towers of 6 tokens and
4 patches: the planner (``plait plan --stack-seq``) and the ledger's expected column price
each stack on its own sequence, to the byte and the call the ledger measures.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.parallel.pipeline_split import additive_modules
from plait.parallel.tp_example import example_call
from plait.parallel.tp_infer import infer_plan, verify_plan
from plait.plan import Plan
from plait.spawn import run_distributed
from tests import _workers_sp_shapes as S

TOL = 1e-5  # fp32: losses and every parameter after AdamW steps
OUTSIDE = "its forward adds {}'s output to that block's input outside the block"


def _assert_as_one_device(ref: dict, got: dict, tol: float = TOL) -> None:
    assert "refused" not in got, got
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True)):
        assert abs(a - b) <= tol * max(1.0, abs(a)), (got["plan"], step, a, b)
    assert set(got["state"]) == set(ref["state"]), (got["plan"], sorted(got["state"]))
    for name, want in ref["state"].items():
        diff = (got["state"][name] - want).abs().max().item()
        assert diff <= tol, (got["plan"], name, diff)


@pytest.mark.parametrize("form", ["tuple", "dict", "attr"])
def test_a_residual_outside_a_block_returning_a_tuple_refuses_sp(form):
    """``h = h + layer(h)[0]`` (or ``["hidden_states"]``, ``.last_hidden_state``): found by
    torch.fx, and SP refused naming the first block."""
    model = S.tuple_residual_lm(form)
    assert additive_modules(model, "layers") >= {"layers.0", "layers.1"}
    plan = verify_plan(model, infer_plan(model), 2, sp=True)
    assert not plan.supports_sp and plan.sp_refused.startswith(OUTSIDE.format("layers.0")), \
        plan.sp_refused


def test_a_tuple_residual_in_one_of_two_stacks_refuses_sp_naming_it():
    """Two towers, the image tower adding its layers' first outputs in a forward fx cannot
    trace (found by running it on the meta device): SP is refused naming both stacks and the
    image tower's first block."""
    model = S.tuple_residual_towers()
    plan = verify_plan(model, infer_plan(model), 2, sp=True)
    assert not plan.supports_sp and plan.sp_refused.startswith(
        "it has 2 stacks of blocks whose layers the plan splits (text_model.layers.*, "
        "vision_model.layers.*), each splitting its own sequence, and vision_model.layers.* "
        "cannot: " + OUTSIDE.format("vision_model.layers.0")), plan.sp_refused


def test_an_auxiliary_output_summed_over_blocks_is_not_a_residual():
    """A block returning ``{"hidden_states": ..., "attention": ...}`` whose forward takes the
    hidden states as they are and sums the other output over the blocks (an auxiliary loss):
    no block output is added to its input, so SP applies."""
    model = S.aux_summing_lm()
    assert not additive_modules(model, "layers") & {"layers.0", "layers.1"}
    plan = verify_plan(model, infer_plan(model), 2, sp=True)
    assert plan.supports_sp and plan.sp_blocks == "layers.*", plan.sp_refused


def test_a_tuple_residual_trains_as_one_device_under_pp2_and_sp_is_refused():
    """pp=2: the stand-in of the block the other stage holds returns a tuple whose first item
    is zero, so the residual adds nothing twice (losses and AdamW's parameters as one device);
    tp=2,sp: refused in parallelize, naming the block."""
    jobs = [("pp=2,mb=2", "tuple_residual_lm"), ("tp=2,sp", "tuple_residual_lm")]
    piped, refused = run_distributed(S.train, 2, jobs, timeout=300)[0]
    _assert_as_one_device(S.reference("tuple_residual_lm"), piped)
    assert OUTSIDE.format("layers.0") in refused.get("refused", ""), refused


@pytest.mark.parametrize("factory", [S.embedded_positions_vit, S.head_first_vit])
def test_an_image_model_whose_input_is_not_pixel_values_is_checked_on_images(factory):
    """``forward(self, images)`` with a convolution stem: a position table that is an
    ``nn.Embedding`` (token ids were guessed) or a head registered before the stem (features
    were guessed) no longer hides the images its forward takes: the first size that runs, for
    real too (an ``nn.Embedding`` indexed by patch runs on fake tensors of any size), is the
    input, its fx-untraceable blocks are recorded from it, and SP is checked and applies."""
    model = factory()
    example = example_call(model)
    assert example is not None and [tuple(a.shape) for a in example.args] == [(2, 3, 32, 32)]
    plan = verify_plan(model, infer_plan(model), 2, sp=True)
    assert plan.supports_sp and plan.sp_blocks == "layers.*", plan.sp_refused


def test_an_image_model_no_guessed_size_fits_is_refused_naming_the_input():
    """A position table of 25 patches (40x40 images, a size plait does not try): the inferred
    plan is refused, with sequence parallelism or without, naming what was tried, why it
    failed (not as a forward that reads values) and example=: no check can run on it, and
    without sp the plan was used unchecked; where the blocks must be recorded from a forward,
    inference says so."""
    model = S.odd_sized_vit(traced=True)
    for sp in (True, False):
        with pytest.raises(ValueError) as refused:
            verify_plan(model, infer_plan(model), 2, sp=sp)
        said = str(refused.value)
        assert said.startswith(
            "tp=2: the tensor-parallel plan inferred for PatchViT cannot be checked: its forward "
            "does not run on any input plait guessed for it (tried a tensor of shape (2, 16), "
            "images of 3 channels and 224, 32, 64, 256, 28, 384, 128, 512, 16 pixels a side "
            "for its convolution stem, on the first: in stem"), said
        assert "reads values" not in said and "example=loader.batch(0)" in said, said
    untraced = S.odd_sized_vit(traced=False)
    with pytest.raises(ValueError, match=r"layers\.\*\.attn \(Attention\): torch.fx cannot trace "
                       r"it .*; nor does the model's forward run on any input plait guessed to "
                       r"record it instead \(tried a tensor of shape \(2, 16\); images of 3 "
                       r"channels"):
        infer_plan(untraced)


def test_image_models_whose_input_is_not_pixel_values_train_as_one_device_under_tp_sp():
    """tp=2,sp on both: losses and AdamW's parameters as one device, 32x32 images, the
    blocks' norms on 8 of the 16 patches."""
    names = ["embedded_positions_vit", "head_first_vit"]
    got = run_distributed(S.train, 2, [("tp=2,sp", n) for n in names], timeout=300)[0]
    for name, result in zip(names, got, strict=True):
        _assert_as_one_device(S.reference(name), result)
        assert set(result["lengths"]) == {8}, (name, result["lengths"])


def _seq2seq_stats() -> Any:
    """:func:`S.plain_seq2seq` read as ``plait plan`` reads a factory's model (on the meta
    device): the decoder is the main stack, the encoder a further one its embedding feeds."""
    from plait.planner.model_stats import load_model

    with torch.device("meta"):
        stats = load_model(S.plain_seq2seq())
    assert stats.stack_first == "decoder.block.0", stats.stack_first
    assert [(m.first, m.n_layers, m.embedded) for m in stats.more_stacks] == [
        ("encoder.block.0", 2, True)], stats.more_stacks
    return stats


def _tp_rows(traffic: list) -> dict[str, tuple[float, float]]:
    rows: dict[str, tuple[float, float]] = {}
    for t in traffic:
        if t.axis == "tp":
            got = rows.get(t.op, (0.0, 0.0))
            rows[t.op] = (got[0] + t.payload, got[1] + t.calls)
    return rows


def _planner_rows(plan: str, stacks: tuple[tuple[str, int], ...]) -> dict:
    """The planner's tp rows {op: (bytes, calls)} per step, each stack's sequence given by its
    first block (the main stack, the decoder, at TGT): the ledger's (``rank_traffic``) and
    what ``evaluate`` prices, which must agree."""
    from plait.planner import constants_for
    from plait.planner.cost import Workload, evaluate, rank_traffic
    from plait.planner.hardware import load_cluster

    stats, p = _seq2seq_stats(), Plan.from_string(plan)
    per_rank = rank_traffic(p, stats, S.BATCH, S.TGT, dict(stacks))
    assert per_rank is not None
    cluster = load_cluster("cpu", devices=p.world_size)
    work = Workload(S.BATCH, S.TGT, stack_seqs=tuple(
        (first, n) for first, n in stacks if first != stats.stack_first))
    priced = evaluate(p, stats, cluster, work, constants_for(cluster))
    assert priced.traffic is not None
    assert _tp_rows(priced.traffic) == _tp_rows(per_rank[0])
    return _tp_rows(per_rank[0])


def test_two_towers_of_different_lengths_are_each_priced_at_their_own():
    """A text tower on 6 tokens and an image tower on 4 patches (a convolution stem, no
    vocabulary-parallel embedding or head) under tp=2,sp: the ledger's expected column equals
    what it measures on every row, calls too (the stacks' ends are gathered; nothing is
    all-reduced for an embedding or head the plan does not split)."""
    comm = run_distributed(S.towers_ledger, 2, "tp=2,sp", timeout=300)[0]
    assert not any("no 'expected' column" in n for n in comm["notes"]), comm["notes"]
    assert {r["op"] for r in comm["rows"] if r["axis"] == "tp"} == {
        "all_gather", "reduce_scatter", "all_reduce"}, comm["rows"]
    for r in comm["rows"]:
        assert r["ratio"] == pytest.approx(1.0, abs=1e-12), r
        assert r["count"] == r["expected_calls"], r


def test_the_planner_prices_an_encoder_at_its_own_length():
    """The encoder's sequence (the decoder's fixed at 16) moves the planner's memory (its
    blocks' saved activations) and step time (their FLOPs and collectives)."""
    from plait.planner import constants_for
    from plait.planner.cost import Workload, evaluate
    from plait.planner.hardware import load_cluster

    stats, plan = _seq2seq_stats(), Plan.from_string("tp=2,sp")
    cluster = load_cluster("cpu", devices=2)
    est = [evaluate(plan, stats, cluster, Workload(S.BATCH, S.TGT, stack_seqs=(
        ("encoder.block.0", n),)), constants_for(cluster)) for n in (16, 48, 480)]
    acts = [e.memory_breakdown["activations"] for e in est]
    times = [e.step_time_s for e in est]
    assert acts[0] < acts[1] < acts[2] and times[0] < times[1] < times[2], (acts, times)
    with pytest.raises(ValueError, match="stack_seqs: encoder.block.0=0 must be a positive"):
        Workload(S.BATCH, S.TGT, stack_seqs=(("encoder.block.0", 0),))


@pytest.mark.parametrize("plan", ["tp=2,sp", pytest.param("tp=2", marks=pytest.mark.slow)])
def test_each_stack_of_an_encoder_decoder_is_priced_at_its_own_length(plan):
    """An encoder-decoder with a source of 48 tokens and a target of 16 under tp=2 (with and
    without SP): the ledger's expected column and the planner's rows (each stack at its own
    length, the decoder's cross-attention all-reducing the gradient of the encoder's 48
    positions, the shared embedding called on both) equal the bytes and calls the ledger
    measures, per op; the same model priced with both stacks at one length does not."""
    comm = run_distributed(S.seq2seq_ledger, 2, plan, timeout=300)[0]
    assert not any("no 'expected' column" in n for n in comm["notes"]), comm["notes"]
    measured = {r["op"]: (r["payload_bytes"], r["count"]) for r in comm["rows"]
                if r["axis"] == "tp" and r["ranks"]}
    for r in comm["rows"]:
        assert r["ratio"] == pytest.approx(1.0, abs=1e-12), r
        assert r["count"] == r["expected_calls"], r
    own = _planner_rows(plan, (("encoder.block.0", S.SRC), ("decoder.block.0", S.TGT)))
    assert set(own) == set(measured), (own, measured)
    for op, (nbytes, calls) in measured.items():
        assert own[op][0] == pytest.approx(nbytes, rel=1e-12), (op, own, measured)
        assert own[op][1] == calls, (op, own, measured)
    one = _planner_rows(plan, ())  # every stack at the decoder's 16
    assert any(one[op][0] != measured[op][0] for op in measured), one


def test_plait_plan_takes_each_stacks_length(capsys):
    """``plait plan --stack-seq encoder.block.0=48`` prices the encoder on 48 tokens: the
    tp rows of ``--format json`` are :func:`_planner_rows`'; a block that starts no further
    stack is refused naming those that do."""
    import argparse
    import json

    from plait.planner.cli import add_plan_arguments, plan_command

    def plan(*more: str) -> int:
        parser = add_plan_arguments(argparse.ArgumentParser())
        return plan_command(parser.parse_args([
            "--model", "tests._workers_sp_shapes:plain_seq2seq", "--cluster", "cpu",
            "--devices", "2", "--global-batch", str(S.BATCH), "--seq", str(S.TGT),
            "--plan", "tp=2,sp", "--format", "json", *more]))

    assert plan("--stack-seq", f"encoder.block.0={S.SRC}") == 0
    traffic = json.loads(capsys.readouterr().out)["plans"][0]["traffic"]
    rows: dict[str, tuple[float, float]] = {}
    for t in traffic:
        if t["axis"] == "tp":
            got = rows.get(t["op"], (0.0, 0.0))
            rows[t["op"]] = (got[0] + t["payload_bytes"], got[1] + t["calls"])
    assert rows == _planner_rows("tp=2,sp", (("encoder.block.0", S.SRC),)), rows
    assert plan("--stack-seq", "decoder.block.0=48") == 2
    assert ("--stack-seq 'decoder.block.0=48': decoder.block.0 is not the first block of a "
            "further stack of tests._workers_sp_shapes:plain_seq2seq (its further stacks start "
            "at encoder.block.0)") in capsys.readouterr().err
