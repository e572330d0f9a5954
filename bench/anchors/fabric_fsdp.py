"""Lightning Fabric, sharded: ModelParallelStrategy with FSDP2 (fully_shard per block, then the
root). Fabric's FSDPStrategy (FSDP1) refuses CPUs ("FSDP is only available on GPU"); this one,
Fabric's strategy for FSDP2/DTensor, runs on both."""
import os
from itertools import islice

import torch
from common import Meter, args
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from plait.data import TextDataset
from plait.models.transformer import build, lm_loss, preset


def shard(model, mesh):
    for block in model.layers:
        fully_shard(block, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


a = args()
world = int(os.environ["WORLD_SIZE"])
fabric = Fabric(devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                strategy=ModelParallelStrategy(shard, data_parallel_size=world,
                                               tensor_parallel_size=1))
fabric.launch()
model = build(preset(a.model, max_seq_len=a.seq), seed=0)
model = fabric.setup_module(model)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
opt = fabric.setup_optimizers(opt)
data = TextDataset(seq_len=a.seq)
loader = DataLoader(data, batch_size=a.batch // fabric.world_size, shuffle=True)
loader = fabric.setup_dataloaders(loader)
meter = Meter()
for x, y in islice(loader, a.steps):
    loss = lm_loss(model(x), y)
    fabric.backward(loss)
    fabric.clip_gradients(model, opt, max_norm=1.0)
    opt.step()
    opt.zero_grad()
    meter.tick(loss)
meter.finish()
