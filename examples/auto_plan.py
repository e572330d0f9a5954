"""Let the planner pick the layout: ranked candidates first, then training under the winner.

    plait run --nproc 2 examples/auto_plan.py
    plait run --nproc 4 examples/auto_plan.py --model small --global-batch 16
    plait run --nproc 2 examples/auto_plan.py --steps 4          # a short run

The planner (``plait.planner``) is pure Python: it needs no process group and no hardware, only
the model's shape, the cluster's description (a preset such as ``cpu``, ``dgx-h100``,
``tpu-v5p``, or a YAML file) and the global batch. Every rank runs the same search on the same
inputs and gets the same answer, so no rank has to broadcast it. The table shows each candidate's
predicted step time, throughput, memory per device and bytes sent per step; after training the
run summary shows the measured step time beside it. The same search sizes a 1,000-GPU job:

    plait plan --model llama-8b --cluster dgx-h100 --nodes 8 --global-batch 512 --seq 4096
"""

import argparse
import os

import torch

import plait
from plait.data import TextDataset
from plait.models.transformer import build, lm_loss, preset
from plait.planner import plan_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--cluster", default="cpu", help="planner preset or YAML file")
    parser.add_argument("--global-batch", "--batch-size", dest="batch_size", type=int, default=8,
                        help="global batch")
    parser.add_argument("--seq", "--seq-len", dest="seq_len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accelerator", default=None)  # read by plait.init()
    parser.add_argument("--format", default="text")  # json: events, read by plait.init()
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; the planner needs no group
    cfg = preset(args.model, max_seq_len=args.seq_len)
    result = plan_model(cfg, args.cluster, world_size=world, global_batch=args.batch_size,
                        seq=args.seq_len, top=5)
    if result.best is None:
        raise SystemExit(f"no layout of {args.model} fits {world} x {args.cluster}")

    run = plait.init(result.best.plan, log_every=10)
    run.print(f"{len(result.ranked)} best of {result.evaluated} layouts for {args.model} on "
              f"{world} x {args.cluster}, global batch {args.batch_size} x {args.seq_len}:")
    run.print(f"  {'plan':<34} {'ms/step':>8} {'tokens/s':>10} {'MiB/device':>10} "
              f"{'MiB sent':>9}")
    for est in result.ranked:
        sent = sum(est.comm_bytes_per_step.values()) / 2**20
        run.print(f"  {est.plan.to_string():<34} {1000 * est.step_time_s:>8.1f} "
                  f"{est.tokens_per_s:>10,.0f} {est.memory_bytes_per_device / 2**20:>10,.1f} "
                  f"{sent:>9.2f}")
    run.print(f"training under the winner: {run.plan.describe()}\n")

    model = run.parallelize(build(cfg, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in run.loader(TextDataset(seq_len=args.seq_len), batch_size=args.batch_size,
                            steps=args.steps):
        run.step(model, batch, lm_loss, opt)
    info = run.finish()
    run.print(f"predicted {1000 * result.best.step_time_s:.1f} ms/step, "
              f"measured {1000 * info['step_time_s']:.1f} ms/step")


if __name__ == "__main__":
    main()
