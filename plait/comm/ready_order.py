"""The order in which a DDP module's gradients became ready, recorded from the run itself.

DDP's all-reduce count is its bucket count (``volumes.ddp_bucket_calls``), and the buckets
depend on the order the gradients arrive in. torch's ``Reducer`` (reducer.cpp,
``autograd_hook``) appends each parameter's index to ``rebuilt_param_indices_`` when the hook
on its ``AccumulateGrad`` node fires, in the first backward pass that reduces (a forward run
with grad enabled and ``require_backward_grad_sync``: not under ``no_sync``), then at the next
forward rebuilds the buckets in that order (``Reducer::rebuild_buckets``), taking rank 0's
order on every rank (``sync_bucket_indices``); under ``find_unused_parameters`` it never
rebuilds. That order is the parameters' reversed only for a forward that runs its modules in
the order they were registered: a head registered before the body, a reused module or a
branchy forward make it another.

torch exposes the order only through a private logging call, so plait records it the way DDP
does: a post-accumulate-grad hook on each of the module's parameters (the same node DDP's hook
sits on), armed by a forward pre-hook that reads DDP's own condition, during that one backward.
The hooks are removed once every parameter has reported (or the pass could not be read):
nothing runs per step after the first synced one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


class ReadyOrder:
    """Records the order of ``ddp``'s gradients in its first backward pass that reduces.

    ``order``: indices into :func:`ddp_parameters` in the order their gradients became ready,
    once every one has; None until then, and for good where the pass could not be read (a
    forward that reduces started again before every gradient arrived, which DDP itself refuses
    without ``find_unused_parameters``)."""

    def __init__(self, ddp: nn.Module) -> None:
        self._ddp: nn.Module | None = ddp  # until the pass is read: the module is not kept
        self.group = getattr(ddp, "process_group", None)  # DDP's: where rank 0's order goes
        self.params = ddp_parameters(ddp)
        self.order: tuple[int, ...] | None = None
        self.failed = False
        self._seen: list[int] = []
        self._got: set[int] = set()
        self._armed = False
        self._handles: list[Any] = [ddp.register_forward_pre_hook(self._forward)]
        self._handles += [p.register_post_accumulate_grad_hook(self._ready(i))
                          for i, p in enumerate(self.params)]

    @property
    def done(self) -> bool:
        return self.order is not None or self.failed

    @property
    def hooked(self) -> bool:
        """Whether its hooks are still on the model (until the pass is read)."""
        return bool(self._handles)

    def _forward(self, _module: nn.Module, _args: Any) -> None:
        # DDP's _pre_forward prepares a reducing backward under this same condition
        if not (torch.is_grad_enabled() and getattr(self._ddp, "require_backward_grad_sync",
                                                      True)):
            return
        if self._seen:  # a reducing pass that left gradients out: not DDP's order to read
            self.failed = True
            self.close()
            return
        self._armed = True

    def _ready(self, index: int) -> Any:
        def hook(_param: torch.Tensor) -> None:
            if not self._armed or index in self._got:
                return
            self._got.add(index)
            self._seen.append(index)
            if len(self._seen) == len(self.params):
                self.order = tuple(self._seen)
                self.close()
        return hook

    def close(self) -> None:
        """Remove the hooks and let go of the module and its parameters (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._armed = False
        self._ddp = None
        self.params = []


def ddp_parameters(ddp: nn.Module) -> list[torch.Tensor]:
    """The parameters DDP's reducer holds, in its order: every one that requires grad and is
    not ignored (``parameters_to_ignore``), each tensor once, module by module as
    ``named_modules`` walks them (``DistributedDataParallel._build_params_for_reducer``)."""
    inner = getattr(ddp, "module", ddp)
    ignored: set[str] = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    seen: set[int] = set()
    out = []
    for module_name, module in inner.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if p.requires_grad and full not in ignored and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def agreed_order(recorder: ReadyOrder | None) -> tuple[int, ...] | None:
    """Rank 0's recorded order on every rank of ``recorder``'s DDP group (the order DDP's
    rebuilt buckets take everywhere), or None where rank 0 has none. A collective over the
    DDP module's process group: call it on every rank of that group."""
    import torch.distributed as dist

    mine = recorder.order if recorder is not None else None
    group = recorder.group if recorder is not None else None
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return mine
    box: list[Any] = [mine]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]
