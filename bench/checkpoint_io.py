"""Checkpoint cost beside a training step: save (blocking and async) and load time, and size.

For the reference GPT-2-shaped model (124M parameters, AdamW: 3 fp32 tensors per parameter on
disk) under DDP and ZeRO-3 on 2 processes (gloo, CPU), it prints, measured in the same
processes back to back:

* blocking save / step        how many steps a synchronous save costs
* async stall / blocking save  the share of a save that still blocks training with async_save
                               (staging the state to host memory), the rest overlaps the next
                               steps; "step during async / step" is what that overlap costs
* load / step                  resuming
* size                         bytes on disk per checkpoint

    PYTHONPATH=. python bench/checkpoint_io.py [--model gpt2] [--plans dp=2 dp_shard=2,zero=3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

import torch

from plait.planner.cpu.probes import _median_time


def job(rank: int, world: int, plan: str, model_name: str, folder: str, batch: int, seq: int,
        repeats: int) -> dict:
    import torch.distributed as dist

    import plait
    from plait.checkpoint import resolve
    from plait.data import TextDataset
    from plait.models.transformer import build, lm_loss

    run = plait.init(plan, checkpoint=folder, keep=2, quiet=True, log_every=10**9)
    model = run.parallelize(build(model_name))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = iter(run.loader(TextDataset(seq_len=seq), batch_size=batch, steps=10**6))

    def step():
        run.step(model, next(batches), lm_loss, opt)
        dist.barrier()

    for _ in range(2):  # warm-up: lazy init, DDP bucket rebuild, optimizer state
        step()
    step_s = _median_time(step, repeats, warmup=0)

    def blocking_save():
        run.save()
        dist.barrier()

    save_s = _median_time(blocking_save, repeats, warmup=0)
    ckpt = run.checkpointing
    ckpt.async_save = True
    stalls, overlapped, totals = [], [], []
    for _ in range(repeats):
        step()
        start = time.perf_counter()
        run.save()                      # returns once the state is staged in host memory
        stalls.append(time.perf_counter() - start)
        t = time.perf_counter()
        step()                          # trains while the background thread writes
        overlapped.append(time.perf_counter() - t)
        ckpt.pending.wait()
        ckpt.pending = None
        dist.barrier()
        totals.append(time.perf_counter() - start)
    ckpt.async_save = False
    newest = resolve(folder)
    size = sum(p.stat().st_size for p in newest.iterdir())
    run.close()

    run2 = plait.init(plan, quiet=True)
    model2 = run2.parallelize(build(model_name))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-4)

    def load():
        run2.load(newest, model=model2, optimizer=opt2)
        dist.barrier()

    load_s = _median_time(load, repeats, warmup=0)
    run2.close()
    return {"plan": plan, "step_s": step_s, "save_s": save_s,
            "async_stall_s": statistics.median(stalls),
            "async_step_s": statistics.median(overlapped),
            "async_total_s": statistics.median(totals), "load_s": load_s, "bytes": size}


def main() -> None:
    from plait.spawn import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--plans", nargs="+", default=["dp=2", "dp_shard=2,zero=3"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--format", choices=("text", "json"), default="text")
    args = parser.parse_args()
    rows = []
    for plan in args.plans:
        folder = tempfile.mkdtemp(prefix="plait-ckpt-bench-")
        try:
            rows.append(run_distributed(job, 2, plan, args.model, folder, args.batch, args.seq,
                                        args.repeats, timeout=1800)[0])
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    if args.format == "json":
        print(json.dumps(rows, indent=2))
        return
    print(f"model {args.model}, 2 processes (gloo, CPU), global batch {args.batch} x seq "
          f"{args.seq}, median of {args.repeats}")
    head = (f"{'plan':<20}{'step s':>8}{'save s':>8}{'save/step':>10}{'async stall':>12}"
            f"{'stall/save':>11}{'async step/step':>16}{'load s':>8}{'load/step':>10}"
            f"{'size MB':>9}")
    print(head)
    for r in rows:
        print(f"{r['plan']:<20}{r['step_s']:>8.2f}{r['save_s']:>8.2f}"
              f"{r['save_s'] / r['step_s']:>10.2f}{r['async_stall_s']:>12.2f}"
              f"{r['async_stall_s'] / r['save_s']:>11.2f}"
              f"{r['async_step_s'] / r['step_s']:>16.2f}{r['load_s']:>8.2f}"
              f"{r['load_s'] / r['step_s']:>10.2f}{r['bytes'] / 1e6:>9.0f}")


if __name__ == "__main__":
    main()
