"""Workers for tests/test_buffers_layouts.py: models whose forward writes buffers (BatchNorm's
running statistics, an EMA, a step counter), trained under a data-parallel or pipeline layout,
and what each rank then holds and reads: its own buffers, ``run.full_state_dict`` and the
checkpoint ``run.save`` writes."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import plait
from plait.parallel.data import unwrap
from tests import _workers_ckpt_users as u
from tests._workers_zero import Block


def ddp_reads(rank: int, world: int, model: str, folder: str, steps: int = 3
              ) -> dict[str, Any]:
    """Train ``model`` (tests/_workers_ckpt_users.MODELS) under dp=2 for ``steps`` steps with
    SGD, then read it: this rank's own buffers before the read, a checkpoint saved to
    ``folder`` and then ``run.full_state_dict``."""
    torch.set_num_threads(1)
    run = plait.init("dp=2", quiet=True, seed=0)
    try:
        net = run.parallelize(u.MODELS[model]())
        opt = u.optimizer("sgd", net)
        losses = [float(run.step(net, batch, u.lm_loss, opt))
                  for batch in run.loader(u.dataset(model), batch_size=u.BATCH, steps=steps)]
        own = {n: b.detach().clone() for n, b in unwrap(net).named_buffers()}
        run.save(folder)  # first: a read before it would already have made the ranks agree
        state = run.full_state_dict(net)
    finally:
        run.close()
    return {"losses": losses, "own": own, "state": state}


WIDTH, ROWS, STEPS = 16, 16, 3


class NormBlock(nn.Module):
    """A residual block with a BatchNorm over the features (running statistics the training
    forward writes). Its linear layer has no bias: the BatchNorm takes out the mean, so a
    bias's gradient would be rounding noise, which AdamW scales up to full steps that differ
    between any two orders of summation."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width, bias=False)
        self.bn = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.bn(self.fc(x)))


class WritesBuffers(nn.Module):
    """Buffers of three kinds the training forward writes, in four blocks a pipeline splits:
    on the root, an EMA of the input features' mean, updated first and then read (the
    features are centred on it), and a count of training forwards that scales them; a
    BatchNorm in the first block. Which rank's EMA and count a step starts from changes every
    rank's gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, WIDTH)
        self.blocks = nn.ModuleList([NormBlock(WIDTH)] + [Block(WIDTH) for _ in range(3)])
        self.out = nn.Linear(WIDTH, 3)
        self.register_buffer("ema", torch.zeros(WIDTH))
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


def writes_buffers() -> nn.Module:
    torch.manual_seed(0)
    return WritesBuffers()


def rows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step``: ROWS rows of features and regression targets."""
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(ROWS, 12, generator=g), torch.randn(ROWS, 3, generator=g)


def layouts(rank: int, world: int, plans: list[str]) -> dict[str, Any]:
    """Per plan: :class:`WritesBuffers` trained STEPS steps with AdamW on this rank's data
    replica's rows of each global batch, the step losses and ``run.full_state_dict``."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for plan in plans:
        run = plait.init(plan, quiet=True, seed=0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # BatchNorm without sync_bn is warned about
                model = run.parallelize(writes_buffers())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = []
            for step in range(STEPS):
                x, y = rows(step)
                part = ROWS // run.dp_size
                lo = run.dp_rank * part
                losses.append(float(run.step(model, (x[lo:lo + part], y[lo:lo + part]),
                                             F.mse_loss, opt)))
            state = run.full_state_dict(model)
        finally:
            run.close()
        out[plan] = {"losses": losses, "state": state}
    return out


def by_hand(replicas: int, micro: int, norms: str) -> dict[str, Any]:
    """What one device trains under a layout of ``replicas`` data replicas, each splitting its
    rows into ``micro`` microbatches, written out in one process: every replica starts the step
    from rank 0's EMA and count (DDP's broadcast; plait's under FSDP2) and runs its microbatches
    in order, the gradients are averaged over every microbatch of every replica, rank 0's
    buffers are kept. BatchNorm's running statistics: ``norms="rank0"``, rank 0's, as DDP
    broadcasts them; ``"mean"``, each replica's own through training and their mean at the end,
    as plait reads them under FSDP2."""
    model = writes_buffers()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    bn = {n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm1d)}
    stats = [n for n, _ in model.named_buffers() if n.rsplit(".", 1)[0] in bn]
    own: list[dict[str, torch.Tensor]] = [
        {n: b.clone() for n, b in model.named_buffers() if n in stats} for _ in range(replicas)]
    part = ROWS // replicas // micro
    losses = []
    for step in range(STEPS):
        x, y = rows(step)
        start = {n: b.clone() for n, b in model.named_buffers()}
        grads = [torch.zeros_like(p) for p in params]
        total = 0.0
        kept: dict[str, torch.Tensor] = {}
        for r in range(replicas):
            for n, b in model.named_buffers():
                b.copy_(own[r][n] if norms == "mean" and n in stats else start[n])
            for m in range(micro):
                lo = (r * micro + m) * part
                loss = F.mse_loss(model(x[lo:lo + part]), y[lo:lo + part])
                total += loss.item() / (replicas * micro)
                for g, d in zip(grads, torch.autograd.grad(loss, params), strict=True):
                    g += d / (replicas * micro)
            own[r] = {n: b.clone() for n, b in model.named_buffers() if n in stats}
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
    if norms == "mean":
        for n, b in model.named_buffers():
            if n in stats and b.is_floating_point():
                b.copy_(sum(o[n] for o in own) / replicas)
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}
