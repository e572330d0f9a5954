"""The search: every sensible layout for a model on a cluster, ranked by predicted step time.

Enumerated: tp (divisors of the world and of the node size that divide heads and ffn, and divide
the kv-heads or are a multiple of them: the kv heads are then replicated), pp
(divisors of what is left, at most one block per chunk), the data-parallel rest as DDP, ZeRO-1/2/3
over all of it, or HSDP (ZeRO-3 inside a node, replicated across); microbatch size (divisors of
the per-rank batch, up to 16); for pp > 1 the schedules 1F1B, interleaved 1F1B (v = 2, 4),
interleaved zero-bubble and ZB-V (v = 2); sequence parallelism; activation checkpointing;
context parallelism (cp: divisors of what tp leaves, where 2 x cp divides the sequence and
the model has attention), wherever ``Plan.validate`` accepts the layout with cp (what cp
composes with is read from the plan's own rule, never restated here).

Pruned, without losing a winner under the cost model:
  * layouts whose model state alone (parameters, gradients, optimizer at the ZeRO stage) does not
    fit are dropped before anything else is tried;
  * checkpointing only adds time, so per layout the modes are tried none -> selective -> full and
    the first that fits is kept;
  * GPipe and looped-BFS are never faster than 1F1B / interleaved at the same v and hold more
    activations, and interleaved zero-bubble is priced like ZB-V with more memory; sequence
    parallelism moves the same bytes as plain TP with less memory. So the search skips the
    dominated ones (GPipe, looped BFS, interleaved ZB, TP without SP); ``--plan`` evaluates them.

Pipeline stages are balanced by the DP partition in :func:`plait.partition.balanced_partition`;
the plan carries the blocks per stage as ``options.pp_stage_layers``, which the runtime's split
honours.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import groupby

from plait.plan import Plan, PlanOptions

from .cost import DEFAULT_CONSTANTS, Constants, Estimate, Workload, evaluate
from .hardware import Cluster
from .memo import Memo
from .model_stats import ModelStats

AC_ORDER = ("none", "selective", "full")
# The fewest tokens of a sequence the search gives a context-parallel rank. Each cp rank
# receives the whole sequence's keys and values per attention block while its compute shrinks
# with cp, so thinner slices only add traffic; they are left out of the search to keep it fast
# (a 1,024-device search would otherwise price ~3.7x the layouts). An explicit plan with fewer
# tokens per rank is still accepted and priced (``plait plan --plan``).
MIN_CP_TOKENS = 1024


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass
class SearchResult:
    """Ranked feasible estimates (best first) and what the search saw."""

    ranked: list[Estimate]
    evaluated: int
    seconds: float
    rejected: dict[str, int] = field(default_factory=dict)   # reason kind -> count
    closest: Estimate | None = None     # the infeasible plan that came nearest to fitting
    fit: int = 0                        # layouts the cost model fits in memory (before the cut
                                        # to ``top`` and before asking the model)
    # Without context parallelism: the fastest layout that fits, else the infeasible one that
    # came nearest to fitting (what ``plait plan`` says a cp winner is chosen over)
    best_without_cp: Estimate | None = None
    closest_without_cp: Estimate | None = None

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def _state_bytes(model: ModelStats, tp: int, pp: int, shard: int, zero: int, dtype: str) -> float:
    """Lower bound on model-state bytes per device (even blocks, embedding share ignored);
    ``shard``: the ranks ZeRO shards over (dp_shard, times cp under context parallelism)."""
    p = model.n_layers * model.block_params / (tp * pp)
    s = shard
    total = 4 * p / (s if zero >= 2 else 1) + 4 * p / (s if zero >= 2 else 1) + \
        8 * p / (s if zero >= 1 else 1)
    if zero == 2:
        total += p * (2 if dtype in ("bf16", "fp16") else 4)
    elif dtype in ("bf16", "fp16") and zero < 2:
        total += 2 * p
    return total


def _dp_splits(dp: int, tp: int, cluster: Cluster, cp: int = 1) -> list[tuple[int, int, int]]:
    """(dp_replicate, dp_shard, zero) choices for a data-parallel degree ``dp``; HSDP shards
    inside a node (dp_shard x cp x tp ranks, cp between dp_shard and tp in mesh order).
    Under context parallelism ZeRO shards over dp_shard x cp, so it has ranks to shard over
    at dp_shard=1 too (FSDP2 or ZeroRedundancyOptimizer over the cp ranks alone)."""
    out = [(dp, 1, 0)]
    if dp > 1 or cp > 1:
        out += [(1, dp, z) for z in (1, 2, 3) if z > 1 or tp == 1]  # see Plan.validate
        inner = max((d for d in divisors(dp) if d * cp * tp <= cluster.devices_per_node
                     and cluster.devices_per_node % (d * cp * tp) == 0), default=1)
        if 1 < inner < dp:
            out.append((dp // inner, inner, 3))
    return out


def _refused(layout: dict) -> str | None:
    """Why ``Plan.validate`` refuses the degrees of ``layout`` (None: it accepts them), as the
    search's rejection kind: what context parallelism composes with is the plan's rule."""
    try:
        Plan(**layout)
    except ValueError as exc:
        return _refusal_kind(exc)
    return None


def _refusal_kind(exc: ValueError) -> str:
    """``Plan.validate``'s first reason, without the degrees: one rejection kind per rule."""
    first = str(exc).removeprefix("invalid plan: ").split(":")[0]
    return "plan does not compose: " + re.sub(r"=\d+", "", first)


# The rejection kind of a pipeline for a model with BatchNorm (ModelStats.batchnorm).
_BATCHNORM_PIECES = ("BatchNorm normalises each pipeline microbatch on its own, not the step's "
                     "batch")


def candidate_plans(model: ModelStats, cluster: Cluster, work: Workload, *,
                    dtype: str = "bf16", max_microbatch: int = 16, plain_tp: bool = False):
    """Yield (plan, balance) groups: each inner list is tried in checkpointing order. With
    ``plain_tp``, TP without SP too (for a model whose blocks may refuse SP)."""
    world = cluster.world_size
    B = work.global_batch
    for tp in divisors(world):
        if tp > cluster.devices_per_node:
            break
        if cluster.devices_per_node % tp and tp < world:
            continue  # a tp group would straddle two nodes
        if model.tp_refuses(tp):
            continue
        degrees = [(c, p) for c in _cp_degrees(model, work, world // tp)
                   for p in divisors(world // (tp * c))]
        for cp, pp in degrees:
            if pp > model.n_layers:
                continue
            if pp > 1 and model.batchnorm:
                yield _BATCHNORM_PIECES
                continue
            dp = world // (tp * cp * pp)
            if B % dp:
                continue
            per_rank = B // dp
            for R, S, zero in _dp_splits(dp, tp, cluster, cp):
                probe = dict(tp=tp, cp=cp, pp=pp, dp_replicate=R, dp_shard=S, zero=zero,
                             mixed_precision=dtype, microbatches=pp)
                why = _refused(probe) if cp > 1 else None
                if why is not None:
                    yield why  # counted as refused
                    continue
                shards = S * cp if zero >= 1 else S  # ZeRO-1's optimizer too
                if _state_bytes(model, tp, pp, shards, zero, dtype) + cluster.reserve_bytes > \
                        cluster.memory_bytes:
                    yield None  # counted as pruned
                    continue
                for b in divisors(per_rank):
                    if b > max_microbatch and not model.batchnorm:
                        break
                    n = per_rank // b
                    if n > 1 and model.batchnorm:
                        continue  # accumulation: BatchNorm would see the batch in pieces
                    base = dict(tp=tp, pp=pp, dp_replicate=R, dp_shard=S, zero=zero,
                                mixed_precision=dtype)
                    if model.batchnorm and R * S > 1:
                        base["sync_bn"] = True  # statistics over the global batch
                    if cp > 1:
                        base["cp"] = cp
                    if pp == 1:
                        layouts = [dict(base, grad_accum=n)]
                    else:
                        if n < pp:
                            continue
                        layouts = [dict(base, microbatches=n, pp_schedule="1f1b")]
                        for v in (2, 4):
                            if pp * v <= model.n_layers and n % pp == 0:
                                layouts.append(dict(base, microbatches=n, virtual_stages=v,
                                                    pp_schedule="interleaved_1f1b"))
                        # With data replicas the gradient reduction follows the weight
                        # passes that end the schedule, exposed (priced in cost.evaluate).
                        if 2 * pp <= model.n_layers:
                            layouts.append(dict(base, microbatches=n, virtual_stages=2,
                                                pp_schedule="zbv"))
                    for layout in layouts:
                        sp_ok = tp > 1 and (work.seq // cp) % tp == 0
                        for sp in (True, False) if sp_ok and plain_tp else (sp_ok,):
                            yield [dict(layout, sp=sp, activation_checkpointing=ac)
                                   for ac in AC_ORDER]


def cp_searched(model: ModelStats, work: Workload, cp: int) -> bool:
    """Whether the search tries context-parallel degree ``cp``: 1 always; above it, for a model
    whose blocks have attention (without it a sequence needs no splitting: data parallelism
    does it), where 2 x cp equal chunks split every sequence (plait.parallel.context) and each
    rank keeps at least ``MIN_CP_TOKENS`` tokens."""
    return cp == 1 or (model.attention and work.seq % (2 * cp) == 0
                       and work.seq // cp >= MIN_CP_TOKENS)


def _cp_degrees(model: ModelStats, work: Workload, devices: int) -> list[int]:
    """Context-parallel degrees to try on ``devices`` (:func:`cp_searched`)."""
    return [cp for cp in divisors(devices) if cp_searched(model, work, cp)]


def _sort_key(e: Estimate) -> tuple[float, int, int]:
    """Fastest first; at the same predicted time, fewer accumulation micro-steps (they exist to
    fit memory, and each costs a launch the model may not price), then less memory; then the
    plan's string (:func:`_ranked`)."""
    return (round(e.step_time_s, 12), e.plan.grad_accum, round(e.memory_bytes_per_device))


def _ranked(estimates: list[Estimate]) -> list[Estimate]:
    """``estimates`` by :func:`_sort_key`, then by plan string: each plan's string is written
    only where the rest of its key ties with another's (a few of thousands)."""
    keyed = sorted(((_sort_key(e), e) for e in estimates), key=lambda pair: pair[0])
    out: list[Estimate] = []
    for _, tied in groupby(keyed, key=lambda pair: pair[0]):
        group = [e for _, e in tied]
        if len(group) > 1:
            group.sort(key=lambda e: e.plan.to_string())
        out += group
    return out


def search(model: ModelStats, cluster: Cluster, work: Workload, *, dtype: str = "bf16",
           top: int = 10, constants: Constants = DEFAULT_CONSTANTS,
           max_microbatch: int = 16,
           layout_check: Callable[[Plan], str | None] | None = None) -> SearchResult:
    """Rank every candidate layout; deterministic (ties broken by fewer accumulation steps,
    then memory, then plan string).

    ``layout_check(plan)`` says why the model itself refuses a layout the cost model cannot
    see (its blocks do not allow sequence parallelism, its layer plan does not fit tp), or
    None: the ranking then skips what it refuses, asking only about layouts that would rank
    in the ``top``, in order (the check may run the model)."""
    cluster.peak(dtype)  # a dtype the chip cannot compute in is refused before any layout
    start = time.perf_counter()
    feasible: list[Estimate] = []
    rejected: dict[str, int] = {}
    closest: Estimate | None = None
    closest_flat: Estimate | None = None  # without context parallelism
    evaluated = 0
    memo = Memo()  # what the layouts of this model share, priced once
    # each plan's options: none set while it is priced, then the split priced (one object
    # per split: a plan is immutable, and its options with it)
    options: dict[tuple[int, ...] | None, PlanOptions] = {None: PlanOptions()}
    for group in candidate_plans(model, cluster, work, dtype=dtype,
                                 max_microbatch=max_microbatch,
                                 plain_tp=layout_check is not None):
        if group is None or isinstance(group, str):
            kind = group or "model state does not fit"
            rejected[kind] = rejected.get(kind, 0) + 1
            continue
        for fields in group:
            try:
                plan = Plan(**fields, options=options[None])
            except ValueError as exc:  # a rule of Plan.validate beyond the degrees (cp's)
                why = _refusal_kind(exc)
                rejected[why] = rejected.get(why, 0) + 1
                break
            est = evaluate(plan, model, cluster, work, constants, balance=True, memo=memo,
                           time_unfit=False)
            evaluated += 1
            if est.feasible:
                feasible.append(_with_stages(est, options))
                break
            kind = "out of memory" if "GiB" in est.reason else est.reason.split(" ")[0]
            rejected[kind] = rejected.get(kind, 0) + 1
            if est.memory_bytes_per_device:
                closest = _nearer(closest, est)
                if plan.cp == 1:
                    closest_flat = _nearer(closest_flat, est)
    # The nearest misses were priced for memory alone: their time too, for the caller
    closest, closest_flat = (None if e is None else
                             evaluate(e.plan, model, cluster, work, constants, balance=True,
                                      memo=memo) for e in (closest, closest_flat))
    feasible = _ranked(feasible)
    fit = len(feasible)
    flat = next((e for e in feasible if e.plan.cp == 1), None)
    if layout_check is not None:
        feasible = _accepted(feasible, layout_check, top, rejected)
    return SearchResult(ranked=feasible[:max(top, 1)] if top else feasible, evaluated=evaluated,
                        seconds=time.perf_counter() - start, rejected=rejected, closest=closest,
                        fit=fit, best_without_cp=flat, closest_without_cp=closest_flat)


def _nearer(closest: Estimate | None, est: Estimate) -> Estimate:
    """The one of two infeasible estimates that needs less memory."""
    if closest is None or est.memory_bytes_per_device < closest.memory_bytes_per_device:
        return est
    return closest


def _accepted(ranked: list[Estimate], check: Callable[[Plan], str | None], top: int,
              rejected: dict[str, int]) -> list[Estimate]:
    """``ranked`` without what ``check`` refuses, down to ``top`` kept (0: all)."""
    kept: list[Estimate] = []
    for est in ranked:
        if top and len(kept) >= top:
            break
        why = check(est.plan)
        if why is None:
            kept.append(est)
        else:
            key = f"refused by the model ({why})"
            rejected[key] = rejected.get(key, 0) + 1
    return kept


def _with_stages(est: Estimate, options: dict[tuple[int, ...] | None, PlanOptions]
                 ) -> Estimate:
    """Record the pipeline split in the plan so the runtime builds what was priced (the plan
    sets no options; ``options``: the search's, by split)."""
    plan = est.plan
    chunks = plan.pp * plan.virtual_stages
    if chunks > 1 and est.stage_layers:
        # Always written, even when even: the runtime's default split balances parameter
        # counts (embedding and head included), which is not the split the planner priced.
        split = tuple(est.stage_layers)
        if split not in options:
            options[split] = PlanOptions(pp_stage_layers=split)
        est.plan = plan.with_options(options[split])
    return est
