"""BatchNorm running statistics under ZeRO-2/3 without ``sync_bn``: one value on every rank.

In training each data rank's BatchNorm updates its running mean and variance from its own rows.
DDP (``dp``, ZeRO-1) broadcasts rank 0's buffers before every forward (torch's
``broadcast_buffers``), so every rank evaluates and saves rank 0's. FSDP2 (ZeRO-2/3, and the
replicated path under tp) has no such broadcast: each rank kept its own statistics, an
evaluation gave each rank another model, and a checkpoint held one rank's.

So, when the statistics are read (a forward with no BatchNorm in training mode, ``run.evaluate``,
``run.save``, ``run.full_state_dict``) after a training forward changed them, they are averaged
over the data ranks: one all-reduce of every layer's statistics, never during training. The
mean of the ranks' running means is one device's running mean over the same rows (the running
mean is linear in the batch means, and the ranks' equal slices average to the global batch's);
the mean of their running variances leaves out the spread between the ranks' means, which
``sync_bn`` (statistics over the data axes at every step) takes in. ``num_batches_tracked`` is
the same on every rank and is left as it is.

torch has no hook for "the model is about to be read": a forward pre-hook on the laid-out
module notes training forwards and averages at the first forward that trains no BatchNorm.
That forward is a collective on every data rank already where FSDP2 shards the parameters (it
gathers them), so the all-reduce adds no new way to hang; see :func:`track_running_stats` for
the replicated layout. A pipeline's evaluation averages before its schedule runs:
torch's shape inference runs a stage's forward whose buffer writes plait undoes
(``plait.parallel.pipeline._buffers_kept``), an average there included.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .layout import layout_of, local_modules


class RunningStats:
    """The BatchNorm layers of one laid-out module, and whether a training forward changed
    their statistics since they were last averaged over ``group``."""

    def __init__(self, norms: list[nn.modules.batchnorm._BatchNorm], group: dist.ProcessGroup):
        self.norms = norms
        self.group = group
        self.changed = False

    def training(self) -> bool:
        return any(m.training and m.track_running_stats for m in self.norms)

    def average(self) -> None:
        """Average every layer's running mean and variance over ``group`` (every rank of it
        calls this), if a training forward changed them since the last time."""
        if not self.changed:
            return
        # Under tp the statistics are DTensors replicated over tp: each rank's local copy is
        # the whole tensor, averaged over the data ranks like a plain one.
        tensors = [t.to_local() if isinstance(t, DTensor) else t
                   for m in self.norms for t in (m.running_mean, m.running_var) if t is not None]
        if tensors:
            with torch.no_grad():
                flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
                dist.all_reduce(flat, group=self.group)
                flat /= dist.get_world_size(self.group)
                start = 0
                for t in tensors:
                    t.copy_(flat[start:start + t.numel()].view_as(t))
                    start += t.numel()
        self.changed = False

    def note_training(self, module: nn.Module, args: Any) -> None:
        if self.training():
            self.changed = True

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.training():
            self.changed = True
        else:
            self.average()


def track_running_stats(module: nn.Module, group: dist.ProcessGroup, *, sharded: bool
                        ) -> RunningStats | None:
    """The :class:`RunningStats` of ``module``'s BatchNorm layers that track running
    statistics, or None when it has none. ``sharded``: FSDP2 shards the parameters over the
    data ranks, so every forward gathers them over those ranks, and the statistics are also
    averaged at the first forward that trains none of them after one that trained some.
    Without sharding (replicated DP over tp) a forward has no collective over the data ranks:
    one rank may evaluate alone, and an all-reduce there would wait for the others forever;
    the statistics are then averaged only by the calls every rank makes (``run.evaluate``,
    ``run.save``, ``run.full_state_dict``)."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             and m.track_running_stats]
    if not norms:
        return None
    stats = RunningStats(norms, group)
    if sharded:
        module.register_forward_pre_hook(stats.pre_forward)
    else:
        module.register_forward_pre_hook(stats.note_training)
    return stats


def average_running_stats(model: nn.Module) -> None:
    """Before the model is read (evaluation, a checkpoint, a full state dict): average the
    BatchNorm running statistics a training forward changed on this rank's modules (the
    stages of a pipeline). Collective over the data ranks; nothing to do for layouts that
    keep one value on every rank (DDP, ``sync_bn``)."""
    for module in local_modules(model):
        stats = layout_of(module).running_stats
        if stats is not None:
            stats.average()
