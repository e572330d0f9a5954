"""``Plan.compile``: ``torch.compile`` on each repeated block, once the layout is in place.

Why per block: a graph of the whole model breaks at every FSDP2 unit, DDP bucket and pipeline
stage boundary, while a block's forward is one graph that every block of the same class shares
(torch guards on the class and takes parameters as inputs), so it compiles once. Why the
forward only, not ``nn.Module.compile`` (which also traces the module's hooks): FSDP2, DDP and
plait's own hooks move parameters in and out of the module around each call, state that a
compiled graph would otherwise have to guard on; left eager, they run as they do without
compile. The state dict keeps its names (no ``_orig_mod.`` part), so checkpoints move between
compiled and eager runs.

Why each block's inputs are waited first (:func:`_wait_collectives`): a tensor-parallel layer
that runs eager before a block (the vocabulary-parallel embedding, a sequence-parallel
reduce-scatter) hands it the local tensor of an asynchronous redistribute, an
``AsyncCollectiveTensor`` that carries the autograd edge while its inner tensor does not.
torch 2.13's AOTAutograd replaces such an input by its waited inner tensor before tracing
(pytorch/pytorch#179849), so the graph is traced as if the input needed no gradient: its
backward returns None for it, and the layer before the block gets no gradient (torch's
``to_local`` then fails in DTensor's redistribute backward; plait's ``_ToLocal`` gets it as
autograd's zeros, and the embedding stops training with nothing failing; the upstream fix is
pytorch/pytorch#191113).
Waiting the collective in an autograd function before the compiled call hands the block a plain
tensor that requires grad, whose gradient goes back unchanged. The wait costs no overlap: the
block's first op would wait for it anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..plan import Plan
from .units import repeated_blocks


def apply_compile(module: nn.Module, plan: Plan) -> nn.Module:
    """Compile the forward of each repeated block of ``module`` (the root's when it has
    none); in place, returns ``module``."""
    if not plan.compile:
        return module
    blocks = [block for _, block in repeated_blocks(module)] or [module]
    for block in blocks:
        inner = getattr(block, "_checkpoint_wrapped_module", block)  # activation checkpointing
        inner.forward = _wait_collectives(torch.compile(inner.forward))
    return module


class _Waited(torch.autograd.Function):
    """An ``AsyncCollectiveTensor`` waited, as a plain tensor whose gradient passes through."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.wait().detach()  # type: ignore[attr-defined]  # an alias, not a view of it

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _wait_collectives(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` called with every ``AsyncCollectiveTensor`` in its arguments waited by
    :class:`_Waited` (see the module's docstring for why)."""
    from .._torch_compat import async_collective_tensor, tree_map_only

    waiting, tree_map = async_collective_tensor(), tree_map_only()

    @functools.wraps(forward)
    def call(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(waiting, _Waited.apply, (args, kwargs))
        return forward(*args, **kwargs)

    return call


def compiled_original(model: nn.Module) -> nn.Module | None:
    """The module ``torch.compile(module)`` wrapped, for a wrapper it returned; else None."""
    from .._torch_compat import compiled_module_class

    if not isinstance(model, compiled_module_class()):
        return None
    inner = model._orig_mod
    return inner if isinstance(inner, nn.Module) else None


def wrapped_after_layout(model: nn.Module) -> str | None:
    """Why ``model``, ``torch.compile`` of a model plait laid out, cannot be stepped; else None.

    plait reads the layout recorded on the module it returned (a pipeline's schedule, DDP's
    gradient sync, the ledger, checkpoints); the wrapper hides it, and a pipeline or a
    tensor-parallel model fails inside the compiled call."""
    from .layout import layout_of

    inner = compiled_original(model)
    if inner is None or not layout_of(inner).applied:
        return None
    return ("the model is torch.compile(...) of the model run.parallelize returned: compile "
            "the one-device model before run.parallelize (plait then compiles each block after "
            "laying it out), or add compile to the plan ('dp=2,compile'), and pass "
            "run.parallelize's model to run.step")


__all__ = ["apply_compile", "compiled_original", "wrapped_after_layout"]
