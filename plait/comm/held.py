"""The ledger's prediction for any model under data parallelism: DDP, ZeRO-1/2/3 and HSDP.

Data-parallel traffic does not depend on the architecture, only on what each rank holds once
plait has laid the model out, so it is read off the laid-out model itself (``held_model``):

* DDP (``dp_replicate``; ZeRO-1 over the flattened ``dp`` axis) all-reduces the gradients of the
  parameters that require grad, each tensor once however many names it has (a tied embedding
  and head), in buckets whose payload is those gradients' bytes, once per optimizer step
  (``no_sync`` while accumulating); the buckets are filled in the order the gradients became
  ready in the run (``plait.comm.ready_order``), which sets how many there are. Before the
  first forward of each step it broadcasts the module's buffers from rank 0
  (``broadcast_buffers``, torch's default).
* ZeRO-1's ``ZeroRedundancyOptimizer`` broadcasts every parameter its optimizer holds from the
  rank that updated it, on ``dp_shard``: frozen ones too, when the optimizer was given them.
* FSDP2 (ZeRO-2/3, HSDP) moves flat buffers per unit (a module ``fully_shard`` made an
  ``FSDPModule``), each parameter at its padded size: dim 0 rounded up to a multiple of the
  shard count (a Linear with 7 outputs is gathered as 8 rows at ``dp_shard=2`` or 4). The
  all-gather holds every parameter of the unit, frozen ones too, in the dtype it computes in
  (``mixed_precision=bf16``: bf16); the reduce-scatter only those that require grad (FSDP2
  reduces the gradients that exist), in fp32. A unit FSDP2 reshards after forward (ZeRO-3's
  units, not its root) is gathered again for backward where the backward pass reaches it or
  the unit after it; every unit once per micro-step, the gradients reduced once per optimizer
  step. HSDP all-reduces the reduce-scattered shard over
  ``dp_replicate``. The sizes and dtypes are FSDP2's own (``_torch_compat.fsdp_param_groups``),
  not re-derived.
* Gradient clipping under ZeRO-2/3: ``get_total_norm`` over the DTensor gradients all-reduces
  one fp32 norm per gradient tensor on ``dp_shard``.

Assumed, as for every closed form here: each forward calls every unit once, the blocks one
after the other. Under ZeRO-3 a block the backward pass never reaches (frozen, after a frozen
embedding and frozen blocks only) is gathered again only when the next one is reached and
prefetches it (``plait.comm.reach``): a frozen first block after a frozen embedding is, the
first of two frozen blocks is not.
* ``sync_bn`` on a device torch's ``SyncBatchNorm`` does not run on (the CPU:
  ``plait.parallel.batchnorm.DataSyncBatchNorm``): per layer and micro-step, two fp32
  all-reduces over the data axes in forward (the channel sums with the row count, C + 1
  values, then the C sums of squared deviations) and the same two in backward, assuming the
  layer's input needs a gradient (a BatchNorm on the raw input, with nothing trainable before
  it, runs no backward all-reduce). Collectives the model issues itself (torch's
  ``SyncBatchNorm`` on CUDA, its own ``torch.distributed`` calls) are not predicted. Tensor and
pipeline parallelism move activations, whose sizes need the model's shapes: those layouts are
predicted for plait's reference transformer only (``plait.comm.predict``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .predict import FP32, _dp_axis, _ledger_axis
from .reach import reached, regathered
from .volumes import Traffic, ddp_bucket_calls, ddp_bucket_calls_any_order


@dataclass(frozen=True)
class ShardUnit:
    """One FSDP2 unit's parameter group as this rank holds it.

    ``gather_bytes``: one all-gather's output, every parameter's padded shard times the shard
    count in the dtype it is gathered in; ``reduce_bytes``: one reduce-scatter's input, the same
    padded sizes for the parameters that require grad, in the reduce dtype; ``shards``: the
    shard count; ``regathered``: resharded after forward and gathered again for backward (the
    backward pass reaches it or prefetches it).
    """

    gather_bytes: int
    reduce_bytes: int
    shards: int
    regathered: bool


@dataclass(frozen=True)
class HeldModel:
    """What one rank holds of any model laid out for data parallelism.

    ``grad_bytes``: bytes of the parameters that require grad, each tensor once (DDP's
    buckets); ``update_bytes``: bytes of the parameters the optimizer updates (what ZeRO-1
    broadcasts); ``buffer_bytes``: buffers DDP broadcasts before a step's first forward (0 when
    it does not); ``grad_tensors``: gradient tensors (clipping reduces one norm each);
    ``units``: FSDP2's units (empty under DDP).
    """

    grad_bytes: int
    update_bytes: int
    buffer_bytes: int
    grad_tensors: int
    units: tuple[ShardUnit, ...] = ()
    # Channels of each BatchNorm layer plait synchronises itself (DataSyncBatchNorm)
    sync_bn_features: tuple[int, ...] = ()
    # Calls behind the bytes: DDP's all-reduces (one per bucket, ``ddp_bucket_calls``), its
    # buffer broadcasts (one per dtype, each under DDP's 250 MiB broadcast bucket) and
    # ZeroRedundancyOptimizer's (one per parameter tensor it updates); None: not known
    grad_calls: int | None = 1
    buffer_calls: int | None = 1
    update_tensors: int = 1
    # Under find_unused_parameters DDP all-reduces which parameters each rank used, one int32
    # per gradient tensor, once a step: this map's bytes (0 otherwise)
    used_map_bytes: int = 0


def _nbytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct tensors (a tied weight counts once)."""
    seen: dict[int, int] = {}
    for p in params:
        seen.setdefault(id(p), p.numel() * p.element_size())
    return sum(seen.values())


def fsdp_padded_numels(model: nn.Module) -> dict[int, int]:
    """Elements FSDP2 gathers and reduce-scatters for each parameter it shards in ``model``,
    by ``id`` of the parameter as ``model.parameters()`` yields it: FSDP2's own padded shard
    (dim 0 cut by ``torch.chunk``, every shard padded to the first) times the shard count,
    the tensor-parallel-local piece beside tp."""
    from torch.distributed.fsdp import FSDPModule

    from .._torch_compat import fsdp_param_groups

    out = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in fsdp_param_groups(module, dtypes=False):
                shards = getattr(group.mesh_info, "shard_mesh_size", 1)  # replicate: 1
                for fp in group.fsdp_params:
                    out[id(fp.sharded_param)] = fp.padded_sharded_param_size.numel() * shards
    return out


def stack_input_grad(model: nn.Module, device_type: str = "cpu") -> bool | None:
    """Whether the input of the first block of ``model``'s stack (before layout) needs a
    gradient, read off a forward pass on fake tensors (``plait.planner.tp_trace.needs_grad``):
    a trainable gain on a frozen embedding's output makes it so although no embedding trains.
    None where every parameter trains, the model has no stack of blocks or the pass cannot
    run (then an embedding that trains says it, :func:`shard_units`)."""
    from ..parallel.pipeline_split import find_blocks
    from ..planner.tp_trace import needs_grad

    if all(p.requires_grad for p in model.parameters()):
        return None
    try:
        path, stack = find_blocks(model)
    except ValueError:
        return None
    key = next(name for name, _ in stack.named_children())
    first = f"{path}.{key}" if path else key
    got = needs_grad(model, [first], [], device_type=device_type)
    return None if got is None else got[0][first]


def shard_units(model: nn.Module, input_grad: bool | None = None) -> tuple[ShardUnit, ...]:
    """FSDP2's units in ``model``, read off FSDP2's own state (padded shard sizes, dtypes,
    whether it reshards after forward), one per parameter group. ``input_grad``: whether the
    first block's input needs a gradient (:func:`stack_input_grad`); None: where an embedding
    trains."""
    from torch.distributed.fsdp import FSDPModule

    from .._torch_compat import fsdp_param_groups

    groups = [group for module in model.modules() if isinstance(module, FSDPModule)
              for group in fsdp_param_groups(module)]
    # the units resharded after forward (ZeRO-3's blocks, in forward order): the backward pass
    # gathers again those it reaches or prefetches (plait.comm.reach)
    chain = [g for g in groups if g.post_forward_mesh_info is not None]
    embeds = [p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()]
    if input_grad is None:
        input_grad = any(p.requires_grad for p in embeds) or not embeds
    reach = reached(input_grad,
                    [any(fp.sharded_param.requires_grad for fp in g.fsdp_params) for g in chain])
    again = {id(g) for g, yes in zip(chain, regathered(reach), strict=True) if yes}
    units = []
    for group in groups:
        shards = group.mesh_info.shard_mesh_size
        gather = reduce = 0
        for fp in group.fsdp_params:
            numel = fp.padded_sharded_param_size.numel() * shards
            gather += numel * (fp.param_dtype or fp.orig_dtype).itemsize
            if fp.sharded_param.requires_grad:
                reduce_dtype = fp.reduce_dtype or fp.param_dtype or fp.orig_dtype
                reduce += numel * reduce_dtype.itemsize
        units.append(ShardUnit(gather_bytes=gather, reduce_bytes=reduce, shards=shards,
                               regathered=id(group) in again))
    return tuple(units)


def held_model(model: nn.Module, optimizer_params: Iterable[torch.Tensor] | None = None,
               input_grad: bool | None = None,
               ready_order: Sequence[int] | None = None) -> HeldModel:
    """Read a ``HeldModel`` off a model ``plait.parallelize`` returned (DDP-wrapped, FSDP2 or
    plain). ``optimizer_params``: what the optimizer updates (ZeRO-1 broadcasts exactly those);
    by default the parameters that require grad. ``input_grad``: :func:`stack_input_grad` of
    the model before layout. ``ready_order``: under DDP, the order its gradients became ready
    in its first reducing backward (``plait.comm.ready_order``, indices into
    ``ready_order.ddp_parameters``); without it DDP's bucket count is known only where every
    order gives the same one."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .ready_order import ddp_parameters

    trainable = [p for p in model.parameters() if p.requires_grad]
    buffers = 0
    buffer_calls: int | None = 1
    grad_calls: int | None = 1
    used_map = 0
    if isinstance(model, DDP):
        # DDP rebuilds its buckets after the first step in the order the gradients became
        # ready, which only the run shows (a head registered before the body, a reused module
        # or a branchy forward make it other than the parameters' reversed); under
        # find_unused_parameters it never rebuilds, keeping the buckets it filled in the
        # parameters' order
        params = ddp_parameters(model)
        sizes = [(str(p.dtype), float(p.numel() * p.element_size())) for p in params]
        if model.find_unused_parameters:
            used_map = 4 * len(params)
            grad_calls = ddp_bucket_calls(sizes, model.bucket_bytes_cap)
        elif ready_order is not None and sorted(ready_order) == list(range(len(params))):
            grad_calls = ddp_bucket_calls([sizes[i] for i in ready_order],
                                          model.bucket_bytes_cap)
        else:
            grad_calls = ddp_bucket_calls_any_order(sizes, model.bucket_bytes_cap)
        if model.broadcast_buffers:
            ignored: set[str] = getattr(model, "parameters_to_ignore", set())
            bufs = [b for n, b in model.module.named_buffers() if n not in ignored]
            buffers = _nbytes(bufs)
            kinds: dict[str, int] = {}
            for b in {id(b): b for b in bufs}.values():
                kinds[str(b.dtype)] = kinds.get(str(b.dtype), 0) + b.numel() * b.element_size()
            buffer_calls = len(kinds) if all(
                v <= model.broadcast_bucket_size for v in kinds.values()) else None
    from ..parallel.batchnorm import DataSyncBatchNorm

    updated = list(optimizer_params) if optimizer_params is not None else trainable
    synced = tuple(m.num_features for m in model.modules() if isinstance(m, DataSyncBatchNorm))
    return HeldModel(grad_bytes=_nbytes(trainable), update_bytes=_nbytes(updated),
                     buffer_bytes=buffers, grad_tensors=len({id(p) for p in trainable}),
                     units=shard_units(model, input_grad), sync_bn_features=synced,
                     grad_calls=grad_calls, buffer_calls=buffer_calls,
                     update_tensors=max(1, len({id(p) for p in updated})),
                     used_map_bytes=used_map)


def held_traffic(plan: Any, held: HeldModel) -> list[Traffic]:
    """Data-parallel traffic of one rank in one optimizer step of ``plan`` (no tp, no pp).
    Under context parallelism the cp ranks reduce gradients with the data ranks: DDP over
    dp x cp (``dp_cp``, or ``cp`` itself at dp=1), FSDP2 over dp_shard x cp
    (``dp_shard_cp``); the K/V collectives are the model's shapes' to say
    (``plait.planner.cost.cp_step_traffic``)."""
    if plan.tp > 1 or plan.pp > 1:
        raise ValueError(f"held_traffic predicts data parallelism alone; tp={plan.tp}, "
                         f"pp={plan.pp} move activations (plait.comm.predict)")
    R, S, cp, accum = plan.dp_replicate, plan.dp_shard, plan.cp, plan.grad_accum
    out: list[Traffic] = []
    if plan.zero <= 1 and R * S * cp > 1:
        axis = _ledger_axis(plan, ("dp_replicate", "dp_shard", "cp")) if cp > 1 else \
            _dp_axis(plan)
        out.append(Traffic(axis, "all_reduce", float(held.grad_bytes), held.grad_calls or 1,
                           R * S * cp, "grads", calls_known=held.grad_calls is not None))
        if held.used_map_bytes:
            out.append(Traffic(axis, "all_reduce", float(held.used_map_bytes), 1, R * S * cp,
                               "used parameters (find_unused)"))
        if held.buffer_bytes:
            out.append(Traffic(axis, "broadcast", float(held.buffer_bytes),
                               held.buffer_calls or 1, R * S * cp, "buffers (DDP)",
                               calls_known=held.buffer_calls is not None))
        if plan.zero == 1:
            out.append(Traffic("dp_shard", "broadcast", float(held.update_bytes),
                               held.update_tensors, S, "params (ZeroRedundancyOptimizer)"))
    elif plan.zero >= 2:
        shard = _ledger_axis(plan, ("dp_shard", "cp"))
        for unit in held.units:
            if unit.reduce_bytes:
                out.append(Traffic(shard, "reduce_scatter", float(unit.reduce_bytes), 1,
                                   S * cp, "grads"))
                if R > 1:  # HSDP: the reduce-scattered shard, all-reduced across replicas
                    out.append(Traffic("dp_replicate", "all_reduce",
                                       float(unit.reduce_bytes) / unit.shards, 1, R, "grads"))
            gathers = (2 if unit.regathered else 1) * accum
            out.append(Traffic(shard, "all_gather", float(unit.gather_bytes) * gathers,
                               gathers, S * cp, "params"))
        if plan.grad_clip:
            out.append(Traffic(shard, "all_reduce", float(held.grad_tensors) * FP32, 1, S * cp,
                               "clip: per-tensor norms"))
    if held.sync_bn_features and R * S > 1:
        # forward and backward each: (C + 1) and C values, per layer and micro-step
        values = sum(2 * (2 * c + 1) for c in held.sync_bn_features) * accum
        out.append(Traffic(_ledger_axis(plan, ("dp_replicate", "dp_shard")), "all_reduce",
                           float(values) * FP32, 4 * len(held.sync_bn_features) * accum, R * S,
                           "sync_bn statistics"))
    return out
