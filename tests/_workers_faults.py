"""Workers for the fault tests (spawned processes import them by module path)."""

import torch
import torch.nn as nn


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def nan_on_step(rank, world_size, plan, policy, bad_rank, bad_step, steps=5):
    """Train a small MLP; rank ``bad_rank`` feeds a NaN input at ``bad_step``. Returns the full
    parameters after every step and the steps the run skipped."""
    import plait
    from plait.check import full_state

    run = plait.init(plan, nonfinite=policy, quiet=True, log_every=1)
    model = run.parallelize(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    history, losses = [], []
    for step in range(1, steps + 1):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
        if step == bad_step and rank == bad_rank:
            x[0, 0] = float("nan")
        losses.append(run.step(model, (x, y), nn.functional.mse_loss, opt))
        history.append(full_state(model))
    skipped = list(run.stats.skipped)
    run.close()
    return {"history": history, "skipped": skipped, "losses": losses}


def sleeps_in_step(rank, world_size, timeout, stamp):
    """Rank 1 sleeps inside step 3's loss function, past the watchdog's timeout."""
    import time
    from pathlib import Path

    import plait

    run = plait.init("dp=2", quiet=True, timeout=timeout)
    model = run.parallelize(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0

    def loss_fn(out, y):
        if rank == 1 and step == 3:
            Path(stamp).write_text(str(time.time()))
            time.sleep(300)
        return nn.functional.mse_loss(out, y)

    for step in range(1, 6):  # noqa: B007 - read by loss_fn
        run.step(model, (torch.randn(4, 8), torch.randn(4, 8)), loss_fn, opt)
    run.close()
