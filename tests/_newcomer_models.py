"""Two models of kinds plait's own are not, as a newcomer brings them: a DLRM-style recommender
(``nn.EmbeddingBag`` tables, one of them 50,000 rows fed a variable-length bag per example
through ``offsets``; a dense MLP; pairwise dot-product feature interactions; a top MLP;
``BCEWithLogitsLoss(pos_weight=...)``) and a small diffusion-style U-Net denoiser
(convolutions down and up with a concatenated skip, GroupNorm, SiLU, a sinusoidal timestep
embedding added in every residual block, MSE against the true noise). Both take dict batches.
Each factory returns (model, dataset, loss_fn); ``collate_clicks`` builds the recommender's
flat index list and offsets, which ``default_collate`` cannot."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

DENSE, DIM, BIG_ROWS, SMALL_ROWS = 8, 16, 50_000, 100


class DLRM(nn.Module):
    """Bottom MLP over dense floats, two embedding-bag tables, the pairwise dot products of the
    three feature vectors, a top MLP to one logit per example."""

    def __init__(self, sparse: bool = False, dict_out: bool = False):
        super().__init__()
        self.big = nn.EmbeddingBag(BIG_ROWS, DIM, mode="sum", sparse=sparse)
        self.small = nn.EmbeddingBag(SMALL_ROWS, DIM, mode="sum", sparse=sparse)
        self.bottom = nn.Sequential(nn.Linear(DENSE, 32), nn.ReLU(), nn.Linear(32, DIM),
                                    nn.ReLU())
        self.top = nn.Sequential(nn.Linear(DIM + 3, 32), nn.ReLU(), nn.Linear(32, 1))
        self.dict_out = dict_out

    def forward(self, dense: torch.Tensor, big_idx: torch.Tensor, big_off: torch.Tensor,
                small_idx: torch.Tensor) -> Any:
        d = self.bottom(dense)
        z = torch.stack([d, self.big(big_idx, big_off), self.small(small_idx)], dim=1)
        inter = torch.bmm(z, z.transpose(1, 2))
        i, j = torch.triu_indices(3, 3, offset=1)
        logit = self.top(torch.cat([d, inter[:, i, j]], dim=1)).squeeze(-1)
        return {"logits": logit} if self.dict_out else logit


class BagBlock(nn.Module):
    """A residual block that adds each example's bag of ids (through a table of its own) to
    the hidden state: every block reads the flat index list and its offsets."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(BIG_ROWS, DIM, mode="mean")
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor, big_idx: torch.Tensor, big_off: torch.Tensor
                ) -> torch.Tensor:
        return h + torch.tanh(self.lin(h) + self.bag(big_idx, big_off))


class BagStack(nn.Module):
    """The recommender's inputs through a stack of :class:`BagBlock` (what a pipeline cuts),
    the small table added after it, one logit per example."""

    def __init__(self, blocks: int = 4):
        super().__init__()
        self.inp = nn.Linear(DENSE, DIM)
        self.layers = nn.ModuleList(BagBlock() for _ in range(blocks))
        self.small = nn.EmbeddingBag(SMALL_ROWS, DIM, mode="sum")
        self.head = nn.Linear(DIM, 1)

    def forward(self, dense: torch.Tensor, big_idx: torch.Tensor, big_off: torch.Tensor,
                small_idx: torch.Tensor) -> torch.Tensor:
        h = self.inp(dense)
        for layer in self.layers:
            h = layer(h, big_idx, big_off)
        return self.head(h + self.small(small_idx)).squeeze(-1)


class Clicks(Dataset):
    """Dense floats, a bag of 1 to 5 ids into the big table, a bag of 2 into the small one."""

    def __init__(self, n: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.dense = torch.randn(n, DENSE, generator=g)
        self.ids = [torch.randint(0, BIG_ROWS, (int(k),), generator=g)
                    for k in torch.randint(1, 6, (n,), generator=g)]
        self.small = torch.randint(0, SMALL_ROWS, (n, 2), generator=g)
        self.y = (torch.rand(n, generator=g) < 0.2).float()

    def __len__(self) -> int:
        return len(self.dense)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"dense": self.dense[i], "ids": self.ids[i], "small_idx": self.small[i],
                "labels": self.y[i]}


def collate_clicks(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The bags of the big table as one flat index list and the offset of each bag in it."""
    ids = [it["ids"] for it in items]
    return {"dense": torch.stack([it["dense"] for it in items]),
            "big_idx": torch.cat(ids),
            "big_off": torch.tensor([0] + [len(x) for x in ids[:-1]]).cumsum(0),
            "small_idx": torch.stack([it["small_idx"] for it in items]),
            "labels": torch.stack([it["labels"] for it in items])}


_BCE = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(4.0))


def click_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return _BCE(logits, labels)


def recommender() -> tuple[nn.Module, Dataset, Any]:
    torch.manual_seed(0)
    return DLRM(), Clicks(), click_loss


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class Res(nn.Module):
    """GroupNorm, SiLU, conv; the timestep embedding added per channel; again; a residual."""

    def __init__(self, cin: int, cout: int, tdim: int):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(4, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(tdim, cout)
        self.n2, self.c2 = nn.GroupNorm(4, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.c1(F.silu(self.n1(x))) + self.t(temb)[:, :, None, None]
        return self.c2(F.silu(self.n2(h))) + self.skip(x)


class UNet(nn.Module):
    """One level down and up, the skip concatenated."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.c, tdim = c, 4 * c
        self.temb = nn.Sequential(nn.Linear(c, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inp = nn.Conv2d(1, c, 3, padding=1)
        self.d1 = Res(c, c, tdim)
        self.down = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.d2 = Res(c, 2 * c, tdim)
        self.mid = Res(2 * c, 2 * c, tdim)
        self.up = nn.ConvTranspose2d(2 * c, 2 * c, 2, stride=2)
        self.u1 = Res(3 * c, c, tdim)
        self.out = nn.Sequential(nn.GroupNorm(4, c), nn.SiLU(), nn.Conv2d(c, 1, 3, padding=1))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        temb = self.temb(timestep_embedding(t, self.c))
        h0 = self.d1(self.inp(x), temb)
        h1 = self.mid(self.d2(self.down(h0), temb), temb)
        return self.out(self.u1(torch.cat([self.up(h1), h0], dim=1), temb))


class Noised(Dataset):
    """8x8 one-channel images noised at a random timestep; the target is the noise."""

    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x0 = torch.randn(n, 1, 8, 8, generator=g).cumsum(-1) / 3
        self.t = torch.randint(0, 1000, (n,), generator=g)
        self.noise = torch.randn(n, 1, 8, 8, generator=g)

    def __len__(self) -> int:
        return len(self.x0)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        a = 1 - self.t[i].float() / 1000
        return {"x": a.sqrt() * self.x0[i] + (1 - a).sqrt() * self.noise[i], "t": self.t[i],
                "labels": self.noise[i]}


def noise_loss(pred: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pred, noise)


def denoiser() -> tuple[nn.Module, Dataset, Any]:
    torch.manual_seed(0)
    return UNet(), Noised(), noise_loss


STEPS, BATCH = 3, 16


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.5)


def _model(name: str, sparse: bool) -> nn.Module:
    torch.manual_seed(0)
    return BagStack() if name == "bag_stack" else DLRM(sparse=sparse)


def train_recommender(rank: int, world_size: int, plan: str, sparse: bool,
                      optimizer: str = "sgd", model_name: str = "dlrm", evaluate: bool = True
                      ) -> dict[str, Any]:
    """``optimizer`` (SGD or AdamW) for STEPS steps on :func:`recommender` under ``plan``
    (batches from ``run.loader`` with :func:`collate_clicks`): the losses and the full state,
    or the refusal's message."""
    from plait.runtime import init

    run = init(plan, quiet=True, seed=0)
    _, data, loss_fn = recommender()
    try:
        model = run.parallelize(_model(model_name, sparse))
    except ValueError as exc:
        run.close()
        return {"refused": str(exc)}
    opt = _optimizer(optimizer, model.parameters())
    losses = [float(run.step(model, batch, loss_fn, opt))
              for batch in run.loader(data, batch_size=BATCH, steps=STEPS,
                                      collate_fn=collate_clicks)]
    evaluated = [float(run.evaluate(model, batch, loss_fn))
                 for batch in run.loader(data, batch_size=BATCH, steps=1, evaluation=True,
                                         collate_fn=collate_clicks) if evaluate]
    state = run.full_state_dict(model)
    run.close()
    return {"losses": losses, "evaluated": evaluated, "state": state if rank == 0 else None}


def recommender_reference(optimizer: str = "sgd", model_name: str = "dlrm") -> dict[str, Any]:
    """What one device trains with torch alone: the same global batches (the loader's order),
    each collated whole, no accumulation, dense gradients (``sparse=False``: a sparse gradient
    densified is the same tensor), torch's own clipping at 1.0 (plait's default)."""
    from plait.data.loader import DistributedLoader

    _, data, loss_fn = recommender()
    model = _model(model_name, False)
    opt = _optimizer(optimizer, model.parameters())
    order = DistributedLoader(data, BATCH)
    losses = []
    for step in range(STEPS):
        batch = collate_clicks([data[int(i)] for i in order.global_indices(step)])
        labels = batch.pop("labels")
        loss = loss_fn(model(**batch), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():  # the trained model on the first global batch (an evaluation loader's)
        batch = collate_clicks([data[int(i)] for i in order.global_indices(0)])
        labels = batch.pop("labels")
        evaluated = [loss_fn(model(**batch), labels).item()]
    return {"losses": losses, "evaluated": evaluated, "state": model.state_dict()}


def recommender_collated() -> tuple[nn.Module, Dataset, Any, Any]:
    """:func:`recommender` with its collate_fn, as ``plait check`` takes a fourth item."""
    return (*recommender(), collate_clicks)


def bag_stack_collated() -> tuple[nn.Module, Dataset, Any, Any]:
    """:class:`BagStack` on the recommender's data, with its collate_fn (``plait check``)."""
    return _model("bag_stack", False), Clicks(), click_loss, collate_clicks


def cosine_run(rank: int, world_size: int, root: str, t_max: int, steps: int) -> list[str]:
    """The U-Net for ``steps`` steps under a cosine schedule of ``t_max`` steps, checkpointing
    into ``root`` at the end (resuming from it when it holds one): plait's warnings."""
    import warnings

    from plait.runtime import init

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run = init("", checkpoint=root, quiet=True, seed=0)
        model, data, loss_fn = denoiser()
        model = run.parallelize(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, t_max)
        for batch in run.loader(data, batch_size=8, steps=steps):
            run.step(model, batch, loss_fn, opt, sched)
        run.finish()
    return [str(w.message) for w in said if str(w.message).startswith("plait:")]
