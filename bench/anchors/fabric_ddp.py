"""Lightning Fabric, data parallel (started by torchrun)."""
import os
from itertools import islice

import torch
from common import Meter, args
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from plait.data import TextDataset
from plait.models.transformer import build, lm_loss, preset

a = args()
fabric = Fabric(devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp")
fabric.launch()
model = build(preset(a.model, max_seq_len=a.seq), seed=0)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
model, opt = fabric.setup(model, opt)
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
