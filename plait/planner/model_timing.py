"""Time a model's own forward and backward where the cluster priced is the machine it runs on.

The planner prices a model without a stack of blocks (:mod:`plait.planner.whole_model`) from
its FLOPs at a compute efficiency and its aten ops at a per-op host time. The efficiency a
profile carries is measured on transformer matmuls; a convolution, an LSTM cell or a Python
loop runs at another rate, and FLOPs say nothing of it. Where the cluster priced is this
machine, the planner holds the real model and can simply run it: a few forward + backward
passes (the factory's loss included) at each per-rank micro-batch a layout runs, median of the
timed ones, in place of FLOPs / efficiency + per-op host time; and plait's update over the
model's plain tensors, DDP's (ZeRO's sharded updates stay priced per tensor).

Which clusters are this machine: a profile ``plait plan --calibrate`` wrote here records the
host it measured (:func:`this_host`: host name, CPU model, cores) under ``extra.host``; the
planner times the model only where that record equals this machine's. A preset, a profile
written elsewhere, or one without the record is priced from FLOPs, whatever is asked.

What a timing here is and is not: one process, with the threads each rank gets under ``plait
run`` (the cores over the ranks on a node, at least one: :func:`rank_threads`). Ranks that
outnumber the cores share them, priced by dividing the time by each rank's share of a core
(:func:`plait.planner.compute.core_share`), as the FLOP pricing does: a model, not a measurement
of the ranks running at once. Nor is the contention of ranks that each own a core (a shared
memory bus, caches) measured: a timing alone on the machine is what is priced.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .hardware import Cluster

# Caps that keep ``plait plan`` quick on a large model: warm-up iterations, at most this many
# timed ones, and no more timed iterations once a batch size has taken TIME_BUDGET_S; a first
# pass slower than SLOW_S is not repeated (the model is priced from its FLOPs instead).
WARMUP = 2
ITERATIONS = 5
TIME_BUDGET_S = 3.0
SLOW_S = 10.0
# A forward + backward needs the parameters, their gradients and the activations it saves:
# timed only where that is under this share of the memory the machine has free.
MEMORY_SHARE = 0.5
# A timing expected to take longer than this says so on the progress line first.
PROGRESS_S = 1.0
# Timed passes whose slowest is over this many times the fastest: the output says the machine
# was busy while it timed
NOISY = 1.5


def this_host() -> dict[str, Any]:
    """What identifies this machine in a calibrated profile: host name, CPU model, cores."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"name": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count() or 1}


def is_this_machine(cluster: Cluster) -> tuple[bool, str]:
    """Whether ``cluster`` is this machine (a CPU profile calibrated here), and why not."""
    if cluster.device.lower() != "cpu":
        return False, (f"cluster {cluster.name} is a {cluster.device} cluster; the planner "
                       f"times a model on CPU profiles only")
    host = (cluster.extra or {}).get("host")
    if not isinstance(host, dict):
        return False, (f"cluster {cluster.name} is not a profile calibrated on this machine (a "
                       f"preset, or a profile without a host record); calibrate here with "
                       f"plait plan --calibrate --profile-out cpu.yaml and plan with --cluster "
                       f"cpu.yaml")
    here = this_host()
    if host != here:
        return False, (f"cluster {cluster.name} was calibrated on {host.get('name')} "
                       f"({host.get('cpu')}, {host.get('cores')} cores), not this machine "
                       f"{here['name']} ({here['cpu']}, {here['cores']} cores)")
    return True, ""


def rank_threads(cluster: Cluster) -> int:
    """Threads each rank computes with: what ``plait run`` gives it, OMP_NUM_THREADS where
    the environment sets it (the ranks inherit it), else an equal share of the node's cores
    for each of its ranks, at least one."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    cores = cluster.compute_units or os.cpu_count() or 1
    on_node = min(cluster.world_size, cluster.devices_per_node)
    return max(1, cores // on_node)


@dataclass(frozen=True)
class Timed:
    """One forward + backward (loss included) at ``rows`` rows, timed on this machine."""

    rows: int
    seconds: float          # median of the timed iterations, forward + backward
    forward_s: float        # of which the forward and the loss
    iterations: int
    threads: int
    fastest_s: float = 0.0  # the fastest and slowest timed pass: far apart on a busy machine
    slowest_s: float = 0.0

    def says(self) -> str:
        text = (f"measured on this machine at batch {self.rows} ({self.threads} thread"
                f"{'s' if self.threads != 1 else ''}, median of {self.iterations})")
        if self.slowest_s > NOISY * self.fastest_s:
            text += (f"; its passes took {self.fastest_s * 1e3:.3g}-{self.slowest_s * 1e3:.3g} "
                     f"ms: the machine is busy, time again when it is quiet")
        return text


@dataclass
class ModelTimer:
    """Times ``model`` at a batch size on first request and keeps the answer.

    ``batch_of(rows)``: a batch of ``rows`` rows as training feeds it; ``loss_of(model,
    batch)``: the scalar the backward starts from. ``progress``: where a line goes before a
    timing that will take more than a second or two (the CLI's stderr)."""

    model: nn.Module
    batch_of: Callable[[int], Any]
    loss_of: Callable[[nn.Module, Any], torch.Tensor]
    threads: int = 1
    saved_per_sample: float = 0.0
    name: str = "model"
    progress: Callable[[str], None] | None = None
    free_bytes: float | None = None
    times: dict[int, Timed | None] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)
    update_times: list[float] = field(default_factory=list)

    def __call__(self, rows: int) -> Timed | None:
        if rows not in self.times:
            self.times[rows] = self._time(rows)
        return self.times[rows]

    def update(self) -> float:
        """Seconds of plait's update (:func:`plait.train.apply_update`: scale, clip at 1.0,
        ``torch.optim.AdamW`` as torch defaults it here, zero the gradients) over every
        trainable parameter of the model, one process, plain tensors: what a DDP rank runs.
        Median of up to ITERATIONS after WARMUP (the first creates AdamW's state)."""
        if not self.update_times:
            from ..plan import Plan
            from ..train import apply_update

            params = [p for p in self.model.parameters() if p.requires_grad]
            saved = [p.detach().clone() for p in params]
            opt = torch.optim.AdamW(params, lr=1e-3)
            totals = torch.tensor([1.0, 1.0])
            before = torch.get_num_threads()
            torch.set_num_threads(self.threads)
            try:
                started = time.perf_counter()
                for i in range(WARMUP + ITERATIONS):
                    for p in params:
                        p.grad = torch.full_like(p, 1e-3)
                    start = time.perf_counter()
                    apply_update(opt, totals, plan=Plan())
                    if i >= WARMUP:
                        self.update_times.append(time.perf_counter() - start)
                        if time.perf_counter() - started > TIME_BUDGET_S:
                            break
            finally:
                torch.set_num_threads(before)
                with torch.no_grad():  # the timed model is left as it was built
                    for p, s in zip(params, saved, strict=True):
                        p.copy_(s)
                self.model.zero_grad(set_to_none=True)
        return statistics.median(self.update_times)

    def _time(self, rows: int) -> Timed | None:
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        need = 2 * params + self.saved_per_sample * rows
        free = self.free_bytes if self.free_bytes is not None else _free_memory()
        if free is not None and need > MEMORY_SHARE * free:
            self.skipped[rows] = (f"not timed at batch {rows}: a forward + backward needs about "
                                  f"{need / 2**30:.1f} GiB, over half the {free / 2**30:.1f} "
                                  f"GiB free on this machine")
            return None
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self._run(rows)
        finally:
            torch.set_num_threads(before)
            self.model.zero_grad(set_to_none=True)

    def _run(self, rows: int) -> Timed | None:
        batch = self.batch_of(rows)
        self.model.train()
        started = time.perf_counter()
        first = self._once(batch)[0]
        if first > SLOW_S:
            self.skipped[rows] = (f"not timed at batch {rows}: one forward + backward took "
                                  f"{first:.1f} s (over {SLOW_S:g} s)")
            return None
        expected = min(first * (WARMUP + ITERATIONS), TIME_BUDGET_S)
        if self.progress is not None and expected > PROGRESS_S:
            self.progress(f"timing {self.name} forward + backward at batch {rows} on this "
                          f"machine ({first:.2f} s each, up to {WARMUP - 1 + ITERATIONS} more)")
        for _ in range(WARMUP - 1):
            self._once(batch)
        total, fwd = [], []
        for _ in range(ITERATIONS):
            whole, forward = self._once(batch)
            total.append(whole)
            fwd.append(forward)
            if time.perf_counter() - started > TIME_BUDGET_S:
                break
        return Timed(rows=rows, seconds=statistics.median(total),
                     forward_s=statistics.median(fwd), iterations=len(total),
                     threads=self.threads, fastest_s=min(total), slowest_s=max(total))

    def _once(self, batch: Any) -> tuple[float, float]:
        """Seconds of one forward + loss + backward, and of its forward + loss."""
        self.model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = self.loss_of(self.model, batch)
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        return end - start, middle - start


def _free_memory() -> float | None:
    """Bytes of memory this machine has free (None where it cannot say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


def timer_for(built: Any, sample: Any, *, threads: int, saved_per_sample: float, name: str,
              progress: Callable[[str], None] | None = None) -> ModelTimer:
    """A :class:`ModelTimer` for what a factory built on the host: ``(model, dataset,
    loss_fn)`` is timed on its dataset's first rows (cycled to the batch) under its loss, as
    ``run.step`` computes it; a bare model on ``rows`` copies of ``sample`` with the backward
    from the sum of its floating-point outputs."""
    from torch.utils.data import default_collate

    from ..train import forward_loss
    from .whole_model import _floats, _real_batch

    model = built[0] if isinstance(built, (tuple, list)) else built
    data = built[1] if isinstance(built, (tuple, list)) and len(built) > 1 else None
    loss_fn = built[2] if isinstance(built, (tuple, list)) and len(built) > 2 else None
    if data is not None and loss_fn is not None:
        size = len(data)

        def batch_of(rows: int) -> Any:
            return default_collate([data[i % size] for i in range(rows)])

        def loss_of(m: nn.Module, batch: Any) -> torch.Tensor:
            total, count = forward_loss(m, batch, loss_fn)
            return (total / count.clamp_min(1)).sum()  # a loss of terms: each over its count
    else:
        def batch_of(rows: int) -> Any:
            return _real_batch(sample, rows)

        def loss_of(m: nn.Module, batch: Any) -> torch.Tensor:
            out = m(batch)
            return torch.stack([t.sum() for t in _floats(out)]).sum()
    return ModelTimer(model=model, batch_of=batch_of, loss_of=loss_of, threads=threads,
                      saved_per_sample=saved_per_sample, name=name, progress=progress)



def factory_timer(spec: str, saved_per_sample: float, cluster: Cluster, *, built: Any = None,
                  progress: Callable[[str], None] | None = None) -> ModelTimer:
    """A :class:`ModelTimer` for factory ``spec`` (``"package.module:function"``) built on
    the host (``built``: what it already returned there), with the threads a rank of
    ``cluster`` gets."""
    from .model_stats import _build
    from .whole_model import sample_of

    if built is None:
        built = _build(spec, "cpu")
    got = sample_of(built)
    return timer_for(built, got[0] if got else None, threads=rank_threads(cluster),
                     saved_per_sample=saved_per_sample, name=spec, progress=progress)
