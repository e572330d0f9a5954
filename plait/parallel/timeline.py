"""Measured pipeline timelines: when each rank really ran each forward and backward.

The pipeline's stages report the start and end of every ``forward_one_chunk`` /
``backward_one_chunk`` / ``backward_weight_one_chunk`` (see ``plait.parallel.pipeline``) to a
``Timeline`` while one is recording. Times are ``time.perf_counter()``, a system-wide monotonic
clock on Linux, so events from different processes on one machine share a time axis; across
machines only per-rank figures are meaningful.

The measured bubble fraction is the idle share of the step: for each rank,
``1 - busy / span`` where ``span`` runs from the first action's start to the last action's end
over *all* ranks, averaged over ranks. Communication waits count as idle, as they should: that
is what the schedule leaves on the table.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Event:
    rank: int
    step: int
    stage: int
    kind: str          # "F", "B" (full backward), "I" (input grad), "W" (weight grad)
    microbatch: int
    start: float
    end: float


@dataclass
class Timeline:
    """Events recorded on this rank (``gather`` pools them over a process group)."""

    rank: int = 0
    events: list[Event] = field(default_factory=list)
    recording: bool = False
    step: int = 0

    def add(self, stage: int, kind: str, microbatch: int, start: float, end: float) -> None:
        if self.recording:
            self.events.append(Event(self.rank, self.step, stage, kind, microbatch, start, end))

    @contextlib.contextmanager
    def record(self) -> Iterator[Timeline]:
        self.recording = True
        try:
            yield self
        finally:
            self.recording = False

    def next_step(self) -> None:
        self.step += 1

    def clear(self) -> None:
        self.events.clear()

    def gather(self, group: dist.ProcessGroup | None = None) -> list[Event]:
        """Every rank's events (collective over ``group``; every member must call it)."""
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return list(self.events)
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, self.events, group=group)
        return [e for part in parts for e in part]


def now() -> float:
    return time.perf_counter()


def steps_of(events: list[Event]) -> list[int]:
    return sorted({e.step for e in events})


def bubble_fraction(events: list[Event], step: int | None = None) -> float:
    """Idle share of one step (or the mean over the steps present)."""
    if step is None:
        steps = steps_of(events)
        if not steps:
            raise ValueError("no events recorded: run a pipeline step inside Timeline.record()")
        return sum(bubble_fraction(events, s) for s in steps) / len(steps)
    ev = [e for e in events if e.step == step]
    if not ev:
        raise ValueError(f"no events recorded for step {step}")
    span = max(e.end for e in ev) - min(e.start for e in ev)
    ranks = {e.rank for e in ev}
    busy = sum(e.end - e.start for e in ev)
    return 1.0 - busy / (span * len(ranks))


def replay_bubble(events: list[Event], num_stages: int, step: int | None = None) -> float:
    """The bubble the recorded step would have with instant communication and no runtime gaps.

    Replays each rank's recorded actions, in their recorded order and with their measured
    durations, through the dependency simulation of ``plait.parallel.schedules``. The difference
    to ``bubble_fraction`` is time lost between actions (p2p latency, Python, a busy CPU); the
    difference to the theoretical bubble is the schedule meeting real, unequal stage times.
    """
    from .schedules import Action, bubble_of, simulate

    if step is None:
        steps = steps_of(events)
        return sum(replay_bubble(events, num_stages, s) for s in steps) / len(steps)
    ev = sorted((e for e in events if e.step == step), key=lambda e: e.start)
    orders: dict[int, list[Action]] = {}
    durations: dict[tuple[int, Action], float] = {}
    for e in ev:
        a = Action(e.kind, e.stage, e.microbatch)
        orders.setdefault(e.rank, []).append(a)
        durations[(e.rank, a)] = e.end - e.start
    return bubble_of(simulate(orders, num_stages, lambda r, a: durations[(r, a)]))


def per_rank_idle(events: list[Event], step: int) -> dict[int, float]:
    """Seconds each rank was idle during ``step`` (span minus its busy time)."""
    ev = [e for e in events if e.step == step]
    span = max(e.end for e in ev) - min(e.start for e in ev)
    ranks = sorted({e.rank for e in ev})
    return {r: span - sum(e.end - e.start for e in ev if e.rank == r) for r in ranks}


def to_dicts(events: list[Event]) -> list[dict[str, Any]]:
    return [asdict(e) for e in events]


def plot(events: list[Event], path: str, *, step: int | None = None,
         title: str | None = None) -> str:
    """Draw one step's timeline (a row per rank, a box per action) to a PNG at ``path``.

    Needs matplotlib (``pip install plait[plot]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # the plot extra is optional
        raise ImportError("drawing a timeline needs matplotlib: pip install 'plait[plot]'") from exc
    if step is None:
        step = steps_of(events)[-1]
    ev = [e for e in events if e.step == step]
    t0 = min(e.start for e in ev)
    ranks = sorted({e.rank for e in ev})
    colors = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.2))
    for e in ev:
        y = ranks.index(e.rank)
        ax.barh(y, (e.end - e.start) * 1e3, left=(e.start - t0) * 1e3, height=0.8,
                color=colors.get(e.kind, "gray"), edgecolor="black", linewidth=0.3)
        ax.text((e.start - t0 + (e.end - e.start) / 2) * 1e3, y, f"{e.kind}{e.microbatch}",
                ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since step start")
    ax.set_title(title or f"pipeline timeline, step {step}, bubble "
                          f"{bubble_fraction(events, step):.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
