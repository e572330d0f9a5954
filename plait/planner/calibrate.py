"""Measure this machine, write a cluster profile the planner can use (``plait plan --calibrate``).

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
from collections.abc import Sequence
from dataclasses import dataclass
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
    intercept = statistics.median(y - slope * x for x, y in zip(xs, ys, strict=True))
    if intercept < 0:
        intercept = 0.0
        slope = statistics.median(y / x for x, y in zip(xs, ys, strict=True) if x > 0)
    residual = statistics.median(abs(y - (slope * x + intercept)) / y
                                 for x, y in zip(xs, ys, strict=True) if y > 0)
    return LineFit(slope, intercept, residual, len(xs))


def measure_block(peak: float, dim: int = 128, seq: int = 64, n_heads: int = 4,
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

    cfg = TransformerConfig(dim=dim, n_layers=1, n_heads=n_heads, max_seq_len=seq)
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
    from plait.comm.volumes import bus_factor
    from plait.spawn import run_distributed

    if world < 2:
        raise ValueError(f"calibrate world={world} must be >= 2 to time a collective")
    peak = measure_matmul()
    eff, overhead, fit = measure_block(peak)
    hbm = measure_memory_bandwidth()
    raw = median_of(run_distributed(measure_group, world, timeout=300))
    alpha = raw[f"all_reduce@{SMALL_BYTES}"] / (2 * (world - 1))
    bw = (LARGE_BYTES - SMALL_BYTES) * bus_factor("all_reduce", world) / max(
        raw[f"all_reduce@{LARGE_BYTES}"] - raw[f"all_reduce@{SMALL_BYTES}"], 1e-9)
    derived = derive_constants(raw, alpha=alpha, bw=bw, rate=peak * eff)
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
                             # the bandwidth below is the achieved bus bandwidth already
                             "link_efficiency": 1.0,
                             **{k: float(v) for k, v in derived.items()},
                             "measured": f"matmul 512^2 fp32 1 thread; block fwd+bwd dim=128 "
                                         f"seq=64, 1 and 2 blocks x batch 1/2/4/8, Theil-Sen "
                                         f"fit; on {world} gloo ranks: all-reduce / all-gather "
                                         f"/ reduce-scatter / broadcast at 1 KiB and 4 MiB, "
                                         f"clip+AdamW over 8 and 32 tensors (plain, DTensor), "
                                         f"2 FSDP2 block units vs plain, the reference model with "
                                         f"1 and 2 blocks plain and TP+SP, 1 and 2 blocks "
                                         f"with the zero-bubble backward split "
                                         f"(calibrate.measure_group)"}
    return Cluster(name=name, device="cpu", nodes=1, devices_per_node=64,
                   memory_bytes=0.8 * ram / max(cores, 1), peak_flops={"fp32": peak},
                   intra_bw=bw, inter_bw=bw, intra_latency=alpha, inter_latency=alpha,
                   hbm_bw=hbm, reserve_bytes=0.2 * GB, compute_units=cores,
                   source="calibrated", extra=extra)


# ------------------------------------------------------------------------------------------
# Measurements that need a process group: what a training step costs beyond its blocks' FLOPs
# and beyond ring all-reduce bandwidth. Each is timed on the same world as the job it explains
# (same number of processes sharing the same cores), in interleaved rounds, medians per point.
# ``measure_group`` returns raw timings only; ``derive_constants`` (pure, unit-tested) turns them
# into cost-model constants, so the arithmetic can be checked by hand.
# ------------------------------------------------------------------------------------------
SMALL_BYTES = 1024
LARGE_BYTES = 4 * 2**20
TENSOR_COUNTS = (8, 32)      # parameter tensors in the optimizer micro-benchmark
FSDP_UNITS = 2               # fully_shard-ed reference blocks in the FSDP2 micro-benchmark
PROBE = dict(dim=128, n_heads=4, vocab=256, seq=64, batch=4)  # the TP / outside-block probe


def _interleaved(fns: dict, rounds: int) -> dict:
    """Median seconds per named callable, timed round-robin (round 0 warms up)."""
    import torch.distributed as dist

    samples: dict = {k: [] for k in fns}
    for rnd in range(rounds + 1):
        for key, fn in fns.items():
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            fn()
            if rnd:
                samples[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def _collective_timings(world: int, rounds: int) -> dict:
    """Seconds per call of each collective plait's runtime issues, at a small and a large
    payload (payload convention of plait.comm.volumes), and of a burst of asynchronous small
    broadcasts (how ZeroRedundancyOptimizer sends parameters: one per tensor, waited together)."""
    import torch
    import torch.distributed as dist

    from plait.parallel.gloo_collectives import (
        GlooAllGather,
        GlooReduceScatter,
        gloo_collectives_apply,
    )

    group = dist.group.WORLD
    # Time the all-gather / reduce-scatter the runtime really issues: on gloo, FSDP2's are
    # replaced by all-to-all ones (plait.parallel.gloo_collectives), 2-3x faster than gloo's own.
    if gloo_collectives_apply(group, "cpu"):
        ag, rs = GlooAllGather(), GlooReduceScatter()
        gather = lambda full, part: ag(full, part, group)  # noqa: E731
        scatter = lambda part, full: rs(part, full, group)  # noqa: E731
    else:
        gather, scatter = dist.all_gather_into_tensor, dist.reduce_scatter_tensor
    fns = {}
    for size in (SMALL_BYTES, LARGE_BYTES):
        n = max(world, size // 4 // world * world)
        full, part = torch.ones(n), torch.ones(n // world)
        fns[("all_reduce", size)] = lambda full=full: dist.all_reduce(full)
        fns[("all_gather", size)] = lambda full=full, part=part: gather(full, part)
        fns[("reduce_scatter", size)] = lambda full=full, part=part: scatter(part, full)
        fns[("broadcast", size)] = lambda full=full: dist.broadcast(full, src=0)
    burst = [torch.ones(SMALL_BYTES // 4) for _ in range(16)]

    def async_broadcasts():
        for w in [dist.broadcast(t, src=i % world, async_op=True) for i, t in enumerate(burst)]:
            w.wait()
    fns[("broadcast_async", SMALL_BYTES)] = async_broadcasts
    got = _interleaved(fns, rounds)
    out = {f"{op}@{size}": t for (op, size), t in got.items()}
    out["broadcast_async@1024"] = got[("broadcast_async", SMALL_BYTES)] / len(burst)
    return out


def _tensor_step_timings(world: int, rounds: int) -> dict:
    """Seconds for gradient clipping + AdamW (per-tensor loop, as the bench and the runtime's
    default) + zero_grad over N small parameter tensors, plain and DTensor (sharded on a 1-D
    mesh of the whole group, as FSDP2 / TP leave them)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from plait.train import clip_grad_norm

    mesh = init_device_mesh("cpu", (world,))
    fns = {}
    for kind in ("plain", "dtensor"):
        for n in TENSOR_COUNTS:
            params = []
            for _ in range(n):
                t = torch.randn(16 * world, 16)
                p = torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)]) if kind == "dtensor"
                                       else t)
                params.append(p)
            opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)

            def step(params=params, opt=opt):
                for p in params:
                    p.grad = torch.ones_like(p)
                clip_grad_norm(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            fns[(kind, n)] = step
    got = _interleaved(fns, rounds)
    return {f"{kind}@{n}": t for (kind, n), t in got.items()}


def _fsdp_timings(world: int, rounds: int) -> dict:
    """Seconds for forward+backward of FSDP_UNITS reference blocks (PROBE dims), each its own
    fully_shard unit, and of the same plain stack, in three FSDP2 variants: ZeRO-2 with the
    gradient sync off (one all-gather per unit and micro-step, no reduce-scatter), ZeRO-2 with
    it on (plus a reduce-scatter per unit) and ZeRO-3 (plus a second all-gather per unit, in
    backward). The differences are FSDP2's cost per unit and micro-step (hooks, per-tensor
    copy-in/out, the gather), per gradient reduce (the post-backward: copy-in, reduce-scatter,
    writing the sharded gradient) and per backward re-gather (the gather and its copy-out).

    Why the reduce and the re-gather are measured here too, not priced from the collective
    micro-benchmarks alone: at world 2 on this VM FSDP2's post-backward cost 1-4 ms per unit
    and ZeRO-3's re-gather ~3 ms, 2-4x the bare collectives, and the model priced ZeRO-2/3 8-28%
    under their measured steps (runs 9-16, docs/planner.md). Real blocks, not toy layers, since
    FSDP2's copies scale with the unit's tensors; a batch of PROBE's size, as the layouts run
    microbatches of 1-8 sequences."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from plait.models.transformer import Block, TransformerConfig
    from plait.parallel.gloo_collectives import use_gloo_collectives

    p = PROBE
    cfg = TransformerConfig(vocab_size=p["vocab"], dim=p["dim"], n_layers=1,
                            n_heads=p["n_heads"], max_seq_len=p["seq"])
    mesh = init_device_mesh("cpu", (world,))

    def stack():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[Block(cfg) for _ in range(FSDP_UNITS)])

    def sharded(reshard: bool, sync: bool) -> torch.nn.Module:
        module = stack()
        for unit in module:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(module, mesh=mesh, reshard_after_forward=False)
        use_gloo_collectives(module, mesh.get_group(), "cpu")  # as plait.parallel.fsdp does
        module.set_requires_gradient_sync(sync)
        return module

    plain = stack()
    mods = {"fsdp_nosync": sharded(False, False), "fsdp_sync": sharded(False, True),
            "fsdp_zero3": sharded(True, True)}
    unit_bytes = sum(t.numel() for t in plain[0].parameters()) * 4
    x = torch.randn(p["batch"], p["seq"], p["dim"])

    def step(module: torch.nn.Module) -> None:
        module(x).sum().backward()
        module.zero_grad(set_to_none=True)  # as a training step leaves them
    fns = {"fsdp_plain": lambda: step(plain)}
    fns.update({k: (lambda m=m: step(m)) for k, m in mods.items()})
    out = _interleaved(fns, rounds)
    out["fsdp_unit_bytes"] = unit_bytes
    return out


def _probe_timings(world: int, rounds: int) -> dict:
    """Seconds for forward + loss + backward of the reference transformer (PROBE shape) with 1
    and 2 blocks, plain and under plait's TP+SP at tp=2 (when the world is even): per-block and
    outside-the-blocks costs by difference, the latter being embedding, head and loss."""
    import torch

    from plait.mesh import build_mesh
    from plait.models.transformer import TransformerConfig, build, lm_loss
    from plait.parallel.tensor import apply_tensor_parallel
    from plait.plan import Plan
    from plait.train import loss_context

    p = PROBE
    fns = {}
    x = torch.randint(0, p["vocab"], (p["batch"], p["seq"] + 1),
                      generator=torch.Generator().manual_seed(0))
    kinds = ["plain"] + (["tp"] if world % 2 == 0 else [])
    for kind in kinds:
        for n in (1, 2):
            cfg = TransformerConfig(vocab_size=p["vocab"], dim=p["dim"], n_layers=n,
                                    n_heads=p["n_heads"], max_seq_len=p["seq"])
            model = build(cfg, seed=0)
            if kind == "tp":
                plan = Plan(tp=2, sp=True, dp_replicate=world // 2)
                model = apply_tensor_parallel(model, build_mesh(plan, "cpu", world), plan)

            def run(model=model):
                with loss_context(model):
                    loss = lm_loss(model(x[:, :-1]), x[:, 1:])
                    if hasattr(loss, "full_tensor"):
                        loss = loss.full_tensor()
                    loss.backward()
                model.zero_grad(set_to_none=True)
            fns[(kind, n)] = run
    got = _interleaved(fns, rounds)
    return {f"probe_{kind}@{n}": t for (kind, n), t in got.items()}


def _zero_bubble_timings(rounds: int) -> dict:
    """Seconds for forward + backward of 1 and 2 reference blocks (PROBE shape), the backward
    whole (``zb_full``) and split the way torch's zero-bubble schedules run it
    (``stage_backward_input`` then ``stage_backward_weight``, ``zb_split``): the split's cost
    per call and per block by difference. Empty where this torch has no such functions (they are
    private to ``torch.distributed.pipelining``)."""
    import torch

    try:
        from torch.distributed.pipelining._backward import (
            stage_backward_input,
            stage_backward_weight,
        )
    except ImportError:  # pragma: no cover - another torch
        return {}
    from plait.models.transformer import Block, TransformerConfig

    p = PROBE
    cfg = TransformerConfig(vocab_size=p["vocab"], dim=p["dim"], n_layers=1,
                            n_heads=p["n_heads"], max_seq_len=p["seq"])
    x0 = torch.randn(p["batch"], p["seq"], p["dim"])
    fns = {}
    for n in (1, 2):
        torch.manual_seed(0)
        stack = torch.nn.Sequential(*[Block(cfg) for _ in range(n)])

        def full(stack=stack):
            x = x0.clone().requires_grad_()
            y = stack(x)
            torch.autograd.backward(y, torch.ones_like(y))
            stack.zero_grad(set_to_none=True)

        def split(stack=stack):
            x = x0.clone().requires_grad_()
            y = stack(x)
            _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], stack.parameters())
            stage_backward_weight(stack.parameters(), groups)
            stack.zero_grad(set_to_none=True)
        fns[("full", n)], fns[("split", n)] = full, split
    got = _interleaved(fns, rounds)
    return {f"zb_{kind}@{n}": t for (kind, n), t in got.items()}


def measure_group(rank: int, world: int, rounds: int = 5) -> dict:
    """Raw timings (seconds) of every group micro-benchmark on this rank; see derive_constants."""
    import torch

    torch.manual_seed(0)
    out = {"world": world}
    out.update(_collective_timings(world, rounds))
    out.update(_tensor_step_timings(world, rounds))
    out.update(_fsdp_timings(world, rounds))
    out.update(_probe_timings(world, rounds))
    out.update(_zero_bubble_timings(rounds))
    return out


def derive_constants(raw: dict, *, alpha: float, bw: float, rate: float) -> dict:
    """Cost-model constants from ``measure_group``'s timings (medians over ranks).

    ``alpha``/``bw``: the all-reduce's per-step latency and bus bandwidth on this world;
    ``rate``: achieved block FLOP/s (peak x efficiency). Every term is what the measurement shows
    beyond what the cost model already prices, clamped at 0 (noise cannot make a cost negative):

    * per collective op: the per-byte slope between the two payloads over the ring ideal at
      ``bw`` (``<op>_factor``), and the small-payload time beyond ``alpha x ring steps`` and its
      bytes (``<op>_call_s``); broadcasts from the asynchronous burst, as ZeroRedundancyOptimizer
      issues them (may be below the latency: they overlap);
    * ``tensor_step_s`` / ``dtensor_step_s``: slope of clip + AdamW + zero_grad over tensors;
    * ``fsdp_unit_s``: FSDP2 stack minus plain stack per unit, minus one modelled all-gather;
      ``fsdp_reduce_s``: with the gradient sync on minus off, per unit, minus one modelled
      reduce-scatter; ``fsdp_regather_s``: ZeRO-3 minus ZeRO-2 (both syncing), per unit, minus
      one modelled all-gather;
    * ``micro_overhead_s``: the probe model's time outside its blocks (1 block minus the 2-1
      difference) minus the head's FLOPs at ``rate``;
    * ``tp_block_overhead_s``: the TP+SP per-block time minus half the plain per-block time
      minus the block's modelled TP collectives; ``tp_micro_overhead_s`` the same outside the
      blocks (embedding, head, loss_parallel collectives modelled);
    * ``zb_backward_factor``: the zero-bubble split's extra time per block (2-block extra minus
      1-block extra) over a block's backward (2/3 of its forward + backward); ``zb_call_s``: the
      1-block extra minus that per-block part (the per-call graph walk).
    """
    import dataclasses

    from plait.comm.volumes import Traffic, bus_factor

    from .cost import DEFAULT_CONSTANTS, collective_time, tp_block_traffic, tp_end_traffic

    world = int(raw["world"])
    out: dict[str, float] = {}
    span = LARGE_BYTES - SMALL_BYTES
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        t_s, t_l = raw[f"{op}@{SMALL_BYTES}"], raw[f"{op}@{LARGE_BYTES}"]
        slope = max(t_l - t_s, 0.0) / span                  # s per payload byte
        ideal = bus_factor(op, world) / bw
        steps = 2 * (world - 1) if op == "all_reduce" else world - 1
        if op != "all_reduce":
            out[f"{op}_factor"] = slope / ideal if ideal else 1.0
        small = raw["broadcast_async@1024"] if op == "broadcast" else t_s
        out[f"{op}_call_s"] = max(-alpha * steps, small - alpha * steps - SMALL_BYTES * slope)
    out["all_reduce_call_s"] = max(0.0, out["all_reduce_call_s"])
    for kind, key in (("plain", "tensor_step_s"), ("dtensor", "dtensor_step_s")):
        n1, n2 = TENSOR_COUNTS
        out[key] = max(0.0, (raw[f"{kind}@{n2}"] - raw[f"{kind}@{n1}"]) / (n2 - n1))
    # what the cost model would now charge for a collective, with the factors above
    from .hardware import Cluster

    cluster = Cluster(name="probe", device="cpu", nodes=1, devices_per_node=world,
                      memory_bytes=1e12, peak_flops={"fp32": rate}, intra_bw=bw, inter_bw=bw,
                      intra_latency=alpha, inter_latency=alpha)
    c = dataclasses.replace(DEFAULT_CONSTANTS, link_efficiency=1.0,
                            **{k: v for k, v in out.items()})
    gather = collective_time(Traffic("dp_shard", "all_gather", raw["fsdp_unit_bytes"], 1, world),
                             cluster, 1, c)
    out["fsdp_unit_s"] = max(0.0, (raw["fsdp_nosync"] - raw["fsdp_plain"]) / FSDP_UNITS - gather)
    if "fsdp_sync" in raw:  # profiles before run 17 did not measure them
        scatter = collective_time(Traffic("dp_shard", "reduce_scatter", raw["fsdp_unit_bytes"], 1,
                                          world), cluster, 1, c)
        out["fsdp_reduce_s"] = max(0.0, (raw["fsdp_sync"] - raw["fsdp_nosync"]) / FSDP_UNITS
                                   - scatter)
        out["fsdp_regather_s"] = max(0.0, (raw["fsdp_zero3"] - raw["fsdp_sync"]) / FSDP_UNITS
                                     - gather)
    p = PROBE
    tokens = p["batch"] * p["seq"]
    head = 3 * 2 * p["dim"] * p["vocab"] * tokens / rate
    block_plain = raw["probe_plain@2"] - raw["probe_plain@1"]
    outside_plain = raw["probe_plain@1"] - block_plain
    out["micro_overhead_s"] = max(0.0, outside_plain - head)
    if "probe_tp@1" in raw:
        comm = sum(collective_time(t, cluster, 1, c) for t in
                   tp_block_traffic(p["batch"], p["seq"], p["dim"], 2, "fp32", True))
        ends = sum(collective_time(t, cluster, 1, c) for t in
                   tp_end_traffic(p["batch"], p["seq"], p["dim"], 2, "fp32", True, embed=True,
                                  head=True))
        block_tp = raw["probe_tp@2"] - raw["probe_tp@1"]
        outside_tp = raw["probe_tp@1"] - block_tp
        out["tp_block_overhead_s"] = max(0.0, block_tp - block_plain / 2 - comm)
        out["tp_micro_overhead_s"] = max(0.0, outside_tp - out["micro_overhead_s"] - head / 2
                                         - ends)
    if "zb_split@1" in raw:
        extra1 = raw["zb_split@1"] - raw["zb_full@1"]
        per_block = max(0.0, (raw["zb_split@2"] - raw["zb_full@2"]) - extra1)
        backward = 2 / 3 * max(raw["zb_full@2"] - raw["zb_full@1"], 1e-12)
        out["zb_backward_factor"] = per_block / backward
        out["zb_call_s"] = max(0.0, extra1 - per_block)
    return out


def median_of(dicts: Sequence[dict]) -> dict:
    """Per-key median of numeric dicts (one per rank, or before/after)."""
    return {k: statistics.median(d[k] for d in dicts) for k in dicts[0]}
