"""Data parallelism (DDP): every replica holds the whole model, gradients are averaged.

Uses ``torch.nn.parallel.DistributedDataParallel``: its bucketed all-reduce overlaps with the
backward pass and is the fastest replicated-DP in PyTorch. (FSDP2's ``replicate`` is the
composable alternative; DDP stays the default for plain models because it is what users compare
against, and plait's overhead over it is benchmarked in bench/ddp_overhead.py.)

What it sends: one all-reduce of every gradient per optimizer step over the ``dp_replicate``
axis — 2(n-1)/n x (parameter bytes) per rank with a ring. Gradient accumulation skips the
all-reduce on all but the last micro-step (``no_sync``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_ddp(module: nn.Module, dp_mesh: DeviceMesh, *, device: torch.device,
              bucket_cap_mb: float = 25.0, find_unused: bool = False) -> nn.Module:
    """Wrap ``module`` in DDP over the ranks of ``dp_mesh`` (a 1-D mesh). ``find_unused``
    (``Plan.find_unused``): DDP walks each step's autograd graph for parameters without a
    gradient and reduces zeros for them, so that ranks whose forward took different branches
    still run the same all-reduces (it costs that walk, every step)."""
    if dp_mesh.ndim != 1:
        raise ValueError(f"DDP needs a 1-D data mesh, got {dp_mesh.ndim}-D {dp_mesh}")
    if not any(p.requires_grad for p in module.parameters()):
        return _frozen_replica(module, dp_mesh)
    device_ids = [device.index] if device.type == "cuda" and device.index is not None else None
    # gradient_as_bucket_view: each gradient is a view into DDP's all-reduce bucket, so the
    # gradients are not copied into the buckets before the all-reduce and back after it, and
    # are held once instead of twice (torch's default keeps them apart).
    return DDP(module, process_group=dp_mesh.get_group(), device_ids=device_ids,
               bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True,
               find_unused_parameters=find_unused)


def _frozen_replica(module: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """``module`` unwrapped, its parameters and buffers broadcast from the first rank of
    ``dp_mesh``, where none of its parameters trains (a pipeline stage whose embedding and
    blocks are all frozen). DDP refuses such a module ("DistributedDataParallel is not needed
    when a module doesn't have any parameter that requires a gradient"); there is no gradient
    to average, and the replicas only need to start equal, which DDP's constructor would have
    done with the same broadcast. DDP's per-step buffer broadcast is not kept: a frozen module
    whose forward writes its buffers (BatchNorm's running statistics in train mode) lets them
    drift apart across replicas."""
    import torch.distributed as dist

    group = dp_mesh.get_group()
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, group=group, group_src=0)
    return module


def unwrap(module: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (names and state dicts without ``module.``)."""
    return module.module if isinstance(module, DDP) else module
