"""A pipeline's step time when its processes outnumber the cores (CPU): processor sharing.

Why: on a GPU every rank owns its device, and a stage idle in the pipeline bubble wastes it. On
a CPU with more processes than cores (4 gloo ranks on 2 cores), the cores are shared by whoever
is busy: a stage idle in the bubble hands its core to the others, so the bubble costs less than
the closed forms say -- and how much less depends on how many stages are busy at each moment.
Measured here: pp=2 x dp=2, 1F1B, 2 microbatches on 2 cores ran 0.21 s where the closed form at
half a core per process gave 0.31 s. How much of the bubble comes back depends on how many
processes are busy at each moment, so the schedule is simulated:
the stages' forward and backward tasks in the schedule's order with their dependencies, every
busy process progressing at ``min(1, cores / busy processes)`` of a core.

Pure Python, small: p stages x m microbatches x 2 tasks events, used by the cost model only when
processes outnumber cores.
"""

from __future__ import annotations

from typing import Sequence


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


def shared_pipeline_time(forward: Sequence[float], backward: Sequence[float], microbatches: int,
                         *, replicas: float, cores: float, schedule: str = "1f1b") -> float:
    """Seconds for one run of the pipeline schedule.

    ``forward[r]`` / ``backward[r]``: stage r's time per microbatch on a whole core;
    ``replicas``: processes per stage on the node (data / tensor parallel copies, in lockstep);
    ``cores``: the node's cores. A busy process progresses at ``min(1, cores / busy)`` of a
    core, busy = replicas x busy stages.

    Past ``3p + 2`` microbatches, runs are simulated at ``2p + 2`` and ``3p + 2`` (the steady
    state) and extrapolated linearly: the search
    prices thousands of layouts, and an event per task would make deep pipelines with many
    microbatches cost a tenth of a second each.
    """
    p, m = len(forward), microbatches
    cap = 2 * p + 2
    if m > cap + p:
        short = _simulate(forward, backward, cap, replicas, cores, schedule)
        longer = _simulate(forward, backward, cap + p, replicas, cores, schedule)
        return short + (m - cap) * (longer - short) / p
    return _simulate(forward, backward, m, replicas, cores, schedule)


def _simulate(forward: Sequence[float], backward: Sequence[float], microbatches: int,
              replicas: float, cores: float, schedule: str) -> float:
    p, m = len(forward), microbatches
    orders = [stage_order(schedule, r, p, m) for r in range(p)]
    position = [0] * p            # next task index per stage
    remaining = [0.0] * p         # work left on the running task (core-seconds)
    running = [False] * p
    done: set[tuple[str, int, int]] = set()
    now = 0.0

    def ready(r: int) -> bool:
        kind, i = orders[r][position[r]]
        if kind == "F":
            return r == 0 or ("F", r - 1, i) in done
        return ("F", r, i) in done and (r == p - 1 or ("B", r + 1, i) in done)

    def start_ready() -> None:
        for r in range(p):
            if not running[r] and position[r] < len(orders[r]) and ready(r):
                kind, _ = orders[r][position[r]]
                remaining[r] = forward[r] if kind == "F" else backward[r]
                running[r] = True

    start_ready()
    while any(running):
        busy = [r for r in range(p) if running[r]]
        speed = min(1.0, cores / (replicas * len(busy)))
        dt = min(remaining[r] for r in busy) / speed
        now += dt
        for r in busy:
            remaining[r] -= dt * speed
        for r in busy:
            if remaining[r] <= 1e-9 * (forward[r] + backward[r]):
                kind, i = orders[r][position[r]]
                done.add((kind, r, i))
                position[r] += 1
                running[r] = False
        start_ready()
    if any(position[r] < len(orders[r]) for r in range(p)):  # pragma: no cover - a bug
        raise RuntimeError("pipeline simulation deadlocked")
    return now
