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
from functools import cached_property
from typing import TYPE_CHECKING, Any

from plait.comm.volumes import fsdp_padded_numel

if TYPE_CHECKING:
    import torch.nn as nn


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
    # Whether the first block's input needs a gradient, as a forward pass showed it
    # (``plait.planner.tp_block.grad_flow``: a trainable gain on a frozen embedding's output);
    # None: where an embedding trains, or there is none.
    stack_input_grad: bool | None = None

    @property
    def block(self) -> tuple[Rows, ...]:
        """The tensors of all blocks (a block's padding is their mean, as its parameters
        are)."""
        return tuple(r for block in self.stack for r in block)

    @property
    def blocks(self) -> int:
        return len(self.stack)

    @cached_property
    def trains(self) -> tuple[bool, ...]:
        """Per block, whether a parameter of it trains (kept: the planner asks per plan)."""
        return tuple(any(r.trained for r in block) for block in self.stack)

    @cached_property
    def reached(self) -> tuple[bool, ...]:
        """Per block, whether the backward pass reaches it (:func:`plait.comm.reach.reached`):
        the first block's input needs a gradient where an embedding trains (or there is
        none)."""
        from plait.comm.reach import reached

        flowing = self.stack_input_grad
        if flowing is None:
            flowing = any(r.trained for r in self.embed) or not self.embed
        return reached(flowing, self.trains)

    @cached_property
    def regathered(self) -> tuple[bool, ...]:
        """Per block, whether ZeRO-3 gathers it again for backward
        (:func:`plait.comm.reach.regathered`)."""
        from plait.comm.reach import regathered

        return regathered(self.reached)

    @cached_property
    def counts(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Running counts over the stack of the blocks that train, that the backward pass
        reaches and that ZeRO-3 gathers again: entry i counts blocks 0..i-1, so a pipeline
        rank's blocks j..k-1 are ``c[k] - c[j]`` (the planner asks per rank of every plan)."""
        def running(flags: tuple[bool, ...]) -> tuple[int, ...]:
            out = [0]
            for f in flags:
                out.append(out[-1] + f)
            return tuple(out)

        return running(self.trains), running(self.reached), running(self.regathered)

    @cached_property
    def one_block(self) -> bool:
        """Whether every block is the same tuple of tensors (a config's)."""
        return all(b is self.stack[0] for b in self.stack)


def _sum(rows: tuple[Rows, ...], tp: int, shards: int, per: int = 1) -> Padding:
    pads = [(r.padding(tp, shards), r.trained) for r in rows]
    return Padding(all=sum(p for p, _ in pads) / per,
                   trained=sum(p for p, trained in pads if trained) / per)


def padding(rows: ParamRows, tp: int, shards: int) -> tuple[Padding, Padding, Padding]:
    """Elements beyond an even split (:meth:`Rows.padding`) at ``tp`` and ``shards`` (FSDP2's
    dp_shard; 1: not sharded) of one block (their mean), of the embeddings and of the rest.
    A block the stack holds several times (a config's: one tuple repeated) is summed once."""
    if rows.stack and rows.one_block:  # the planner asks per plan: one block's sum will do
        return (_sum(rows.stack[0], tp, shards), _sum(rows.embed, tp, shards),
                _sum(rows.rest, tp, shards))
    per_block: dict[int, Padding] = {}
    total = Padding()
    for block in rows.stack:
        if id(block) not in per_block:
            per_block[id(block)] = _sum(block, tp, shards)
        got = per_block[id(block)]
        total = Padding(total.all + got.all, total.trained + got.trained)
    n = max(rows.blocks, 1)
    return (Padding(total.all / n, total.trained / n), _sum(rows.embed, tp, shards),
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


def config_rows(*, layers: int, hidden: int, q: int, kv: int, ffn: int, gated: bool,
                vocab: int, tied: bool, bias: bool = False, qkv_bias: bool = False,
                norm_tensors: int = 1) -> ParamRows:
    """The ``ParamRows`` a decoder built from a config holds, as :func:`param_rows` reads them
    off the built model: per block separate q, k, v and o projections and a gated (gate, up,
    down) or plain (up, down) MLP, ``nn.Linear`` weights stored (out, in), split by tensor
    parallelism as plait's layer plans for these blocks split them (q, k, v, gate, up by
    output rows, o and down by input columns, a column-parallel bias with its rows; norms
    whole), every linear with a bias where ``bias``, q, k and v alone where ``qkv_bias``, and
    two norms of ``norm_tensors`` vectors each (RMSNorm: the weight; LayerNorm: weight and
    bias); a token embedding (``vocab`` rows, split by rows), a final norm and a head of
    ``vocab`` rows split by rows (none of its own where ``tied``)."""
    def linear(d_out: int, d_in: int, split: int, with_bias: bool) -> tuple[Rows, ...]:
        weight = Rows((d_out, d_in), split)
        return (weight, Rows((d_out,), 0 if split == 0 else None)) if with_bias else (weight,)

    norms = tuple(Rows((hidden,)) for _ in range(norm_tensors))
    block = (*linear(q, hidden, 0, bias or qkv_bias), *linear(kv, hidden, 0, bias or qkv_bias),
             *linear(kv, hidden, 0, bias or qkv_bias), *linear(hidden, q, 1, bias),
             *(linear(ffn, hidden, 0, bias) if gated else ()), *linear(ffn, hidden, 0, bias),
             *linear(hidden, ffn, 1, bias), *norms, *norms)
    head = () if tied else (Rows((vocab, hidden), 0),)
    return ParamRows(stack=(block,) * layers, embed=(Rows((vocab, hidden), 0),),
                     rest=(*norms, *head))


def param_rows(model: nn.Module, blocks: list[nn.Module], found: tuple[Any, bool] | None
               ) -> ParamRows:
    """Read ``ParamRows`` off ``model`` (any device, the meta device included): the blocks of
    the stack ``blocks``, in order, the tp dim of each parameter from the layer plan ``found``
    (``plait.planner.tp_block.plan_of``; None: no plan, every tensor whole)."""
    import torch.nn as nn

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
