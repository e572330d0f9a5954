"""What watching every batch for a dataset's own generator costs, beside a tiny model's step.

The loader scans the dataset's attributes before and after each batch for a generator object
it holds and drew from (``plait.data.rng.GeneratorWatch``), because a dataset may draw only on
some items or from its second epoch on. This times that scan alone per batch, for a dataset
holding no generator and one holding a ``torch.Generator``, and one training step of a tiny
MLP (forward, backward, AdamW) on a batch of 8, eager and through ``run.step``, interleaved
rounds, best of each, and prints the scan as a share of each.

    python bench/data_generator_watch.py [--batches 20000] [--rounds 5] [--format json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

import plait
from plait.data.rng import watch_own_generators


class _Plain:
    def __init__(self) -> None:
        self.items = list(range(64))


class _Holds(_Plain):
    def __init__(self) -> None:
        super().__init__()
        self.g = torch.Generator().manual_seed(0)


def _per_batch(data: Any, batches: int) -> float:
    start = time.perf_counter()
    for _ in range(batches):
        watch_own_generators(data, lambda: None)
    return (time.perf_counter() - start) / batches


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _per_step(steps: int) -> float:
    """One eager step of the tiny MLP, no plait: the smallest step a loader could feed."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    start = time.perf_counter()
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - start) / steps


def _per_run_step(run: Any, steps: int) -> float:
    """``run.step`` on the same model and batch, one process: what a user's loop pays."""
    model = run.parallelize(_mlp())
    opt = torch.optim.AdamW(model.parameters())
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    loss_fn = torch.nn.functional.cross_entropy
    run.step(model, batch, loss_fn, opt)
    start = time.perf_counter()
    for _ in range(steps):
        run.step(model, batch, loss_fn, opt)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--format", choices=["table", "json"], default="table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = plait.init(quiet=True)
    plain, holds, step, run_step = [], [], [], []
    for _ in range(args.rounds):
        plain.append(_per_batch(_Plain(), args.batches))
        holds.append(_per_batch(_Holds(), args.batches))
        step.append(_per_step(max(1, args.batches // 20)))
        run_step.append(_per_run_step(run, max(1, args.batches // 40)))
    run.close()
    out = {"scan_no_generator_us": min(plain) * 1e6, "scan_torch_generator_us": min(holds) * 1e6,
           "tiny_step_us": min(step) * 1e6, "tiny_run_step_us": min(run_step) * 1e6}
    for scan in ("no_generator", "torch_generator"):
        out[f"share_{scan}"] = out[f"scan_{scan}_us"] / out["tiny_step_us"]
        out[f"share_{scan}_run_step"] = out[f"scan_{scan}_us"] / out["tiny_run_step_us"]
    if args.format == "json":
        print(json.dumps(out))
        return
    print(f"{'per batch':<34}{'us':>8}{'of step':>9}{'of run.step':>13}")
    for scan, label in (("no_generator", "scan, dataset holds no generator"),
                        ("torch_generator", "scan, dataset holds a Generator")):
        print(f"{label:<34}{out[f'scan_{scan}_us']:>8.1f}{out[f'share_{scan}']:>9.2%}"
              f"{out[f'share_{scan}_run_step']:>13.2%}")
    print(f"{'tiny MLP step (batch 8, AdamW)':<34}{out['tiny_step_us']:>8.1f}")
    print(f"{'run.step of it (one process)':<34}{out['tiny_run_step_us']:>8.1f}")


if __name__ == "__main__":
    main()
