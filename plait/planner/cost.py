"""The cost model: step time, memory per device and bytes per mesh axis for one Plan.

Every figure is closed-form, so the search can evaluate tens of thousands of layouts a second.

Time
  * Compute: FLOPs / (peak FLOP/s of the compute dtype x ``compute_efficiency``), one constant for
    every layout and model (see ``Constants``; calibrated once against Narayanan et al. 2021, not
    per row). Backward = 2x forward; recomputation replays the forward of checkpointed blocks.
  * Collectives: ``alpha * steps + wire_bytes / (bandwidth * link_efficiency)`` on the tier the
    group lives on. Mesh order is (pp, dp_replicate, dp_shard, cp, tp), tp innermost, so a group
    of size n and stride d stays inside a node iff n*d <= devices_per_node.
  * TP/SP collectives are on the critical path (not overlapped). DP/ZeRO gradient traffic
    overlaps with the backward of the last microbatch; what does not fit is exposed. ZeRO-3
    gathers overlap with each microbatch's compute (prefetch). ZeRO-1/2's parameter all-gather
    after the optimizer step is exposed.
  * Pipeline: with per-rank time t_r per microbatch, ``m*max(t) + (sum(t) - max(t)) * k`` where
    k is the schedule's bubble scale: 1 (GPipe, 1F1B), 1/v (interleaved, looped BFS),
    1/(3v) (zero-bubble H1 and V: the weight-gradient pass fills the bubble; ZB paper,
    T_F = T_B = T_W). With v=1 this is the textbook ``sum(t) + (m-1) max(t)``.
  * Optimizer: AdamW is memory-bound: bytes of owned state read and written / HBM bandwidth.

Memory per device (the busiest pipeline rank)
  * Parameters (fp32), gradients (fp32), AdamW state (2 x fp32), sharded by ZeRO stage over
    dp_shard; a compute-dtype copy of the parameters under bf16 (ZeRO-3: two gathered blocks).
  * Activations per block after Korthikanti et al. 2022 (table 2), generalised to GQA, SwiGLU and
    any ffn size: 2-byte figures scaled to the compute dtype; the replicated part (norm inputs,
    inputs of QKV/MLP, dropout masks: 10sbh for GPT) is not divided by tp unless sp; attention
    scores (5as^2b) only without flash attention. Full recomputation keeps the block input (plus
    one block being recomputed); "selective" checkpoints every k-th block; "op" is approximated as
    keeping 60% of a block's activations and replaying 5% of its forward.
  * Microbatches in flight per schedule: GPipe m; 1F1B/ZB-V pp - r on rank r; interleaved
    Megatron's warm-up count ``2(pp - r - 1) + (v - 1) pp + 1`` chunks.
  * fp32 logits (and their gradient) on the last stage; a reserve from the cluster description.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from plait.comm.volumes import Traffic, by_axis, pp_traffic, tp_traffic
from plait.plan import Plan

from .hardware import Cluster
from .model_stats import ModelStats
from .cpu.sharing import shared_pipeline_time


@dataclass(frozen=True)
class Constants:
    """The model's few fitted constants; one value each, for every model and layout.

    ``compute_efficiency``: achieved fraction of datasheet peak for the dense transformer matmuls
    (and the rest of a block's kernels, folded in). Fitted once, as the value that makes the
    median error over all ten rows of Narayanan et al. 2021 table 1 zero (0.568 -> 0.57), after
    communication and bubbles were modelled; see docs/planner.md and bench/planner_accuracy.py.
    ``plait plan --calibrate`` measures it for the local machine instead.
    ``link_efficiency``: fraction of link bandwidth NCCL-class collectives reach (busbw/link).
    """

    compute_efficiency: float = 0.57
    link_efficiency: float = 0.8
    # Fixed time per block per microbatch (forward + backward): kernel launches and Python.
    # Negligible on GPUs at planning shapes; measured by --calibrate on CPUs.
    block_overhead_s: float = 0.0
    # Whether data-parallel communication can run under compute. False where processes already
    # use every core (CPU + gloo): nothing is left to drive the collective in the background.
    overlap: bool = True
    # Per-byte cost of each collective relative to the ring ideal at the all-reduce's measured
    # bus bandwidth (1.0: the ring). gloo has no native reduce-scatter or all-gather into a
    # tensor and torch emulates them with an all-reduce / per-rank copies, about 2.0 per byte;
    # --calibrate measures each from the op itself.
    all_gather_factor: float = 1.0
    reduce_scatter_factor: float = 1.0
    broadcast_factor: float = 1.0
    # Time per call beyond ``latency x ring steps`` (launch, copies, gloo's own work). May be
    # negative down to minus the latency where calls overlap (ZeroRedundancyOptimizer's burst of
    # asynchronous broadcasts). 0 on the GPU presets: NCCL's per-call cost is in the latency.
    all_reduce_call_s: float = 0.0
    all_gather_call_s: float = 0.0
    reduce_scatter_call_s: float = 0.0
    broadcast_call_s: float = 0.0
    # Per microbatch, outside the blocks: embedding lookup, final norm, loss, autograd's root
    # (the head's matmul FLOPs are counted separately). Charged on the last pipeline chunk.
    micro_overhead_s: float = 0.0
    # Per parameter tensor per optimizer step: gradient clipping + optimizer + zero_grad, for
    # plain tensors and for DTensors (FSDP2 / TP parameters: every op goes through DTensor's
    # dispatch, and the clip norm through a collective). 0 on GPU presets: fused/foreach
    # optimizers make this a few kernel launches for the whole model.
    tensor_step_s: float = 0.0
    dtensor_step_s: float = 0.0
    # FSDP2 per unit (a fully_shard-ed block or root) per micro-step beyond its collectives:
    # pre/post forward and backward hooks, copy-in/out of the flat buffers.
    fsdp_unit_s: float = 0.0
    # FSDP2 beyond the modelled collective, per unit: per gradient reduce (the post-backward
    # hook, the reduce-scatter's copy-in and the sharded gradient's write) and, under ZeRO-3,
    # per re-gather in backward (the copy-out into the unsharded parameters). 0 on GPU presets.
    fsdp_reduce_s: float = 0.0
    fsdp_regather_s: float = 0.0
    # Tensor parallelism beyond compute / tp and the modelled TP collectives: per block per
    # microbatch (DTensor dispatch and redistribution in the block), and per microbatch outside
    # the blocks (vocabulary-parallel embedding, loss_parallel).
    tp_block_overhead_s: float = 0.0
    tp_micro_overhead_s: float = 0.0
    # Zero-bubble schedules (ZB-V, interleaved ZB) split each backward into torch's
    # stage_backward_input and stage_backward_weight: a Python walk of the autograd graph per
    # call (``zb_call_s`` per chunk per microbatch) and a dearer backward (``zb_backward_factor``:
    # extra fraction of a block's backward FLOP time). 0 on GPU presets: not measured there.
    zb_call_s: float = 0.0
    zb_backward_factor: float = 0.0
    flash_attention: bool = True
    activation_dropout_masks: bool = True
    bucket_bytes: float = 25 * 2**20


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

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")


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
    comm_bytes_per_step: dict[str, float] = field(default_factory=dict)
    bubble_fraction: float = 0.0
    time_breakdown: dict[str, float] = field(default_factory=dict)
    microbatch_size: int = 0
    stage_layers: tuple[int, ...] = ()
    traffic: list[Traffic] = field(default_factory=list)
    # What the prediction assumes that a reader should know (printed under the table).
    notes: list[str] = field(default_factory=list)

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
                "notes": list(self.notes)}


# ------------------------------------------------------------------------------ helpers
def act_bytes(plan: Plan) -> int:
    return 2 if plan.mixed_precision == "bf16" else 4


def tier(cluster: Cluster, size: int, stride: int) -> tuple[float, float]:
    """(bandwidth, latency) of a group of ``size`` ranks ``stride`` apart in mesh order.

    Inside a node only if the span ``size * stride`` divides the node: otherwise some groups
    straddle two nodes and the ring runs at the slower tier."""
    span = size * stride
    if span <= cluster.devices_per_node and cluster.devices_per_node % span == 0:
        return cluster.intra_bw, cluster.intra_latency
    return cluster.inter_bw, cluster.inter_latency


_FACTOR = {"all_gather": "all_gather_factor", "reduce_scatter": "reduce_scatter_factor",
           "broadcast": "broadcast_factor"}
_CALL = {"all_reduce": "all_reduce_call_s", "all_gather": "all_gather_call_s",
         "reduce_scatter": "reduce_scatter_call_s", "broadcast": "broadcast_call_s"}


def collective_time(t: Traffic, cluster: Cluster, stride: int, c: Constants) -> float:
    """``calls x (latency x ring steps + per-call cost) + wire / (bw x link_eff) x op factor``."""
    if t.group == 1 and t.op != "send_recv":
        return 0.0
    bw, alpha = tier(cluster, t.group, stride)
    n = t.group
    steps = {"all_reduce": 2 * (n - 1), "send_recv": 1}.get(t.op, n - 1)
    extra = getattr(c, _CALL[t.op]) if t.op in _CALL else 0.0
    per_call = max(0.0, steps * alpha + extra)
    factor = getattr(c, _FACTOR[t.op]) if t.op in _FACTOR else 1.0
    return t.calls * per_call + t.wire / (bw * c.link_efficiency) * factor


def tp_block_traffic(b: int, s: int, h: int, tp: int, dtype: str, sp: bool,
                     recomputed: float = 0.0) -> list[Traffic]:
    """TP collectives of one block for one microbatch (forward + backward), as plait's runtime
    issues them (plait.comm.predict): Megatron's 4 all-reduces, or with SP 4 all-gathers + 4
    reduce-scatters plus the 2 sequence-parallel norms' weight-gradient all-reduces (h fp32).
    ``recomputed`` (0..1): share of the block replayed by checkpointing; torch's non-reentrant
    checkpoint stops before the last collective, so a replay costs 1 all-reduce (SP: 2
    all-gathers + 1 reduce-scatter)."""
    if tp == 1:
        return []
    out = tp_traffic(b, s, h, 1, tp, dtype, sp=sp)
    act = float(b) * s * h * act_dtype_bytes(dtype)
    if sp:
        out.append(Traffic("tp", "all_reduce", 2.0 * h * 4, 2, tp, "norm weight grads"))
    if recomputed:
        if sp:
            out += [Traffic("tp", "all_gather", act * 2 * recomputed, 2 * recomputed, tp),
                    Traffic("tp", "reduce_scatter", act * recomputed, recomputed, tp)]
        else:
            out.append(Traffic("tp", "all_reduce", act * recomputed, recomputed, tp))
    return out


def tp_end_traffic(b: int, s: int, h: int, tp: int, dtype: str, sp: bool, *, embed: bool,
                   head: bool) -> list[Traffic]:
    """TP collectives outside the blocks per microbatch: the vocabulary-parallel embedding and
    the head each an all-reduce of b*s*h (SP: all-gather + reduce-scatter), loss_parallel's 3
    fp32 values per token, and with SP the final norm's weight-gradient all-reduce."""
    if tp == 1:
        return []
    act = float(b) * s * h * act_dtype_bytes(dtype)
    ends = int(embed) + int(head)
    out = []
    if ends:
        if sp:
            out += [Traffic("tp", "all_gather", act * ends, ends, tp),
                    Traffic("tp", "reduce_scatter", act * ends, ends, tp)]
        else:
            out.append(Traffic("tp", "all_reduce", act * ends, ends, tp))
    if head:
        out.append(Traffic("tp", "all_reduce", 3.0 * b * s * 4, 3, tp, "loss_parallel"))
        if sp:
            out.append(Traffic("tp", "all_reduce", float(h) * 4, 1, tp, "final norm grad"))
    return out


def act_dtype_bytes(dtype: str) -> int:
    return 2 if dtype == "bf16" else 4


def activation_bytes_per_block(m: ModelStats, b: int, s: int, tp: int, sp: bool, dtype_bytes: int,
                               c: Constants) -> float:
    """Korthikanti et al. 2022 activation memory of one block and microbatch (no recompute)."""
    h, f, a = m.hidden, m.ffn, m.n_heads
    kv = m.kv_heads * (h // m.n_heads)
    mask = 1 if c.activation_dropout_masks else 0
    # 2-byte units of s*b: attention: QKV input 2h, q/k/v 2(h+2kv), o_proj input 2h, mask h.
    attn = 2 * h + 2 * (h + 2 * kv) + 2 * h + mask * h
    if m.mlp == "swiglu":
        mlp = 2 * h + 8 * f + mask * h    # input, gate/up outputs, silu output, down input
    else:
        mlp = 2 * h + 4 * f + mask * h    # input, activation input, down input
    norms = 4 * h
    replicated = norms + 2 * h + 2 * h + 2 * mask * h  # stays whole under TP without SP
    sharded = attn + mlp + norms - replicated
    scores = 0.0 if (c.flash_attention or not m.attention) else 5 * a * s  # per token
    per_token = (replicated / (tp if sp else 1)) + (sharded + scores) / tp
    return per_token * s * b * dtype_bytes / 2


def _checkpointed(plan: Plan, layers: int) -> tuple[int, float]:
    """(blocks whose activations are dropped, fraction of a block's forward replayed per block
    of this rank) for the plan's checkpointing mode."""
    mode = plan.activation_checkpointing
    if mode == "full":
        return layers, 1.0
    if mode == "selective":
        n = math.ceil(layers / plan.checkpoint_every)
        return n, n / layers if layers else 0.0
    if mode == "op":
        return 0, 0.05
    return 0, 0.0


def balanced_partition(costs: list[float] | tuple[float, ...], parts: int) -> list[int]:
    return list(_balanced_partition(tuple(costs), parts))


@functools.lru_cache(maxsize=4096)
def _balanced_partition(costs: tuple[float, ...], parts: int) -> tuple[int, ...]:
    """Split ``costs`` into ``parts`` contiguous non-empty chunks minimising the largest sum.

    Dynamic programming over (chunks, prefix): best[k][j] = min_i max(best[k-1][i], S[j]-S[i]).
    best[k-1][.] grows with i while S[j]-S[i] shrinks, so the optimal i is where they cross:
    a bisection instead of a scan (O(parts * n log n)). Returns the chunk sizes; ties go to the
    earliest split, so the result is deterministic.
    """
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} blocks into {parts} pipeline chunks")
    prefix = [0.0]
    for x in costs:
        prefix.append(prefix[-1] + x)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    arg = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        prev, cur, cur_arg = best[k - 1], best[k], arg[k]
        for j in range(k, n - (parts - k) + 1):
            lo, hi = k - 1, j - 1  # i in [lo, hi]: chunk (i, j] non-empty
            while lo < hi:  # first i where prev[i] >= S[j]-S[i]
                mid = (lo + hi) // 2
                if prev[mid] >= prefix[j] - prefix[mid]:
                    hi = mid
                else:
                    lo = mid + 1
            cand = []
            for i in (lo - 1, lo):
                if k - 1 <= i <= j - 1 and prev[i] < inf:
                    cand.append((max(prev[i], prefix[j] - prefix[i]), i))
            value, i = min(cand)
            cur[j], cur_arg[j] = value, i
    sizes, j = [], n
    for k in range(parts, 0, -1):
        i = arg[k][j]
        sizes.append(j - i)
        j = i
    return tuple(sizes[::-1])


def _even_split(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _bubble_scale(plan: Plan) -> float:
    if plan.pp_schedule in ("gpipe", "1f1b"):
        return 1.0
    if plan.pp_schedule in ("interleaved_1f1b", "looped_bfs"):
        return 1.0 / plan.virtual_stages
    return 1.0 / (3 * plan.virtual_stages)  # interleaved_zb, zbv


def _inflight(plan: Plan, rank: int, m: int) -> float:
    """Microbatches of this rank's whole share of layers held at the memory peak."""
    pp, v = plan.pp, plan.virtual_stages
    if pp == 1:
        return 1.0
    if plan.pp_schedule == "gpipe":
        return float(m)
    if plan.pp_schedule in ("1f1b", "zbv"):
        return float(min(m, pp - rank))
    chunks = min(m * v, 2 * (pp - rank - 1) + (v - 1) * pp + 1)
    return chunks / v


# ------------------------------------------------------------------------------ evaluate
def evaluate(plan: Plan, model: ModelStats, cluster: Cluster, work: Workload,
             constants: Constants = DEFAULT_CONSTANTS, *, balance: bool = False) -> Estimate:
    """Predict one plan. Infeasible plans come back with ``feasible=False`` and a reason.

    ``balance=True`` splits blocks over pipeline chunks by the DP above (the heavy first/last
    stages get fewer blocks); otherwise ``plan.options["pp_stage_layers"]`` or an even split.
    """
    c = constants
    est = Estimate(plan=plan, feasible=False)
    world = cluster.world_size
    if plan.world_size != world:
        est.reason = f"plan uses {plan.world_size} devices, cluster has {world}"
        return est
    B, s = work.global_batch, work.seq
    dp, tp, pp, v = plan.dp, plan.tp, plan.pp, plan.virtual_stages
    m = plan.microbatches if pp > 1 else 1
    steps = plan.grad_accum
    if B % dp:
        est.reason = f"global batch {B} not divisible by dp={dp}"
        return est
    if (B // dp) % (m * steps):
        est.reason = (f"batch per dp rank {B // dp} not divisible by microbatches x grad_accum "
                      f"= {m * steps}")
        return est
    b = B // dp // (m * steps)
    est.microbatch_size = b
    for what, value in (("attention heads", model.n_heads), ("kv heads", model.kv_heads),
                        ("ffn", model.ffn)):
        if value % tp:
            est.reason = f"tp={tp} does not divide {what}={value}"
            return est
    if plan.zero == 1 and tp > 1:
        # plait's ZeRO-1 is DDP + ZeroRedundancyOptimizer; DDP cannot bucket TP's DTensor
        # parameters, so the runtime refuses this layout (plait/parallel/fsdp.py).
        est.reason = "zero=1 with tp>1 is not supported by plait's runtime; use zero=2 or 3"
        return est
    if plan.sp and s % tp:
        est.reason = f"sequence parallel needs seq={s} divisible by tp={tp}"
        return est
    chunks = pp * v
    L = model.n_layers
    if chunks > L:
        est.reason = f"pp x virtual_stages = {chunks} chunks > {L} blocks"
        return est
    ab = act_bytes(plan)
    dtype = plan.mixed_precision
    peak = cluster.peak(dtype)
    on_node = min(world, cluster.devices_per_node)
    share = 1.0
    if cluster.compute_units is not None and on_node > cluster.compute_units:
        share = cluster.compute_units / on_node
    rate = peak * c.compute_efficiency * share

    # ---- per-block and per-stage times for one microbatch (this rank's shard)
    tokens_mb = b * s
    fwd_block = model.block_flops_per_token(s) * tokens_mb / tp
    ckpt_mode = plan.activation_checkpointing
    replay = {"full": 1.0, "op": 0.05}.get(ckpt_mode, 0.0)
    if ckpt_mode == "selective":
        replay = 1.0 / plan.checkpoint_every
    if replay and pp > 1 and plan.pp_schedule in ("interleaved_zb", "zbv") and model.block_tensors:
        # Zero-bubble schedules split backward into an input-gradient pass and a weight-gradient
        # pass; torch.distributed.pipelining's stage_backward_weight calls autograd.grad once
        # per parameter group, and non-reentrant checkpointing recomputes the block's forward on
        # every call. Counted on plait's runtime (tiny, pp=2 ZB-V, full recomputation): 10
        # forwards replayed per block and microbatch on the middle rank = 1 (input pass) + 9
        # (its parameter tensors); 5.5 on the rank holding embedding and head.
        replay *= 1 + model.block_tensors
    block_compute = fwd_block * (3 + replay) / rate + c.block_overhead_s * (1 + replay / 3)
    zero_bubble = pp > 1 and plan.pp_schedule in ("interleaved_zb", "zbv")
    if zero_bubble:
        block_compute += c.zb_backward_factor * 2 * fwd_block / rate
    # TP collectives per block and microbatch, on the tp tier (tp innermost: stride 1).
    tp_block = tp_block_comm = 0.0
    if tp > 1:
        recomputed = {"full": 1.0, "selective": 1.0 / plan.checkpoint_every}.get(ckpt_mode, 0.0)
        tp_block = sum(collective_time(t, cluster, 1, c) for t in
                       tp_block_traffic(b, s, model.hidden, tp, dtype, plan.sp, recomputed))
        tp_block_comm = tp_block
        tp_block += c.tp_block_overhead_s
    block_time = block_compute + tp_block
    head_time = 3 * model.head_flops_per_token() * tokens_mb / tp / rate + c.micro_overhead_s
    embed_time = 0.0
    if tp > 1:
        first_last = pp * v > 1
        embed_time = sum(collective_time(t, cluster, 1, c) for t in tp_end_traffic(
            b, s, model.hidden, tp, dtype, plan.sp, embed=True, head=not first_last))
        head_time += c.tp_micro_overhead_s
        if first_last:
            head_time += sum(collective_time(t, cluster, 1, c) for t in tp_end_traffic(
                b, s, model.hidden, tp, dtype, plan.sp, embed=False, head=True))
    weights = model.layer_weights or (1.0,) * L
    costs = [w * block_time for w in weights]
    given = plan.options.get("pp_stage_layers") if plan.options else None
    if given is not None:
        given = [int(x) for x in given]
        if len(given) != chunks or sum(given) != L or min(given) < 1:
            est.reason = (f"options.pp_stage_layers={given} must list {chunks} positive block "
                          f"counts summing to {L}")
            return est
        sizes = given
    elif balance and chunks > 1:
        # Relative costs, rounded, so layouts that differ only in batch or tp share one DP run.
        unit = block_time or 1.0
        rel = [round(x / unit, 3) for x in costs]
        rel[0] = round(rel[0] + embed_time / unit, 3)
        rel[-1] = round(rel[-1] + head_time / unit, 3)
        sizes = balanced_partition(rel, chunks)
    else:
        sizes = _even_split(L, chunks)
    est.stage_layers = tuple(sizes)
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    chunk_time = [sum(costs[bounds[i]:bounds[i + 1]]) for i in range(chunks)]
    chunk_time[0] += embed_time
    chunk_time[-1] += head_time
    if zero_bubble:
        chunk_time = [t + c.zb_call_s for t in chunk_time]
    # pipeline p2p per chunk boundary per microbatch (send forward + send backward)
    p2p = 0.0
    if pp > 1:
        # Megatron's scatter/gather trick (or SP) sends the tp-shard; plain torch sends it all.
        split = tp if (plan.sp or work.pp_scatter_gather) else 1
        msg = Traffic("pp", "send_recv", tokens_mb * model.hidden * ab / split, 1, 2)
        p2p = 2 * collective_time(msg, cluster, tp * plan.dp_shard * plan.dp_replicate, c)
    rank_chunks = [range(r, chunks, pp) for r in range(pp)]
    rank_time = [sum(chunk_time[i] for i in ids) + p2p * len(ids) for ids in rank_chunks]
    rank_layers = [sum(sizes[i] for i in ids) for ids in rank_chunks]
    # FSDP2 wraps every block and the stage root (ZeRO-2/3, and replicated DP over TP shards,
    # which goes through FSDP2 too): its hooks run per unit and microbatch.
    fsdp = plan.zero >= 2 or (plan.zero == 0 and tp > 1 and plan.dp_replicate > 1)
    # The per-unit cost is FSDP2's copy-in/out of sharded parameters and gradients; replicated
    # DP over TP (shard groups of one rank) has nothing to gather or scatter and, timed on CPU,
    # costs nothing measurable beyond its all-reduces, so the term is charged with sharding only.
    if fsdp and plan.dp_shard > 1 and c.fsdp_unit_s:
        rank_time = [t + c.fsdp_unit_s * (n + 1)
                     for t, n in zip(rank_time, rank_layers, strict=True)]
    t_max, t_sum = max(rank_time), sum(rank_time)
    if pp > 1:
        pipe = m * t_max + (t_sum - t_max) * _bubble_scale(plan)
        if share < 1.0:
            # More processes than cores (CPU): a stage idle in the bubble hands its core to the
            # busy ones (plait.planner.cpu.sharing simulates the schedule chunk by chunk, in the
            # order each rank runs it, with shared cores). Each chunk's time on a whole core,
            # its sends included; FSDP2's per-unit cost spread over the rank's chunks.
            split = (2 + replay) / (3 + replay)    # backward's share of a microbatch
            full = [t + p2p for t in chunk_time]
            if fsdp and plan.dp_shard > 1 and c.fsdp_unit_s:
                for ids in rank_chunks:
                    for i in ids:
                        full[i] += c.fsdp_unit_s * (sizes[i] + 1 / len(ids))
            full = [t * share for t in full]
            schedule = {"gpipe": "gpipe", "1f1b": "1f1b", "looped_bfs": "looped_bfs"}.get(
                plan.pp_schedule, "interleaved")
            if plan.pp_schedule == "zbv":
                # ZB-V's V-shaped placement and its split backward are not simulated: priced
                # as 1F1B over each rank's whole share (what it saves is bubble, which sharing
                # fills anyway).
                full = [sum(full[i] for i in ids) for ids in rank_chunks]
                schedule = "1f1b"
            per_stage = max(1.0, on_node / pp)
            cores = cluster.compute_units * (pp / on_node if pp > on_node else 1.0)
            pipe = shared_pipeline_time([t * (1 - split) for t in full], [t * split for t in full],
                                        m, replicas=per_stage, cores=cores, schedule=schedule,
                                        ranks=pp)
        bubble = max(0.0, (pipe - m * t_max) / pipe)
    else:
        pipe = rank_time[0]
        bubble = 0.0
    pipe *= steps

    # ---- parameters on the busiest rank (for state memory and DP traffic)
    block_params = [w * model.block_params for w in weights] if model.layer_weights else \
        [float(model.block_params)] * L
    rank_params = []
    for ids in rank_chunks:
        p = sum(sum(block_params[bounds[i]:bounds[i + 1]]) for i in ids)
        if 0 in ids:
            p += model.embed_params
        if chunks - 1 in ids:
            p += model.head_params if not (model.tied and pp == 1) else \
                model.head_params - model.embed_params
        rank_params.append(p / tp)

    # ---- data-parallel traffic, as plait's runtime issues it (see plait.comm.predict)
    S, R, zero = plan.dp_shard, plan.dp_replicate, plan.zero
    gbytes = act_dtype_bytes(work.grad_reduce_dtype)
    pbytes = act_dtype_bytes(dtype)
    r_busy = rank_time.index(t_max)
    # A pipeline syncs gradients at the last backward of each schedule run (once per
    # accumulation step); without one, once per optimizer step (no_sync while accumulating).
    syncs = steps if pp > 1 else 1

    def rank_state(r: int) -> tuple[float, float, int, int]:
        """Pipeline rank r's parameters, of which its root's (embedding / head), its FSDP
        units (blocks + the root unit) and its parameter tensors."""
        ids = rank_chunks[r]
        root = ((model.embed_params if 0 in ids else 0) +
                (model.head_params if chunks - 1 in ids else 0)) / tp
        tensors = (rank_layers[r] * model.block_tensors +
                   (model.embed_tensors if 0 in ids else 0) +
                   (model.head_tensors if chunks - 1 in ids else 0))
        return rank_params[r], root, rank_layers[r] + 1, tensors

    def dp_traffic(r: int) -> list[tuple[Traffic, int]]:
        """Pipeline rank r's data-parallel traffic per optimizer step, with each op's rank
        stride."""
        P, root, units, tensors = rank_state(r)
        out: list[tuple[Traffic, int]] = []

        def grads(axis: str, op: str, payload: float, calls: int, group: int,
                  stride: int) -> None:
            if group > 1:
                out.append((Traffic(axis, op, payload * syncs, calls * syncs, group, "grads"),
                            stride))

        if zero == 0 and R > 1:
            calls = units if fsdp else max(1, math.ceil(P * gbytes / c.bucket_bytes))
            grads("dp_replicate", "all_reduce", P * gbytes, calls, R, tp * S)
        elif zero == 1:
            # DDP over every data rank, then ZeroRedundancyOptimizer broadcasts each parameter
            # tensor from the rank that updated it.
            grads("dp", "all_reduce", P * gbytes, max(1, math.ceil(P * gbytes / c.bucket_bytes)),
                  R * S, tp)
            if S > 1:
                out.append((Traffic("dp_shard", "broadcast", P * 4, max(1, tensors), S,
                                    "params"), tp))
        elif zero >= 2 and S > 1:
            grads("dp_shard", "reduce_scatter", P * gbytes, units, S, tp)
            if R > 1:  # HSDP: the shard's gradients all-reduced across replicas
                grads("dp_replicate", "all_reduce", P / S * gbytes, units, R, tp * S)
            # FSDP2 reshards after every backward, so ZeRO-2 gathers once per micro-step
            # (pipeline: per schedule run); ZeRO-3 before each forward and backward, the root
            # once (pipeline, 1F1B/GPipe: m + 1 times per block per run, the stage runtime keeps
            # blocks gathered between backwards).
            if zero == 2:
                per_block = per_root = steps
            elif pp == 1:
                per_block, per_root = 2 * steps, steps
            else:
                per_block, per_root = (m + 1) * steps, steps
            payload = ((P - root) * per_block + root * per_root) * pbytes
            calls = (units - 1) * per_block + per_root
            out.append((Traffic("dp_shard", "all_gather", payload, calls, S, "params"), tp))
        return out

    def fsdp_time(r: int) -> tuple[float, float]:
        """FSDP2's per-unit costs beyond the collectives on pipeline rank r, per optimizer
        step: (its gradient reduces, its ZeRO-3 backward re-gathers)."""
        if not (zero >= 2 and S > 1):
            return 0.0, 0.0
        units = rank_state(r)[2]
        reduce = c.fsdp_reduce_s * units * syncs
        # ZeRO-3 gathers each block once more per backward than ZeRO-2 (the root never)
        per_block = (m if pp > 1 else 1) * steps if zero == 3 else 0
        return reduce, c.fsdp_regather_s * (units - 1) * per_block

    def grad_sync_time(r: int) -> float:
        return sum(collective_time(t, cluster, stride, c) for t, stride in dp_traffic(r)
                   if t.what == "grads") + fsdp_time(r)[0]

    P, _, _, tensors = rank_state(r_busy)  # for the optimizer and per-tensor terms
    traffic_dp = dp_traffic(r_busy)
    grad_time = gather_time = ag_time = 0.0
    for t, stride in traffic_dp:
        ct = collective_time(t, cluster, stride, c)
        if t.what == "grads":
            grad_time += ct
        elif t.op == "all_gather":
            ag_time += ct
        else:
            gather_time += ct
    fsdp_reduce, fsdp_regather = fsdp_time(r_busy)
    grad_time += fsdp_reduce
    ag_time += fsdp_regather
    bwd_window = rank_time[r_busy] * (2 + replay) / (3 + replay)
    exposed_grad = max(0.0, grad_time - bwd_window) if c.overlap else grad_time
    if pp > 1 and not c.overlap and grad_time:
        # The stage runtime syncs a stage's gradients inside its last backward (DDP's reducer,
        # FSDP2's post-backward), before that backward's input gradient is sent upstream. Where
        # the sync blocks the rank (CPU + gloo: no core left to run it in the background), the
        # last microbatch's backward chain waits for every stage's sync in turn, not only the
        # busiest rank's at the end. With overlap (GPUs) the sync runs under the backward and
        # only its tail is exposed, on the last stage to finish: counted once, above.
        exposed_grad += sum(grad_sync_time(r) for r in range(pp) if r != r_busy)
    exposed_ag3 = ag_time
    if ag_time and c.overlap:
        # FSDP2 prefetches the next unit's gather under the current unit's compute.
        per_micro = ag_time / (m * steps)
        exposed_ag3 = max(0.0, per_micro - rank_time[r_busy]) * m * steps + \
            ag_time / (m * steps) / max(1, max(sizes))  # first gather is never hidden
    owned = P / (S if zero >= 1 else 1)
    opt_time = owned * 16 * 2 / cluster.hbm_bw  # param, grad, 2 moments: read + write
    dtensors = zero >= 2 or tp > 1
    tensor_time = tensors * (c.dtensor_step_s if dtensors else c.tensor_step_s)
    # Gradient clipping across pipeline stages: each stage holds only its own gradients, so
    # plait's runtime all-reduces the squared norm (one fp32) over pp before every optimizer
    # step (plait.train.clip_grad_norm): a blocking call every stage waits in. (The per-tensor
    # norms of DTensor gradients are inside the measured ``dtensor_step_s``.)
    clip = []
    if plan.grad_clip and pp > 1:
        clip = [(Traffic("pp", "all_reduce", 4.0, 1, pp, "clip: squared norm"), tp * S * R)]
    clip_time = sum(collective_time(t, cluster, stride, c) for t, stride in clip)
    step = pipe + exposed_grad + gather_time + exposed_ag3 + opt_time + tensor_time + clip_time

    # ---- memory on each pipeline rank; the worst one counts
    mem_best, breakdown = -1.0, {}
    act_full = activation_bytes_per_block(model, b, s, tp, plan.sp, ab, c)
    act_input = tokens_mb * model.hidden * ab / (tp if plan.sp else 1)
    # Peak memory sits on the first rank (most microbatches in flight) or the last (logits);
    # rank 1 is checked too for the interleaved warm-up.
    for r in sorted({0, min(1, pp - 1), pp - 1}):
        ids = rank_chunks[r]
        layers_r = sum(sizes[i] for i in ids)
        Pr = rank_params[r]
        # fp32 master parameters and gradients: sharded under FSDP2 (ZeRO-2/3). ZeRO-1 is
        # DDP + ZeroRedundancyOptimizer in plait's runtime, so only AdamW's state is sharded.
        params = 4 * Pr / (S if zero >= 2 else 1)
        grads = 4 * Pr / (S if zero >= 2 else 1)
        optim = 8 * Pr / (S if zero >= 1 else 1)
        copy = 0.0
        if zero == 2:
            # reshard_after_forward=False: the whole stage is gathered in the compute dtype
            # from forward to backward (docs/zero.md: 16 Psi / d + C Psi)
            copy = Pr * act_dtype_bytes(dtype)
        elif dtype == "bf16" and zero < 2:
            copy = 2 * Pr
        if zero == 3:
            copy += 2 * 2 * model.block_params / tp * ab / 2 * (2 if dtype == "fp32" else 1)
        dropped, _ = _checkpointed(plan, layers_r)
        per_mb = (layers_r - dropped) * act_full + dropped * act_input
        if ckpt_mode == "op":
            per_mb = 0.6 * layers_r * act_full
        inflight = _inflight(plan, r, m)
        acts = per_mb * inflight
        if dropped:
            acts += act_full  # the block being recomputed
        if 0 in ids:
            acts += act_input * inflight  # embedding output
        logits = 0.0
        if chunks - 1 in ids:
            held = m if (pp > 1 and plan.pp_schedule == "gpipe") else 1
            logits = 2 * tokens_mb * model.vocab / tp * 4 * held
        buffers = 2 * c.bucket_bytes if (R > 1 or S > 1) else 0.0
        total = params + grads + optim + copy + acts + logits + buffers + cluster.reserve_bytes
        if total > mem_best:
            mem_best = total
            breakdown = {"params": params, "grads": grads, "optimizer": optim,
                         "compute_copy": copy, "activations": acts, "logits": logits,
                         "buffers": buffers, "reserve": cluster.reserve_bytes,
                         "pipeline_rank": r}

    # ---- traffic per axis (busiest rank), from the same closed forms the ledger uses
    traffic = [t for t, _ in traffic_dp + clip]
    if tp > 1:
        layers_busy = sum(sizes[i] for i in rank_chunks[r_busy])
        recomputed = layers_busy if ckpt_mode == "full" else (
            _checkpointed(plan, layers_busy)[0] if ckpt_mode == "selective" else 0)
        traffic += tp_traffic(b, s, model.hidden, layers_busy, tp, dtype, sp=plan.sp,
                              microbatches=m * steps, recomputed_layers=recomputed)
    if pp > 1:
        traffic += pp_traffic(b, s, model.hidden, pp, dtype, microbatches=m * steps,
                              virtual_stages=v, tp=tp, sp=plan.sp)

    est.traffic = traffic
    est.comm_bytes_per_step = by_axis(traffic)
    est.memory_bytes_per_device = mem_best
    est.memory_breakdown = breakdown
    est.step_time_s = step
    est.tokens_per_s = B * s / step
    model_flops = model.model_flops(B * s, s)
    hw_flops = model.model_flops(B * s, s, recompute_layers=replay * L)
    est.tflops_per_device = model_flops / step / world / 1e12
    est.tflops_per_device_hw = hw_flops / step / world / 1e12
    est.mfu = model_flops / step / world / (peak * share)
    est.bubble_fraction = bubble
    est.time_breakdown = {"pipeline": pipe, "compute_per_microbatch": t_max,
                          "tp_comm_per_block": tp_block,
                          "tp_comm": tp_block_comm * rank_layers[r_busy] * m * steps,
                          "dp_grad_exposed": exposed_grad,
                          "dp_grad_total": grad_time, "param_gather": gather_time,
                          "zero3_gather_exposed": exposed_ag3, "optimizer": opt_time,
                          "per_tensor": tensor_time, "clip_norm": clip_time}
    if zero == 1 and S > 1:
        est.notes.append("zero=1 memory follows plait's runtime (DDP + ZeroRedundancyOptimizer): "
                         "fp32 parameters and gradients on every rank, only AdamW state sharded")
    if zero == 3 and S > 1 and c.overlap:
        est.notes.append("zero=3 assumes full overlap: parameter all-gathers are prefetched "
                         "under compute, exposed only for the first unit and where a "
                         "microbatch's gathers outlast its compute")
    if mem_best > cluster.memory_bytes:
        est.reason = (f"needs {mem_best / 2**30:.1f} GiB per device (of which activations "
                      f"{breakdown['activations'] / 2**30:.1f} GiB), has "
                      f"{cluster.memory_bytes / 2**30:.1f} GiB")
        return est
    est.feasible = True
    return est
