"""What a pipeline step pays when each ``mesh["pp"]`` builds a new DeviceMesh slice.

``plait.mesh.Mesh`` keeps each slice of its root once built; torch 2.13 recomputes a slice's
layout and coordinates on every ``root["pp"]``, and the train step asks for ``mesh["pp"]``
twice per pipeline step. One job of 2 processes (gloo) trains the LoRA-like model of
``bench/own_models_overhead.py`` under ``pp=2,mb=4``; rounds alternate a step with the kept
slices ("cached") and a step after emptying them (each ``mesh["pp"]`` then built anew, as
before the cache), the order swapped every round. Prints each way's median step (a step's
time is its slowest rank's) and the median over rounds of cached / rebuilt.

    PYTHONPATH=. python bench/mesh_slice_cost.py [--rounds 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

WAYS = ("rebuilt", "cached")


def job(rank: int, world: int, rounds: int, warmup: int) -> dict[str, list[float]]:
    import torch.distributed as dist
    from own_models_overhead import MODELS, PlaitContestant

    warnings.filterwarnings("ignore")
    who = PlaitContestant(MODELS["lora"], "pp", rank, world)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    step = 0
    for r in range(warmup + rounds):
        for way in WAYS if r % 2 else WAYS[::-1]:
            if way == "rebuilt":
                who.run.mesh._slices.clear()
            dist.barrier()
            start = time.perf_counter()
            who.step(step)
            elapsed = time.perf_counter() - start
            step += 1
            if r >= warmup:
                times[way].append(elapsed)
    who.run.close()
    return times


def main(argv: list[str] | None = None) -> int:
    from plait.spawn import run_distributed

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args(argv)
    ranks = run_distributed(job, 2, a.rounds, a.warmup, timeout=1800,
                            env={"OMP_NUM_THREADS": "1"})
    steps = {way: [max(ts) for ts in zip(*(r[way] for r in ranks), strict=True)] for way in WAYS}
    ratios = [c / b for c, b in zip(steps["cached"], steps["rebuilt"], strict=True)]
    q1, q2, q3 = statistics.quantiles(ratios, n=4)
    print(f"lora pp=2,mb=4, 2 processes (gloo), {a.rounds} rounds of one step each way")
    for way in WAYS:
        print(f"  {way:<8} median step {1e3 * statistics.median(steps[way]):.2f} ms")
    print(f"  cached / rebuilt: median over rounds {q2:.3f} (quartiles {q1:.2f}-{q3:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
