"""plait bench comm vs a raw torch.distributed loop: all-reduce busbw ratio (target within 5%).

Both run in the same processes, interleaved size by size (plait's timing helper, then a plain
loop written here with nothing but torch.distributed and time.perf_counter), so machine noise
hits both alike. Prints busbw per size and plait/raw.

    PYTHONPATH=. python bench/comm_busbw.py [--nproc 2] [--min-bytes 1K] [--max-bytes 64M]
"""

from __future__ import annotations

import argparse
import time


def raw_busbw(size: int, n: int, iters: int, warmup: int) -> float:
    """nccl-tests' all-reduce busbw from a loop with no plait code in it."""
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
    return t.numel() * 4 / mine.item() / 1e9 * 2 * (n - 1) / n


def worker(rank: int, world: int, sizes: list[int], iters: int, warmup: int,
           rounds: int) -> list[dict]:
    """Per size, ``rounds`` interleaved measurements (plait first on even rounds, raw first on
    odd ones); the median of each side is reported, so one noisy burst moves neither."""
    import statistics

    from plait.comm.bench import bench_worker
    out = []
    for size in sizes:
        ours, raw, size_bytes = [], [], size
        for r in range(rounds):
            for side in (("plait", "raw") if r % 2 == 0 else ("raw", "plait")):
                if side == "plait":
                    row = bench_worker(rank, world, ["all_reduce"], [size], iters, warmup)[0]
                    ours.append(row["busbw_gbps"])
                    size_bytes = row["size_bytes"]
                else:
                    raw.append(raw_busbw(size, world, iters, warmup))
        out.append({"size_bytes": size_bytes, "plait_busbw": statistics.median(ours),
                    "raw_busbw": statistics.median(raw)})
    return out


def main(argv: list[str] | None = None) -> int:
    from plait.comm.bench import parse_size, size_sweep, validate_world
    from plait.spawn import run_distributed
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--min-bytes", default="1K")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="interleaved repetitions per size")
    args = p.parse_args(argv)
    validate_world(args.nproc)
    sizes = size_sweep(parse_size(args.min_bytes), parse_size(args.max_bytes))
    rows = run_distributed(worker, args.nproc, sizes, args.iters, args.warmup, args.rounds,
                          timeout=3600)[0]
    print(f"{'size':>10} {'plait busbw':>12} {'raw busbw':>12} {'plait/raw':>10}")
    for r in rows:
        print(f"{r['size_bytes']:>10} {r['plait_busbw']:>12.4f} {r['raw_busbw']:>12.4f} "
              f"{r['plait_busbw'] / r['raw_busbw']:>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
