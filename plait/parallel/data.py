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
    device_ids = [device.index] if device.type == "cuda" and device.index is not None else None
    # gradient_as_bucket_view: each gradient is a view into DDP's all-reduce bucket, so the
    # gradients are not copied into the buckets before the all-reduce and back after it, and
    # are held once instead of twice (torch's default keeps them apart).
    return DDP(module, process_group=dp_mesh.get_group(), device_ids=device_ids,
               bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True,
               find_unused_parameters=find_unused)


def unwrap(module: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (names and state dicts without ``module.``)."""
    return module.module if isinstance(module, DDP) else module
