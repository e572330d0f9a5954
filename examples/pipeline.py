"""Pipeline parallelism on the reference transformer: schedule, training, measured bubble.

    plait run --nproc 2 examples/pipeline.py --plan pp=2,schedule=1f1b,mb=4
    plait run --nproc 2 examples/pipeline.py --plan pp=2,schedule=zbv,v=2,mb=4
    plait run --nproc 4 examples/pipeline.py --plan pp=2,dp=2,schedule=gpipe,mb=4
    python examples/pipeline.py            # starts 2 local processes itself
    plait run --nproc 2 examples/pipeline.py --steps 6     # a short run

The training loop is the same as on one device; only the plan says "pipeline". Before training
it prints the schedule as a step x rank grid (no processes needed for that: it is data), and
after training the bubble it measured beside the theoretical one, plus a timeline PNG when
matplotlib is installed (``pip install 'plait[plot]'``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import plait
from plait.data import TextDataset
from plait.models.transformer import build, lm_loss, preset
from plait.parallel.schedules import format_schedule, theoretical_bubble
from plait.parallel.timeline import bubble_fraction, plot

DEFAULT_PLAN = "pp=2,schedule=1f1b,mb=4"


def main(plan: str | None = None, steps: int = 20, png: str = "pipeline_timeline.png") -> None:
    run = plait.init(plan, log_every=5)
    p = run.plan
    if p.pp == 1:
        raise SystemExit("this example needs a pipeline plan, e.g. --plan " + DEFAULT_PLAN)
    run.print(format_schedule(p.pp_schedule, p.pp, p.microbatches, p.virtual_stages) + "\n")

    # 8 blocks so that pp=4 x 2 virtual stages still gets one block per stage.
    cfg = preset("tiny", n_layers=8)
    model = run.parallelize(build(cfg, seed=0))
    specs = ", ".join(f"stage {s.index}: blocks {s.start}-{s.end - 1}"
                      for s in plait.layout_of(model).stage_specs)
    print(f"rank {run.rank}: {specs}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

    pipe = plait.layout_of(model).pipeline
    data = TextDataset(seq_len=64)
    for i, batch in enumerate(run.loader(data, batch_size=8 * p.dp, steps=steps)):
        if i == steps - 3:  # record the last steps (the first ones include shape inference)
            pipe.timeline.clear()
            pipe.timeline.recording = True
        run.step(model, batch, lm_loss, opt)
    pipe.timeline.recording = False
    events = pipe.timeline.gather(run.mesh["pp"].get_group())
    if run.dp_rank == 0 and run.mesh.local_rank("pp") == 0:
        theory = theoretical_bubble(p.pp_schedule, p.pp, p.microbatches, p.virtual_stages)
        print(f"bubble: measured {bubble_fraction(events):.1%} (mean of the last "
              f"{len({e.step for e in events})} steps), theory {theory:.1%} (the theory counts "
              f"compute only; the measured idle time also holds the waits on sends and "
              f"receives, large beside a model this small)", flush=True)
        try:
            print(f"timeline: {plot(events, png)}", flush=True)
        except ImportError as exc:
            print(f"no timeline PNG: {exc}", flush=True)
    run.finish()


def _worker(rank: int, world_size: int, plan: str, steps: int) -> None:
    main(plan, steps=steps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", default=None)
    parser.add_argument("--steps", type=int, default=20, help="at least 3")
    args, _ = parser.parse_known_args()
    if "WORLD_SIZE" in os.environ:
        main(args.plan or DEFAULT_PLAN, steps=max(3, args.steps))
    else:  # plain `python examples/pipeline.py`: start the processes here
        from plait.plan import Plan
        from plait.spawn import run_distributed

        plan = args.plan or DEFAULT_PLAN
        run_distributed(_worker, Plan.load(plan).world_size, plan, max(3, args.steps),
                        timeout=600)
        sys.exit(0)
