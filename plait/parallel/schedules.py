"""Pipeline schedules as data: who computes what, when, and how much of the time is bubble.

A schedule is, for every pipeline rank, the *order* of its compute actions: ``F`` (forward of one
microbatch through one stage), ``B`` (full backward), or, for the zero-bubble schedules, ``I``
(backward to the stage input) and ``W`` (backward to the weights, deferred to fill bubbles).
Nothing here needs a process group or a device: the grid prints on a laptop.

Where the orders come from:

* multi-stage schedules (interleaved 1F1B, looped BFS, interleaved zero-bubble, ZB-V): from
  torch's own schedule classes, which compute ``pipeline_order`` for every rank in their
  constructor. They only read a few attributes of the stages, so we hand them lightweight stage
  descriptions — the printed order is exactly what the runtime executes.
* GPipe and 1F1B: torch runs these from hand-written loops (``_step_microbatches``); their
  ``pipeline_order`` attribute is informational only and, in torch 2.13, drops the idle slots
  and mislabels microbatches on later ranks. So the order is regenerated here from the same
  rules as those loops (GPipe: all forwards, then all backwards; 1F1B: ``min(m, p - rank)``
  warm-up forwards, then alternate one backward / one forward, then drain the backwards).

Time is then *simulated*: every rank runs its actions in order, each action starts when the rank
is free and its inputs exist (the previous stage's forward, the next stage's backward), and
communication is free. With unit cost per action this gives the printed step x rank grid; with
``F=1, B=2`` (``I=1, W=1``) it gives the bubble fraction the schedule would have on a perfectly
balanced pipeline, which ``bench/pipeline_bubble.py`` compares with what a run measures.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import Any, NamedTuple

from ..outputs import add_format
from ..plan import MULTI_STAGE_SCHEDULES, PP_SCHEDULES, rounds_error

# Relative cost of each action kind on a balanced pipeline: a backward costs two forwards (one
# matmul for the input gradient, one for the weight gradient); the zero-bubble split gives each
# half one unit.
DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
UNIT_COSTS = {"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0}


class Action(NamedTuple):
    """One compute action: ``kind`` in F/B/I/W, on global ``stage``, for ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def label(self, show_stage: bool) -> str:
        return f"{self.kind}{self.microbatch}" + (f"@{self.stage}" if show_stage else "")


@dataclass(frozen=True)
class Timed:
    rank: int
    action: Action
    start: float
    end: float


# ------------------------------------------------------------------------------ validation
# plait's schedule names (plait.plan.PP_SCHEDULES) -> torch.distributed.pipelining's, which
# get_schedule_class turns into the schedule class.
TORCH_SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
                        "looped_bfs": "LoopedBFS", "interleaved_zb": "InterleavedZeroBubble",
                        "zbv": "ZBVZeroBubble"}


def schedule_class(schedule: str) -> Any:
    """torch's schedule class for one of plait's schedule names."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    return get_schedule_class(TORCH_SCHEDULE_NAMES[schedule])


def check_schedule_args(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> None:
    """Raise ValueError naming the numbers and the fix when a schedule cannot run them."""
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of "
                         f"{', '.join(PP_SCHEDULES)}")
    for name, value in (("pp", pp), ("microbatches", microbatches),
                        ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    multi = schedule in MULTI_STAGE_SCHEDULES
    if multi and virtual_stages < 2:
        raise ValueError(f"schedule {schedule!r} runs several stages per rank: set "
                         f"virtual_stages >= 2 (got {virtual_stages})")
    if not multi and virtual_stages != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank: virtual_stages="
                         f"{virtual_stages} needs interleaved_1f1b, looped_bfs, interleaved_zb "
                         f"or zbv")
    if schedule == "zbv" and virtual_stages != 2:
        raise ValueError(f"schedule 'zbv' runs exactly 2 stages per rank (virtual_stages="
                         f"{virtual_stages}); use virtual_stages=2")
    if schedule != "gpipe" and microbatches < pp:
        raise ValueError(f"schedule {schedule!r} with pp={pp} needs at least {pp} microbatches "
                         f"(one per stage in flight), got microbatches={microbatches}; raise "
                         f"microbatches to >= {pp} or use schedule=gpipe")
    rounds = rounds_error(schedule, pp, microbatches)
    if rounds:
        raise ValueError(rounds)


# ------------------------------------------------------------------------------ placement
def stage_to_rank(schedule: str, pp: int, virtual_stages: int) -> list[int]:
    """Pipeline rank of every global stage: looped (``s % pp``), or V-shaped for ZB-V."""
    n = pp * virtual_stages
    if schedule != "zbv":
        return [s % pp for s in range(n)]
    # V: stages 0..pp-1 go down the ranks, pp..2pp-1 come back up (rank 0 holds first and last).
    return [s if s < pp else 2 * pp - 1 - s for s in range(n)]


def local_stages(schedule: str, pp: int, virtual_stages: int, rank: int) -> list[int]:
    return [s for s, r in enumerate(stage_to_rank(schedule, pp, virtual_stages)) if r == rank]


# ------------------------------------------------------------------------------ orders
def rank_orders(schedule: str, pp: int, microbatches: int,
                virtual_stages: int = 1) -> dict[int, list[Action]]:
    """Every rank's compute actions, in the order the torch runtime executes them."""
    check_schedule_args(schedule, pp, microbatches, virtual_stages)
    m = microbatches
    if schedule == "gpipe":
        return {r: [Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
                for r in range(pp)}
    if schedule == "1f1b":
        orders = {}
        for r in range(pp):
            warmup = min(m, pp - r)
            ops = [Action("F", r, i) for i in range(warmup)]
            fwd, bwd = warmup, 0
            while True:
                ops.append(Action("B", r, bwd))
                bwd += 1
                if fwd == m:
                    break
                ops.append(Action("F", r, fwd))
                fwd += 1
            ops.extend(Action("B", r, i) for i in range(bwd, m))
            orders[r] = ops
        return orders
    return _torch_orders(schedule, pp, m, virtual_stages)


@lru_cache(maxsize=16)
def _torch_schedule(schedule: str, pp: int, m: int, v: int) -> Any:
    """torch's schedule object for ``schedule``, built without stages or a process group (its
    orders only; a large one costs seconds to build, hence the cache)."""
    cls = schedule_class(schedule)
    # The schedule constructors compute pipeline_order for *all* ranks from rank 0's view; they
    # read only these attributes of the stages (no communication happens before step()).
    stages = [SimpleNamespace(group_size=pp, group_rank=0, num_stages=pp * v, stage_index=s,
                              submod=None, is_first=s == 0, is_last=s == pp * v - 1,
                              stage_index_to_group_rank=None)
              for s in local_stages(schedule, pp, v, 0)]
    return cls(stages, m)


def _torch_orders(schedule: str, pp: int, m: int, v: int) -> dict[int, list[Action]]:
    sched = _torch_schedule(schedule, pp, m, v)
    kinds = {"F": "F", "B": "B", "I": "I", "W": "W"}
    orders: dict[int, list[Action]] = {}
    for rank, actions in sched.pipeline_order.items():
        orders[rank] = [Action(kinds[a.computation_type.value], a.stage_index, a.microbatch_index)
                        for a in actions
                        if a is not None and a.computation_type.value in kinds]
    return orders


@dataclass(frozen=True)
class StageGathers:
    """How often FSDP2 all-gathers the units of one pipeline stage in one schedule step.

    ``unshards``: the times torch's runtime gathers the whole stage (its UNSHARD action: every
    unit, the root included); ``reshard_after_forward``: the stage's forwards whose next action
    on the stage is torch's RESHARD (the stage evicted to make room for others), after which
    no step of the stage gathers the block again: the UNSHARD that brings the stage back does.
    """

    unshards: int
    reshard_after_forward: int

    def block(self, microbatches: int, zero: int) -> int:
        """Gathers of one block. ZeRO-3 (FSDP2 reshards a block after each forward): one per
        UNSHARD, and one at the stage's next step after each forward, which FSDP2's
        pre-forward or pre-backward hook (or ``TimedStage`` before an input- or weight-gradient
        step) gathers for; ZeRO-2 keeps blocks gathered from UNSHARD to RESHARD."""
        if zero == 3:
            return self.unshards + microbatches - self.reshard_after_forward
        return self.unshards

    @property
    def root(self) -> int:
        """Gathers of the stage's root unit: FSDP2 keeps a root gathered from forward to
        backward, so once per UNSHARD."""
        return self.unshards


# torch's runtime prefetches the next this many distinct stages of a rank (its UNSHARD/RESHARD
# lowering, ``max_active_stages``): a rank holding at most this many never evicts one.
ACTIVE_STAGES = 3


@lru_cache(maxsize=1024)
def stage_gathers(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1
                  ) -> dict[int, StageGathers]:
    """FSDP2's gathers of every global stage in one schedule step, as torch's runtime orders
    them (:class:`StageGathers`).

    GPipe and 1F1B (torch's one-stage loops, no UNSHARD step) gather a stage once, at its first
    forward. The multi-stage schedules run torch's lowered order (``pipeline_order_with_comms``):
    UNSHARD every stage before its first action, RESHARD it when it leaves the next
    ``ACTIVE_STAGES`` distinct stages the rank will run, UNSHARD it again when it comes back. A
    rank holding at most ``ACTIVE_STAGES`` stages gathers each once per step; otherwise the
    counts are read off torch's order (interleaved 1F1B's off plait's own build of it,
    :func:`interleaved_1f1b_stages` and :func:`lowered_gathers`: the planner searches it and
    torch's takes seconds to build). They are the same every step: the order is fixed when the
    schedule is built, not by timing. Cached: the planner asks for the same schedule for
    every layout it prices; callers must not change the dict returned."""
    check_schedule_args(schedule, pp, microbatches, virtual_stages)
    n = pp * virtual_stages
    if schedule in ("gpipe", "1f1b") or virtual_stages <= ACTIVE_STAGES:
        return {s: StageGathers(1, 0) for s in range(n)}
    if schedule == "interleaved_1f1b":
        return _interleaved_gathers(pp, microbatches, virtual_stages)
    return _lowered_gathers(schedule, pp, microbatches, virtual_stages)


def interleaved_1f1b_stages(pp: int, m: int, v: int, rank: int) -> list[tuple[str, int]]:
    """The (kind, stage) of every compute action of ``rank`` under interleaved 1F1B, in torch's
    order (``ScheduleInterleaved1F1B.pipeline_order`` without its idle slots): microbatches
    in rounds of ``m // rounds`` (rounds = ``max(1, m // pp)``), each round through the rank's
    stages in turn; ``(v - 1)`` rounds' worth of forwards plus two per rank below the last as
    warm-up, then one forward and one backward (the stages in reverse) at a time, then the
    remaining backwards. Built here because the planner prices many of these schedules and
    torch builds one in seconds (it lowers every rank's communication too);
    ``tests/test_comm_ledger.py`` holds it to torch's order."""
    size = m // max(1, m // pp)
    ops = v * m
    warmup = min((v - 1) * size + 2 * (pp - 1 - rank), ops)

    def forward(k: int) -> tuple[str, int]:
        return "F", (k // size) % v * pp + rank

    def backward(k: int) -> tuple[str, int]:
        return "B", (v - 1 - (k - warmup) // size % v) * pp + rank

    out = [forward(k) for k in range(warmup)]
    for k in range(warmup, ops):
        out += [forward(k), backward(k)]
    return out + [backward(k) for k in range(ops, ops + warmup)]


def lowered_gathers(actions: list[tuple[str, int]], active: int = ACTIVE_STAGES
                    ) -> dict[int, StageGathers]:
    """UNSHARD and evictions of each stage of one rank running compute ``actions`` in order,
    by the policy torch's runtime lowers a multi-stage schedule with: before each action the
    next ``active`` distinct stages the rank will run are gathered (UNSHARD) and every other
    stage resharded (RESHARD)."""
    # the next `active` distinct stages from each position on, built from the end
    ahead: list[tuple[int, ...]] = [()] * len(actions)
    upcoming: tuple[int, ...] = ()
    for i in range(len(actions) - 1, -1, -1):
        stage = actions[i][1]
        upcoming = ((stage,) + tuple(s for s in upcoming if s != stage))[:active]
        ahead[i] = upcoming
    unshards: dict[int, int] = {s: 0 for _, s in actions}
    evicted = dict.fromkeys(unshards, 0)
    last: dict[int, str] = {}
    held: set[int] = set()
    for (kind, stage), wanted in zip(actions, ahead, strict=True):
        for s in held - set(wanted):
            evicted[s] += last.get(s) == "F"
            last[s] = "RESHARD"
        held &= set(wanted)
        for s in wanted:
            unshards[s] += s not in held
        held |= set(wanted)
        last[stage] = kind
    return {s: StageGathers(unshards[s], evicted[s]) for s in unshards}


@lru_cache(maxsize=256)
def _interleaved_gathers(pp: int, m: int, v: int) -> dict[int, StageGathers]:
    out: dict[int, StageGathers] = {}
    for rank in range(pp):
        out.update(lowered_gathers(interleaved_1f1b_stages(pp, m, v, rank)))
    return out


@lru_cache(maxsize=64)
def _lowered_gathers(schedule: str, pp: int, m: int, v: int) -> dict[int, StageGathers]:
    unshards = dict.fromkeys(range(pp * v), 0)
    evicted = dict.fromkeys(range(pp * v), 0)
    for actions in _torch_schedule(schedule, pp, m, v).pipeline_order_with_comms.values():
        last: dict[int, str] = {}
        for a in actions:
            kind, s = a.computation_type.value, a.stage_index
            if kind == "UNSHARD":
                unshards[s] += 1
            elif kind == "RESHARD":
                evicted[s] += last.get(s) == "F"
            if kind in ("F", "B", "I", "W", "RESHARD"):
                last[s] = kind
    return {s: StageGathers(unshards[s], evicted[s]) for s in unshards}


# ------------------------------------------------------------------------------ simulation
def simulate(orders: dict[int, list[Action]], num_stages: int,
             costs: dict[str, float] | Callable[[int, Action], float] | None = None
             ) -> list[Timed]:
    """Earliest start of every action given in-order execution per rank and data dependencies.

    F(s, i) needs F(s-1, i); B/I(s, i) needs F(s, i) and B/I(s+1, i); W(s, i) needs I(s, i).
    ``costs``: time per action kind, or a function ``(rank, action) -> time`` (e.g. measured
    durations, see ``plait.parallel.timeline.replay_bubble``). Raises ValueError if the orders
    deadlock (a rank waits for something never computed).
    """
    costs = costs or DEFAULT_COSTS
    done: dict[tuple[str, int, int], float] = {}
    free = {r: 0.0 for r in orders}
    pos = {r: 0 for r in orders}
    out: list[Timed] = []

    def deps(a: Action) -> list[tuple[str, int, int]]:
        if a.kind == "F":
            return [("F", a.stage - 1, a.microbatch)] if a.stage > 0 else []
        if a.kind in ("B", "I"):
            need = [("F", a.stage, a.microbatch)]
            if a.stage < num_stages - 1:
                need.append(("G", a.stage + 1, a.microbatch))  # input gradient of next stage
            return need
        return [("G", a.stage, a.microbatch)]  # W after I

    remaining = sum(len(o) for o in orders.values())
    while remaining:
        progressed = False
        for r, ops in orders.items():
            while pos[r] < len(ops):
                a = ops[pos[r]]
                need = deps(a)
                if any(k not in done for k in need):
                    break
                start = max([free[r]] + [done[k] for k in need])
                end = start + (costs(r, a) if callable(costs) else costs[a.kind])
                free[r] = end
                done[(a.kind, a.stage, a.microbatch)] = end
                if a.kind in ("B", "I"):
                    done[("G", a.stage, a.microbatch)] = end
                out.append(Timed(r, a, start, end))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(orders[r][pos[r]]) for r in orders if pos[r] < len(orders[r])}
            raise ValueError(f"schedule deadlocks: ranks wait on {stuck}")
    return out


def bubble_of(timed: list[Timed]) -> float:
    """Idle share of the step: mean over ranks of 1 - busy / (last end - first start)."""
    if not timed:
        return 0.0
    span = max(t.end for t in timed) - min(t.start for t in timed)
    ranks = {t.rank for t in timed}
    busy = sum(t.end - t.start for t in timed)
    return 1.0 - busy / (span * len(ranks))


def theoretical_bubble(schedule: str, pp: int, microbatches: int,
                       virtual_stages: int = 1) -> float:
    """Bubble fraction on a perfectly balanced pipeline with free communication.

    Closed forms: GPipe and 1F1B (p-1)/(m+p-1); interleaved 1F1B (p-1)/(v*m+p-1) (the bubble
    divided by v, Narayanan et al. 2021). Others (looped BFS, the zero-bubble schedules) come
    from the simulation with F=1, I=1, W=1 (B=2).
    """
    p, m, v = pp, microbatches, virtual_stages
    check_schedule_args(schedule, p, m, v)
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    return simulated_bubble(schedule, p, m, v)


def simulated_bubble(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1,
                     costs: dict[str, float] | None = None) -> float:
    orders = rank_orders(schedule, pp, microbatches, virtual_stages)
    return bubble_of(simulate(orders, pp * virtual_stages, costs))


# ------------------------------------------------------------------------------ memory
def peak_in_flight(schedule: str, pp: int, microbatches: int,
                   virtual_stages: int = 1) -> dict[int, int]:
    """Per rank, the most microbatch-stages whose activations are alive at once.

    An activation is held from a stage's forward until its backward (``B``, or ``W`` for the
    zero-bubble split, which still needs the stage's saved inputs). GPipe: m on every rank;
    1F1B: p - rank; interleaved: more, since each rank holds v stages.
    """
    orders = rank_orders(schedule, pp, microbatches, virtual_stages)
    peak = {}
    for r, ops in orders.items():
        live, best = 0, 0
        for a in ops:
            if a.kind == "F":
                live += 1
                best = max(best, live)
            elif a.kind in ("B", "W"):
                live -= 1
        peak[r] = best
    return peak


# ------------------------------------------------------------------------------ printing
def schedule_grid(schedule: str, pp: int, microbatches: int,
                  virtual_stages: int = 1) -> list[list[str]]:
    """Rank x step grid of labels ("F0", "B3", "." for idle) with one time step per action."""
    orders = rank_orders(schedule, pp, microbatches, virtual_stages)
    timed = simulate(orders, pp * virtual_stages, UNIT_COSTS)
    steps = int(max(t.end for t in timed))
    grid = [["."] * steps for _ in range(pp)]
    show_stage = virtual_stages > 1
    for t in timed:
        grid[t.rank][int(t.start)] = t.action.label(show_stage)
    return grid


def format_schedule(schedule_name: str, pp: int, microbatches: int,
                    virtual_stages: int = 1) -> str:
    """The schedule as text: one row per rank, one column per time step, plus its bubble.

    Labels are ``F<mb>``/``B<mb>`` (``I``/``W`` for the split backward of zero-bubble schedules),
    with ``@<stage>`` when a rank holds several stages; ``.`` is idle.
    """
    grid = schedule_grid(schedule_name, pp, microbatches, virtual_stages)
    width = max(len(c) for row in grid for c in row)
    header = (f"{schedule_name}: pp={pp} microbatches={microbatches}"
              + (f" virtual_stages={virtual_stages}" if virtual_stages > 1 else ""))
    steps = len(grid[0])
    lines = [header, "step    " + " ".join(f"{i:<{width}}" for i in range(steps))]
    for r, row in enumerate(grid):
        lines.append(f"rank {r:<2} " + " ".join(f"{c:<{width}}" for c in row))
    theory = theoretical_bubble(schedule_name, pp, microbatches, virtual_stages)
    peak = peak_in_flight(schedule_name, pp, microbatches, virtual_stages)
    lines.append(f"bubble (F=1, B=2): {theory:.1%}   microbatch activations in flight per rank: "
                 + ", ".join(str(peak[r]) for r in sorted(peak)))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ CLI
def _schedule_name(text: str) -> str:
    if text in PP_SCHEDULES:
        return text
    hint = "; to print every schedule use --all" if text == "all" else ""
    raise argparse.ArgumentTypeError(f"{text!r} is not a schedule (choose from "
                                     f"{', '.join(PP_SCHEDULES)}){hint}")


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``plait schedule`` (print a pipeline schedule without running it)."""
    parser.add_argument("--schedule", default="1f1b", type=_schedule_name,
                        metavar="{" + ",".join(PP_SCHEDULES) + "}",
                        help="pipeline schedule (default: 1f1b); 'all' is not a schedule, "
                             "use --all")
    parser.add_argument("--pp", type=int, default=4, metavar="N",
                        help="pipeline ranks (default: 4)")
    parser.add_argument("--microbatches", "-m", type=int, default=8, metavar="N",
                        help="microbatches per step (default: 8)")
    parser.add_argument("--virtual-stages", "-v", type=int, default=None, metavar="N",
                        help="stages per rank (default: 1, or 2 for multi-stage schedules)")
    parser.add_argument("--all", action="store_true", help="print every schedule")
    add_format(parser)


# `plait schedule` draws a grid for people to read; its cost grows faster than the grid.
MAX_GRID_CELLS = 4096


def schedule_command(args: argparse.Namespace) -> int:
    names = list(PP_SCHEDULES) if args.all else [args.schedule]
    multi = args.all or args.schedule in MULTI_STAGE_SCHEDULES
    cells = args.pp * args.microbatches * (args.virtual_stages or (2 if multi else 1))
    if cells > MAX_GRID_CELLS:
        raise ValueError(f"--pp {args.pp} x --microbatches {args.microbatches} x virtual stages "
                         f"= {cells:,} is more than plait schedule draws ({MAX_GRID_CELLS:,}); "
                         f"the shape of a schedule shows at e.g. --pp 8 -m 16")
    rows: list[dict[str, Any]] = []
    texts: list[str] = []
    for name in names:
        v = args.virtual_stages
        if v is None:
            v = 2 if name in MULTI_STAGE_SCHEDULES else 1
        elif args.all and name not in MULTI_STAGE_SCHEDULES:
            v = 1
        if args.format == "json":
            rows.append({"schedule": name, "pp": args.pp, "microbatches": args.microbatches,
                         "virtual_stages": v,
                         "grid": schedule_grid(name, args.pp, args.microbatches, v),
                         "bubble": theoretical_bubble(name, args.pp, args.microbatches, v),
                         "in_flight": peak_in_flight(name, args.pp, args.microbatches, v)})
        else:
            texts.append(format_schedule(name, args.pp, args.microbatches, v))
    print(json.dumps(rows, indent=2) if args.format == "json" else "\n\n".join(texts))
    return 0
