"""plait bench comm vs a raw torch.distributed loop: all-reduce busbw ratio (target within 5%).

Both run in the same processes on the same sizes: plait's sweep worker (``plait bench comm``'s
``bench_worker``, one op and one size per call) and a plain loop written here with nothing but
``torch.distributed`` and ``time.perf_counter``. Per size:

* the number of calls per measurement is calibrated once (raw loop, slowest rank) so that one
  measurement lasts at least ``--min-time`` (250 ms by default: at 50 ms the per-round ratio
  still swung by +-10% on a quiet 2-core machine), so a timer's resolution and one scheduler
  hiccup cannot dominate it; both sides then use that same count;
* ``--rounds`` rounds in ABBA order (plait, raw, raw, plait, plait, raw, ...), so that drift in
  machine load hits both sides alike;
* reported: each side's median busbw, the median of the per-round ratios plait/raw with its
  interquartile range, and best/best (each side's highest busbw: the least disturbed run).

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/comm_busbw.py [--nproc 2] [--min-bytes 1K] \\
        [--max-bytes 16M] [--rounds 21] [--min-time 0.25]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time


def raw_seconds(size: int, iters: int, warmup: int) -> float:
    """Seconds per all-reduce of ``size`` bytes (fp32), slowest rank: a loop with no plait
    code in it (the same structure as nccl-tests: warm up, barrier, time ``iters`` calls)."""
    import torch
    import torch.distributed as dist
    t = torch.ones(max(1, size // 4))
    for _ in range(warmup):
        dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    mine = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine.item())


def calibrate(size: int, min_time: float, warmup: int) -> int:
    """Calls per measurement so that one lasts >= ``min_time`` seconds (same on all ranks:
    every rank derives it from the same slowest-rank time)."""
    per_call = raw_seconds(size, 3, warmup)
    return max(1, math.ceil(min_time / max(per_call, 1e-9)))


def worker(rank: int, world: int, sizes: list[int], iters: int | None, warmup: int,
           rounds: int, min_time: float) -> list[dict]:
    from plait.comm.bench import bench_worker
    from plait.comm.volumes import bus_factor
    factor = bus_factor("all_reduce", world)
    out = []
    for size in sizes:
        n = iters or calibrate(size, min_time, warmup)
        ours: list[float] = []
        raw: list[float] = []
        size_bytes = size
        for r in range(rounds):
            for side in ("plait", "raw") if r % 2 == 0 else ("raw", "plait"):
                if side == "plait":
                    row = bench_worker(rank, world, ["all_reduce"], [size], n, warmup)[0]
                    ours.append(row["busbw_gbps"])
                    size_bytes = row["size_bytes"]
                else:
                    t = raw_seconds(size, n, warmup)
                    raw.append(max(1, size // 4) * 4 / t / 1e9 * factor)
        ratios = [a / b for a, b in zip(ours, raw, strict=True)]
        q1, mid, q3 = (statistics.quantiles(ratios, n=4, method="inclusive") if rounds > 1
                       else (ratios[0],) * 3)
        out.append({"size_bytes": size_bytes, "iters": n, "plait_busbw": statistics.median(ours),
                    "raw_busbw": statistics.median(raw), "ratio": mid, "q1": q1, "q3": q3,
                    "best_ratio": max(ours) / max(raw)})
    return out


def main(argv: list[str] | None = None) -> int:
    from plait.comm.bench import parse_size, size_sweep, validate_world
    from plait.spawn import run_distributed
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--min-bytes", default="1K")
    p.add_argument("--max-bytes", default="16M")
    p.add_argument("--rounds", type=int, default=21, help="ABBA rounds per size")
    p.add_argument("--min-time", type=float, default=0.25,
                   help="seconds per measurement; sets the calls per size")
    p.add_argument("--iters", type=int, default=None,
                   help="fixed calls per measurement instead of --min-time")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    validate_world(args.nproc)
    if args.rounds < 1 or (args.iters is not None and args.iters < 1) or args.min_time <= 0:
        p.error("--rounds and --iters must be >= 1, --min-time > 0")
    sizes = size_sweep(parse_size(args.min_bytes), parse_size(args.max_bytes))
    rows = run_distributed(worker, args.nproc, sizes, args.iters, args.warmup, args.rounds,
                           args.min_time, timeout=3600)[0]
    print(f"all-reduce busbw GB/s, {args.nproc} ranks, {args.rounds} ABBA rounds per size; "
          f"plait/raw = median of per-round ratios [q1, q3]; best = best/best")
    print(f"{'size':>10} {'iters':>6} {'plait busbw':>12} {'raw busbw':>12} {'plait/raw':>10} "
          f"{'q1':>7} {'q3':>7} {'best':>7}")
    for r in rows:
        print(f"{r['size_bytes']:>10} {r['iters']:>6} {r['plait_busbw']:>12.4f} "
              f"{r['raw_busbw']:>12.4f} {r['ratio']:>10.3f} {r['q1']:>7.3f} {r['q3']:>7.3f} "
              f"{r['best_ratio']:>7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
