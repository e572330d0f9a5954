"""Raw PyTorch DistributedDataParallel, started by torchrun."""
import os
from itertools import islice

import torch
import torch.distributed as dist
from common import Meter, args
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from plait.data import TextDataset
from plait.models.transformer import build, lm_loss, preset

a = args()
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
model = build(preset(a.model, max_seq_len=a.seq), seed=0).to(device)
model = DDP(model, device_ids=[local_rank] if cuda else None)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
data = TextDataset(seq_len=a.seq)
sampler = DistributedSampler(data, shuffle=True)
loader = DataLoader(data, batch_size=a.batch // dist.get_world_size(), sampler=sampler)
meter = Meter()
for x, y in islice(loader, a.steps):
    x, y = x.to(device), y.to(device)
    loss = lm_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    meter.tick(loss)
meter.finish()
dist.destroy_process_group()
