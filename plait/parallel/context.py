"""Context parallelism (the ``cp`` mesh axis): each rank of a cp group holds a slice of every
sequence, and attention still sees the whole sequence.

The form is the all-gather one (as Llama 3 was trained): every rank keeps its own queries,
all-gathers keys and values over the cp group in the forward (their gradients are
reduce-scattered back in the backward) and runs the ordinary
``F.scaled_dot_product_attention`` of its queries against every key, with a boolean mask built
from the global token positions. Everything outside attention is per token, so it runs on the
local slice unchanged.

Why not ``torch.distributed.tensor.experimental.context_parallel``: in torch 2.13 it swaps in
ring attention for the CUDA kernels only (its handler table holds the flash, efficient and
cuDNN SDPA ops); on a CPU, SDPA dispatches ``_scaled_dot_product_flash_attention_for_cpu``,
which it does not handle ("NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered"), so it cannot run where plait's default backend (gloo on CPUs) runs.
The all-gather form is plain tensor code on any device, its only collective is an all-gather
(counted by plait's ledger like any other), and a long sequence's K/V (2 x tokens x kv_heads x
head_dim per layer) is small next to the activations it saves.

Load balance under a causal mask: each sequence is cut into ``2 * cp`` chunks and rank ``r``
keeps chunks ``r`` and ``2 * cp - 1 - r`` (head and tail), so every rank's queries see the
same number of unmasked keys. The mask is ``query position >= key position`` on the global
positions, so the split never changes what attends to what.

How a model is run: :func:`cp_attention` patches ``torch.nn.functional.
scaled_dot_product_attention`` (the module attribute, which is what ``F.scaled_dot_product_
attention(...)`` and Hugging Face's SDPA attention look up at call time) for the duration of a
forward and its backward, as torch's own context_parallel does; the patch is undone on exit.
What it cannot compute the whole-sequence answer for (an explicit mask, dropout, keys of
another length than the queries) is refused by name.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .._torch_compat import pytree

if TYPE_CHECKING:
    from ..mesh import Mesh


def head_tail_positions(seq: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """The global positions (1-D int64) of rank ``rank``'s slice of a sequence of ``seq``
    tokens: chunks ``rank`` and ``2*cp - 1 - rank`` of ``2*cp`` equal chunks."""
    check_divisible(seq, cp)
    chunk = seq // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail_start = (2 * cp - 1 - rank) * chunk
    tail = torch.arange(tail_start, tail_start + chunk, device=device)
    return torch.cat([head, tail])


def check_divisible(seq: int, cp: int) -> None:
    if seq % (2 * cp):
        raise ValueError(
            f"a sequence of {seq} tokens does not split across cp={cp}: context parallelism "
            f"cuts each sequence into 2*cp={2 * cp} equal chunks (head and tail per rank, to "
            f"balance causal attention); pad or crop sequences to a multiple of {2 * cp}")


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` in forward; reduce-scatter (sum) of the gradient in
    backward: each rank's keys and values are used by every rank's queries, so their gradient
    is the sum of every rank's contribution to them (Megatron's all-gather/reduce-scatter
    pair, applied to the sequence)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        local = local.contiguous()
        out = local.new_empty((n * local.shape[0], *local.shape[1:]))
        dist.all_gather_single(out, local, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        n = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // n, *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad, group=ctx.group)
        return out, None


def gather_sequence(t: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """``t`` with its dim ``dim`` all-gathered over ``group`` (rank order), differentiably."""
    moved = t.movedim(dim, 0)
    return _GatherSequence.apply(moved, group).movedim(0, dim)


@dataclass(frozen=True)
class ContextGroup:
    """The cp group of this rank: what the train step needs to split batches and run
    attention. ``rank``/``size``: this rank's index in the group and the group's size."""

    group: dist.ProcessGroup
    rank: int
    size: int

    def positions(self, seq: int, device: Any = None) -> torch.Tensor:
        """Global positions of this rank's slice of a ``seq``-token sequence."""
        return head_tail_positions(seq, self.size, self.rank, device)

    def key_positions(self, seq: int, device: Any = None) -> torch.Tensor:
        """Global positions of the gathered keys, in the all-gather's order (rank 0's slice,
        then rank 1's, ...): no reordering is needed, the mask reads positions."""
        return torch.cat([head_tail_positions(seq, self.size, r, device)
                          for r in range(self.size)])


def shard_sequence(t: torch.Tensor, positions: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's slice of ``t`` along its sequence dim ``dim`` (``positions`` from
    :meth:`ContextGroup.positions`)."""
    return t.index_select(dim, positions.to(t.device))


# The attribute cp_attention's replacement keeps torch's own attention function under.
_TORCH_SDPA = "_plait_torch_sdpa"


@contextlib.contextmanager
def cp_attention(cp: ContextGroup, seq: int, whole_model: bool = False) -> Iterator[None]:
    """While inside: ``F.scaled_dot_product_attention`` of this rank's queries (its slice of a
    ``seq``-token sequence) attends to the whole sequence. Keep the backward inside too
    (activation checkpointing recomputes attention there). Entered again inside (a loss of
    several terms counts the later micro-batches' terms inside the first one's), the inner
    slice's attention wraps torch's own function, not the outer one's, and the outer one's
    is back on exit. ``whole_model`` (not a pipeline stage, which may hold no attention): a
    forward that never called it is refused on exit, before the optimizer steps: attention
    written out (``softmax(q @ k.T) @ v``) would have read this rank's slice only."""
    previous = F.scaled_dot_product_attention
    original = getattr(previous, _TORCH_SDPA, previous)
    q_pos = cp.positions(seq)
    k_pos = cp.key_positions(seq)
    local = q_pos.numel()
    masks: dict[torch.device, torch.Tensor] = {}
    calls = [0]

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                  is_causal: bool = False, scale: float | None = None,
                  **kwargs: Any) -> torch.Tensor:
        if attn_mask is not None:
            raise ValueError(
                f"scaled_dot_product_attention got an explicit attn_mask "
                f"(shape {tuple(attn_mask.shape)}) under context parallelism (cp={cp.size}): "
                f"each rank holds a slice of the sequence, so a mask over local positions "
                f"would be wrong; use is_causal=True (or no mask) and leave out padding masks "
                f"(pack or pad sequences with labels set to -100 instead), or train with cp=1")
        if dropout_p > 0:
            raise ValueError(
                f"scaled_dot_product_attention got dropout_p={dropout_p} under context "
                f"parallelism (cp={cp.size}), which does not reproduce one device's dropout; "
                f"set the attention dropout to 0 (e.g. config.attention_dropout=0.0), or "
                f"train with cp=1")
        if query.shape[-2] != local or key.shape[-2] != local:
            raise ValueError(
                f"scaled_dot_product_attention got {query.shape[-2]} queries and "
                f"{key.shape[-2]} keys under context parallelism (cp={cp.size}), but this "
                f"rank's slice of the {seq}-token sequence has {local}: attention over "
                f"anything but the sequence the batch carried (cross-attention, added tokens, "
                f"a KV cache) cannot be split this way; train such a model with cp=1")
        calls[0] += 1
        full_k = gather_sequence(key, cp.group, key.ndim - 2)
        full_v = gather_sequence(value, cp.group, value.ndim - 2)
        mask = None
        if is_causal:
            mask = masks.get(query.device)
            if mask is None:
                mask = masks[query.device] = (q_pos[:, None] >= k_pos[None, :]).to(query.device)
        return original(query, full_k, full_v, attn_mask=mask, dropout_p=0.0, is_causal=False,
                        scale=scale, **kwargs)

    setattr(attention, _TORCH_SDPA, original)
    F.scaled_dot_product_attention = attention  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous
    if whole_model and not calls[0]:
        raise ValueError(
            f"context parallelism (cp={cp.size}) gives each rank a slice of every sequence and "
            f"makes F.scaled_dot_product_attention attend over the whole of it, but the model's "
            f"forward never called it: attention written out (softmax(q @ k.transpose(-2, -1)) "
            f"@ v) would attend over this rank's slice only; compute attention with "
            f"F.scaled_dot_product_attention, or train with cp=1")


# ------------------------------------------------------------------------------ the train step
POSITIONS_KWARG = "position_ids"


def context_group(module: nn.Module, mesh: Mesh) -> ContextGroup:
    """This rank's cp group for ``module``, once the module is known to take the positions of
    its slice: a model that numbers positions from its input's length (``arange(seq)`` for
    rotary or a position embedding) would number a slice 0..seq/cp and train a different
    model, silently; one that takes ``position_ids`` is given the slice's global positions."""
    why = cp_refusal(module, mesh.size("cp"))
    if why is not None:
        raise ValueError(why)
    return ContextGroup(mesh["cp"].get_group(), mesh.local_rank("cp"), mesh.size("cp"))


def cp_refusal(module: nn.Module, cp: int) -> str | None:
    """Why ``module`` cannot be laid out with context parallelism of degree ``cp``, as far as
    its signature says (None: it takes ``position_ids``); what only a batch shows (an
    explicit attention mask, a loss that shifts labels) is refused at the step."""
    inner = module.module if hasattr(module, "module") and isinstance(
        module.module, nn.Module) else module
    two = encoder_decoder(inner)
    if two is not None:
        return (f"context parallelism (cp={cp}) splits one sequence per batch row over the cp "
                f"ranks, and {type(inner).__name__} is an encoder-decoder ({two}), whose "
                f"decoder attends to the encoder's whole output (cross-attention), a sequence "
                f"of its own that the slices of one do not split: use tp or dp for "
                f"encoder-decoder models (cp=1)")
    config = getattr(inner, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    if isinstance(attn, str) and attn != "sdpa" and hasattr(config, "is_encoder_decoder"):
        return (f"context parallelism (cp={cp}) makes F.scaled_dot_product_attention attend "
                f"over the whole sequence, and {type(inner).__name__} computes attention with "
                f"attn_implementation={attn!r}, which would attend over each rank's slice "
                f"only: build it with attn_implementation='sdpa', or train with cp=1")
    if takes_positions(inner):
        return None
    return (f"context parallelism (cp={cp}) gives each rank a slice of every sequence, so "
            f"{type(inner).__name__}.forward must be told the slice's global positions: add a "
            f"'{POSITIONS_KWARG}' keyword argument (a (batch, local_seq) int64 tensor; use it "
            f"wherever positions are computed, e.g. rotary embeddings or a position embedding; "
            f"a model without positional encodings may ignore it), or train with cp=1")


# Forward parameters that name a second sequence: the decoder's own (``decoder_input_ids``,
# ``decoder_attention_mask``) or the encoder's output a decoder attends to
# (``encoder_hidden_states``, ``encoder_outputs``), as Hugging Face names them.
_SECOND_SEQUENCE = ("decoder_", "encoder_")


def encoder_decoder(module: nn.Module) -> str | None:
    """What makes ``module`` an encoder-decoder (its stacks of blocks, or what says so), or
    None: a Hugging Face config saying ``is_encoder_decoder`` or ``add_cross_attention`` (its
    forward takes ``encoder_hidden_states`` whether or not it attends to them); a model without
    one, a forward taking a parameter named for the decoder's or the encoder's sequence."""
    from .pipeline_hf import other_block_stacks

    config = getattr(module, "config", None)
    if hasattr(config, "is_encoder_decoder"):
        flags = [f for f in ("is_encoder_decoder", "add_cross_attention")
                 if getattr(config, f, False) is True]
        said = f"config.{flags[0]}" if flags else None
    else:
        try:
            params = list(inspect.signature(module.forward).parameters)
        except (TypeError, ValueError):
            params = []
        named = [p for p in params if p.startswith(_SECOND_SEQUENCE)]
        said = f"its forward takes {named[0]}" if named else None
    if said is None:
        return None
    stacks = other_block_stacks(module, "")
    return f"stacks {' and '.join(stacks)}" if len(stacks) >= 2 else said


def takes_positions(module: nn.Module) -> bool:
    """Whether ``module.forward`` accepts ``position_ids`` (by name, or through ``**kwargs``,
    as Hugging Face models do)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return POSITIONS_KWARG in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def split_batch(batch: Any, cp: ContextGroup) -> tuple[Any, int, dict[str, torch.Tensor]]:
    """This rank's slice of every sequence in ``batch``: (the sliced batch, the whole sequence
    length, the keyword arguments to add to the model call).

    The sequence length is dim 1 of the first input tensor; every tensor in the batch is cut
    along its dim 1 (inputs, labels, masks, given position ids), so each must have that length
    there. The positions go to the model as ``position_ids``: in the batch when it is a dict
    (and holds none already), else as a keyword argument."""
    first = _first_tensor(batch[0] if isinstance(batch, (tuple, list)) else batch)
    if first is None or first.ndim < 2:
        shape = None if first is None else tuple(first.shape)
        raise ValueError(f"context parallelism (cp={cp.size}) splits each sequence along dim 1 "
                         f"of the inputs, but the first input has shape {shape}; give "
                         f"(batch, seq, ...) inputs, or train with cp=1")
    seq = first.shape[1]
    check_divisible(seq, cp.size)
    positions = cp.positions(seq, first.device)

    def cut(t: Any, where: str) -> Any:
        if isinstance(t, dict):
            return {k: cut(v, f"{where}[{k!r}]") for k, v in t.items()}
        if isinstance(t, (tuple, list)):
            return type(t)(cut(v, f"{where}[{i}]") for i, v in enumerate(t))
        if not isinstance(t, torch.Tensor):
            return t
        if (t.ndim >= 2 and t.shape[1] != seq and where != "batch['labels']"
                and where.startswith(("batch[0]", "batch['"))):  # an input, not the targets
            raise ValueError(
                f"context parallelism (cp={cp.size}) cuts every input of the batch at the same "
                f"positions of its dim 1, but {where} has {t.shape[1]} positions there where "
                f"the first input has {seq}: a second sequence of another length (an "
                f"encoder-decoder's source and target) cannot be cut alike; give both one "
                f"length (pad the shorter, -100 on its labels), or train with cp=1")
        if t.ndim < 2 or t.shape[1] != seq:
            raise ValueError(
                f"context parallelism (cp={cp.size}) splits every tensor of the batch along "
                f"its sequence dim (1), but {where} has shape {tuple(t.shape)} where the "
                f"inputs have {seq} positions: per-row targets (a class per sequence) are not "
                f"per-token, and cannot be split; give per-token labels (-100 where none), or "
                f"train with cp=1")
        return shard_sequence(t, positions, 1)

    local = cut(batch, "batch")
    given = positions.expand(first.shape[0], -1)
    if isinstance(local, dict):
        if POSITIONS_KWARG not in local:
            local = {**local, POSITIONS_KWARG: given}
        return local, seq, {}
    inputs = local[0]
    if isinstance(inputs, dict):
        if POSITIONS_KWARG not in inputs:
            local = type(local)([{**inputs, POSITIONS_KWARG: given}, *local[1:]])
        return local, seq, {}
    return local, seq, {POSITIONS_KWARG: given}


def _first_tensor(value: Any) -> torch.Tensor | None:
    flatten, _ = pytree()
    return next((v for v in flatten(value)[0] if isinstance(v, torch.Tensor)), None)


SHIFTED_LABELS = (
    "the loss leaves out each row's first label (it shifts logits[:, :-1] against "
    "labels[:, 1:], as Hugging Face causal LMs do with loss_fn=None), which under context "
    "parallelism (cp={cp}) would shift each rank's slice, not the sequence: shift the labels "
    "in the data instead (labels[t] = token t+1, -100 at the end) and pass a loss_fn that "
    "does not shift, e.g. F.cross_entropy(logits.flatten(0, 1), labels.flatten())")
