"""``find_unused`` under ZeRO-2/3: a parameter no data rank used in a step keeps no gradient.

One device leaves a parameter its forward did not use (an auxiliary head on the steps without
its targets) without a gradient, and torch's optimizers skip such a parameter: Adam neither moves
it nor decays its moments. DDP's ``find_unused_parameters`` keeps that: a parameter unused on
every rank keeps its gradient untouched. FSDP2's ``set_reduce_scatter_unused_params`` (what
``find_unused`` turns on, so that every rank reduces the same tensors whichever branches it
took) reduce-scatters zeros for it instead, and Adam then moves it by its momentum: another
training than one device's.

So, as DDP does, each rank notes which parameters its step's autograd graph reaches (a walk of
the graph before backward), one all-reduce of that mask over the ranks finds those no rank
used, and their gradients go back to None after backward. FSDP2 has no hook for it: the leaf
its forward reads is each parameter's unsharded copy, reached through its param group.

Under pipeline parallelism torch's schedule runs each microbatch's backward itself, from the
stage's outputs (and on the last stage from the loss of those outputs), so each stage notes
the parameters its outputs reach as it makes them (``plait.parallel.pipeline.TimedStage``),
and the mask is reduced over the ranks holding the same stages (their data replicas) once the
schedule has run.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .pipeline_chain import leaves_reached


def _fsdp_params(model: nn.Module) -> list[Any]:
    """FSDP2's per-parameter records (sharded parameter, unsharded copy) in a fixed order."""
    records = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
        if group is not None:
            records.extend(group.fsdp_params)
    return records


class UnusedTracker:
    """Which FSDP2 parameters a step's micro-batches used, on this rank; :meth:`finish`
    clears the gradients of those no rank used."""

    def __init__(self, model: nn.Module) -> None:
        self.records = _fsdp_params(model)
        self.used: set[int] = set()

    def note(self, loss: torch.Tensor) -> None:
        """Before ``loss.backward()`` (or, in a pipeline, on each output a stage's backward
        starts from): remember the parameters it reaches."""
        if loss.grad_fn is not None:
            self.used |= leaves_reached(loss)

    def finish(self, group: dist.ProcessGroup | None = None) -> None:
        """After the last backward (every rank of ``group`` calls it): a parameter no rank
        used gets its gradient back to None, as on one device."""
        if not self.records:
            return
        device = self.records[0].sharded_param.device
        mask = torch.tensor([float(id(getattr(r, "_unsharded_param", None)) in self.used
                                   or id(r.sharded_param) in self.used)
                             for r in self.records], device=device)
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)
        for record, used in zip(self.records, mask.tolist(), strict=True):
            if not used:
                record.sharded_param.grad = None
        self.used = set()
