"""Activation checkpointing from the Plan: trade recomputation for activation memory.

Modes (``plan.activation_checkpointing``):

* ``none``      — keep every activation for backward.
* ``full``      — checkpoint every block: only block inputs are kept; each block's forward runs
  again during backward (~1/3 more compute for a transformer).
* ``selective`` — checkpoint every ``plan.checkpoint_every``-th block (blocks 0, k, 2k, ...):
  a dial between the two.
* ``op``        — every block, but with torch's selective-checkpoint policy at the op level:
  outputs of the matmuls (and attention) are saved, the cheap elementwise ops (norms,
  activations, rotary) are recomputed — most of the memory saving for little recompute.

Built on ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (non-reentrant
``torch.utils.checkpoint``; the wrapper FSDP2 and torchtitan compose with) and
``torch.utils.checkpoint.create_selective_checkpoint_contexts``. The wrapper adds a
``_checkpoint_wrapped_module.`` level to parameter names;
``plait.parallel.units.canonical_name`` strips it, and state dicts load through it.

Blocks are the model's repeated units (``plait.parallel.units.repeated_blocks``), so any model
with its layers in a ``ModuleList``/``Sequential`` works; a model whose blocks are plain
attributes (a U-Net's ``down1``, ``mid``, ``up1``) names them with
``options.checkpoint_patterns``. Where the largest container found is no stack of blocks (a
U-Net's small timestep MLP) and no patterns are given, checkpointing is refused: wrapping that
container's layers would save next to nothing, silently.

A Hugging Face key/value cache (``transformers.Cache``) that reaches a checkpointed block is left
out of its call, as transformers' own gradient checkpointing does: the block updates the cache
in place, so the recompute in backward would find the keys of the forward already in it and run
other ops (``ac=op`` then fails: "aten.slice.Tensor encountered during backward but not found in
storage"; ``full`` recomputes against a cache twice its length). Transformers models build an
empty one in every training forward (``use_cache`` defaults on); one that already holds tokens
(a prefix) is refused rather than dropped, since leaving it out would change the result.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .._torch_compat import checkpoint_wrapper_api, sdpa_ops
from ..plan import Plan
from .hf import transformers_class
from .pipeline_split import STAND_INS
from .units import canonical_name, not_a_stack, repeated_blocks, select_units

checkpoint_wrapper, CheckpointImpl, _ = checkpoint_wrapper_api()
_aten = torch.ops.aten
# Ops whose outputs op-level checkpointing keeps: the expensive ones (matmuls, attention).
SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    *sdpa_ops(),
}


def _op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def op_level_context():
    """Context pair for ``torch.utils.checkpoint``: save matmul outputs, recompute the rest."""
    return create_selective_checkpoint_contexts(_op_policy)


def checkpointed_blocks(n_blocks: int, plan: Plan) -> list[int]:
    """Indices of the blocks that ``plan`` checkpoints, out of ``n_blocks``."""
    mode = plan.activation_checkpointing
    if mode == "none":
        return []
    if mode in ("full", "op"):
        return list(range(n_blocks))
    if mode == "selective":
        return list(range(0, n_blocks, plan.checkpoint_every))
    raise ValueError(f"activation_checkpointing={mode!r} is not one of none, full, selective, op")


def _without_kv_cache(block: nn.Module, args: tuple, kwargs: dict[str, Any]
                      ) -> tuple[tuple, dict[str, Any]]:
    """``args``/``kwargs`` of a checkpointed ``block``'s call with each transformers cache
    replaced by None (and ``use_cache`` off): the block would update the cache in forward and
    again in the recompute. Unchanged without gradients (nothing is recomputed), for layers that
    only read the cache (transformers' ``_can_checkpoint_with_cache``) and for calls that carry
    no cache."""
    cache_type = transformers_class("cache_utils", "Cache")
    if (cache_type is None or not torch.is_grad_enabled()
            or getattr(block, "_can_checkpoint_with_cache", False)):
        return args, kwargs
    found: list[Any] = [v for v in (*args, *kwargs.values()) if isinstance(v, cache_type)]
    if not found:
        return args, kwargs
    for cache in found:
        held = cache.get_seq_length()
        if held:
            raise ValueError(
                f"{type(block).__name__} is activation-checkpointed and gets a transformers "
                f"{type(cache).__name__} that already holds {held} tokens: the recompute in "
                f"backward would add them to it a second time, and leaving the cache out would "
                f"change the result. Train with activation_checkpointing='none' (ac=none), or "
                f"without the filled cache (past_key_values)")
    args = tuple(None if isinstance(v, cache_type) else v for v in args)
    kwargs = {k: None if isinstance(v, cache_type) else v for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


def _checkpoint_block(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint`` (non-reentrant) of ``block`` on its call without a
    key/value cache (:func:`_without_kv_cache`); ``kwargs`` mixes the block's keyword arguments
    with checkpoint's own (``context_fn``, ``preserve_rng_state``), as ``checkpoint_wrapper``
    passes them."""
    args, kwargs = _without_kv_cache(block, args, kwargs)
    return checkpoint(block, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(module: nn.Module, plan: Plan) -> nn.Module:
    """Wrap the blocks of ``module`` that ``plan`` checkpoints; returns ``module`` (in place)."""
    if plan.activation_checkpointing == "none":
        return module
    blocks = checkpoint_units(module, plan)
    kwargs = {}
    if plan.activation_checkpointing == "op":
        kwargs["context_fn"] = op_level_context
    for i in checkpointed_blocks(len(blocks), plan):
        name, block = blocks[i]
        wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                     checkpoint_fn=_checkpoint_block, preserve_rng_state=True,
                                     **kwargs)
        module.set_submodule(name, wrapped)
    return module


def checkpoint_units(module: nn.Module, plan: Plan) -> list[tuple[str, nn.Module]]:
    """The modules activation checkpointing wraps, in model order: those
    ``options.checkpoint_patterns`` names (the outermost where one holds another: a wrapped
    module's forward replays what it holds), or the repeated blocks. ValueError where there is
    none, or where the blocks found are no stack of blocks and no pattern names the real ones."""
    mode, name = plan.activation_checkpointing, type(module).__name__
    fix = ("name the modules to checkpoint with options.checkpoint_patterns (globs over module "
           "names, e.g. {'checkpoint_patterns': ['down.*', 'mid']})")
    patterns = plan.options.checkpoint_patterns
    if patterns:
        chosen = select_units(module, patterns, option="options.checkpoint_patterns")
        names = {canonical_name(n) for n, _ in chosen}
        order = {canonical_name(n): i for i, (n, _) in enumerate(module.named_modules())}
        outer = [(n, m) for n, m in chosen
                 if not any(canonical_name(n).startswith(o + ".") for o in names)]
        return sorted(outer, key=lambda u: order[canonical_name(u[0])])
    blocks = repeated_blocks(module)
    if not blocks:
        raise ValueError(f"activation_checkpointing={mode!r} needs repeated blocks (children of "
                         f"an nn.ModuleList/Sequential) in {name}, and it has none: {fix}")
    # A pipeline stage's own blocks sit beside stand-ins for the other stages' ones, and its
    # embedding may outweigh them: a stack all the same.
    why = not_a_stack(module, blocks, ignore=STAND_INS)
    if why is not None:
        raise ValueError(f"activation_checkpointing={mode!r} would wrap {why}: checkpointing "
                         f"them saves next to nothing. {fix[0].upper()}{fix[1:]}, or leave "
                         f"activation_checkpointing off")
    return blocks


__all__ = ["apply_activation_checkpointing", "checkpoint_units", "checkpointed_blocks",
           "op_level_context"]
