"""Worker for bench/planner_accuracy.py: time training steps of the reference model per layout.

Runs each layout through plait's runtime (``plait.init`` / ``run.parallelize`` / ``run.step``)
when this checkout has it; otherwise through plain torch building blocks (DDP, FSDP2
``fully_shard``, DTensor ``parallelize_module``), which cover every layout without pipeline
parallelism or sequence parallelism.
"""

from __future__ import annotations

import time
from typing import Any


def has_runtime() -> bool:
    try:
        import plait
        from plait import runtime  # noqa: F401
    except ImportError:
        return False
    return hasattr(plait, "init") or hasattr(runtime, "init")


def torch_supports(plan) -> bool:
    return plan.pp == 1 and not plan.sp and plan.zero != 1 and not (
        plan.dp_replicate > 1 and (plan.tp > 1 or plan.dp_shard > 1))


def _torch_layout(model, plan, world):
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from plait.mesh import build_mesh

    mesh = build_mesh(plan, "cpu", world)
    if plan.tp > 1:
        tp_mesh = mesh["tp"]
        for block in model.layers:
            parallelize_module(block, tp_mesh, {
                "attention.q_proj": ColwiseParallel(), "attention.k_proj": ColwiseParallel(),
                "attention.v_proj": ColwiseParallel(), "attention.o_proj": RowwiseParallel(),
                "feed_forward.gate_proj": ColwiseParallel(),
                "feed_forward.up_proj": ColwiseParallel(),
                "feed_forward.down_proj": RowwiseParallel()})
    if plan.activation_checkpointing == "full":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import \
            checkpoint_wrapper
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    if plan.dp_shard > 1:
        dp_mesh = mesh["dp_shard"]
        reshard = plan.zero == 3
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
        sync = model.set_requires_gradient_sync
    elif plan.dp_replicate > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, process_group=mesh["dp_replicate"].get_group())
        sync = None
    else:
        sync = None
    data_rank = mesh["dp"].get_local_rank() if plan.dp > 1 else 0
    return model, sync, data_rank


def calibrate_here(rank: int, world: int) -> dict:
    """This rank's compute and the group's all-reduce, measured under the same conditions (the
    same number of processes sharing the same cores) as the layouts timed next."""
    import torch.distributed as dist

    from plait.planner.calibrate import _allreduce_worker, measure_block, measure_matmul

    dist.barrier()
    peak = measure_matmul()
    eff, overhead = measure_block(peak)
    times = _allreduce_worker(rank, world, [1024, 4 * 2**20], 5)
    return {"peak": peak, "eff": eff, "overhead": overhead, "t_small": times[1024],
            "t_large": times[4 * 2**20], "small": 1024, "large": 4 * 2**20}


def time_layouts(rank: int, world: int, plans: list[dict], model_name: str, global_batch: int,
                 seq: int, steps: int, warmup: int, use_runtime: bool) -> list[Any]:
    import contextlib

    import torch
    import torch.distributed as dist

    from plait.models.transformer import build, lm_loss, preset
    from plait.plan import Plan

    cfg = preset(model_name).replace(max_seq_len=seq)
    gen = torch.Generator().manual_seed(1234)
    data = torch.randint(0, cfg.vocab_size, (global_batch * (steps + warmup), seq + 1),
                         generator=gen)
    out = [calibrate_here(rank, world)]
    for fields in plans:
        plan = Plan.from_dict(fields)
        try:
            model = build(cfg, seed=0)
            if use_runtime:
                import plait
                run = plait.init(plan, quiet=True)
                model = run.parallelize(model)
                data_rank, dp = run.dp_rank, run.dp_size
            else:
                model, sync, data_rank = _torch_layout(model, plan, world)
                dp = plan.dp
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            local = global_batch // dp
            times = []
            for step in range(warmup + steps):
                rows = data[step * global_batch + data_rank * local:
                            step * global_batch + (data_rank + 1) * local]
                batch = (rows[:, :-1], rows[:, 1:])
                dist.barrier()
                t0 = time.perf_counter()
                if use_runtime:
                    run.step(model, batch, lm_loss, opt)
                else:
                    n = plan.grad_accum
                    parts = list(zip(batch[0].chunk(n), batch[1].chunk(n)))
                    for i, (x, y) in enumerate(parts):
                        last = i == n - 1
                        if sync is not None:
                            sync(last)
                            ctx = contextlib.nullcontext()
                        elif hasattr(model, "no_sync") and not last:
                            ctx = model.no_sync()
                        else:
                            ctx = contextlib.nullcontext()
                        with ctx:
                            (lm_loss(model(x), y) / n).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                dist.barrier()
                times.append(time.perf_counter() - t0)
            out.append(times[warmup:])
        except Exception as exc:  # noqa: BLE001 - a layout that does not run is reported
            out.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        finally:
            model = opt = None
            import gc
            gc.collect()
    out.append(calibrate_here(rank, world))
    return out
