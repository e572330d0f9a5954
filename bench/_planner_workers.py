"""Workers for bench/planner_accuracy.py: time training steps of the reference model, one layout
per job, and calibrate the machine in jobs of their own.

Every layout runs through plait's runtime, exactly as a user's script would: ``plait.init(plan)``,
``run.parallelize(model)``, ``run.step(model, batch, lm_loss, opt)`` (DDP, ZeRO-1/2/3, TP+SP,
pipelines with every schedule, their compositions).

Why one layout per job (fresh processes each time): the same layout measured 0.58 s alone in its
processes and 0.85-1.06 s among 16 layouts held by the same processes (2-core CPU machine);
a user's job holds one layout, so that is what is timed. Why calibration jobs of their own: the
calibration then sees the state a user's job starts from (fresh processes, one model), not one
layout's leftovers. Load drift on a shared machine is handled by the bench, which interleaves the
jobs (calibration, layout 1..n, then in reverse order, ...).
"""

from __future__ import annotations

import resource
import time


def calibration_job(rank: int, world: int, shape: dict) -> dict:
    """This rank's compute and the group's micro-benchmarks (collectives, per-tensor optimizer
    cost, FSDP2 units, the TP probe), with as many processes sharing the cores as the layouts
    timed in the same rounds."""
    from plait.planner.cpu.probes import measure_group

    out = calibrate_compute(rank, world, shape)
    out.update(measure_group(rank, world))
    return out


def calibrate_compute(rank: int, world: int, shape: dict) -> dict:
    """This rank's matmul peak and block rate / overhead (plait.planner.cpu.probes), with the
    block probe at the timed model's width, heads and sequence length (``shape``): the achieved
    FLOP/s of a block falls with the sequence (attention's s x s softmax is memory-bound; ~10%
    lower at seq 128 than at 64 here), so a probe at another shape biases every prediction the
    same way. The probe spans the microbatch sizes the layouts run (1 .. the global batch), so
    the fit's slope is set by the shapes it predicts, not extrapolated, and stacks as deep as
    the layouts' stages (2 and 4 blocks: the per-block time grows with the activations held,
    ~5% from 1-2 to 2-4 blocks here). ``rate`` is the block FLOP/s itself, not capped at the
    matmul peak: on a machine whose speed drifts the two are measured at different moments.

    ``all_reduce_small``: the latency probe, a 1-KiB all-reduce over every rank (median of 7, a
    barrier before each, as ``plait.planner.cpu.probes`` times it). Why here too, in every job:
    timed only in the calibration jobs (one per round) it can swing 0.4-5.2 ms from round to
    round, and a median of three rounds then prices every send and latency-bound call of that
    world up to 5x dearer than the layouts pay; one per job gives the bench as many samples as
    layouts, taken when they ran."""
    import torch.distributed as dist

    from plait.models.transformer import TransformerConfig
    from plait.planner.cpu.probes import (
        SMALL_BYTES,
        _allreduce_worker,
        measure_block,
        measure_matmul,
    )
    from plait.planner.model_stats import from_transformer_config

    dist.barrier()
    peak = measure_matmul()
    eff, overhead, fit = measure_block(peak, repeats=3, **shape)
    cfg = TransformerConfig(dim=shape["dim"], n_layers=1, n_heads=shape["n_heads"],
                            max_seq_len=shape["seq"])
    rate = 3 * from_transformer_config(cfg).block_flops_per_token(shape["seq"]) / max(
        fit.slope, 1e-12)
    return {"peak": peak, "eff": eff, "rate": rate, "overhead": overhead,
            "residual": fit.residual,
            "all_reduce_small": _allreduce_worker(rank, world, [SMALL_BYTES], 7)[SMALL_BYTES]}


def probe_shape(model_name: str, global_batch: int, seq: int) -> dict:
    from plait.models.transformer import preset

    cfg = preset(model_name)
    sizes = tuple(b for b in (1, 4, 16, 64) if b <= global_batch)
    if global_batch not in sizes:
        sizes += (global_batch,)
    return {"dim": cfg.dim, "n_heads": cfg.n_heads, "seq": seq, "batches": sizes,
            "blocks": (2, 4)}


def layout_job(rank: int, world: int, plan: dict, model_name: str, global_batch: int, seq: int,
               steps: int, warmup: int, shape: dict | None, barriers: bool = False
               ) -> dict | str:
    """``steps`` training steps of one layout, back to back after ``warmup`` discarded ones
    (allocator, DDP bucket rebuild, pipeline shape inference), and a compute calibration taken
    right after them in the same processes (``compute``), or the error that stopped it.

    ``start``: when the timed steps began (after one barrier); ``ends``: when each timed step
    returned on this rank. Both are on ``time.monotonic()``, one clock for every process on the
    machine (CLOCK_MONOTONIC on Linux), so the bench takes step k's time as the latest rank's end
    of step k minus the latest rank's end of step k-1 (:func:`step_times`).
    ``cpu``: this process's CPU seconds (every thread: gloo's included) per timed step, so the
    bench can say how busy the cores were (CPU time over cores x wall).

    Why back to back, with no barrier between steps: a user's loop has none, and a barrier is
    not free -- each is a small all-reduce (~7 ms on 4 ranks sharing 2 cores here), and on shared
    cores it also reshuffles which rank runs when. Timed both ways (bench/step_barriers.py, world
    4), barriers changed a layout's step by -15..+22% round by round, unequally between layouts
    and runs: not a constant the model could add. Ranks still
    wait for each other where the layout makes them (gradient syncs, pipeline sends): that is
    part of the step.

    Why a compute calibration in every job: this machine's speed drifts by +-25% over minutes
    (a shared VM), far more than the layouts differ, so a few calibrations taken at other
    moments mislead; one per job, spread evenly over the run and taken in the state a user's job
    is in (one model and its optimizer held), gives a median that saw what the layouts saw. The
    bench uses the median over every job of the world, never a layout's own figure. ``shape``
    None skips it (``compute`` is None).

    ``barriers`` (bench/step_barriers.py compares the two methods): a barrier before
    and after every step, and ``timed``, each step's time on this rank up to the end of the
    barrier after it."""
    import torch
    import torch.distributed as dist

    import plait
    from plait.models.transformer import build, lm_loss, preset
    from plait.plan import Plan

    torch.set_num_threads(1)
    cfg = preset(model_name).replace(max_seq_len=seq)
    gen = torch.Generator().manual_seed(1234)
    n_batches = 4
    data = torch.randint(0, cfg.vocab_size, (global_batch * n_batches, seq + 1), generator=gen)
    try:
        run = plait.init(Plan.from_dict(plan), quiet=True)
        model = run.parallelize(build(cfg, seed=0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        local = global_batch // run.dp_size
        ends, cpu, timed, start = [], [], [], 0.0
        for k in range(warmup + steps):
            j = k % n_batches
            rows = data[j * global_batch + run.dp_rank * local:
                        j * global_batch + (run.dp_rank + 1) * local]
            if barriers or k == warmup:
                dist.barrier()
            t0 = time.monotonic()
            if k == warmup:
                start = t0
            r0 = _cpu_seconds()
            run.step(model, (rows[:, :-1], rows[:, 1:]), lm_loss, opt)
            if barriers:
                dist.barrier()
            if k >= warmup:
                ends.append(time.monotonic())
                cpu.append(_cpu_seconds() - r0)
                timed.append(ends[-1] - t0)
        dist.barrier()
        compute = calibrate_compute(rank, world, shape) if shape is not None else None
        run.close()
        return {"start": start, "ends": ends, "cpu": cpu, "timed": timed, "compute": compute}
    except Exception as exc:  # noqa: BLE001 - a layout that does not build or step is reported
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def step_times(ranks: list[dict]) -> list[float]:
    """Seconds per step of one job from every rank's ``start`` / ``ends`` (see layout_job): a
    step ends when its last rank returns from it."""
    start = max(r["start"] for r in ranks)
    ends = [max(stamps) for stamps in zip(*(r["ends"] for r in ranks), strict=True)]
    return [b - a for a, b in zip([start] + ends[:-1], ends, strict=True)]


def _cpu_seconds() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime
