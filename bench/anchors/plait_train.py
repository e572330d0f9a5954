"""plait: the same file for one device, DDP, ZeRO-3 and pipelines; ``--plan`` picks the layout
(``torchrun --nproc-per-node 2 plait_train.py --plan dp_shard=2,zero=3``)."""
import torch
from common import Meter, args

import plait
from plait.data import TextDataset
from plait.models.transformer import build, lm_loss, preset

a = args()
run = plait.init(seed=0)  # the data order torch's DistributedSampler draws (its seed 0)
model = run.parallelize(build(preset(a.model, max_seq_len=a.seq), seed=0))
opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
data = TextDataset(seq_len=a.seq)
loader = run.loader(data, batch_size=a.batch, steps=a.steps)
meter = Meter()
for batch in loader:
    loss = run.step(model, batch, lm_loss, opt)
    meter.tick(loss)
meter.finish()
run.finish()
