"""What a search prices many times over, kept for the search's length.

Thousands of layouts share each pipeline rank's share of the model: it depends on the
degrees that split the model (tp, pp, and FSDP2's sharding) and the stage split, not on the
microbatch size, the schedule, checkpointing or sequence parallelism, which the search varies
most. A :class:`Memo` keeps what :func:`plait.planner.traffic.rank_shares` and
:func:`plait.planner.traffic.uneven_pieces` found, keyed on exactly the plan fields they
read. One memo serves one model: :func:`plait.planner.search.search` creates its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from plait.comm.predict import LocalModel, clip_axes
from plait.plan import Plan

from .fsdp_rows import Padding
from .model_stats import ModelStats
from .traffic import fsdp_shards, rank_shares, uneven_pieces

Pieces = tuple[Padding, Padding, Padding, Padding] | None


class ShareKey(NamedTuple):
    """What :func:`~plait.planner.traffic.rank_shares` reads of a plan, and the stage split:
    tp, pp, the ranks FSDP2 shards over (:func:`~plait.planner.traffic.fsdp_shards`, which
    is all it reads of dp_shard, cp and zero besides the clip norm's axes) and the axes the
    clip norm is all-reduced over (:func:`plait.comm.predict.clip_axes`)."""

    tp: int
    pp: int
    shards: int
    clip_axes: tuple[str, ...]
    sizes: tuple[int, ...]
    rank_chunks: tuple[tuple[int, ...], ...]


class PiecesKey(NamedTuple):
    """What :func:`~plait.planner.traffic.uneven_pieces` reads of a plan."""

    tp: int
    shards: int


@dataclass
class Memo:
    """Each rank's share of one model and its uneven pieces, by the plan fields they read."""

    shares: dict[ShareKey, list[LocalModel]] = field(default_factory=dict)
    pieces: dict[PiecesKey, Pieces] = field(default_factory=dict)

    def rank_shares(self, plan: Plan, model: ModelStats, sizes: Sequence[int],
                    rank_chunks: Sequence[Sequence[int]]) -> list[LocalModel]:
        """:func:`~plait.planner.traffic.rank_shares` (a new list of the same, frozen,
        shares)."""
        key = ShareKey(plan.tp, plan.pp, fsdp_shards(plan), clip_axes(plan), tuple(sizes),
                       tuple(tuple(ids) for ids in rank_chunks))
        if key not in self.shares:
            self.shares[key] = rank_shares(plan, model, list(sizes), rank_chunks)
        return list(self.shares[key])

    def uneven_pieces(self, plan: Plan, model: ModelStats) -> Pieces:
        """:func:`~plait.planner.traffic.uneven_pieces`."""
        key = PiecesKey(plan.tp, fsdp_shards(plan))
        if key not in self.pieces:
            self.pieces[key] = uneven_pieces(plan, model)
        return self.pieces[key]
