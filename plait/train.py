"""The training step: one call for every plan.

``train_step`` runs forward, backward, gradient clipping and the optimizer step for whatever
layout the model was parallelized with. Pipelined models carry their schedule (see
``plait.parallel.pipeline``) and take the pipeline branch; everything else runs gradient
accumulation over ``plan.grad_accum`` micro-steps, with gradient synchronisation switched off on
all but the last so that accumulation costs no extra communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .plan import Plan

LossFn = Callable[[Any, Any], torch.Tensor]

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16}


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Switch gradient synchronisation on or off for DDP and FSDP2 modules alike."""
    if enabled:
        yield
        return
    if isinstance(model, DDP):
        with model.no_sync():
            yield
        return
    set_sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2 (fully_shard)
    if set_sync is None:
        yield
        return
    set_sync(False)
    try:
        yield
    finally:
        set_sync(True)


def autocast(plan: Plan, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 compute with fp32 master weights, or nothing for fp32.

    FSDP2 handles its own casting (MixedPrecisionPolicy) and needs no autocast; DDP and plain
    modules use autocast so that parameters and their gradients stay fp32 (the all-reduce then
    runs in fp32, as the plan promises)."""
    dtype = _AUTOCAST_DTYPES.get(plan.mixed_precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def split_microbatches(batch: Any, n: int) -> list[Any]:
    """Split a batch (tensor, or tuple/list/dict of tensors) into ``n`` equal parts along dim 0."""
    if n == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % n:
            raise ValueError(f"batch of {batch.shape[0]} rows does not split into {n} equal "
                             f"micro-batches; make the per-replica batch a multiple of {n}")
        return list(batch.chunk(n))
    if isinstance(batch, dict):
        parts = {k: split_microbatches(v, n) for k, v in batch.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(n)]
    if isinstance(batch, (tuple, list)):
        parts = [split_microbatches(v, n) for v in batch]
        return [type(batch)(p[i] for p in parts) for i in range(n)]
    raise TypeError(f"cannot split a batch of type {type(batch).__name__} into micro-batches")


def _forward_loss(model: nn.Module, batch: Any, loss_fn: LossFn) -> torch.Tensor:
    """Convention: a batch is (inputs, targets); inputs may be a tuple/dict of model arguments."""
    inputs, targets = batch
    if isinstance(inputs, dict):
        out = model(**inputs)
    elif isinstance(inputs, (tuple, list)):
        out = model(*inputs)
    else:
        out = model(inputs)
    loss = loss_fn(out, targets)
    if hasattr(loss, "full_tensor"):  # a DTensor loss (vocabulary-parallel head): replicated
        loss = loss.full_tensor()
    return loss


def loss_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """The context forward+loss+backward run in: torch's ``loss_parallel()`` for models whose
    head keeps vocabulary-sharded logits (tensor parallelism sets ``plait_loss_parallel``)."""
    if getattr(model, "plait_loss_parallel", False):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float,
                   pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip the global gradient norm, across pipeline stages too.

    ``torch.nn.utils.clip_grad_norm_`` already handles DTensor gradients (FSDP/TP shards). With
    pipeline parallelism each rank holds only its stages' gradients, so the squared norms are
    summed over the ``pp`` group before clipping (the same norm as one device computes).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        squared = norm.pow(2)
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


def train_step(model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
               *, plan: Plan, device: torch.device,
               pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """One optimizer step on this rank's ``batch``; returns the mean loss (detached).

    For pipelined models the returned loss is only meaningful on the last stage; other stages
    return NaN (the runtime broadcasts it for reporting).
    """
    pipeline = getattr(model, "plait_pipeline", None)
    if pipeline is not None:
        loss = pipeline.step(batch, loss_fn, plan=plan, device=device)
    else:
        micro = split_microbatches(batch, plan.grad_accum)
        total = torch.zeros((), device=device)
        for i, part in enumerate(micro):
            # backward inside grad_sync too: FSDP2 reads the flag in backward (a backward
            # outside it reduce-scattered every micro-step); DDP reads it in forward.
            with loss_context(model), grad_sync(model, enabled=i == len(micro) - 1):
                with autocast(plan, device):
                    loss = _forward_loss(model, part, loss_fn) / len(micro)
                loss.backward()
            total += loss.detach().float()
        loss = total
    if plan.grad_clip:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm(params, plan.grad_clip, pp_group)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss
