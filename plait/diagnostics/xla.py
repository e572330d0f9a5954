"""What slows a PyTorch/XLA run down without failing it, measured per step and named.

The usual TPU failures are silent: a graph compiled again every few steps, an op that falls back
to the CPU, a ``.item()`` or a print in the step that executes half a graph early, a data
loader whose last batch is short (one more compilation per epoch). Each shows in torch_xla's
own counters; :class:`XLADiagnostics` reads them around every training step and keeps, per
step, the compilations, the graph executions, the ``aten::`` fallback counts and the compile,
execute and transfer time.

A step runs one graph when it works as it should: the one the step boundary
(``torch_xla.sync()``) executes. An execution before it is a host sync. To name it, plait
watches the step's torch calls with a ``TorchFunctionMode`` and records the call during which
the execution counter moved (``Tensor.item at train.py:42``). The watch costs a little per op,
so it is on only in strict mode and, otherwise, from the step after the first unexplained
execution on (a run without host syncs never pays for it).

A compilation after the warm-up steps (the first compiles the step, the second the step with
the optimizer state in place) is reported with its cause where plait can tell: the inputs
changed shape (a short last batch: the fix is ``drop_last=True`` or padding), or the same
shapes gave a new graph (data-dependent control flow, a Python number that changes each step).

``strict=True`` turns each finding into an :class:`XLADiagnosticError` at the step where it
appears, with what to change.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: execution counters: one per graph run (ExecuteComputation without SPMD, ExecuteReplicated
#: with it)
EXECUTE_COUNTERS = ("ExecuteComputation", "ExecuteReplicated")
#: time metrics (nanoseconds accumulated)
TIME_METRICS = {"compile": ("CompileTime",),
                "execute": ("ExecuteTime", "ExecuteReplicatedTime"),
                "transfer": ("TransferToDeviceTime", "TransferFromDeviceTime")}
#: the ``aten::`` counter .item() bumps: a host read, reported as a sync, not as a fallback
SCALAR_READ = "aten::_local_scalar_dense"

# Frames under these are library code, never the line to show the user: torch, the stdlib.
_LIBRARY_DIRS = tuple(os.path.dirname(path) + os.sep for path in (torch.__file__,
                                                                   contextlib.__file__) if path)


class XLADiagnosticError(RuntimeError):
    """Strict mode: a step recompiled, fell back to the CPU or synced with the host."""


@dataclass
class StepRecord:
    """What torch_xla's counters say about one training step."""

    step: int
    shapes: tuple[tuple[int, ...], ...]
    compilations: int = 0
    executions: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    compile_ms: float = 0.0
    execute_ms: float = 0.0
    transfer_ms: float = 0.0


@dataclass
class Finding:
    """One problem, the steps it appeared in, and what to change."""

    kind: str          # "recompilation", "fallback", "host_sync", "partial_batch"
    what: str
    fix: str
    steps: list[int] = field(default_factory=list)
    count: int = 0


def _counters() -> dict[str, int]:
    import torch_xla.debug.metrics as met

    return {name: met.counter_value(name) or 0 for name in met.counter_names()
            if name.startswith("aten::") or name in EXECUTE_COUNTERS or name == "UncachedCompile"}


def _times() -> dict[str, float]:
    import torch_xla.debug.metrics as met

    names = set(met.metric_names())
    out = {}
    for kind, metrics in TIME_METRICS.items():
        out[kind] = sum(met.metric_data(m)[1] for m in metrics if m in names) / 1e6
    return out


def _executions(counters: dict[str, int]) -> int:
    return sum(counters.get(name, 0) for name in EXECUTE_COUNTERS)


def batch_shapes(batch: Any) -> tuple[tuple[int, ...], ...]:
    """The shapes of every tensor in a batch (tensor, or tuple/list/dict of them)."""
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape),)
    if isinstance(batch, dict):
        return tuple(s for v in batch.values() for s in batch_shapes(v))
    if isinstance(batch, (tuple, list)):
        return tuple(s for v in batch for s in batch_shapes(v))
    return ()


def user_frame() -> str:
    """``file:line`` of the innermost caller outside torch, torch_xla and plait's runtime."""
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = os.path.abspath(frame.filename)
        if "torch_xla" in path or path.startswith(_LIBRARY_DIRS) or (
                path.startswith(own) and not path.startswith(own + "models")):
            continue
        return f"{os.path.relpath(path) if not path.startswith('/usr') else path}:{frame.lineno}"
    return "?"


class _SyncWatch(TorchFunctionMode):
    """Records each torch call during which a graph was executed (a host sync)."""

    def __init__(self) -> None:
        super().__init__()
        self.hits: list[tuple[str, str]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        import torch_xla.debug.metrics as met

        before = sum(met.counter_value(n) or 0 for n in EXECUTE_COUNTERS)
        out = func(*args, **(kwargs or {}))
        if sum(met.counter_value(n) or 0 for n in EXECUTE_COUNTERS) != before:
            self.hits.append((_func_name(func), user_frame()))
        return out


def _func_name(func: Any) -> str:
    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
    if isinstance(owner, type) and (issubclass(owner, torch.Tensor)
                                    or issubclass(torch.Tensor, owner)):  # TensorBase methods
        return f"Tensor.{name}"
    module = getattr(func, "__module__", "") or ""
    return f"{module}.{name}" if module.startswith("torch") else name


class XLADiagnostics:
    """Per-step counters of one run on PyTorch/XLA, and the findings they add up to."""

    def __init__(self, *, warmup: int = 2, strict: bool = False) -> None:
        self.warmup = warmup
        self.strict = strict
        self.records: list[StepRecord] = []
        self.findings: dict[tuple[str, str], Finding] = {}
        self._watching = strict
        self._watch: _SyncWatch | None = None
        self._start: tuple[dict[str, int], dict[str, float]] | None = None
        self._shapes: tuple[tuple[int, ...], ...] = ()
        self._unexplained: list[int] = []

    # --------------------------------------------------------------------------- per step
    @contextlib.contextmanager
    def step(self, batch: Any) -> Iterator[None]:
        """Around one training step, step boundary (sync) included."""
        self._shapes = batch_shapes(batch)
        self._start = (_counters(), _times())
        self._watch = _SyncWatch() if self._watching else None
        with self._watch if self._watch is not None else contextlib.nullcontext():
            yield

    def step_end(self) -> StepRecord:
        """Call after the step's sync: record the step, derive findings (raise when strict)."""
        assert self._start is not None, "step_end() without step()"
        counters, times = _counters(), _times()
        before, before_times = self._start
        index = len(self.records) + 1
        record = StepRecord(
            step=index, shapes=self._shapes,
            compilations=counters.get("UncachedCompile", 0) - before.get("UncachedCompile", 0),
            executions=_executions(counters) - _executions(before),
            fallbacks={k: v - before.get(k, 0) for k, v in counters.items()
                       if k.startswith("aten::") and k != SCALAR_READ and v != before.get(k, 0)},
            compile_ms=times["compile"] - before_times["compile"],
            execute_ms=times["execute"] - before_times["execute"],
            transfer_ms=times["transfer"] - before_times["transfer"])
        self.records.append(record)
        new = self._findings_for(record, self._watch.hits if self._watch else [])
        self._start, self._watch = None, None
        if self.strict and new:
            raise XLADiagnosticError("; ".join(f"step {record.step}: {f.what}: {f.fix}"
                                               for f in new))
        return record

    def _note(self, kind: str, what: str, fix: str, step: int, count: int = 1) -> Finding | None:
        """Add to a finding; returns it when it is new (strict mode raises on new ones)."""
        key = (kind, what)
        fresh = key not in self.findings
        finding = self.findings.setdefault(key, Finding(kind=kind, what=what, fix=fix))
        finding.steps.append(step)
        finding.count += count
        return finding if fresh or self.strict else None

    def _findings_for(self, rec: StepRecord, hits: list[tuple[str, str]]) -> list[Finding]:
        new: list[Finding | None] = []
        for op, count in sorted(rec.fallbacks.items()):
            new.append(self._note(
                "fallback", f"{op} ran on the CPU (not lowered to XLA)",
                f"replace {op.removeprefix('aten::')} with ops XLA lowers, or compute it "
                f"outside the step", rec.step, count))
        extra = max(0, rec.executions - 1)
        named = Counter(hits)
        for (op, where), count in sorted(named.items()):
            new.append(self._note(
                "host_sync", f"{op} at {where} executed the graph before the step ended",
                "keep the value on the device (log it after the step, e.g. from "
                "run.step's return value) or drop it", rec.step, count))
        if extra > sum(named.values()) and not rec.fallbacks:
            # (A CPU fallback executes the graph to get its inputs: reported as the fallback.)
            self._unexplained.append(rec.step)
            self._watching = True  # from now on: name it on the steps that follow
            if self.strict:
                new.append(self._note(
                    "host_sync", f"{extra} graph execution(s) before the step ended",
                    "look for .item(), print(tensor), bool(tensor) or .cpu() in the step",
                    rec.step, extra))
        if rec.step > self.warmup and rec.compilations:
            new.append(self._recompilation(rec))
        return [f for f in new if f is not None]

    def _recompilation(self, rec: StepRecord) -> Finding | None:
        seen = [r.shapes for r in self.records[:-1]]
        usual = Counter(seen).most_common(1)[0][0] if seen else rec.shapes
        if rec.shapes != usual:
            rows, full = _first_dim(rec.shapes), _first_dim(usual)
            if rows is not None and full is not None and rows < full:
                return self._note(
                    "partial_batch", f"a batch of {rows} rows instead of {full} (the data "
                    f"loader's last partial batch) compiled the step again",
                    f"use drop_last=True in the DataLoader, or pad the last batch to {full} rows",
                    rec.step, rec.compilations)
            return self._note(
                "recompilation", f"input shapes changed from {_fmt(usual)} to "
                f"{_fmt(rec.shapes)}: the step compiled again",
                "pad inputs to a few fixed shapes (bucket sequence lengths)", rec.step,
                rec.compilations)
        return self._note(
            "recompilation", "the same input shapes traced a new graph",
            "look for Python control flow on tensor values or Python numbers that change every "
            "step (pass them as tensors)", rec.step, rec.compilations)

    # --------------------------------------------------------------------------- report
    def report(self) -> dict[str, Any]:
        """Every finding and the per-step figures after warm-up (medians), JSON-ready."""
        steady = self.records[self.warmup:] or self.records

        def median(key: str) -> float:
            return statistics.median(getattr(r, key) for r in steady) if steady else 0.0

        return {
            "steps": len(self.records), "warmup": self.warmup, "strict": self.strict,
            "compilations_after_warmup": sum(r.compilations for r in self.records[self.warmup:]),
            "executions_per_step": median("executions"),
            "compile_ms_per_step": median("compile_ms"),
            "execute_ms_per_step": median("execute_ms"),
            "transfer_ms_per_step": median("transfer_ms"),
            "unexplained_syncs_at_steps": list(self._unexplained),
            "findings": [asdict(f) for f in self.findings.values()],
            "per_step": [asdict(r) for r in self.records],
        }


def _first_dim(shapes: tuple[tuple[int, ...], ...]) -> int | None:
    return shapes[0][0] if shapes and shapes[0] else None


def _fmt(shapes: tuple[tuple[int, ...], ...]) -> str:
    return ", ".join("(" + ", ".join(map(str, s)) + ")" for s in shapes) or "()"


def format_report(report: dict[str, Any]) -> str:
    """The end-of-run table: figures per step, then each finding with its fix."""
    lines = [f"--- XLA diagnostics: {report['steps']} steps, the first {report['warmup']} "
             f"warm-up ---",
             f"per step (median)  compile {report['compile_ms_per_step']:.1f} ms | execute "
             f"{report['execute_ms_per_step']:.1f} ms | transfer "
             f"{report['transfer_ms_per_step']:.1f} ms | {report['executions_per_step']:g} graph "
             f"execution(s)",
             f"compilations after warm-up: {report['compilations_after_warmup']}"]
    if not report["findings"]:
        lines.append("no recompilation, CPU fallback or host sync found")
    for f in report["findings"]:
        steps = f["steps"]
        where = (f"step {steps[0]}" if len(steps) == 1 else
                 f"{len(steps)} steps ({steps[0]}..{steps[-1]})")
        lines.append(f"{f['kind']:<14} {f['what']} [{f['count']}x, {where}]")
        lines.append(f"{'':<14} fix: {f['fix']}")
    if report["unexplained_syncs_at_steps"]:
        lines.append(f"host syncs not yet named at steps {report['unexplained_syncs_at_steps']} "
                     f"(the first one: naming starts on the step after it)")
    return "\n".join(lines)

