"""Ledger on vs off in plait's own training step: step-time ratio (target < 1.02).

For each plan, every rank builds two Runs on the same process group, ``plait.init(plan,
ledger=True)`` and ``plait.init(plan, ledger=False)``, each with its own copy of the reference
model (same seed) laid out by ``run.parallelize``, and runs their steps in ABBA order (on, off,
off, on, on, off, ...) on the same batches, so that a burst of machine noise hits both alike. The
ledger's kernels are installed for each "on" step and removed for each "off" step, outside the
timed region, so "off" is a run without any ledger (as in a real run, where they stay installed
for the whole run, the install costs nothing per step).

Per step: wall time (slowest rank, between barriers) and CPU time (summed over ranks: the
process's CPU, gloo's threads included). CPU time does not grow while a rank waits for a core,
so it is the steadier figure on a loaded machine. Printed: median step of each side, the
median of the per-pair ratios on/off with their interquartile range, best/best (each side's
fastest step: the least disturbed), and the collectives per step the ledger saw.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/comm_overhead.py [--model tiny] [--steps 20] \\
        [--plans "dp_replicate=2;dp_shard=2,zero=3;tp=2;tp=2,sp=1;pp=2,microbatches=2"]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _worker(rank: int, world: int, plan: str, model_name: str, steps: int, batch: int,
            seq: int, time_every: int, control: bool = False) -> dict:
    import torch.distributed as dist

    import plait
    from plait.comm.ledger import Ledger
    from plait.data import TextDataset
    from plait.models import transformer as tfm

    torch.set_num_threads(1)
    warmup = 3
    runs, models, opts = [], [], []
    for ledger in (not control, False):
        run = plait.init(plan, quiet=True, ledger=ledger, log_every=10**9)
        if run.ledger is not None and run.ledger.time_every != time_every:
            run.ledger.uninstall()
            run.ledger = Ledger(run.ledger.mesh, time_every=time_every)
        run.ledger_warmup = warmup
        cfg = tfm.preset(model_name, max_seq_len=seq)
        model = run.parallelize(tfm.build(cfg, seed=0))
        runs.append(run)
        models.append(model)
        opts.append(torch.optim.AdamW(model.parameters(), lr=1e-3))
    data = TextDataset(seq_len=seq, split="train")
    batches = list(runs[0].loader(data, batch_size=batch * runs[0].dp_size,
                                  steps=warmup + steps))
    wall: dict[int, list[float]] = {0: [], 1: []}
    cpu: dict[int, list[float]] = {0: [], 1: []}
    for i, b in enumerate(batches):
        # ABBA: pair i runs on-then-off when i % 2 == 0, off-then-on otherwise.
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            if runs[0].ledger is not None:
                if k == 0:
                    runs[0].ledger.install()
                else:
                    runs[0].ledger.uninstall()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            runs[k].step(models[k], b, tfm.lm_loss, opts[k])
            dist.barrier()
            if i >= warmup:
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
    entries = []
    if runs[0].ledger is not None:
        runs[0].ledger.uninstall()
        entries = runs[0].ledger.local_entries()
    calls = sum(e["count"] + e["recv_count"] for e in entries) / steps
    for run in runs:
        run.close()
    return {"wall_on": wall[0], "wall_off": wall[1], "cpu_on": cpu[0], "cpu_off": cpu[1],
            "calls": calls}


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def summarise(res: list[dict], steps: int) -> dict:
    """Per step: wall = slowest rank, CPU = sum over ranks; then medians and paired ratios."""
    out: dict = {"calls": res[0]["calls"]}
    for kind, combine in (("wall", max), ("cpu", sum)):
        on = [combine(r[f"{kind}_on"][i] for r in res) for i in range(steps)]
        off = [combine(r[f"{kind}_off"][i] for r in res) for i in range(steps)]
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        lo, mid, hi = _quartiles(ratios)
        out[kind] = {"on": statistics.median(on), "off": statistics.median(off),
                     "ratio": mid, "q1": lo, "q3": hi, "best": min(on) / min(off)}
    return out


def main(argv: list[str] | None = None) -> int:
    from plait.plan import Plan
    from plait.spawn import run_distributed
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=20, help="measured steps per side")
    p.add_argument("--batch", type=int, default=8, help="batch per data replica")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--time-every", type=int, default=8,
                   help="Ledger(time_every=...): 1 times every collective")
    p.add_argument("--control", action="store_true",
                   help="A/A control: both sides without a ledger (the two Runs' own difference)")
    p.add_argument("--plans", default="dp_replicate=2;dp_shard=2,zero=3;tp=2;tp=2,sp=1;"
                                      "pp=2,microbatches=2")
    args = p.parse_args(argv)
    if args.steps < 4:
        p.error("--steps must be >= 4 (quartiles of the paired ratios)")
    print(f"ledger on/off per step, ABBA, {args.steps} pairs, model {args.model}, "
          f"time_every={args.time_every}; wall = slowest rank, cpu = sum over ranks; "
          f"ratio = median of paired on/off [q1, q3]; best = fastest on / fastest off; ms per step")
    print(f"{'plan':24} {'calls':>6} {'wall off':>9} {'wall on':>9} {'wall on/off':>22} "
          f"{'best':>6} {'cpu off':>9} {'cpu on':>9} {'cpu on/off':>22} {'best':>6}")
    for plan in args.plans.split(";"):
        world = Plan.from_string(plan).world_size
        res = run_distributed(_worker, world, plan, args.model, args.steps, args.batch,
                              args.seq, args.time_every, args.control, timeout=1800)
        s = summarise(res, args.steps)
        cells = []
        for kind in ("wall", "cpu"):
            k = s[kind]
            cells.append(f"{k['off'] * 1e3:>9.2f} {k['on'] * 1e3:>9.2f} "
                         f"{k['ratio']:>7.3f} [{k['q1']:.3f}, {k['q3']:.3f}] {k['best']:>6.3f}")
        print(f"{plan:24} {s['calls']:>6.0f} {cells[0]} {cells[1]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
