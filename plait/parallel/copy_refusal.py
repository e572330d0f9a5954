"""A laid-out model refuses ``copy.deepcopy`` where the copy would not be a model.

``torch.optim.swa_utils.AveragedModel(model)`` and a hand-made EMA copy deep-copy the model.
After ``run.parallelize`` that copy is not what the user meant: under tensor parallelism its
parameters are DTensors whose copied layers lost their input and output redistribution (its
forward fails with ``got mixed torch.Tensor and DTensor``); FSDP2 raises an AssertionError that
suggests a state dict; a pipeline's process groups cannot be copied (``cannot pickle
'ProcessGroup'``). None of those names the way that works: copy the model before
``run.parallelize`` and lay the copy out too, so that each of its parameters is laid out as the
model's. A DDP-wrapped or single-device model copies correctly and is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import torch.nn as nn
from torch.distributed.tensor import DTensor

# An instance attribute: copy.deepcopy looks ``__deepcopy__`` up on the object, where it comes
# before the class's (FSDP2's class-level refusal included).
COPY_ATTR = "__deepcopy__"

# What a pipeline's EMA does instead of AveragedModel: a copy laid out as the model, its
# stages' parameters paired with the model's.
HAND_EMA = ("ema = copy.deepcopy(raw).requires_grad_(False) before model = run.parallelize(raw), "
            "then ema = run.parallelize(ema), and after each run.step, under torch.no_grad(), "
            "e.lerp_(p, 1 - decay) for e, p in zip(ema.parameters(), model.parameters())")


@dataclass(frozen=True)
class CopyRefusal:
    """``copy.deepcopy``'s hook on one laid-out model: raises ValueError(``message``). An
    object rather than a closure, so that pickling the model (``torch.save(model)``) still
    works."""

    message: str

    def __call__(self, memo: Any = None) -> NoReturn:
        raise ValueError(self.message)


def refuse_copies(model: nn.Module, message: str) -> None:
    """Make ``copy.deepcopy(model)`` raise ValueError(``message``)."""
    model.__dict__[COPY_ATTR] = CopyRefusal(message)


def copy_refusal(model: nn.Module, pipelined: bool) -> str | None:
    """Why a copy of the laid-out ``model`` would not work and what to do, or None where it
    would."""
    head = "a laid-out model cannot be copied (copy.deepcopy, torch.optim.swa_utils.AveragedModel)"
    if pipelined:
        return (f"{head}: its pipeline stages hold process groups; copy the model before "
                f"run.parallelize and lay the copy out too, updated by hand: {HAND_EMA}")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return (f"{head}: its parameters are DTensor shards (tensor parallelism or ZeRO), "
                f"whose layout a copy does not carry; copy the model before "
                f"run.parallelize and lay the copy out too: swa = AveragedModel(raw)"
                f".requires_grad_(False), then model = run.parallelize(raw) and swa = "
                f"run.parallelize(swa)")
    return None


def refuse_averaged_pipeline(model: nn.Module, pp: int) -> None:
    """An ``AveragedModel`` split into pipeline stages loses ``update_parameters`` and its
    ``n_averaged`` count, which belong to the whole model (the split keeps its blocks): refused
    with the hand-made EMA that a pipeline's stages update pairwise, as the model's."""
    from torch.optim.swa_utils import AveragedModel

    if pp > 1 and isinstance(model, AveragedModel):
        raise ValueError(
            f"torch.optim.swa_utils.AveragedModel cannot be split into pp={pp} pipeline "
            f"stages (its update_parameters and n_averaged belong to the whole model); keep "
            f"the EMA by hand: {HAND_EMA}")
