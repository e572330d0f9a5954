"""Which blocks of a stack the backward pass reaches, and which of them FSDP2 gathers again
for it under ZeRO-3: a model whose leading blocks are frozen (fine-tuning the last layers
only) issues fewer collectives in backward than one that trains throughout.

Autograd runs backward only through tensors that require grad. A block's output requires grad
when its input does (a trainable embedding upstream) or one of its own parameters trains, so
the blocks before the first one that trains, fed by a frozen embedding, are never reached:

* tensor parallelism's backward collectives (the input gradients a column-parallel layer
  all-reduces, sequence parallelism's backward gathers and reduce-scatters, a checkpoint's
  replay) are not issued in them;
* FSDP2 registers its pre-backward hook (``FSDPState._register_pre_backward_hook``) on a unit's
  outputs that require grad, so an unreached block's own hook never fires. It is still
  gathered for backward when the next unit's hook fires, which prefetches the unit before it in
  forward order (``FSDPParamGroup._backward_prefetch``); the root's hook prefetches the last
  block. Of the leading blocks that are never reached, all but the last are thus not gathered
  again; the one after them is, once, and reduce-scatters nothing (it has no gradient).

Blocks are taken to run one after the other, each feeding the next. Whether the first
block's input needs a gradient (``input_grad``) is read, where some parameter is frozen, off a
forward pass on fake tensors (a trainable gain on a frozen embedding's output makes it so:
``plait.comm.held.stack_input_grad``, ``plait.planner.tp_block.grad_flow``), else taken to be
so exactly when an embedding trains (or the model has none).

This is the whole-block view. Inside a reached block the backward pass may still skip part of
it: a frozen attention behind a frozen norm, on a stream nothing before it trains, gets no
gradient while the MLP after it does, so the input-gradient collectives of that attention are
never issued. Where some parameter is frozen, the planner reads which tensor-parallel
collectives each block issues in backward off a forward pass on fake tensors
(``plait.planner.tp_trace.needs_grad``, ``plait.planner.tp_block.grad_flow``) and falls back
to this view where that pass cannot run.
"""

from __future__ import annotations

from collections.abc import Sequence


def reached(input_grad: bool, trains: Sequence[bool]) -> tuple[bool, ...]:
    """Per block, whether the backward pass reaches it (its output requires grad): the stack's
    input needs a gradient (``input_grad``) or this block or one before it has a parameter
    that trains (``trains``, per block in forward order)."""
    out, flowing = [], input_grad
    for t in trains:
        flowing = flowing or t
        out.append(flowing)
    return tuple(out)


def regathered(reach: Sequence[bool]) -> tuple[bool, ...]:
    """Per block, whether FSDP2 (ZeRO-3, blocks resharded after forward) gathers it again for
    backward: its own pre-backward hook fires (``reach``) or the next unit's does and prefetches
    it; after the last block comes the root, whose hook fires on the loss's input."""
    return tuple(reach[i + 1] if i + 1 < len(reach) else True for i in range(len(reach)))
