"""How many aten ops a training step dispatches: the count the per-op host cost is charged on.

A small model's step is not bound by its FLOPs but by the ops it runs: every aten op costs the
host a fixed time to dispatch (and, on a GPU, to launch a kernel) whatever its size. On a CPU,
where the host is the device, that time adds to the op's arithmetic; a ResNet on 8x8 images or
an LSTM of width 16 spends most of its step there. The planner counts the ops of one forward
and backward on fake tensors (:mod:`plait.planner.whole_model`) and of plait's optimizer update
(:func:`update_ops`), and the accelerator's profile says what one op costs
(:attr:`plait.planner.hardware.Cluster.op_latency`).

What is counted is what a ``TorchDispatchMode`` sees: every op below autograd, the backward's
included, each once. Left out: the ``prim`` namespace, fake tensors' own queries
(``prim.device``) that a real run does not dispatch, and ``aten.detach``, autograd's
bookkeeping of saved tensors, whose number depends on how they are saved (a forward under
``saved_tensors_hooks``, as the planner's, detaches them at unpacking instead).
"""

from __future__ import annotations

from typing import Any

import torch

from .._torch_compat import torch_dispatch_mode


def op_counter() -> Any:
    """A dispatch mode whose ``ops`` attribute counts the aten ops run inside it."""
    base = torch_dispatch_mode()
    skipped = {torch.ops.aten.detach.default}

    class OpCounter(base):  # type: ignore[misc, valid-type]
        """Counts each op, then runs it unchanged."""

        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if getattr(func, "namespace", "") != "prim" and func not in skipped:
                self.ops += 1
            return func(*args, **(kwargs or {}))

    return OpCounter()


def update_ops(tensors: int, *, clip: float = 1.0) -> int:
    """Aten ops of plait's update (:func:`plait.train.apply_update`: gradient scale, clip,
    ``torch.optim.AdamW`` as torch defaults it on a CPU, one loop over the tensors, and
    ``zero_grad``) over ``tensors`` small parameter tensors, after its first step (which also
    creates the optimizer's state)."""
    from plait.plan import Plan
    from plait.train import apply_update

    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(tensors)]
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    plan = Plan(grad_clip=clip)
    totals = torch.tensor([1.0, 1.0])
    counter = op_counter()
    for step in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        if step:
            with counter:
                apply_update(opt, totals, plan=plan)
        else:
            apply_update(opt, totals, plan=plan)
    return int(counter.ops)


def update_cost(*, clip: float = 1.0) -> tuple[int, int]:
    """(ops per parameter tensor, ops per update whatever the tensors) of plait's update, by
    difference between one and two tensors."""
    one, two = update_ops(1, clip=clip), update_ops(2, clip=clip)
    return two - one, one - (two - one)
