"""A pipeline's step time when its processes outnumber the cores (CPU): processor sharing.

Why: on a GPU every rank owns its device, and a stage idle in the pipeline bubble wastes it. On
a CPU with more processes than cores (4 gloo ranks on 2 cores), the cores are shared by whoever
is busy: a stage idle in the bubble hands its core to the others, so the bubble costs less than
the closed forms say -- and how much less depends on how many stages are busy at each moment.
Measured here: pp=2 x dp=2, 1F1B, 2 microbatches on 2 cores ran 0.21 s where the closed form at
half a core per process gave 0.31 s. So the schedule is simulated: every rank's forward and
backward tasks (per pipeline chunk) in the order the schedule runs them, with their dependencies,
every busy process progressing at ``min(1, cores / busy processes)`` of a core.

Sends between stages are not events of their own: their measured time is part of each chunk's
work (``plait.planner.cost``). Modelling them instead as latency that leaves the cores to others
fitted worse: the pipelines came out 2-5% faster still, and interleaved 1F1B exactly as fast as
1F1B, where it measured 5-15% slower -- its extra cost at world 4 on 2 cores is CPU (13 ms more
per rank and step), not idle cores.

Pure Python, small: ranks x chunks x microbatches x 2 events, used by the cost model only when
processes outnumber cores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Op = tuple[str, int, int]  # ("F" | "B", stage, microbatch)


def stage_order(schedule: str, stage: int, stages: int, microbatches: int
                ) -> list[tuple[str, int]]:
    """The (kind, microbatch) tasks one stage runs, in order: GPipe all forwards then all
    backwards; 1F1B ``stages - stage - 1`` warm-up forwards, then one forward one backward,
    then the remaining backwards."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(stages - stage - 1, m)
    order = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while b < m:
        if f < m:
            order.append(("F", f))
            f += 1
        order.append(("B", b))
        b += 1
    return order


def rank_ops(schedule: str, rank: int, ranks: int, local_stages: int, microbatches: int
             ) -> list[Op]:
    """The (kind, stage, microbatch) tasks one rank runs, in order; stage ``c x ranks + rank``
    is the rank's c-th chunk (looped placement).

    * one chunk per rank: :func:`stage_order` (GPipe or 1F1B);
    * ``looped_bfs``: every microbatch through the rank's chunks in turn, then the backwards in
      reverse;
    * ``interleaved`` (interleaved 1F1B, and interleaved zero-bubble's forward/backward order):
      torch.distributed.pipelining's interleaved order (Megatron-LM's, generalised to any
      microbatch count): ``(v - 1) x per_round + 2 (ranks - 1 - rank)`` warm-up forwards, then
      one forward one backward, then the remaining backwards, the chunk switching every
      ``per_round`` operations, where ``per_round`` is the microbatches per round (``ranks``
      when they divide the microbatches)."""
    v, m, p = local_stages, microbatches, ranks
    if v == 1:
        return [(kind, rank, i) for kind, i in stage_order(schedule, rank, p, m)]
    if schedule == "looped_bfs":
        fwd = [("F", c * p + rank, i) for c in range(v) for i in range(m)]
        bwd = [("B", c * p + rank, i) for c in reversed(range(v)) for i in range(m)]
        return fwd + bwd
    per_round = m // max(1, m // p)
    total = v * m
    warm = min((v - 1) * per_round + 2 * (p - 1 - rank), total)
    counts: dict[tuple[str, int], int] = {}

    def take(kind: str, stage: int) -> Op:
        i = counts.get((kind, stage), 0)
        counts[(kind, stage)] = i + 1
        return (kind, stage, i)

    def fwd_stage(op: int) -> int:
        return (op // per_round) % v * p + rank

    def bwd_stage(op: int) -> int:
        return (v - 1 - ((op - warm) // per_round) % v) * p + rank

    out = [take("F", fwd_stage(op)) for op in range(warm)]
    for op in range(warm, total):
        out += [take("F", fwd_stage(op)), take("B", bwd_stage(op))]
    out += [take("B", bwd_stage(op)) for op in range(total, total + warm)]
    return out


def shared_pipeline_time(forward: Sequence[float], backward: Sequence[float], microbatches: int,
                         *, replicas: float, cores: float, schedule: str = "1f1b",
                         ranks: int | None = None) -> float:
    """Seconds for one run of the pipeline schedule.

    ``forward[s]`` / ``backward[s]``: pipeline chunk s's time per microbatch on a whole core, in
    pipeline order; ``ranks``: pipeline ranks (default: one chunk each), chunk s on rank
    ``s % ranks``; ``replicas``: processes per rank on the node (data / tensor parallel copies,
    in lockstep); ``cores``: the node's cores. A busy process progresses at
    ``min(1, cores / busy)`` of a core, busy = replicas x busy ranks.

    Past about ``4 x ranks`` microbatches, runs are simulated at two lengths a round of
    ``ranks`` microbatches apart (the steady state) and extrapolated linearly: the search
    prices thousands of layouts, and an event per task would make deep pipelines with many
    microbatches cost a tenth of a second each.
    """
    p = ranks or len(forward)
    if len(forward) != len(backward) or len(forward) % p:
        raise ValueError(f"{len(forward)} forward / {len(backward)} backward chunk times do not "
                         f"split evenly over {p} ranks")
    m = microbatches
    cap = p * math.ceil((2 * p + 2) / p)
    args = (replicas, cores, schedule)
    if m > cap + p:
        short = _simulate(forward, backward, cap, *args, ranks=p)
        longer = _simulate(forward, backward, cap + p, *args, ranks=p)
        return short + (m - cap) * (longer - short) / p
    return _simulate(forward, backward, m, *args, ranks=p)


def _simulate(forward: Sequence[float], backward: Sequence[float], microbatches: int,
              replicas: float, cores: float, schedule: str, *, ranks: int | None = None
              ) -> float:
    p = ranks or len(forward)
    stages = len(forward)
    orders = [rank_ops(schedule, r, p, stages // p, microbatches) for r in range(p)]
    position = [0] * p              # next task index per rank
    remaining = [0.0] * p           # work left on the running task (core-seconds)
    running = [False] * p
    done: set[Op] = set()
    scale = max(max(forward, default=0.0) + max(backward, default=0.0), 1e-30)
    now = 0.0

    def ready(r: int) -> bool:
        kind, s, i = orders[r][position[r]]
        if kind == "F":
            return s == 0 or ("F", s - 1, i) in done
        return ("F", s, i) in done and (s == stages - 1 or ("B", s + 1, i) in done)

    def start_ready() -> None:
        for r in range(p):
            if not running[r] and position[r] < len(orders[r]) and ready(r):
                kind, s, _ = orders[r][position[r]]
                remaining[r] = forward[s] if kind == "F" else backward[s]
                running[r] = True

    start_ready()
    while any(running):
        busy = [r for r in range(p) if running[r]]
        speed = min(1.0, cores / (replicas * len(busy)))
        dt = min(remaining[r] for r in busy) / speed
        now += dt
        for r in busy:
            remaining[r] -= dt * speed
            if remaining[r] <= 1e-9 * scale:
                done.add(orders[r][position[r]])
                position[r] += 1
                running[r] = False
        start_ready()
    if any(position[r] < len(orders[r]) for r in range(p)):  # pragma: no cover - a bug
        raise RuntimeError("pipeline simulation deadlocked")
    return now
