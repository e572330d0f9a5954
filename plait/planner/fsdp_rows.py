"""The rows FSDP2 pads: each parameter's shape, so the planner prices ZeRO-2/3 at the sizes
FSDP2 gathers, reduce-scatters and allocates rather than at the model's element count, and a
dim tensor parallelism splits unevenly at the piece its first rank holds.

FSDP2 (``fully_shard``) cuts dim 0 of each parameter (its tensor-parallel-local piece beside
tp) with ``torch.chunk`` and pads every shard to the first, the largest: a parameter of ``r``
rows moves as ``ceil(r / dp_shard) * dp_shard`` rows (``plait.comm.volumes.fsdp_padded_numel``),
a vocabulary of 51 as 52 at dp_shard 2 or 4, a Linear with 7 outputs as 8. Tensor
parallelism cuts its dim as ``torch.chunk`` does too (DTensor's ``Shard``): 51 vocabulary
rows at tp=2 are 26 on the first rank and 25 on the second, not 25.5, and data parallelism
reduces each rank's own piece. Both depend on the plan, so the model's stats keep the shapes
(``ParamRows``, read off a module) and the planner adds what they change for the plan it
prices (:func:`padding`).

The shapes also say which parameters train, block by block (:func:`trained`): FSDP2 gathers
every parameter of a unit, frozen ones too, but reduce-scatters only the gradients that exist
(``FSDPParamGroup.post_backward`` collects the parameters whose gradient is not None, and a
unit with none issues no reduce-scatter at all); DDP buckets only the parameters that require
grad; gradient clipping takes one norm per gradient. Blocks need not train alike (LoRA with a
frozen first block, a frozen first pipeline stage), so these are kept per block, not as a mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from plait.comm.volumes import fsdp_padded_numel


@dataclass(frozen=True)
class Rows:
    """One parameter tensor: its shape, the dim tensor parallelism splits (None: whole on every
    rank) and whether it trains (FSDP2 reduce-scatters only those)."""

    shape: tuple[int, ...]
    tp_dim: int | None = None
    trained: bool = True

    def held(self, tp: int, shards: int) -> int:
        """Elements the tp rank holding the largest piece (``torch.chunk``: the first,
        ``ceil(n / tp)`` of a split dim) holds of this tensor, padded as FSDP2 pads it over
        ``shards`` ranks (1: not sharded, no padding): what it gathers and reduces."""
        local = list(self.shape)
        if self.tp_dim is not None and tp > 1:
            local[self.tp_dim] = -(-local[self.tp_dim] // tp)
        return fsdp_padded_numel(tuple(local), shards)

    def padding(self, tp: int, shards: int) -> float:
        """:meth:`held` beyond this tensor's even tp-local count (``numel / tp`` split,
        ``numel`` whole: what the planner's ``Held`` counts)."""
        numel = 1
        for n in self.shape:
            numel *= n
        counted = numel / tp if self.tp_dim is not None and tp > 1 else float(numel)
        return self.held(tp, shards) - counted


@dataclass(frozen=True)
class Padding:
    """Elements FSDP2 adds to one part of the model: all of them (its gathers, its memory),
    and those of the parameters that train (its reduce-scatters)."""

    all: float = 0.0
    trained: float = 0.0


@dataclass(frozen=True)
class Trained:
    """What data parallelism reduces of some parameter tensors on one rank: the elements of
    their gradients (tp-local, at FSDP2's padded size where it shards) and how many gradient
    tensors (gradient clipping takes one norm each)."""

    elements: float = 0.0
    tensors: int = 0

    def __add__(self, other: Trained) -> Trained:
        return Trained(self.elements + other.elements, self.tensors + other.tensors)


@dataclass(frozen=True)
class ParamRows:
    """Every parameter tensor of a model, in the parts the planner splits it into: ``stack``
    the tensors of each block of the stack in order, ``embed`` the embeddings', ``rest`` the
    others (final norm, head)."""

    stack: tuple[tuple[Rows, ...], ...]
    embed: tuple[Rows, ...]
    rest: tuple[Rows, ...]

    @property
    def block(self) -> tuple[Rows, ...]:
        """The tensors of all blocks (a block's padding is their mean, as its parameters
        are)."""
        return tuple(r for block in self.stack for r in block)

    @property
    def blocks(self) -> int:
        return len(self.stack)


def _sum(rows: tuple[Rows, ...], tp: int, shards: int, per: int = 1) -> Padding:
    pads = [(r.padding(tp, shards), r.trained) for r in rows]
    return Padding(all=sum(p for p, _ in pads) / per,
                   trained=sum(p for p, trained in pads if trained) / per)


def padding(rows: ParamRows, tp: int, shards: int) -> tuple[Padding, Padding, Padding]:
    """Elements beyond an even split (:meth:`Rows.padding`) at ``tp`` and ``shards`` (FSDP2's
    dp_shard; 1: not sharded) of one block, of the embeddings and of the rest."""
    return (_sum(rows.block, tp, shards, max(rows.blocks, 1)), _sum(rows.embed, tp, shards),
            _sum(rows.rest, tp, shards))


def trained(rows: tuple[Rows, ...], tp: int, shards: int, *, even: bool = False) -> Trained:
    """The gradients of the tensors among ``rows`` that train, as one rank reduces them at
    ``tp`` and ``shards`` (FSDP2's dp_shard; 1: not sharded): each at :meth:`Rows.held`, or
    where ``even`` (tensor parallelism over a model without a layer plan, every tensor priced
    as split evenly) at ``numel / tp``."""
    out = Trained()
    for r in rows:
        if r.trained:
            numel = 1
            for n in r.shape:
                numel *= n
            out += Trained(numel / tp if even else float(r.held(tp, shards)), 1)
    return out


def copy_padding(shapes: tuple[tuple[int, ...], ...], tp: int, shards: int) -> float:
    """:func:`padding` of the copy of a tied weight on the last pipeline stage (the head's,
    split over tp on its rows as the embedding's is)."""
    return sum(Rows(shape, 0).padding(tp, shards) for shape in shapes)


def param_rows(model: nn.Module, blocks: list[nn.Module], found: tuple[Any, bool] | None
               ) -> ParamRows:
    """Read ``ParamRows`` off ``model`` (any device, the meta device included): the blocks of
    the stack ``blocks``, in order, the tp dim of each parameter from the layer plan ``found``
    (``plait.planner.tp_block.plan_of``; None: no plan, every tensor whole)."""
    from plait.parallel.tp_plans import glob_regex

    from .tp_block import split_dim

    patterns = [(glob_regex(g), style) for g, style in found[0].styles.items()] if found else []
    embeds = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
              for p in m.parameters()}
    index = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
    stacked: list[list[Rows]] = [[] for _ in blocks]
    parts: list[list[Rows]] = [[], []]
    for name, p in model.named_parameters():  # a tied weight once
        owner, _, kind = name.rpartition(".")
        style = next((st for regex, st in patterns if regex.match(owner)), None)
        row = Rows(tuple(p.shape), split_dim(model.get_submodule(owner), kind, style),
                   p.requires_grad)
        if id(p) in index:
            stacked[index[id(p)]].append(row)
        else:
            parts[0 if id(p) in embeds else 1].append(row)
    return ParamRows(stack=tuple(tuple(b) for b in stacked), embed=tuple(parts[0]),
                     rest=tuple(parts[1]))
