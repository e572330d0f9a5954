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

import contextlib
import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from .._torch_compat import meta_nonzero_patch, tree_map_only


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


def on_meta(value: Any) -> Any:
    """``value`` (a tensor, or tensors nested in tuples, lists and dicts) on the meta device:
    the first step's inputs as the meta-device checks of a :func:`meta_replica` take them."""
    return tree_map_only()(torch.Tensor, lambda t: t.to("meta"), value)


def _data_dependent_on_meta() -> contextlib.AbstractContextManager:
    """Indexing by a mask (a mixture-of-experts layer's ``torch.where``) taking every index on
    the meta device, where this torch can (:func:`plait._torch_compat.meta_nonzero_patch`)."""
    patch = meta_nonzero_patch()
    return patch() if patch is not None else contextlib.nullcontext()


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


def leaves_reached(x: torch.Tensor, cut: Any = None) -> set[int]:
    """The ids of the leaf tensors (parameters, marked block outputs) in ``x``'s history, not
    looking past the autograd node ``cut``."""
    reached: set[int] = set()
    seen: set[int] = set()
    stack: list[Any] = [x.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node is cut or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if variable is not None:
            reached.add(id(variable))
        stack.extend(n for n, _ in node.next_functions)
    return reached


def _reaches(x: torch.Tensor, leaves: list[torch.Tensor]) -> bool | None:
    """Whether ``x`` was computed from one of ``leaves``; None when ``x`` has no history."""
    if any(x is leaf for leaf in leaves):
        return True
    if x.grad_fn is None:
        return None
    return not {id(leaf) for leaf in leaves}.isdisjoint(leaves_reached(x))


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


def _distinct_blocks(replica: nn.Module, path: str) -> tuple[list[str], list[nn.Module]]:
    """The names and modules of the blocks at ``path`` of ``replica``, whose floating
    parameters this makes trainable (so that every activation records its history); empty
    when a module is more than one block (one layer applied several times), whose calls
    cannot be told apart."""
    container = replica.get_submodule(path) if path else replica
    named = [(k, m) for k, m in container._modules.items() if m is not None]
    if len({id(m) for _, m in named}) < len(named):
        return [], []
    for p in replica.parameters():
        if p.is_floating_point():
            p.requires_grad_(True)
    return [k for k, _ in named], [m for _, m in named]


def chain_break(replica: nn.Module, path: str, x: Any, kwargs: dict[str, Any]
                ) -> tuple[str, str] | bool | None:
    """The names of the first two consecutive blocks at ``path`` of which the second is not fed
    by the first's output, in one forward of ``replica`` (a :func:`meta_replica`, whose
    parameters this makes trainable so that every activation records its history) on ``x``
    and ``kwargs`` (meta tensors); True when every block after the first was seen fed by the
    one before; None when it cannot tell (for some block or all). A block under several names
    (one layer applied several times) is not asked about."""
    names, blocks = _distinct_blocks(replica, path)
    if not blocks:
        return None
    outputs: dict[int, list[torch.Tensor]] = {}
    asked: list[int] = []
    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(partial(_ask, outputs, asked, i),
                                                       with_kwargs=True))
        handles.append(block.register_forward_hook(partial(_mark, outputs, i)))
    prefix = f"{path}." if path else ""
    try:
        with torch.enable_grad(), _data_dependent_on_meta():
            replica(*(() if x is None else (x,)), **kwargs)
    except _BrokenChainError as broken:
        return prefix + names[broken.before], prefix + names[broken.after]
    except Exception:  # noqa: BLE001 - not runnable on meta: no verdict
        return None
    finally:
        for h in handles:
            h.remove()
    return True if set(asked) >= set(range(1, len(blocks))) else None


def loss_reads_before(replica: nn.Module, path: str, start: int, x: Any,
                      kwargs: dict[str, Any], loss_of: Callable[[Any], Any]) -> list[str] | None:
    """The names of the blocks before block ``start`` (the last stage's first) whose work the
    loss reads other than through the input of block ``start``, in one forward of ``replica``
    (a :func:`meta_replica`) on ``x`` and ``kwargs`` (meta tensors) followed by
    ``loss_of(output)``: an empty list when none is; None when it cannot tell.

    The last stage computes the loss from what it receives (the input of its first block) and
    its own modules; the blocks other stages hold are stand-ins there that compute nothing. A
    term the forward gathers from every block (a mixture-of-experts balance loss each block
    keeps or returns) is therefore computed from the last stage's blocks only, and a forward
    that skips what is missing (``if block.aux is not None``) or gathers it through
    ``self.modules()`` trains on it silently. The loss's history is walked without looking
    past block ``start``'s input (so a residual in the forward, ``h = h + block(h)``, which
    reads that input, is fine), and each block's outputs are replaced by marked copies, as in
    :func:`chain_break`: an earlier block's parameters or marked outputs reached all the same
    are read besides the hidden states handed on. No verdict when a block before ``start``
    returns an output that cannot be marked (a dict, or from inside a reentrant checkpoint),
    when blocks repeat, or when the forward or the loss does not run on meta tensors."""
    names, blocks = _distinct_blocks(replica, path)
    if not 0 < start < len(blocks):
        return None
    outputs: dict[int, list[torch.Tensor]] = {}
    handed_on: list[Any] = []

    def received(module: nn.Module, args: tuple, kw: dict[str, Any]) -> None:
        h = args[0] if args else kw.get("hidden_states")
        if not handed_on:
            handed_on.append(h)

    handles = [block.register_forward_hook(partial(_mark, outputs, i))
               for i, block in enumerate(blocks)]
    handles.append(blocks[start].register_forward_pre_hook(received, with_kwargs=True))
    try:
        with torch.enable_grad(), _data_dependent_on_meta():
            loss = loss_of(replica(*(() if x is None else (x,)), **kwargs))
    except Exception:  # noqa: BLE001 - not runnable on meta: no verdict
        return None
    finally:
        for h in handles:
            h.remove()
    if isinstance(loss, (tuple, list)):  # (sum, count)
        loss = loss[0] if loss else None
    cut = handed_on[0].grad_fn if handed_on and isinstance(handed_on[0], torch.Tensor) else None
    if (not isinstance(loss, torch.Tensor) or loss.grad_fn is None or cut is None
            or any(i not in outputs for i in range(start))):
        return None
    reached = leaves_reached(loss, cut)
    held_later = {id(p) for b in blocks[start:] for p in b.parameters()}
    before = [i for i in range(start)
              if any(id(leaf) in reached for leaf in outputs[i])
              or any(id(p) in reached and id(p) not in held_later for p in blocks[i].parameters())]
    prefix = f"{path}." if path else ""
    return [prefix + names[i] for i in before]


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


def side_input(replica: nn.Module, path: str, x: Any, kwargs: dict[str, Any]
               ) -> tuple[str, int] | None:
    """The first block at ``path`` of ``replica`` (a :func:`meta_replica`) that one forward on
    ``x`` calls with a tensor beyond its first positional argument that the forward computed
    from trainable parameters (a U-Net's decoder block given the encoder's output: a skip that
    crosses every block between them), as (its name, the argument's position); None when no
    block is (or the forward cannot run on meta). A pipeline stage receives only the previous
    stage's output, so a stage that does not hold the module that computed such a tensor
    never has it. Keyword arguments are not asked about: those of the model's own input reach
    every stage, and a cross-attention's encoder states go by keyword in the models plait
    pipelines."""
    names, blocks = _distinct_blocks(replica, path)
    found: list[tuple[str, int]] = []

    def pre(name: str, _m: nn.Module, args: tuple) -> None:
        if found:
            return
        for i, a in enumerate(args[1:], 1):
            if isinstance(a, torch.Tensor) and a.grad_fn is not None:
                found.append((name, i))
                return

    prefix = f"{path}." if path else ""
    handles = [b.register_forward_pre_hook(partial(pre, prefix + n))
               for n, b in zip(names, blocks, strict=True)]
    try:
        with torch.enable_grad(), _data_dependent_on_meta():
            replica(*(() if x is None else (x,)), **kwargs)
    except Exception:  # noqa: BLE001 - not runnable on meta: no verdict
        return None
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def chain_source(replica: nn.Module, path: str, x: Any, kwargs: dict[str, Any]
                 ) -> str | None:
    """The keyword input the first block at ``path`` of ``replica`` (a :func:`meta_replica`)
    is computed from when it is not computed from ``x``, the forward's first input; None
    when it is (or the forward cannot run on meta, or no keyword input reaches it either).

    A pipeline chains the forward's first input: later stages get the hidden states in its
    place and every other input by name. A two-tower model whose forward takes
    ``(pixels, ids)`` and runs its blocks on ``ids`` would hand the text tower's hidden
    states to the image tower on a later stage as ``pixels``. Which input a tensor comes
    from is followed op by op (a torch function mode labels every result with the inputs
    its arguments came from), on meta tensors."""
    if not isinstance(x, torch.Tensor):
        return None
    from torch.overrides import TorchFunctionMode

    labels: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}

    def label(t: Any, names: frozenset[str]) -> None:
        if isinstance(t, torch.Tensor) and names:
            held = labels.get(id(t))
            labels[id(t)] = (t, names | (held[1] if held is not None else frozenset()))

    def of(t: Any) -> frozenset[str]:
        held = labels.get(id(t)) if isinstance(t, torch.Tensor) else None
        return held[1] if held is not None and held[0] is t else frozenset()

    class Follow(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                               kw: dict[str, Any] | None = None) -> Any:
            kw = kw or {}
            out = func(*args, **kw)
            found: set[str] = set()
            tree_map_only()(torch.Tensor, lambda t: found.update(of(t)), (args, kw))
            if found:
                tree_map_only()(torch.Tensor, lambda t: label(t, frozenset(found)), out)
            return out

    names, blocks = _distinct_blocks(replica, path)
    if not blocks:
        return None
    seen: list[frozenset[str]] = []

    def pre(_m: nn.Module, args: tuple) -> None:
        if not seen and args and isinstance(args[0], torch.Tensor):
            seen.append(of(args[0]))

    label(x, frozenset({""}))
    for key, value in kwargs.items():
        label(value, frozenset({key}))
    handle = blocks[0].register_forward_pre_hook(pre)
    try:
        with torch.no_grad(), _data_dependent_on_meta(), Follow():
            replica(x, **kwargs)
    except Exception:  # noqa: BLE001 - not runnable on meta: no verdict
        return None
    finally:
        handle.remove()
    if not seen or "" in seen[0] or not seen[0]:
        return None
    return sorted(seen[0])[0]


def chain_source_message(model_name: str, first: str, path: str, source: str) -> str:
    """The refusal for blocks fed from another input than the forward's first, naming the fix."""
    return (f"the first block of {path} runs on {model_name}.forward's input {source!r}, "
            f"not on its first input {first!r}: a pipeline chains the forward's first input "
            f"from stage to stage (later stages get the hidden states in its place, the "
            f"other inputs by name), so there {first!r} would be the hidden states. Put "
            f"{source!r} first in the forward's signature (forward(self, {source}, {first}, "
            f"...)), or run with pp=1")
