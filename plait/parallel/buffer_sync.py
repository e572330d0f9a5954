"""Buffers a forward writes (outside BatchNorm) under FSDP2: rank 0's on every data rank, as DDP.

A model may keep state of its own in buffers its forward updates: a step counter, an EMA of
activations that the forward also reads. Each data rank updates it from its own rows. DDP
(``dp``, ZeRO-1) broadcasts the first data rank's buffers before every forward that follows a
synchronised training forward (torch's ``broadcast_buffers``): each step starts from rank 0's
values on every rank, so a forward that reads the buffer computes what rank 0's copy gives, and
a checkpoint or an evaluation sees rank 0's. FSDP2 (ZeRO-2/3, and replicated dp over tp) has no
such broadcast: each rank drifted on its own copy, read it in its forward (so its gradients
were not DDP's), and a checkpoint held whichever rank's copy DCP took.

So plait does what DDP does, from the data group's first rank, at the start of each training
step (before the first microbatch's forward; DDP too skips its ``no_sync`` microbatches) and
before the model is read (``run.evaluate``, ``run.save``, ``run.full_state_dict``), for the
buffers the first training step wrote on any rank (their version counters say which; one
all-reduce of a byte per buffer after that step, outside the ledger like the run's other
first-step checks): one broadcast of those buffers' bytes per step.
Buffers nothing writes (a rotary table, a mask) cost nothing per step; DDP broadcasts every
buffer. A buffer first written in a later step is warned about and left per rank (deciding
per step which to send would cost a collective every step). BatchNorm's statistics are
left to :mod:`plait.parallel.bn_running`, which averages them instead (one device's running
mean, where rank 0's would be a quarter of the rows' at dp=4).

DDP in a pipeline stage is handled here too, BatchNorm's statistics included: torch's stage
runs every forward under ``no_sync``, and a forward under ``no_sync`` leaves DDP's broadcast
off for the next one, so it never runs there. After the last step DDP (without a pipeline)
still holds each rank's own writes until its next forward: :func:`broadcast_ddp_buffers` gives
every rank rank 0's before the model is read without a forward.

torch has no FSDP2 counterpart of ``broadcast_buffers``; DDP's own broadcast lives in its
forward and cannot be borrowed without DDP's reducer.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from .layout import layout_of, local_modules


def _local(t: torch.Tensor) -> torch.Tensor:
    # A buffer replicated over tp is a DTensor: each rank's local copy is the whole buffer.
    return t.to_local() if isinstance(t, DTensor) else t


class WrittenBuffers:
    """The buffers of one laid-out module outside BatchNorm layers, by owner and name (a
    forward may assign a new tensor, ``self.count = self.count + 1``, so each is looked up
    again), the identity and version each had when last broadcast, and which of them the
    first training step wrote on any rank (None until :meth:`learn`)."""

    def __init__(self, slots: list[tuple[nn.Module, str]], group: dist.ProcessGroup):
        self.slots = slots
        self.group = group
        self.stamps = self._stamps()
        self.chosen: list[int] | None = None
        self.warned = False

    def _tensors(self) -> list[torch.Tensor]:
        return [_local(getattr(m, name)) for m, name in self.slots]

    def _stamps(self) -> list[tuple[int, int]]:
        return [(id(t), t._version) for t in self._tensors()]

    def _written(self) -> list[bool]:
        return [new != old for new, old in zip(self._stamps(), self.stamps, strict=True)]

    def learn(self) -> None:
        """After the first training step: which buffers it wrote on any rank (one all-reduce of
        a byte per buffer; every rank of ``group`` calls this). Those are broadcast from then
        on; a buffer nothing writes (a rotary table, a mask) costs nothing per step."""
        written = self._written()
        flags = torch.tensor(written, dtype=torch.uint8, device=self._tensors()[0].device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        self.chosen = [i for i, flag in enumerate(flags.tolist()) if flag]

    def broadcast(self) -> None:
        """Give every rank of ``group`` its first rank's copy of each buffer the first step
        wrote (every rank of the group calls this); nothing before :meth:`learn`."""
        if self.chosen is None:
            return
        tensors = self._tensors()
        if not self.warned:
            late = [self.slots[i][1] for i, w in enumerate(self._written())
                    if w and i not in self.chosen]
            if late:
                self.warned = True
                warnings.warn(f"plait: buffer(s) {', '.join(late)} were first written after "
                              f"the first training step: each data rank keeps its own copy "
                              f"of them (only the buffers the first step writes are "
                              f"broadcast from rank 0 before each step, as DDP does); write "
                              f"them in the first step too (a no-op update) to have them "
                              f"broadcast", UserWarning, stacklevel=2)
        if not self.chosen:
            return
        broadcast_from_first([tensors[i] for i in self.chosen], self.group)
        self.stamps = self._stamps()


def broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """The group's first rank's values of ``tensors`` on every rank of it, in place: one
    broadcast of their bytes, whatever their dtypes (gloo has no bool either)."""
    if not tensors:
        return
    with torch.no_grad():
        flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8)
                          for t in tensors])
        dist.broadcast(flat, group=group, group_src=0)
        start = 0
        for t in tensors:
            size = t.numel() * t.element_size()
            t.copy_(flat[start:start + size].clone().view(t.dtype).view(t.shape))
            start += size


def track_written_buffers(module: nn.Module, group: dist.ProcessGroup, *,
                          norms: bool = False) -> WrittenBuffers | None:
    """The :class:`WrittenBuffers` of ``module`` over ``group``, or None when it holds no
    buffer to track: those outside BatchNorm layers, and with ``norms`` BatchNorm's too (DDP's
    semantics, for a DDP pipeline stage whose own broadcast never runs)."""
    skipped = set() if norms else {
        id(m) for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    seen: set[int] = set()
    slots = []
    for m in module.modules():
        if id(m) in skipped:
            continue
        for name, b in m.named_buffers(recurse=False):
            if id(b) not in seen:  # one buffer under two names is broadcast once
                seen.add(id(b))
                slots.append((m, name))
    return WrittenBuffers(slots, group) if slots else None


def learn_written_buffers(model: nn.Module) -> None:
    """After the first training step: which buffers it wrote, on every data rank of this
    rank's modules (:meth:`WrittenBuffers.learn`). Collective over the data ranks."""
    for module in local_modules(model):
        written = layout_of(module).written_buffers
        if written is not None and written.chosen is None:
            written.learn()


def broadcast_written_buffers(model: nn.Module) -> None:
    """Before a training step and before the model is read: rank 0's copy of every buffer a
    forward wrote, on every data rank of this rank's modules (the stages of a pipeline).
    Collective over the data ranks; nothing to do for DDP, which does it itself before each
    forward (see :func:`broadcast_ddp_buffers` for a read with no forward)."""
    for module in local_modules(model):
        written = layout_of(module).written_buffers
        if written is not None:
            written.broadcast()


def broadcast_ddp_buffers(model: nn.Module) -> None:
    """Before the model is read with no forward (``run.full_state_dict``, ``run.save``): the
    first data rank's buffers on every data rank of this rank's DDP modules. DDP broadcasts
    them at the start of each forward, so after the last step every other rank still holds
    the statistics and EMAs its own rows wrote, which no forward of the run ever reads: one
    device's model, under DDP's semantics, is rank 0's. Every buffer DDP itself would send
    (BatchNorm's included), in one broadcast per module. Collective over the data ranks."""
    for module in local_modules(model):
        if isinstance(module, DistributedDataParallel) and module.broadcast_buffers:
            buffers = [b for _, b in module.module.named_buffers()]
            broadcast_from_first(buffers, module.process_group)
