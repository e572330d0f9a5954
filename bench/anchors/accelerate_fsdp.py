"""Hugging Face Accelerate with its FSDP plugin (FSDP2, one unit per transformer block)."""
from itertools import islice

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from common import Meter, args
from torch.utils.data import DataLoader

from plait.data import TextDataset
from plait.models.transformer import build, lm_loss, preset

a = args()
fsdp = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                      transformer_cls_names_to_wrap=["Block"])
accelerator = Accelerator(fsdp_plugin=fsdp)
model = build(preset(a.model, max_seq_len=a.seq), seed=0)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
data = TextDataset(seq_len=a.seq)
loader = DataLoader(data, batch_size=a.batch // accelerator.num_processes, shuffle=True)
model, opt, loader = accelerator.prepare(model, opt, loader)
meter = Meter()
for x, y in islice(loader, a.steps):
    loss = lm_loss(model(x), y)
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    meter.tick(loss)
meter.finish()
accelerator.end_training()
