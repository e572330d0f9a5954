"""BatchNorm's running variance on PyTorch/XLA, kept as eager torch keeps it.

Eager torch updates ``running_var`` with the batch's unbiased variance (divided by n - 1, for n
values per channel); torch_xla 2.9 updates it with the biased one (divided by n). Training is
the same, but the running statistics, and with them every prediction the model makes in eval
mode, drift from what one device computes (by a factor (n - 1) / n per update: 12% with 8 rows
per channel). Where the installed torch_xla does this (:func:`updates_biased_variance` asks it
on two values), :func:`keep_unbiased_running_var` puts eager torch's update back with a pair of
hooks on each BatchNorm that tracks running statistics: one more variance per BatchNorm per
training forward, inside the same compiled step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm


def updates_biased_variance(device: torch.device) -> bool:
    """Whether BatchNorm on ``device`` updates ``running_var`` with the biased variance: one
    update of momentum 1 over the values 0 and 2 leaves 2 (unbiased) or 1 (biased)."""
    probe = nn.BatchNorm1d(1, momentum=1.0).to(device)
    with torch.no_grad():
        probe(torch.tensor([[0.0], [2.0]], device=device))
    running_var = probe.running_var
    assert running_var is not None
    return float(running_var.cpu()[0]) < 1.5


def _tracks(module: nn.Module) -> bool:
    return (isinstance(module, _BatchNorm) and module.track_running_stats
            and module.running_var is not None)


def _before(module: _BatchNorm, args: tuple[Any, ...]) -> None:
    """Training forward: keep the running variance as it was and the batch's unbiased one."""
    if not module.training or not args or not isinstance(args[0], torch.Tensor):
        return
    x = args[0].detach()
    values = x.numel() // max(1, x.shape[1]) if x.ndim > 1 else 0
    if values < 2:  # eager torch refuses one value per channel itself
        return
    dims = [0, *range(2, x.ndim)]
    running_var = module.running_var
    assert running_var is not None
    with torch.no_grad():
        module.__dict__["_plait_var"] = (running_var.detach().clone(),
                                         x.float().var(dim=dims, correction=1))


def _after(module: _BatchNorm, args: tuple[Any, ...], output: Any) -> None:
    """Replace torch_xla's running-variance update by eager torch's."""
    saved = module.__dict__.pop("_plait_var", None)
    if saved is None:
        return
    old, batch_var = saved
    if module.momentum is None:  # a cumulative average over the batches seen
        momentum: Any = 1.0 / module.num_batches_tracked.float()  # type: ignore[union-attr]
    else:
        momentum = module.momentum
    running_var = module.running_var
    assert running_var is not None
    with torch.no_grad():
        # A new tensor, not an in-place copy: torch_xla's batch norm keeps the running variance
        # for its backward, which then refuses a tensor changed in place.
        module.running_var = (old * (1 - momentum) + batch_var * momentum).to(running_var.dtype)


def keep_unbiased_running_var(model: nn.Module, device: torch.device) -> int:
    """Hook every BatchNorm of ``model`` that tracks running statistics so that its running
    variance is eager torch's, where ``device`` needs it (see the module docstring). Returns
    how many were hooked."""
    norms = [m for m in model.modules() if _tracks(m)]
    if not norms or not updates_biased_variance(device):
        return 0
    for module in norms:
        module.register_forward_pre_hook(_before)
        module.register_forward_hook(_after)
    return len(norms)
