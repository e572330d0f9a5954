"""Global-batch loss semantics: the loss one device computes, under every layout.

A loss that is a *mean over counted items* — tokens whose label is not ``ignore_index``, rows of
padding left out, weighted samples — is not the mean of per-rank (or per-micro-batch) means
when the ranks count different numbers of items. plait therefore works with the pair
``(sum over items, number of items)`` for every micro-batch, and the step's loss is

    sum of every micro-batch's sum, over every data rank  /  sum of their counts

which is exactly the mean one device computes over the whole global batch. The count is
all-reduced over the data axes once per step (with the loss sum: one 2-element all-reduce),
and the gradients, which backward computed for the sums, are scaled by ``dp / count`` (data
parallelism averages gradients over its ``dp`` replicas) before clipping and the optimizer step.

What a loss function may return (``loss_fn(output, targets)``):

* ``(sum, count)``: the summed loss of the micro-batch and how many items it sums over (an int
  or a tensor). Use this for weighted samples (``(sum(w * l), sum(w))``) or anything unusual.
* a scalar: read as the *mean* over the micro-batch's counted items, the count taken from the
  targets by :func:`count_items`: integer labels count the entries that are not
  ``IGNORE_INDEX`` (-100, the default of ``F.cross_entropy`` and of Hugging Face models), any
  other targets count rows. So ``F.cross_entropy(..., ignore_index=-100)`` (mean reduction),
  Hugging Face's ``output.loss`` and ``F.mse_loss`` are right with no change.

What happens otherwise: a scalar that is *not* a mean over those counted items (a sum, or a mean
over items the targets do not show) is still weighted by the count, so the layout trains a
differently weighted loss than one device; return ``(sum, count)`` instead. With every
micro-batch counting the same number of items (no ignored labels), the weighting is uniform
and a scalar of any kind trains what one device trains on the mean of the micro-batch losses.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

# The label value losses skip: F.cross_entropy's and Hugging Face's default ignore_index.
IGNORE_INDEX = -100


def count_items(targets: Any, *, shift: bool = False) -> torch.Tensor:
    """How many items a mean loss over ``targets`` averages over (a float 0-dim tensor).

    Integer labels: the entries that are not ``IGNORE_INDEX``; with ``shift=True`` the first
    position of every row is dropped first (a causal LM predicts token t+1 from t, so Hugging
    Face's causal-LM loss never reads the first label). A dict: its ``"labels"`` entry if there
    is one, else its first tensor. Anything else: the rows (dim 0) of the first tensor.
    """
    if isinstance(targets, dict):
        targets = targets["labels"] if "labels" in targets else next(
            (v for v in targets.values() if isinstance(v, torch.Tensor)), None)
    elif isinstance(targets, (tuple, list)):
        targets = next((v for v in targets if isinstance(v, torch.Tensor)), None)
    if not isinstance(targets, torch.Tensor):
        return torch.ones(())
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        return torch.tensor(float(targets.shape[0] if targets.ndim else 1),
                            device=targets.device)
    labels = targets[..., 1:] if shift and targets.ndim > 1 else targets
    return (labels != IGNORE_INDEX).sum().float()


def loss_sum_and_count(value: Any, targets: Any, *, shift: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss with autograd, count) from what a loss function returned (module docs)."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"a loss function returns a scalar mean or a (sum, count) pair; "
                             f"got a {type(value).__name__} of {len(value)} items")
        total, count = value
        total = _full(total)
        count = torch.as_tensor(_full(count), dtype=torch.float32, device=total.device)
        return total, count.detach().reshape(())
    loss = _full(value)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"the loss function returned {shape}; return a scalar mean "
                         f"(reduction='mean') or a (sum, count) pair")
    count = count_items(targets, shift=shift).to(loss.device)
    return loss.reshape(()) * count, count


def _full(t: Any) -> Any:
    """A replicated DTensor loss (vocabulary-parallel head under loss_parallel) as a tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def shifts_labels(model: nn.Module) -> bool:
    """True for a Hugging Face causal LM, whose ``output.loss`` skips each row's first label."""
    for sub in model.modules():
        name = type(sub).__name__
        if name.endswith(("ForCausalLM", "LMHeadModel")) and hasattr(sub, "config"):
            return True
    return False


def scale_gradients(parameters: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every gradient by ``factor`` (0-dim), one foreach call per device. A DTensor
    gradient is scaled through its local shard: the same values, without DTensor's per-call
    sharding propagation."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if hasattr(g, "to_local") else g
        by_device.setdefault(local.device, []).append(local)
    with torch.no_grad():
        for device, grads in by_device.items():
            torch._foreach_mul_(grads, factor.to(device))
