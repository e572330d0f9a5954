"""A Hugging Face user's fine-tuning loop under plait equals the same loop on one device.

Causal LMs (Llama with rotary positions, its head untied and tied; GPT-2 with learned positions
and its head tied) and a BERT masked LM, built from tiny configs; dict batches from a collate
function (variable lengths padded right or left, ``attention_mask``, labels -100 on padding
and prompts); the model's own loss (``loss_fn=None``) or a hand-written shifted loss on its
outputs; an LR scheduler; gradient accumulation; ``run.evaluate`` on held-out data after every
step. Workers and the one-device loop: tests/_workers_hf.py.

Tolerance: 1e-6 relative on every step's loss and held-out loss, and on every tensor of the
final state 1e-6 relative to the tensor's largest entry (at least 1e-2): fp32 sums in another
order, nothing more. SGD: Adam turns gradient rounding noise (an attention key bias, whose
gradient is zero in exact arithmetic) into steps of +-lr, so it cannot be held to fp32 level;
one device splitting its own batch in two moves GPT-2's key bias by 2e-4 relative after 3 AdamW
steps.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from plait.spawn import run_distributed
from tests import _workers_hf as W

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install plait[hf])")

REL, FLOOR = 1e-6, 1e-2


def _assert_matches(ref: dict, got: dict) -> None:
    label = (got["plan"], got["model"])
    for what in ("losses", "evals"):
        for step, (a, b) in enumerate(zip(ref[what], got[what], strict=True)):
            assert abs(a - b) <= REL * abs(a), (*label, what, step, a, b)
    for name, want in ref["state"].items():
        assert name in got["state"], (*label, name, sorted(got["state"]))
        if not want.is_floating_point():
            continue
        diff = (got["state"][name] - want).abs().max().item()
        assert diff <= REL * max(want.abs().max().item(), FLOOR), (*label, name, diff)


def _check(world: int, jobs: list, timeout: float) -> None:
    got = run_distributed(W.finetune, world, jobs, timeout=timeout)[0]
    for (_, model, kw), result in zip(jobs, got, strict=True):
        _assert_matches(W.reference(model, kw), result)


@pytest.mark.slow  # the data- and tensor-parallel fine-tuning loop runs by default
def test_causal_lm_loop_under_two_rank_layouts():
    """The model's own loss under DDP (left padding, RoPE), ZeRO-1 and ZeRO-3 with gradient
    accumulation (GPT-2, tied head), the hand-written shifted loss under tensor parallelism
    (vocabulary-parallel tied head), and a pipeline (left padding to a fixed length, the tied
    head on the other stage); GPT-2 left-padded per replica with the collate's position_ids.
    Llama's sequence classifier in a pipeline: it pools at each row's last token that is not
    the pad token, found in ``input_ids``; its last stage gets hidden states, and the batch's
    token ids too, so right-padded rows are pooled where one device pools them (at the last
    position, a pad, without them: 3e-2 off in the first step's loss). The same for a
    classifier written for the test, whose pooling reads the pad token from an attribute of
    its own (5e-2 off without the token ids)."""
    jobs = [("dp=2", "llama", {"side": "left"}),
            ("dp_shard=2,zero=1", "gpt2", {}),
            ("dp_shard=2,zero=3,grad_accum=2", "gpt2", {}),
            ("tp=2", "llama_tied", {"loss": "shifted"}),
            ("pp=2,mb=2", "llama_tied", {"fixed": 12, "side": "left"}),
            ("dp=2", "gpt2", {"side": "left", "positions": True}),
            ("pp=2", "llama_classifier", {"fixed": 12, "classes": 3}),
            ("pp=2", "own_classifier", {"fixed": 12, "classes": 3})]
    _check(2, jobs, timeout=300)


def test_data_parallel_tensor_parallel_and_evaluation_between_steps():
    """Replicated data parallelism over tensor-parallel shards (FSDP2's replicate, which keeps
    the gathered weights after a forward): the blocks' norms, which tensor parallelism leaves
    whole, get their gradient in the step after an evaluation too."""
    _check(4, [("dp=2,tp=2", "gpt2", {})], timeout=300)


def test_checkpoint_exports_to_a_hugging_face_folder_and_generates(tmp_path):
    """Trained under ZeRO-3 (GPT-2, its head tied): ``run.save``, then ``plait export`` to a
    Hugging Face folder, which ``from_pretrained`` loads into the one-device model's weights,
    tie included; ``model.generate`` on a one-device copy from ``run.full_state_dict`` gives
    the one-device model's tokens."""
    import transformers

    from plait.checkpoint.export import export

    kw = {"save": str(tmp_path / "ckpt"), "generate": True}
    (got,) = run_distributed(W.finetune, 2, [("dp_shard=2,zero=3", "gpt2", kw)],
                             timeout=300)[0]
    ref = W.reference("gpt2", kw)
    _assert_matches(ref, got)
    export(got["saved"], tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    held = W.collate(W.dataset(4, seed=3))
    model = ref["model"].eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**held).logits, model(**held).logits)
    assert got["generated"] == W.generate(model)


@pytest.mark.slow
def test_more_layouts_and_a_masked_lm():
    """ZeRO-2 with accumulation, sequence parallelism (a fixed length tp divides), the pipeline
    with GPT-2's own loss and 4 microbatches, and BERT's masked LM (left padding with
    position_ids) under DDP, tensor parallelism and ZeRO-3; a pipeline over Llama with the
    user's own (non-reentrant) gradient checkpointing on."""
    jobs = [("dp_shard=2,zero=2,grad_accum=2", "llama", {}),
            ("tp=2,sp=true", "gpt2", {"fixed": 12}),
            ("tp=2,sp=true", "llama", {"fixed": 12, "side": "left"}),
            ("pp=2,mb=4", "gpt2", {"fixed": 12}),
            ("dp=2", "bert", {"mlm": True, "side": "left", "positions": True}),
            ("tp=2", "bert", {"mlm": True}),
            ("dp_shard=2,zero=3", "bert", {"mlm": True}),
            ("pp=2", "llama_checkpointed", {"fixed": 12})]
    _check(2, jobs, timeout=600)


@pytest.mark.slow
def test_four_rank_compositions():
    """ZeRO-2 and ZeRO-3 over tensor-parallel shards (with SP), and a pipeline over two data
    replicas."""
    jobs = [("dp_shard=2,zero=2,tp=2", "llama", {"side": "left"}),
            ("dp_shard=2,zero=3,tp=2,sp=true", "llama_tied", {"fixed": 12}),
            ("pp=2,dp=2,mb=2", "gpt2", {"fixed": 12})]
    _check(4, jobs, timeout=600)


@pytest.mark.slow
def test_multimodal_classifiers_that_hand_their_forward_on():
    """Gemma 3's and Qwen 3.5's image-and-text sequence classifiers on text, right-padded
    under a pipeline: their forward calls transformers' shared one, which pools by the text
    config's pad token; the last stage gets the token ids, as for Llama's (without them,
    4e-2 and 2e-2 off in the first step's loss)."""
    jobs = [("pp=2", "gemma3_classifier", {"fixed": 12, "classes": 3}),
            ("pp=2", "qwen3_5_classifier", {"fixed": 12, "classes": 3})]
    _check(2, jobs, timeout=600)


def _xglm() -> torch.nn.Module:
    from transformers import XGLMConfig, XGLMForCausalLM

    return XGLMForCausalLM(XGLMConfig(vocab_size=W.VOCAB, d_model=32, ffn_dim=64, num_layers=2,
                                      attention_heads=4, max_position_embeddings=32,
                                      pad_token_id=W.PAD))


def _trocr() -> torch.nn.Module:
    from transformers import TrOCRConfig, TrOCRForCausalLM

    return TrOCRForCausalLM(TrOCRConfig(vocab_size=W.VOCAB, d_model=32, decoder_ffn_dim=64,
                                        decoder_layers=2, decoder_attention_heads=4,
                                        max_position_embeddings=32, pad_token_id=W.PAD))


def _checked_classifier() -> torch.nn.Module:
    """Llama's classifier with a forward that first branches on its token ids' values, which
    a forward on fake tensors cannot do."""
    from transformers import LlamaForSequenceClassification

    class Checked(LlamaForSequenceClassification):
        def forward(self, input_ids=None, **kwargs):
            if input_ids is not None and bool((input_ids < 0).any()):
                raise ValueError("negative token ids")
            return super().forward(input_ids=input_ids, **kwargs)

    return Checked(W.llama_classifier().config)


POOLING = {"llama_classifier": W.llama_classifier, "gemma3_classifier": W.gemma3_classifier,
           "qwen3_5_classifier": W.qwen3_5_classifier, "own_classifier": W.own_classifier,
           "checked_classifier": _checked_classifier}
NOT_POOLING = {"llama": W.llama, "gpt2": W.gpt2, "bert": W.bert, "xglm": _xglm,
               "trocr": _trocr}


@pytest.mark.parametrize("name", [*POOLING, *NOT_POOLING])
def test_which_models_read_their_token_ids_beside_their_embedding(name):
    """A model whose head reads ``input_ids`` outside the modules that embed them (a pooling
    at the last non-pad token) gets them on its last stage, seen in one forward on fake
    tensors: also where the class hands its forward on (Gemma 3, Qwen 3.5) or keeps the pad
    token elsewhere (the test's own classifier). XGLM and TrOCR name ``pad_token_id`` in
    their forward (their labels' shift) but read the ids only to embed them. Where the fake
    forward cannot run (a branch on the ids' values), every forward in the class's MRO is
    read for ``pad_token_id`` and ``input_ids``."""
    from plait.parallel.pipeline_hf import pools_by_pad_token

    model = {**POOLING, **NOT_POOLING}[name]()
    assert pools_by_pad_token(model) == (name in POOLING)


def test_a_classifier_pooling_by_token_ids_inside_a_wrapper_is_refused_under_a_pipeline():
    """Inside a module of the user's, the pipeline's first input need not be the token ids the
    classifier pools by: refused when the stage is built, with the value and the fix."""
    from plait.parallel.pipeline_split import build_stage_module, plan_stages
    from plait.plan import Plan

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = W.llama_classifier()

        def forward(self, input_ids, attention_mask=None, labels=None):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    model = Wrapper()
    path, specs = plan_stages(model, Plan(pp=2))
    with pytest.raises(ValueError, match="pad_token_id=0.*pass LlamaForSequenceClassification "
                                         "itself to run.parallelize, or run with pp=1"):
        build_stage_module(model, path, specs[1])
    path, specs = plan_stages(model.inner, Plan(pp=2))
    build_stage_module(model.inner, path, specs[1])  # the classifier itself: accepted


@pytest.mark.parametrize("build, refused", [(W.gemma3_classifier, True), (_xglm, False),
                                             (_trocr, False)])
def test_inside_a_wrapper_only_a_model_that_reads_its_ids_is_refused(build, refused):
    """Gemma 3's classifier, whose pooling is found through the forward it hands on to, is
    refused inside a module of the user's under a pipeline; XGLM and TrOCR causal LMs, which
    read their ids only to embed them, are accepted."""
    from plait.parallel.pipeline_split import build_stage_module, plan_stages
    from plait.plan import Plan

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = build()

        def forward(self, input_ids, attention_mask=None):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask).logits

    model = Wrapper()
    path, specs = plan_stages(model, Plan(pp=2))
    if refused:
        with pytest.raises(ValueError, match="pad_token_id=0.*run with pp=1"):
            build_stage_module(model, path, specs[1])
    else:
        build_stage_module(model, path, specs[1])


def test_reentrant_gradient_checkpointing_is_refused_under_a_pipeline():
    """transformers' gradient checkpointing with use_reentrant=True cannot give a stage's input
    its gradient through torch.autograd.grad, which torch's pipeline stages take: the last
    stage raised in its first backward and the first stage waited for that gradient until the
    timeout. Refused when the stages are built, naming the fix; use_reentrant=False builds."""
    from plait.parallel.pipeline_split import build_stage_module, plan_stages
    from plait.plan import Plan

    model = W.llama_checkpointed(reentrant=True)
    path, specs = plan_stages(model, Plan(pp=2))
    for spec in specs:
        with pytest.raises(ValueError, match=r"use_reentrant=True \(model, model.layers.0, "
                                             r"model.layers.1\); under pp=2 .*'use_reentrant': "
                                             r"False"):
            build_stage_module(model, path, spec)
    model = W.llama_checkpointed(reentrant=False)
    for spec in specs:
        build_stage_module(model, path, spec)


def _loader_warnings(collate, dp_size: int = 2) -> list[str]:
    from plait.data.loader import DistributedLoader

    loader = DistributedLoader(W.dataset(), W.BATCH, dp_size=dp_size, steps=2, collate_fn=collate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(loader)
    return [str(w.message) for w in caught]


def test_left_padding_per_replica_is_named():
    """Each replica pads its rows to its own longest, so left padding puts a row's tokens at
    other positions than one device's batch: said once, with the fix. Not said with
    position_ids, right padding, a fixed length or one replica."""
    from functools import partial

    (said,) = _loader_warnings(partial(W.collate, side="left"))
    assert "left-padded without 'position_ids'" in said and "position_ids from the collate_fn" \
        in said, said
    for quiet in (partial(W.collate, side="left", positions=True), W.collate,
                  partial(W.collate, side="left", fixed=12)):
        assert _loader_warnings(quiet) == []
    assert _loader_warnings(partial(W.collate, side="left"), dp_size=1) == []
