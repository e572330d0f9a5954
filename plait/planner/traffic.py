"""Which collectives one step issues, and how long each takes on the cluster's links.

The bytes come from :mod:`plait.comm.volumes` (the closed forms the ledger also uses) and follow
what plait's runtime issues (:mod:`plait.comm.predict`, whose per-block TP traffic the planner
prices directly: ``tp_block_traffic``, ``tp_end_traffic``); the time of a collective is
``calls x (latency x ring steps + per-call cost) + wire bytes / (bandwidth x link efficiency)``
on the tier its group lives on. Mesh order is (pp, dp_replicate, dp_shard, cp, tp), tp
innermost, so a group of size n and stride d stays inside a node iff n*d divides the node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.comm.volumes import Traffic
from plait.plan import Plan

from .hardware import Cluster
from .model_stats import ModelStats

if TYPE_CHECKING:
    from .cost import Constants


def act_dtype_bytes(dtype: str) -> int:
    return 2 if dtype == "bf16" else 4


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


# ------------------------------------------------------------------------ data parallelism
@dataclass(frozen=True)
class RankShare:
    """What one pipeline rank holds (TP-local): parameters, of which its root's (embedding /
    head), its FSDP units (blocks + the root unit) and its parameter tensors."""

    params: float
    root: float
    units: int
    tensors: int


def rank_shares(plan: Plan, model: ModelStats, sizes: list[int],
                rank_chunks: list[range]) -> list[RankShare]:
    """Every pipeline rank's share of the model, for its optimizer state and its DP traffic."""
    tp, pp, chunks = plan.tp, plan.pp, len(sizes)
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    weights = model.layer_weights or (1.0,) * model.n_layers
    block_params = [w * model.block_params for w in weights] if model.layer_weights else \
        [float(model.block_params)] * model.n_layers
    out = []
    for ids in rank_chunks:
        p = sum(sum(block_params[bounds[i]:bounds[i + 1]]) for i in ids)
        first, last = 0 in ids, chunks - 1 in ids
        if first:
            p += model.embed_params
        if last:
            p += model.head_params if not (model.tied and pp == 1) else \
                model.head_params - model.embed_params
        root = ((model.embed_params if first else 0) + (model.head_params if last else 0)) / tp
        layers = sum(sizes[i] for i in ids)
        tensors = (layers * model.block_tensors + (model.embed_tensors if first else 0) +
                   (model.head_tensors if last else 0))
        out.append(RankShare(p / tp, root, layers + 1, tensors))
    return out


def uses_fsdp(plan: Plan) -> bool:
    """FSDP2 wraps every block and the stage root: ZeRO-2/3, and replicated DP over TP shards
    (plait's runtime replicates DTensor parameters through FSDP2 too)."""
    return plan.zero >= 2 or (plan.zero == 0 and plan.tp > 1 and plan.dp_replicate > 1)


def dp_traffic(plan: Plan, share: RankShare, *, grad_dtype: str, bucket_bytes: float
               ) -> list[tuple[Traffic, int]]:
    """One pipeline rank's data-parallel traffic per optimizer step, as plait's runtime issues
    it (see plait.comm.predict), with each op's rank stride in mesh order."""
    S, R, zero, tp, pp = plan.dp_shard, plan.dp_replicate, plan.zero, plan.tp, plan.pp
    steps, m = plan.grad_accum, (plan.microbatches if pp > 1 else 1)
    gbytes, pbytes = act_dtype_bytes(grad_dtype), act_dtype_bytes(plan.mixed_precision)
    P, root, units = share.params, share.root, share.units
    # A pipeline syncs gradients at the last backward of each schedule run (once per
    # accumulation step); without one, once per optimizer step (no_sync while accumulating).
    syncs = steps if pp > 1 else 1
    out: list[tuple[Traffic, int]] = []

    def grads(axis: str, op: str, payload: float, calls: int, group: int, stride: int) -> None:
        if group > 1:
            out.append((Traffic(axis, op, payload * syncs, calls * syncs, group, "grads"),
                        stride))

    buckets = max(1, math.ceil(P * gbytes / bucket_bytes))
    if zero == 0 and R > 1:
        grads("dp_replicate", "all_reduce", P * gbytes, units if uses_fsdp(plan) else buckets,
              R, tp * S)
    elif zero == 1:
        # DDP over every data rank, then ZeroRedundancyOptimizer broadcasts each parameter
        # tensor from the rank that updated it.
        grads("dp", "all_reduce", P * gbytes, buckets, R * S, tp)
        if S > 1:
            out.append((Traffic("dp_shard", "broadcast", P * 4, max(1, share.tensors), S,
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


def fsdp_host_time(plan: Plan, share: RankShare, c: Constants) -> tuple[float, float]:
    """FSDP2's per-unit costs beyond the collectives on one pipeline rank, per optimizer step:
    (its gradient reduces, its ZeRO-3 backward re-gathers)."""
    if not (plan.zero >= 2 and plan.dp_shard > 1):
        return 0.0, 0.0
    pp, steps = plan.pp, plan.grad_accum
    syncs = steps if pp > 1 else 1
    reduce = c.fsdp_reduce_s * share.units * syncs
    # ZeRO-3 gathers each block once more per backward than ZeRO-2 (the root never)
    per_block = (plan.microbatches if pp > 1 else 1) * steps if plan.zero == 3 else 0
    return reduce, c.fsdp_regather_s * (share.units - 1) * per_block


def clip_traffic(plan: Plan) -> list[tuple[Traffic, int]]:
    """Gradient clipping across pipeline stages: each stage holds only its own gradients, so
    plait's runtime all-reduces the squared norm (one fp32) over pp before every optimizer step
    (plait.train.clip_grad_norm): a blocking call every stage waits in. (The per-tensor norms
    of DTensor gradients are inside the measured ``dtensor_step_s``.)"""
    if not (plan.grad_clip and plan.pp > 1):
        return []
    return [(Traffic("pp", "all_reduce", 4.0, 1, plan.pp, "clip: squared norm"),
             plan.tp * plan.dp_shard * plan.dp_replicate)]


def fsdp_exposed(plan: Plan, cluster: Cluster, share: RankShare, layers: int,
                 fwd_unit: float, bwd_unit: float, *, grad_dtype: str,
                 c: Constants) -> float:
    """Seconds of FSDP2's gathers and reduce-scatters (ZeRO-2/3) the step waits for on one rank
    without a pipeline, unit by unit, as FSDP2 runs them with prefetch depth 1.

    Each block is a unit. Forward: the gather of block i+1 runs under block i's forward, so a
    block waits for ``max(0, gather - forward)``; the root's gather and the first block's are
    never hidden. ZeRO-2 gathers once per micro-step (forward); ZeRO-3 again in backward.
    Backward: the next block's re-gather (ZeRO-3) and this block's reduce-scatter share the
    same links (the inter-node NIC once dp_shard spans nodes) and run under this block's
    backward: it waits for ``max(0, gather + reduce-scatter - backward)``, the reduce-scatter
    only on the micro-step that syncs gradients, and the last one is never hidden. Overlap is
    thus capped by the compute of each unit, on the dp_shard group's tier (inter-node bandwidth
    per GPU when the group spans nodes), with the ring's latency per call."""
    S, tp = plan.dp_shard, plan.tp
    steps = plan.grad_accum
    pbytes, gbytes = act_dtype_bytes(plan.mixed_precision), act_dtype_bytes(grad_dtype)
    block = (share.params - share.root) / max(layers, 1)
    gather = collective_time(Traffic("dp_shard", "all_gather", block * pbytes, 1, S), cluster,
                             tp, c)
    scatter = collective_time(Traffic("dp_shard", "reduce_scatter", block * gbytes, 1, S),
                              cluster, tp, c)
    root = collective_time(Traffic("dp_shard", "all_gather", share.root * pbytes, 1, S),
                           cluster, tp, c)
    hidden = max(layers - 1, 0)
    regather = gather if plan.zero == 3 else 0.0
    fwd = root + gather + max(0.0, gather - fwd_unit) * hidden
    bwd_nosync = max(0.0, regather - bwd_unit) * hidden
    bwd_sync = max(0.0, regather + scatter - bwd_unit) * hidden + scatter
    return fwd * steps + bwd_nosync * (steps - 1) + bwd_sync
