"""Measure this machine and write a cluster profile the planner can use (``plait plan --calibrate``).

What is measured, and why each is enough:
  * matmul FLOP/s on one thread in fp32 (large square GEMM): the "peak" of one CPU device, since
    plait runs one single-threaded process per device;
  * the compute efficiency of a real block: forward + backward of the reference transformer's
    block at the given shape, FLOPs counted as the cost model counts them, over that peak;
  * memory bandwidth (a large copy), for the optimizer term;
  * all-reduce latency (small message) and bus bandwidth (large message) over gloo on ``world``
    local processes, through :func:`plait.spawn.run_distributed`.
Figures are medians of a few repetitions; the profile records how they were taken.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

from .hardware import GB, Cluster


def _median_time(fn, repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_matmul(n: int = 512, threads: int = 1) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = _median_time(lambda: a @ b, repeats=7)
    return 2 * n ** 3 / t


@dataclass(frozen=True)
class LineFit:
    """``time = slope * x + intercept`` fitted robustly; ``residual`` is the median relative
    misfit |t - fit| / t over the points (how well one line explains them)."""

    slope: float
    intercept: float
    residual: float
    points: int


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> LineFit:
    """Theil-Sen fit: the median of all pairwise slopes, then the median intercept.

    Why not two points or least squares: on a shared machine a timing is only ever inflated
    (another process took the core), so single points are outliers, not Gaussian noise. The
    median of slopes ignores up to ~29% of bad points. The intercept (fixed time: launches,
    Python) cannot be negative; if the data say it is, it is clamped to 0 and the slope refitted
    through the origin (median of y/x), so a clamped fit still passes through the bulk.
    """
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"fit_line needs >= 2 paired points, got {len(xs)} x and {len(ys)} y")
    if len(set(xs)) < 2:
        raise ValueError(f"fit_line needs >= 2 distinct x values, got {sorted(set(xs))}")
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i])
              for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    slope = max(statistics.median(slopes), 0.0)
    intercept = statistics.median(y - slope * x for x, y in zip(xs, ys))
    if intercept < 0:
        intercept = 0.0
        slope = statistics.median(y / x for x, y in zip(xs, ys) if x > 0)
    residual = statistics.median(abs(y - (slope * x + intercept)) / y
                                 for x, y in zip(xs, ys) if y > 0)
    return LineFit(slope, intercept, residual, len(xs))


def measure_block(peak: float, dim: int = 128, seq: int = 64,
                  batches: Sequence[int] = (1, 2, 4, 8), blocks: Sequence[int] = (1, 2),
                  repeats: int = 5) -> tuple[float, float, LineFit]:
    """(efficiency, fixed overhead per block per microbatch in s, the fit) of forward+backward
    of the reference block.

    Stacks of ``blocks`` blocks are timed at every microbatch size in ``batches``, interleaved
    (round-robin over the grid, ``repeats`` rounds, median per point) so a burst of load lands
    on every point alike. Per-block times ``t / n_blocks`` against tokens are fitted by
    :func:`fit_line`: the slope gives the achieved FLOP/s (as a fraction of ``peak``, FLOPs
    counted as the cost model counts them), the intercept the per-block, per-microbatch
    overhead that small microbatches pay.
    """
    import torch

    from plait.models.transformer import Block, TransformerConfig

    from .model_stats import from_transformer_config

    cfg = TransformerConfig(dim=dim, n_layers=1, n_heads=4, max_seq_len=seq)
    stacks = {n: torch.nn.Sequential(*[Block(cfg) for _ in range(n)]) for n in blocks}
    per_token = 3 * from_transformer_config(cfg).block_flops_per_token(seq)
    grid = [(n, b) for n in blocks for b in batches]
    inputs = {b: torch.randn(b, seq, dim, requires_grad=True) for b in batches}
    samples: dict[tuple[int, int], list[float]] = {k: [] for k in grid}
    for rnd in range(repeats + 1):
        for n, b in grid:
            t0 = time.perf_counter()
            stacks[n](inputs[b]).sum().backward()
            if rnd:  # round 0 warms every shape up
                samples[(n, b)].append(time.perf_counter() - t0)
    xs = [b * seq for n, b in grid]
    ys = [statistics.median(samples[(n, b)]) / n for n, b in grid]
    fit = fit_line(xs, ys)
    slope = max(fit.slope, 1e-12)
    return min(1.0, per_token / slope / peak), fit.intercept, fit


def measure_memory_bandwidth(mb: int = 64) -> float:
    import torch

    src = torch.empty(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), repeats=5)
    return 2 * src.numel() * 4 / t


def _allreduce_worker(rank: int, world: int, sizes: list[int], repeats: int) -> dict[int, float]:
    import torch
    import torch.distributed as dist

    out = {}
    for size in sizes:
        buf = torch.ones(max(1, size // 4))
        dist.all_reduce(buf)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        out[size] = statistics.median(times)
    return out


def measure_allreduce(world: int = 2, small: int = 1024, large: int = 16 * 2**20,
                      repeats: int = 5) -> tuple[float, float]:
    """(per-step latency alpha in s, link bandwidth in bytes/s) from gloo all-reduce timings."""
    from plait.comm.volumes import bus_factor
    from plait.spawn import run_distributed

    results = run_distributed(_allreduce_worker, world, [small, large], repeats, timeout=120)
    t_small = max(r[small] for r in results)
    t_large = max(r[large] for r in results)
    steps = 2 * (world - 1)
    alpha = t_small / steps
    bw = large * bus_factor("all_reduce", world) / max(t_large - t_small, 1e-9)
    return alpha, bw


def calibrate(world: int = 2, name: str = "local-cpu") -> Cluster:
    """Measure this machine (CPU, gloo) and return a one-node Cluster profile."""
    if world < 2:
        raise ValueError(f"calibrate world={world} must be >= 2 to time a collective")
    peak = measure_matmul()
    eff, overhead, fit = measure_block(peak)
    hbm = measure_memory_bandwidth()
    alpha, bw = measure_allreduce(world)
    cores = os.cpu_count() or 1
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        ram = 8 * GB
    extra: dict[str, Any] = {"compute_efficiency": round(eff, 4),
                             "block_overhead_s": overhead,
                             "block_fit_residual": round(fit.residual, 4),
                             # every core computes: no background progress for collectives
                             "overlap": False,
                             # gloo runs reduce-scatter as a full all-reduce (FIELD-NOTES)
                             "reduce_scatter_factor": 2.0,
                             "measured": f"matmul 512^2 fp32 1 thread; block fwd+bwd dim=128 "
                                         f"seq=64, 1 and 2 blocks x batch 1/2/4/8, Theil-Sen fit; gloo all-reduce 1 KiB/16 MiB on {world} ranks"}
    return Cluster(name=name, device="cpu", nodes=1, devices_per_node=64,
                   memory_bytes=0.8 * ram / max(cores, 1), peak_flops={"fp32": peak},
                   intra_bw=bw, inter_bw=bw, intra_latency=alpha, inter_latency=alpha,
                   hbm_bw=hbm, reserve_bytes=0.2 * GB, compute_units=cores,
                   source="calibrated", extra=extra)
