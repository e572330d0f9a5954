"""Check numerically that an inferred tensor-parallel plan splits each block into whole heads.

A fake-tensor forward (:func:`plait.parallel.tp_infer.check_shapes`) catches a split that
changes shapes, not one that keeps them: a fused q|k|v layer laid out head by head
(``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``, as GPT-NeoX and BLOOM store it) split as three blocks
(``[q | k | v]``, as minGPT and GPT-2 store it) gives every rank tensors of the right shapes that
mix one head's queries with another head's keys: a different model, silently.

What a correct split guarantees is that rank r's rows of the column-parallel layers and its
columns of the row-parallel one are whole heads (or whole hidden units of an MLP), and a block
computes the same function whatever order its heads are in. So swapping rank 0's share with
rank 1's in every split layer of a block at once (their rows, and the exit's columns) must leave
the block's output unchanged, and a split that mixes heads changes it. The check runs each kind
of block once (the first block of each name pattern) on the inputs it receives in one real
forward of the model on a small guessed input, in eval mode and without gradients, and puts the
weights back.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from .._torch_compat import pytree
from .tp_example import Example, run_on
from .tp_infer import _glob_levels
from .tp_kv import KVHeads
from .tp_lora import low_rank_parts

# How a style lays out a linear's weight: the dimension split over tp, and in how many equal
# parts it is split first (a fused q|k|v layer: each third on its own).
_SPLIT = {"colwise": (0, 1), "colwise_qkv": (0, 3), "rowwise": (1, 1)}


class _CapturedError(Exception):
    """Raised from a hook once every block to check has its input: the rest of the forward
    is not needed."""


def _swap_index(size: int, parts: int, tp: int, ranks: tuple[int, int] = (0, 1)
                ) -> torch.Tensor:
    """A permutation of ``range(size)`` exchanging two ranks' shares (rank 0's and rank 1's)
    of each of ``parts`` equal parts."""
    index = torch.arange(size)
    part = size // parts
    share = part // tp
    for p in range(parts):
        a = p * part + ranks[0] * share
        b = p * part + ranks[1] * share
        index[a:a + share], index[b:b + share] = (torch.arange(b, b + share),
                                                 torch.arange(a, a + share))
    return index


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The block's output: its first floating tensor. What follows in a tuple (attention
    weights, one per head) is permuted with the heads, legitimately."""
    flatten, _ = pytree()
    return next((v for v in flatten(value)[0]
                 if isinstance(v, torch.Tensor) and v.is_floating_point()), None)


def _block_of(name: str, model: nn.Module | None = None) -> str:
    """The block a split linear belongs to: its parent, or its grandparent when the parent is
    a LoRA layer (the linear is that layer's base or side path)."""
    parent = name.rpartition(".")[0]
    if model is not None and parent and low_rank_parts(model.get_submodule(parent)) is not None:
        return parent.rpartition(".")[0]
    return parent


def mixed_blocks(model: nn.Module, matched: dict[str, str], tp: int,
                 example: torch.Tensor | Example,
                 kv: dict[str, KVHeads] | None = None) -> list[str] | None:
    """The blocks (one per name pattern) whose output changes when rank 0's and rank 1's
    shares of their split linears are swapped, i.e. whose split mixes heads; None when the
    check cannot run (a parameter on the meta device, a forward that fails on the guess).

    ``kv``: k/v projections whose heads are replicated (:mod:`plait.parallel.tp_kv`), each
    rank computing the kv head its query heads read. Ranks 0 and 1 then read the same kv head,
    so a block with K >= 2 of them is also checked with its split layers cut in K shares
    instead of tp, the first two swapped, and kv heads 0 and 1 swapped with them: unchanged
    only if query head i reads kv head i // (H/K), as the replication assumes
    (``repeat_interleave``, not ``repeat``)."""
    if tp < 2 or any(p.is_meta for p in model.parameters()):
        return None
    kv = kv or {}
    split = {n: s for n, s in matched.items() if s in _SPLIT or n in kv}
    blocks: dict[str, str] = {}  # pattern -> the first block of it
    for name in split:
        # One block per pattern: every index a *, as inference collapses them.
        block = _block_of(name, model)
        blocks.setdefault(_glob_levels(block)[0], block)
    inputs = block_inputs(model, list(blocks.values()), example)
    if inputs is None:
        return None
    training = model.training
    model.train(False)  # no dropout: the two runs of a block must compute the same thing
    try:
        with torch.no_grad():
            return [name for name in blocks.values() if name in inputs and any(
                _changes_when_swapped(model, name, split, kv, shares, *inputs[name])
                for shares in _shares(name, kv, tp))]
    finally:
        model.train(training)


def block_inputs(model: nn.Module, names: list[str], example: torch.Tensor | Example
                 ) -> dict[str, tuple[tuple, dict]] | None:
    """The (args, kwargs) each named block receives in one forward of ``model`` on ``example``
    (eval mode, no gradients; stopped once every block has its input), or None when the
    forward fails on the guess."""
    inputs: dict[str, tuple[tuple, dict]] = {}
    handles = []

    def capture(name: str) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            inputs.setdefault(name, _copied((args, kwargs)))
            if len(inputs) == len(names):
                raise _CapturedError
        return hook

    for name in names:
        handles.append(model.get_submodule(name).register_forward_pre_hook(
            capture(name), with_kwargs=True))
    training = model.training
    model.train(False)
    try:
        with torch.no_grad():
            run_on(model, example)
    except _CapturedError:
        pass
    except Exception:  # noqa: BLE001 - not runnable on the guess: not checked
        return None
    finally:
        for h in handles:
            h.remove()
        model.train(training)
    return inputs


def _copied(value: Any) -> Any:
    """A deep copy of a block's inputs: a forward may update one in place (a key/value cache
    that transformers passes in grows with every call)."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an input that cannot be copied is used as it is
        return value


def _shares(block_name: str, kv: dict[str, KVHeads], tp: int) -> list[int]:
    """Into how many shares the split layers of ``block_name`` are cut for a swap: tp (the
    ranks'), and K for K >= 2 replicated kv heads (the groups of ranks reading one kv head)."""
    heads = {h.heads for n, h in kv.items() if _block_of(n) == block_name}
    return [tp] + sorted(k for k in heads if k > 1)


def _changes_when_swapped(model: nn.Module, block_name: str, split: dict[str, str],
                          kv: dict[str, KVHeads], shares: int, args: tuple, kwargs: dict
                          ) -> bool:
    """Whether ``block_name``'s output changes when the first two of ``shares`` shares of its
    split layers are swapped (with the kv heads those shares read)."""
    block = model.get_submodule(block_name)
    before = _first_tensor(block(*_copied(args), **_copied(kwargs)))
    if before is None:
        return False
    before = before.clone()
    saved = []
    try:
        for name, style in split.items():
            if _block_of(name, model) != block_name:
                continue
            linear = model.get_submodule(name)
            assert isinstance(linear, (nn.Linear, nn.Embedding))
            if isinstance(linear, nn.Embedding):  # a per-head table: its columns are heads
                dim, index = 1, _swap_index(linear.weight.shape[1], 1, shares)
            elif name in kv:  # whole on every rank: swap the kv heads the two shares read
                dim, heads = 0, kv[name].heads
                index = _swap_index(linear.weight.shape[0], 1, heads, (0, heads // shares))
            else:
                dim, parts = _SPLIT[style]
                index = _swap_index(linear.weight.shape[dim], parts, shares)
            saved.append((linear.weight, linear.weight.detach().clone()))
            linear.weight.data = linear.weight.data.index_select(dim, index)
            bias = linear.bias if isinstance(linear, nn.Linear) else None
            if dim == 0 and bias is not None:
                saved.append((bias, bias.detach().clone()))
                bias.data = bias.data.index_select(0, index)
        after = _first_tensor(block(*_copied(args), **_copied(kwargs)))
    finally:
        for param, value in saved:
            param.data = value
    scale = max(1.0, before.abs().max().item())
    return after is None or after.shape != before.shape or not torch.allclose(
        after, before, rtol=1e-4, atol=1e-5 * scale)
