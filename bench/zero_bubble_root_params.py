"""What a parameter read at every depth costs a zero-bubble schedule's weight step.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/zero_bubble_root_params.py \
        [--plan pp=2,schedule=zbv,v=2,mb=4] [--width 256] [--depth 8] [--steps 10]

Two MLPs of the same compute, whose own module adds a shift after every block: ``shared``
adds one parameter at every depth (its weight gradient walks back through the blocks between
its reads, with the graph kept: ``plait.parallel.pipeline.TimedStage``), ``per_block`` adds a
parameter of its own at each depth (each read meets the graph once, as torch's weight step
expects). Two processes train each under ``--plan``, twice, alternating; prints the better
mean step time of each side by side and their ratio.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.nn as nn


class ShiftedMLP(nn.Module):
    def __init__(self, width: int, depth: int, shared: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 8)
        self.shared = shared
        self.shift = nn.Parameter(torch.full((width,), 0.01))
        for i in range(depth):  # on the root module itself, as ``shift``
            self.register_parameter(f"shift{i}", nn.Parameter(torch.full((width,), 0.01)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            h = torch.tanh(block(h)) + (self.shift if self.shared else getattr(self, f"shift{i}"))
        return self.out(h)


def worker(rank: int, world: int, plan: str, width: int, depth: int, steps: int
           ) -> dict[str, float]:
    import torch.nn.functional as F

    import plait

    out: dict[str, float] = {}
    for shared in (False, True, False, True):  # twice each, the best kept: a shared machine
        torch.manual_seed(0)
        run = plait.init(plan, quiet=True)
        model = run.parallelize(ShiftedMLP(width, depth, shared))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        batch = (torch.randn(64, width, generator=g), torch.randn(64, 8, generator=g))
        for _ in range(3):
            run.step(model, batch, F.mse_loss, opt)
        start = time.perf_counter()
        for _ in range(steps):
            run.step(model, batch, F.mse_loss, opt)
        name = "shared" if shared else "per_block"
        took = (time.perf_counter() - start) / steps
        out[name] = min(out.get(name, took), took)
        run.close()
    return out


def main() -> None:
    from plait.spawn import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="pp=2,schedule=zbv,v=2,mb=4")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    out: dict[str, Any] = run_distributed(worker, 2, args.plan, args.width, args.depth,
                                          args.steps, timeout=600)[0]
    print(f"{args.plan}, width {args.width}, depth {args.depth}, {args.steps} steps, "
          f"2 processes")
    print(f"{'per_block (ms)':>15s} {'shared (ms)':>12s} {'ratio':>7s}")
    print(f"{out['per_block'] * 1e3:15.2f} {out['shared'] * 1e3:12.2f} "
          f"{out['shared'] / out['per_block']:7.3f}")


if __name__ == "__main__":
    main()
