"""What a barrier around every training step costs: the same layouts timed both ways.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/step_barriers.py [--world 4] [--rounds 3]

Why: a barrier before and after every timed step makes a step's time its slowest rank's, but a
user's loop has no barrier, and one is not free:
each is a small all-reduce, and on ranks that share cores the last one to arrive must also be
scheduled. This times each layout in fresh processes twice, alternating: ``barrier`` (a barrier
before each step and the step's time up to the end of the barrier after it) and
``back-to-back`` (steps run as a user's loop runs them; a step ends when its last rank returns
from it, on the machine-wide monotonic clock, as bench/planner_accuracy.py times). Prints the median
step of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    from _planner_workers import layout_job, step_times

    from plait.plan import Plan
    from plait.spawn import run_distributed

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    half = args.world // 2
    plans = {"DDP": Plan(dp_replicate=args.world),
             "pp=2 1F1B": Plan(pp=2, dp_replicate=half, microbatches=2),
             "pp=2 interleaved": Plan(pp=2, dp_replicate=half, microbatches=2,
                                      pp_schedule="interleaved_1f1b", virtual_stages=2)}
    got: dict = {(name, mode): [] for name in plans for mode in ("barrier", "back-to-back")}
    for _ in range(args.rounds):
        for name, plan in plans.items():
            for mode in ("barrier", "back-to-back"):
                ranks = run_distributed(layout_job, args.world, plan.to_dict(), "tiny", 16, 128,
                                        8, 2, None, mode == "barrier", timeout=300)
                bad = next((r for r in ranks if isinstance(r, str)), None)
                if bad is not None:
                    raise SystemExit(f"{name}: {bad}")
                if mode == "barrier":
                    steps = [max(ts) for ts in zip(*(r["timed"] for r in ranks), strict=True)]
                else:
                    steps = step_times(ranks)
                got[(name, mode)].append(statistics.median(steps))
    print(f"world {args.world}, tiny model, global batch 16 x seq 128, median of {args.rounds} "
          f"rounds x 8 steps")
    print(f"{'layout':<18} {'barrier ms':>10} {'back-to-back ms':>15} {'ratio':>6}")
    for name in plans:
        a = statistics.median(got[(name, "barrier")])
        b = statistics.median(got[(name, "back-to-back")])
        print(f"{name:<18} {a * 1e3:>10.1f} {b * 1e3:>15.1f} {a / b:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
