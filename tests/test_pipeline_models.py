"""Pipelines for the models people have, each under pp=2 against a plain one-process loop.

Dict batches in the Hugging Face convention (``{"input_ids", "attention_mask", "labels"}``),
a keyword input every stage needs (the attention mask: the test model's blocks mix the
unmasked positions, and GPT-2/BERT attend only to them), extra outputs (a tuple
``(logits, aux)``, a dict, a Hugging Face ``ModelOutput``, which the loss gets as one device's
loss does), pre-block modules that are more than a token embedding (BERT's embeddings, a
vision stem), and a split given by module names. Models and data: tests/_pipeline_models.py.

The reference is a plain loop (SGD, lr 0.1, torch's clipping at 1.0) over the same batches
from the same seed. Tolerance: 1e-6 relative on every step's loss, and on every parameter
after the last step 1e-6 relative to the tensor's largest entry (at least 1e-2): fp32 sums
taken in a different order, nothing more.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys

import pytest
import torch
import torch.nn.functional as F

from plait.plan import Plan
from plait.spawn import run_distributed
from tests import _pipeline_models as M
from tests._workers_semantics import train_jobs

REL, FLOOR = 1e-6, 1e-2
# The Hugging Face cases need the optional `hf` extra; the rest run without it.
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason="transformers is not installed (pip install plait[hf])")


def _assert_matches(ref: dict, got: dict) -> None:
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True)):
        assert abs(a - b) <= REL * abs(a), (got["plan"], step, a, b)
    assert set(got["state"]) >= set(ref["state"]), (got["plan"], sorted(got["state"]))
    for name, want in ref["state"].items():
        diff = (got["state"][name] - want).abs().max().item()
        assert diff <= REL * max(want.abs().max().item(), FLOOR), (got["plan"], name, diff)


@needs_hf
def test_the_mask_matters_and_the_data_counts_unevenly():
    """Without the attention mask the models compute something else (so a stage that missed it
    would fail the comparisons below), and microbatches count different numbers of labels."""
    batch = M.padded_batch(0)
    with torch.no_grad():
        for factory in (M.mixer_tuple, M.gpt2_lm):
            model = factory()
            with_mask = model(batch["input_ids"], attention_mask=batch["attention_mask"])
            without = model(batch["input_ids"])
            a, b = (with_mask[0], without[0]) if isinstance(with_mask, tuple) else \
                (with_mask.logits, without.logits)
            assert (a - b).abs().max() > 1e-2
    counts = (batch["labels"] != -100).reshape(4, -1).sum(1)
    assert len(set(counts.tolist())) > 1


@needs_hf
def test_dict_batches_masks_and_extra_outputs_pp2():
    """1F1B and GPipe: the test model returning (logits, aux) and a dict; Hugging Face GPT-2
    (tied embeddings) returning its ModelOutput, with a loss_fn reading .logits and with its
    own loss (loss_fn=None: the labels go to the last stage's model)."""
    batches = [M.padded_batch(s) for s in range(M.STEPS)]
    jobs = [("pp=2,mb=4", M.mixer_tuple, batches, M.mixer_loss),
            ("pp=2,schedule=gpipe,mb=2", M.mixer_dict, batches, M.mixer_loss),
            ("pp=2,mb=4", M.gpt2_lm, batches, M.logits_loss),
            ("pp=2,schedule=gpipe,mb=2", M.gpt2_lm, batches, None)]
    got = run_distributed(train_jobs, 2, jobs, timeout=300)[0]
    for (_, factory, _, loss_fn), result in zip(jobs, got, strict=True):
        _assert_matches(M.reference_loop(factory, batches, loss_fn), result)


@needs_hf
def test_pre_block_modules_and_named_split_pp2():
    """BERT's embeddings (word + position + token type + LayerNorm + dropout) and its head tied
    to the word embedding; a ConvNet's stem; a ConvNet whose stem outweighs its blocks, split
    by name (split_points=["blocks.2"] also names the block sequence); a ConvNet that pools and
    flattens between its blocks and its classifier, as torchvision's ResNet does."""
    berts = [M.bert_batch(s) for s in range(M.STEPS)]
    images = [M.image_batch(s) for s in range(M.STEPS)]
    named = Plan(pp=2, microbatches=4, options={"split_points": ["blocks.2"]})
    jobs = [("pp=2,mb=2", M.bert_mlm, berts, M.logits_loss),
            ("pp=2,mb=4", M.convnet, images, F.cross_entropy),
            (named, M.convnet_wide_stem, images, F.cross_entropy),
            ("pp=2,schedule=gpipe,mb=2", M.convnet_pooled, images, F.cross_entropy)]
    got = run_distributed(train_jobs, 2, jobs, timeout=300)[0]
    for (_, factory, batches, loss_fn), result in zip(jobs, got, strict=True):
        _assert_matches(M.reference_loop(factory, batches, loss_fn), result)


def test_what_the_forward_does_outside_the_blocks_runs_once():
    """Every stage runs the model's whole forward; what it does to the running activation
    outside the blocks (an activation module after the embedding, a scale, an activation
    between blocks) must not run again on hidden states a stage received. 1F1B and an
    interleaved schedule (a rank's second stage starts mid-sequence), against one device."""
    from functools import partial

    batches = [M.padded_batch(s) for s in range(M.STEPS)]
    jobs = [(plan, partial(M.changed_on_the_way, how), batches, M.mixer_loss)
            for how, plan in (("module", "pp=2,mb=4"), ("scale", "pp=2,mb=4"),
                              ("between", "pp=2,mb=4"),
                              ("scale", "pp=2,mb=4,pp_schedule=interleaved_1f1b,"
                                        "virtual_stages=2"))]
    got = run_distributed(train_jobs, 2, jobs, timeout=300)[0]
    for (_, factory, _, loss_fn), result in zip(jobs, got, strict=True):
        _assert_matches(M.reference_loop(factory, batches, loss_fn), result)


def test_a_change_before_a_residual_outside_the_block_is_refused():
    """The scale, then ``h = h + block.mlp(h)`` in the forward: a later stage's residual would
    read the scaled-again tensor; refused with where to move the change."""
    from functools import partial

    from plait.spawn import WorkerError

    batches = [M.padded_batch(0)]
    job = ("pp=2,mb=2", partial(M.changed_on_the_way, "residual"), batches, M.mixer_loss)
    with pytest.raises(WorkerError, match=r"ChangedOnTheWay's forward changes the hidden states "
                                          r"on their way to blocks.\d .*residual into the block"):
        run_distributed(train_jobs, 2, [job], timeout=300)


# ------------------------------------------------------------------ splits and bad input (pure)
@needs_hf
def test_split_points_name_the_block_sequence():
    """The largest container of the wide-stem ConvNet is its stem; split points in ``blocks``
    make ``blocks`` the block sequence. BERT's, GPT-2's and the test model's blocks are split
    by name as well."""
    from plait.parallel.pipeline_split import plan_stages

    wide = M.convnet_wide_stem()
    assert plan_stages(wide, Plan(pp=2, microbatches=2))[0] == "stem"
    path, specs = plan_stages(wide, Plan(pp=2, microbatches=2,
                                         options={"split_points": ["blocks.3"]}))
    assert path == "blocks" and [(s.start, s.end) for s in specs] == [(0, 3), (3, 4)]
    path, specs = plan_stages(M.bert_mlm(), Plan(pp=2, microbatches=2, options={
        "split_points": ["bert.encoder.layer.1"]}))
    assert path == "bert.encoder.layer" and [(s.start, s.end) for s in specs] == [(0, 1), (1, 4)]
    for factory, point, want in [(M.gpt2_lm, "transformer.h.3", "transformer.h"),
                                 (M.mixer_tuple, "blocks.3", "blocks")]:
        path, specs = plan_stages(factory(), Plan(pp=2, microbatches=2,
                                                  options={"split_points": [point]}))
        assert path == want and [(s.start, s.end) for s in specs] == [(0, 3), (3, 4)]


@pytest.mark.parametrize("points,match", [
    (["blocks.2", "stem.1"], r"name blocks of different containers \(blocks, stem\)"),
    (["head.linear.0"], r"'head.linear.0': head.linear is not a submodule of SmallConvNet"),
    (["blocks.1.conv1"], r"blocks.1 is a ConvBlock, not an nn.ModuleList.*e.g. layers.4"),
    (["blocks.9"], r"split point 'blocks.9' is not a block of blocks; blocks are blocks.0 .. "
                   r"blocks.3"),
])
def test_bad_split_points_name_the_module_and_the_fix(points, match):
    from plait.parallel.pipeline_split import plan_stages

    plan = Plan(pp=1 + len(points), pp_schedule="gpipe", microbatches=2,
                options={"split_points": points})
    with pytest.raises(ValueError, match=match) as info:
        plan_stages(M.convnet(), plan)
    assert "\n" not in str(info.value)


def _forward(input_ids, attention_mask=None, *, token_type_ids=None, labels=None):
    pass


def _no_labels(input_ids, attention_mask=None):
    pass


def _star(*args):
    pass


def _keywords_only(*, feats, scale=1.0):
    pass


_IDS = torch.zeros(4, 3, dtype=torch.long)


@pytest.mark.parametrize("batch,loss_fn,forward,match", [
    ({"input_ids": _IDS}, F.cross_entropy, _forward,
     r"a dict batch under pp > 1 needs a 'labels' entry \(keys: \['input_ids'\]\)"),
    ({"input_ids": _IDS, "label": _IDS}, F.cross_entropy, _forward,
     r"needs a 'labels' entry.*rename 'label' to 'labels' \(in the dataset's __getitem__"),
    ({"attention_mask": _IDS, "labels": _IDS}, F.cross_entropy, _forward,
     r"chains Net.forward's first parameter \(input_ids\).*no 'input_ids' entry"),
    ({"x": _IDS, "labels": _IDS}, F.cross_entropy, _star,
     r"Net.forward names no positional parameter \(it takes \*args\).*\['x'\]"),
    # torch's stages pass the chained input positionally: a keyword-only forward is told so
    # and how to change it (was "takes *args" and "the batch has no None entry").
    ({"feats": _IDS, "labels": _IDS}, F.cross_entropy, _keywords_only,
     r"Net.forward takes its inputs by keyword only \(feats, scale\).*"
     r"def forward\(self, feats, \*, ...\)"),
    (((_IDS, _IDS, _IDS, _IDS), _IDS), F.cross_entropy, _forward,
     r"names 2 positional parameters but the batch gives 4 inputs.*as a dict"),
    ({"input_ids": _IDS, "mask": _IDS, "labels": _IDS}, F.cross_entropy, _forward,
     r"Net.forward has no parameter 'mask'"),
    ((_IDS, _IDS), None, _forward, r"loss_fn=None under pp > 1 needs the Hugging Face dict"),
    ({"input_ids": _IDS, "labels": _IDS}, None, _no_labels,
     r"loss_fn=None: .*Net.forward has no parameter 'labels'; pass a loss_fn"),
    ({"input_ids": _IDS, "target": _IDS, "labels": _IDS}, F.cross_entropy, _forward,
     r"model input 'target' has the name of a keyword of torch's pipeline schedule step"),
    ((("text", _IDS), _IDS), F.cross_entropy, _forward, r"must be a tensor.*got str"),
    ((_IDS, _IDS, _IDS), F.cross_entropy, _forward, r"takes \(inputs, targets\) or a dict"),
])
def test_batches_the_stages_cannot_take_are_refused_in_one_line(batch, loss_fn, forward, match):
    from plait.parallel.pipeline import stage_inputs

    with pytest.raises(ValueError, match=match) as info:
        stage_inputs(batch, loss_fn, inspect.signature(forward), "Net")
    assert "\n" not in str(info.value)


def test_batch_layout_positional_dict_and_own_loss():
    from plait.parallel.pipeline import stage_inputs

    sig = inspect.signature(_forward)
    laid = stage_inputs(((_IDS, _IDS + 1), _IDS + 2), F.cross_entropy, sig, "Net")
    assert laid.first is _IDS and set(laid.every) == {"attention_mask"}
    hf = {"input_ids": _IDS, "token_type_ids": _IDS + 1, "labels": _IDS + 2}
    laid = stage_inputs(hf, None, sig, "Net")
    assert laid.first is _IDS and set(laid.every) == {"token_type_ids"}
    assert laid.last_only["labels"] is hf["labels"] and laid.targets is hf["labels"]
    assert stage_inputs(hf, F.cross_entropy, sig, "Net").last_only == {}
    laid = stage_inputs(((_IDS,), _IDS), F.cross_entropy, inspect.signature(_star), "Net")
    assert laid.first is _IDS and laid.every == {}


def test_a_forward_that_skips_its_last_block_is_refused_before_the_schedule():
    """The split check runs on a meta-device replica (no memory, no sends)."""
    from plait.parallel.pipeline import split_checker, stage_inputs
    from plait.parallel.pipeline_split import plan_stages

    model = M.skips_last_block()
    path, specs = plan_stages(model, Plan(pp=2, microbatches=2))
    check = split_checker(model, path, specs)
    laid = stage_inputs(M.padded_batch(0), M.mixer_loss, inspect.signature(model.forward),
                        "SkipsLastBlock")
    with pytest.raises(ValueError, match=r"SkipsLastBlock's forward did not call its block "
                                         r"blocks.2 on pipeline stage 0.*or run with pp=1"):
        check(laid)
    assert all(p.device.type == "cpu" for p in model.parameters())  # the model is untouched
    good = M.mixer_tuple()
    split_checker(good, *plan_stages(good, Plan(pp=2, microbatches=2)))(laid)


def test_blocks_that_do_not_form_a_chain_are_refused():
    """A dense mixture of experts with no stack of layers: plait's default block sequence is
    its experts list, and every expert reads the same input. Refused when the model is split
    (a meta-device forward on a guessed input), by the planner's question, on every rank of a
    real pp=2 job, and, when no input can be guessed, on the first step's real inputs."""
    from plait.parallel.pipeline import pp_refusal, split_checker, stage_inputs
    from plait.parallel.pipeline_split import plan_stages
    from plait.spawn import WorkerError

    plan = Plan(pp=2, microbatches=2)
    refusal = (r"the blocks of experts do not form a chain: DenseMoE's forward feeds experts.1 "
               r"an input not computed from experts.0's output .*options.pp_blocks.*pp=1")
    with pytest.raises(ValueError, match=refusal):
        plan_stages(M.dense_moe(), plan)
    assert pp_refusal(M.dense_moe(), plan).startswith("the blocks of experts do not form a chain")
    features = [(torch.randn(4, 8), torch.randn(4, 6))]
    with pytest.raises(WorkerError, match=refusal) as caught:
        run_distributed(train_jobs, 2, [("pp=2,mb=2", M.dense_moe, features, F.mse_loss)],
                        timeout=120)
    assert "failed too" in str(caught.value)  # both ranks refused, neither hung

    unguessable = M.DenseMoE(needs_temperature=True)
    path, specs = plan_stages(unguessable, plan)  # no verdict without the second input
    assert not specs[0].chained
    laid = stage_inputs(((torch.randn(4, 8), torch.tensor(2.0)), torch.randn(4, 6)),
                        F.mse_loss, inspect.signature(unguessable.forward), "DenseMoE")
    with pytest.raises(ValueError, match=refusal):
        split_checker(unguessable, path, specs)(laid)
    assert all(p.device.type == "cpu" for p in unguessable.parameters())


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_blocks_fed_through_the_parent_are_a_chain():
    """What the chain check must not mistake for alternatives: a residual in the parent, a
    frozen embedding, a block inside a reentrant checkpoint, a detached input."""
    from plait.parallel.pipeline_chain import chain_break, meta_replica
    from plait.parallel.pipeline_split import plan_stages

    model = M.chained_by_the_parent()
    ids = torch.randint(0, M.VOCAB, (2, M.SEQ))
    # Not broken; but two of its blocks could not be asked about: no verdict at the split,
    # so the first step asks again (on the real inputs).
    assert chain_break(meta_replica(model), "blocks", ids.to("meta"), {}) is None
    assert not plan_stages(model, Plan(pp=2, microbatches=2))[1][0].chained
    # A plain chain is seen whole at the split, and the first step does not ask again.
    assert chain_break(meta_replica(M.deep_mlp()), "", torch.randn(2, 12, device="meta"),
                       {}) is True
    assert plan_stages(M.deep_mlp(), Plan(pp=2, microbatches=2))[1][0].chained
    moe = meta_replica(M.dense_moe())
    assert chain_break(moe, "experts", torch.randn(2, 8, device="meta"), {}) == (
        "experts.0", "experts.1")
    assert moe.experts[0][0]._forward_hooks == {}  # the check leaves no hooks behind


@needs_hf
def test_hf_model_without_inputs_embeds_is_refused():
    """HF ViT's forward takes pixels only: later stages could not be given hidden states."""
    from transformers import ViTConfig, ViTForImageClassification

    from plait.parallel.pipeline_split import build_stage_module, plan_stages

    model = ViTForImageClassification(ViTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        image_size=8, patch_size=4, num_labels=3))
    path, specs = plan_stages(model, Plan(pp=2, microbatches=2))
    with pytest.raises(ValueError, match=r"ViTForImageClassification.forward takes no "
                                         r"inputs_embeds.*run this model with pp=1"):
        build_stage_module(model, path, specs[1])


@needs_hf
def test_hf_model_without_token_embeddings_is_refused():
    """Wav2Vec2's forward takes raw samples, and Hugging Face's get_input_embeddings raises
    NotImplementedError for it: refused in one line, not that error from the adapter."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    from plait.parallel.pipeline_split import build_stage_module, plan_stages

    model = Wav2Vec2ForCTC(Wav2Vec2Config(
        vocab_size=5, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, conv_dim=(8,), conv_kernel=(3,), conv_stride=(2,),
        num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2))
    path, specs = plan_stages(model, Plan(pp=2, microbatches=2))
    with pytest.raises(ValueError, match=r"^Wav2Vec2ForCTC .*run this model with pp=1"):
        build_stage_module(model, path, specs[1])


def test_every_rank_refuses_on_its_first_step():
    """No rank waits on another inside torch's runtime: both get the one line."""
    messages = run_distributed(M.refusal_worker, 2, timeout=120)
    assert all(m and "did not call its block blocks.2" in m for m in messages), messages


def test_batchnorm_in_microbatches_is_named():
    """BatchNorm normalises each microbatch (or accumulation step) by itself: a warning names
    the layer; with one piece per step there is none."""
    plans = ["pp=2,mb=2", "pp=2,schedule=gpipe,mb=1", "dp=2,sync_bn,grad_accum=2"]
    piped, whole, accum = run_distributed(M.batchnorm_warnings, 2, plans, timeout=120)[0]
    assert len(piped) == 1 and "stem.1" in piped[0] and "microbatches=2" in piped[0]
    assert whole == []
    assert len(accum) == 1 and "grad_accum=2" in accum[0] and "GroupNorm" in accum[0]


# ------------------------------------------------------------------ other schedules (slow)
@pytest.mark.slow
@needs_hf
def test_dict_batches_under_multi_stage_schedules():
    """Two stages per rank: interleaved 1F1B and ZB-V (rank 0 holds the first and the last
    stage, so the labels for the model's own loss reach it and its first stage drops them)."""
    batches = [M.padded_batch(s) for s in range(M.STEPS)]
    jobs = [("pp=2,schedule=interleaved_1f1b,v=2,mb=2", M.mixer_dict, batches, M.mixer_loss),
            ("pp=2,schedule=zbv,v=2,mb=2", M.mixer_tuple, batches, M.mixer_loss),
            ("pp=2,schedule=interleaved_1f1b,v=2,mb=2", M.gpt2_lm_untied, batches, None),
            ("pp=2,schedule=zbv,v=2,mb=2", M.bert_mlm_untied, [M.bert_batch(s) for s in
                                                              range(M.STEPS)], M.logits_loss)]
    got = run_distributed(train_jobs, 2, jobs, timeout=600)[0]
    for (_, factory, data, loss_fn), result in zip(jobs, got, strict=True):
        _assert_matches(M.reference_loop(factory, data, loss_fn), result)


@pytest.mark.slow
@needs_hf
def test_dict_batches_pp2_with_data_and_tensor_parallel():
    """World 4 on dict batches: pp=2 x dp=2 (the test model; GPT-2 with its own loss) and
    pp=2 x tp=2 (GPT-2, its tied embedding vocabulary-parallel on both stages)."""
    batches = [M.padded_batch(s) for s in range(M.STEPS)]
    jobs = [("pp=2,dp=2,mb=2", M.mixer_tuple, batches, M.mixer_loss),
            ("pp=2,dp=2,mb=2", M.gpt2_lm, batches, None),
            ("pp=2,tp=2,mb=2", M.gpt2_lm, batches, M.logits_loss)]
    got = run_distributed(train_jobs, 4, jobs, timeout=600)[0]
    for (_, factory, data, loss_fn), result in zip(jobs, got, strict=True):
        _assert_matches(M.reference_loop(factory, data, loss_fn), result)


def test_a_stage_reads_settings_of_blocks_it_does_not_hold():
    """torch's nn.TransformerEncoder reads its first layer's settings on every stage: the
    stand-in answers with the layer's own values; its tensors and calls stay refused, naming
    the layer and the fix."""
    from plait.parallel.pipeline_split import build_stage_module, plan_stages
    from tests import _workers_semantics as W

    model = W.torch_encoder_lm()
    path, specs = plan_stages(model, Plan(pp=2, microbatches=2))
    assert path == "enc.layers"
    last = build_stage_module(model, path, specs[1])
    held_elsewhere = last.get_submodule("enc.layers.0")
    assert held_elsewhere.self_attn.batch_first is True
    assert held_elsewhere.self_attn.num_heads == 2 and held_elsewhere.norm1.eps == 1e-5
    with pytest.raises(AttributeError, match=r"enc\.layers\.0\.self_attn\.in_proj_weight: "
                                             r".*does not hold enc\.layers\.0 .*pp=1"):
        _ = held_elsewhere.self_attn.in_proj_weight
    with pytest.raises(TypeError, match=r"enc\.layers\.0\.self_attn is called .*pp=1"):
        held_elsewhere.self_attn(torch.zeros(1, 2, 8))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
def test_a_forward_that_reads_its_input_on_a_later_stage_is_explained():
    """A forward that computes from its first argument (here, which rows take a branch) fails
    on the second stage, which passes it hidden states: the error says so and what to do."""
    from plait.parallel.pipeline_split import build_stage_module, plan_stages
    from tests import _workers_semantics as W

    model = W.aux_branch_lm()
    path, specs = plan_stages(model, Plan(pp=2, microbatches=2))
    last = build_stage_module(model, path, specs[1])
    hidden = torch.zeros(2, W.SEQ, W.WIDTH)
    with pytest.raises(Exception) as info:
        last(hidden)
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "pipeline stage 1 runs AuxBranchLM's forward with the hidden states" in note, note
    assert f"(a (2, {W.SEQ}, {W.WIDTH}) torch.float32 tensor)" in note and "pp=1" in note


def test_the_shape_inference_forward_sees_zeros_on_every_rank():
    """torch 2.13 infers a later stage's shapes by running its forward once on uninitialised
    tensors; each rank's garbage differs, so a forward whose collectives depend on values (a
    routed MoE under tp) ran different collectives on tp peers and aborted. The later stage's
    first forward must see zeros, and training still equals one device."""
    batches = [M.mlp_batch(s, 0) for s in range(M.STEPS)]
    got = run_distributed(M.first_inputs_seen, 2, "pp=2,mb=4", batches, F.mse_loss,
                          timeout=300)
    assert got[1]["seen"][0] == 0.0, got[1]["seen"][:2]
    assert min(got[1]["seen"][1:]) > 0.0  # the microbatches themselves were real
    want = M.reference_loop(M.logged_mlp, batches, F.mse_loss)["losses"]
    for rank in (0, 1):
        assert got[rank]["losses"] == pytest.approx(want, rel=1e-6)
