"""Time of one microbatch through one block, the embedding and the head, on one device.

Compute is FLOPs / (peak FLOP/s of the compute dtype x ``compute_efficiency``); backward is 2x
forward; checkpointing replays the forward of the blocks it drops. Tensor parallelism divides
the FLOPs by tp and adds its collectives, which sit on the critical path (each block's output
is needed by the next): priced per block with :mod:`plait.planner.traffic`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.comm.predict import (
    casts_params,
    tp_block_traffic,
    tp_end_traffic,
    tp_stack_traffic,
)
from plait.comm.volumes import Traffic
from plait.plan import ZERO_BUBBLE_SCHEDULES, Plan

from .hardware import Cluster
from .model_stats import ModelStats
from .traffic import act_dtype_bytes, collective_time

if TYPE_CHECKING:
    from .cost import Constants

@dataclass(frozen=True)
class MicroTimes:
    """Seconds for one microbatch of ``b`` sequences on one device of the layout."""

    rate: float          # achieved FLOP/s per device (peak x efficiency x core share)
    share: float         # fraction of a compute unit each device gets (CPU: cores / processes)
    replay: float        # blocks' forwards replayed by checkpointing, per block
    block: float         # one block, forward + backward, its TP collectives and overheads
    tp_comm: float       # of which TP collectives
    cp_comm: float       # of which context parallelism's K/V all-gathers and reduce-scatters
    embed: float         # outside the blocks on the first chunk (a stem, TP embedding collectives)
    head: float          # outside the blocks on the last chunk (head matmul, loss, overheads)
    zero_bubble: bool    # backward split into input- and weight-gradient passes


def core_share(cluster: Cluster) -> float:
    """Fraction of a compute unit each device process gets: 1 unless processes outnumber the
    cores they run on (CPU)."""
    on_node = min(cluster.world_size, cluster.devices_per_node)
    if cluster.compute_units is not None and on_node > cluster.compute_units:
        return cluster.compute_units / on_node
    return 1.0


def more_stacks_time(plan: Plan, model: ModelStats, cluster: Cluster, b: int, s: int,
                     stack_seqs: Mapping[str, int], rate: float, replay: float,
                     c: Constants) -> float:
    """Time of one microbatch in the model's further stacks of blocks (``model.more_stacks``),
    each on its own sequence (``stack_seqs`` by first block, default ``s``): its blocks'
    FLOPs (its own block's, per token of that sequence; forward, backward and what
    checkpointing replays) and their tensor-parallel collectives
    (:func:`plait.comm.predict.tp_stack_traffic`, on the tp tier). Under a pipeline, none:
    plait does not cut a model with several stacks into stages."""
    if plan.pp > 1 or not model.more_stacks:
        return 0.0
    total = 0.0
    for more in model.more_stacks:
        seq = stack_seqs.get(more.first, s) // plan.cp
        fwd = model.stack_block(more).block_flops_per_token(seq, side_seq=s) * b * seq / plan.tp
        total += more.n_layers * (fwd * (3 + replay) / rate + c.block_overhead_s
                                  * (1 + replay / 3))
        if plan.tp > 1 and more.tp_block is not None:
            total += sum(collective_time(t, cluster, 1, c) for t in tp_stack_traffic(
                plan, b, seq, model.hidden, more.tp_block, more.n_layers,
                embedded=more.embedded, side_seq=s, recomputed=min(replay, 1.0))
                ) / plan.grad_accum
            total += more.n_layers * c.tp_block_overhead_s
    return total


def replay_per_block(plan: Plan, model: ModelStats) -> float:
    """Forwards replayed per block and microbatch by activation checkpointing."""
    mode = plan.activation_checkpointing
    replay = {"full": 1.0, "op": 0.05}.get(mode, 0.0)
    if mode == "selective":
        replay = 1.0 / plan.checkpoint_every
    if replay and plan.pp > 1 and plan.pp_schedule in ZERO_BUBBLE_SCHEDULES and model.block_tensors:
        # Zero-bubble schedules split backward into an input-gradient pass and a weight-gradient
        # pass; torch.distributed.pipelining's stage_backward_weight calls autograd.grad once
        # per parameter group, and non-reentrant checkpointing recomputes the block's forward on
        # every call. Counted on plait's runtime (tiny, pp=2 ZB-V, full recomputation): 10
        # forwards replayed per block and microbatch on the middle rank = 1 (input pass) + 9
        # (its parameter tensors); 5.5 on the rank holding embedding and head.
        replay *= 1 + model.block_tensors
    return replay


def microbatch_times(plan: Plan, model: ModelStats, cluster: Cluster, b: int, s: int,
                     c: Constants, stack_seqs: Mapping[str, int] | None = None) -> MicroTimes:
    """Per-block and outside-block times of one microbatch of ``b`` sequences of ``s`` tokens.
    A model's further stacks of blocks (``model.more_stacks``: an encoder-decoder's other
    stack; without a pipeline) count in the outside-block time, each block priced as the main
    stack's on the stack's own sequence (``stack_seqs`` by first block, default ``s``) with its
    own tensor-parallel collectives (:func:`more_stacks_time`); the main stack's
    cross-attention reads the first further stack's sequence (:meth:`ModelStats.side_seq`).

    Under context parallelism each rank computes ``s / cp`` tokens of every sequence: their
    matmuls, and their queries against all ``s`` keys. The head-tail split
    (:mod:`plait.parallel.context`) gives every rank the same unmasked attention work, so each
    rank's share of a block is exactly 1/cp of it. The K/V all-gathers (forward, again per
    replayed block) and their gradients' reduce-scatters (backward) are issued inside
    attention and waited for there: on the critical path, like TP's."""
    tp, cp, dtype = plan.tp, plan.cp, plan.mixed_precision
    share = core_share(cluster)
    rate = cluster.peak(dtype) * c.compute_efficiency * share
    tokens = b * s / cp
    local_s = s // cp  # the tokens of each sequence TP's collectives move on this rank
    # the further stack's sequence the blocks' cross-attention reads (an encoder's source)
    side = model.side_seq(s, stack_seqs or {})
    fwd_block = model.block_flops_per_token(s, side) * tokens / tp
    replay = replay_per_block(plan, model)
    block = fwd_block * (3 + replay) / rate + c.block_overhead_s * (1 + replay / 3)
    zero_bubble = plan.pp > 1 and plan.pp_schedule in ZERO_BUBBLE_SCHEDULES
    if zero_bubble:
        block += c.zb_backward_factor * 2 * fwd_block / rate
    # TP collectives per block and microbatch, on the tp tier (tp innermost: stride 1).
    tp_comm = 0.0
    if tp > 1:
        recomputed = {"full": 1.0, "selective": 1.0 / plan.checkpoint_every}.get(
            plan.activation_checkpointing, 0.0)
        tp_comm = sum(collective_time(t, cluster, 1, c) for t in
                      tp_block_traffic(b, local_s, model.hidden, tp, dtype, plan.sp,
                                       recomputed, model.kv_whole(tp), model.tp_block,
                                       casts_params(plan), side_seq=side))
        block += tp_comm + c.tp_block_overhead_s
    cp_comm = 0.0
    if cp > 1 and model.attention:
        # per block and microbatch: K and V gathered (again in a replayed forward), their
        # gradients reduce-scattered, each call b x s x kv_dim elements gathered
        # (plait.comm.volumes.cp_traffic); the cp group's ranks are tp apart in mesh order
        size = float(b) * s * model.kv_dim(tp) * act_dtype_bytes(dtype)
        one = {op: collective_time(Traffic("cp", op, size, 1, cp), cluster, tp, c)
               for op in ("all_gather", "reduce_scatter")}
        cp_comm = 2 * (1 + replay) * one["all_gather"] + 2 * one["reduce_scatter"]
        block += cp_comm
    # what runs outside the blocks: a stem before them on the first chunk, the rest (the head,
    # a pooled classifier) on the last; each tp rank runs a module the plan splits (a
    # vocabulary-parallel head) 1/tp, the rest (a patchify stem, a projection) whole
    # (a preset's head by the formula, vocabulary-parallel in its plan: 1/tp)
    before, after = model.outside_flops_per_rank(s, tp)
    stem = 3 * before * tokens / rate
    head = 3 * after * tokens / rate + c.micro_overhead_s
    head += more_stacks_time(plan, model, cluster, b, s, stack_seqs or {}, rate, replay, c)
    embed = stem
    if tp > 1:
        split = plan.pp * plan.virtual_stages > 1  # embedding and head on different chunks
        embed += sum(collective_time(t, cluster, 1, c) for t in tp_end_traffic(
            b, local_s, model.hidden, tp, dtype, plan.sp, embed=True, head=not split))
        head += c.tp_micro_overhead_s
        if split:
            head += sum(collective_time(t, cluster, 1, c) for t in tp_end_traffic(
                b, local_s, model.hidden, tp, dtype, plan.sp, embed=False, head=True))
    return MicroTimes(rate, share, replay, block, tp_comm, cp_comm, embed, head, zero_bubble)
