"""BatchNorm under data parallelism: statistics over the global batch (``sync_bn``), or a warning.

A BatchNorm layer in training normalises with the mean and variance of the batch it sees. Under
data parallelism each rank sees only its share of the global batch, so without synchronisation
every rank normalises with different, noisier statistics and the layout trains another model
than one device does. ``Plan.sync_bn`` replaces every BatchNorm by one whose statistics are
taken over the data axes (``dp_replicate x dp_shard``): the same mean, variance, running
averages and gradients as one device on the global batch. Without it, plait warns once, naming
the modules. Pipeline microbatches and gradient accumulation cut a step's batch into pieces that
BatchNorm normalises one by one; plait warns about that too (nothing synchronises it away).

Building blocks: ``torch.nn.SyncBatchNorm`` where torch runs it (CUDA, XPU, HPU). torch refuses
it for CPU tensors ("SyncBatchNorm expected input tensor to be on GPU"), so on other devices
:class:`DataSyncBatchNorm` below does the same with two all-reduces per layer (sum, then the
sum of squared deviations: the two-pass variance, as exact as one device's), differentiable
through :class:`_AllReduce` (torch's own differentiable ``torch.distributed.nn.functional``
version is deprecated in favour of functional collectives that have no backward).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..plan import Plan
from ..warn import user_stacklevel

_TORCH_SYNC_DEVICES = ("cuda", "xpu", "hpu")


def batchnorm_modules(module: nn.Module) -> list[str]:
    """Names of the BatchNorm layers (1d/2d/3d, lazy ones included) in ``module``."""
    return [name or type(module).__name__ for name, m in module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and not isinstance(m, (nn.SyncBatchNorm, DataSyncBatchNorm))]


def _named_on_rank0(module: nn.Module) -> str | None:
    """The BatchNorm layers of ``module`` as a short list for a warning, on rank 0 only."""
    names = batchnorm_modules(module)
    if not names or (dist.is_initialized() and dist.get_rank() != 0):
        return None
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def warn_unsynced(module: nn.Module, plan: Plan) -> None:
    """Warn (rank 0) when BatchNorm layers will train on per-rank statistics; the fix shown is
    the run's own plan with ``sync_bn`` added, so that it can be pasted as it is."""
    dp = plan.dp
    shown = _named_on_rank0(module) if dp > 1 else None
    if shown:
        fixed = plan.replace(sync_bn=True).to_string()
        warnings.warn(f"plait: BatchNorm {shown} will normalise with per-rank statistics (each "
                      f"over 1/{dp} of the global batch), which is not what one device trains; "
                      f"add sync_bn to the plan ('{fixed}') to take them over the data axes",
                      UserWarning, stacklevel=user_stacklevel())


def warn_microbatched(module: nn.Module, parts: int, why: str) -> None:
    """Warn (rank 0) when BatchNorm layers will see each step's batch in ``parts`` pieces
    (pipeline microbatches, gradient accumulation): each piece is normalised by its own
    statistics, which no synchronisation over the data axes repairs."""
    shown = _named_on_rank0(module) if parts > 1 else None
    if shown:
        warnings.warn(f"plait: BatchNorm {shown} will normalise each of the {parts} pieces of a "
                      f"step's batch ({why}) with its own statistics, which is not what one "
                      f"device trains on the whole batch; use GroupNorm or LayerNorm, or one "
                      f"piece (microbatches=1 with schedule=gpipe, grad_accum=1)", UserWarning,
                      stacklevel=user_stacklevel())


class _AllReduce(torch.autograd.Function):
    """Sum over ``group``; the gradient of a sum over ranks is the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _AllReduce.apply(t, group)


class DataSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics are taken over every rank of ``group``."""

    def __init__(self, source: nn.modules.batchnorm._BatchNorm, group: dist.ProcessGroup):
        super().__init__(source.num_features, source.eps, source.momentum, source.affine,
                         source.track_running_stats, device=_device(source),
                         dtype=_dtype(source))
        self.group = group
        if source.affine:
            self.weight, self.bias = source.weight, source.bias
        if source.track_running_stats:
            self.running_mean, self.running_var = source.running_mean, source.running_var
            self.num_batches_tracked = source.num_batches_tracked
        self.training = source.training

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2-D input (N, C, ...), got {x.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        use_batch = self.training or not self.track_running_stats
        if not use_batch:
            return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                            self.bias, False, 0.0, self.eps)
        # Statistics in fp32 for a bf16/fp16 input (mixed_precision=bf16), as torch's
        # batch_norm computes them, and the output in the input's dtype, as it returns it: in
        # bf16 the count (exact only up to 256), the sums and the variance would be rounded to
        # 8 bits, and the running statistics would take those values.
        out_dtype = x.dtype
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        count = torch.tensor([x.numel() // x.shape[1]], dtype=x.dtype, device=x.device)
        sums = all_reduce(torch.cat([x.sum(dims), count]), self.group)
        n = sums[-1]
        mean = sums[:-1] / n
        centred = x - mean.reshape(shape)
        var = all_reduce((centred * centred).sum(dims), self.group) / n
        if self.training and self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), n.detach())
        y = centred * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        return y.to(out_dtype)

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor) -> None:
        assert self.running_mean is not None and self.running_var is not None  # tracked
        assert self.num_batches_tracked is not None
        self.num_batches_tracked += 1
        momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                    else self.momentum)
        unbiased = var * n / (n - 1).clamp_min(1)
        self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)


def _device(m: nn.Module) -> torch.device | None:
    t = next(iter(list(m.parameters()) + list(m.buffers())), None)
    return t.device if t is not None else None


def _dtype(m: nn.Module) -> torch.dtype | None:
    t = next((p for p in m.parameters()), None)
    return t.dtype if t is not None else None


def apply_sync_bn(module: nn.Module, group: dist.ProcessGroup, device_type: str) -> nn.Module:
    """Every BatchNorm in ``module`` synchronised over ``group`` (the data axes); the same
    parameters and buffers, so names and state dicts do not change."""
    if device_type in _TORCH_SYNC_DEVICES:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group=group)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return DataSyncBatchNorm(module, group)
    for name, child in list(module.named_children()):
        module.add_module(name, apply_sync_bn(child, group, device_type))
    return module


def forward_statistics(module: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``module``'s floating-point buffers outside BatchNorm layers (``sync_bn`` and
    :func:`warn_unsynced` cover those), by user-facing name: what :func:`warn_forward_statistics`
    compares after a step to find buffers the forward updates."""
    from torch.distributed.tensor import DTensor

    from .layout import local_modules
    from .units import canonical_name

    def local(b: torch.Tensor) -> torch.Tensor:
        # A buffer replicated over tp is a DTensor, and torch.equal on one is a collective:
        # rank 0 compares alone, so this rank's own copy.
        return b.to_local() if isinstance(b, DTensor) else b

    norms = {id(m) for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    # A pipeline's stage modules name their buffers as the user's model does.
    return {canonical_name(f"{owner}.{name}" if owner else name): local(b).detach().clone()
            for stage in local_modules(module)
            for owner, m in stage.named_modules() if id(m) not in norms
            for name, b in m.named_buffers(recurse=False) if b.is_floating_point()}


def warn_forward_statistics(module: nn.Module, before: dict[str, torch.Tensor],
                            dp: int) -> None:
    """Warn (rank 0) when a step changed a floating-point buffer of ``module``: a running
    statistic the forward keeps itself (an EMA of activations, a running mean) is updated on
    each data rank from that rank's rows only, as BatchNorm's are without sync_bn, and nothing
    averages it over the data ranks (each step starts from rank 0's copy: DDP broadcasts it,
    and plait.parallel.buffer_sync does under ZeRO-2/3), so it is not what one device computes
    on the global batch."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    after = forward_statistics(module)
    changed = [n for n, b in before.items() if n in after and not torch.equal(after[n], b)]
    if changed:
        shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more"
                                          if len(changed) > 6 else "")
        warnings.warn(f"plait: buffer(s) {shown} changed in a training step: each of the {dp} "
                      f"data ranks updates them from its own 1/{dp} of the global batch and "
                      f"each step starts from rank 0's copy (checkpoints and full_state_dict "
                      f"take rank 0's too), which is not what one device computes; reduce them "
                      f"over the data ranks in the forward (torch.distributed.all_reduce) if "
                      f"they must match",
                      UserWarning, stacklevel=user_stacklevel())
