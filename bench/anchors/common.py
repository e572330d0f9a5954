"""What every script in this folder shares and is not the user's training code: the command
line (model size, steps, global batch) and a meter that times each step and writes the figures
``bench/vs_anchors.py`` compares. Each script calls ``args()`` once and ``Meter.tick`` once per
step, so the lines that differ between two scripts are the library's, not the harness's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _rss_bytes() -> int:
    """Resident set size now (Linux /proc; the high-water mark elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * (1 if sys.platform == "darwin" else 1024)


@functools.cache
def args() -> argparse.Namespace:
    """The run's shape (parsed once). ``--plan`` and anything else a library reads is left
    alone. The first call also fixes the memory baseline: after imports, before the model."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps not timed")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default=None, help="JSON file rank 0 writes the figures to")
    a, _ = p.parse_known_args()
    a.baseline_rss = _rss_bytes()
    return a


class Meter:
    """Times the interval between consecutive ``tick`` calls (data loading included, as a user
    sees it) and keeps the last loss."""

    def __init__(self) -> None:
        self.a = args()
        self.times: list[float] = []
        self.last_loss: float | torch.Tensor = float("nan")
        self._t = time.perf_counter()

    def tick(self, loss: float | torch.Tensor) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.times.append(now - self._t)
        self._t = now
        self.last_loss = loss

    def finish(self) -> dict | None:
        """Gather every rank's figures; rank 0 writes them to ``--out`` and returns them."""
        timed = self.times[self.a.warmup:] or self.times
        last = self.last_loss
        value = float(last.detach().float().item()) if isinstance(last, torch.Tensor) else last
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = max(0, _peak_rss_bytes() - self.a.baseline_rss)
        mine = {"step_s": statistics.median(timed), "loss": value, "peak_bytes": peak,
                "steps": len(self.times)}
        ranks = [mine]
        if dist.is_available() and dist.is_initialized():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            if dist.get_rank() != 0:
                return None
        # Pipelines: only the last stage holds the loss; the others report NaN.
        losses = [r["loss"] for r in ranks if r["loss"] == r["loss"]]
        step_s = max(r["step_s"] for r in ranks)  # the job is as slow as its slowest rank
        out = {"world": len(ranks), "step_s": step_s,
               "tokens_per_s": self.a.batch * self.a.seq / step_s,
               "peak_bytes_per_rank": [r["peak_bytes"] for r in ranks],
               "final_loss": sum(losses) / len(losses) if losses else None,
               "steps": mine["steps"], "timed_steps": len(timed),
               "memory_kind": "cuda max_memory_allocated"
               if torch.cuda.is_available() and torch.cuda.is_initialized()
               else "peak RSS above the size before the model was built"}
        if self.a.out:
            with open(self.a.out, "w") as f:
                json.dump(out, f)
        return out
