"""One device: the script every other file in this folder starts from."""
from itertools import islice

import torch
from common import Meter, args
from torch.utils.data import DataLoader

from plait.data import TextDataset
from plait.models.transformer import build, lm_loss, preset

a = args()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = build(preset(a.model, max_seq_len=a.seq), seed=0).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
data = TextDataset(seq_len=a.seq)
loader = DataLoader(data, batch_size=a.batch, shuffle=True)
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
