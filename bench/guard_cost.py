"""What the per-step agreements cost: the NaN/inf guard and the watchdog's step-start check.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/guard_cost.py [--world 2] [--plan dp=2]
        [--models test,tiny] [--rounds 200]

One job of ``--world`` processes (gloo) trains the reference transformer under ``--plan`` with
plait's own step (``plait.train``: forward and backward, the loss totals' all-reduce started
before the last backward, the update), four ways; every round runs one step of each way, in an
order that rotates from round to round, so that a busy moment of the machine falls on all alike:

* ``off``: no guard, no check;
* ``guard``: the NaN/inf guard as ``run.step`` runs it. When the data replicas are the whole job
  (``--plan dp=N``, ZeRO) and gradients are clipped, its flags travel in the totals' all-reduce
  and a clean step issues no collective of its own (two host reads remain); otherwise it is the
  next way;
* ``guard-own``: the guard's own agreement, one all-reduce of three numbers over the job, as
  layouts whose data replicas are not the whole job (TP, pipelines) or runs without clipping
  pay it;
* ``guard+check``: ``guard`` and the watchdog's step-start check (one all-gather of each rank's
  collective counts on its own gloo group), which is what ``run.step`` does.

Each step's time is its slowest rank's (a barrier before each step, outside the timing). Prints
the median step of each way, the median over rounds of each way's step over the same round's
``off`` step, and the quartiles of that ratio (how far to trust it: gloo on a shared machine
varies by 10-20% from step to step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WAYS = ("off", "guard", "guard-own", "guard+check")


def job(rank: int, world: int, plan: str, model_name: str, rounds: int, batch: int,
        seq: int) -> dict[str, list[float]]:
    """This rank's step time of each way in every round."""
    import torch
    import torch.distributed as dist

    import plait
    from plait.guard import StepGuard
    from plait.models.transformer import build, lm_loss, preset
    from plait.train import TotalsExchange, apply_update, forward_backward, reduce_totals

    run = plait.init(plan, quiet=True, log_every=10**9)
    model = run.parallelize(build(model_name))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = preset(model_name).vocab_size
    gen = torch.Generator().manual_seed(rank)
    dp_group = run.mesh["dp"].get_group() if run.mesh is not None and run.dp_size > 1 else None
    guard = StepGuard("stop", rank, world)
    dog = run._watchdog  # started by plait.init for a multi-rank job

    # As run.step: the guard's flags ride in the totals' all-reduce when it spans the job.
    fused = run.dp_size == world and bool(run.plan.grad_clip)

    def one_step(way: str, step: int) -> float:
        tokens = torch.randint(0, vocab, (batch // run.dp_size, seq + 1), generator=gen)
        flags = fused and way in ("guard", "guard+check")
        dist.barrier()
        start = time.perf_counter()
        if way == "guard+check" and dog is not None:
            dog.step_started(step)
        exchange = None if dp_group is None else TotalsExchange(
            dp_group, extra=guard.local_flags if flags else None)
        local = forward_backward(model, (tokens[:, :-1], tokens[:, 1:]), lm_loss,
                                 plan=run.plan, device=run.device, exchange=exchange)
        agreed = None
        if exchange is None:
            totals = reduce_totals(local, dp_group=None, pp_group=None)
        else:
            totals, summed = exchange.finish()
            agreed = summed if flags else None
        check = None if way == "off" else (lambda norm: guard(local[0], norm, agreed=agreed))
        apply_update(opt, totals, plan=run.plan, guard=check)
        return time.perf_counter() - start

    for step in range(3):  # warm-up: allocator, DDP buckets
        one_step("guard+check", step)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    step = 3
    for r in range(rounds):
        for i in range(len(WAYS)):
            way = WAYS[(r + i) % len(WAYS)]
            step += 1
            times[way].append(one_step(way, step))
    if dog is not None:
        dog.active = False
    run.close()
    return times


def main(argv: list[str] | None = None) -> int:
    from plait.spawn import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--plan", default=None, help="default: dp=WORLD")
    ap.add_argument("--models", default="test,tiny")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    plan = args.plan or f"dp={args.world}"
    print(f"world {args.world}, plan {plan}, gloo on CPU, global batch {args.batch} x seq "
          f"{args.seq}, {args.rounds} rounds of one step per way, order rotating")
    shown = WAYS[1:]
    print(f"{'model':<6} {'off ms':>7} " + " ".join(f"{w + ' ms':>14}" for w in shown) + " "
          + " ".join(f"{w + '/off (quartiles)':>29}" for w in shown))
    for name in args.models.split(","):
        ranks = run_distributed(job, args.world, plan, name, args.rounds, args.batch, args.seq,
                                timeout=900)
        # a step's time is its slowest rank's
        steps = {way: [max(ts) for ts in zip(*(r[way] for r in ranks), strict=True)]
                 for way in WAYS}
        med = {way: statistics.median(v) * 1e3 for way, v in steps.items()}
        cols = []
        for way in shown:
            paired = [a / b for a, b in zip(steps[way], steps["off"], strict=True)]
            q1, q2, q3 = statistics.quantiles(paired, n=4)
            cols.append(f"{q2:>15.3f} {f'({q1:.2f}-{q3:.2f})':>13}")
        print(f"{name:<6} {med['off']:>7.2f} " + " ".join(f"{med[w]:>14.2f}" for w in shown)
              + " " + " ".join(cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
