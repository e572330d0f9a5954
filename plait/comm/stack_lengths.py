"""The length of the sequence each stack of blocks of a model runs on, read in the run.

An encoder-decoder's stacks run sequences of their own lengths (a source of 48 tokens, a
target of 16), which the batch's first input alone does not say; the ledger's expected column
prices each stack's tensor-parallel collectives at its own length (``plait.planner.cost
.activation_traffic``). A forward pre-hook on each stack's first block, registered once the
model is laid out (the layout's checks run the blocks on a guessed input) and put first among
its hooks (before sequence parallelism's splits that input), notes the length of the first
input it gets (dim 1), once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def watch_stack_lengths(model: nn.Module, firsts: list[str]) -> dict[str, int]:
    """A dict that the first forward of ``model`` fills with the sequence length each block
    named in ``firsts`` (module paths: each stack's first block) receives; the hooks remove
    themselves once each block has been seen."""
    lengths: dict[str, int] = {}
    handles: dict[str, Any] = {}

    def note(name: str) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor) and x.ndim >= 2:
                lengths.setdefault(name, int(x.shape[1]))
                handles.pop(name).remove()
        return hook

    for name in firsts:
        handles[name] = model.get_submodule(name).register_forward_pre_hook(
            note(name), with_kwargs=True, prepend=True)
    return lengths
