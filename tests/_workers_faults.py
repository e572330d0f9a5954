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

    run = plait.init(plan, nonfinite=policy, quiet=True, log_every=1, seed=0)
    model = run.parallelize(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    history, losses, issued = [], [], []
    groups = _job_groups(run)
    for step in range(1, steps + 1):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
        if step == bad_step and rank == bad_rank:
            x[0, 0] = float("nan")
        before = _issued(groups)
        losses.append(run.step(model, (x, y), nn.functional.mse_loss, opt))
        issued.append(_issued(groups) - before)
        history.append(full_state(model))
    skipped = list(run.stats.skipped)
    run.close()
    return {"history": history, "skipped": skipped, "losses": losses, "issued": issued}


def _job_groups(run):
    """The job's process groups: the default one and each mesh axis's (the watchdog's private
    group is left out)."""
    import torch.distributed as dist

    groups = {id(dist.group.WORLD): dist.group.WORLD}
    for name in run.mesh.root.mesh_dim_names:
        if run.mesh.size(name) > 1:
            group = run.mesh[name].get_group()
            groups[id(group)] = group
    return list(groups.values())


def _issued(groups):
    """Collectives issued so far on ``groups`` (their sequence numbers)."""
    return sum(int(g._get_sequence_number_for_group()) for g in groups)


def listening_sockets(rank, world_size):
    """{port: address} of the TCP sockets this worker listens on, after one all-reduce."""
    import os

    import torch.distributed as dist

    from tests._ranks import listening

    dist.all_reduce(torch.ones(1))
    return listening([os.getpid()])


class _InfInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class _Poison(nn.Module):
    """Identity forward; when ``armed``, an inf gradient flows back through it."""

    armed = False

    def forward(self, x):
        return _InfInBackward.apply(x) if self.armed else x


def inf_grad_on_step(rank, world_size, plan, policy, bad_rank, bad_step, steps=4):
    """Like ``nan_on_step``, but the loss stays finite: on rank ``bad_rank`` at ``bad_step``
    the gradient reaching the first layer turns inf in backward."""
    import plait
    from plait.check import full_state

    run = plait.init(plan, nonfinite=policy, quiet=True, log_every=1, seed=0)
    torch.manual_seed(0)
    poison = _Poison()
    model = run.parallelize(nn.Sequential(nn.Linear(8, 16), poison, nn.ReLU(),
                                          nn.Linear(16, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    history = []
    for step in range(1, steps + 1):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
        poison.armed = step == bad_step and rank == bad_rank
        loss = run.step(model, (x, y), nn.functional.mse_loss, opt)
        assert torch.isfinite(loss)
        history.append(full_state(model))
    skipped = list(run.stats.skipped)
    run.close()
    return {"history": history, "skipped": skipped}


def agree_stop_between_hosts(rank, world_size):
    """The agreement XLA hosts make after each step (``StepGuard.agree_stop``, a CPU tensor on
    gloo): rank 1 alone gets SIGTERM between two steps. Returns what each step agreed."""
    import os
    import signal

    from plait.guard import StepGuard
    from plait.lifecycle import StopRequest

    stop = StopRequest(grace=120).install()
    guard = StepGuard("stop", rank, world_size, stop_request=stop)
    try:
        before = guard.agree_stop()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        after = guard.agree_stop()
    finally:
        stop.uninstall()
    return [before, after, guard.last.stop]


def stop_on_one_rank(rank, world_size, plan, folder, stop_step):
    """Only rank 1 gets SIGTERM, inside step ``stop_step``'s loss function; returns the exit
    code and the steps done on this rank."""
    import os
    import signal

    import plait

    run = plait.init(plan, checkpoint=folder, quiet=True, seed=0)
    model = run.parallelize(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    sent = []

    # once: plait may call a loss function again on parts of a batch (whether a scalar is a
    # mean over its rows), and a second SIGTERM ends a process at once
    def loss_fn(out, y):
        if rank == 1 and run.steps_done + 1 == stop_step and not sent:
            sent.append(stop_step)
            os.kill(os.getpid(), signal.SIGTERM)
        return nn.functional.mse_loss(out, y)

    try:
        for _ in range(6):
            run.step(model, (torch.randn(4, 8), torch.randn(4, 8)), loss_fn, opt)
    except SystemExit as leave:
        return {"code": leave.code, "steps": run.steps_done}
    return {"code": 0, "steps": run.steps_done}


def collectives_per_step(rank, world_size):
    """Collectives one clean step issues: plait's DDP step, and a raw DDP step of the same
    model (process groups' sequence numbers: each counts the collectives issued on it)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import plait

    run = plait.init(f"dp={world_size}", quiet=True, seed=0)
    model = run.parallelize(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = {id(g): g for g in (dist.group.WORLD, run.mesh["dp"].get_group(),
                                 run.mesh["dp_replicate"].get_group())}

    def issued():
        return sum(int(g._get_sequence_number_for_group()) for g in groups.values())

    batch = (torch.randn(4, 8), torch.randn(4, 8))
    run.step(model, batch, nn.functional.mse_loss, opt)  # the first step sets DDP up
    before = issued()
    run.step(model, batch, nn.functional.mse_loss, opt)
    ours = issued() - before
    raw = DDP(_model())
    raw_opt = torch.optim.SGD(raw.parameters(), lr=0.1)
    counts = []
    for _ in range(2):
        before = issued()
        nn.functional.mse_loss(raw(batch[0]), batch[1]).backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        raw_opt.step()
        raw_opt.zero_grad()
        counts.append(issued() - before)
    run.close()
    return {"plait": ours, "raw": counts[-1]}


def desync_check_switch(rank, world_size, desync_check):
    """Whether the watchdog runs, and whether it has the step-start check's group, after two
    steps under ``plait.init(desync_check=...)``."""
    import plait

    run = plait.init(f"dp={world_size}", quiet=True, desync_check=desync_check, seed=0)
    model = run.parallelize(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    losses = [float(run.step(model, batch, nn.functional.mse_loss, opt)) for _ in range(2)]
    dog = run._watchdog
    out = {"watchdog": dog is not None, "check": dog is not None and dog.check_group is not None,
           "losses": losses}
    run.close()
    return out
