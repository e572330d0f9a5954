"""Checkpoints: stop a run, start it again, and it continues exactly where it stopped, under
the same layout or another one.

    plait run --nproc 2 examples/checkpoint_resume.py --plan dp=2 --stop-at 100   # stops at 100
    plait run --nproc 2 examples/checkpoint_resume.py --plan dp=2                 # 101..200
    python examples/checkpoint_resume.py --steps 300        # one process resumes the dp=2 one
    plait export ckpt/ --to model.safetensors                # the model, as one plain file

With ``checkpoint=`` the run saves every ``--every`` steps (and when it finishes) into
``--checkpoint``, keeping the newest three, and when that folder already holds a checkpoint it
resumes from the newest: model, optimizer, LR scheduler, data position, random states. Stopped
and resumed, the losses are bitwise those of a run that never stopped (fp32 on CPU, same plan).
"""

import argparse

import torch

import plait
from plait.data import TextDataset
from plait.models.transformer import build, lm_loss

parser = argparse.ArgumentParser()
parser.add_argument("--plan", default=None, help="layout, e.g. dp=2 (default: dp over all)")
parser.add_argument("--accelerator", default=None, help="e.g. cuda (read by plait.init())")
parser.add_argument("--format", default="text")  # json: events, read by plait.init()
parser.add_argument("--model", default="tiny")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--stop-at", type=int, default=None, help="stop early (as if preempted)")
parser.add_argument("--every", type=int, default=50, help="save every N steps")
parser.add_argument("--checkpoint", default="ckpt/", help="checkpoint folder")
parser.add_argument("--global-batch", "--batch-size", dest="batch_size", type=int, default=16)
parser.add_argument("--seq", "--seq-len", dest="seq_len", type=int, default=64)
args = parser.parse_args()

run = plait.init(args.plan, checkpoint=args.checkpoint, every=args.every, keep=3)
model = run.parallelize(build(args.model))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
steps = min(args.steps, args.stop_at or args.steps)
for batch in run.loader(TextDataset(seq_len=args.seq_len), batch_size=args.batch_size,
                        steps=steps):               # a resumed run starts at the saved step
    loss = run.step(model, batch, lm_loss, opt, scheduler=sched)  # saves every --every steps
info = run.finish()                                 # saves the final step too
if run.is_main and info["final_loss"] is not None:
    print(f"FINAL step {run.steps_done} loss {info['final_loss']:.6f}")
