"""What rank 0's buffers cost per step under ZeRO-2/3: the broadcast beside the step it precedes.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/zero_written_buffers.py \
        [--plan dp_shard=2,zero=3] [--width 512] [--depth 4] [--steps 20]

Two processes train an MLP of ``--depth`` blocks of ``--width`` whose forward keeps an EMA of
its features (``--width`` floats) and a step count, and reads both: under ZeRO-2/3 plait
broadcasts rank 0's copy of them before each step, as DDP does
(``plait.parallel.buffer_sync``). Prints the mean step time and, timed apart on the same
processes, the mean time of that broadcast alone, side by side with their ratio, and the bytes
it sends.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.nn as nn


class EmaMLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 8)
        self.register_buffer("ema", torch.zeros(width))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * h.mean(0))
                self.seen += 1
        h = h - self.ema
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.out(h)


def worker(rank: int, world: int, plan: str, width: int, depth: int, steps: int
           ) -> dict[str, Any]:
    import torch.nn.functional as F

    import plait
    from plait.parallel.buffer_sync import broadcast_written_buffers

    torch.manual_seed(0)
    run = plait.init(plan, quiet=True)
    model = run.parallelize(EmaMLP(width, depth))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randn(32, width, generator=g), torch.randn(32, 8, generator=g))
    for _ in range(3):  # warm-up (the first step also finds which buffers the forward writes)
        run.step(model, batch, F.mse_loss, opt)
    start = time.perf_counter()
    for _ in range(steps):
        run.step(model, batch, F.mse_loss, opt)
    step = (time.perf_counter() - start) / steps
    start = time.perf_counter()
    for _ in range(steps):
        model.seen += 1  # written, so that each call sends: as before a real step
        model.ema.mul_(1.0)
        broadcast_written_buffers(model)
    sync = (time.perf_counter() - start) / steps
    run.close()
    return {"step": step, "sync": sync}


def main() -> None:
    from plait.spawn import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="dp_shard=2,zero=3")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    out = run_distributed(worker, 2, args.plan, args.width, args.depth, args.steps,
                          timeout=600)[0]
    sent = args.width * 4 + 8
    print(f"{args.plan}, width {args.width}, depth {args.depth}, {args.steps} steps, 2 processes")
    print(f"{'step (ms)':>10s} {'broadcast (ms)':>15s} {'ratio':>8s} {'bytes sent':>11s}")
    print(f"{out['step'] * 1e3:10.2f} {out['sync'] * 1e3:15.3f} "
          f"{out['sync'] / out['step']:8.4f} {sent:11d}")


if __name__ == "__main__":
    main()
