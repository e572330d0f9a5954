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
from collections.abc import Callable
from functools import partial
from typing import Any

from ..block_probe import measure_block, measure_op_latency
from ..hardware import GB, Cluster
from .derive import (
    FSDP_UNITS,
    LARGE_BYTES,
    PROBE,
    SMALL_BYTES,
    TENSOR_COUNTS,
    derive_constants,
    median_of,
)
from .overheads import CPU_PROFILE


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
    op_latency = measure_op_latency()
    raw = median_of(run_distributed(measure_group, world, timeout=300))
    alpha = raw[f"all_reduce@{SMALL_BYTES}"] / (2 * (world - 1))
    bw = (LARGE_BYTES - SMALL_BYTES) * bus_factor("all_reduce", world) / max(
        raw[f"all_reduce@{LARGE_BYTES}"] - raw[f"all_reduce@{SMALL_BYTES}"], 1e-9)
    derived = derive_constants(raw, alpha=alpha, bw=bw, rate=peak * eff)
    cores = os.cpu_count() or 1
    ram: float
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        ram = 8 * GB
    from ..model_timing import this_host

    # the machine measured: the planner times a model's own forward and backward only on a
    # profile whose host is the machine it runs on (plait.planner.model_timing)
    extra: dict[str, Any] = {"host": this_host(), "compute_efficiency": round(eff, 4),
                             "op_latency_source": "measured: forward + backward of 4-32 tiny "
                                                  "Linear + tanh layers, seconds over aten ops "
                                                  "(plait.planner.block_probe."
                                                  "measure_op_latency)",
                             "block_overhead_s": overhead,
                             "block_fit_residual": round(fit.residual, 4),
                             **CPU_PROFILE,
                             **{k: float(v) for k, v in derived.items()},
                             "measured": f"matmul 512^2 fp32 1 thread; block fwd+bwd dim=128 "
                                         f"seq=64, 1 and 2 blocks x batch 1/2/4/8, Theil-Sen "
                                         f"fit; on {world} gloo ranks: all-reduce / all-gather "
                                         f"/ reduce-scatter / broadcast at 1 KiB and 4 MiB, "
                                         f"clip+AdamW over 8 and 32 tensors (plain, DTensor), "
                                         f"2 FSDP2 block units vs plain, the reference model with "
                                         f"1 and 2 blocks plain and TP+SP, 1 and 2 blocks "
                                         f"with the zero-bubble backward split "
                                         f"(plait.planner.cpu.probes.measure_group)"}
    return Cluster(name=name, device="cpu", nodes=1, devices_per_node=64,
                   memory_bytes=0.8 * ram / max(cores, 1), peak_flops={"fp32": peak},
                   intra_bw=bw, inter_bw=bw, intra_latency=alpha, inter_latency=alpha,
                   hbm_bw=hbm, reserve_bytes=0.2 * GB, compute_units=cores,
                   op_latency=op_latency,
                   source="calibrated", extra=extra)


# ------------------------------------------------------------------------------------------
# Measurements that need a process group: what a training step costs beyond its blocks' FLOPs
# and beyond ring all-reduce bandwidth. Each is timed on the same world as the job it explains
# (same number of processes sharing the same cores), in interleaved rounds, medians per point.
# ``measure_group`` returns raw timings only; :func:`plait.planner.cpu.derive.derive_constants`
# (pure, unit-tested) turns them into cost-model constants, so the arithmetic can be checked.
# ------------------------------------------------------------------------------------------
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
    gather: Callable[[torch.Tensor, torch.Tensor], Any]
    scatter: Callable[[torch.Tensor, torch.Tensor], Any]
    # Time the all-gather / reduce-scatter the runtime really issues: on gloo, FSDP2's are
    # replaced by all-to-all ones (plait.parallel.gloo_collectives), 2-3x faster than gloo's own.
    if group is not None and gloo_collectives_apply(group, "cpu"):
        ag, rs = GlooAllGather(), GlooReduceScatter()
        gather = lambda full, part: ag(full, part, group)  # noqa: E731
        scatter = lambda part, full: rs(part, full, group)  # noqa: E731
    else:
        gather, scatter = dist.all_gather_into_tensor, dist.reduce_scatter_tensor
    fns: dict[tuple[str, int], Callable[[], Any]] = {}
    for size in (SMALL_BYTES, LARGE_BYTES):
        n = max(world, size // 4 // world * world)
        full, part = torch.ones(n), torch.ones(n // world)
        fns[("all_reduce", size)] = partial(dist.all_reduce, full)
        fns[("all_gather", size)] = partial(gather, full, part)
        fns[("reduce_scatter", size)] = partial(scatter, part, full)
        fns[("broadcast", size)] = partial(dist.broadcast, full, src=0)
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
    micro-benchmarks alone: at world 2 on a 2-core machine FSDP2's post-backward costs 1-4 ms per
    unit and ZeRO-3's re-gather ~3 ms, 2-4x the bare collectives; priced from the collectives
    alone, ZeRO-2/3 layouts come out 8-28% under their measured steps. Real blocks, not toy
    layers, since FSDP2's copies scale with the unit's tensors; a batch of PROBE's size, as the
    layouts run
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
        use_gloo_collectives(module, mesh.get_group(), "cpu")  # as plait.parallel.zero does
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
    fns: dict[str, Callable[[], Any]] = {"fsdp_plain": lambda: step(plain)}
    fns.update({k: partial(step, m) for k, m in mods.items()})
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
            model: torch.nn.Module = build(cfg, seed=0)
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

    from plait._torch_compat import stage_backward_split

    pair = stage_backward_split()
    if pair is None:  # pragma: no cover - another torch
        return {}
    stage_backward_input, stage_backward_weight = pair
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
