"""What one small collective costs between processes once they have all arrived, beside one
that waits for a rank arriving later (the bookkeeping collectives of a step are a few floats).

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/rendezvous_cost.py [--nproc 2] [--calls 300]

Why: a pipeline step used to bring the last stage's (loss sum, count) to the other stages with
a broadcast and then take the step guard's agreement (an all-reduce MAX of three numbers); it now
does both in one all-reduce of five numbers. This times, after a barrier (the ranks arrive
together): one all-reduce of five floats, and a broadcast of three then an all-reduce of three.
Prints each rank's median and minimum in ms, and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def job(rank: int, world: int, calls: int) -> dict[str, tuple[float, float]]:
    buffer = torch.zeros(5)
    for _ in range(20):  # gloo's first calls set up its pairs
        dist.all_reduce(buffer)
    one, two = [], []
    for _ in range(calls):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        one.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        dist.broadcast(buffer[:3], src=world - 1)
        dist.all_reduce(buffer[:3], op=dist.ReduceOp.MAX)
        two.append(time.perf_counter() - start)
    return {"one all-reduce": (statistics.median(one), min(one)),
            "broadcast + all-reduce": (statistics.median(two), min(two))}


def main() -> None:
    from plait.spawn import run_distributed

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args()
    start = os.getloadavg()
    out = run_distributed(job, a.nproc, a.calls, timeout=600, env={"OMP_NUM_THREADS": "1"})
    end = os.getloadavg()
    print(f"{a.nproc} processes (gloo), {a.calls} calls each after a barrier; load average "
          f"{start[0]:.2f} at start, {end[0]:.2f} at end")
    for rank, times in enumerate(out):
        print(f"rank {rank}: " + "; ".join(f"{name} median {1e3 * m:.3f} ms (min {1e3 * lo:.3f})"
                                         for name, (m, lo) in times.items()))


if __name__ == "__main__":
    main()
