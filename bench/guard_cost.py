"""What the per-step agreements cost: the NaN/inf guard and the watchdog's step-start check.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/guard_cost.py [--world 2]
        [--plans dp=2,tp=2,dp=2+clip=0] [--models test] [--rounds 200]

One job of ``--world`` processes (gloo) per plan and model trains the reference transformer with
``run.step``, three ways; every round runs one step of each way, in an order that rotates from
round to round, so that a busy moment of the machine falls on all three alike:

* ``off``: neither of the two below (the bench swaps them out of the Run; users keep the guard
  always, and drop the check with ``plait.init(desync_check=False)``);
* ``guard``: the NaN/inf guard (``plait.guard.StepGuard``). With the data replicas spanning the
  job and gradients clipped (DDP, ZeRO, HSDP with the default ``clip=1.0``) its flags travel in
  the step's (loss sum, count) all-reduce and a clean step costs two host reads; otherwise
  (tensor or pipeline parallel, ``clip=0``) one all-reduce of three numbers over the job;
* ``guard+check``: that and the watchdog's step-start check (one all-gather of each rank's
  collective counts on its own gloo group, waited for before the step's first collective):
  ``run.step`` as users get it. The collective kernels its wait is hooked into stay installed
  in all three ways (one Python call per collective), so that is not in the difference.

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

WAYS = ("off", "guard", "guard+check")


class _NoGuard:
    """Stands in for the Run's ``plait.guard.StepGuard``: agrees to every step, reads nothing
    on the host and sends no collective of its own."""

    def __init__(self) -> None:
        from plait.guard import Verdict

        self.last = Verdict()

    def local_flags(self, loss):
        import torch

        return torch.zeros(2, device=loss.device)

    def __call__(self, loss, grad_norm, *, agreed=None) -> bool:
        return True


def job(rank: int, world: int, plan: str, model_name: str, rounds: int, batch: int,
        seq: int) -> dict[str, list[float]]:
    """This rank's step time of each way in every round."""
    import torch
    import torch.distributed as dist

    import plait
    from plait.models.transformer import build, lm_loss, preset

    run = plait.init(plan, quiet=True, log_every=10**9)
    model = run.parallelize(build(model_name))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = preset(model_name).vocab_size
    gen = torch.Generator().manual_seed(run.dp_rank)
    guard, dog = run._step_guard(), run._watchdog  # the Run's own (a multi-rank job has both)
    check_group = dog.check_group

    def one_step(way: str) -> float:
        tokens = torch.randint(0, vocab, (batch // run.dp_size, seq + 1), generator=gen)
        run._guard = _NoGuard() if way == "off" else guard
        run._exchange = None  # the step's totals exchange carries the guard's flags: remade
        dog.check_group = check_group if way == "guard+check" else None
        dist.barrier()
        start = time.perf_counter()
        run.step(model, (tokens[:, :-1], tokens[:, 1:]), lm_loss, opt)
        return time.perf_counter() - start

    for _ in range(3):  # warm-up: allocator, DDP buckets
        one_step("guard+check")
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for r in range(rounds):
        for i in range(len(WAYS)):
            way = WAYS[(r + i) % len(WAYS)]
            times[way].append(one_step(way))
    run._guard, dog.check_group = guard, check_group
    run.close()
    return times


def main(argv: list[str] | None = None) -> int:
    from plait.spawn import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--plans", default=None,
                    help="plans separated by commas, '+' inside a plan (default: "
                         "dp=WORLD,tp=WORLD,dp=WORLD+clip=0)")
    ap.add_argument("--models", default="test")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    w = args.world
    plans = (args.plans or f"dp={w},tp={w},dp={w}+clip=0").split(",")
    print(f"world {w}, gloo on CPU, global batch {args.batch} x seq {args.seq}, {args.rounds} "
          f"rounds of one step per way, order rotating")
    print(f"{'plan':<12} {'model':<6} {'off ms':>7} {'guard ms':>9} {'guard+check ms':>15} "
          f"{'guard/off':>10} {'(quartiles)':>13} {'guard+check/off':>16} {'(quartiles)':>13}")
    for plan, name in ((p, m) for p in plans for m in args.models.split(",")):
        ranks = run_distributed(job, w, plan.replace("+", ","), name, args.rounds, args.batch,
                                args.seq, timeout=900)
        # a step's time is its slowest rank's
        steps = {way: [max(ts) for ts in zip(*(r[way] for r in ranks), strict=True)]
                 for way in WAYS}
        med = {way: statistics.median(v) * 1e3 for way, v in steps.items()}
        cols = []
        for way in ("guard", "guard+check"):
            paired = [a / b for a, b in zip(steps[way], steps["off"], strict=True)]
            q1, q2, q3 = statistics.quantiles(paired, n=4)
            cols.append(f"{q2:>{10 if way == 'guard' else 16}.3f} {f'{q1:.2f}-{q3:.2f}':>13}")
        print(f"{plan:<12} {name:<6} {med['off']:>7.2f} {med['guard']:>9.2f} "
              f"{med['guard+check']:>15.2f} " + " ".join(cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
