"""Tensor-parallel plans inferred for models torch.fx cannot trace, of T5's and CLIP's shapes.

A forward that needs two inputs (an encoder-decoder's ``decoder_input_ids``, a two-tower
model's ``pixel_values``) gets them guessed from its parameters' names, so that the blocks
fx cannot trace are recorded from one run; a table with one column per head in an attention
block (T5's relative position bias) is split with the heads; projection heads side by side
on the root stay whole; sequence parallelism splits each stack's own sequence (the decoder's
cross-attention reads the encoder's whole output), or is refused naming the stack that cannot
take it.

Default run: inference on Hugging Face T5, BART and CLIP built from configs (no process group),
and models written for the test trained under tp=2 and tp=2,sp (AdamW) against one device, in
one process group. The Hugging Face models trained: slow; ``plait check`` on them is in
tests/test_encoder_decoder.py (slow).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from plait.parallel.tp_example import Example, example_call
from plait.parallel.tp_infer import infer_plan, verify_plan
from plait.parallel.tp_plans import TPPlan
from plait.planner.tp_block import tp_block
from plait.spawn import run_distributed
from tests import _workers_encdec as E
from tests import _workers_tp_encdec as T

TOL = 1e-5  # fp32: losses and every parameter after AdamW steps
STACKS = "stacks of blocks whose layers the plan splits"
CROSS = ("whose decoder attends to the encoder's whole output (cross-attention), a sequence of "
         "its own that the slices of one do not split: use tp or dp for encoder-decoder models "
         "(cp=1)")


def _assert_as_one_device(ref: dict, got: dict, tol: float = TOL,
                          noise: tuple[str, ...] = ()) -> None:
    """Losses and every parameter within ``tol``, but those whose names end in ``noise``."""
    assert "refused" not in got, got
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True)):
        assert abs(a - b) <= TOL, (got["plan"], step, a, b)
    assert set(got["state"]) == set(ref["state"]), (got["plan"], sorted(got["state"]))
    for name, want in ref["state"].items():
        diff = (got["state"][name] - want).abs().max().item()
        assert diff <= tol or name.endswith(noise), (got["plan"], name, diff)


def _assert_split(got: dict, name: str, lengths: tuple[int, int], sp: bool) -> None:
    """The norms :data:`T.PROBES` names saw one rank's half of each stack's sequence under
    sp, the whole of it without."""
    want = {probe: n // 2 if sp else n for probe, n in zip(T.PROBES[name], lengths,
                                                             strict=True)}
    assert got["lengths"] == want, (got["plan"], got["lengths"], want)


def _assert_weights_dropped(got: dict, name: str) -> None:
    """The attention block :data:`T.WEIGHTS` names returned None for its weights in every
    forward (each rank holds its own heads' weights only)."""
    assert got["weights"] and all(got["weights"]), (got["plan"], name, got["weights"])


def test_models_fx_cannot_trace_train_as_one_device_under_tp_and_sp():
    """An encoder-decoder with a relative position bias in block 0 of each stack (and
    cross-attention, a head tied to the embedding) and two towers with projection heads and a
    temperature: tp=2 and tp=2,sp train what one device trains; under sp each stack's blocks
    run on half of its own sequence (the encoder's 6 source positions, the decoder's 4 target
    positions; the text tower's 6 tokens, the image tower's 4 patches). The encoder-decoder
    whose attention returns its softmax beside its output (as eager attention does) trains the
    same, its attention weights returned as None. cp=2 refuses the encoder-decoder at
    run.parallelize, naming its stacks, though its forward takes position_ids."""
    jobs = [("tp=2", "seq2seq"), ("tp=2", "towers"), ("tp=2,sp", "seq2seq"),
            ("tp=2,sp", "towers"), ("tp=2", "weights_seq2seq"), ("tp=2,sp", "weights_seq2seq"),
            ("cp=2", "kwargs_seq2seq")]
    got = run_distributed(T.train, 2, jobs, timeout=240)[0]
    assert got[-1]["refused"] == (
        f"context parallelism (cp=2) splits one sequence per batch row over the cp ranks, and "
        f"KwargsSeq2Seq is an encoder-decoder (stacks encoder.block and decoder.block), "
        f"{CROSS}"), got[-1]
    for (plan, name), result in zip(jobs[:-1], got[:-1], strict=True):
        _assert_as_one_device(T.reference(name), result)
        lengths = (6, 4) if name == "towers" else (T.SRC, T.TGT)
        _assert_split(result, name, lengths, sp=plan.endswith("sp"))
        if name in T.WEIGHTS:
            _assert_weights_dropped(result, name)


def test_sp_is_refused_naming_the_stack_that_cannot_take_it():
    """A decoder whose blocks shift tokens outside their regions, an image tower whose blocks
    hold a BatchNorm, one whose forward adds the blocks' residuals outside them: sp is refused
    before any sharding, naming both stacks, the one that cannot split its sequence and why."""
    shifted = T.shifted_seq2seq()
    plan = verify_plan(shifted, infer_plan(shifted), 2, sp=True)
    assert not plan.supports_sp and plan.sp_refused.startswith(
        f"it has 2 {STACKS} (encoder.block.*, decoder.block.*), each splitting its own "
        f"sequence, and decoder.block.* cannot: decoder.block.0 does not treat positions one "
        f"by one outside its tensor-parallel regions"), plan.sp_refused
    assert plan.styles["decoder.block.*.cross"] == "region"
    bn = T.batchnorm_towers()
    plan = verify_plan(bn, infer_plan(bn), 2, sp=True)
    assert not plan.supports_sp and plan.sp_refused == (
        f"it has 2 {STACKS} (text_model.layers.*, vision_model.layers.*), each splitting its "
        f"own sequence, and vision_model.layers.* cannot: vision_model.layers.0.norm_2.bn is a "
        f"BatchNorm, whose statistics would cover one rank's positions"), plan.sp_refused
    outer = T.outer_residual_towers()
    plan = verify_plan(outer, infer_plan(outer), 2, sp=True)
    assert not plan.supports_sp and plan.sp_refused.startswith(
        f"it has 2 {STACKS} (text_model.layers.*, vision_model.layers.*), each splitting its "
        f"own sequence, and vision_model.layers.* cannot: its forward adds "
        f"vision_model.layers.0's output to that block's input outside the block"), \
        plan.sp_refused


@pytest.mark.slow
def test_gated_feed_forwards_and_hugging_face_t5_train_as_one_device_under_tp():
    """The gated form (``wi_0``, ``wi_1``), and T5 from configs (T5 v1.1's gated-gelu with an
    untied head too): their inferred plans under tp=2, AdamW, against one device."""
    names = ["gated_seq2seq", "hf_t5", "hf_t5_gated", "hf_t5_eager", "hf_t5_gated_eager"]
    got = run_distributed(T.train, 2, [("tp=2", n) for n in names], timeout=400)[0]
    for name, result in zip(names, got, strict=True):
        _assert_as_one_device(T.reference(name), result)
        if name in T.WEIGHTS:
            _assert_weights_dropped(result, name)


@pytest.mark.slow
def test_hugging_face_encoder_decoders_and_clip_train_as_one_device_under_tp_and_sp():
    """T5 (its relative position bias computed in block 0 of each stack on the whole
    sequence, which the attention region gathers, and handed on), T5 v1.1, BART and CLIP from
    configs under tp=2,sp: one device's losses and parameters, each stack's blocks on half of
    its own sequence. CLIP's key biases are left out of the parameters compared: softmax
    ignores them, so their gradient is rounding noise that AdamW scales to a step (tp alone
    moves them as far)."""
    names = ["gated_seq2seq", "hf_t5", "hf_t5_gated", "hf_bart", "hf_clip", "hf_t5_eager",
             "hf_t5_gated_eager"]
    got = run_distributed(T.train, 2, [("tp=2,sp", n) for n in names], timeout=540)[0]
    for name, result in zip(names, got, strict=True):
        if name == "hf_clip":
            _assert_as_one_device(T.reference(name), result, tol=1e-4, noise=("k_proj.bias",))
            _assert_split(result, name, (6, 50), sp=True)
            continue
        _assert_as_one_device(T.reference(name), result)
        if name in T.PROBES:
            _assert_split(result, name, (T.SRC, T.TGT), sp=True)
        if name in T.WEIGHTS:
            _assert_weights_dropped(result, name)


def test_the_inferred_plans_of_the_models_written_for_the_test():
    """The relative bias table is split by its columns (heads) in block 0 only; the towers'
    projections and temperature are not in the plan (whole on every rank)."""
    seq = infer_plan(T.seq2seq())
    for stack in ("encoder", "decoder"):
        assert seq.styles[f"{stack}.block.*.attn.relative_attention_bias"] == "colwise"
        assert seq.styles[f"{stack}.block.*.attn.o"] == "rowwise"
        assert seq.divide_attrs[f"{stack}.block.*.attn"] == ("n_heads",)
    assert seq.styles["decoder.block.*.cross.k"] == "colwise"
    # Cross-attention is a region whose boundary replicates the queries' input; k and v read
    # the encoder's output, each all-reducing its own input's gradient: the planner counts a
    # decoder block's backward all-reduces as self-attention 1, cross-attention 3 (the
    # region's, k's, v's), MLP 1.
    assert seq.styles["decoder.block.*.cross"] == "region"
    assert sorted(seq.side_inputs) == ["decoder.block.*.cross.k", "decoder.block.*.cross.v"]
    priced = tp_block(T.seq2seq(), "decoder.block.1", (seq, False))
    assert priced is not None and priced.backward == (T.WIDTH,) * 5, priced
    # The plan printed for a user to copy into options.tp_plan keeps them, so the copy is
    # priced the same.
    copied = TPPlan.from_option(json.loads(json.dumps(seq.to_dict())))
    assert copied.side_inputs == seq.side_inputs
    assert tp_block(T.seq2seq(), "decoder.block.1", (copied, False)) == priced
    with pytest.raises(ValueError, match="side_inputs='decoder.block.*.cross.k': give a list"):
        TPPlan.from_option({"styles": seq.styles, "side_inputs": "decoder.block.*.cross.k"})
    assert seq.styles["shared"] == "vocab_embedding" and seq.styles["lm_head"] == "vocab_head"
    gated = infer_plan(T.gated_seq2seq()).styles
    assert [gated[f"encoder.block.*.ff.{n}"] for n in ("wi_0", "wi_1", "wo")] == [
        "colwise", "colwise", "rowwise"]
    towers = infer_plan(T.towers()).styles
    assert not [g for g in towers if "projection" in g], towers
    assert towers["vision_model.layers.*.attn.q"] == "colwise"


def test_inputs_are_guessed_by_the_names_of_the_forwards_parameters():
    """One tensor when it runs; else token ids for each ``*input_ids`` and images of the
    first size that runs for ``pixel_values``; else the one-tensor guess."""
    guess = example_call(T.seq2seq())
    assert isinstance(guess, Example) and not guess.args
    assert set(guess.kwargs) == {"input_ids", "decoder_input_ids"}
    images = example_call(T.towers())
    assert images is not None and images.kwargs["pixel_values"].shape[:2] == (2, 3)
    one = example_call(nn.Sequential(nn.Linear(4, 4)))
    assert one is not None and one.args[0].shape == (2, 4) and not one.kwargs

    class Unnamed(nn.Module):  # two inputs named otherwise: nothing runs, the guess stays
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 4)

        def forward(self, ids: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
            return self.emb(ids) + other

    fallback = example_call(Unnamed())
    assert fallback is not None and len(fallback.args) == 1 and not fallback.kwargs


def test_linears_sharing_an_input_without_an_output_linear_are_still_refused():
    """Heads side by side stay whole only when each reads a value of its own: q, k, v of one
    input with no output projection are a block inference cannot read."""
    class NoOutput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(8, 8) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.q(x) @ self.k(x).transpose(-1, -2)).softmax(-1) @ self.v(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = NoOutput()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x)

    with pytest.raises(ValueError, match=r"attn \(NoOutput\): linear\(s\) .* produce the block "
                                         r"output directly"):
        infer_plan(Net())


@pytest.mark.parametrize("gated", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["relu", "gated-gelu"])
def test_hugging_face_t5_gets_a_plan_checked_before_any_sharding(gated):
    """fx cannot trace T5Attention: the blocks are recorded from one fake-tensor forward on
    guessed ``input_ids`` and ``decoder_input_ids``; block 0's relative_attention_bias is split
    with the heads; the plan passes the shape and head-swap checks; SP is refused by name."""
    model = E.t5_gated()[0] if gated else E.t5()[0]
    plan = verify_plan(model, infer_plan(model), 2)
    ff = ("wi_0", "wi_1", "wo") if gated else ("wi", "wo")
    for stack in ("encoder", "decoder"):
        attn = f"{stack}.block.*.layer.*.SelfAttention"
        assert [plan.styles[f"{attn}.{n}"] for n in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
        assert plan.styles[f"{attn}.relative_attention_bias"] == "colwise"
        assert plan.divide_attrs[attn] == ("n_heads",)
        assert [plan.styles[f"{stack}.block.*.layer.*.DenseReluDense.{n}"] for n in ff] == [
            "colwise"] * (len(ff) - 1) + ["rowwise"]
    assert plan.styles["decoder.block.*.layer.*.EncDecAttention.k"] == "colwise"
    assert plan.styles["decoder.block.*.layer.*.EncDecAttention"] == "region"
    sp = verify_plan(model, infer_plan(model), 2, sp=True)
    assert sp.supports_sp and sp.sp_stacks == ("encoder.block.*", "decoder.block.*"), sp


def test_hugging_face_bart_gets_sp_in_both_stacks():
    """BART's cross-attention (``encoder_attn``) is a region: its queries' sequence is
    gathered at its boundary and its keys and values read the encoder's whole output."""
    model = E.bart()[0]
    sp = verify_plan(model, infer_plan(model), 2, sp=True)
    assert sp.styles["model.decoder.layers.*.encoder_attn"] == "region"
    assert sp.supports_sp and sp.sp_stacks == (
        "model.encoder.layers.*", "model.decoder.layers.*"), sp


def test_hugging_face_clip_gets_a_plan_with_its_projections_whole():
    model = E.clip_model()
    plan = verify_plan(model, infer_plan(model), 2)
    for tower in ("text_model", "vision_model"):
        layer = f"{tower}.encoder.layers.*"
        assert plan.styles[f"{layer}.self_attn.out_proj"] == "rowwise"
        assert plan.styles[f"{layer}.mlp.fc1"] == "colwise"
    assert not [g for g in plan.styles if "projection" in g or "logit" in g], plan.styles
    sp = verify_plan(model, infer_plan(model), 2, sp=True)
    assert sp.supports_sp and sp.sp_stacks == (
        "text_model.encoder.layers.*", "vision_model.encoder.layers.*"), sp


def test_context_parallelism_refuses_hugging_face_encoder_decoders_by_their_stacks():
    """T5 (SDPA and eager attention), T5 v1.1 and BART: cp=2 is refused before any sharding,
    naming the stacks; a decoder-only Llama, whose forward also takes ``**kwargs``, is not."""
    from plait.parallel.context import cp_refusal
    from tests._workers_cp import hf_llama

    for model, stacks in ((E.t5()[0], "encoder.block and decoder.block"),
                          (E.t5(attn="eager")[0], "encoder.block and decoder.block"),
                          (E.t5_gated()[0], "encoder.block and decoder.block"),
                          (E.bart()[0], "model.encoder.layers and model.decoder.layers")):
        assert cp_refusal(model, 2) == (
            f"context parallelism (cp=2) splits one sequence per batch row over the cp ranks, "
            f"and {type(model).__name__} is an encoder-decoder (stacks {stacks}), {CROSS}")
    assert cp_refusal(hf_llama(), 2) is None


def test_attention_weights_returned_beside_the_output_get_the_plan_without_them():
    """An attention block that returns its softmax beside its output (eager attention's
    weights: per head, from q and k alone) gets the plan the same block without them gets,
    and the plan names where they sit, to return None there under tp; the plan a user copies
    keeps that. Hugging Face T5 built with attn_implementation="eager" gets its SDPA form's
    plan, sequence parallelism included (T5 v1.1's gated form: trained in the slow tests)."""
    plan = infer_plan(T.weights_seq2seq())
    assert plan.styles == infer_plan(T.seq2seq()).styles
    assert plan.head_outputs == {"encoder.block.*.attn": (2,), "decoder.block.*.attn": (2,),
                                 "decoder.block.*.cross": (2,)}
    copied = TPPlan.from_option(json.loads(json.dumps(plan.to_dict())))
    assert copied.head_outputs == plan.head_outputs
    with pytest.raises(ValueError, match=r"head_outputs=\{'attn': \[0\]\}: give a mapping"):
        TPPlan.from_option({"styles": plan.styles, "head_outputs": {"attn": [0]}})
    eager, sdpa = E.t5(attn="eager")[0], E.t5()[0]
    assert eager.config._attn_implementation == "eager"
    got = verify_plan(eager, infer_plan(eager), 2, sp=True)
    want = infer_plan(sdpa)
    assert got.styles == want.styles and got.divide_attrs == want.divide_attrs
    assert got.supports_sp and got.sp_stacks == ("encoder.block.*", "decoder.block.*"), got
    assert got.head_outputs == {f"{stack}.block.*.layer.*.{attn}": (2,) for stack, attn in (
        ("encoder", "SelfAttention"), ("decoder", "SelfAttention"),
        ("decoder", "EncDecAttention"))}
    assert not want.head_outputs
