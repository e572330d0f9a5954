"""The one place where parallelisms are composed, and in which order.

Order matters and is fixed here:

1. **Pipeline split** first: it decides which blocks live on this rank; everything after works
   on the stage modules only (no full model is kept per rank).
2. **Tensor / sequence parallel** next: it replaces parameters by DTensors sharded on the ``tp``
   axis, inside each stage.
3. **Activation checkpointing** wraps whole blocks after TP so that recomputation replays the
   TP collectives too (and before FSDP, so FSDP's hooks stay outside the checkpointed region).
   **Compile** (``plan.compile``) then compiles each block's forward, the hooks left eager.
4. **Data parallel last** — FSDP2 (ZeRO / HSDP) over ``dp_shard`` (x ``dp_replicate``), or DDP
   over ``dp_replicate``: it must see the final parameters (DTensors from TP included) to shard
   or bucket them. Context parallelism (``cp``) changes no module: its ranks join the data
   ranks here (FSDP2 over ``dp_shard x cp``, beside TP too; DDP over ``dp x cp``, under ZeRO-1
   with the optimizer state over ``dp_shard x cp``; or for TP's DTensors FSDP2's replicate over
   ``dp x cp``), and the train step (a pipeline's runner, for every stage) splits each sequence
   over them (``plait.parallel.context``).

Each step is a plain function in ``plait.parallel``; a step whose axis has degree 1 is skipped.
What ran is recorded on the returned model as one typed ``Layout``
(:mod:`plait.parallel.layout`), which the train step and the reports read.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .mesh import Mesh
from .parallel.layout import Layout, layout_of, record_layout
from .parallel.tp_example import Example, from_batch
from .plan import Plan, reduces_after_schedule


def parallelize(model: nn.Module, mesh: Mesh, plan: Plan, *, device: torch.device,
                say: Callable[[str], None] | None = None, example: Any = None) -> nn.Module:
    """Return ``model`` laid out for ``plan`` on ``mesh``, on ``device``. What the layout
    decided that the user should know (an inferred tensor-parallel plan) is told through
    ``say``; by default it is printed on rank 0's stderr. ``example``: one batch as
    ``run.step`` receives it, which the checks that run the model before training (an
    inferred tensor-parallel plan, sequence parallelism, a pipeline's split) run on in place
    of an input they guess (:func:`plait.parallel.tp_example.from_batch`).

    The model must be built identically on every rank (same seed): plait does not broadcast
    initial weights except where DDP does so itself.
    """
    given = None if example is None else from_batch(model, example)
    parts = plan.grad_accum * (plan.microbatches if plan.pp > 1 else 1)
    if parts > 1:
        from .parallel.batchnorm import warn_microbatched

        why = " x ".join(f"{k}={v}" for k, v in (("microbatches", plan.microbatches),
                                                   ("grad_accum", plan.grad_accum))
                         if v > 1 and (k != "microbatches" or plan.pp > 1))
        warn_microbatched(model, parts, why)
    if plan.pp > 1:
        from .parallel.pipeline import apply_pipeline

        # The pipeline applies steps 2-4 to each of its stage modules itself (it calls back into
        # parallelize_stage), since the stage boundary changes what "the model" is.
        return apply_pipeline(model, mesh, plan, device=device, say=say, example=given,
                              parallelize_stage=partial(parallelize_stage, say=say))
    return parallelize_stage(model, mesh, plan, device=device, say=say, example=given)


def parallelize_stage(module: nn.Module, mesh: Mesh, plan: Plan, *, device: torch.device,
                      say: Callable[[str], None] | None = None,
                      example: Example | None = None) -> nn.Module:
    """Steps 2-4 (TP/SP, checkpointing, data parallel) on one module or pipeline stage;
    ``example``: the forward's arguments an inferred tensor-parallel plan is checked on."""
    from .parallel.placement import to_device_keeping_ties

    module = to_device_keeping_ties(module, device)
    applied: list[str] = []
    loss_parallel = False
    if plan.dp > 1:
        # BatchNorm first: its replacement keeps the parameters that TP/FSDP then lay out.
        from .parallel.batchnorm import apply_sync_bn, warn_unsynced

        if plan.sync_bn:
            module = apply_sync_bn(module, mesh["dp"].get_group(), device.type)
        else:
            warn_unsynced(module, plan)
    if plan.tp > 1:
        from .parallel.tensor import apply_tensor_parallel

        module = apply_tensor_parallel(module, mesh, plan, say,
                                       None if example is None else example.to(device))
        applied.append("tensor_parallel")
        loss_parallel = layout_of(module).loss_parallel
    if plan.activation_checkpointing != "none":
        from .parallel.checkpointing import apply_activation_checkpointing

        module = apply_activation_checkpointing(module, plan)
        applied.append("activation_checkpointing")
    if plan.compile:
        from .parallel.compile import apply_compile

        module = apply_compile(module, plan)  # blocks laid out, data-parallel hooks not yet
        applied.append("compile")
    if reduces_after_schedule(plan):
        # A zero-bubble schedule's weight gradients come in a later autograd.grad that DDP's
        # reducer never sees: the pipeline averages them over the data (and cp) ranks after
        # the schedule (sync_data_gradients); ZeRO-1's optimizer is sharded as ever.
        pass
    elif plan.zero > 0:
        from .parallel.zero import apply_fsdp

        module = apply_fsdp(module, mesh, plan)
        applied.append("zero")
    elif plan.cp > 1 and plan.tp > 1:
        # The same sum over dp x cp for TP's DTensor parameters, which DDP cannot take.
        from .parallel.zero import apply_replicate_cp

        module = apply_replicate_cp(module, mesh, plan)
        applied.append("replicate")
    elif plan.cp > 1:
        # Context-parallel ranks compute partial gradients of the same parameters: DDP sums
        # them over the data and cp ranks together (dp_cp), as it averages over replicas.
        from .mesh import DP_CP
        from .parallel.data import apply_ddp

        module = apply_ddp(module, mesh[DP_CP], device=device, find_unused=plan.find_unused)
        applied.append("ddp")
    elif plan.dp_replicate > 1:
        if plan.tp > 1:
            # DDP cannot bucket DTensor parameters; replicated DP over TP shards goes through
            # FSDP2's replicate path instead.
            from .parallel.zero import apply_replicate

            module = apply_replicate(module, mesh, plan)
            applied.append("replicate")
        else:
            from .parallel.data import apply_ddp

            module = apply_ddp(module, mesh["dp_replicate"], device=device,
                               find_unused=plan.find_unused)
            applied.append("ddp")
    context = None
    if plan.cp > 1:
        from .parallel.context import context_group

        context = context_group(module, mesh)
        applied.append("context_parallel")
    running_stats = None
    if (plan.dp > 1 or plan.cp > 1) and not plan.sync_bn and not isinstance(
            module, DistributedDataParallel):
        # FSDP2 keeps each data (and cp) rank's BatchNorm statistics; DDP broadcasts rank 0's.
        from .mesh import DP_CP
        from .parallel.bn_running import track_running_stats

        running_stats = track_running_stats(
            module, mesh[DP_CP if plan.cp > 1 else "dp"].get_group(),
            sharded=plan.dp_shard * plan.cp > 1)
    written_buffers = None
    ddp = isinstance(module, DistributedDataParallel)
    if (plan.dp > 1 or plan.cp > 1) and (not ddp or plan.pp > 1):
        # DDP broadcasts rank 0's buffers before each step's forward (over dp x cp under cp);
        # FSDP2 keeps each rank's. So does DDP in a pipeline stage: torch's stage runs every
        # forward under no_sync (PipelineStage.forward_maybe_with_nosync), and a forward
        # under no_sync turns DDP's broadcast off for the next one, so it never runs; plait
        # broadcasts them instead, BatchNorm's statistics too, as DDP would.
        from .mesh import DP_CP
        from .parallel.buffer_sync import track_written_buffers

        written_buffers = track_written_buffers(
            module, mesh[DP_CP if plan.cp > 1 else "dp"].get_group(), norms=ddp)
    return record_layout(module, Layout(applied=tuple(applied), loss_parallel=loss_parallel,
                                        context=context, running_stats=running_stats,
                                        written_buffers=written_buffers))
