"""Pipeline stages: how blocks are split over chunks, each rank's time per microbatch, and the
step of a schedule with its bubble.

With per-rank time t_r per microbatch a schedule of m microbatches takes
``m*max(t) + (sum(t) - max(t)) * k`` where k is the schedule's bubble scale: 1 (GPipe, 1F1B),
1/v (interleaved, looped BFS), 1/(3v) (zero-bubble H1 and V: the weight-gradient pass fills
the bubble; ZB paper, T_F = T_B = T_W). With v=1 this is the textbook
``sum(t) + (m-1) max(t)``. Where processes outnumber cores (CPU), the schedule is simulated
instead (:mod:`plait.planner.cpu.sharing`): a stage idle in its bubble hands its core over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.comm.volumes import Traffic
from plait.partition import balanced_partition
from plait.plan import Plan

from .compute import MicroTimes
from .cpu.sharing import shared_pipeline_time
from .hardware import Cluster
from .model_stats import ModelStats
from .traffic import act_dtype_bytes, collective_time, uses_fsdp

if TYPE_CHECKING:
    from .cost import Constants, Workload


def bubble_scale(plan: Plan) -> float:
    if plan.pp_schedule in ("gpipe", "1f1b"):
        return 1.0
    if plan.pp_schedule in ("interleaved_1f1b", "looped_bfs"):
        return 1.0 / plan.virtual_stages
    return 1.0 / (3 * plan.virtual_stages)  # interleaved_zb, zbv


def inflight(plan: Plan, rank: int, m: int) -> float:
    """Microbatches of this rank's whole share of layers held at the memory peak: GPipe m;
    1F1B/ZB-V pp - r on rank r; interleaved, Megatron's warm-up count
    ``2(pp - r - 1) + (v - 1) pp + 1`` chunks."""
    pp, v = plan.pp, plan.virtual_stages
    if pp == 1:
        return 1.0
    if plan.pp_schedule == "gpipe":
        return float(m)
    if plan.pp_schedule in ("1f1b", "zbv"):
        return float(min(m, pp - rank))
    chunks = min(m * v, 2 * (pp - rank - 1) + (v - 1) * pp + 1)
    return chunks / v


def stage_sizes(plan: Plan, model: ModelStats, times: MicroTimes, balance: bool
                ) -> list[int] | str:
    """Blocks per model chunk: ``plan.options.pp_stage_layers`` when given, the split
    balancing time when ``balance`` (the heavy first/last chunks get fewer blocks), else the
    pipeline runtime's own default (:func:`plait.parallel.pipeline_split.plan_stages`): the
    split balancing parameters, the embedding on the first chunk and the head on the last. A
    string is the reason the given split is invalid."""
    chunks, L = plan.pp * plan.virtual_stages, model.n_layers
    if plan.options.pp_stage_layers is not None:
        given = list(plan.options.pp_stage_layers)
        if len(given) != chunks or sum(given) != L or min(given) < 1:
            return (f"options.pp_stage_layers={given} must list {chunks} positive block "
                    f"counts summing to {L}")
        return given
    weights = model.layer_weights or (1.0,) * L
    if balance and chunks > 1:
        # Relative costs, rounded, so layouts that differ only in batch or tp share one DP run.
        unit = times.block or 1.0
        rel = [round(w * times.block / unit, 3) for w in weights]
        rel[0] = round(rel[0] + times.embed / unit, 3)
        rel[-1] = round(rel[-1] + times.head / unit, 3)
        return balanced_partition(rel, chunks)
    if chunks == 1:
        return [L]
    params = [w * model.block_params for w in weights] if model.layer_weights else \
        [float(model.block_params)] * L
    return balanced_partition(params, chunks, first_extra=model.embed_params,
                              last_extra=model.head_params)


@dataclass
class Stages:
    """Each chunk's and each pipeline rank's time for one microbatch."""

    sizes: list[int]               # blocks per chunk
    chunk_time: list[float]        # per chunk, embedding / head / zero-bubble calls included
    rank_chunks: list[Sequence[int]]  # chunks each pipeline rank runs (chunk_placement)
    rank_time: list[float]         # per rank: its chunks, their sends, FSDP2 per-unit costs
    rank_layers: list[int]
    p2p: float                     # one chunk boundary's send forward + send backward

    @property
    def busiest(self) -> int:
        return self.rank_time.index(max(self.rank_time))


def chunk_placement(plan: Plan, chunks: int) -> list[Sequence[int]]:
    """The chunks (global stages) each pipeline rank runs, as the runtime places them
    (:func:`plait.parallel.schedules.stage_to_rank`): round-robin, or V-shaped under ZB-V,
    whose rank 0 holds the first and the last stage (the embedding and the head)."""
    from plait.parallel.schedules import stage_to_rank

    pp = plan.pp
    if chunks != pp * plan.virtual_stages:
        return [range(r, chunks, pp) for r in range(pp)]
    placed: list[list[int]] = [[] for _ in range(pp)]
    for stage, rank in enumerate(stage_to_rank(plan.pp_schedule, pp, plan.virtual_stages)):
        placed[rank].append(stage)
    return [tuple(p) for p in placed]


def stage_times(plan: Plan, model: ModelStats, cluster: Cluster, work: Workload, b: int,
                times: MicroTimes, sizes: list[int], c: Constants) -> Stages:
    pp, tp = plan.pp, plan.tp
    chunks = len(sizes)
    weights = model.layer_weights or (1.0,) * model.n_layers
    costs = [w * times.block for w in weights]
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    chunk_time = [sum(costs[bounds[i]:bounds[i + 1]]) for i in range(chunks)]
    chunk_time[0] += times.embed
    chunk_time[-1] += times.head
    if times.zero_bubble:
        chunk_time = [t + c.zb_call_s for t in chunk_time]
    # pipeline p2p per chunk boundary per microbatch (send forward + send backward)
    p2p = 0.0
    if pp > 1:
        # Megatron's scatter/gather trick (or SP) sends the tp-shard; plain torch sends it all.
        split = tp if (plan.sp or work.pp_scatter_gather) else 1
        ab = act_dtype_bytes(plan.mixed_precision)
        # each rank sends its cp slice of every sequence
        msg = Traffic("pp", "send_recv", b * (work.seq // plan.cp) * model.hidden * ab / split,
                      1, 2)
        p2p = 2 * collective_time(msg, cluster, tp * plan.dp_shard * plan.dp_replicate, c)
    rank_chunks = chunk_placement(plan, chunks)
    rank_time = [sum(chunk_time[i] for i in ids) + p2p * len(ids) for ids in rank_chunks]
    rank_layers = [sum(sizes[i] for i in ids) for ids in rank_chunks]
    # The per-unit cost is FSDP2's copy-in/out of sharded parameters and gradients; replicated
    # DP over TP (shard groups of one rank) has nothing to gather or scatter and, timed on CPU,
    # costs nothing measurable beyond its all-reduces, so the term is charged with sharding only.
    if uses_fsdp(plan) and plan.dp_shard > 1 and c.fsdp_unit_s:
        rank_time = [t + c.fsdp_unit_s * (n + 1)
                     for t, n in zip(rank_time, rank_layers, strict=True)]
    return Stages(sizes, chunk_time, rank_chunks, rank_time, rank_layers, p2p)


def pipeline_time(plan: Plan, cluster: Cluster, st: Stages, times: MicroTimes,
                  c: Constants) -> tuple[float, float]:
    """(seconds of the schedules of one optimizer step, bubble fraction)."""
    pp, m = plan.pp, (plan.microbatches if plan.pp > 1 else 1)
    t_max, t_sum = max(st.rank_time), sum(st.rank_time)
    if pp == 1:
        return st.rank_time[0] * plan.grad_accum, 0.0
    pipe = m * t_max + (t_sum - t_max) * bubble_scale(plan)
    if times.share < 1.0:
        pipe = _shared_cores_time(plan, cluster, st, times, c)
    bubble = max(0.0, (pipe - m * t_max) / pipe)
    return pipe * plan.grad_accum, bubble


def _shared_cores_time(plan: Plan, cluster: Cluster, st: Stages, times: MicroTimes,
                       c: Constants) -> float:
    """More processes than cores (CPU): a stage idle in the bubble hands its core to the busy
    ones (plait.planner.cpu.sharing simulates the schedule chunk by chunk, in the order each
    rank runs it, with shared cores). Each chunk's time on a whole core, its sends included;
    FSDP2's per-unit cost spread over the rank's chunks."""
    pp, m = plan.pp, plan.microbatches
    on_node = min(cluster.world_size, cluster.devices_per_node)
    split = (2 + times.replay) / (3 + times.replay)    # backward's share of a microbatch
    full = [t + st.p2p for t in st.chunk_time]
    if uses_fsdp(plan) and plan.dp_shard > 1 and c.fsdp_unit_s:
        for ids in st.rank_chunks:
            for i in ids:
                full[i] += c.fsdp_unit_s * (st.sizes[i] + 1 / len(ids))
    full = [t * times.share for t in full]
    schedule = {"gpipe": "gpipe", "1f1b": "1f1b", "looped_bfs": "looped_bfs"}.get(
        plan.pp_schedule, "interleaved")
    if plan.pp_schedule == "zbv":
        # ZB-V's V-shaped placement and its split backward are not simulated: priced as 1F1B
        # over each rank's whole share (what it saves is bubble, which sharing fills anyway).
        full = [sum(full[i] for i in ids) for ids in st.rank_chunks]
        schedule = "1f1b"
    per_stage = max(1.0, on_node / pp)
    cores = (cluster.compute_units or on_node) * (pp / on_node if pp > on_node else 1.0)
    return shared_pipeline_time([t * (1 - split) for t in full], [t * split for t in full],
                                m, replicas=per_stage, cores=cores, schedule=schedule, ranks=pp)
