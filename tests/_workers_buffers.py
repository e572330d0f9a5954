"""Workers for tests/test_buffers_layouts.py: models whose forward writes buffers (BatchNorm's
running statistics, an EMA, a step counter), trained under a data-parallel or pipeline layout,
and what each rank then holds and reads: its own buffers, ``run.full_state_dict`` and the
checkpoint ``run.save`` writes."""

from __future__ import annotations

from typing import Any

import torch

import plait
from plait.parallel.data import unwrap
from tests import _workers_ckpt_users as u


def ddp_reads(rank: int, world: int, model: str, folder: str, steps: int = 3
              ) -> dict[str, Any]:
    """Train ``model`` (tests/_workers_ckpt_users.MODELS) under dp=2 for ``steps`` steps with
    SGD, then read it: this rank's own buffers before the read, ``run.full_state_dict`` and
    a checkpoint saved to ``folder``."""
    torch.set_num_threads(1)
    run = plait.init("dp=2", quiet=True)
    try:
        net = run.parallelize(u.MODELS[model]())
        opt = u.optimizer("sgd", net)
        losses = [float(run.step(net, batch, u.lm_loss, opt))
                  for batch in run.loader(u.dataset(model), batch_size=u.BATCH, steps=steps)]
        own = {n: b.detach().clone() for n, b in unwrap(net).named_buffers()}
        state = run.full_state_dict(net)
        run.save(folder)
    finally:
        run.close()
    return {"losses": losses, "own": own, "state": state}
