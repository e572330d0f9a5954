"""Activation checkpointing: same loss and gradients as without it, less saved for backward."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

from plait._torch_compat import checkpoint_wrapper_api
from plait.check import check
from plait.models.transformer import build, lm_loss
from plait.parallel.checkpointing import apply_activation_checkpointing, checkpointed_blocks
from plait.parallel.units import canonical_name
from plait.plan import Plan
from tests import _workers_semantics as W
from tests._workers_zero import DeepMLP


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (4, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


@functools.cache  # read-only results; `none` is the reference of every case
def _loss_grads_saved(mode: str, every: int = 2) -> tuple[float, dict, int]:
    """Loss, gradients by canonical name, and bytes saved for backward outside checkpoints."""
    torch.manual_seed(0)
    model = build("test", seed=0)
    model = apply_activation_checkpointing(
        model, Plan(activation_checkpointing=mode, checkpoint_every=every))
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    inputs, targets = _batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model(inputs), targets)
    loss.backward()
    grads = {canonical_name(n): p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, saved


@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_checkpointing_gives_the_same_loss_and_gradients(mode):
    ref_loss, ref_grads, ref_saved = _loss_grads_saved("none")
    loss, grads, saved = _loss_grads_saved(mode)
    assert abs(loss - ref_loss) < 1e-6
    assert grads.keys() == ref_grads.keys()
    worst = max((grads[k] - ref_grads[k]).abs().max().item() for k in grads)
    assert worst < 1e-6, worst
    # Checkpointed blocks keep (almost) nothing for backward outside the checkpoint.
    assert saved < ref_saved


def test_full_saves_less_than_selective():
    _, _, full = _loss_grads_saved("full")
    _, _, selective = _loss_grads_saved("selective", every=2)
    _, _, none = _loss_grads_saved("none")
    assert full < selective < none


def test_which_blocks_are_wrapped():
    assert checkpointed_blocks(8, Plan(activation_checkpointing="selective",
                                       checkpoint_every=3)) == [0, 3, 6]
    assert checkpointed_blocks(4, Plan(activation_checkpointing="full")) == [0, 1, 2, 3]
    assert checkpointed_blocks(4, Plan()) == []
    model = apply_activation_checkpointing(DeepMLP(depth=6), Plan(
        activation_checkpointing="selective", checkpoint_every=2))
    wrapped = [i for i, b in enumerate(model.blocks) if isinstance(b, checkpoint_wrapper_api()[2])]
    assert wrapped == [0, 2, 4]
    # Parameter names keep their canonical form under the wrapper.
    names = {canonical_name(n) for n, _ in model.named_parameters()}
    assert names == {n for n, _ in DeepMLP(depth=6).named_parameters()}


def test_model_without_blocks_is_refused():
    with pytest.raises(ValueError, match="needs repeated blocks"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), Plan(activation_checkpointing="full"))


def test_op_level_checkpointing_under_zero3_matches_single_device():
    result = check("dp_shard=2,zero=3,ac=op")
    assert result.ok, result.format()


@pytest.mark.slow
def test_full_checkpointing_under_zero2_matches_single_device():
    result = check("dp_shard=2,zero=2,ac=full")
    assert result.ok, result.format()


# ------------------------------------------- transformers models: their key/value cache
HF = {"gpt2": W.hf_gpt2, "llama": W.hf_llama}


def _cache_of(output) -> object:
    return output.past_key_values if hasattr(output, "past_key_values") else output.cache


def _hf_run(name: str, mode: str) -> tuple[float, dict, int]:
    """Loss, gradients by canonical name, and the tokens the model's own key/value cache holds
    after backward (transformers builds one in every forward: ``use_cache`` defaults on)."""
    model = apply_activation_checkpointing(HF[name](), Plan(activation_checkpointing=mode))
    tokens, labels = W.hf_batch(0)
    out = model.hf(input_ids=tokens)
    cache = _cache_of(out)
    W.mlm_loss(out.logits, labels).backward()
    grads = {canonical_name(n): p.grad.clone() for n, p in model.named_parameters()}
    return out.logits.detach(), grads, cache.get_seq_length()


@pytest.mark.parametrize("mode", ["full", "op"])
@pytest.mark.parametrize("name", sorted(HF))
def test_transformers_blocks_are_checkpointed_without_their_kv_cache(name, mode):
    """The blocks would update the cache in forward and again in the recompute (op: torch's
    "aten.slice.Tensor encountered during backward but not found in storage"; full: a cache
    of twice the sequence); they run without it, as under transformers' own checkpointing."""
    pytest.importorskip("transformers")
    ref_logits, ref_grads, ref_cached = _hf_run(name, "none")
    logits, grads, cached = _hf_run(name, mode)
    assert ref_cached == W.SEQ  # the model does build and fill a cache
    assert cached == 0
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys()
    worst = max((grads[k] - ref_grads[k]).abs().max().item() for k in grads)
    assert worst < 1e-6, worst


def test_transformers_cache_is_kept_without_gradients_and_a_filled_one_refused():
    """Without gradients nothing is recomputed, so the cache fills as usual (generation); a
    cache that already holds tokens (a prefix) cannot be left out without changing the result."""
    pytest.importorskip("transformers")
    model = apply_activation_checkpointing(W.hf_llama(), Plan(activation_checkpointing="op"))
    tokens, _ = W.hf_batch(0)
    with torch.no_grad():
        cache = _cache_of(model.hf(input_ids=tokens[:, :5], use_cache=True))
    assert cache.get_seq_length() == 5
    name = next(n for n in ("cache", "past_key_values")
                if n in inspect.signature(model.hf.forward).parameters)
    with pytest.raises(ValueError, match=r"LlamaDecoderLayer .* already holds 5 tokens.*ac=none"):
        model.hf(input_ids=tokens[:, 5:], use_cache=True, **{name: cache})
