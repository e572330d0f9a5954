"""What a newcomer's models do where the loss or the randomness spans the whole batch: the
two-tower and mixture-of-experts models of ``tests/_newcomer7_models.py`` under a pipeline and
gradient accumulation, a diffusion U-Net whose noise the training loop draws, and a masked
autoencoder (MAE) whose forward draws its random mask; and a GRU encoder-decoder on dict
batches whose targets have different lengths.

References run torch alone on one device, on the loader's global batches:

* :func:`reference_parts`: one device accumulating gradients over the parts plait cuts the
  global batch into (``grad_accum`` and a pipeline's microbatches, each part holding its
  share of every data replica's rows, as ``run.all_gather`` gathers them), the loss the mean
  of the parts' losses. A loss over the whole batch (InfoNCE, a balance loss) differs from it.
* :func:`reference_drawn`: one device drawing the noise (or the MAE's mask) for the whole
  batch (``per_replica=1``), or for ``rows / dp`` rows repeated ``dp`` times
  (``per_replica=dp``), which is what ``dp`` replicas drawing from one stream compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from tests import _newcomer7_models as N

STEPS, BATCH = 3, 8


class IdsFirst(N.TwoTower):
    """The two-tower model with the text tower's ids as the forward's first input."""

    def forward(self, ids: torch.Tensor, pixels: torch.Tensor  # type: ignore[override]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return super().forward(pixels, ids)


# --- a masked autoencoder: the forward draws which patches it hides ---

PATCHES, PATCH, KEEP = 8, 6, 4


class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(N.WIDTH)
        self.fc1, self.fc2 = nn.Linear(N.WIDTH, 2 * N.WIDTH), nn.Linear(2 * N.WIDTH, N.WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


def draw_mask(rows: int) -> torch.Tensor:
    """MAE's per-row uniform noise, whose argsort picks the patches kept."""
    return torch.rand(rows, PATCHES)


class MAE(nn.Module):
    """Patch embedding and positions, a random KEEP of the PATCHES patches per row (drawn in
    the forward, as MAE's ``random_masking``) through 2 encoder blocks, mask tokens in the
    hidden places, 1 decoder block and a head predicting each patch; returns the prediction
    and the mask (1 where hidden)."""

    def __init__(self, draw: Callable[[int], torch.Tensor] = draw_mask) -> None:
        super().__init__()
        self.draw = draw
        self.embed = nn.Linear(PATCH, N.WIDTH)
        self.pos = nn.Parameter(0.02 * torch.randn(PATCHES, N.WIDTH))
        self.blocks = nn.ModuleList([MLPBlock() for _ in range(2)])
        self.mask_token = nn.Parameter(torch.zeros(N.WIDTH))
        self.decoder = MLPBlock()
        self.head = nn.Linear(N.WIDTH, PATCH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.shape[0]
        order = self.draw(rows).to(x.device).argsort(1)
        keep = order[:, :KEEP]
        h = self.embed(x) + self.pos
        h = torch.gather(h, 1, keep[..., None].expand(-1, -1, N.WIDTH))
        for block in self.blocks:
            h = block(h)
        full = self.mask_token.expand(rows, PATCHES, N.WIDTH).clone()
        full = full.scatter(1, keep[..., None].expand(-1, -1, N.WIDTH), h)
        mask = torch.ones(rows, PATCHES, device=x.device).scatter(1, keep, 0.0)
        return self.head(self.decoder(full + self.pos)), mask


def mae_loss(out: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """MSE over the hidden patches (KEEP of them in every row, so a mean over rows)."""
    pred, mask = out
    return (((pred - x) ** 2).mean(-1) * mask).sum() / mask.sum()


class Patches(Dataset):
    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        base = torch.randn(n, 1, PATCH, generator=g)
        self.x = base + 0.3 * torch.randn(n, PATCHES, PATCH, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.x[i]


def repeated_draw(per_replica: int) -> Callable[[int], torch.Tensor]:
    """What ``per_replica`` data replicas drawing from one stream give the global batch: the
    draw for ``rows / per_replica`` rows, repeated."""
    return lambda rows: draw_mask(rows // per_replica).repeat(per_replica, 1)


# --- a diffusion U-Net whose noise the training loop draws ---

class Clean(N.Noised):
    """The U-Net's images without noise: the loop draws the timesteps and the noise."""

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
        return self.images[i]


def noised(images: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> dict[str, Any]:
    a = N.alpha_bar(t)[:, None, None, None]
    return {"x": a.sqrt() * images + (1 - a).sqrt() * noise, "t": t}


def loop_noise(images: torch.Tensor, draw_rows: int, take: slice) -> tuple[dict[str, Any],
                                                                            torch.Tensor]:
    """The loop's draws: timesteps and noise for ``draw_rows`` rows, rows ``take`` used."""
    t = torch.randint(0, N.TIMES, (draw_rows,))[take]
    noise = torch.randn(draw_rows, *images.shape[1:])[take]
    return noised(images, t, noise), noise


# --- a GRU encoder-decoder on dict batches, targets of different lengths ---

SRC, TGT, BOS = 7, 6, 0


class Seq2Seq(nn.Module):
    """A GRU encoder whose last state starts a GRU decoder fed the target shifted right
    (teacher forcing), a head over the vocabulary; inputs by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(N.VOCAB, N.WIDTH)
        self.encoder = nn.GRU(N.WIDTH, N.WIDTH, batch_first=True)
        self.decoder = nn.GRU(N.WIDTH, N.WIDTH, batch_first=True)
        self.head = nn.Linear(N.WIDTH, N.VOCAB)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        _, state = self.encoder(self.embed(src))
        out, _ = self.decoder(self.embed(tgt_in), state)
        return self.head(out)


class Reversals(Dataset):
    """Source sequences and their first 2 to TGT tokens reversed, padded with -100."""

    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.src = torch.randint(1, N.VOCAB, (n, SRC), generator=g)
        self.lengths = torch.randint(2, TGT + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        tgt = self.src[i].flip(0)[:TGT]
        tgt_in = torch.cat([torch.tensor([BOS]), tgt[:-1]])
        labels = tgt.clone()
        labels[int(self.lengths[i]):] = -100
        return {"src": self.src[i], "tgt_in": tgt_in}, labels


def token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean over the labelled tokens (-100 left out)."""
    return F.cross_entropy(logits.reshape(-1, N.VOCAB), labels.reshape(-1))


# --- plait and one device ---

def _mse(out: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, noise)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], Dataset], Any, Any]] = {
    "clip": (N.TwoTower, N.Pairs, N.clip_loss, N.collate_pairs),
    "clip_ids": (IdsFirst, N.Pairs, N.clip_loss, N.collate_pairs),
    "moe": (N.MoELM, N.Tokens, N.moe_loss, N.collate_tokens),
    "mae": (MAE, Patches, lambda _: mae_loss, None),
    # the loop draws the noise: for this replica's rows, or the global batch's sliced
    "unet_own": (N.UNet, Clean, lambda _: _mse, None),
    "unet_global": (N.UNet, Clean, lambda _: _mse, None),
    "seq2seq": (Seq2Seq, Reversals, lambda _: token_ce, None),
}


def train(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Per job ``(case, plan)``: AdamW for STEPS steps on ``run.loader``'s batches, as the
    docs' loop; the losses, rank 0's full state and plait's warnings, or the refusal."""
    import warnings

    from plait.runtime import init

    torch.set_num_threads(1)
    out: list[dict[str, Any]] = []
    for name, plan in jobs:
        build, data_cls, loss_of, collate = CASES[name]
        run = init(plan, quiet=True, seed=0)
        torch.manual_seed(0)
        model, data = build(), data_cls()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                loader = run.loader(data, batch_size=BATCH, steps=STEPS, collate_fn=collate)
                first = loader.batch(0)
                example = (noised(first, torch.zeros(len(first), dtype=torch.long), first)
                           if name.startswith("unet") else first)
                model = run.parallelize(model, example=example)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                loss_fn = loss_of(run.all_gather)
                losses = []
                for batch in loader:
                    if name.startswith("unet"):
                        rows = len(batch)
                        if name == "unet_own":  # torch.randn_like(x) in the loop
                            batch = loop_noise(batch, rows, slice(None))
                        else:  # the global batch's draws, this replica's rows of them
                            r = run.dp_rank
                            batch = loop_noise(batch, rows * run.dp_size,
                                               slice(r * rows, (r + 1) * rows))
                    losses.append(float(run.step(model, batch, loss_fn, opt)))
            except Exception as exc:  # noqa: BLE001 - what the user sees
                run.close()
                out.append({"case": name, "plan": plan,
                            "refused": f"{type(exc).__name__}: {exc}"})
                continue
        state = run.full_state_dict(model)
        run.close()
        said = [str(w.message) for w in caught if str(w.message).startswith("plait:")]
        out.append({"case": name, "plan": plan, "losses": losses, "evaluated": [], "warnings": said,
                    "state": state if rank == 0 else None})
    return out


def _global_batch(name: str, data: Dataset, step: int) -> Any:
    from plait.data.loader import DistributedLoader

    collate = CASES[name][3] or torch.utils.data.default_collate
    order = DistributedLoader(data, BATCH)
    return collate([data[int(i)] for i in order.global_indices(step)])


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _take(batch: Any, rows: list[int]) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[rows]
    if isinstance(batch, dict):
        return {k: _take(v, rows) for k, v in batch.items()}
    return type(batch)(_take(v, rows) for v in batch)


def _fit(model: nn.Module, name: str, batches: Callable[[int], list[Any]]) -> dict[str, Any]:
    loss_fn = CASES[name][2](N.one_device_gather)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        parts = batches(step)
        total = sum(loss_fn(_call(model, x), y) for x, y in parts) / len(parts)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(total.item())
    return {"losses": losses, "evaluated": [], "state": model.state_dict()}


def reference_parts(name: str, dp: int = 1, parts: int = 1) -> dict[str, Any]:
    """One device accumulating over the ``parts`` parts of each global batch that ``dp``
    replicas under ``grad_accum`` x ``microbatches`` = ``parts`` compute the loss on: part j
    holds the j-th slice of each replica's rows, in replica order."""
    build, data_cls, _, _ = CASES[name]
    torch.manual_seed(0)
    model, data = build(), data_cls()
    own = BATCH // dp
    cut = own // parts

    def batches(step: int) -> list[Any]:
        x, y = _global_batch(name, data, step)
        return [_take((x, y), [r * own + j * cut + i for r in range(dp) for i in range(cut)])
                for j in range(parts)]

    return _fit(model, name, batches)


def reference_drawn(name: str, per_replica: int = 1) -> dict[str, Any]:
    """One device, the noise (``unet_*``) or the MAE's mask drawn for the whole global batch
    (``per_replica=1``) or for 1/``per_replica`` of it, repeated (:func:`repeated_draw`)."""
    build, data_cls, _, _ = CASES[name]
    torch.manual_seed(0)
    model = MAE(repeated_draw(per_replica)) if name == "mae" else build()
    data = data_cls()

    def batches(step: int) -> list[Any]:
        batch = _global_batch(name, data, step)
        if name == "mae":
            return [batch]
        own = BATCH // per_replica
        inputs, noise = loop_noise(batch[:own], own, slice(None))
        whole = torch.cat([inputs["x"]] * per_replica), torch.cat([inputs["t"]] * per_replica)
        a = N.alpha_bar(whole[1])[:, None, None, None]
        noise = torch.cat([noise] * per_replica)
        return [({"x": a.sqrt() * batch + (1 - a).sqrt() * noise, "t": whole[1]}, noise)]

    return _fit(model, name, batches)
