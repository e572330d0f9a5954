"""Raw PyTorch pipeline parallelism (torch.distributed.pipelining, 1F1B over 4 micro-batches),
one stage per process, started by torchrun."""
import os
from itertools import islice

import torch
import torch.distributed as dist
import torch.nn as nn
from common import Meter, args
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.utils.data import DataLoader

from plait.data import TextDataset
from plait.models.transformer import build, lm_loss, preset

a = args()
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
torch.manual_seed(0)  # every stage must draw the same batches
model = build(preset(a.model, max_seq_len=a.seq), seed=0)
per_stage = len(model.layers) // world
model.layers = nn.ModuleList(model.layers[rank * per_stage:(rank + 1) * per_stage])
if rank > 0:
    model.tok_embeddings = None
if rank < world - 1:
    model.norm, model.output = None, None
model.to(device)
stage = PipelineStage(model, rank, world, device)
schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=lm_loss)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
data = TextDataset(seq_len=a.seq)
loader = DataLoader(data, batch_size=a.batch, shuffle=True)
meter = Meter()
for x, y in islice(loader, a.steps):
    x, y = x.to(device), y.to(device)
    losses = []
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    loss = torch.stack(losses).mean() if losses else float("nan")
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    squared = norm**2
    dist.all_reduce(squared)  # the global norm spans every stage's gradients
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, squared.sqrt())
    opt.step()
    opt.zero_grad()
    meter.tick(loss)
meter.finish()
dist.destroy_process_group()
