"""Which collectives one step issues, and how long each takes on the cluster's links.

The collectives are the comm ledger's prediction of what plait's runtime issues
(:mod:`plait.comm.predict`: data parallelism, TP, pipeline sends and clipping, on each pipeline
rank's share of the model as a ``LocalModel``); the time of a collective is
``calls x (latency x ring steps + per-call cost) + wire bytes / (bandwidth x link efficiency)``
on the tier its group lives on. Mesh order is (pp, dp_replicate, dp_shard, cp, tp), tp
innermost, so a group of size n and stride d stays inside a node iff n*d divides the node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

from plait.comm import predict
from plait.comm.predict import LocalModel, clip_axes
from plait.comm.volumes import Traffic
from plait.mesh import DP_CP, DP_SHARD_CP, DP_SHARD_CP_TP, DP_SHARD_TP
from plait.plan import Plan

from .fsdp_rows import Padding, ParamRows, Rows, Trained, copy_padding, padding, trained
from .hardware import Cluster
from .model_stats import ModelStats

if TYPE_CHECKING:
    from .cost import Constants


def act_dtype_bytes(dtype: str) -> int:
    return 2 if dtype in ("bf16", "fp16") else 4


def tier(cluster: Cluster, size: int, stride: int) -> tuple[float, float]:
    """(bandwidth, latency) of a group of ``size`` ranks ``stride`` apart in mesh order.

    Inside a node only if the span ``size * stride`` divides the node: otherwise some groups
    straddle two nodes and the ring runs at the slower tier. Across nodes the bandwidth is
    the inter-node link of every rank the group holds in one node (``inter_bw`` is per
    device: one NIC per GPU on the presets), capped by the in-node link: NCCL's rings cross
    each node boundary once per channel and spread the channels over the node's NICs, so a
    group with k ranks in a node moves its inter-node bytes over k NICs at once while the
    in-node legs ride NVLink (nccl-tests' bus bandwidth across DGX nodes approaches the node's
    NIC total, not one NIC's). A group of one rank per node (a data-parallel axis outside
    tp = 8) keeps one NIC's bandwidth."""
    span = size * stride
    per_node = cluster.devices_per_node
    if span <= per_node and per_node % span == 0:
        return cluster.intra_bw, cluster.intra_latency
    k = per_node // stride if stride < per_node and per_node % stride == 0 else 1
    return min(cluster.intra_bw, k * cluster.inter_bw), cluster.inter_latency


_FACTOR = {"all_gather": "all_gather_factor", "reduce_scatter": "reduce_scatter_factor",
           "broadcast": "broadcast_factor"}
_CALL = {"all_reduce": "all_reduce_call_s", "all_gather": "all_gather_call_s",
         "reduce_scatter": "reduce_scatter_call_s", "broadcast": "broadcast_call_s"}


def collective_time(t: Traffic, cluster: Cluster, stride: int, c: Constants) -> float:
    """``calls x (latency x ring steps + per-call cost) + wire / (bw x link_eff) x op factor``."""
    if t.group == 1 and t.op != "send_recv":
        return 0.0
    bw, alpha = tier(cluster, t.group, stride)
    n, op = t.group, t.op
    steps = 2 * (n - 1) if op == "all_reduce" else 1 if op == "send_recv" else n - 1
    extra = getattr(c, _CALL[t.op]) if t.op in _CALL else 0.0
    per_call = max(0.0, steps * alpha + extra)
    factor = getattr(c, _FACTOR[t.op]) if t.op in _FACTOR else 1.0
    return t.calls * per_call + t.wire / (bw * c.link_efficiency) * factor


# ------------------------------------------------------------------------ data parallelism
def axis_stride(plan: Plan, axis: str) -> int:
    """Rank stride of a mesh axis's groups in mesh order (pp, dp_replicate, dp_shard, cp, tp).
    The flattened views over cp (``dp_shard_cp``, ``dp_cp``) join neighbouring axes down to
    cp, so their ranks are tp apart, as cp's own."""
    tp, cp, S, R = plan.tp, plan.cp, plan.dp_shard, plan.dp_replicate
    return {"tp": 1, DP_SHARD_TP: 1, DP_SHARD_CP_TP: 1, "cp": tp, DP_SHARD_CP: tp, DP_CP: tp,
            "dp_shard": cp * tp, "dp": cp * tp,
            "dp_replicate": S * cp * tp, "pp": R * S * cp * tp}[axis]


def fsdp_shards(plan: Plan) -> int:
    """Ranks FSDP2 shards parameters, gradients and optimizer state over: dp_shard under
    ZeRO-2/3, times cp under context parallelism (the cp ranks hold the same parameters, so
    plait shards over dp_shard x cp); 1 otherwise."""
    return plan.dp_shard * plan.cp if plan.zero >= 2 else 1


def state_shards(plan: Plan) -> int:
    """Ranks AdamW's state is sharded over: FSDP2's (:func:`fsdp_shards`) under ZeRO-2/3, and
    under ZeRO-1 ZeroRedundancyOptimizer's, dp_shard x cp too (``plait.parallel.zero
    .shard_optimizer``); 1 without ZeRO."""
    return plan.dp_shard * plan.cp if plan.zero >= 1 else 1


def rank_shares(plan: Plan, model: ModelStats, sizes: list[int],
                rank_chunks: Sequence[Sequence[int]]) -> list[LocalModel]:
    """Every pipeline rank's share of the model (TP-local), for its optimizer state and its
    traffic, in the form the comm ledger's prediction takes (:class:`plait.comm.predict
    .LocalModel`). What trains is read block by block where the model's shapes were read
    (:func:`trained_share`): frozen parameters are gathered, never reduced."""
    split = StageSplit.of(plan, model, sizes, uneven_pieces(plan, model))
    memo: dict[int, Trained] = {}  # trained_share's, for every rank of this plan
    return [rank_share(plan, model, split, ids, memo) for ids in rank_chunks]


@dataclass(frozen=True)
class StageSplit:
    """What every pipeline rank's share of one plan reads besides its own chunks: the blocks
    per chunk and where each chunk starts, each block's parameters, the uneven pieces
    (:func:`uneven_pieces`) and a frozen tied weight's elements."""

    sizes: tuple[int, ...]
    bounds: tuple[int, ...]
    block_params: tuple[float, ...]
    pad: tuple[Padding, Padding, Padding, Padding] | None
    frozen_copy: float

    @classmethod
    def of(cls, plan: Plan, model: ModelStats, sizes: Sequence[int],
           pad: tuple[Padding, Padding, Padding, Padding] | None) -> StageSplit:
        """``sizes``: blocks per chunk; ``pad``: :func:`uneven_pieces` of the plan."""
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        weights = model.layer_weights or (1.0,) * model.n_layers
        block_params = [w * model.block_params for w in weights] if model.layer_weights \
            else [float(model.block_params)] * model.n_layers
        return cls(tuple(sizes), tuple(bounds), tuple(block_params),
                   pad,
                   float(sum(prod(shape) for shape in model.frozen_tied_shapes)))


def rank_share(plan: Plan, model: ModelStats, split: StageSplit, ids: Sequence[int],
               memo: dict[int, Trained] | None = None) -> LocalModel:
    """The share of the pipeline rank running the chunks ``ids`` (:func:`rank_shares`);
    ``memo``: :func:`trained_share`'s, kept across the ranks of one plan (or of plans alike
    in tp and :func:`fsdp_shards`)."""
    tp, pp, sizes = plan.tp, plan.pp, split.sizes
    chunks, bounds, block_params = len(sizes), split.bounds, split.block_params
    pad, frozen_copy = split.pad, split.frozen_copy
    p = sum(sum(block_params[bounds[i]:bounds[i + 1]]) for i in ids)
    first, last = 0 in ids, chunks - 1 in ids
    if first:
        p += model.embed_params
    # a config's head_params hold the tied weight, which one stage holds once
    head_part = model.head_params if not (model.tied and pp == 1) else \
        model.head_params - model.embed_params
    if last:
        p += head_part
    root = ((model.embed_params if first else 0) + (head_part if last else 0)) / tp
    layers = sum(sizes[i] for i in ids)
    tensors = (layers * model.block_tensors + (model.embed_tensors if first else 0) +
               (model.head_tensors if last else 0))
    # k/v weights kept whole on every rank when there are fewer kv heads than tp
    kv = layers * model.kv_whole(tp) * (tp - 1)
    p += kv
    # a weight the embedding and the head share: a copy on each rank that holds one of them
    # alone (a module's head_params leave the copy out)
    tied = model.tied_params if first != last else 0
    copies = frozen = 0
    if last and not first and not model.tied:
        p += tied + frozen_copy
        # one more tensor to step and to broadcast (ZeRO-1), left out of the clip norm
        # (counted once, on the first stage); a frozen copy is stepped by nobody
        copies, frozen = len(model.tied_shapes), len(model.frozen_tied_shapes)
        tensors += copies + frozen
    held_copy = (tied + frozen_copy) / tp if last and not first else 0.0
    local, grads = p / tp, None
    grad_tensors = tensors - copies - frozen if copies or frozen else None
    if model.held is not None:  # what tensor parallelism keeps whole, what trains
        block, embed, head = model.held
        parts = [(block, layers)] + [(embed, 1)] * first + [(head, 1)] * last
        local = sum(h.local(tp) * k for h, k in parts) + kv / tp + held_copy
        # FSDP2's root unit: the embeddings and the head at their tp-local size, norms whole
        root = sum(h.local(tp) * k for h, k in parts[1:]) + held_copy
        grads = sum(h.grads(tp) * k for h, k in parts) + kv / tp + \
            (tied / tp if last and not first else 0.0)
        # the copy on the last stage is left out of the clip norm (counted once, on the first)
        grad_tensors = round(sum(h.trained_tensors * k for h, k in parts))
    if pad is not None:  # uneven tp pieces, FSDP2's padded rows: what each rank holds
        block_pad, embed_pad, rest_pad, copy_pad = pad
        ends = [(embed_pad, first), (rest_pad, last)]
        # the last stage's copy of a tied weight, frozen or not
        copy_all = copy_pad.all if copies or frozen else 0.0
        root += sum(e.all for e, on in ends if on) + copy_all
        local += layers * block_pad.all + sum(e.all for e, on in ends if on) + copy_all
        if grads is not None:
            grads += (layers * block_pad.trained + sum(e.trained for e, on in ends if on)
                      + (copy_pad.trained if copies else 0.0))
    grad_units = trained_layers = reached_layers = regathered_layers = None
    own = None  # each block's own tensor-parallel collectives, where they differ
    if model.tp_blocks is not None and len(model.tp_blocks) == model.n_layers:
        own = tuple(model.tp_blocks[j] for i in ids for j in range(bounds[i], bounds[i + 1]))
    if model.rows is not None and model.rows.blocks == model.n_layers:
        # a config's blocks are one tuple: their count will do
        blocks: Sequence[int] = range(layers) if model.rows.one_block else \
            [j for i in ids for j in range(bounds[i], bounds[i + 1])]
        reduced, grad_units = trained_share(plan, model, model.rows, blocks, first, last,
                                            bool(copies), memo)
        grads = reduced.elements + kv / tp
        grad_tensors = reduced.tensors
        # leading frozen blocks: no backward collectives, not all gathered again
        trained_layers, reached_layers, regathered_layers = (
            sum(c[bounds[i + 1]] - c[bounds[i]] for i in ids) for c in model.rows.counts)
    tied_elements = tied_piece(plan, model) if tied else 0.0
    tied_tensors = max(1, len(model.tied_shapes)) if tied else 0
    if pp > 1 and (model.shared_shapes or model.frozen_shared_shapes):
        extra = shared_share(plan, model, first=first, last=last)
        grads = (local if grads is None else grads) + extra.trained
        grad_tensors = (tensors if grad_tensors is None else grad_tensors) + extra.clip
        local += extra.held
        root += extra.held
        tensors += extra.tensors
        if grad_units is not None and extra.trained and not any(
                r.trained for r in (model.rows.embed if model.rows and first else ())):
            grad_units += 1  # a stage root with no other gradient reduces these
        tied_elements += extra.summed
        tied_tensors += len(model.shared_shapes)
    return LocalModel(params=local, root_params=root, tensors=tensors, layers=layers,
                      embed=first, head=last, stages=tuple(ids), num_stages=chunks,
                      clip_axes=clip_axes(plan),
                      tied=tied_elements,
                      tied_tensors=max(1, tied_tensors), grad_params=grads,
                      grad_tensors=grad_tensors, grad_units=grad_units,
                      trained_layers=trained_layers, reached_layers=reached_layers,
                      regathered_layers=regathered_layers, tp_blocks=own,
                      stage_layers=tuple(sizes[i] for i in ids))


@dataclass(frozen=True)
class Shared:
    """What the parameters every pipeline stage holds (``ModelStats.shared_shapes``: the root
    module's, a ``logit_scale``) add to one rank beyond its blocks, embeddings and head:
    elements held and their trainable ones (FSDP2's padded size under ZeRO-2/3; whole on every
    tp rank), parameter tensors held and gradient tensors in its clip norm, and the elements
    of their gradients it sums over the stages (its dp_shard piece)."""

    held: float = 0.0
    trained: float = 0.0
    tensors: int = 0
    clip: int = 0
    summed: float = 0.0


def shared_share(plan: Plan, model: ModelStats, *, first: bool, last: bool) -> Shared:
    """:class:`Shared` for a pipeline rank holding the first stage (``first``) and/or the last
    (``last``). The last stage counts them among the rest (``head_params``), so a rank without
    it holds a copy; each copy's gradient is summed over the stages like a tied weight's
    (``plait.parallel.pipeline`` ``sync_tied_gradients``), and the clip norm counts it on the
    first stage alone (the others are marked copies)."""
    shards = fsdp_shards(plan)
    trains = tuple(Rows(shape) for shape in model.shared_shapes)
    frozen = tuple(Rows(shape, None, False) for shape in model.frozen_shared_shapes)
    summed = float(sum(-(-r.shape[0] // shards) * prod(r.shape[1:]) if r.shape else 1
                       for r in trains))
    if last:  # held among the rest; a copy unless the rank holds the first stage too
        return Shared(clip=0 if first else -len(trains), summed=summed)
    return Shared(held=float(sum(r.held(1, shards) for r in trains + frozen)),
                  trained=float(sum(r.held(1, shards) for r in trains)),
                  tensors=len(trains) + len(frozen), clip=len(trains) if first else 0,
                  summed=summed)


def trained_share(plan: Plan, model: ModelStats, rows: ParamRows, blocks: Sequence[int],
                  first: bool, last: bool, copy: bool,
                  memo: dict[int, Trained] | None = None) -> tuple[Trained, int]:
    """What data parallelism reduces on a pipeline rank holding the blocks ``blocks`` (indices
    into the stack), the embeddings where ``first``, the rest where ``last`` and a trainable
    tied weight's copy where ``copy``, read off the model's shapes (``rows``: ``model.rows``,
    which say what trains): the gradients (elements, tensors; the copy is left out of the clip norm,
    counted once on the first stage) and how many FSDP2 units have one (FSDP2 reduce-scatters
    a unit's existing gradients, and nothing for a unit with none: a frozen block, a root with
    a frozen embedding). ``memo``: what each part of ``rows`` reduces, kept across the ranks
    of one plan (a block the stack holds several times, a config's, is read once)."""
    tp = plan.tp
    shards = fsdp_shards(plan)
    even = tp > 1 and model.held is None  # no layer plan: every tensor priced as split evenly
    memo = {} if memo is None else memo

    def of(part: tuple[Rows, ...]) -> Trained:
        if id(part) not in memo:
            memo[id(part)] = trained(part, tp, shards, even=even)
        return memo[id(part)]

    held: dict[int, tuple[Trained, int]] = {}
    if rows.one_block and blocks:
        held[id(rows.stack[0])] = (of(rows.stack[0]), len(blocks))
    for j in blocks if not rows.one_block else ():
        block = rows.stack[j]
        got, count = held.get(id(block)) or (of(block), 0)
        held[id(block)] = (got, count + 1)
    root = Trained()
    if first:
        root += of(rows.embed)
    if last:
        root += of(rows.rest)
    copies = trained(tuple(Rows(shape, 0) for shape in model.tied_shapes), tp, shards,
                     even=even) if copy and model.tied_shapes else Trained()
    elements = root.elements + copies.elements + sum(t.elements * n for t, n in held.values())
    tensors = root.tensors + sum(t.tensors * n for t, n in held.values())
    units = sum(n for t, n in held.values() if t.tensors) + \
        (1 if root.tensors or copies.tensors else 0)
    return Trained(elements, tensors), units


def uneven_pieces(plan: Plan, model: ModelStats
                  ) -> tuple[Padding, Padding, Padding, Padding] | None:
    """Elements each rank holds beyond the even split the planner's element counts assume, of
    one block, of the embeddings, of the rest and of a tied weight's copy on the last stage
    (:mod:`plait.planner.fsdp_rows`): a dim tensor parallelism splits unevenly is cut as
    ``torch.chunk`` cuts it (the first tp rank holds the most), and under ZeRO-2/3 FSDP2 pads
    that piece's dim 0 to a multiple of dp_shard. None where neither applies (tp=1 without
    FSDP2's sharding), the model's shapes were not read (a config: element counts), or tensor
    parallelism splits a model without a layer plan (every tensor priced as split evenly)."""
    shards = fsdp_shards(plan)
    if model.rows is None or (plan.tp == 1 and shards == 1):
        return None
    if plan.tp > 1 and model.held is None:
        return None
    block, embed, rest = padding(model.rows, plan.tp, shards)
    trained = copy_padding(model.tied_shapes, plan.tp, shards)
    return block, embed, rest, Padding(
        all=trained + copy_padding(model.frozen_tied_shapes, plan.tp, shards), trained=trained)


def tied_piece(plan: Plan, model: ModelStats) -> float:
    """Elements of the tied weights' gradients the busiest rank sums with the other stage's
    copies (``plait.parallel.pipeline`` sums each copy's local piece over the two stages): the
    tensor-parallel shard, and under FSDP2's ZeRO-2/3 its ``dp_shard`` shard of that. Both cut
    dim 0 (the vocabulary rows) as ``torch.chunk`` does, the first chunk the largest."""
    shards = fsdp_shards(plan)
    if not model.tied_shapes:  # shapes not read: an even split
        return model.tied_params / (plan.tp * shards)
    out = 0.0
    for rows, *rest in model.tied_shapes:
        local = -(-rows // plan.tp)
        out += -(-local // shards) * prod(rest)
    return out


def uses_fsdp(plan: Plan) -> bool:
    """FSDP2 wraps every block and the stage root: ZeRO-2/3, and replicated DP over TP shards
    (plait's runtime replicates DTensor parameters through FSDP2 too, over dp x cp under
    context parallelism)."""
    return plan.zero >= 2 or (plan.zero == 0 and plan.tp > 1
                              and plan.dp_replicate * plan.cp > 1)


def dp_traffic(plan: Plan, share: LocalModel, *, grad_dtype: str, bucket_bytes: float,
               gathers: bool = True) -> list[tuple[Traffic, int]]:
    """One pipeline rank's data-parallel traffic per optimizer step, exactly what the comm
    ledger predicts for it (:func:`plait.comm.predict.dp_traffic`; ``gathers=False``: without
    FSDP2's parameter gathers), with each op's rank stride in mesh order."""
    return [(t, axis_stride(plan, t.axis)) for t in
            predict.dp_traffic(plan, share, grad_dtype=grad_dtype, bucket_bytes=bucket_bytes,
                               gathers=gathers)]


def clip_traffic(plan: Plan, share: LocalModel) -> list[tuple[Traffic, int]]:
    """Gradient clipping's collectives on one pipeline rank (:func:`plait.comm.predict
    .clip_traffic`): the per-tensor norms over the axes DTensor gradients are sharded on, and
    with pipelines the squared norm over pp, a blocking call every stage waits in."""
    return [(t, axis_stride(plan, t.axis)) for t in predict.clip_traffic(plan, share)]


def fsdp_host_time(plan: Plan, share: LocalModel, c: Constants) -> tuple[float, float]:
    """FSDP2's per-unit costs beyond the collectives on one pipeline rank, per optimizer step:
    (its gradient reduces, its ZeRO-3 backward re-gathers)."""
    if fsdp_shards(plan) == 1:
        return 0.0, 0.0
    pp, steps = plan.pp, plan.grad_accum
    syncs = steps if pp > 1 else 1
    reduce = c.fsdp_reduce_s * share.reducing_units * syncs  # a frozen unit reduces nothing
    # ZeRO-3 gathers each block once more per backward than ZeRO-2 (the root never; a leading
    # frozen block only where the block after it is reached); in a pipeline once more after
    # each forward, but where torch's runtime evicts the stage right after it (four or more
    # stages per rank), when ZeRO-2 gathers it again too (plait.parallel.schedules)
    if plan.zero != 3:
        return reduce, 0.0
    if pp == 1:
        return reduce, c.fsdp_regather_s * share.layers_regathered * steps
    from ..parallel.schedules import stage_gathers

    every = stage_gathers(plan.pp_schedule, pp, plan.microbatches, plan.virtual_stages)
    m = plan.microbatches
    regathers = sum(layers * (every[s].block(m, 3) - every[s].block(m, 2))
                    for s, layers, _, _ in share.stage_parts())
    return reduce, c.fsdp_regather_s * regathers * steps


def fsdp_exposed(plan: Plan, cluster: Cluster, share: LocalModel, layers: int,
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
    S, tp = fsdp_shards(plan), plan.tp
    steps = plan.grad_accum
    pbytes, gbytes = act_dtype_bytes(plan.mixed_precision), act_dtype_bytes(grad_dtype)
    block = (share.params - share.root_params) / max(layers, 1)
    gather = collective_time(Traffic("dp_shard", "all_gather", block * pbytes, 1, S), cluster,
                             tp, c)
    scatter = collective_time(Traffic("dp_shard", "reduce_scatter", block * gbytes, 1, S),
                              cluster, tp, c)
    root = collective_time(Traffic("dp_shard", "all_gather", share.root_params * pbytes, 1, S),
                           cluster, tp, c)
    hidden = max(layers - 1, 0)
    regather = gather if plan.zero == 3 else 0.0
    fwd = root + gather + max(0.0, gather - fwd_unit) * hidden
    bwd_nosync = max(0.0, regather - bwd_unit) * hidden
    bwd_sync = max(0.0, regather + scatter - bwd_unit) * hidden + scatter
    return fwd * steps + bwd_nosync * (steps - 1) + bwd_sync
