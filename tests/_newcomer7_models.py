"""Three model families a newcomer brings, written from the docs alone: a CLIP-style two-tower
contrastive model with a learned ``logit_scale`` and InfoNCE over the global batch, a small
diffusion U-Net (skip connections, a sinusoidal timestep embedding in each block, GroupNorm,
MSE on the noise) and a language model with a mixture-of-experts layer of its own (top-2 of 4
experts in an ``nn.ModuleList``, a load-balancing loss added to the task loss).

Each case is ``(model, dataset, loss_fn, collate_fn)``; a loss that compares rows across the
batch (InfoNCE, the balance loss's expert shares) takes a ``gather`` (``run.all_gather`` under
plait, :func:`one_device_gather` on one device) and gathers what it compares, as the docs'
"A loss over the whole batch" says."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

STEPS, BATCH = 3, 8
Gather = Callable[..., Any]


def one_device_gather(t: torch.Tensor, *, return_index: bool = False) -> Any:
    """What ``run.all_gather`` is on one data rank: ``t`` itself, its rows in place."""
    return (t, torch.arange(len(t), device=t.device)) if return_index else t


# --- 1. CLIP-style two towers ---

IMG, VOCAB, SEQ, WIDTH, EMBED = 12, 16, 6, 16, 8


class TextBlock(nn.Module):
    """Pre-norm self-attention (``nn.MultiheadAttention``) and an MLP, residuals inside."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                 nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm1(h)
        h = h + self.attn(x, x, x, need_weights=False)[0]
        return h + self.mlp(self.norm2(h))


class TwoTower(nn.Module):
    """An MLP image tower and an embedding + 2-block transformer text tower, each projected
    to EMBED and normalised; ``logit_scale`` the learned log temperature (0-dim as in CLIP,
    or 1-element: ``scalar=False``)."""

    def __init__(self, scalar: bool = True) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(IMG, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, WIDTH))
        self.blocks = nn.ModuleList([TextBlock() for _ in range(2)])
        self.image_proj = nn.Linear(WIDTH, EMBED, bias=False)
        self.text_proj = nn.Linear(WIDTH, EMBED, bias=False)
        start = torch.tensor(math.log(1 / 0.07))
        self.logit_scale = nn.Parameter(start if scalar else start.reshape(1))

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.embed(ids) + self.pos
        for block in self.blocks:
            h = block(h)
        text = F.normalize(self.text_proj(h.mean(1)), dim=-1)
        image = F.normalize(self.image_proj(self.image(pixels)), dim=-1)
        return image, text, self.logit_scale.exp()


class Pairs(Dataset):
    """(image features, caption ids) pairs, the caption a noisy function of the image."""

    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.pixels = torch.randn(n, IMG, generator=g)
        codes = (self.pixels[:, :SEQ] * 3).long() % VOCAB
        self.ids = (codes + torch.randint(0, 2, (n, SEQ), generator=g)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixels": self.pixels[i], "ids": self.ids[i]}


def collate_pairs(items: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], Any]:
    """Inputs by keyword; no targets (the labels are the rows' own places)."""
    return ({"pixels": torch.stack([d["pixels"] for d in items]),
             "ids": torch.stack([d["ids"] for d in items])},
            torch.zeros(len(items)))


def clip_loss(gather: Gather) -> Callable[[Any, Any], torch.Tensor]:
    """InfoNCE both ways over every pair of the global batch: this rank's rows against the
    gathered rows of every replica (the two-tower test's loss, reused)."""
    from tests._workers_encdec import scaled_nce

    return cast(Callable[[Any, Any], torch.Tensor], scaled_nce(gather))


def clip_local_loss(_: Gather) -> Callable[[Any, Any], torch.Tensor]:
    """The same InfoNCE on this rank's rows alone: another loss under data parallelism."""
    return clip_loss(one_device_gather)


# --- 2. a diffusion U-Net ---

CH, SIDE, TIMES = 8, 8, 100


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The sinusoidal embedding of integer timesteps (DDPM's)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class ResBlock(nn.Module):
    """GroupNorm, SiLU, conv, plus the timestep embedding projected to the channels."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(2, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.time = nn.Linear(2 * CH, cout)
        self.norm2 = nn.GroupNorm(2, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time(temb)[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class UNet(nn.Module):
    """Two levels down (stride-2 convs), a middle block, two levels up (nearest upsampling),
    each up block reading the down path's output at its resolution (the skips)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, CH, 3, padding=1)
        self.time_mlp = nn.Sequential(nn.Linear(CH, 2 * CH), nn.SiLU(), nn.Linear(2 * CH, 2 * CH))
        self.down = nn.ModuleList([ResBlock(CH, CH), ResBlock(CH, 2 * CH)])
        self.pools = nn.ModuleList([nn.Conv2d(CH, CH, 3, 2, 1), nn.Conv2d(2 * CH, 2 * CH, 3, 2, 1)])
        self.mid = ResBlock(2 * CH, 2 * CH)
        self.up = nn.ModuleList([ResBlock(4 * CH, CH), ResBlock(2 * CH, CH)])
        self.out = nn.Sequential(nn.GroupNorm(2, CH), nn.SiLU(), nn.Conv2d(CH, 1, 3, padding=1))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        temb = self.time_mlp(timestep_embedding(t, CH))
        h = self.stem(x)
        skips = []
        for block, pool in zip(self.down, self.pools, strict=True):
            h = block(h, temb)
            skips.append(h)
            h = pool(h)
        h = self.mid(h, temb)
        for block in self.up:
            h = F.interpolate(h, scale_factor=2.0, mode="nearest")
            h = block(torch.cat([h, skips.pop()], dim=1), temb)
        return self.out(h)


def alpha_bar(t: torch.Tensor) -> torch.Tensor:
    """The cosine schedule's share of signal left at step ``t``."""
    return torch.cos((t.float() / TIMES + 0.008) / 1.008 * math.pi / 2) ** 2


class Noised(Dataset):
    """Images of blobs; ``dataset[i]`` draws item i's timestep and noise from a generator
    seeded by i, so every layout noises each image as one device does."""

    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        grid = torch.linspace(-1, 1, SIDE)
        centers = torch.rand(n, 2, generator=g) * 2 - 1
        d2 = (grid[None, :, None] - centers[:, None, None, 0]) ** 2 + \
             (grid[None, None, :] - centers[:, None, None, 1]) ** 2
        self.images = (torch.exp(-d2 / 0.2) * 2 - 1)[:, None]
        self.seed = seed

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100003 + i)
        t = torch.randint(0, TIMES, (), generator=g)
        noise = torch.randn(self.images[i].shape, generator=g)
        a = alpha_bar(t)
        return {"x": a.sqrt() * self.images[i] + (1 - a).sqrt() * noise, "t": t}, noise


def collate_noised(items: list[tuple[dict[str, torch.Tensor], torch.Tensor]]
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return ({"x": torch.stack([d["x"] for d, _ in items]),
             "t": torch.stack([d["t"] for d, _ in items])},
            torch.stack([n for _, n in items]))


def unet_loss(_: Gather) -> Callable[[Any, Any], torch.Tensor]:
    return lambda out, noise: F.mse_loss(out, noise)


# --- 3. a mixture-of-experts language model ---

EXPERTS, TOP_K, BALANCE = 4, 2, 0.1


class MoE(nn.Module):
    """A router and 4 expert MLPs; each token goes to its top-2 experts, weighted by their
    renormalised router probabilities, no capacity limit. Returns the output and the router's
    probabilities and top-2 choices (for the balance loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                                    nn.Linear(2 * WIDTH, WIDTH))
                                      for _ in range(EXPERTS)])

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = h.reshape(-1, WIDTH)
        probs = self.router(flat).softmax(-1)
        weight, chosen = probs.topk(TOP_K, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if len(rows):
                out = out.index_add(0, rows, weight[rows, slot, None] * expert(flat[rows]))
        picked = F.one_hot(chosen, EXPERTS).sum(1).float()
        return out.reshape(h.shape), probs.reshape(*h.shape[:2], EXPERTS), \
            picked.reshape(*h.shape[:2], EXPERTS)


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.moe = MoE()

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, probs, picked = self.moe(self.norm(h))
        return h + out, probs, picked


class MoELM(nn.Module):
    """Embedding, 2 MoE blocks, a head; returns the logits and each block's router
    probabilities and choices, stacked ``(batch, seq, blocks, experts)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([MoEBlock() for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.embed(ids)
        probs, picked = [], []
        for block in self.blocks:
            h, p, c = block(h)
            probs.append(p)
            picked.append(c)
        return self.head(h), torch.stack(probs, 2), torch.stack(picked, 2)


class Tokens(Dataset):
    """Sequences whose next token is a noisy function of the current one."""

    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        steps = torch.randint(1, 3, (n, SEQ), generator=g)
        self.ids = (start + steps.cumsum(1)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i, :-1], self.ids[i, 1:]


def balance(probs: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """Switch/Mixtral's load-balancing loss per block, summed over the blocks: E x sum over
    experts of (share of the tokens' top-k picks) x (mean router probability), over every
    token given."""
    share = picked.reshape(-1, *picked.shape[2:]).mean(0) / TOP_K
    mean_prob = probs.reshape(-1, *probs.shape[2:]).mean(0)
    return EXPERTS * (share * mean_prob).sum()


def moe_loss(gather: Gather) -> Callable[[Any, Any], torch.Tensor]:
    """Cross-entropy over this rank's tokens plus the balance loss over the global batch's
    tokens (the router statistics gathered from every replica)."""
    def loss(out: Any, y: torch.Tensor) -> torch.Tensor:
        logits, probs, picked = out
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        return ce + BALANCE * balance(gather(probs), gather(picked))
    return loss


def moe_local_loss(_: Gather) -> Callable[[Any, Any], torch.Tensor]:
    """The balance loss over this rank's tokens alone."""
    return moe_loss(one_device_gather)


def collate_tokens(items: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], Dataset], Any, Any]] = {
    "clip": (TwoTower, Pairs, clip_loss, collate_pairs),
    "clip_1elem": (lambda: TwoTower(scalar=False), Pairs, clip_loss, collate_pairs),
    "clip_local": (TwoTower, Pairs, clip_local_loss, collate_pairs),
    "unet": (UNet, Noised, unet_loss, collate_noised),
    "moe": (MoELM, Tokens, moe_loss, collate_tokens),
    "moe_local": (MoELM, Tokens, moe_local_loss, collate_tokens),
}


def train(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Per job ``(case, plan)``: AdamW for STEPS steps on ``run.loader``'s batches; the losses,
    rank 0's full state and plait's warnings, or the refusal's message."""
    import warnings

    from plait.runtime import init

    torch.set_num_threads(1)
    out: list[dict[str, Any]] = []
    for name, plan in jobs:
        build, data_cls, loss_of, collate = CASES[name]
        run = init(plan, quiet=True, seed=0)
        torch.manual_seed(0)
        model, data = build(), data_cls()
        # plan="auto" chooses the mesh in run.parallelize, before any loader: the example is
        # the dataset's first rows, collated as the loader collates them.
        example = collate([data[i] for i in range(BATCH // world_size)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                model = run.parallelize(model, example=example)
                loader = run.loader(data, batch_size=BATCH, steps=STEPS, collate_fn=collate)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                loss_fn = loss_of(run.all_gather)
                losses = [float(run.step(model, b, loss_fn, opt)) for b in loader]
            except Exception as exc:  # noqa: BLE001 - what the user sees
                run.close()
                out.append({"case": name, "plan": plan,
                            "refused": f"{type(exc).__name__}: {exc}"})
                continue
        state = run.full_state_dict(model)
        chosen = run.plan.to_string()
        run.close()
        said = [str(w.message) for w in caught if str(w.message).startswith("plait:")]
        out.append({"case": name, "plan": plan, "chosen": chosen, "losses": losses,
                    "evaluated": [], "warnings": said, "state": state if rank == 0 else None})
    return out


def reference(name: str) -> dict[str, Any]:
    """The same AdamW steps with torch alone on one device, each global batch (the loader's
    order) whole, torch's clipping at 1.0 (plait's default)."""
    from plait.data.loader import DistributedLoader

    build, data_cls, loss_of, collate = CASES[name]
    torch.manual_seed(0)
    model, data = build(), data_cls()
    loss_fn = loss_of(one_device_gather)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    order = DistributedLoader(data, BATCH)
    losses = []
    for step in range(STEPS):
        inputs, targets = collate([data[int(i)] for i in order.global_indices(step)])
        value = loss_fn(model(**inputs) if isinstance(inputs, dict) else model(inputs), targets)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(value.item())
    return {"losses": losses, "evaluated": [], "state": model.state_dict()}
