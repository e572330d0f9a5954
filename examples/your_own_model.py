"""Your own model under plait: prove the layout first, then train.

A model nobody in plait wrote (residual MLP blocks in an nn.Sequential, BatchNorm, a masked
loss whose rows count different numbers of labels) and its own dataset. Two commands:

    plait check --plan dp=2,sync_bn --model examples.your_own_model:factory   # same as 1 device?
    plait run --nproc 2 examples/your_own_model.py --plan dp=2,sync_bn        # then train

``factory()`` is all ``plait check`` needs: it returns (model, dataset, loss_fn). The loss is a
mean over the labels that are not -100, and plait makes that the mean over the *global* batch
(the count of labels is all-reduced once per step), as one device computes it. ``sync_bn``
takes BatchNorm statistics over the data axes; without it plait warns and names the layers.
Try ``--plan tp=2``: the tensor-parallel plan is inferred from the structure, checked with one
fake-tensor forward, and printed.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

import plait

FEATURES, WIDTH, CLASSES = 12, 64, 5


class Block(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TaggingModel(nn.Module):
    """Tags every position of a (batch, positions, features) input with one of CLASSES."""

    def __init__(self, depth: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.GELU())
        self.bn = nn.BatchNorm1d(WIDTH)
        self.blocks = nn.Sequential(*(Block(WIDTH) for _ in range(depth)))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)  # BatchNorm over (batch, positions)
        return self.head(self.blocks(h))


class Sequences(Dataset):
    """Synthetic sequences; each has a random number of labelled positions (the rest -100)."""

    def __init__(self, n: int = 512, positions: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, positions, FEATURES, generator=g)
        w = torch.randn(FEATURES, CLASSES, generator=g)
        self.y = (self.x @ w).argmax(-1)
        keep = torch.rand(n, positions, generator=g) < torch.rand(n, 1, generator=g)
        self.y[~keep] = -100

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def tagging_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the labelled positions (-100 is ignored)."""
    return F.cross_entropy(logits.reshape(-1, CLASSES), labels.reshape(-1), ignore_index=-100)


def factory() -> tuple[nn.Module, Dataset, object]:
    """What `plait check --model examples.your_own_model:factory` trains."""
    return TaggingModel(), Sequences(), tagging_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch", "--batch-size", dest="batch_size", type=int, default=32)
    parser.add_argument("--plan", default=None)  # read by plait.init()
    parser.add_argument("--accelerator", default=None)  # read by plait.init()
    parser.add_argument("--format", default="text")  # json: events, read by plait.init()
    args = parser.parse_args()

    run = plait.init()
    model, dataset, loss_fn = factory()
    model = run.parallelize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in run.loader(dataset, batch_size=args.batch_size, steps=args.steps):
        loss = run.step(model, batch, loss_fn, opt)
    run.print(f"final loss {float(loss):.4f}")
    state = run.full_state_dict(model)  # full tensors under your own names, any layout
    run.print(f"{len(state)} tensors, e.g. {next(iter(state))}")
    run.finish()


if __name__ == "__main__":
    main()
