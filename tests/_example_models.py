"""Models whose input plait cannot guess, for ``run.parallelize(model, example=batch)``: a
vision transformer on 40x40 images cut into 4x4 patches, whose learned position table of 100
rows fits none of the image sizes a guess tries (224, 32, 64, ...), so that tensor
parallelism's sequence-parallel check has nothing to run on without the user's batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

SIDE, PATCH, DIM, HEADS, CLASSES = 40, 4, 32, 4, 5
STEPS, BATCH = 3, 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_heads = HEADS
        # No key bias: softmax ignores it, its gradient is 0 but for rounding, which AdamW
        # would blow up into an update (ViT-style models often leave it out for that reason).
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM, bias=False), nn.Linear(
            DIM, DIM)
        self.o = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.n_heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.attn, self.n2, self.mlp = nn.LayerNorm(DIM), Attention(), nn.LayerNorm(
            DIM), Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class PatchViT(nn.Module):
    """Conv patches, a learned position per patch (only 40x40 images fit it), two blocks, a
    norm, the mean over patches, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, DIM, PATCH, stride=PATCH)
        self.pos = nn.Parameter(torch.randn(1, (SIDE // PATCH) ** 2, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


class Pictures(Dataset):
    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, SIDE, SIDE, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def train_vit(rank: int, world_size: int, plan: str, with_example: bool) -> dict[str, Any]:
    """AdamW for STEPS steps on :class:`PatchViT` under ``plan`` (batches from ``run.loader``),
    given the first batch as ``example=`` or not: the losses and the full state (rank 0), or
    the refusal's message."""
    from plait.runtime import init

    run = init(plan, quiet=True, seed=0)
    data = Pictures()
    batches = list(run.loader(data, batch_size=BATCH, steps=STEPS))
    torch.manual_seed(0)
    try:
        model = run.parallelize(PatchViT(), example=batches[0] if with_example else None)
    except ValueError as exc:
        run.close()
        return {"refused": str(exc)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [float(run.step(model, batch, F.cross_entropy, opt)) for batch in batches]
    state = run.full_state_dict(model)
    run.close()
    return {"losses": losses, "state": state if rank == 0 else None}


def vit_reference() -> dict[str, Any]:
    """One device with torch alone: the loader's global batches, clipping at 1.0 (plait's
    default), AdamW."""
    from plait.data.loader import DistributedLoader

    data = Pictures()
    torch.manual_seed(0)
    model = PatchViT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    order = DistributedLoader(data, BATCH)
    losses = []
    for step in range(STEPS):
        idx = [int(i) for i in order.global_indices(step)]
        loss = F.cross_entropy(model(data.x[idx]), data.y[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def vit() -> tuple[nn.Module, Dataset, Any]:
    """``(model, dataset, loss_fn)`` for ``plait check --model`` and ``plait plan --model``."""
    torch.manual_seed(0)
    return PatchViT(), Pictures(), F.cross_entropy
