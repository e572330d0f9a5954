"""Models whose forward takes more than one input, under the layouts whose checks run the
model before training (an inferred tensor-parallel plan, sequence parallelism, a pipeline's
split, ``plan="auto"``), given the first batch as ``example=`` or not: a U-Net-like denoiser
``forward(x, t)`` (convolutions, a timestep MLP) and a ``forward(features, mask)`` stack of
MLP blocks. Each has an MLP whose inferred tensor-parallel plan does not fit its dataflow (a
learned gain over the full hidden width, a layer norm over a stored width), which only a
forward catches; ``fitting=True`` builds the same models without it, whose plan fits."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate

C, HIDDEN, FEATURES, SEQ, BLOCKS = 8, 16, 8, 6, 4
STEPS, BATCH = 2, 8


class TimeMLP(nn.Module):
    """Sinusoidal features of t through up, SiLU, a fixed per-feature gain (a buffer), down:
    the gain is read at the full hidden width, which a column-parallel ``up`` gives 1/tp of."""

    def __init__(self, gain: bool) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(C, HIDDEN), nn.Linear(HIDDEN, C)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, HIDDEN) if gain else None)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = C // 2
        freqs = torch.exp(-math.log(1000.0) * torch.arange(half, dtype=torch.float32) / half)
        angles = t.float()[:, None] * freqs[None]
        h = F.silu(self.up(torch.cat([angles.sin(), angles.cos()], dim=-1)))
        return self.down(h if self.gain is None else h * self.gain)


class Denoiser(nn.Module):
    """A convolution in, the timestep added per channel, one level down and up with the skip
    added, a convolution out."""

    def __init__(self, fitting: bool = False) -> None:
        super().__init__()
        self.time = TimeMLP(gain=not fitting)
        self.inp = nn.Conv2d(1, C, 3, padding=1)
        self.norm = nn.GroupNorm(2, C)
        self.down = nn.Conv2d(C, C, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(C, C, 2, stride=2)
        self.out = nn.Conv2d(C, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h0 = F.silu(self.norm(self.inp(x) + self.time(t)[:, :, None, None]))
        return self.out(h0 + self.up(F.silu(self.down(h0))))


class Noised(Dataset):
    """8x8 noised one-channel images, their timesteps, the noise as labels."""

    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(1)
        self.noise = torch.randn(n, 1, 8, 8, generator=g)
        self.x = torch.randn(n, 1, 8, 8, generator=g).cumsum(-1) / 3 + self.noise
        self.t = torch.randint(0, 1000, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "t": self.t[i], "labels": self.noise[i]}


class MaskedBlock(nn.Module):
    """A residual MLP whose hidden features are layer-normed over a stored width (what a
    column-parallel ``up`` gives 1/tp of), the masked positions left as they are."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(FEATURES, HIDDEN), nn.Linear(HIDDEN, FEATURES)
        self.width = HIDDEN if norm else 0

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        u = F.gelu(self.up(h))
        if self.width:
            u = F.layer_norm(u, (self.width,))
        return h + self.down(u) * mask[..., None]


class MaskedMLP(nn.Module):
    """``forward(features, mask)``: a stack of :class:`MaskedBlock`, the mean over the
    unmasked positions, one value per row."""

    def __init__(self, fitting: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MaskedBlock(norm=not fitting) for _ in range(BLOCKS))
        self.head = nn.Linear(FEATURES, 1)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = features
        for block in self.blocks:
            h = block(h, mask)
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.head(pooled).squeeze(-1)


class Masked(Dataset):
    """Features of SEQ positions, a mask that keeps at least the first, a target per row."""

    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(2)
        lengths = torch.randint(1, SEQ + 1, (n,), generator=g)
        self.mask = (torch.arange(SEQ)[None] < lengths[:, None]).float()
        self.features = torch.randn(n, SEQ, FEATURES, generator=g)
        self.y = torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": self.features[i], "mask": self.mask[i], "labels": self.y[i]}


MODELS: dict[str, tuple[type[nn.Module], type[Dataset]]] = {
    "denoiser": (Denoiser, Noised), "masked": (MaskedMLP, Masked)}


def _build(name: str, fitting: bool) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0](fitting)


def reference(name: str, fitting: bool) -> dict[str, Any]:
    """One device with torch alone: SGD on the loader's global batches, clipping at 1.0
    (plait's default); the losses and the parameters after STEPS steps."""
    from plait.data.loader import DistributedLoader

    data = MODELS[name][1]()
    model = _build(name, fitting)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    order = DistributedLoader(data, BATCH)
    losses = []
    for step in range(STEPS):
        batch = default_collate([data[int(i)] for i in order.global_indices(step)])
        labels = batch.pop("labels")
        loss = F.mse_loss(model(**batch), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone()
                                        for k, v in model.state_dict().items()}}


def train(rank: int, world_size: int, jobs: list[tuple[str, str, bool, bool]]
          ) -> list[dict[str, Any]]:
    """Each (model name, plan, fitting, with example=): the model laid out for the plan (the
    first batch given as ``example=`` or not) and trained as :func:`reference` trains it; the
    plan used with the losses and rank 0's full state, the refusal's message, or what the
    first step raised."""
    from plait.runtime import init

    out: list[dict[str, Any]] = []
    for name, plan, fitting, with_example in jobs:
        run = init(plan, quiet=True, seed=0)
        data = MODELS[name][1]()
        # plan="auto" chooses the mesh in run.parallelize, before any loader: the example is
        # the dataset's first rows, collated as the loader collates them.
        example = default_collate([data[i] for i in range(BATCH // world_size)])
        try:
            model = run.parallelize(_build(name, fitting),
                                    example=example if with_example else None)
        except ValueError as exc:
            run.close()
            out.append({"refused": str(exc)})
            continue
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            losses = [float(run.step(model, b, F.mse_loss, opt))
                      for b in run.loader(data, batch_size=BATCH, steps=STEPS)]
        except Exception as exc:  # noqa: BLE001 - what the user would see
            run.close()
            out.append({"raised": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"})
            continue
        state = run.full_state_dict(model)
        out.append({"plan": run.plan.to_string(), "losses": losses,
                    "state": state if rank == 0 else None})
        run.close()
    return out
