"""Measured vs theoretical pipeline bubble, for every schedule at pp = 2 and 4, m = 4, 8, 16.

    PYTHONPATH=. python bench/pipeline_bubble.py [--block-ms 6] [--steps 2] [--pp 2 4]

How the bubble is measured honestly on a 2-core machine. Four pipeline processes on two cores
would time-share the CPU: a rank's forward would run slower exactly when the other ranks are
busy, which shrinks the measured bubble for reasons that have nothing to do with the schedule.
So the blocks' cost is *time*, not CPU: each block runs a small real Linear and then sleeps a
fixed time in its forward (``t``), in its input-gradient backward (``t``) and in its
weight-gradient backward (``t``, on a separate autograd branch so the zero-bubble schedules can
defer it as their ``W`` action). F : B = 1 : 2, as the theory assumes. Everything else is the
real thing: torch's schedules and PipelineStage send/recv over gloo, plait's stage splitting and
timeline. Per rank, idle time is the step's span (first action start to last action end, over
all ranks) minus the time that rank spent inside forward/backward; the bubble is the mean idle
share. Communication waits and runtime overhead count as idle, as they would on hardware.

"replayed" separates the machine from the schedule: the same recorded actions, in their
recorded order with their measured durations, re-timed with instant communication (see
``plait.parallel.timeline.replay_bubble``). On a machine shared with other jobs (load average
far above the core count) most of measured - theory is wake-up latency between actions, and
the replayed column shows what the schedule itself costs with the real stage times.

Theory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved 1F1B; looped BFS
and the zero-bubble schedules come from plait's schedule simulation (F=1, I=1, W=1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plait.spawn import run_distributed

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2),
             ("interleaved_zb", 2), ("zbv", 2)]
N_BLOCKS = 8
DIM = 32


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward take a fixed wall time (not CPU)."""

    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        ctx.bwd_s = bwd_s
        if fwd_s:
            time.sleep(fwd_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.bwd_s)
        return grad, None, None


class TimedBlock(nn.Module):
    """Linear + fixed costs: forward t, input-gradient t, weight-gradient t."""

    def __init__(self, seconds: float):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.probe = nn.Parameter(torch.zeros(()))
        self.seconds = seconds

    def forward(self, x):
        y = _Sleep.apply(torch.tanh(self.linear(x)), self.seconds, self.seconds)
        # A parameter-only branch: its backward (the W half) costs t and is not needed for the
        # input gradient, so zero-bubble schedules can move it into bubbles.
        w = _Sleep.apply(self.probe, 0.0, self.seconds)
        return y + w


def worker(rank, world_size, configs, block_s, steps):
    import torch.distributed as dist

    from plait.parallel.layout import layout_of
    from plait.parallel.timeline import bubble_fraction, replay_bubble
    from plait.plan import Plan
    from plait.runtime import init

    torch.set_num_threads(1)
    rows = []
    for schedule, v, m in configs:
        plan = Plan(pp=world_size, pp_schedule=schedule, virtual_stages=v, microbatches=m,
                    grad_clip=None)
        run = init(plan, quiet=True)
        torch.manual_seed(0)
        model = nn.Sequential(*[TimedBlock(block_s) for _ in range(N_BLOCKS)])
        model = run.parallelize(model)
        pipe = layout_of(model).pipeline
        x = torch.randn(m * 2, DIM)
        y = torch.randn(m * 2, DIM)
        loss_fn = nn.functional.mse_loss
        pipe.step((x, y), loss_fn, plan=plan, device=run.device)  # warm-up: shape inference
        for p in model.parameters():
            p.grad = None
        with pipe.timeline.record():
            for _ in range(steps):
                dist.barrier()
                pipe.step((x, y), loss_fn, plan=plan, device=run.device)
                for p in model.parameters():
                    p.grad = None
        events = pipe.timeline.gather()
        pipe.timeline.clear()
        if rank == 0:
            steps_seen = sorted({e.step for e in events})
            per_step = [bubble_fraction(events, s) for s in steps_seen]
            replay = [replay_bubble(events, world_size * v, s) for s in steps_seen]
            rows.append({"schedule": schedule, "pp": world_size, "v": v, "m": m,
                         "measured": statistics.mean(per_step),
                         "replayed": statistics.mean(replay),
                         "spread": (max(per_step) - min(per_step)) if per_step else 0.0})
        run.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-ms", type=float, default=6.0,
                        help="time per block per forward / input-grad / weight-grad (ms)")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per config")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=[s for s, _ in SCHEDULES])
    parser.add_argument("--format", choices=("text", "json"), default="text")
    args = parser.parse_args()

    from plait.parallel.schedules import theoretical_bubble

    rows = []
    for pp in args.pp:
        configs = [(s, v, m) for s, v in SCHEDULES if s in args.schedules
                   for m in args.microbatches]
        rows += run_distributed(worker, pp, configs, args.block_ms / 1e3, args.steps,
                                timeout=1200)[0]
    for r in rows:
        r["theory"] = theoretical_bubble(r["schedule"], r["pp"], r["m"], r["v"])
        r["rel_err"] = (r["measured"] - r["theory"]) / r["theory"]
        r["replay_err"] = (r["replayed"] - r["theory"]) / r["theory"]
    if args.format == "json":
        print(json.dumps(rows, indent=2))
        return 0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {os.cpu_count()} cores, load average {load:.1f} at the end of the run")
    print(f"pipeline bubble: measured (timeline, mean of {args.steps} steps) vs theory; "
          f"{N_BLOCKS} blocks, {args.block_ms:g} ms per block per F / I / W")
    print(f"{'schedule':<17}{'pp':>3}{'v':>3}{'m':>4}{'theory':>9}{'measured':>10}"
          f"{'rel.err':>9}{'spread':>8}{'replayed':>10}{'rel.err':>9}")
    for r in rows:
        print(f"{r['schedule']:<17}{r['pp']:>3}{r['v']:>3}{r['m']:>4}{r['theory']:>9.1%}"
              f"{r['measured']:>10.1%}{r['rel_err']:>+9.1%}{r['spread']:>8.1%}"
              f"{r['replayed']:>10.1%}{r['replay_err']:>+9.1%}")
    by = {(r["schedule"], r["pp"], r["m"]): r["measured"] for r in rows}
    print("\nzero-bubble vs 1F1B at the same p, m (measured):")
    for pp in args.pp:
        for m in args.microbatches:
            if ("1f1b", pp, m) in by:
                zb = [f"{s} {by[(s, pp, m)]:.1%}" for s in ("interleaved_zb", "zbv")
                      if (s, pp, m) in by]
                print(f"  pp={pp} m={m:<3} 1f1b {by[('1f1b', pp, m)]:.1%}   " + "   ".join(zb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
