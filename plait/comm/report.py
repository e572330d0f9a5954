"""The communication report: the ledger's entries from every rank, per mesh axis and collective.

One row per (mesh axis, collective). Bytes are *per rank per step*, the unit the closed forms in
``plait.comm.volumes`` use, so ``ratio = measured / expected`` is 1.000 when the traffic is what
the formula says. Ranks do not always send the same amount (pipeline stages at the ends send one
way only), so a row keeps the per-rank figures and reports the busiest rank as ``payload_bytes``;
``total_payload_bytes`` sums every rank. Where the prediction knows how many calls carry the
bytes, ``expected_calls`` and ``calls_ratio = calls / expected_calls`` sit beside them (one
all-reduce per DDP bucket, one gather per FSDP2 unit...); ``-`` where the count depends on
what the prediction does not read, with a note saying what.

Backend caveats go into ``notes`` next to the figures rather than into the numbers (the numbers
follow the convention; the note says what the backend moved instead), e.g. gloo's reduce-scatter.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# Row order in tables: data axes first, then model axes, then anything else.
_AXIS_ORDER = ("dp_replicate", "dp_shard", "dp", "dp_shard_cp", "cp", "tp", "pp")


@dataclass
class Row:
    axis: str
    op: str
    group_size: int
    ranks: int                 # ranks that issued this collective on this axis
    count: float               # calls per step on the busiest rank
    payload_bytes: float       # per rank per step (busiest rank), volumes.py's payload
    wire_bytes: float          # per rank per step (busiest rank), ring wire bytes
    total_payload_bytes: float  # summed over ranks, per step
    time_s: float              # per step, slowest rank
    algbw_gbps: float | None   # payload / time (GB/s)
    busbw_gbps: float | None   # wire / time (GB/s)
    expected_bytes: float | None = None
    ratio: float | None = None
    recv_bytes: float = 0.0    # send_recv: bytes received per step (busiest rank)
    per_rank_payload: list[float] = field(default_factory=list)
    via: str = ""              # the c10d op that carried it, if not the op itself (issued_as)
    expected_calls: float | None = None  # predicted calls per step (None: not known)
    calls_ratio: float | None = None     # count / expected_calls


class Expected(dict[tuple[str, str], float]):
    """Predicted payload bytes per (axis, op), a plain mapping to every reader of bytes, with
    ``calls``: the predicted calls per (axis, op), None for a row whose count the prediction
    cannot know (``plait.comm.predict.expected_rows`` makes it)."""

    def __init__(self, payload: Mapping[tuple[str, str], float],
                 calls: Mapping[tuple[str, str], float | None] | None = None) -> None:
        super().__init__(payload)
        self.calls: dict[tuple[str, str], float | None] = dict(calls or {})


# The note under a table with a row whose bytes are predicted but not its calls.
UNKNOWN_CALLS_NOTE = ("expected calls '-': the count depends on what the prediction does not "
                      "read (DDP's buckets past the first need each gradient tensor's size, in "
                      "the order the backward pass makes them ready)")


def expected_calls(expected: Any) -> dict[tuple[str, str], float | None]:
    """The predicted calls per (axis, op) an :class:`Expected` carries ({} for plain bytes)."""
    return dict(expected.calls) if isinstance(expected, Expected) else {}


def normalise_expected(expected: Any) -> dict[tuple[str, str], float]:
    """Accept {(axis, op): b}, {axis: {op: b}} or {"axis/op": b}; return {(axis, op): b}."""
    if expected is None:
        return {}
    if hasattr(expected, "to_ledger_expected"):
        expected = expected.to_ledger_expected()
    if not isinstance(expected, Mapping):
        raise ValueError(f"expected must be a mapping of (axis, op) -> bytes, got "
                         f"{type(expected).__name__}")
    out: dict[tuple[str, str], float] = {}
    for key, value in expected.items():
        if isinstance(key, tuple) and len(key) == 2:
            out[(str(key[0]), str(key[1]))] = float(value)
        elif isinstance(key, str) and isinstance(value, Mapping):
            for op, b in value.items():
                out[(key, str(op))] = float(b)
        elif isinstance(key, str) and "/" in key:
            axis, op = key.split("/", 1)
            out[(axis, op)] = float(value)
        else:
            raise ValueError(f"expected key {key!r}: use (axis, op), 'axis/op' or "
                             f"{{axis: {{op: bytes}}}}")
    return out


@dataclass
class CommReport:
    rows: list[Row]
    steps: int
    world_size: int
    backend: str | None = None
    notes: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ building
    @classmethod
    def from_ranks(cls, per_rank: Sequence[Sequence[Mapping[str, Any]]], steps: int = 1,
                   expected: Any = None, backend: str | None = None) -> CommReport:
        if steps < 1:
            raise ValueError(f"steps={steps} must be >= 1")
        exp = normalise_expected(expected)
        calls = expected_calls(expected)
        world = len(per_rank)
        keys = sorted({(e["axis"], e["op"]) for entries in per_rank for e in entries},
                      key=_row_key)
        rows = []
        for axis, op in keys:
            mine = [next((e for e in entries if e["axis"] == axis and e["op"] == op), None)
                    for entries in per_rank]
            present = [e for e in mine if e is not None]
            per_payload = [(e["payload_bytes"] / steps if e else 0.0) for e in mine]
            busiest = max(present, key=lambda e: (e["payload_bytes"], e["count"]))
            payload = busiest["payload_bytes"] / steps
            wire = busiest["wire_bytes"] / steps
            t = max(e["time_s"] for e in present) / steps
            t_busiest = busiest["time_s"] / steps
            row = Row(axis=axis, op=op, group_size=busiest["group_size"], ranks=len(present),
                      count=busiest["count"] / steps, payload_bytes=payload, wire_bytes=wire,
                      total_payload_bytes=sum(per_payload), time_s=t,
                      algbw_gbps=payload / t_busiest / 1e9 if t_busiest > 0 else None,
                      busbw_gbps=wire / t_busiest / 1e9 if t_busiest > 0 else None,
                      recv_bytes=max(e.get("recv_bytes", 0) for e in present) / steps,
                      per_rank_payload=per_payload,
                      via=next((e["via"] for e in present if e.get("via")), ""))
            if (axis, op) in exp:
                row.expected_bytes = exp[(axis, op)]
                row.ratio = payload / row.expected_bytes if row.expected_bytes else None
                row.expected_calls = calls.get((axis, op))
                if row.expected_calls:
                    row.calls_ratio = row.count / row.expected_calls
            rows.append(row)
        seen = {(r.axis, r.op) for r in rows}
        for (axis, op), b in sorted(exp.items(), key=lambda kv: _row_key(kv[0])):
            if (axis, op) not in seen and b:
                rows.append(Row(axis=axis, op=op, group_size=0, ranks=0, count=0,
                                payload_bytes=0.0, wire_bytes=0.0, total_payload_bytes=0.0,
                                time_s=0.0, algbw_gbps=None, busbw_gbps=None,
                                expected_bytes=b, ratio=0.0,
                                expected_calls=calls.get((axis, op)),
                                calls_ratio=0.0 if calls.get((axis, op)) else None))
        report = cls(rows=rows, steps=steps, world_size=world, backend=backend)
        report.notes = _notes(report)
        if isinstance(expected, Expected) and any(
                r.expected_bytes is not None and r.expected_calls is None and r.ranks
                for r in rows):
            report.notes.append(UNKNOWN_CALLS_NOTE)
        return report

    # ------------------------------------------------------------------ access
    def row(self, axis: str, op: str) -> Row | None:
        return next((r for r in self.rows if r.axis == axis and r.op == op), None)

    def measured(self) -> dict[tuple[str, str], float]:
        """{(axis, op): payload bytes per rank per step} for every measured row."""
        return {(r.axis, r.op): r.payload_bytes for r in self.rows if r.ranks}

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "world_size": self.world_size, "backend": self.backend,
                "unit": "bytes per rank per step (payload: volumes.py convention)",
                "rows": [asdict(r) for r in self.rows], "notes": list(self.notes)}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    # ------------------------------------------------------------------ text
    def table(self) -> str:
        head = ("axis", "collective", "n", "calls", "exp calls", "payload", "wire", "expected",
                "ratio", "time", "busbw")
        lines = [head]
        for r in self.rows:
            op = r.op + (f" (via {r.via})" if r.via else "")
            lines.append((r.axis, op, str(r.group_size), _num(r.count),
                          _num(r.expected_calls) if r.expected_calls is not None else "-",
                          human_bytes(r.payload_bytes),
                          human_bytes(r.wire_bytes),
                          human_bytes(r.expected_bytes) if r.expected_bytes is not None else "-",
                          f"{r.ratio:.3f}" if r.ratio is not None else "-",
                          f"{r.time_s * 1e3:.2f} ms",
                          f"{r.busbw_gbps:.2f} GB/s" if r.busbw_gbps else "-"))
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        out = [f"communication per rank per step ({self.steps} step(s), {self.world_size} ranks"
               f"{', ' + self.backend if self.backend else ''})"]
        for i, line in enumerate(lines):
            out.append("  ".join(c.ljust(w) if j < 2 else c.rjust(w)
                                 for j, (c, w) in enumerate(zip(line, widths, strict=True))))
            if i == 0:
                out.append("  ".join("-" * w for w in widths))
        if not self.rows:
            out.append("(no collectives recorded)")
        out.extend(f"note: {n}" for n in self.notes)
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()

    # ------------------------------------------------------------------ picture
    def plot(self, path: str) -> str | None:
        """Bar chart of measured (and expected) bytes per axis/collective; None without
        matplotlib (the ``plot`` extra)."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        labels = [f"{r.axis}\n{r.op}" for r in self.rows]
        measured = [r.payload_bytes / 2**20 for r in self.rows]
        expected = [(r.expected_bytes or 0) / 2**20 for r in self.rows]
        fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(labels) + 2), 4))
        xs = range(len(labels))
        has_exp = any(r.expected_bytes is not None for r in self.rows)
        width = 0.4 if has_exp else 0.7
        ax.bar([x - (width / 2 if has_exp else 0) for x in xs], measured, width,
               label="measured")
        if has_exp:
            ax.bar([x + width / 2 for x in xs], expected, width, label="expected")
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_ylabel("MiB per rank per step (payload)")
        ax.set_title(f"communication, {self.world_size} ranks, {self.steps} step(s)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _row_key(key: tuple[str, str]) -> tuple[int, str, str]:
    axis, op = key
    first = axis.split("+")[0]
    rank = _AXIS_ORDER.index(first) if first in _AXIS_ORDER else len(_AXIS_ORDER)
    return (rank, axis, op)


def _notes(report: CommReport) -> list[str]:
    notes = []
    for r in report.rows:
        if r.via and r.ranks:
            notes.append(f"{r.axis} {r.op} ran as {r.via} (same payload and ring bytes; "
                         f"plait.parallel.gloo_collectives)")
    if report.backend == "gloo" and any(r.op == "reduce_scatter" and r.ranks and not r.via
                                        for r in report.rows):
        notes.append("gloo has no native reduce-scatter: it runs a full all-reduce of the "
                     "payload (2(n-1)/n wire bytes, not the (n-1)/n counted here)")
    if any(r.op == "send_recv" and r.ranks for r in report.rows):
        notes.append("send_recv counts bytes sent by each rank; received bytes are in recv_bytes")
    if any(r.ratio is not None and r.ranks and abs(r.ratio - 1) > 1e-9 for r in report.rows):
        notes.append("some rows differ from the expected volume (ratio != 1.000)")
    if any(r.calls_ratio is not None and r.ranks and abs(r.calls_ratio - 1) > 1e-9
           for r in report.rows):
        notes.append("some rows make a different number of calls than expected "
                     "(calls != exp calls)")
    return notes


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
