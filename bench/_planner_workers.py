"""Worker for bench/planner_accuracy.py: time training steps of the reference model per layout.

Every layout runs through plait's runtime, exactly as a user's script would: ``plait.init(plan)``,
``run.parallelize(model)``, ``run.step(model, batch, lm_loss, opt)`` (DDP, ZeRO-1/2/3, TP+SP,
pipelines with every schedule, their compositions).

Noise: the machine is shared (2 cores, other jobs), and contention only ever adds time. So all
layouts are built first, then timed in interleaved rounds (layout 1, 2, ..., n, then again), a
burst of load hitting every layout alike rather than one layout wholesale; the first round's
first ``warmup`` steps of each layout are discarded (allocator, DDP bucket rebuild, pipeline
shape inference). Each rank returns its raw step times per round; the bench takes medians.
"""

from __future__ import annotations

import time
from typing import Any


def calibrate_here(rank: int, world: int, shape: dict) -> dict:
    """This rank's compute and the group's micro-benchmarks (collectives, per-tensor optimizer
    cost, FSDP2 units, the TP probe), measured under the same conditions (the same number of
    processes sharing the same cores) as the layouts timed next."""
    import torch.distributed as dist

    from plait.planner.calibrate import measure_group

    out = calibrate_compute(rank, world, shape)
    out.update(measure_group(rank, world))
    return out


def calibrate_compute(rank: int, world: int, shape: dict) -> dict:
    """This rank's matmul peak and block efficiency / overhead (plait.planner.calibrate), with
    the block probe at the timed model's width, heads and sequence length (``shape``): the
    achieved FLOP/s of a block falls with the sequence (attention's s x s softmax is memory-
    bound; ~10% lower at seq 128 than at 64 here), so a probe at another shape biases every
    prediction the same way."""
    import torch.distributed as dist

    from plait.planner.calibrate import measure_block, measure_matmul

    dist.barrier()
    peak = measure_matmul()
    eff, overhead, fit = measure_block(peak, repeats=3, **shape)
    return {"peak": peak, "eff": eff, "overhead": overhead, "residual": fit.residual}


def time_layouts(rank: int, world: int, plans: list[dict], model_name: str, global_batch: int,
                 seq: int, steps: int, warmup: int, rounds: int) -> list[Any]:
    """[calibration before, per layout (list of rounds of step times, or an error string),
    calibration after]. The compute calibration is also repeated after every round
    (``after["round_compute"]``): load on a shared machine comes in bursts, and a calibration
    taken only before and after the timings can see a different machine than they did."""
    import gc

    import torch
    import torch.distributed as dist

    import plait
    from plait.models.transformer import build, lm_loss, preset
    from plait.plan import Plan

    torch.set_num_threads(1)
    cfg = preset(model_name).replace(max_seq_len=seq)
    # the block probe spans the microbatch sizes the layouts run (1 .. the global batch): the
    # fit's slope is then set by the shapes it predicts, not extrapolated past them
    sizes = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= global_batch)
    shape = {"dim": cfg.dim, "n_heads": cfg.n_heads, "seq": seq, "batches": sizes}
    gen = torch.Generator().manual_seed(1234)
    n_batches = 4
    data = torch.randint(0, cfg.vocab_size, (global_batch * n_batches, seq + 1), generator=gen)
    setups: list[Any] = []
    for fields in plans:
        try:
            run = plait.init(Plan.from_dict(fields), quiet=True)
            model = run.parallelize(build(cfg, seed=0))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            setups.append((run, model, opt))
        except Exception as exc:  # noqa: BLE001 - a layout that does not build is reported
            setups.append(f"{type(exc).__name__}: {str(exc)[:200]}")
    # Calibrate once every layout is built, not before: the same kernels run ~1.5x slower in a
    # process holding 16 models and their optimizers (allocator and cache state) than in a
    # fresh one -- measured: 4 reference blocks 103 ms alone, 155 ms beside 15 idle DDP copies,
    # and the block probe agreed with each within 5% when run in the same state.
    out: list[Any] = [calibrate_here(rank, world, shape)]
    results: list[Any] = [[] if not isinstance(s, str) else s for s in setups]
    counter = 0
    round_compute = []
    for rnd in range(rounds):
        for i, setup in enumerate(setups):
            if isinstance(setup, str) or isinstance(results[i], str):
                continue
            run, model, opt = setup
            local = global_batch // run.dp_size
            times = []
            try:
                for k in range(steps + (warmup if rnd == 0 else 0)):
                    j = counter % n_batches
                    counter += 1
                    rows = data[j * global_batch + run.dp_rank * local:
                                j * global_batch + (run.dp_rank + 1) * local]
                    dist.barrier()
                    t0 = time.perf_counter()
                    run.step(model, (rows[:, :-1], rows[:, 1:]), lm_loss, opt)
                    dist.barrier()
                    if not (rnd == 0 and k < warmup):
                        times.append(time.perf_counter() - t0)
                results[i].append(times)
            except Exception as exc:  # noqa: BLE001
                results[i] = f"{type(exc).__name__}: {str(exc)[:200]}"
        round_compute.append(calibrate_compute(rank, world, shape))
    for setup in setups:
        if not isinstance(setup, str):
            setup[0].close()
    setups = []
    gc.collect()
    out.extend(results)
    out.append(calibrate_here(rank, world, shape))
    out[-1]["round_compute"] = round_compute
    return out
