"""The training loop a user writes around plait (spawned processes import this module): a
map-style dataset of variable-length sequences padded by a collate_fn, epoch loops that make a
new loader each epoch, AdamW with parameter groups chosen by name, an LR scheduler, clipping,
and a save mid-epoch resumed under another layout. The reference is a plain one-process loop
over the same global batches."""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from plait.data import DistributedLoader
from tests._workers_semantics import SEQ, VOCAB, masked_lm, mlm_loss

ITEMS, BATCH, EPOCHS, LR, CLIP = 20, 8, 3, 0.02, 0.05  # 2 global batches an epoch, 4 left over


def dataset() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences of 2 to SEQ tokens (the model's positions); the labels mask a different number
    of positions in each."""
    g = torch.Generator().manual_seed(7)
    items = []
    for i in range(ITEMS):
        n = 2 + i % (SEQ - 1)
        tokens = torch.randint(0, VOCAB, (n,), generator=g)
        labels = torch.randint(0, VOCAB, (n,), generator=g)
        labels[torch.rand(n, generator=g) < 0.3] = -100
        items.append((tokens, labels))
    return items


def pad(items: list[tuple[torch.Tensor, torch.Tensor]], length: int | None = None
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads to ``length``, or to the longest sequence of the list (-100: padding is not a
    label). Positions are independent in the model, so the losses do not depend on it."""
    n = length or max(len(x) for x, _ in items)
    return (torch.stack([F.pad(x, (0, n - len(x))) for x, _ in items]),
            torch.stack([F.pad(y, (0, n - len(y)), value=-100) for _, y in items]))


def optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW without weight decay on biases, chosen by parameter name, and a decaying LR."""
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.1},
              {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, foreach=False)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def reference() -> list[float]:
    """One process, no plait: the global batches of plait's loader (seed 0), epoch by epoch."""
    items, order = dataset(), DistributedLoader(dataset(), BATCH)
    model = masked_lm()
    opt, sched = optimizer(model)
    losses = []
    for step in range(EPOCHS * order.batches_per_epoch):
        x, y = pad([items[int(i)] for i in order.global_indices(step)])
        loss = mlm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def epoch_loop(rank: int, world_size: int, plan: str, *, save_after: int | None = None,
               folder: str | None = None, resume: bool = False, length: int | None = None
               ) -> tuple[list[float], list[str]]:
    """``for epoch ...: for batch in run.loader(...)``: the losses of the steps this process
    took, and the warnings they raised. ``save_after``: stop after that many steps with a
    checkpoint in ``folder``; ``resume``: continue from the newest checkpoint there.
    ``length``: pad every batch to it (a pipeline's stages take one shape)."""
    import plait

    run = plait.init(f"{plan},clip={CLIP}", quiet=True,
                     checkpoint=folder if resume else None, seed=0)
    model = run.parallelize(masked_lm())
    opt, sched = optimizer(model)
    items = dataset()
    per_epoch = ITEMS // BATCH
    losses: list[float] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _epoch in range(run.steps_done // per_epoch, EPOCHS):
            for batch in run.loader(items, BATCH, collate_fn=partial(pad, length=length)):
                losses.append(float(run.step(model, batch, mlm_loss, opt, sched)))
                if run.steps_done == save_after:
                    run.save(folder)
                    run.close()
                    return losses, [str(w.message) for w in caught]
    run.close()
    return losses, [str(w.message) for w in caught]


def optimizer_made_first(rank: int, world_size: int, plan: str) -> list[float]:
    """The optimizer built on the model's parameters before run.parallelize."""
    import plait
    from plait.check import _slice
    from tests._workers_semantics import mlm_batch

    run = plait.init(plan, quiet=True, seed=0)
    model = masked_lm()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model = run.parallelize(model)
    losses = [float(run.step(model, _slice(mlm_batch(s), run.dp_rank, run.dp_size), mlm_loss,
                             opt)) for s in range(2)]
    run.close()
    return losses


def own_dataloader(rank: int, world_size: int, plan: str, sampler: bool) -> list[str]:
    """Two steps over a DataLoader the script iterates itself (each rank loading the batch its
    replica trains on), with or without a DistributedSampler: the warnings they raised."""
    from torch.utils.data import DataLoader, DistributedSampler

    import plait

    run = plait.init(plan, quiet=True, seed=0)
    model = run.parallelize(masked_lm())
    opt, _ = optimizer(model)
    items = dataset()
    share = (DistributedSampler(items, num_replicas=run.dp_size, rank=run.dp_rank,
                                shuffle=False) if sampler else None)
    loader = DataLoader(items, batch_size=BATCH // run.dp_size, sampler=share,
                        collate_fn=partial(pad, length=SEQ))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _, batch in zip(range(2), loader, strict=False):
            run.step(model, batch, mlm_loss, opt)
    run.close()
    return [str(w.message) for w in caught]
