"""Minimal stand-in written on the ``tensor`` branch so dp x tp can be tested; the ``zero``
branch owns this file and its full version (apply_fsdp, offload, ...) replaces this one.

``apply_replicate``: replicated data parallelism over ``dp_replicate`` for models whose
parameters are DTensors (after TP). DDP cannot bucket DTensors, so this uses FSDP2's
``fully_shard`` on the 2-D (dp_replicate, dp_shard) mesh with dp_shard == 1, i.e. HSDP with a
shard degree of one: every replica keeps whole (TP-local) parameters and gradients are
all-reduced over dp_replicate.
"""

from __future__ import annotations

import torch.nn as nn

from ..mesh import Mesh
from ..plan import Plan


def apply_replicate(module: nn.Module, mesh: Mesh, plan: Plan) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh.root["dp_replicate", "dp_shard"]
    for block in getattr(module, "layers", None) or []:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
    return module
