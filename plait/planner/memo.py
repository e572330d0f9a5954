"""What a search prices many times over, kept for the search's length.

The layouts of one search share parts of their price, each keyed on exactly the plan fields
it reads (a NamedTuple per part, below):

* each pipeline rank's share of the model (:func:`plait.planner.traffic.rank_shares`) and
  its uneven pieces (:func:`plait.planner.traffic.uneven_pieces`): they depend on tp, pp,
  FSDP2's sharding and the stage split, not on the microbatch size, the schedule,
  checkpointing or sequence parallelism, which the search varies most;
* each rank's data-parallel collectives (:func:`plait.planner.traffic.dp_traffic`), the
  seconds its gradient reduction takes, and its clipping collectives: alike for the
  checkpointing modes and sequence parallelism of one layout;
* one microbatch's times (:func:`plait.planner.compute.microbatch_times`): alike over the
  data-parallel and pipeline degrees; and the pipeline's split that balances them
  (:func:`plait.planner.pipeline.stage_sizes`);
* each pipeline rank's time per microbatch (:func:`plait.planner.pipeline.stage_times`):
  alike over the ZeRO stages and the split of the data-parallel ranks;
* the busiest rank's activation collectives (:func:`plait.planner.cost.activation_traffic`):
  alike over data parallelism's layouts where FSDP2 does not change the dtype; kept apart
  (:class:`Activations`), as an estimate prices its traffic where first read, after the
  search (:attr:`plait.planner.cost.Estimate.traffic`), and keeps this part alone.

Each rank's share is made where it is first read (:class:`Shares`: a layout that does not
fit reads three of a pipeline's), and a rank given the same blocks by another stage split
gets the same share (:class:`RankKey`). Keys name a share by its id, the share kept alive
by the memo (:attr:`Memo.held`): cheaper to hash than its fields.

One memo serves one search (one model, cluster, workload and constants):
:func:`plait.planner.search.search` creates its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, overload

from plait.comm.predict import LocalModel, casts_params, clip_axes
from plait.comm.volumes import Traffic
from plait.plan import ZERO_BUBBLE_SCHEDULES, Plan

from .compute import MicroTimes, microbatch_times
from .fsdp_rows import Padding, Trained
from .hardware import Cluster
from .model_stats import ModelStats
from .pipeline import Stages, stage_sizes, stage_times
from .traffic import (
    StageSplit,
    clip_traffic,
    collective_time,
    dp_traffic,
    fsdp_host_time,
    fsdp_shards,
    rank_share,
    uneven_pieces,
    uses_fsdp,
)

if TYPE_CHECKING:
    from .cost import Constants, Workload

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


class TrafficKey(NamedTuple):
    """What :func:`plait.comm.predict.dp_traffic` reads of a plan (its degrees, ZeRO stage,
    schedule, micro-steps, compute dtype, DDP's ``find_unused``; the mesh strides read only
    the degrees), the rank's share and the two options: everything but checkpointing, sequence
    parallelism and clipping, which a search varies within one layout."""

    tp: int
    pp: int
    cp: int
    dp_replicate: int
    dp_shard: int
    zero: int
    find_unused: bool
    grad_accum: int
    microbatches: int
    pp_schedule: str
    virtual_stages: int
    mixed_precision: str
    share: int | None  # the share's Memo.held id; None: every rank's (Memo.grad_sync_times)
    grad_dtype: str
    bucket_bytes: float


class ClipKey(NamedTuple):
    """What :func:`plait.comm.predict.clip_traffic` reads of a plan (clipping, and the
    degrees that name and size the axes the norms are reduced over) and the rank's share."""

    grad_clip: float | None
    tp: int
    pp: int
    cp: int
    dp_replicate: int
    dp_shard: int
    share: int  # Memo.held id


class TimesKey(NamedTuple):
    """What :func:`plait.planner.compute.microbatch_times` reads of a plan for a model with
    one stack of blocks, and the microbatch size: tp, cp, sequence parallelism, the dtype,
    checkpointing, whether a pipeline runs a zero-bubble schedule, whether the embedding and
    the head sit on different chunks, and whether FSDP2 casts the parameters
    (:func:`plait.comm.predict.casts_params`)."""

    tp: int
    cp: int
    sp: bool
    mixed_precision: str
    activation_checkpointing: str
    checkpoint_every: int
    zero_bubble: bool
    split: bool
    casts_params: bool
    b: int


class SizesKey(NamedTuple):
    """What :func:`plait.planner.pipeline.stage_sizes` reads: the chunks, a split the plan
    gives, whether to balance, and the times it balances (a block's, the embedding's, the
    head's)."""

    chunks: int
    given: tuple[int, ...] | None
    balance: bool
    block: float
    embed: float
    head: float


class StagesKey(NamedTuple):
    """What :func:`plait.planner.pipeline.stage_times` reads of a plan, and the microbatch's
    times and the stage split: the pipeline's degree, schedule and stages per rank; its sends'
    size and route (tp, sequence parallelism, cp, the dtype, the microbatch size, the ranks
    between two stages); whether FSDP2's per-unit cost applies (``units``)."""

    pp: int
    virtual_stages: int
    pp_schedule: str
    tp: int
    sp: bool
    cp: int
    mixed_precision: str
    stride: int
    units: bool
    b: int
    times: MicroTimes
    sizes: tuple[int, ...]


class ActivationsKey(NamedTuple):
    """What :func:`plait.planner.cost.activation_traffic` reads of a plan (its degrees but
    data parallelism's, sequence parallelism, the dtype and whether FSDP2 casts the
    parameters, the pipeline's schedule and micro-steps), of the rank's share (its blocks,
    those replayed and those that train or that the backward pass reaches, each block's own
    collectives, its stages, the embedding, the head and a tied weight's piece), and the
    microbatch size."""

    tp: int
    cp: int
    pp: int
    sp: bool
    mixed_precision: str
    casts_params: bool
    grad_accum: int
    microbatches: int
    pp_schedule: str
    virtual_stages: int
    b: int
    layers: int
    recomputed: int
    trained_layers: int | None
    reached_layers: int | None
    tp_blocks: tuple[object, ...] | None
    embed: bool
    head: bool
    stages: tuple[int, ...]
    num_stages: int
    tied: float
    tied_tensors: int


class PiecesKey(NamedTuple):
    """What :func:`~plait.planner.traffic.uneven_pieces` reads of a plan."""

    tp: int
    shards: int


class RankKey(NamedTuple):
    """What :func:`~plait.planner.traffic.rank_share` reads: the :class:`ShareKey`'s plan
    fields, the number of chunks, the rank's chunks and where each starts and ends (stage
    splits that differ elsewhere give a rank the same share)."""

    tp: int
    pp: int
    shards: int
    clip_axes: tuple[str, ...]
    chunks: int
    ids: tuple[int, ...]
    bounds: tuple[tuple[int, int], ...]


class Shares(Sequence[LocalModel]):
    """Every pipeline rank's share of one plan (:func:`~plait.planner.traffic.rank_shares`,
    index: pp rank), each made on first use, or taken from ``made`` (the search's, by
    :class:`RankKey`) and kept."""

    def __init__(self, plan: Plan, model: ModelStats, split: StageSplit, key: ShareKey,
                 trained: dict[int, Trained], made: dict[RankKey, LocalModel]) -> None:
        self._plan, self._model, self._split, self._key = plan, model, split, key
        self._made: list[LocalModel | None] = [None] * len(key.rank_chunks)
        self._trained = trained  # trained_share's, across the ranks
        self._all = made

    def __len__(self) -> int:
        return len(self._made)

    @overload
    def __getitem__(self, r: int) -> LocalModel: ...

    @overload
    def __getitem__(self, r: slice) -> list[LocalModel]: ...

    def __getitem__(self, r: int | slice) -> LocalModel | list[LocalModel]:
        if isinstance(r, slice):
            return [self[i] for i in range(len(self))[r]]
        got = self._made[r]
        if got is None:
            k, bounds = self._key, self._split.bounds
            ids = k.rank_chunks[r]
            key = RankKey(k.tp, k.pp, k.shards, k.clip_axes, len(k.sizes), ids,
                          tuple((bounds[i], bounds[i + 1]) for i in ids))
            if key not in self._all:
                self._all[key] = rank_share(self._plan, self._model, self._split, ids,
                                            self._trained)
            got = self._made[r] = self._all[key]
        return got


@dataclass
class Activations:
    """The activations' collectives of a pipeline rank, by what they read
    (:class:`ActivationsKey`)."""

    kept: dict[ActivationsKey, list[Traffic]] = field(default_factory=dict)

    def traffic(self, plan: Plan, share: LocalModel, b: int,
                price: Callable[[], list[Traffic]]) -> list[Traffic]:
        """The activations' collectives of a rank holding ``share`` at microbatch size ``b``
        (``price()``: :func:`plait.planner.cost.activation_traffic` of the same; a new list
        of the same collectives): alike over data parallelism's layouts but where FSDP2's
        cast changes the dtype."""
        key = ActivationsKey(plan.tp, plan.cp, plan.pp, plan.sp, plan.mixed_precision,
                             casts_params(plan), plan.grad_accum, plan.microbatches,
                             plan.pp_schedule, plan.virtual_stages, b, share.layers,
                             share.recomputed, share.trained_layers, share.reached_layers,
                             share.tp_blocks, share.embed, share.head, share.stages,
                             share.num_stages, share.tied, share.tied_tensors)
        if key not in self.kept:
            self.kept[key] = price()
        return list(self.kept[key])


@dataclass
class Memo:
    """Each rank's share of one model and its uneven pieces, by the plan fields they read."""

    shares: dict[ShareKey, Shares] = field(default_factory=dict)
    pieces: dict[PiecesKey, Pieces] = field(default_factory=dict)
    traffic: dict[TrafficKey, list[tuple[Traffic, int]]] = field(default_factory=dict)
    syncs: dict[TrafficKey, float] = field(default_factory=dict)
    clips: dict[ClipKey, list[tuple[Traffic, int]]] = field(default_factory=dict)
    times: dict[TimesKey, MicroTimes] = field(default_factory=dict)
    sizes: dict[SizesKey, list[int] | str] = field(default_factory=dict)
    rank_syncs: dict[tuple[TrafficKey, ShareKey], list[float]] = field(default_factory=dict)
    stages: dict[StagesKey, Stages] = field(default_factory=dict)
    activations: Activations = field(default_factory=Activations)
    # every share a key names, by id: kept alive, so an id names one share for the memo's life
    # (a key holds the id, cheaper to hash than the share's fields)
    held: dict[int, LocalModel] = field(default_factory=dict)
    # what each part of the model's rows reduces (trained_share's memo), by tp and shards
    trained: dict[tuple[int, int], dict[int, Trained]] = field(default_factory=dict)
    rank_made: dict[RankKey, LocalModel] = field(default_factory=dict)

    def _id(self, share: LocalModel) -> int:
        """``share``'s id, the share kept (:attr:`held`)."""
        self.held.setdefault(id(share), share)
        return id(share)

    def grad_sync_times(self, plan: Plan, model: ModelStats, sizes: Sequence[int],
                        rank_chunks: Sequence[Sequence[int]], cluster: Cluster, c: Constants,
                        *, grad_dtype: str) -> list[float]:
        """:meth:`grad_sync_time` of every pipeline rank (index: pp rank), kept by the
        plan's fields and the stage split (cheaper to look up than each rank's share)."""
        shares_key = _share_key(plan, sizes, rank_chunks)
        # the gradient collectives and FSDP2's reduces do not read the microbatch count (only
        # the parameter gathers do): layouts that differ in it alone share one entry
        key = (_traffic_key(plan, None, grad_dtype, c.bucket_bytes)._replace(microbatches=0),
               shares_key)
        if key not in self.rank_syncs:
            self.rank_syncs[key] = [
                self.grad_sync_time(plan, share, cluster, c, grad_dtype=grad_dtype)
                for share in self.rank_shares(plan, model, sizes, rank_chunks)]
        return self.rank_syncs[key]

    def stage_times(self, plan: Plan, model: ModelStats, cluster: Cluster, work: Workload,
                    b: int, times: MicroTimes, sizes: Sequence[int], c: Constants) -> Stages:
        """:func:`~plait.planner.pipeline.stage_times` (the same ``Stages``, read only):
        alike over the ZeRO stages and the split of the data-parallel ranks, whose product
        alone sets the stride between two stages."""
        key = StagesKey(plan.pp, plan.virtual_stages, plan.pp_schedule, plan.tp,
                        plan.sp or work.pp_scatter_gather, plan.cp, plan.mixed_precision,
                        plan.tp * plan.dp_shard * plan.dp_replicate,
                        uses_fsdp(plan) and plan.dp_shard > 1 and bool(c.fsdp_unit_s), b,
                        times, tuple(sizes))
        if key not in self.stages:
            self.stages[key] = stage_times(plan, model, cluster, work, b, times, list(sizes), c)
        return self.stages[key]

    def stage_sizes(self, plan: Plan, model: ModelStats, times: MicroTimes, balance: bool
                    ) -> list[int] | str:
        """:func:`~plait.planner.pipeline.stage_sizes` (a new list of the same)."""
        key = SizesKey(plan.pp * plan.virtual_stages, plan.options.pp_stage_layers, balance,
                       times.block, times.embed, times.head)
        if key not in self.sizes:
            self.sizes[key] = stage_sizes(plan, model, times, balance)
        got = self.sizes[key]
        return got if isinstance(got, str) else list(got)

    def microbatch_times(self, plan: Plan, model: ModelStats, cluster: Cluster, b: int,
                         s: int, c: Constants, stack_seqs: Mapping[str, int]) -> MicroTimes:
        """:func:`~plait.planner.compute.microbatch_times`, kept for a model with one stack
        of blocks (a further stack's time reads more of the plan: priced afresh)."""
        if model.more_stacks:
            return microbatch_times(plan, model, cluster, b, s, c, stack_seqs)
        key = TimesKey(plan.tp, plan.cp, plan.sp, plan.mixed_precision,
                       plan.activation_checkpointing, plan.checkpoint_every,
                       plan.pp > 1 and plan.pp_schedule in ZERO_BUBBLE_SCHEDULES,
                       plan.pp * plan.virtual_stages > 1, casts_params(plan), b)
        if key not in self.times:
            self.times[key] = microbatch_times(plan, model, cluster, b, s, c, stack_seqs)
        return self.times[key]

    def rank_shares(self, plan: Plan, model: ModelStats, sizes: Sequence[int],
                    rank_chunks: Sequence[Sequence[int]]) -> Shares:
        """:func:`~plait.planner.traffic.rank_shares`, each rank's (frozen) share made where
        it is first read: a layout that does not fit reads three ranks' of a pipeline."""
        key = _share_key(plan, sizes, rank_chunks)
        if key not in self.shares:
            split = StageSplit.of(plan, model, sizes, self.uneven_pieces(plan, model))
            self.shares[key] = Shares(plan, model, split, key,
                                      self.trained.setdefault((key.tp, key.shards), {}),
                                      self.rank_made)
        return self.shares[key]

    def dp_traffic(self, plan: Plan, share: LocalModel, *, grad_dtype: str,
                   bucket_bytes: float) -> list[tuple[Traffic, int]]:
        """:func:`~plait.planner.traffic.dp_traffic` (a new list of the same, frozen,
        collectives)."""
        key = _traffic_key(plan, self._id(share), grad_dtype, bucket_bytes)
        if key not in self.traffic:
            self.traffic[key] = dp_traffic(plan, share, grad_dtype=grad_dtype,
                                           bucket_bytes=bucket_bytes)
        return list(self.traffic[key])

    def grad_sync_time(self, plan: Plan, share: LocalModel, cluster: Cluster, c: Constants, *,
                       grad_dtype: str) -> float:
        """Seconds a rank holding ``share`` spends reducing its gradients: its data-parallel
        gradient collectives and FSDP2's per-unit reduce cost
        (:func:`~plait.planner.traffic.fsdp_host_time`, which reads no more of the plan);
        neither reads the microbatch count (only the parameter gathers do)."""
        key = _traffic_key(plan, self._id(share), grad_dtype, c.bucket_bytes)._replace(
            microbatches=0)
        if key not in self.syncs:
            traffic = dp_traffic(plan, share, grad_dtype=grad_dtype,
                                 bucket_bytes=c.bucket_bytes, gathers=False)
            self.syncs[key] = sum(collective_time(t, cluster, stride, c)
                                  for t, stride in traffic if t.what == "grads") + \
                fsdp_host_time(plan, share, c)[0]
        return self.syncs[key]

    def clip_traffic(self, plan: Plan, share: LocalModel) -> list[tuple[Traffic, int]]:
        """:func:`~plait.planner.traffic.clip_traffic` (a new list of the same collectives)."""
        key = ClipKey(plan.grad_clip, plan.tp, plan.pp, plan.cp, plan.dp_replicate,
                      plan.dp_shard, self._id(share))
        if key not in self.clips:
            self.clips[key] = clip_traffic(plan, share)
        return list(self.clips[key])

    def uneven_pieces(self, plan: Plan, model: ModelStats) -> Pieces:
        """:func:`~plait.planner.traffic.uneven_pieces`."""
        key = PiecesKey(plan.tp, fsdp_shards(plan))
        if key not in self.pieces:
            self.pieces[key] = uneven_pieces(plan, model)
        return self.pieces[key]


def _share_key(plan: Plan, sizes: Sequence[int], rank_chunks: Sequence[Sequence[int]]
               ) -> ShareKey:
    return ShareKey(plan.tp, plan.pp, fsdp_shards(plan), clip_axes(plan), tuple(sizes),
                    tuple(tuple(ids) for ids in rank_chunks))


def _traffic_key(plan: Plan, share: int | None, grad_dtype: str, bucket_bytes: float
                 ) -> TrafficKey:
    # Without FSDP2's sharding (ZeRO-0/1) there are no parameter gathers, the one reader of
    # the microbatch count; and without a pipeline the gradients are reduced once a step,
    # whatever the micro-steps: layouts that differ in those alone share one entry.
    fsdp = plan.zero >= 2
    return TrafficKey(plan.tp, plan.pp, plan.cp, plan.dp_replicate, plan.dp_shard, plan.zero,
                      plan.find_unused, plan.grad_accum if fsdp or plan.pp > 1 else 0,
                      plan.microbatches if fsdp else 0, plan.pp_schedule,
                      plan.virtual_stages, plan.mixed_precision, share, grad_dtype,
                      bucket_bytes)
