"""gloo reduce-scatter / all-gather: torch's own vs plait's all-to-all ones (gloo_collectives).

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/gloo_collectives.py [--nproc 2] [--mib 150]

Both run in the same processes, interleaved round by round, on the same tensors, the way FSDP2
calls them (buffers from the comm's ``allocate``, the all-gather input a view of its output).
Each side gets fresh buffers per call, as FSDP2 does, so torch's side pays its allocation and
ours its pool. Prints the median ms per call, slowest rank.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any


def worker(rank: int, world: int, numel: int, rounds: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from plait.parallel.gloo_collectives import GlooAllGather, GlooReduceScatter

    k = numel // world
    x = torch.randn(world * k)
    rs, ag = GlooReduceScatter(), GlooAllGather()
    group = dist.group.WORLD

    def torch_rs() -> None:
        dist.reduce_scatter_single(torch.empty(k), x, op=dist.ReduceOp.AVG)

    def plait_rs() -> None:
        rs(rs.allocate((k,), dtype=x.dtype, device=x.device), x, group, dist.ReduceOp.AVG)

    def torch_ag() -> None:
        out = torch.empty(world * k)
        own = out.narrow(0, rank * k, k)
        own.copy_(x[:k])
        dist.all_gather_single(out, own)

    def plait_ag() -> None:
        out = ag.allocate((world * k,), dtype=x.dtype, device=x.device)
        own = out.narrow(0, rank * k, k)
        own.copy_(x[:k])
        ag(out, own, group)

    cases: dict[str, Callable[[], None]] = {"reduce_scatter torch": torch_rs,
                                            "reduce_scatter plait": plait_rs,
                                            "all_gather torch": torch_ag,
                                            "all_gather plait": plait_ag}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for f in cases.values():  # warm-up
        f()
    for _ in range(rounds):
        for name, f in cases.items():
            dist.barrier()
            t0 = time.perf_counter()
            f()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(t.item())
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main() -> None:
    from plait.spawn import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--mib", type=float, default=150.0, help="full buffer size (fp32)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    numel = int(args.mib * 2**20 / 4)
    res: dict[str, Any] = run_distributed(worker, args.nproc, numel, args.rounds,
                                          timeout=600)[0]
    print(f"gloo, {args.nproc} processes, fp32, {args.mib:g} MiB full buffer, median of "
          f"{args.rounds} rounds (slowest rank)")
    for op in ("reduce_scatter", "all_gather"):
        t, p = res[f"{op} torch"], res[f"{op} plait"]
        print(f"  {op:<15} torch {t:8.1f} ms   plait all-to-all {p:8.1f} ms   "
              f"{t / p:5.2f}x")


if __name__ == "__main__":
    main()
