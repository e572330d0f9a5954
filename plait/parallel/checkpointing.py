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
with its layers in a ``ModuleList``/``Sequential`` works.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .._torch_compat import checkpoint_wrapper_api, sdpa_ops
from ..plan import Plan
from .units import repeated_blocks

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


def apply_activation_checkpointing(module: nn.Module, plan: Plan) -> nn.Module:
    """Wrap the blocks of ``module`` that ``plan`` checkpoints; returns ``module`` (in place)."""
    if plan.activation_checkpointing == "none":
        return module
    blocks = repeated_blocks(module)
    if not blocks:
        raise ValueError(f"activation_checkpointing={plan.activation_checkpointing!r} needs "
                         f"repeated blocks (children of an nn.ModuleList/Sequential) in "
                         f"{type(module).__name__}, and it has none")
    kwargs = {}
    if plan.activation_checkpointing == "op":
        kwargs["context_fn"] = op_level_context
    for i in checkpointed_blocks(len(blocks), plan):
        name, block = blocks[i]
        wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                     preserve_rng_state=True, **kwargs)
        module.set_submodule(name, wrapped)
    return module


__all__ = ["apply_activation_checkpointing", "checkpointed_blocks", "op_level_context"]
