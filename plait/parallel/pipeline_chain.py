"""Pipeline parallelism: do the blocks form a chain?

A pipeline cuts the block sequence into stages and sends what reaches a stage's end to the next
stage's first block. That computes the model only when each block is fed (something computed
from) the previous block's output. A container whose members are alternatives rather than
steps, such as the experts of a mixture-of-experts layer or parallel branches that are summed,
holds blocks that all read one input: cut into stages, the later stages would compute from the
wrong tensor, and training would run on, silently, as another model. A model with one MoE
layer and no stack of layers has its experts list as its largest container, which is the
block sequence plait picks by default, so this is asked of every split.

:func:`chain_break` runs the model's forward once on the meta device (no memory, no compute)
with autograd recording, replaces each block's outputs with marked copies, and asks, as each
block is called, whether its input was computed from the previous block's marked outputs. It
answers only where it can tell: a block called with autograd off (inside a reentrant
checkpoint or a custom ``autograd.Function``, whose outputs do not record how they were
computed), an input without autograd history, or a forward that does not run on meta tensors
gives no verdict, and the split goes ahead. Blocks a forward at the split saw chain whole are
not asked about again at the first step.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import torch
import torch.nn as nn


def meta_replica(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` whose parameters and buffers are on the meta device (no memory),
    or None when the model cannot be deep-copied."""
    memo: dict[int, Any] = {}
    for t in model.parameters():
        memo[id(t)] = nn.Parameter(t.detach().to("meta"), requires_grad=t.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - uncopyable model: the split is not checked up front
        return None


class _BrokenChainError(Exception):
    """Raised inside the forward at the first block not fed by the one before it."""

    def __init__(self, before: int, after: int):
        super().__init__(before, after)
        self.before, self.after = before, after


def _mark(outputs: dict[int, list[torch.Tensor]], index: int, module: nn.Module, args: tuple,
          out: Any) -> Any:
    """Block ``index``'s output with each floating tensor replaced by a copy of a fresh leaf
    (kept in ``outputs``): whatever is computed from it has that leaf in its autograd history.
    The copy, not the leaf, goes on, so that the forward may update it in place."""
    outputs.pop(index, None)
    if not torch.is_grad_enabled():  # a reentrant checkpoint: its output hides the history
        return None
    leaves: list[torch.Tensor] = []

    def marked(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            leaf = t.detach().requires_grad_()
            leaves.append(leaf)
            return leaf.clone()
        return t

    if isinstance(out, torch.Tensor):
        new: Any = marked(out)
    elif type(out) in (tuple, list):  # (hidden states, attention weights, ...)
        new = type(out)(marked(t) for t in out)
    else:  # a dict or dataclass output: left as it is, and the next block is not asked
        return None
    if leaves:
        outputs[index] = leaves
    return new


def _reaches(x: torch.Tensor, leaves: list[torch.Tensor]) -> bool | None:
    """Whether ``x`` was computed from one of ``leaves``; None when ``x`` has no history."""
    if any(x is leaf for leaf in leaves):
        return True
    if x.grad_fn is None:
        return None
    targets = {id(leaf) for leaf in leaves}
    seen: set[int] = set()
    stack: list[Any] = [x.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if variable is not None and id(variable) in targets:
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False


def _ask(outputs: dict[int, list[torch.Tensor]], asked: list[int], index: int,
         module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    leaves = outputs.get(index - 1)
    if not leaves or not torch.is_grad_enabled():
        return
    x = args[0] if args else kwargs.get("hidden_states")
    verdict = _reaches(x, leaves) if isinstance(x, torch.Tensor) else None
    if verdict is False:
        raise _BrokenChainError(index - 1, index)
    if verdict:
        asked.append(index)


def chain_break(replica: nn.Module, path: str, x: Any, kwargs: dict[str, Any]
                ) -> tuple[str, str] | bool | None:
    """The names of the first two consecutive blocks at ``path`` of which the second is not fed
    by the first's output, in one forward of ``replica`` (a :func:`meta_replica`, whose
    parameters this makes trainable so that every activation records its history) on ``x``
    and ``kwargs`` (meta tensors); True when every block after the first was seen fed by the
    one before; None when it cannot tell (for some block or all). A block under several names
    (one layer applied several times) is not asked about."""
    container = replica.get_submodule(path) if path else replica
    named = [(k, m) for k, m in container._modules.items() if m is not None]
    names = [k for k, _ in named]
    blocks = [m for _, m in named]
    if len({id(b) for b in blocks}) < len(blocks):
        return None
    for p in replica.parameters():
        if p.is_floating_point():
            p.requires_grad_(True)
    outputs: dict[int, list[torch.Tensor]] = {}
    asked: list[int] = []
    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(partial(_ask, outputs, asked, i),
                                                       with_kwargs=True))
        handles.append(block.register_forward_hook(partial(_mark, outputs, i)))
    prefix = f"{path}." if path else ""
    try:
        with torch.enable_grad():
            replica(x, **kwargs)
    except _BrokenChainError as broken:
        return prefix + names[broken.before], prefix + names[broken.after]
    except Exception:  # noqa: BLE001 - not runnable on meta: no verdict
        return None
    finally:
        for h in handles:
            h.remove()
    return True if set(asked) >= set(range(1, len(blocks))) else None


def unchained_message(model_name: str, where: str, pair: tuple[str, str]) -> str:
    """The refusal for blocks that do not form a chain, naming the pair and the fixes."""
    before, after = pair
    return (f"the blocks of {where} do not form a chain: {model_name}'s forward feeds {after} "
            f"an input not computed from {before}'s output (the experts of a mixture-of-experts "
            f"layer and parallel branches are alternatives, not steps). A pipeline sends each "
            f"stage's output to the next stage's first block, so it splits only a sequence of "
            f"blocks each fed by the one before: name such a sequence (the container of the "
            f"model's layers) with options.pp_blocks, or run with pp=1 (dp_shard/zero or tp "
            f"split the experts instead)")
