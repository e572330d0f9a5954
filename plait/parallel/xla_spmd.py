"""Plans on PyTorch/XLA through SPMD: the same Plan, laid out as sharding annotations.

Under SPMD one program runs over every device of the slice: plait marks how tensors are split
over a named XLA mesh, and the compiler (GSPMD) partitions the program and inserts the
collectives. Annotations change where values live, never what is computed, so a layout trains
what one device trains. The Plan maps onto it like this:

==================  ===============  ==========================================================
plan                XLA mesh axis    what plait annotates
==================  ===============  ==========================================================
dp_replicate        ``dp_replicate``  the batch's first dimension (with ``fsdp``)
dp_shard, zero=3    ``fsdp``          FSDPv2 (torch_xla's ``SpmdFullyShardedDataParallel``) on
                                      every repeated block (or each module the plan's
                                      ``shard_patterns`` names) and on the root: each parameter is
                                      split on its largest dimension; the batch's first
                                      dimension. The axis is called ``fsdp`` because FSDPv2
                                      looks it up by that name.
tp                  ``tp``            each parameter a layer plan names (``tp_plans``, the same
                                      plans as DTensor TP): colwise/vocab splits the output
                                      features, rowwise the input features
==================  ===============  ==========================================================

Refused up front, with the reason (``plan_problems``): pipelines (GSPMD partitions one program;
plait has no pipeline schedule for it), ZeRO-1/2 (no SPMD form here: zero=3 is FSDPv2),
sequence parallelism, activation checkpointing and offload (not built on this path).

The degrees multiply to the number of devices of the slice, not of processes: one process per
host drives all of its host's devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..plan import Plan

#: the XLA mesh's axes, outermost first
XLA_AXES = ("dp_replicate", "fsdp", "tp")
#: the batch's first dimension is split over these
DATA_AXES = ("dp_replicate", "fsdp")

# Style -> which dimension of a Linear weight (out, in) the tp axis splits. The other
# dimension goes to the fsdp axis under ZeRO-3, so FSDPv2 (which leaves already-annotated
# parameters alone) and TP compose into one 2-D split.
_TP_DIM = {"colwise": 0, "colwise_qkv": 0, "colwise_gather": 0, "vocab_head": 0, "rowwise": 1,
           "rowwise_split": 1, "vocab_embedding": 0}


def plan_problems(plan: Plan) -> list[str]:
    """Every field of ``plan`` the XLA SPMD path cannot express, each with why and what to do."""
    problems = []
    if plan.pp > 1:
        problems.append(f"pp={plan.pp}: pipeline parallelism is not built on XLA (GSPMD "
                        f"partitions one program over the mesh and plait has no pipeline "
                        f"schedule for it); use dp_shard/tp on XLA, pipelines on GPUs")
    if plan.mixed_precision == "fp16":
        problems.append("mixed_precision=fp16: TPUs compute in bf16, which keeps fp32's range "
                        "and needs no loss scaling; use mixed_precision=bf16")
    if plan.zero in (1, 2):
        problems.append(f"zero={plan.zero}: ZeRO-1/2 have no SPMD form in plait; use zero=3 "
                        f"(FSDPv2: parameters, gradients and optimizer state split on fsdp)")
    if plan.sp:
        problems.append("sp=True: sequence parallelism is not built on XLA (the compiler picks "
                        "activation layouts); drop sp")
    if plan.activation_checkpointing != "none":
        problems.append(f"activation_checkpointing={plan.activation_checkpointing!r}: not built "
                        f"on XLA (the compiler removes torch.utils.checkpoint's recomputation; "
                        f"torch_xla has its own); use 'none'")
    if plan.offload:
        problems.append("offload=True: not built on XLA; drop offload")
    if plan.compile:
        problems.append("compile=True: XLA compiles the whole step already; drop compile")
    return problems


def check_plan(plan: Plan, devices: int) -> Plan:
    """``plan`` when XLA can lay it out on ``devices`` devices, else one ValueError naming every
    problem."""
    problems = plan_problems(plan)
    if plan.world_size != devices:
        product = " * ".join(f"{a}({getattr(plan, a)})" for a in ("dp_replicate", "dp_shard", "tp")
                             ) + (f" * pp({plan.pp})" if plan.pp > 1 else "")
        problems.append(f"{product} = {plan.world_size} != {devices} XLA devices; make the "
                        f"degrees multiply to {devices}")
    if problems:
        raise ValueError("plan cannot run on XLA: " + "; ".join(problems))
    return plan


@dataclass
class SPMDLayout:
    """The XLA mesh for a Plan, and this process's place among the hosts."""

    plan: Plan
    mesh: Any  # torch_xla.distributed.spmd.Mesh
    process_index: int = 0
    process_count: int = 1

    def data_rank_and_size(self) -> tuple[int, int]:
        """This host's share of the global batch: each host loads its own rows, the devices of
        the host split them (one host: the whole batch)."""
        return self.process_index, self.process_count

    def axis_sizes(self) -> dict[str, int]:
        return dict(zip(XLA_AXES, self.mesh.mesh_shape, strict=True))

    def batch_spec(self, ndim: int) -> tuple:
        """Partition spec of a batch tensor: the first dimension over the data axes."""
        return (DATA_AXES,) + (None,) * (ndim - 1) if ndim else ()

    def place_batch(self, batch: Any, device: torch.device) -> Any:
        """A host batch moved to the devices, split on its first dimension over the data axes
        (host tensors go through torch_xla's sharded transfer, the one ``MpDeviceLoader`` makes;
        tensors already on the device are annotated in place)."""
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.spmd as xs

        if isinstance(batch, torch.Tensor):
            if batch.device.type == "xla":
                if batch.ndim:
                    xs.mark_sharding(batch, self.mesh, self.batch_spec(batch.ndim))
                return batch
            if self.process_count > 1 and batch.ndim == 0:
                raise ValueError("a 0-d tensor in the batch cannot be split over hosts")
            # torch_xla's sharded transfer fails on a 1-D tensor (IndexError: too many
            # indices for tensor of dimension 1), a row's class label or timestep: it travels
            # as a column and is read back as the vector it was
            column = batch.ndim == 1
            host = batch.unsqueeze(1) if column else batch
            spec = xs.ShardingSpec(self.mesh, self.batch_spec(host.ndim),
                                   minibatch=self.process_count > 1) if host.ndim else None
            placed = xm.send_cpu_data_to_device(host, device, input_sharding=spec)[0]
            return placed.squeeze(1) if column else placed
        if isinstance(batch, dict):
            return {k: self.place_batch(v, device) for k, v in batch.items()}
        if isinstance(batch, (tuple, list)):
            return type(batch)(self.place_batch(v, device) for v in batch)
        return batch


def build_layout(plan: Plan | None) -> SPMDLayout:
    """Switch torch_xla to SPMD and build the mesh for ``plan`` (None: data parallel over every
    device) over the slice's devices.

    Must run before any tensor is placed on the XLA device (SPMD is a process-wide mode).
    """
    if plan is not None and plan_problems(plan):  # refused before the runtime starts
        raise ValueError("plan cannot run on XLA: " + "; ".join(plan_problems(plan)))
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    devices = xr.global_runtime_device_count()
    plan = check_plan(plan if plan is not None else Plan(dp_replicate=devices), devices)
    shape = (plan.dp_replicate, plan.dp_shard, plan.tp)
    mesh = xs.Mesh(np.arange(devices), shape, XLA_AXES)
    return SPMDLayout(plan=plan, mesh=mesh, process_index=xr.process_index(),
                      process_count=xr.process_count())


# ------------------------------------------------------------------------------ the layout
def apply_spmd(model: nn.Module, layout: SPMDLayout, *, device: torch.device,
               example: Any = None, say: Any = None) -> nn.Module:
    """``model`` on the XLA device with the plan's sharding annotations (TP, then FSDPv2).

    ``example``: the forward's arguments (``plait.parallel.tp_example.Example``, where the
    model is) that an inferred tensor-parallel plan is inferred and checked on, as on other
    devices, so that both lay out the same plan and refuse the same ones; ``say``: where the
    inferred plan is told (default: rank 0's stderr)."""
    from .placement import to_device_keeping_ties
    from .tensor import resolve_plan
    from .xla_batchnorm import keep_unbiased_running_var

    plan = layout.plan
    # on the host, before the move: the checks' forwards compile nothing
    styles = resolve_plan(model, plan, say, example).styles if plan.tp > 1 else None
    model = to_device_keeping_ties(model, device)
    keep_unbiased_running_var(model, device)
    if styles is not None:
        mark_tensor_parallel(model, layout, styles)
    if plan.zero == 3:
        model = wrap_fsdpv2(model, layout)
    return model


def mark_tensor_parallel(model: nn.Module, layout: SPMDLayout,
                         styles: dict[str, str] | None = None) -> dict[str, str]:
    """Annotate each parameter of each module the layer plan names; returns {module: style}.

    The plan is the one DTensor TP would use (``plait.parallel.tensor.resolve_plan``; or
    ``styles``, resolved already). Under SPMD the model keeps its global shapes, so nothing is
    divided by tp (heads, split sizes).
    """
    import torch_xla.distributed.spmd as xs

    from .tensor import _is_conv1d, match_plan, resolve_plan

    if styles is None:
        styles = resolve_plan(model, layout.plan).styles
    matched = match_plan(model, styles)
    other = "fsdp" if layout.plan.zero == 3 else None
    for name, style in matched.items():
        dim = _TP_DIM.get(style)
        if dim is None:  # region / sequence_parallel: no parameters of their own to split
            continue
        module = model.get_submodule(name)
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.ndim == 2:
            if _is_conv1d(module):  # HF Conv1D stores its weight (in, out)
                dim = 1 - dim
            spec: list[str | None] = [other, other]
            spec[dim] = "tp"
            xs.mark_sharding(weight, layout.mesh, tuple(spec))
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor) and style != "rowwise":
            xs.mark_sharding(bias, layout.mesh, ("tp",))
    return matched


def _shard_output(layout: SPMDLayout) -> Any:
    """FSDPv2's output hook: the first tensor of a block's output split on the data axes (the
    activations FSDP keeps are per data shard); tuples (Hugging Face blocks) included."""
    import torch_xla.distributed.spmd as xs

    def shard(output: Any, mesh: Any) -> None:
        first = output
        while isinstance(first, (tuple, list)) and first:
            first = first[0]
        if isinstance(first, torch.Tensor) and first.ndim:
            xs.mark_sharding(first, mesh, layout.batch_spec(first.ndim))

    return shard


def wrap_fsdpv2(model: nn.Module, layout: SPMDLayout) -> nn.Module:
    """FSDPv2 on each sharding unit (so each unit's parameters are gathered when it runs, not
    all at once) and on the root for the rest. The units are FSDP2's on other devices: the
    repeated blocks, or the modules ``plan.options.shard_patterns`` names (deepest first)."""
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        SpmdFullyShardedDataParallel as FSDPv2,
    )

    from .units import select_units

    kwargs = {"mesh": layout.mesh, "shard_output": _shard_output(layout),
              "extra_data_axis": "dp_replicate"}
    for name, block in select_units(model, layout.plan.options.shard_patterns):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FSDPv2(block, **kwargs))
    return FSDPv2(model, **kwargs)
