"""Models, a one-process reference loop and the worker for the precision and memory option
tests (bf16, CPU offload, activation checkpointing, gradient clipping); spawned processes
import this module."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook

from plait.check import _slice
from tests._workers_semantics import (
    SEQ,
    VOCAB,
    WIDTH,
    ConvBN,
    HeadFirstLM,
    MaskedLM,
    StagedMaskedLM,
    _pre_norm_mlps,
    mlm_batch,
    mlm_loss,
    seeded,
)

__all__ = ["SEQ", "VOCAB", "mlm_batch", "mlm_loss"]


class TiedClipLM(nn.Module):
    """Token embedding tied to the head (trainable, so its gradient has two sources), a frozen
    position embedding and a frozen first block: clipping must count the tie once and skip the
    frozen parameters."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.blocks = _pre_norm_mlps(WIDTH, depth)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        self.pos.weight.requires_grad_(False)
        self.blocks[0].requires_grad_(False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class FrozenStageLM(StagedMaskedLM):
    """:class:`StagedMaskedLM` with its embedding and first two blocks frozen: under pp=2 the
    first stage holds no gradient at all."""

    def __init__(self) -> None:
        super().__init__()
        self.embed.requires_grad_(False)
        for block in self.blocks[:2]:
            block.requires_grad_(False)


def image_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 images of 17 x 17 (each data rank's BatchNorm count, 4 x 289 = 1156 per channel, is
    not a bf16 number), the two halves with different statistics."""
    g = torch.Generator().manual_seed(700 + step)
    x = torch.randn(8, 3, 17, 17, generator=g)
    x[4:] = 2.0 * x[4:] + 3.0
    return x, torch.randint(0, 5, (8,), generator=g)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


masked_lm = partial(seeded, MaskedLM)
conv_bn = partial(seeded, ConvBN)
frozen_stage_lm = partial(seeded, FrozenStageLM)
staged_lm = partial(seeded, StagedMaskedLM)
tied_clip_lm = partial(seeded, TiedClipLM)
head_first_lm = partial(seeded, HeadFirstLM)


def reference(factory: Callable[[], nn.Module], batches: list[Any], loss_fn: Callable, *,
              lr: float = 0.1, clip: float | None = 1.0, bf16: bool = False) -> dict[str, Any]:
    """A plain one-process loop (SGD on each whole batch, torch's clip_grad_norm_), under
    torch.autocast(cpu, bfloat16) when ``bf16`` (fp32 weights and gradients). ``norms``: the
    gradient norm clip_grad_norm_ saw at each step; ``state``: the parameters and
    floating-point buffers after the last."""
    model = factory()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    cast = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext())
    losses, norms = [], []
    for inputs, targets in batches:
        with cast:
            loss = loss_fn(model(inputs), targets)
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    state.update({n: b.clone() for n, b in model.named_buffers() if b.is_floating_point()})
    return {"losses": losses, "norms": norms, "state": state}


def _note_dtypes(seen: set[str], optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
                 ) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            seen.add(f"param {p.dtype}")
            if p.grad is not None:
                seen.add(f"grad {p.grad.dtype}")


def train_jobs(rank: int, world_size: int, jobs: list[tuple[str, Callable, list[Any], Callable]],
               lr: float = 0.1) -> list[dict[str, Any]]:
    """Train each (plan, factory, batches, loss_fn) with SGD (lr ``lr``; frozen parameters in
    the optimizer too, as ``model.parameters()`` gives them); per job the losses run.step
    returned, rank 0's full state, the dtypes of the parameters and gradients every optimizer
    step saw (ZeRO-1's inner one too), and how many checkpoint-wrapped blocks this rank's
    model holds."""
    from plait.runtime import init

    out = []
    for text, factory, batches, loss_fn in jobs:
        run = init(text, quiet=True, log_every=1, seed=0)
        model = run.parallelize(factory())
        opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=False)
        seen: set[str] = set()
        hook = register_optimizer_step_pre_hook(
            partial(_note_dtypes, seen))
        try:
            losses = [float(run.step(model, _slice(b, run.dp_rank, run.dp_size), loss_fn, opt))
                      for b in batches]
        finally:
            hook.remove()
        state = run.full_state_dict(model)
        run.close()
        wrapped = sum(type(m).__name__.endswith("CheckpointWrapper") for m in model.modules())
        out.append({"plan": text, "losses": losses, "dtypes": sorted(seen), "wrapped": wrapped,
                    "state": state if rank == 0 else None})
    return out


# ------------------------------------------------------------------------------ fp16
def reference_fp16(factory: Callable[[], nn.Module], batches: list[Any], loss_fn: Callable, *,
                   init_scale: float, growth_interval: int, lr: float = 0.1,
                   clip: float | None = 1.0) -> dict[str, Any]:
    """A plain one-process loop under torch.autocast(cpu, float16) with torch.amp.GradScaler
    (its other settings at their defaults), as its documentation writes one: scale(loss)
    .backward(), unscale_, clip_grad_norm_, step (skipped on inf/NaN gradients), update.
    ``scales``: the scale after each step; ``skipped``: the steps (from 1) whose update the
    scaler skipped."""
    model = factory()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    losses, scales, skipped = [], [], []
    for step, (inputs, targets) in enumerate(batches, 1):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(inputs), targets)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if scaler.get_scale() < before:
            skipped.append(step)
        losses.append(float(loss.detach()))
        scales.append(scaler.get_scale())
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    state.update({n: b.clone() for n, b in model.named_buffers() if b.is_floating_point()})
    return {"losses": losses, "scales": scales, "skipped": skipped, "state": state}


def fp16_jobs(rank: int, world_size: int, jobs: list[tuple[str, Callable, list[Any], Callable]],
              init_scale: float, growth_interval: int, lr: float = 0.1) -> list[dict[str, Any]]:
    """Train each (plan, factory, batches, loss_fn) under mixed_precision=fp16 with the given
    loss-scaler settings; per job the losses, the scale after each step, the steps an overflow
    skipped (as this rank saw them), the dtypes the optimizer saw and rank 0's full state."""
    from plait.loss_scale import LossScaler
    from plait.runtime import init

    out = []
    for text, factory, batches, loss_fn in jobs:
        run = init(text, quiet=True, log_every=1, seed=0)
        run.loss_scaler = LossScaler(scale=init_scale, growth_interval=growth_interval)
        model = run.parallelize(factory())
        opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=False)
        seen: set[str] = set()
        hook = register_optimizer_step_pre_hook(partial(_note_dtypes, seen))
        losses, scales = [], []
        try:
            for b in batches:
                losses.append(float(run.step(model, _slice(b, run.dp_rank, run.dp_size),
                                             loss_fn, opt)))
                scales.append(run.loss_scaler.scale)
        finally:
            hook.remove()
        state = run.full_state_dict(model)
        summary = run.summary()
        run.close()
        out.append({"plan": text, "losses": losses, "scales": scales,
                    "skipped": list(run.stats.overflows), "dtypes": sorted(seen),
                    "summary_scale": summary["loss_scale"],
                    "state": state if rank == 0 else None})
    return out


class NaNLossOnce:
    """``mlm_loss``, but NaN during step ``at`` (the worker sets ``step``) on rank ``rank``
    only: a user's bug in the loss, which fp16's loss scaling must not take for an overflow."""

    def __init__(self, rank: int, at: int) -> None:
        self.rank, self.at, self.step = rank, at, 0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        loss = mlm_loss(logits, labels)
        if dist.get_rank() == self.rank and self.step == self.at:
            return loss * float("nan")
        return loss


def fp16_nan_loss(rank: int, world_size: int, batches: list[Any], nonfinite: str,
                  init_scale: float) -> dict[str, Any]:
    """Three dp=2 fp16 steps whose second has a NaN loss on rank 1: what run.step raised (its
    message) or the steps the guard and the scaler skipped, and the scale after each step."""
    from plait.guard import NonFiniteError
    from plait.loss_scale import LossScaler
    from plait.runtime import init

    run = init("dp=2,mp=fp16", quiet=True, nonfinite=nonfinite, seed=0)
    run.loss_scaler = LossScaler(scale=init_scale)
    model = run.parallelize(masked_lm())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = NaNLossOnce(rank=1, at=2)
    scales, error = [], None
    try:
        for loss_fn.step, b in enumerate(batches, 1):
            run.step(model, _slice(b, run.dp_rank, run.dp_size), loss_fn, opt)
            scales.append(run.loss_scaler.scale)
    except NonFiniteError as exc:
        error = str(exc)
    out = {"error": error, "scales": scales, "skipped": list(run.stats.skipped),
           "overflows": list(run.stats.overflows)}
    run.close()
    return out


def fp16_resume(rank: int, world_size: int, folder: str, batches: list[Any], split: int,
                init_scale: float, growth_interval: int) -> dict[str, Any]:
    """dp=2 fp16: ``split`` steps, run.save, then a fresh run that run.loads the checkpoint
    and trains the remaining batches. The loss-scaler state each run ended with (the second
    right after loading too), the losses and scales of both parts, and rank 0's final state."""
    from plait.loss_scale import LossScaler
    from plait.runtime import init

    parts: list[dict[str, Any]] = []
    state = None
    for part, todo in enumerate((batches[:split], batches[split:])):
        run = init("dp=2,mp=fp16", quiet=True, seed=0)
        run.loss_scaler = LossScaler(scale=init_scale, growth_interval=growth_interval)
        model = run.parallelize(masked_lm())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
        loaded = None
        if part:
            run.load(folder, model=model, optimizer=opt)
            loaded = run.loss_scaler.state_dict()
        losses, scales = [], []
        for b in todo:
            losses.append(float(run.step(model, _slice(b, run.dp_rank, run.dp_size),
                                         mlm_loss, opt)))
            scales.append(run.loss_scaler.scale)
        if not part:
            run.save(folder, model=model, optimizer=opt)
        else:
            state = run.full_state_dict(model)
        parts.append({"loaded": loaded, "end": run.loss_scaler.state_dict(), "losses": losses,
                      "scales": scales})
        run.close()
    return {"parts": parts, "state": state if rank == 0 else None}
