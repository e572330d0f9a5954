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


def listening_sockets(rank, world_size):
    """{port: address} of the TCP sockets this worker listens on, after one all-reduce."""
    import os

    import torch.distributed as dist

    from tests._ranks import listening

    dist.all_reduce(torch.ones(1))
    return listening([os.getpid()])
