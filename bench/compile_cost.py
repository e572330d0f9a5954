"""What ``compile`` in the plan costs at the first step and saves after: data vs pipeline parallel.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/compile_cost.py [--world 2]
        [--plans dp=2,dp=2+compile,pp=2,pp=2+compile] [--model test] [--steps 20]
        [--batch 8] [--seq 64] [--microbatches 4]

One job of ``--world`` processes (gloo) per plan trains plait's reference transformer with
``run.step``, twice: ``cold`` with an empty inductor cache (a fresh ``TORCHINDUCTOR_CACHE_DIR``,
what a user's first run on a machine pays) and ``warm`` with the cache the cold job left (a
rerun). Prints, per plan and cache, the first step (slowest rank), the median of the later
steps, and what torch.compile did on each rank: the graphs it built (``unique_graphs``) and the
frames it was asked to compile (``frames``: more than the graphs means a recompile or a frame
that failed, e.g. one called on the meta device), the graphs inductor took from its cache, and
the seconds torch.compile spent on each rank (``compile s/rank``).

The first step is about the sum of the ranks' compile seconds where the stages compile one
after another (torch's stage shape inference runs through the sends: a later stage's blocks
meet torch.compile only once the earlier stage has compiled and sent its shapes on, and the
backward the other way), and about their maximum where they compile at once (data parallel;
pipeline parallel since each rank compiles its stages before the schedule's sends,
``plait.parallel.pipeline_warmup``). Each stage's blocks compile to the same graphs at the same
shapes: one after another, cold, the first stage compiles the forward and finds the backward the
last stage left in the on-disk cache, the last stage the other way round (one hit of two on each
rank); at once, cold, every rank compiles both, as under data parallel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def job(rank: int, world: int, plan: str, model_name: str, steps: int, batch: int,
        seq: int) -> dict:
    """This rank's step times and what torch.compile did."""
    import torch
    import torch.distributed as dist

    import plait
    from plait._torch_compat import (
        compile_seconds,
        dynamo_frames,
        dynamo_graph_count,
        inductor_cache_hits,
    )
    from plait.models.transformer import build, lm_loss, preset

    run = plait.init(plan, quiet=True, log_every=10**9)
    model = run.parallelize(build(model_name))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = preset(model_name).vocab_size
    gen = torch.Generator().manual_seed(run.dp_rank)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch // run.dp_size, seq + 1), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        run.step(model, (tokens[:, :-1], tokens[:, 1:]), lm_loss, opt)
        times.append(time.perf_counter() - start)

    frames, compiled = dynamo_frames()
    out = {"times": times, "graphs": dynamo_graph_count(), "frames": frames,
           "failed": frames - compiled, "hits": inductor_cache_hits(),
           "compile": compile_seconds()}
    run.close()
    return out


def main(argv: list[str] | None = None) -> int:
    from plait.spawn import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--plans", default=None,
                    help="plans separated by commas, '+' inside a plan (default: "
                         "dp=WORLD,dp=WORLD+compile,pp=WORLD,pp=WORLD+compile)")
    ap.add_argument("--model", default="test")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4, help="for the pipeline plans")
    args = ap.parse_args(argv)
    w = args.world
    plans = (args.plans or f"dp={w},dp={w}+compile,pp={w},pp={w}+compile").split(",")
    print(f"world {w}, gloo on CPU, model {args.model}, global batch {args.batch} x seq "
          f"{args.seq}, {args.steps} steps, pipeline microbatches {args.microbatches}")
    print(f"{'plan':<34} {'cache':<5} {'first s':>8} {'later ms':>9} "
          f"{'graphs/rank':>12} {'frames/rank':>12} {'failed':>7} {'cache hits':>11} "
          f"{'compile s/rank':>15}")
    for plan in plans:
        spec = plan.replace("+", ",")
        if spec.startswith("pp=") or ",pp=" in spec:
            spec += f",microbatches={args.microbatches}"
        with tempfile.TemporaryDirectory(prefix="plait-inductor-") as cache:
            # the bench's own knob: each plan's cold job starts from an empty cache
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            for kind in ("cold", "warm"):
                if "compile" not in spec and kind == "warm":
                    continue
                ranks = run_distributed(job, w, spec, args.model, args.steps, args.batch,
                                        args.seq, timeout=900)
                steps = [max(ts) for ts in zip(*(r["times"] for r in ranks), strict=True)]
                later = statistics.median(steps[1:]) * 1e3
                per = {key: "/".join(str(r[key]) for r in ranks)
                       for key in ("graphs", "frames", "failed", "hits")}
                per["compile"] = "/".join(f"{r['compile']:.1f}" for r in ranks)
                print(f"{spec:<34} {kind if 'compile' in spec else '-':<5} {steps[0]:>8.2f} "
                      f"{later:>9.2f} {per['graphs']:>12} {per['frames']:>12} "
                      f"{per['failed']:>7} {per['hits']:>11} {per['compile']:>15}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
