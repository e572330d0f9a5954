"""Bytes per element of each tensor-parallel collective of one block (``Sizes``).

Apart from :mod:`plait.planner.tp_trace`, which reads them off a forward pass on fake tensors
and needs torch for it: the planner prices a preset model with the uniform sizes alone, without
importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32 = 4


@dataclass(frozen=True)
class Sizes:
    """Bytes per element of each tensor-parallel collective of one block and of the model's
    ends under one precision: ``forward`` (each row-parallel layer's output), ``backward``
    (each column-parallel layer's or region's input), ``embed_out`` (the vocabulary-parallel
    embedding's output), ``head_in`` (the vocabulary-parallel head's input), ``stack_in`` /
    ``stack_out`` (the first block's input, a block's output: what a pipeline stage sends),
    ``grads`` (parameter gradients all-reduced over tp)."""

    forward: tuple[int, ...]
    backward: tuple[int, ...]
    embed_out: int = FP32
    head_in: int = FP32
    stack_in: int = FP32
    stack_out: int = FP32
    grads: int = FP32

    @classmethod
    def uniform(cls, e: int, forward: int, backward: int) -> Sizes:
        """Every activation at ``e`` bytes, parameter gradients at ``e`` too."""
        return cls((e,) * forward, (e,) * backward, e, e, e, e, e)
