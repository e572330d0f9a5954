"""Stand-in layouts for ``plait comm`` and the ledger tests, built directly from torch's pieces.

TEMPORARY: plait's own ``plait.parallelize`` (the lead's composition function) is being written
at the same time as the ledger. Once it covers TP/SP, FSDP and PP, ``plait comm`` and
tests/_workers_comm.py should call it instead, so that the ledger measures exactly what plait
issues; ``plait.comm.predict`` documents the layout assumptions these builders make (Megatron
TP with a vocab-parallel embedding and a column-parallel head, FSDP2 per block + root).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def tp_plan(n_layers: int, sp: bool) -> dict:
    """Megatron's layout for the reference model as DTensor styles.

    ``PrepareModuleInput(..., use_local_output=False)`` on attention / feed_forward makes the
    block input one DTensor shared by q/k/v (gate/up): their input gradients are then summed as
    Partial DTensors and reduced *once* per block (Megatron's g operator) instead of once per
    projection. With sp, the residual stream is sharded on the sequence (Shard(1)) and each
    all-reduce becomes an all-gather before and a reduce-scatter after the block.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    for i in range(n_layers):
        p = f"layers.{i}."
        for block, ins, outs in (("attention", ("q_proj", "k_proj", "v_proj"), "o_proj"),
                                 ("feed_forward", ("gate_proj", "up_proj"), "down_proj")):
            plan[p + block] = PrepareModuleInput(input_layouts=(seq,),
                                                 desired_input_layouts=(Replicate(),),
                                                 use_local_output=False)
            for name in ins:
                plan[f"{p}{block}.{name}"] = ColwiseParallel()
            plan[f"{p}{block}.{outs}"] = RowwiseParallel(output_layouts=seq)
        if sp:
            plan[p + "attention_norm"] = SequenceParallel()
            plan[p + "ffn_norm"] = SequenceParallel()
    return plan


def apply_tp(model: nn.Module, mesh: Any, sp: bool) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module
    plan = tp_plan(len(model.layers), sp)
    present = {k: v for k, v in plan.items() if _has(model, k)}
    return parallelize_module(model, mesh["tp"], present)


def apply_fsdp(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    return model


def apply_ddp(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, process_group=mesh["dp_replicate"].get_group())


def split_stage(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Keep this pipeline stage's contiguous blocks (and the ends on the first/last stage)."""
    n = len(model.layers)
    if n % stages:
        raise ValueError(f"{n} layers do not split evenly into pp={stages} stages")
    per = n // stages
    model.layers = nn.ModuleList(list(model.layers)[stage * per:(stage + 1) * per])
    if stage != 0:
        model.tok_embeddings = None
    if stage != stages - 1:
        model.norm = None
        model.output = None
    return model


def local_params(model: nn.Module) -> tuple[int, int]:
    """(parameters this rank holds, those outside the blocks = FSDP2's root unit), counting a
    tensor-parallel DTensor by its local shard: what data parallelism then reduces/gathers."""
    from torch.distributed.tensor import DTensor

    def n(p: torch.Tensor) -> int:
        return p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    blocks = {id(p) for p in model.layers.parameters()}
    params = list(model.parameters())
    return sum(n(p) for p in params), sum(n(p) for p in params if id(p) not in blocks)


def supported(plan: Any) -> None:
    """Raise ValueError for layouts these stand-ins do not build."""
    if plan.pp > 1 and plan.world_size != plan.pp:
        raise ValueError(f"plait comm builds pipelines alone for now (pp={plan.pp} with other "
                         f"axes); use e.g. 'pp=2' until plait.parallelize covers it")
    if plan.dp_replicate > 1 and plan.world_size != plan.dp_replicate:
        raise ValueError("plait comm builds DDP alone for now (dp_replicate with other axes)")
    if plan.zero not in (0, 3):
        raise ValueError(f"plait comm builds ZeRO-3 only for now (zero={plan.zero})")
    if plan.activation_checkpointing != "none" or plan.grad_accum != 1:
        raise ValueError("plait comm: activation checkpointing and grad_accum need plait's "
                         "runtime (not merged here yet)")


def _has(model: nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False


def build(plan: Any, mesh: Any, model: nn.Module, rank: int) -> tuple[nn.Module, Any, int, int]:
    """(model laid out for ``plan``, pipeline schedule or None, params and root params this
    rank's data parallelism handles)."""
    supported(plan)
    if plan.pp > 1:
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe)
        from ..models.transformer import lm_loss
        stage_mod = split_stage(model, rank, plan.pp)
        stage = PipelineStage(stage_mod, rank, plan.pp, torch.device("cpu"),
                              group=mesh["pp"].get_group())
        cls = ScheduleGPipe if plan.pp_schedule == "gpipe" else Schedule1F1B
        if plan.pp_schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"plait comm builds gpipe/1f1b pipelines for now, "
                             f"not {plan.pp_schedule!r}")
        params, root = local_params(stage_mod)
        return (stage_mod, cls(stage, n_microbatches=plan.microbatches, loss_fn=lm_loss),
                params, root)
    if plan.tp > 1:
        model = apply_tp(model, mesh, plan.sp)
    params, root = local_params(model)
    if plan.zero == 3:
        model = apply_fsdp(model, mesh)
    elif plan.dp_replicate > 1:
        model = apply_ddp(model, mesh)
    return model, None, params, root
