"""Ledger on vs off in plait's own training step: step-time ratio (target < 1.02).

For each plan, every rank builds two Runs on the same process group, ``plait.init(plan,
ledger=True)`` and ``plait.init(plan, ledger=False)``, each with its own copy of the reference
model (same seed) laid out by ``run.parallelize``, and alternates their ``run.step`` calls
(on, off, on, off, ...) on the same batches so that machine noise hits both alike. Prints the
median step time of each (slowest rank per step) and their ratio, and the collectives per step
the ledger saw.

    PYTHONPATH=. python bench/comm_overhead.py [--model tiny] [--steps 20] \\
        [--plans "dp=2;dp_shard=2,zero=3;tp=2;tp=2,sp=1;pp=2,microbatches=2"]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _worker(rank: int, world: int, plan: str, model_name: str, steps: int, batch: int,
            seq: int) -> dict:
    import torch.distributed as dist

    import plait
    from plait.data import TextDataset
    from plait.models import transformer as tfm

    torch.set_num_threads(1)
    warmup = 3
    runs, models, opts = [], [], []
    for ledger in (True, False):
        run = plait.init(plan, quiet=True, ledger=ledger, log_every=10**9)
        run.ledger_warmup = warmup
        cfg = tfm.preset(model_name, max_seq_len=seq)
        model = run.parallelize(tfm.build(cfg, seed=0))
        runs.append(run)
        models.append(model)
        opts.append(torch.optim.AdamW(model.parameters(), lr=1e-3))
    data = TextDataset(seq_len=seq, split="train")
    batches = list(runs[0].loader(data, batch_size=batch * runs[0].dp_size,
                                  steps=warmup + steps))
    on, off = [], []
    # Rounds of a few steps each, alternating on/off. The ledger's kernels are installed for
    # the "on" rounds only (as in a real run, where they stay installed for the whole run) and
    # removed for the "off" rounds, outside the timed steps, so "off" is a run without a ledger.
    block = 5
    for r, start in enumerate(range(0, len(batches), block)):
        for k in (0, 1) if r % 2 == 0 else (1, 0):  # alternate who goes first
            if k == 0:
                runs[0].ledger.install()
            else:
                runs[0].ledger.uninstall()
            for i in range(start, min(start + block, len(batches))):
                dist.barrier()
                t0 = time.perf_counter()
                runs[k].step(models[k], batches[i], tfm.lm_loss, opts[k])
                dist.barrier()
                if i >= warmup:
                    (on if k == 0 else off).append(time.perf_counter() - t0)
    entries = runs[0].ledger.local_entries()
    calls = sum(e["count"] + e["recv_count"] for e in entries) / steps
    for run in runs:
        run.close()
    return {"on": on, "off": off, "calls": calls}


def main(argv: list[str] | None = None) -> int:
    from plait.plan import Plan
    from plait.spawn import run_distributed
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="batch per data replica")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--plans", default="dp=2;dp_shard=2,zero=3;tp=2;tp=2,sp=1;"
                                      "pp=2,microbatches=2")
    args = p.parse_args(argv)
    print(f"{'plan':24} {'calls/step':>10} {'off ms':>8} {'on ms':>8} {'on/off':>7}")
    for plan in args.plans.split(";"):
        world = Plan.from_string(plan).world_size
        res = run_distributed(_worker, world, plan, args.model, args.steps, args.batch,
                              args.seq, timeout=1200)
        on = statistics.median(max(r["on"][i] for r in res) for i in range(args.steps))
        off = statistics.median(max(r["off"][i] for r in res) for i in range(args.steps))
        print(f"{plan:24} {res[0]['calls']:>10.0f} {off * 1e3:>8.2f} {on * 1e3:>8.2f} "
              f"{on / off:>7.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
