"""The README's training script: the same file on one device or many.

    python examples/train.py --steps 50
    plait run --nproc 2 examples/train.py --plan dp=2 --steps 50
    plait run --nproc 4 examples/train.py --plan dp=2,tp=2 --steps 50
    plait run --nproc 2 --format json examples/train.py --plan dp=2 --steps 50
"""

import argparse

import torch

import plait
from plait.data import TextDataset
from plait.models.transformer import build, lm_loss

parser = argparse.ArgumentParser()
parser.add_argument("--plan", default=None, help="layout, e.g. dp=2,tp=2 (default: dp over all)")
parser.add_argument("--accelerator", default=None, help="e.g. cuda (read by plait.init())")
parser.add_argument("--format", default="text", help="json: JSON Lines events on stdout, as "
                    "plait run --format json passes it (read by plait.init())")
parser.add_argument("--model", default="tiny")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--global-batch", "--batch-size", dest="batch_size", type=int, default=32)
parser.add_argument("--seq", "--seq-len", dest="seq_len", type=int, default=128)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)                           # the run's seed, as on one device
run = plait.init(args.plan, log_every=10)              # torchrun env, device, backend, mesh
model = run.parallelize(build(args.model))             # PP split, TP/SP, checkpointing, FSDP/DDP
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
dataset = TextDataset(seq_len=args.seq_len)
for batch in run.loader(dataset, batch_size=args.batch_size, steps=args.steps):
    loss = run.step(model, batch, lm_loss, opt)        # forward, backward, clip, step
info = run.finish()                                    # summary: loss, tokens/s, memory per rank
if run.is_main:
    print(f"FINAL {info['final_loss']:.6f} {info['world_size']}")
