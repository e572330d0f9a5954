"""How fast a transformer block trains on this device: the compute efficiency, measured; and
what one aten op costs whatever its size (:func:`measure_op_latency`).

``measure_block`` times forward + backward of the reference block at several microbatch sizes
and fits time against tokens (:func:`plait.planner.cpu.derive.fit_line`): the slope is the
achieved FLOP/s, the intercept the fixed cost per block and microbatch. On a CPU it feeds
``plait plan --calibrate``'s whole-machine profile (:mod:`plait.planner.cpu.probes`); on an
accelerator (CUDA, ROCm, XLA through ``torch.accelerator``) :func:`calibrate_accelerator` turns
it into the compute efficiency of a cluster preset, replacing the published figure with this
machine's.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

from .cpu.derive import LineFit, fit_line
from .hardware import Cluster


def _sync(device: str) -> None:
    if device != "cpu":
        import torch

        torch.accelerator.synchronize()


def measure_block(peak: float, dim: int = 128, seq: int = 64, n_heads: int = 4,
                  batches: Sequence[int] = (1, 2, 4, 8), blocks: Sequence[int] = (1, 2),
                  repeats: int = 5, device: str = "cpu",
                  bf16: bool = False) -> tuple[float, float, LineFit]:
    """(efficiency, fixed overhead per block per microbatch in s, the fit) of forward+backward
    of the reference block.

    Stacks of ``blocks`` blocks are timed at every microbatch size in ``batches``, interleaved
    (round-robin over the grid, ``repeats`` rounds, median per point) so a burst of load lands
    on every point alike. Per-block times ``t / n_blocks`` against tokens are fitted by
    :func:`fit_line`: the slope gives the achieved FLOP/s (as a fraction of ``peak``, FLOPs
    counted as the cost model counts them), the intercept the per-block, per-microbatch
    overhead that small microbatches pay. ``device``/``bf16``: where and in what dtype
    (autocast) the block runs; the device is synchronized around every timing.
    """
    import torch

    from plait.models.transformer import Block, TransformerConfig

    from .model_stats import from_transformer_config

    cfg = TransformerConfig(dim=dim, n_layers=1, n_heads=n_heads, max_seq_len=seq)
    stacks = {n: torch.nn.Sequential(*[Block(cfg) for _ in range(n)]).to(device)
              for n in blocks}
    per_token = 3 * from_transformer_config(cfg).block_flops_per_token(seq)
    grid = [(n, b) for n in blocks for b in batches]
    inputs = {b: torch.randn(b, seq, dim, device=device, requires_grad=True) for b in batches}
    samples: dict[tuple[int, int], list[float]] = {k: [] for k in grid}
    for rnd in range(repeats + 1):
        for n, b in grid:
            _sync(device)
            t0 = time.perf_counter()
            with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16,
                                enabled=bf16):
                out = stacks[n](inputs[b]).float().sum()
            out.backward()
            _sync(device)
            if rnd:  # round 0 warms every shape up
                samples[(n, b)].append(time.perf_counter() - t0)
    xs = [b * seq for n, b in grid]
    ys = [statistics.median(samples[(n, b)]) / n for n, b in grid]
    fit = fit_line(xs, ys)
    slope = max(fit.slope, 1e-12)
    return min(1.0, per_token / slope / peak), fit.intercept, fit



def measure_op_latency(depths: Sequence[int] = (4, 8, 16, 32), repeats: int = 9,
                       device: str = "cpu") -> float:
    """Seconds per aten op on ``device`` when the ops do next to no arithmetic: forward and
    backward of a chain of ``depth`` tiny Linear + tanh layers (one sample of 8 features), its
    ops counted as the planner counts a model's (:func:`plait.planner.op_count.op_counter`),
    time over ops fitted across depths (:func:`fit_line`'s slope, so what each step pays once,
    autograd's start, stays out). On a CPU that is the host's dispatch; on an accelerator,
    synchronized once per step, the longer of the host's dispatch and launch and the device's
    time per kernel."""
    import torch

    from .op_count import op_counter

    if device == "cpu":
        torch.set_num_threads(1)
    x = torch.randn(1, 8, device=device)
    ops, times = [], []
    for depth in depths:
        torch.manual_seed(0)
        chain = torch.nn.Sequential(*[m for _ in range(depth)
                                      for m in (torch.nn.Linear(8, 8), torch.nn.Tanh())])
        chain = chain.to(device)

        def step(chain: torch.nn.Module = chain) -> None:
            chain(x).sum().backward()
            chain.zero_grad(set_to_none=True)
        counter = op_counter()
        with counter:
            step()
        ops.append(float(counter.ops))
        samples = []
        for rnd in range(repeats + 2):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            if rnd >= 2:  # two warm-up steps
                samples.append(time.perf_counter() - t0)
        times.append(statistics.median(samples))
    return fit_line(ops, times).slope


def calibrate_accelerator(cluster: Cluster, device: str, *, dim: int = 4096, seq: int = 2048,
                          n_heads: int = 32) -> Cluster:
    """``cluster`` with this device's measured compute efficiency in bf16 (against the preset's
    bf16 peak): a block of the given width timed at microbatch 1, 2 and 4 on ``device``."""
    peak = cluster.peak("bf16")
    eff, overhead, fit = measure_block(peak, dim=dim, seq=seq, n_heads=n_heads,
                                       batches=(1, 2, 4), device=device, bf16=True)
    op_latency = measure_op_latency(device=device)
    extra = {k: v for k, v in (cluster.extra or {}).items()
             if not k.startswith("compute_efficiency")}
    extra.update(compute_efficiency=float(eff),
                 compute_efficiency_source=f"calibrated on {device}: block dim {dim}, seq {seq}, "
                                           f"bf16, fit residual {fit.residual:.1%}",
                 block_fit_residual=round(fit.residual, 4),
                 op_latency_source=f"calibrated on {device}: {op_latency * 1e6:.3g} us per op "
                                   f"(plait.planner.block_probe.measure_op_latency)")
    return dataclasses.replace(cluster, extra=extra, source="calibrated", op_latency=op_latency)
