"""The cost model: step time, memory per device and bytes per mesh axis for one Plan.

Every figure is closed-form, so the search can evaluate tens of thousands of layouts a second.
:func:`evaluate` composes four parts, each a module of its own:

* :mod:`.compute`: one microbatch through a block, the embedding and the head (FLOPs at
  peak x ``compute_efficiency``; TP collectives on the critical path);
* :mod:`.pipeline`: blocks per chunk, each rank's time, the schedule and its bubble;
* :mod:`.traffic`: the collectives of data parallelism and clipping, and their times on the
  cluster's links;
* :mod:`.memory`: model state by ZeRO stage, activations by schedule, logits, buffers.

Overlap: DP/ZeRO gradient traffic overlaps with the backward of the last microbatch; what does
not fit is exposed. A zero-bubble schedule's gradient reduction is exposed in full: at
zero=0/1 its data ranks average once per step after the schedule, under ZeRO-2/3 FSDP2
reduce-scatters after each stage's last weight-gradient pass, which ends the schedule.
ZeRO-3 gathers overlap with each microbatch's compute (prefetch). ZeRO-1/2's parameter
all-gather after the optimizer step is exposed. The optimizer is memory-bound: bytes of owned
AdamW state read and written / HBM bandwidth. What applies only where processes share
CPU cores lives in :mod:`plait.planner.cpu`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from plait.comm import predict
from plait.comm.predict import LocalModel
from plait.comm.volumes import DDP_BUCKET_BYTES, Traffic, by_axis
from plait.plan import ZERO_BUBBLE_SCHEDULES, Plan, reduces_after_schedule

from .compute import microbatch_times
from .cpu.overheads import HostOverheads
from .hardware import Cluster
from .memo import Activations, Memo
from .memory import checkpointed, peak_memory
from .model_stats import ModelStats
from .pipeline import pipeline_time, stage_times
from .traffic import (
    clip_traffic,
    collective_time,
    dp_traffic,
    fsdp_exposed,
    fsdp_host_time,
    rank_shares,
    state_shards,
)


@dataclass(frozen=True)
class Constants(HostOverheads):
    """The model's few fitted constants; one value each, for every model and layout.

    ``compute_efficiency``: achieved fraction of datasheet peak for the dense transformer matmuls
    (and the rest of a block's kernels, folded in). Fitted once, as the value that makes the
    median error over all ten rows of Narayanan et al. 2021 table 1 zero (0.556 -> 0.56),
    with communication and bubbles modelled; see docs/planner.md and
    bench/planner_accuracy.py, which prints the value that zeroes it for the model as it is.
    ``plait plan --calibrate`` measures it for the local machine instead.
    ``link_efficiency``: fraction of link bandwidth NCCL-class collectives reach (busbw/link).
    What ``plait plan --calibrate`` measures on a CPU machine (per block, per tensor, per FSDP2
    unit, gloo's per-op byte factors and per-call costs) is inherited from
    :class:`plait.planner.cpu.overheads.HostOverheads`, its one home: neutral on accelerators.
    """

    compute_efficiency: float = 0.56
    link_efficiency: float = 0.8
    # Whether data-parallel communication can run under compute. False where processes already
    # use every core (CPU + gloo): nothing is left to drive the collective in the background.
    overlap: bool = True
    flash_attention: bool = True
    bucket_bytes: float = DDP_BUCKET_BYTES


DEFAULT_CONSTANTS = Constants()


@dataclass(frozen=True)
class Workload:
    """What is trained: global batch (sequences per optimizer step), sequence length, dtype."""

    global_batch: int
    seq: int
    # Gradient all-reduce/reduce-scatter dtype. plait reduces in fp32 (also under bf16).
    grad_reduce_dtype: str = "fp32"
    # Send only the tp-shard of a stage's output between pipeline stages and all-gather it over
    # the tp group on arrival (Megatron-LM's scatter/gather optimisation; plait's runtime does
    # not, so off by default; with sp the output is already sharded).
    pp_scatter_gather: bool = False
    # A model with several stacks of blocks (``ModelStats.more_stacks``: an encoder-decoder):
    # (first block's path, sequence length) of each stack whose sequence is not ``seq`` (a
    # source of 48 tokens beside a target of 16); ``seq`` is the main stack's.
    stack_seqs: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for path, value in self.stack_seqs:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"stack_seqs: {path}={value!r} must be a positive integer")

    @property
    def seqs(self) -> dict[str, int]:
        """:attr:`stack_seqs` as a dict."""
        return dict(self.stack_seqs)


@dataclass
class Estimate:
    """The prediction for one plan. Times in s, memory in bytes, comm in wire bytes per rank."""

    plan: Plan
    feasible: bool
    reason: str = ""
    step_time_s: float = math.inf
    tokens_per_s: float = 0.0
    tflops_per_device: float = 0.0       # model FLOPs (no recomputation)
    tflops_per_device_hw: float = 0.0    # with recomputation
    mfu: float = 0.0
    memory_bytes_per_device: float = 0.0
    memory_breakdown: dict[str, float] = field(default_factory=dict)
    bubble_fraction: float = 0.0
    time_breakdown: dict[str, float] = field(default_factory=dict)
    microbatch_size: int = 0
    stage_layers: tuple[int, ...] = ()
    # the pipeline rank whose time and traffic the step is priced by (the busiest)
    busiest_rank: int = 0
    # What the prediction assumes that a reader should know (printed under the table).
    notes: list[str] = field(default_factory=list)
    # (fastest, slowest) step time over the chip's compute-efficiency range (plait.planner
    # .uncertainty); None until priced
    step_time_range_s: tuple[float, float] | None = None
    # Where the compute time came from, for a model priced without blocks: "measured on this
    # machine at batch N ..." or "FLOPs at efficiency E ..." (plait.planner.whole_model)
    compute_from: str = ""
    # The busiest rank's collectives (:attr:`traffic`), or what prices them on first read
    # (:meth:`traffic_priced_by`); and their bytes per axis, once summed
    _traffic: list[Traffic] | Callable[[], list[Traffic]] = field(default_factory=list,
                                                                  repr=False, compare=False)
    _comm: dict[str, float] | None = field(default=None, repr=False, compare=False)

    @property
    def traffic(self) -> list[Traffic]:
        """The collectives the busiest pipeline rank issues per step, as the comm ledger
        predicts them (:mod:`plait.comm.predict`); priced here on first read where
        :func:`evaluate` left them to be (no figure of the step reads them, and a search
        prices thousands of layouts to show a few)."""
        if callable(self._traffic):
            self._traffic = self._traffic()
        return self._traffic

    @traffic.setter
    def traffic(self, value: list[Traffic]) -> None:
        self._traffic, self._comm = value, None

    def traffic_priced_by(self, price: Callable[[], list[Traffic]]) -> None:
        """:attr:`traffic` is ``price()``, called on its first read (and only then)."""
        self._traffic, self._comm = price, None

    @property
    def comm_bytes_per_step(self) -> dict[str, float]:
        """Wire bytes per mesh axis of :attr:`traffic` (per step, on the busiest rank)."""
        if self._comm is None:
            self._comm = by_axis(self.traffic)
        return self._comm

    def __eq__(self, other: object) -> bool:
        """Field by field, the traffic included (priced where it was not yet)."""
        if not isinstance(other, Estimate):
            return NotImplemented
        mine, theirs = ([getattr(e, f.name) for f in dataclasses.fields(e) if f.compare]
                        + [e.traffic] for e in (self, other))
        return mine == theirs

    def __getstate__(self) -> dict[str, Any]:
        """What pickles: the traffic priced first (what prices it holds a search's memo)."""
        return dict(vars(self), _traffic=self.traffic)

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_string(), "layout": self.plan.to_dict(),
                "describe": self.plan.describe(), "feasible": self.feasible,
                "reason": self.reason, "step_time_s": self.step_time_s,
                "tokens_per_s": self.tokens_per_s, "tflops_per_device": self.tflops_per_device,
                "tflops_per_device_with_recompute": self.tflops_per_device_hw, "mfu": self.mfu,
                "memory_bytes_per_device": self.memory_bytes_per_device,
                "memory_breakdown": self.memory_breakdown,
                "comm_bytes_per_step": self.comm_bytes_per_step,
                "bubble_fraction": self.bubble_fraction, "time_breakdown": self.time_breakdown,
                "microbatch_size": self.microbatch_size, "stage_layers": list(self.stage_layers),
                "notes": list(self.notes), "compute_from": self.compute_from,
                "traffic": [{"axis": t.axis, "op": t.op, "what": t.what,
                             "payload_bytes": t.payload, "calls": t.calls, "group": t.group}
                            for t in self.traffic],
                "step_time_range_s": list(self.step_time_range_s)
                if self.step_time_range_s else None}


# ------------------------------------------------------------------------------ evaluate
def _invalid(plan: Plan, model: ModelStats, cluster: Cluster, work: Workload) -> str:
    """Why the layout cannot run this workload here ("" when it can)."""
    world, B, s = cluster.world_size, work.global_batch, work.seq
    dp, tp, pp = plan.dp, plan.tp, plan.pp
    m = plan.microbatches if pp > 1 else 1
    if plan.world_size != world:
        return f"plan uses {plan.world_size} devices, cluster has {world}"
    if B % dp:
        return f"global batch {B} not divisible by dp={dp}: use a multiple of {dp}"
    if (B // dp) % (m * plan.grad_accum):
        return (f"batch per dp rank {B // dp} not divisible by microbatches x grad_accum "
                f"= {m * plan.grad_accum}: use a global batch that is a multiple of "
                f"{dp * m * plan.grad_accum}")
    if model.tp_refuses(tp):
        return model.tp_refuses(tp)
    if plan.cp > 1 and s % (2 * plan.cp):
        return (f"context parallelism needs seq={s} divisible by 2 x cp={2 * plan.cp} (each "
                f"rank keeps a head and a tail chunk of every sequence): pad or crop the "
                f"sequence to a multiple of {2 * plan.cp}, or pick another cp")
    if plan.sp and (s // plan.cp) % tp:
        return f"sequence parallel needs seq={s} / cp={plan.cp} divisible by tp={tp}"
    if pp * plan.virtual_stages > model.n_layers:
        return f"pp x virtual_stages = {pp * plan.virtual_stages} chunks > {model.n_layers} blocks"
    return ""


def evaluate(plan: Plan, model: ModelStats, cluster: Cluster, work: Workload,
             constants: Constants = DEFAULT_CONSTANTS, *, balance: bool = False,
             memo: Memo | None = None, time_unfit: bool = True) -> Estimate:
    """Predict one plan. Infeasible plans come back with ``feasible=False`` and a reason.

    ``balance=True`` splits blocks over pipeline chunks by the DP partition (the heavy
    first/last stages get fewer blocks); otherwise ``plan.options.pp_stage_layers`` or an
    even split. ``memo``: what earlier plans of the same search (``model``, ``cluster``,
    ``work``, ``constants``) priced that this one shares (:class:`plait.planner.memo.Memo`;
    the search passes one), else priced afresh. ``time_unfit=False``: a layout that does not
    fit in memory comes back with its memory, breakdown and reason only, its time unpriced
    (what the search needs of the many it rejects; pricing the rest of it costs more than
    the memory).
    """
    c = constants
    memo = Memo() if memo is None else memo
    est = Estimate(plan=plan, feasible=False)
    B, s, world = work.global_batch, work.seq, cluster.world_size
    tp, pp, zero = plan.tp, plan.pp, plan.zero
    S = state_shards(plan)  # what ZeRO shards state over
    m = plan.microbatches if pp > 1 else 1
    steps = plan.grad_accum
    b = B // plan.dp // (m * steps)
    est.microbatch_size = b
    est.reason = _invalid(plan, model, cluster, work)
    if est.reason:
        if plan.world_size != world or B % plan.dp or (B // plan.dp) % (m * steps):
            est.microbatch_size = 0
        return est

    # ---- time: one microbatch per block and chunk, then the pipeline's schedule
    seqs = work.seqs
    times = memo.microbatch_times(plan, model, cluster, b, s, c, seqs)
    sizes = memo.stage_sizes(plan, model, times, balance)
    if isinstance(sizes, str):
        est.reason = sizes
        return est
    est.stage_layers = tuple(sizes)
    st = memo.stage_times(plan, model, cluster, work, b, times, sizes, c)
    pipe, bubble = pipeline_time(plan, cluster, st, times, c)
    r_busy = st.busiest

    shares = memo.rank_shares(plan, model, sizes, st.rank_chunks)

    # ---- memory on each pipeline rank; the worst one counts
    mem_best, breakdown = peak_memory(plan, model, cluster, b, s, st, shares, c,
                                      stack_seqs=seqs, memo=memo)
    est.memory_bytes_per_device = mem_best
    est.memory_breakdown = breakdown
    unfit = mem_best > cluster.memory_bytes
    if unfit and not time_unfit:
        est.reason = _out_of_memory(mem_best, breakdown, cluster)
        return est

    # ---- data-parallel traffic and what of it the backward hides

    def grad_sync_times() -> list[float]:  # each pipeline rank's gradient reduction
        return memo.grad_sync_times(plan, model, sizes, st.rank_chunks, cluster, c,
                                    grad_dtype=work.grad_reduce_dtype)

    traffic_dp = memo.dp_traffic(plan, shares[r_busy], grad_dtype=work.grad_reduce_dtype,
                                 bucket_bytes=c.bucket_bytes)
    grad_time = gather_time = ag_time = 0.0
    for t, stride in traffic_dp:
        ct = collective_time(t, cluster, stride, c)
        if t.what == "grads":
            grad_time += ct
        elif t.op == "all_gather":
            ag_time += ct
        else:
            gather_time += ct
    fsdp_reduce, fsdp_regather = fsdp_host_time(plan, shares[r_busy], c)
    grad_time += fsdp_reduce
    ag_time += fsdp_regather
    busy_time = st.rank_time[r_busy]
    bwd_window = busy_time * (2 + times.replay) / (3 + times.replay)
    exposed_grad = max(0.0, grad_time - bwd_window) if c.overlap else grad_time
    after_schedule = reduces_after_schedule(plan)
    zero_bubble = pp > 1 and plan.pp_schedule in ZERO_BUBBLE_SCHEDULES
    if zero_bubble and grad_time:
        # No backward hides a zero-bubble schedule's gradient reduction. At zero=0/1 the data
        # (and cp) ranks average once per step, after the schedule
        # (PipelineRunner.sync_data_gradients); under ZeRO-2/3 torch reduce-scatters each
        # stage's at its REDUCE_GRAD step, after the stage's last weight-gradient pass, and
        # those passes end the schedule (they fill its cooldown). Charged in full (at ZeRO-2/3
        # a rank's earlier stage may hide under its later stage's last passes: an upper
        # bound); each pp rank reduces its own stages over its own group, all at once, so the
        # step waits for the slowest rank's.
        exposed_grad = max(grad_sync_times())
    elif pp > 1 and not c.overlap and grad_time:
        # The stage runtime syncs a stage's gradients inside its last backward (DDP's reducer,
        # FSDP2's post-backward), before that backward's input gradient is sent upstream. Where
        # the sync blocks the rank (CPU + gloo: no core left to run it in the background), the
        # last microbatch's backward chain waits for every stage's sync in turn, not only the
        # busiest rank's at the end. With overlap (GPUs) the sync runs under the backward and
        # only its tail is exposed, on the last stage to finish: counted once, above.
        exposed_grad += sum(t for r, t in enumerate(grad_sync_times()) if r != r_busy)
    exposed_ag3 = ag_time
    if ag_time and c.overlap and zero >= 2 and pp == 1:
        # unit by unit: each block's gather (and in backward its reduce-scatter) against that
        # block's compute; the reduce-scatter leaves the backward-window term above
        fwd_unit = times.block / (3 + times.replay)
        scatter_time = sum(collective_time(t, cluster, stride, c) for t, stride in traffic_dp
                           if t.what == "grads" and t.op == "reduce_scatter")
        exposed_ag3 = fsdp_exposed(plan, cluster, shares[r_busy], st.rank_layers[r_busy],
                                   fwd_unit, times.block - fwd_unit,
                                   grad_dtype=work.grad_reduce_dtype, c=c) + fsdp_regather
        grad_time -= scatter_time
        exposed_grad = max(0.0, grad_time - bwd_window)
    elif ag_time and c.overlap:
        # FSDP2 prefetches the next unit's gather under the current unit's compute.
        per_micro = ag_time / (m * steps)
        exposed_ag3 = max(0.0, per_micro - busy_time) * m * steps + \
            ag_time / (m * steps) / max(1, max(sizes))  # first gather is never hidden
    P, tensors = shares[r_busy].params, shares[r_busy].tensors
    owned = P / (S if zero >= 1 else 1)
    opt_time = owned * 16 * 2 / cluster.hbm_bw  # param, grad, 2 moments: read + write
    dtensors = zero >= 2 or tp > 1
    tensor_time = tensors * (c.dtensor_step_s if dtensors else c.tensor_step_s)
    clip = memo.clip_traffic(plan, shares[r_busy])
    clip_time = sum(collective_time(t, cluster, stride, c) for t, stride in clip)
    step = pipe + exposed_grad + gather_time + exposed_ag3 + opt_time + tensor_time + clip_time

    # ---- traffic of the busiest rank, as the comm ledger predicts it: where first read
    layers_busy = st.rank_layers[r_busy]
    est.traffic_priced_by(partial(_busiest_traffic, plan, model, memo.activations,
                                  shares[r_busy], layers_busy, b, s, seqs, traffic_dp + clip))
    est.busiest_rank = r_busy
    est.step_time_s = step
    est.tokens_per_s = B * s / step
    L = model.n_layers
    # the further stacks' blocks (an encoder-decoder's encoder), without a pipeline
    more = model.more_stacks_flops(B, s, seqs) if plan.pp == 1 else 0.0
    side = model.side_seq(s, seqs)
    model_flops = model.model_flops(B * s, s, side_seq=side) + 3 * more
    hw_flops = model.model_flops(B * s, s, recompute_layers=times.replay * L, side_seq=side) + \
        (3 + times.replay) * more
    peak = cluster.peak(plan.mixed_precision)
    est.tflops_per_device = model_flops / step / world / 1e12
    est.tflops_per_device_hw = hw_flops / step / world / 1e12
    est.mfu = model_flops / step / world / (peak * times.share)
    est.bubble_fraction = bubble
    est.time_breakdown = {"pipeline": pipe, "compute_per_microbatch": max(st.rank_time),
                          "tp_comm_per_block": times.tp_comm + c.tp_block_overhead_s
                          if tp > 1 else 0.0,
                          "tp_comm": times.tp_comm * layers_busy * m * steps,
                          "cp_comm": times.cp_comm * layers_busy * m * steps,
                          "dp_grad_exposed": exposed_grad,
                          "dp_grad_total": grad_time, "param_gather": gather_time,
                          "zero3_gather_exposed": exposed_ag3, "optimizer": opt_time,
                          "per_tensor": tensor_time, "clip_norm": clip_time}
    if zero == 1 and S > 1:
        est.notes.append("zero=1 memory follows plait's runtime (DDP + ZeroRedundancyOptimizer): "
                         "fp32 parameters and gradients on every rank, only AdamW state sharded")
    if zero == 3 and S > 1 and c.overlap:
        est.notes.append("zero=3 assumes overlap: FSDP2's prefetch hides each unit's gather "
                         "(and its reduce-scatter) under that unit's compute, no slowdown of the "
                         "compute by the collectives; exposed only where a unit's collectives "
                         "outlast its compute" if pp == 1 else
                         "zero=3 inside a pipeline assumes full overlap: parameter all-gathers "
                         "are prefetched under compute, exposed only for the first unit and "
                         "where a microbatch's gathers outlast its compute")
    if zero_bubble and grad_time:
        est.notes.append(f"{plan.pp_schedule}: the gradients are " + (
            "averaged over the data ranks once per step after the schedule" if after_schedule
            else "reduce-scattered after each stage's last weight-gradient pass") +
            ", not overlapped with a backward (charged in full)")
    if plan.cp > 1:
        est.notes.append("cp: plait's all-gather form (K and V of the whole sequence gathered "
                         "in each attention, their gradients reduce-scattered), waited for "
                         "inside attention: not overlapped with compute, unlike ring attention; "
                         "attention FLOPs counted over the whole s x s square")
    if unfit:
        est.reason = _out_of_memory(mem_best, breakdown, cluster)
        return est
    est.feasible = True
    return est


def _busiest_traffic(plan: Plan, model: ModelStats, kept: Activations, share: LocalModel,
                     layers: int, b: int, s: int, seqs: Mapping[str, int],
                     priced: list[tuple[Traffic, int]]) -> list[Traffic]:
    """The collectives of the rank holding ``share`` (``layers`` blocks) per step, as the comm
    ledger predicts them (:mod:`plait.comm.predict`): ``priced``, its data-parallel and
    clipping collectives (with their strides), then its activations' at microbatch size ``b``
    (:func:`activation_traffic`, with the blocks the plan's checkpointing replays; ``kept``:
    the search's, the one part of its memo an estimate holds on to)."""
    busy = dataclasses.replace(share, recomputed=checkpointed(plan, layers)[0])
    return [t for t, _ in priced] + kept.traffic(
        plan, busy, b, lambda: activation_traffic(plan, model, busy, b, s, seqs))


def _out_of_memory(needs: float, breakdown: Mapping[str, float], cluster: Cluster) -> str:
    """The reason a layout needing ``needs`` bytes per device does not fit."""
    return (f"needs {needs / 2**30:.1f} GiB per device (of which activations "
            f"{breakdown['activations'] / 2**30:.1f} GiB), has "
            f"{cluster.memory_bytes / 2**30:.1f} GiB")


def rank_traffic(plan: Plan, model: ModelStats, global_batch: int, seq: int,
                 stack_seqs: Mapping[str, int] | None = None) -> list[list[Traffic]] | None:
    """The collectives each pipeline rank issues per optimizer step (index: pp rank), as
    :func:`evaluate` prices its busiest rank's: what the comm ledger's expected column shows for
    a model other than plait's reference transformer under tp or pp. None where the plan
    cannot run the model (a tp its blocks cannot take, a batch it cannot split).
    ``stack_seqs``: :func:`activation_traffic`'s."""
    from . import constants_for
    from .hardware import load_cluster

    cluster = load_cluster("cpu", devices=plan.world_size)
    c = constants_for(cluster)
    work = Workload(global_batch, seq, stack_seqs=tuple((stack_seqs or {}).items()))
    est = evaluate(plan, model, cluster, work, c)
    if est.traffic is None or not est.stage_layers:
        return None
    b = est.microbatch_size
    times = microbatch_times(plan, model, cluster, b, seq, c, work.seqs)
    sizes = list(est.stage_layers)
    st = stage_times(plan, model, cluster, work, b, times, sizes, c)
    out = []
    for r, share in enumerate(rank_shares(plan, model, sizes, st.rank_chunks)):
        share = dataclasses.replace(share, recomputed=checkpointed(plan, st.rank_layers[r])[0])
        out.append([t for t, _ in dp_traffic(plan, share, grad_dtype=work.grad_reduce_dtype,
                                             bucket_bytes=c.bucket_bytes)]
                   + [t for t, _ in clip_traffic(plan, share)]
                   + activation_traffic(plan, model, share, b, seq, stack_seqs))
    return out


def activation_traffic(plan: Plan, model: ModelStats, share: LocalModel, b: int, seq: int,
                       stack_seqs: Mapping[str, int] | None = None) -> list[Traffic]:
    """The collectives that move activations on one pipeline rank holding ``share``, per
    optimizer step of micro-batches of ``b`` sequences of ``seq`` tokens, as the comm ledger
    predicts them (:mod:`plait.comm.predict`): tensor parallelism's (on the rank's ``seq /
    cp`` tokens of each sequence), the pipeline's sends, and context parallelism's K/V
    all-gathers and reduce-scatters (:func:`cp_rank_traffic`). A model with further stacks of
    blocks (``model.more_stacks``: an encoder-decoder's other stack) has each priced on its own
    sequence, ``stack_seqs`` by the path of its first block (default ``seq``), and the
    cross-attention of one stack on the other's (:func:`more_stacks_traffic`)."""
    local = seq // plan.cp
    seqs = stack_seqs or {}
    other = next((seqs.get(m.first, seq) for m in model.more_stacks), None)
    return (predict.tp_rank_traffic(plan, share, b, local, model.hidden,
                                    model.kv_whole(plan.tp), model.tp_block, side_seq=other)
            + more_stacks_traffic(plan, model, share, b, seq, seqs)
            + predict.pp_rank_traffic(plan, share, b, local, model.hidden, model.tp_block)
            + cp_rank_traffic(plan, model, share, b, seq))


def more_stacks_traffic(plan: Plan, model: ModelStats, share: LocalModel, b: int, seq: int,
                        stack_seqs: Mapping[str, int]) -> list[Traffic]:
    """Tensor parallelism's collectives of the model's further stacks of blocks
    (``model.more_stacks``) per optimizer step, each on its own sequence (``stack_seqs`` by its
    first block's path, default ``seq``), its cross-attention on the main stack's ``seq``.
    Without a pipeline only: plait does not cut a model with several stacks into stages."""
    if plan.tp == 1 or plan.pp > 1:
        return []
    replayed = share.recomputed / share.layers if share.layers else 0.0
    return [t for more in model.more_stacks if more.tp_block is not None
            for t in predict.tp_stack_traffic(plan, b, stack_seqs.get(more.first, seq),
                                              model.hidden, more.tp_block, more.n_layers,
                                              embedded=more.embedded, side_seq=seq,
                                              recomputed=replayed)]


def cp_step_traffic(plan: Plan, model: ModelStats, b: int, seq: int) -> list[Traffic]:
    """Context parallelism's K/V collectives of one rank per optimizer step without a
    pipeline: every block of ``model``, those the plan's checkpointing drops replayed, on
    micro-batches of ``b`` whole sequences of ``seq`` tokens (what the comm ledger's expected
    column shows for a model other than plait's reference transformer)."""
    layers = model.n_layers
    share = LocalModel(params=0.0, root_params=0.0, tensors=0, layers=layers,
                       recomputed=checkpointed(plan, layers)[0])
    return cp_rank_traffic(plan, model, share, b, seq)


def cp_rank_traffic(plan: Plan, model: ModelStats, share: LocalModel, b: int, seq: int
                    ) -> list[Traffic]:
    """Context parallelism's collectives on a rank holding ``share`` (its blocks, those
    checkpointing replays): per attention block and micro-step of ``b`` whole sequences, K and
    V all-gathered (again per replayed block) and their gradients reduce-scattered, each of
    ``b x seq x kv_dim`` elements: the rank's share of the kv heads (``ModelStats.kv_dim``),
    not the query heads. Where the model's blocks have no attention, nothing."""
    if plan.cp == 1 or not model.attention:
        return []
    e = None
    if plan.mixed_precision != "fp32" and plan.tp == 1:
        # the dtypes the model's own code hands attention, where a forward pass read them
        e = model.kv_element_bytes(predict.casts_params(plan))
    return predict.cp_rank_traffic(plan, share, b, seq, model.kv_dim(plan.tp), e)
