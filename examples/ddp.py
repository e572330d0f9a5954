"""Data parallelism, by hand and by plait, side by side — for learning what DDP does.

Each of N processes holds the whole model and a different slice of the global batch. After the
backward pass the gradients are averaged with one all-reduce (2(N-1)/N x parameter bytes per rank
on a ring), so every replica takes the same optimizer step and the replicas never drift apart.

This script shows it twice on the same data: first a hand-written loop (all-reduce each gradient
ourselves), then plait's DDP, and checks both equal one device's training.

    plait run --nproc 2 examples/ddp.py
"""

import torch
import torch.distributed as dist

import plait
from plait.data import TextDataset
from plait.data.loader import DistributedLoader
from plait.models.transformer import build, lm_loss

STEPS, BATCH, SEQ = 5, 8, 32

run = plait.init(log_every=STEPS)
rank, world = run.dp_rank, run.dp_size
dataset = TextDataset(seq_len=SEQ)

# 1. By hand: every rank computes gradients on its slice, then all-reduces and averages them.
manual = build("tiny", seed=0)
opt = torch.optim.SGD(manual.parameters(), lr=0.1)
loader = DistributedLoader(dataset, BATCH, dp_rank=rank, dp_size=world, seed=run.seed)
for step in range(STEPS):
    x, y = loader.batch(step)
    lm_loss(manual(x), y).backward()
    for p in manual.parameters():
        dist.all_reduce(p.grad)          # sum over replicas ...
        p.grad /= world                  # ... then the mean: the gradient of the global batch
    opt.step()
    opt.zero_grad()

# 2. plait: the same thing through DDP (bucketed, overlapped with the backward pass).
model = run.parallelize(build("tiny", seed=0))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
plan_no_clip = run.plan.replace(grad_clip=None)
run.plan = plan_no_clip                  # the hand-written loop does not clip either
for batch in run.loader(dataset, batch_size=BATCH, steps=STEPS):
    run.step(model, batch, lm_loss, opt)

# 3. One device, whole global batch, for reference (every rank computes it; it is small).
single = build("tiny", seed=0)
opt = torch.optim.SGD(single.parameters(), lr=0.1)
loader = DistributedLoader(dataset, BATCH, seed=run.seed)  # run.loader's order
for step in range(STEPS):
    x, y = loader.batch(step)
    lm_loss(single(x), y).backward()
    opt.step()
    opt.zero_grad()

ours = dict(model.module.named_parameters()) if hasattr(model, "module") else dict(
    model.named_parameters())
diff_manual = max((a - b).abs().max().item()
                  for a, b in zip(manual.parameters(), single.parameters(), strict=True))
diff_plait = max((ours[n] - p).abs().max().item() for n, p in single.named_parameters())
run.print(f"max |param diff| vs one device: by hand {diff_manual:.2e}, plait {diff_plait:.2e}")
run.finish(print_summary=False)
if max(diff_manual, diff_plait) > 1e-5:
    raise SystemExit(f"data parallel training drifted from one device: {diff_manual:.2e}, "
                     f"{diff_plait:.2e} (expected < 1e-5)")
