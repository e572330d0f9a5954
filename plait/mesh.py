"""Plan -> named DeviceMesh.

Every mesh has the same five named axes, ``pp, dp_replicate, dp_shard, cp, tp`` (outermost
first, see ``plait.plan.MESH_AXES``), including those of degree 1. Keeping the degree-1 axes
means code never asks "does this mesh have a tp axis?": ``mesh["tp"]`` always exists, and a
parallelism whose axis has size 1 is simply not applied. Flattened views of the data axes are
built once here and kept (torch wants flattened meshes bookkept by the caller), so the loader,
DDP/FSDP and the ledger agree on which ranks share a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .plan import MESH_AXES, Plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Flattened views built on every mesh.
DP = "dp"                    # dp_replicate x dp_shard: ranks that see different batches
DP_SHARD_CP = "dp_shard_cp"  # what FSDP shards over: cp ranks hold the same model, too
DP_CP = "dp_cp"              # dp x cp: ranks whose gradients and loss totals are reduced together
DP_SHARD_TP = "dp_shard_tp"  # FSDP x TP: the gradient norm's one all-reduce (see build_mesh)
DP_SHARD_CP_TP = "dp_shard_cp_tp"  # the same under context parallelism (FSDP over dp_shard x cp)


@dataclass
class Mesh:
    """The root DeviceMesh with its named axes, plus the flattened data views."""

    plan: Plan
    root: DeviceMesh
    flat: dict[str, DeviceMesh] = field(default_factory=dict)
    # Slices of the root asked for so far. Each ``root[name]`` builds a new DeviceMesh (torch
    # 2.13 recomputes its layout and coordinates: 0.5-1 ms on a CPU), and the train step asks
    # for ``mesh["pp"]`` every step; a slice is a view of the same ranks and process groups,
    # so one per name serves every caller.
    _slices: dict[str | tuple[str, ...], DeviceMesh] = field(default_factory=dict, repr=False,
                                                             compare=False)

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(name, str) and name in self.flat:
            return self.flat[name]
        found = self._slices.get(name)
        if found is None:
            found = self._slices[name] = self.root[name]
        return found

    def size(self, name: str) -> int:
        return self[name].size()

    def local_rank(self, name: str) -> int:
        return self[name].get_local_rank()

    @property
    def device_type(self) -> str:
        return self.root.device_type

    def data_rank_and_size(self) -> tuple[int, int]:
        """This rank's index among the data-parallel replicas, and how many there are."""
        return self.local_rank(DP), self.size(DP)

    def axis_sizes(self) -> dict[str, int]:
        return {name: self.size(name) for name in MESH_AXES}


def build_mesh(plan: Plan, device_type: str, world_size: int) -> Mesh:
    """Build the named mesh for ``plan`` on ``world_size`` ranks of ``device_type``.

    Needs an initialised default process group. Raises ValueError when the plan's degrees do not
    multiply to the world size.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from ._torch_compat import flatten_mesh

    plan.validate(world_size)
    shape = tuple(getattr(plan, axis) for axis in MESH_AXES)
    root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
    flat = {
        DP: flatten_mesh(root["dp_replicate", "dp_shard"], DP),
        DP_SHARD_CP: flatten_mesh(root["dp_shard", "cp"], DP_SHARD_CP),
    }
    if plan.cp > 1:
        # Context-parallel ranks hold the same parameters and compute partial gradients (their
        # slices of each sequence): gradients and the step's (loss sum, count) are reduced
        # over the data and cp ranks together. Built only there: it creates process groups.
        flat[DP_CP] = flatten_mesh(root["dp_replicate", "dp_shard", "cp"], DP_CP)
    if plan.tp > 1 and plan.dp_shard * plan.dp_replicate > 1:
        # Data parallelism over TP goes through FSDP2 (plait.parallel.zero), whose parameters'
        # gradient norms are partial over dp_shard and tp (dp_shard of size 1 included, under
        # replicated DP); DTensor reduces them in one all-reduce when the root mesh has this
        # flattened view, and in two sequential ones (one latency more per step, and a warning)
        # when it does not. Built only there: a flattened view creates process groups.
        flat[DP_SHARD_TP] = flatten_mesh(root["dp_shard", "tp"], DP_SHARD_TP)
    if plan.tp > 1 and plan.cp > 1 and plan.zero >= 2:
        # Under cp, FSDP2 shards over dp_shard x cp (plait.parallel.zero.data_mesh): the
        # gradient norms are partial over dp_shard_cp and tp, reduced in one all-reduce when
        # this view exists (DTensor finds it by its ranks' layout).
        flat[DP_SHARD_CP_TP] = flatten_mesh(root["dp_shard", "cp", "tp"], DP_SHARD_CP_TP)
    return Mesh(plan=plan, root=root, flat=flat)
