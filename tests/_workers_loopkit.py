"""A data scientist's whole training loop, beyond ``run.step``: a ``ReduceLROnPlateau`` fed with
the loss ``run.step`` returns, an EMA kept by ``torch.optim.swa_utils.AveragedModel`` and one
kept by hand, early stopping on ``run.evaluate``'s held-out loss, accuracy and a confusion
matrix counted on each rank's rows and summed with ``run.all_reduce``, a ``OneCycleLR`` stepped
once per ``run.step`` under gradient accumulation, the learning rate read back
(``opt.param_groups[0]["lr"]``, ``sched.get_last_lr()``) and ``clip_grad_norm_`` called by the
user after a step.

Each ``*_loop`` runs the loop through plait under each of several plans in one process group;
each ``*_reference`` is the same loop in plain torch on one device (the global batches
``run.loader`` hands out, clipping at 1.0 as ``run.step`` does)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import default_collate

from tests._multi_models import Block  # a residual MLP block: what tp splits, pp cuts

FEAT, CLASSES, WIDTH = 8, 4, 16
BATCH, HELD = 16, 32
MAX_STEPS, PATIENCE, MIN_DELTA = 8, 0, 0.01
DECAY = 0.8
SGD_LR = 0.5  # SGD with momentum 0.9: the plateau's start, OneCycleLR's peak


class Classifier(nn.Module):
    """Features in, two blocks, a score per class."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEAT, WIDTH)
        self.layers = nn.ModuleList(Block(WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def classifier() -> Classifier:
    torch.manual_seed(0)
    return Classifier()


def items(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Noisy blobs, one centre per class, with a fifth of the labels flipped: a held-out loss
    that stops improving within a few steps."""
    centres = torch.randn(CLASSES, FEAT, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = centres[y] + 1.5 * torch.randn(n, FEAT, generator=g)
    flip = torch.rand(n, generator=g) < 0.2
    y = torch.where(flip, torch.randint(0, CLASSES, (n,), generator=g), y)
    return [(x[i], y[i]) for i in range(n)]


def train_set() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return items(96, 1)


def held_set() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return items(HELD, 2)


def global_batches(data: list[Any], batch: int, steps: int) -> list[Any]:
    """The global batches ``run.loader`` hands out at steps 0 .. steps - 1, whole."""
    from plait.data.loader import DistributedLoader

    order = DistributedLoader(data, batch)
    return [default_collate([data[int(i)] for i in order.global_indices(step)])
            for step in range(steps)]


def confusion(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Counts of (label, prediction) pairs, flat: ``[label * CLASSES + prediction]``."""
    pred = logits.detach().argmax(-1)
    return torch.bincount(y * CLASSES + pred, minlength=CLASSES * CLASSES).float()


def hand_ema(ema: nn.Module, model: nn.Module) -> None:
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters(), strict=True):
            e.lerp_(p, 1 - DECAY)


class Stopper:
    """Early stopping on a held-out loss: stop after more than ``PATIENCE`` evaluations that
    do not improve on the best by ``MIN_DELTA``."""

    def __init__(self) -> None:
        self.best, self.bad = float("inf"), 0

    def stop(self, value: float) -> bool:
        if value < self.best - MIN_DELTA:
            self.best, self.bad = value, 0
        else:
            self.bad += 1
        return self.bad > PATIENCE


def plateau_reference() -> dict[str, Any]:
    """The loop on one device with torch alone."""
    model = classifier()
    swa = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    x_held, y_held = global_batches(held_set(), HELD, 1)[0]
    stopper, out = Stopper(), _record()
    for x, y in global_batches(train_set(), BATCH, MAX_STEPS):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        swa.update_parameters(model)
        hand_ema(ema, model)
        plateau.step(loss.item())
        with torch.no_grad():
            logits = model(x_held)
        val = F.cross_entropy(logits, y_held).item()
        out["losses"].append(loss.item())
        out["lrs"].append(opt.param_groups[0]["lr"])
        out["val"].append(val)
        out["confusion"].append(confusion(logits, y_held))
        if stopper.stop(val):
            break
    with torch.no_grad():
        out["swa_val"] = F.cross_entropy(swa(x_held), y_held).item()
        out["ema_val"] = F.cross_entropy(ema(x_held), y_held).item()
    out.update(model=model.state_dict(), swa=swa.state_dict(), ema=ema.state_dict())
    return out


def _record() -> dict[str, Any]:
    return {"losses": [], "lrs": [], "val": [], "confusion": [], "outputs_confusion": []}


def plateau_loop(rank: int, world_size: int, plans: list[str], folder: str
                 ) -> dict[str, Any]:
    """Per plan, the loop through plait: the EMA copies taken before ``run.parallelize`` and
    laid out too (``AveragedModel`` except under a pipeline, which refuses it: there the copy
    is updated by hand), the plateau fed with ``run.step``'s loss, the held-out loss from
    ``run.evaluate`` (whose loss function also counts the confusion matrix, on the last stage
    under a pipeline) and, without a pipeline, the confusion matrix counted again from
    ``model(x)`` on this rank's held-out rows; both summed with ``run.all_reduce``. The
    ``AveragedModel`` is saved with ``run.save`` under ``folder`` and loaded into a new one."""
    import plait

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for plan in plans:
        run = plait.init(plan, quiet=True, seed=0)
        try:
            out[plan] = _plateau_run(run, f"{folder}/{plan}")
        finally:
            run.close()
    return out


def _plateau_run(run: Any, folder: str) -> dict[str, Any]:
    raw = classifier()
    pipelined = run.plan.pp > 1
    swa = None if pipelined else AveragedModel(
        raw, multi_avg_fn=get_ema_multi_avg_fn(DECAY)).requires_grad_(False)
    ema = copy.deepcopy(raw).requires_grad_(False)
    model = run.parallelize(raw)
    ema = run.parallelize(ema)
    if swa is not None:
        swa = run.parallelize(swa)
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    held = next(iter(run.loader(held_set(), batch_size=HELD, steps=1, evaluation=True)))
    stopper, out = Stopper(), _record()
    counts = torch.zeros(CLASSES * CLASSES)

    def scored(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        counts.add_(confusion(logits, y).cpu())
        return F.cross_entropy(logits, y)

    for batch in run.loader(train_set(), batch_size=BATCH, steps=MAX_STEPS):
        loss = run.step(model, batch, F.cross_entropy, opt)
        if swa is not None:
            swa.update_parameters(model)
        hand_ema(ema, model)
        plateau.step(float(loss))
        counts.zero_()
        val = float(run.evaluate(model, held, scored))
        out["losses"].append(float(loss))
        out["lrs"].append(opt.param_groups[0]["lr"])
        out["val"].append(val)
        out["confusion"].append(run.all_reduce(counts))
        if not pipelined:
            x, y = held
            with torch.no_grad():
                logits = model(x.to(run.device))
            out["outputs_confusion"].append(run.all_reduce(confusion(logits, y.to(run.device))))
        if stopper.stop(val):
            break
    if swa is not None:
        out["swa_val"] = float(run.evaluate(swa, held, F.cross_entropy))
        out["swa"] = run.full_state_dict(swa)
        run.save(folder, model=swa)
        torch.manual_seed(1)  # other weights than the saved ones, until loaded
        again = run.parallelize(AveragedModel(Classifier()).requires_grad_(False))
        run.load(folder, model=again)
        out["swa_loaded"] = run.full_state_dict(again)
    out["ema_val"] = float(run.evaluate(ema, held, F.cross_entropy))
    out["ema"] = run.full_state_dict(ema)
    out["model"] = run.full_state_dict(model)
    return out


def copy_reference() -> dict[str, torch.Tensor]:
    """``AveragedModel(model)`` on one device after 2 steps: what ``copies_refused`` trains."""
    model = classifier()
    swa = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9)
    for x, y in global_batches(train_set(), BATCH, 2):
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        swa.update_parameters(model)
    return swa.state_dict()


def onecycle_reference() -> dict[str, Any]:
    """A ``OneCycleLR`` stepped once per optimizer step, on one device."""
    model = classifier()
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=SGD_LR, total_steps=4)
    out: dict[str, Any] = {"losses": [], "lrs": [], "last_lrs": []}
    for x, y in global_batches(train_set(), BATCH, 4):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        out["losses"].append(loss.item())
        out["lrs"].append(opt.param_groups[0]["lr"])
        out["last_lrs"].append(sched.get_last_lr()[0])
    out["model"] = model.state_dict()
    return out


def onecycle_loop(rank: int, world_size: int, plans: list[str]) -> dict[str, Any]:
    """The ``OneCycleLR`` given to ``run.step`` under each plan (gradient accumulation in
    them: one scheduler step per ``run.step``), the rate read back both ways, and the norm
    ``clip_grad_norm_`` returns when the user calls it after a step."""
    import plait

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for plan in plans:
        run = plait.init(plan, quiet=True, seed=0)
        try:
            model = run.parallelize(classifier())
            opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=SGD_LR, total_steps=4)
            got: dict[str, Any] = {"losses": [], "lrs": [], "last_lrs": [], "norms": []}
            for batch in run.loader(train_set(), batch_size=BATCH, steps=4):
                got["losses"].append(float(run.step(model, batch, F.cross_entropy, opt, sched)))
                got["lrs"].append(opt.param_groups[0]["lr"])
                got["last_lrs"].append(sched.get_last_lr()[0])
                got["norms"].append(float(torch.nn.utils.clip_grad_norm_(
                    model.parameters(), 1.0)))
            got["model"] = run.full_state_dict(model)
        finally:
            run.close()
        out[plan] = got
    return out


def copies_refused(rank: int, world_size: int, plans: list[str]) -> dict[str, Any]:
    """Per plan, what ``AveragedModel(model)`` built after ``run.parallelize`` raises (or
    ``"built"``, and then its state after 2 steps: ``plan + " state"``), and what laying out
    an ``AveragedModel`` under a pipeline raises."""
    import plait

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for plan in plans:
        run = plait.init(plan, quiet=True, seed=0)
        try:
            if run.plan.cp > 1:  # run.all_reduce's refusal: no model needed
                try:
                    run.all_reduce(1.0)
                    out[plan] = "summed"
                except ValueError as exc:
                    out[plan] = str(exc)
                continue
            model = run.parallelize(classifier())
            try:
                swa = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
                out[plan] = "built"
            except ValueError as exc:
                out[plan] = str(exc)
            else:
                opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9)
                plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
                try:  # given to run.step, which would step it without its metric
                    run.step(model, next(iter(run.loader(train_set(), batch_size=BATCH))),
                             F.cross_entropy, opt, plateau)
                    out[plan + " plateau"] = "stepped"
                except ValueError as exc:
                    out[plan + " plateau"] = str(exc)
                for batch in run.loader(train_set(), batch_size=BATCH, steps=2):
                    run.step(model, batch, F.cross_entropy, opt)
                    swa.update_parameters(model)
                out[plan + " state"] = run.full_state_dict(swa)
            if run.plan.pp > 1:
                try:
                    run.parallelize(AveragedModel(classifier()).requires_grad_(False))
                    out[plan + " before"] = "laid out"
                except ValueError as exc:
                    out[plan + " before"] = str(exc)
        finally:
            run.close()
    return out
