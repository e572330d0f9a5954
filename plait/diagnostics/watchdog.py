"""The hang watchdog: a rank that does not reach a collective is named, and the job ends.

What torch gives, and what it lacks. A process group's timeout makes the ranks that *wait*
raise (gloo: "Timed out waiting ... for recv", after 30 minutes by default), naming no peer, so
the blame falls on a waiting rank; NCCL's own watchdog aborts the communicator and, with
``TORCH_NCCL_TRACE_BUFFER_SIZE`` set, dumps its flight recorder; torchelastic stops a job once one
worker exits. None of them says which rank is missing, on which mesh axis, at which step, and a
rank that skipped a collective goes unnoticed until the job hangs at its end. What torch does
keep is each process group's *sequence number*: the count of collectives issued on it, taken when
a collective is issued (gloo and NCCL alike). The watchdog adds the rest from that.

How. A daemon thread per rank publishes a heartbeat to the job's store once per ``interval``:
the step, each mesh axis's sequence number, and where the main thread is. A rank whose progress
(step and sequence numbers) has not moved for ``timeout`` seconds while it is in a step or in
``finish()`` reads all heartbeats and writes one report: on the axis where it waits, the ranks
whose sequence number is lower did not reach the collective. Every rank's thread watches for a
report and ends its process with ``EXIT_HANG`` when one appears, so the whole job ends within
about ``timeout`` + 2 x ``interval``. The process group's own timeout is set longer than
``timeout`` (see ``plait.init``), so torch's unhelpful error does not come first.

Desync. At the start of every step (and in ``finish()``) the ranks all-gather their sequence
numbers on a private gloo group that only the watchdog uses, so its collectives cannot be paired
with the user's. The all-gather is started there and waited for just before the step's first
collective is issued (a gate in the collective kernels of ``plait.comm.ledger``): its latency,
and the time the ranks arrive apart, pass under the forward's compute instead of stalling
every rank at the step's start (2 ms of a 100 ms DDP step on 2 CPU processes). A rank that
skipped (or added) a collective on some axis is then named there, with the axis and the step,
before the next collective can pair with the wrong one: on gloo such a pairing aborts the
process (``Received data size doesn't match``) when the sizes differ, and silently mixes data
when they match. When the skipped collective leaves its
peers waiting in it, the ranks that skipped it wait in the check, and the timeout report says
which ranks issued fewer collectives on which axis, and where the others wait. Pipeline groups
are left out of the comparison: their point-to-point sends and receives differ legitimately
from stage to stage. A mismatched collective *inside* a step is not caught before gloo sees it.

Cost: one small store write per rank per ``interval`` off the training thread, and rank 0 reads
``world_size`` small keys per ``interval`` (at thousands of ranks, a longer ``interval``); per
step, one all-gather of a few integers per rank on the private group, overlapped with the
forward, and one Python call per collective for the gate (bench/guard_cost.py).
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

EXIT_HANG = 124  # the exit code of every rank of a job the watchdog ended (as timeout(1))
_TORCH = str(Path(dist.__file__).resolve().parents[1])
_PLAIT = str(Path(__file__).resolve().parents[1])
_STDLIB = sysconfig.get_paths()["stdlib"]


class HangError(RuntimeError):
    """A collective was not reached by every rank in time, or ranks issued different ones."""


def where(thread_id: int) -> dict[str, str]:
    """Where a thread is: the innermost Python call (``op``) and the innermost frame of the
    user's code (``at``), e.g. ``{"op": "all_reduce", "at": "train.py:14"}``."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return {"op": "", "at": ""}
    stack = traceback.extract_stack(frame)
    inner = stack[-1]
    op = inner.name
    if inner.filename.startswith(_TORCH) and "autograd" in inner.filename:
        op = "backward"
    user = next((f for f in reversed(stack)
                 if not f.filename.startswith((_TORCH, _PLAIT, _STDLIB, "<"))), None)
    at = f"{Path(user.filename).name}:{user.lineno}" if user else ""
    return {"op": op, "at": at, "inner": f"{Path(inner.filename).name}:{inner.lineno}"}


@dataclass
class Watchdog:
    """One rank's watchdog thread. ``groups``: {mesh axis name: process group} to watch."""

    store: Any
    rank: int
    world_size: int
    groups: dict[str, Any]
    timeout: float = 300.0
    interval: float = 1.0
    prefix: str = "plait/watchdog/0"
    pipeline_axes: tuple[str, ...] = ("pp",)
    check_group: Any = None       # the private gloo group of the step-start check (None: none)
    step: int = 0
    active: bool = False          # inside a step or finish(): waiting there is not idleness
    checking: bool = False        # waiting for the step-start check
    finishing: bool = False       # the check is finish()'s (after the last step), not a step's
    _pending: tuple | None = None  # (work, gathered counts, axis names, step) not waited for
    _gate: Any = None             # self.await_check, armed while a check is pending
    _main: int = field(default_factory=lambda: threading.main_thread().ident or 0)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _members: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._members = {name: dist.get_process_group_ranks(pg)
                         for name, pg in self.groups.items()}

    # ------------------------------------------------------------------ the training thread
    def start(self) -> Watchdog:
        self._thread = threading.Thread(target=self._loop, name="plait-watchdog", daemon=True)
        self._thread.start()
        return self

    def step_started(self, step: int, *, finishing: bool = False) -> None:
        """Called at the start of every step (and in ``finish()``, as step N + 1 with
        ``finishing``): every rank starts comparing its collective counts with its peers' (an
        all-gather, waited for by :meth:`await_check` before the step's first collective; see
        the module's doc)."""
        self.step = step
        self.finishing = finishing
        self.active = True
        if self.check_group is None:
            return
        import torch

        from ..comm.ledger import arm_gate

        self.await_check()  # the previous step's, when no collective came after it
        names = list(self.groups)
        seqs = self._seqs()
        mine = torch.tensor([seqs[n] for n in names], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(every, mine, group=self.check_group, async_op=True)
        self._pending = (work, every, names, step)
        if self._gate is None:
            self._gate = self.await_check
            from ..comm.ledger import hold_kernels

            hold_kernels()
        arm_gate(self._gate)

    def await_check(self) -> None:
        """Wait for the pending step-start check and report a desync; nothing when none is
        pending. Called by the gate before a collective, or directly."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        from ..comm.ledger import disarm_gate

        disarm_gate(self._gate)
        work, every, names, step = pending
        self.checking = True
        work.wait()
        self.checking = False
        counts = {r: dict(zip(names, t.tolist(), strict=True)) for r, t in enumerate(every)}
        report = desync_report(step, counts, self._members, self.pipeline_axes,
                               finishing=self.finishing)
        if report is not None:
            self._report(report)

    def close(self) -> None:
        if self._gate is not None:
            from ..comm.ledger import disarm_gate, release_kernels

            disarm_gate(self._gate)
            release_kernels()
            self._gate = None
        self._pending = None
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)

    # ------------------------------------------------------------------ the watchdog thread
    def _seqs(self) -> dict[str, int]:
        return {name: int(pg._get_sequence_number_for_group())
                for name, pg in self.groups.items()}

    def _key(self, rank: int | str) -> str:
        return f"{self.prefix}/{rank}"

    def _loop(self) -> None:
        last: tuple | None = None
        since = time.monotonic()
        while not self._stop.wait(self.interval):
            try:
                seqs = self._seqs()
                progress = (self.step, tuple(seqs.values()))
                now = time.monotonic()
                if progress != last:
                    last, since = progress, now
                beat = {"rank": self.rank, "step": self.step, "seqs": seqs, "time": time.time(),
                        "waited": now - since if self.active else 0.0, "active": self.active,
                        "checking": self.checking, "finishing": self.finishing,
                        "where": where(self._main)}
                self.store.set(self._key(self.rank), json.dumps(beat))
                if self.store.check([self._key("report")]):
                    self._end(self.store.get(self._key("report")).decode())
                # Rank 0 reports first; the others only if it cannot (dead, frozen, or not in
                # a step).
                grace = 0.0 if self.rank == 0 else 3 * self.interval
                if self.active and now - since >= self.timeout + grace:
                    self._report(self._diagnose(seqs, now - since))
            except Exception:  # noqa: BLE001 - the store went away: the job is ending anyway
                if self._stop.is_set():
                    return
                time.sleep(self.interval)

    def _beats(self) -> dict[int, dict]:
        keys = [self._key(r) for r in range(self.world_size)]
        present = [k for k in keys if self.store.check([k])]
        values = self.store.multi_get(present) if present else []
        return {int(k.rsplit("/", 1)[1]): json.loads(v)
                for k, v in zip(present, values, strict=True)}

    def _diagnose(self, seqs: dict[str, int], waited: float) -> str:
        """The report: on each watched group whose members' collective counts differ, the
        ranks that issued the latest collective wait in it, and the others never reached it."""
        beats = self._beats()
        beats[self.rank] = {**beats.get(self.rank, {}), "seqs": seqs, "step": self.step,
                            "where": where(self._main), "time": time.time(),
                            "checking": self.checking, "finishing": self.finishing}
        me = beats[self.rank]
        op = me["where"].get("op") or "a collective"
        groups = []  # (name, {rank: count}) where counts differ, this rank's groups first
        order = sorted(self.groups, key=lambda n: (n == "world", len(self._members[n])))
        for name in order:
            if name in self.pipeline_axes:
                continue
            counts = {r: beats[r]["seqs"].get(name) for r in self._members[name] if r in beats}
            absent = [r for r in self._members[name] if r not in beats]
            if absent or len(set(counts.values())) > 1:
                groups.append((name, counts, absent))
        missing: list[int] = []
        axis = "?"
        for name, counts, absent in groups:
            top = max(counts.values())
            missing = sorted(absent + [r for r, c in counts.items() if c < top])
            axis = name
            if counts.get(self.rank) == top:  # where this rank waits
                break
        if not groups:  # equal counts everywhere: the silent ranks, or those not waiting
            stale = [r for r in range(self.world_size)
                     if r not in beats or time.time() - beats[r]["time"] > 3 * self.interval]
            missing = stale or [r for r, b in beats.items()
                                if b.get("waited", 0.0) < self.timeout / 2]
        early = _left_early(beats)
        if early is not None:
            head = early
        elif self.checking:
            head = self._at_check(beats, groups, waited)
        else:
            head = (f"plait watchdog: step {me['step']}: rank(s) {missing} did not reach the "
                    f"collective on mesh axis {axis} within {self.timeout:g} s; rank {self.rank} "
                    f"has waited {waited:.0f} s in {op} (at {me['where'].get('at') or '?'})")
        lines = [head]
        for name, counts, absent in groups:
            lines.append(f"  collectives issued on {name}: " + ", ".join(
                f"rank {r}: {c}" for r, c in sorted(counts.items()))
                + (f"; no heartbeat from {absent}" if absent else ""))
        for r in sorted(beats):
            b = beats[r]
            op = _check_name(b["step"], b.get("finishing", False)) if b.get("checking") \
                else b["where"].get("op")
            phase = f"finish() after step {b['step'] - 1}" if b.get("finishing") \
                else f"step {b['step']}"
            lines.append(f"  rank {r}: {phase}, in {op} at "
                         f"{b['where'].get('at') or b['where'].get('inner')}")
        return "\n".join(lines)

    def _at_check(self, beats: dict[int, dict], groups: list, waited: float) -> str:
        """The first line of a report from a rank that waits in the step-start check: the
        ranks there issued fewer collectives than the others, which wait in one they skipped
        (a desync), or the others have not come back from the previous step."""
        step = self.step
        there = sorted({self.rank} | {r for r, b in beats.items()
                                      if b.get("checking") and b.get("step") == step})
        away = [r for r in range(self.world_size) if r not in there]
        for name, counts, _ in groups:
            top = max(counts.values())
            fewer = sorted(r for r, c in counts.items() if c < top)
            ahead = [r for r, c in counts.items() if c == top and r in away]
            if fewer and set(fewer) <= set(there) and ahead:
                at = beats[ahead[0]]["where"]
                return (f"plait watchdog: desync after step {step - 1}: rank(s) {fewer} issued "
                        f"fewer collectives on mesh axis {name} than rank(s) {sorted(ahead)}, "
                        f"which wait in {at.get('op') or 'a collective'} (at "
                        f"{at.get('at') or at.get('inner') or '?'}): a collective rank(s) "
                        f"{fewer} skipped; they have waited {waited:.0f} s in "
                        f"{_check_name(step, self.finishing)}")
        target = "finish()" if self.finishing else f"the start of step {step}"
        return (f"plait watchdog: rank(s) {away} did not reach {target} within "
                f"{self.timeout:g} s; rank(s) {there} wait there")

    def _report(self, report: str) -> None:
        """Publish ``report`` unless another rank's came first, and end with the first one."""
        winner = self.store.compare_set(self._key("report"), "", report)
        self._end(winner.decode() if isinstance(winner, bytes) else str(winner))

    def _end(self, report: str) -> None:
        """Print the report, leave it for torchrun's error file, and end this process."""
        sys.stderr.write(report + "\n")
        sys.stderr.flush()
        if "TORCHELASTIC_ERROR_FILE" in os.environ:
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(HangError(report))
        # Leave once every rank has read the report (or after two heartbeats): the first to
        # leave breaks its peers' collectives, and their main threads would end with gloo's
        # "Connection closed by peer" (exit code 1, a traceback) instead of the report. An error
        # the main thread raises from now on ends the process the same way, quietly.
        sys.excepthook = _exit_hang
        try:
            self.store.add(self._key("ended"), 1)
            deadline = time.monotonic() + 2 * self.interval + 1.0
            while time.monotonic() < deadline \
                    and self.store.add(self._key("ended"), 0) < self.world_size:
                time.sleep(0.01)
            if self.rank == 0:  # it may host the store: the others' last read comes first
                time.sleep(0.2)
        except Exception:  # noqa: BLE001 - the store went away: leave now
            pass
        os._exit(EXIT_HANG)


def _left_early(beats: dict[int, dict]) -> str | None:
    """The first line of a report where some ranks called ``finish()`` while others are
    still training: the loop ended on some ranks only, as a ``break`` on a value the ranks
    disagree on (early stopping on a metric each rank computed from its own rows) does.
    None when no rank is in ``finish()``, or none of the others in a step after its last."""
    done = sorted(r for r, b in beats.items() if b.get("finishing"))
    if not done:
        return None
    last = min(beats[r]["step"] for r in done)  # finish() counts as the step after the last
    # ranks in a step the finishing ones never began (not a collective of their own after
    # the same last step, which the desync report names)
    training = sorted(r for r, b in beats.items()
                      if not b.get("finishing") and b.get("step", 0) >= last)
    if not training:
        return None
    return (f"plait watchdog: rank(s) {done} left the training loop (finish() after step "
            f"{beats[done[0]]['step'] - 1}) while rank(s) {training} train step "
            f"{beats[training[0]]['step']}: a loop that stops (a break, early stopping) on a "
            f"value the ranks disagree on; stop on one that is the same on every rank: "
            f"run.step's or run.evaluate's loss, or a count summed with run.all_reduce")


def _exit_hang(*_: object) -> None:
    os._exit(EXIT_HANG)


def _check_name(step: int, finishing: bool) -> str:
    """How a report names the collective-count check a rank waits in."""
    return (f"the check in finish() (after step {step - 1})" if finishing
            else f"the step-start check of step {step}")


def desync_report(step: int, counts: dict[int, dict[str, int]],
                  members: dict[str, list[int]], pipeline_axes: tuple[str, ...] = ("pp",),
                  *, finishing: bool = False) -> str | None:
    """The report of a step-start check whose counts differ, or None: ``counts`` holds every
    rank's ``{mesh axis: collectives issued}``, ``members`` this rank's ranks per axis;
    ``finishing``: the check is ``finish()``'s, after the last step (``step - 1``)."""
    for name, ranks in members.items():
        if name in pipeline_axes:
            continue
        seen = {r: counts[r][name] for r in ranks if name in counts.get(r, {})}
        if len(set(seen.values())) < 2:
            continue
        top = max(seen.values())
        fewer = sorted(r for r, c in seen.items() if c < top)
        more = sorted(r for r, c in seen.items() if c == top)
        listed = ", ".join(f"rank {r}: {c}" for r, c in sorted(seen.items()))
        before = "finish()" if finishing else f"step {step}"
        return (f"plait watchdog: desync before {before}: rank(s) {fewer} issued fewer "
                f"collectives on mesh axis {name} than rank(s) {more} ({listed}) in step "
                f"{step - 1} or after it: a collective skipped on some ranks, or added on "
                f"others")
    return None


def start(rank: int, world_size: int, mesh: Any, timeout: float, env: dict[str, str],
          interval: float = 1.0, desync_check: bool = True) -> Watchdog | None:
    """The watchdog of this rank, running; None for a one-rank job or without a TCP store
    (MASTER_ADDR/MASTER_PORT, as torchrun and plait.spawn define them). ``desync_check=False``:
    no step-start check (hangs are still reported at the timeout, without naming a rank that
    skipped a collective)."""
    if world_size < 2 or "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None
    from datetime import timedelta

    from ..store import LOOPBACK

    host = env["MASTER_ADDR"]
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "False" and \
            env.get("LOCAL_WORLD_SIZE") == str(world_size):
        host = LOOPBACK  # plait run's single-node store listens there only (plait.lifecycle)
    store = dist.TCPStore(host, int(env["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timedelta(seconds=max(30.0, 2 * interval)))
    groups: dict[str, Any] = {}
    for name in (*mesh.root.mesh_dim_names, *mesh.flat):
        if mesh.size(name) > 1:
            pg = mesh[name].get_group()
            if all(pg is not seen for seen in groups.values()):  # one name per group
                groups[name] = pg
    if all(dist.group.WORLD is not seen for seen in groups.values()):
        groups["world"] = dist.group.WORLD
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    # The n-th Run of each rank in one job gets the n-th set of keys: ranks create their Runs
    # in the same order, and a later Run must not read an earlier one's heartbeats.
    nth = store.add(f"plait/watchdog/{attempt}/runs/{rank}", 1)
    prefix = f"plait/watchdog/{attempt}" + (f"/run{nth}" if nth > 1 else "")
    # The step-start check's own group: its all-gathers never pair with the user's collectives.
    check = dist.new_group(backend="gloo") if desync_check else None
    return Watchdog(store, rank, world_size, groups, timeout=timeout, interval=interval,
                    prefix=prefix, check_group=check).start()
