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
from typing import Any

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


def measure_block(peak: float, dim: int = 128, seq: int = 64,
                  batches: tuple[int, int] = (1, 8)) -> tuple[float, float]:
    """(efficiency, fixed overhead in s) of forward+backward of one reference block.

    Timed at two microbatch sizes: the slope gives the achieved FLOP/s (as a fraction of
    ``peak``, FLOPs counted as the cost model counts them), the intercept the per-block,
    per-microbatch overhead (launches, Python) that small microbatches pay.
    """
    import torch

    from plait.models.transformer import Block, TransformerConfig

    from .model_stats import from_transformer_config

    cfg = TransformerConfig(dim=dim, n_layers=1, n_heads=4, max_seq_len=seq)
    block = Block(cfg)
    per_token = 3 * from_transformer_config(cfg).block_flops_per_token(seq)
    times = []
    for batch in batches:
        x = torch.randn(batch, seq, dim, requires_grad=True)
        times.append(_median_time(lambda: block(x).sum().backward(), repeats=9))
    (b0, b1), (t0, t1) = batches, times
    slope = max((t1 - t0) / ((b1 - b0) * seq), 1e-12)     # s per token
    overhead = max(t0 - slope * b0 * seq, 0.0)
    return min(1.0, per_token / slope / peak), overhead


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
    eff, overhead = measure_block(peak)
    hbm = measure_memory_bandwidth()
    alpha, bw = measure_allreduce(world)
    cores = os.cpu_count() or 1
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        ram = 8 * GB
    extra: dict[str, Any] = {"compute_efficiency": round(eff, 4),
                             "block_overhead_s": overhead,
                             # every core computes: no background progress for collectives
                             "overlap": False,
                             # gloo runs reduce-scatter as a full all-reduce (FIELD-NOTES)
                             "reduce_scatter_factor": 2.0,
                             "measured": f"matmul 512^2 fp32 1 thread; block fwd+bwd dim=128 "
                                         f"seq=64 at batch 1 and 8; gloo all-reduce 1 KiB/16 MiB on {world} ranks"}
    return Cluster(name=name, device="cpu", nodes=1, devices_per_node=64,
                   memory_bytes=0.8 * ram / max(cores, 1), peak_flops={"fp32": peak},
                   intra_bw=bw, inter_bw=bw, intra_latency=alpha, inter_latency=alpha,
                   hbm_bw=hbm, reserve_bytes=0.2 * GB, compute_units=cores,
                   source="calibrated", extra=extra)
