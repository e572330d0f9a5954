"""What ``plait plan`` prices for a ViT-B/16 (224 x 224 images, 16 x 16 patches: 196 tokens,
width 768, 12 heads, MLP 3072, 12 blocks, 1000 classes; tests/_workers_tp_outside.py's
``PatchViT`` built on the meta device) under tensor parallelism on one ``dgx-h100`` node of 8
GPUs: the step time, and per microbatch the time outside the blocks before them (``embed``:
the patchify ``Conv2d``'s forward + backward, and under tp the collectives at the stack's
input) and after them (``head``: the classifier, the per-microbatch overheads). Every tp
rank runs the stem and the classifier whole (the layer plan splits neither).

    python bench/planner_tp_stem.py [--global-batch 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from plait.plan import Plan
from plait.planner import constants_for
from plait.planner.compute import microbatch_times
from plait.planner.cost import Workload, evaluate
from plait.planner.hardware import load_cluster
from plait.planner.model_stats import load_model
from tests._workers_tp_outside import PatchViT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--global-batch", type=int, default=256)
    args = parser.parse_args(argv)
    with torch.device("meta"):
        model = PatchViT(image=224, patch=16, width=768, heads=12, ffn=3072, layers=12,
                         classes=1000)
    stats = load_model(model)
    cluster = load_cluster("dgx-h100", devices=8)
    c = constants_for(cluster)
    seq = 196
    print(f"ViT-B/16 on dgx-h100 x 8, global batch {args.global_batch}, seq {seq}")
    print(f"{'plan':12} {'step ms':>9} {'embed ms/mb':>11} {'head ms/mb':>11} {'MFU':>7}")
    for plan_text in ("dp=8", "dp=4,tp=2", "dp=2,tp=4"):
        plan = Plan.from_string(plan_text)
        est = evaluate(plan, stats, cluster, Workload(args.global_batch, seq), c)
        b = args.global_batch // (8 // plan.tp) // plan.grad_accum
        t = microbatch_times(plan, stats, cluster, b, seq, c)
        print(f"{plan_text:12} {est.step_time_s * 1e3:9.2f} {t.embed * 1e3:11.3f}"
              f" {t.head * 1e3:11.3f} {est.mfu:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
