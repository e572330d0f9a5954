"""Worker functions for tests/test_zero.py (must be importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from plait.check import (
    CheckConfig,
    _build,
    _global_batches,
    _make_optimizer,
    _slice,
    full_state,
    train,
)
from plait.plan import Plan


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class DeepMLP(nn.Module):
    """A non-transformer model: its repeated blocks live in a ModuleList."""

    def __init__(self, width: int = 32, depth: int = 6):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def mlp_factory() -> nn.Module:
    return DeepMLP()


def mlp_batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def train_memory(rank: int, world_size: int, plan: Plan, cfg: CheckConfig) -> dict[str, Any]:
    """Train ``cfg.steps`` steps under ``plan``; return the run's memory report."""
    run, _, _ = train(plan, cfg)
    report = run.memory_report()
    run.close()
    return report


def train_memory_many(rank: int, world_size: int, plans: list[Plan], cfg: CheckConfig
                      ) -> list[dict[str, Any]]:
    """``train_memory`` for several plans of the same world size in one process group (one
    start-up instead of one per plan)."""
    return [train_memory(rank, world_size, plan, cfg) for plan in plans]


def grads_after_one_step(rank: int, world_size: int, plan: Plan, cfg: CheckConfig
                         ) -> dict[str, Any]:
    """Loss and every gradient (full, canonical names) after one forward/backward under ``plan``."""
    from plait.parallel.units import canonical_name
    from plait.runtime import init
    from plait.train import _forward_loss

    run = init(plan, seed=cfg.seed, quiet=True)
    model, loss_fn = _build(cfg)
    model = run.parallelize(model)
    batch = _global_batches(cfg, vocab=256)[0]
    loss = _forward_loss(model, batch, loss_fn)
    loss.backward()
    grads = {canonical_name(n): p.grad.detach().clone() for n, p in model.named_parameters()}
    run.close()
    return {"loss": float(loss), "grads": grads}


def replicate_run(rank: int, world_size: int, plan: Plan, cfg: CheckConfig) -> dict[str, Any]:
    """Train with ``apply_replicate`` (replicated DP through FSDP2) instead of DDP."""
    from plait.parallel.zero import apply_replicate
    from plait.runtime import init

    run = init(plan, seed=cfg.seed, quiet=True, log_every=1)
    model, loss_fn = _build(cfg)
    torch.manual_seed(cfg.seed)
    model = apply_replicate(model.to(run.device), run.mesh, plan)
    opt = _make_optimizer(cfg, model.parameters())
    dp_rank, dp_size = run.mesh.data_rank_and_size()
    losses = [float(run.step(model, _slice(b, dp_rank, dp_size), loss_fn, opt))
              for b in _global_batches(cfg, vocab=256)]
    state = full_state(model)
    run.close()
    return {"losses": losses, "state": state if rank == 0 else None}


def parallelize_error(rank: int, world_size: int, plan: Plan) -> str:
    """The ValueError message ``run.parallelize`` raises for ``plan`` ('' if none)."""
    from plait.models.transformer import build
    from plait.runtime import init

    run = init(plan, quiet=True, seed=0)
    try:
        run.parallelize(build("test"))
    except ValueError as e:
        return str(e)
    finally:
        run.close()
    return ""


def strided_replica_numel(rank: int, world_size: int) -> int:
    """``replica_numel`` of a fused q|k|v weight split per third over tp (``_StridedShard``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from plait._torch_compat import strided_shard
    from plait.memory import replica_numel

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    return replica_numel(distribute_tensor(torch.zeros(12, 4), mesh, [strided_shard(0, 3)]))


def warnings_of_a_step(rank: int, world_size: int, plan: str) -> list[str]:
    """The warnings one step of the semantics tests' masked LM raises under ``plan``: its
    blocks end in an ``nn.Linear`` with a bias on a 3-D input, whose output is a view, as is
    its head's (what FSDP2 warns about when a unit returns it)."""
    import warnings

    from plait.check import _slice
    from plait.runtime import init
    from tests import _workers_semantics as W

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run = init(plan, quiet=True, seed=0)
        model = run.parallelize(W.masked_lm())
        opt = torch.optim.SGD(model.parameters(), lr=W.LR)
        batch = W.mlm_batch(0)
        run.step(model, _slice(batch, run.dp_rank, run.dp_size), W.mlm_loss, opt)
        run.close()
    return [str(w.message) for w in seen]


class ReadsItsState(nn.Module):
    """A forward that reads state it writes: it centres the features on an EMA of their mean
    over the rows it sees, updated first, and scales them by a count of its training forwards.
    Each data rank updates the EMA from its own rows, so which rank's copy the next step starts
    from changes every rank's gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.blocks = nn.ModuleList(Block(32) for _ in range(2))
        self.out = nn.Linear(32, 3)
        self.register_buffer("ema", torch.zeros(32))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.5).add_(0.5 * h.mean(0))
                self.seen += 1
        h = (h - self.ema) / (1 + 0.1 * self.seen)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def reads_its_state() -> nn.Module:
    torch.manual_seed(0)
    return ReadsItsState()


def _rows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(16, 12, generator=g), torch.randn(16, 3, generator=g)


STATE_STEPS = 3


def state_read_by_forward(rank: int, world: int, plans: list[str], folder: str
                          ) -> dict[str, Any]:
    """Per plan: the step losses, the full state at the end (this rank's view), this rank's own
    copy of the EMA before anything reads the model, and the folder of a checkpoint saved then
    (under ``folder``); rank ``r`` steps on rows ``r`` of each global batch of 16 split in
    ``world``."""
    import torch.nn.functional as F

    import plait

    out: dict[str, Any] = {}
    for plan in plans:
        run = plait.init(plan, quiet=True, seed=0)
        model = run.parallelize(reads_its_state())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        rows = 16 // world
        for step in range(STATE_STEPS):
            x, y = _rows(step)
            part = (x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])
            losses.append(float(run.step(model, part, F.mse_loss, opt)))
        own = next(b for n, b in model.named_buffers() if n.endswith("ema")).detach().clone()
        saved = str(run.save(f"{folder}/{plan.replace(',', '_')}"))
        state = run.full_state_dict(model)
        run.close()
        out[plan] = {"losses": losses, "state": state, "own": own, "saved": saved}
    return out


def ddp_by_hand(world: int) -> dict[str, Any]:
    """DDP's semantics written out on one device: each step, every rank's forward starts from
    rank 0's buffers, the gradients are averaged over the ranks and rank 0's buffers are kept."""
    import torch.nn.functional as F

    model = reads_its_state()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    rows = 16 // world
    losses = []
    for step in range(STATE_STEPS):
        x, y = _rows(step)
        start = {n: b.clone() for n, b in model.named_buffers()}
        grads = [torch.zeros_like(p) for p in params]
        total = 0.0
        kept: dict[str, torch.Tensor] = {}
        for r in range(world):
            for n, b in model.named_buffers():
                b.copy_(start[n])
            loss = F.mse_loss(model(x[r * rows:(r + 1) * rows]), y[r * rows:(r + 1) * rows])
            total += loss.item() / world
            for g, d in zip(grads, torch.autograd.grad(loss, params), strict=True):
                g += d / world
            if r == 0:
                kept = {n: b.clone() for n, b in model.named_buffers()}
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # plait's default grad_clip
        opt.step()
        opt.zero_grad()
        for n, b in model.named_buffers():
            b.copy_(kept[n])
        losses.append(total)
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}
