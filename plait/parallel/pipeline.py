"""Pipeline parallelism, part 3: the stage runtime, and ``apply_pipeline``, its entry point.

``apply_pipeline`` cuts the model (:mod:`plait.parallel.pipeline_split`), keeps the stages this
rank owns, lays each out with ``parallelize_stage`` and runs them with torch's schedules.

Schedules are torch's (``torch.distributed.pipelining``): GPipe, 1F1B, interleaved 1F1B, looped
BFS, interleaved zero-bubble and ZB-V, with ``PipelineStage`` doing the point-to-point sends.
The loss is divided by the number of microbatches inside the schedule's ``loss_fn`` (torch's
``scale_grads`` is off) so that gradients equal the single-device mean-loss gradients even when
the train step accumulates several pipeline steps.

Each stage module goes through ``parallelize_stage`` (TP/SP, checkpointing, FSDP/DDP) before it
becomes a PipelineStage, so data parallelism composes per stage: torch's stage runtime keeps DDP
in ``no_sync`` for all but the last backward of a step, and drives FSDP2's reduction itself.
The result is a ``PipelinedModel`` whose :class:`plait.parallel.layout.Layout` holds the
stages, their block ranges and the ``PipelineRunner`` the train step calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel as DDP

from .._torch_compat import pipeline_stage_base
from ..mesh import Mesh
from ..plan import Plan
from .layout import Layout, layout_of, record_layout
from .pipeline_split import build_stage_module, check_no_shared_parameters, plan_stages
from .schedules import check_schedule_args, local_stages
from .timeline import Timeline, now

pipeline_stage_base()  # TimedStage overrides a private method: fail clearly if torch changed it


class TimedStage(PipelineStage):
    """A PipelineStage that reports each forward/backward to a Timeline while one records."""

    timeline: Timeline | None = None

    def _prepare_forward_infra(self, *args, **kwargs):  # type: ignore[override]
        # torch 2.13 infers stage shapes by running the submodule once, outside DDP's no_sync.
        # That DDP forward arms the reducer for a backward that never comes, so the first real
        # (no_sync) microbatch backward is recorded for bucket rebuilding too and the second
        # step dies in Reducer._rebuild_buckets ("rebuilt parameter indices size is not same as
        # original model parameters size"). Running the inference under no_sync avoids it.
        if isinstance(self.submod, DDP):
            with self.submod.no_sync():
                return super()._prepare_forward_infra(*args, **kwargs)
        return super()._prepare_forward_infra(*args, **kwargs)

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):  # type: ignore[override]
        start = now()
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if self.timeline is not None:
            self.timeline.add(self.stage_index, "F", fwd_chunk_id, start, now())
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True,  # type: ignore
                           last_backward=False):
        start = now()
        out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                         last_backward=last_backward)
        if self.timeline is not None and self.has_backward:
            self.timeline.add(self.stage_index, "B" if full_backward else "I", bwd_chunk_id,
                              start, now())
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):  # type: ignore
        start = now()
        out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        if self.timeline is not None:
            self.timeline.add(self.stage_index, "W", bwd_chunk_id, start, now())
        return out


_SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B", "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
}


def _rows(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.shape[0]
    if isinstance(x, (tuple, list)) and x:
        return _rows(x[0])
    raise ValueError(f"pipeline inputs must be a tensor or a tuple of tensors, got "
                     f"{type(x).__name__}")


class PipelineRunner:
    """The schedule of this rank's stages; ``step`` runs one optimizer step's worth of it."""

    def __init__(self, stages: list[TimedStage], plan: Plan, rank: int, *,
                 loss_parallel: bool = False):
        self.stages = stages
        self.plan = plan
        self.loss_parallel = loss_parallel
        self.timeline = Timeline(rank=rank)
        for s in stages:
            s.timeline = self.timeline
        self._schedule: Any = None
        self._loss_fn: Callable | None = None
        self._scale = 1.0
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        # Mean over microbatches (and accumulation steps): each microbatch's mean loss divided
        # by their number, so the summed gradients are the whole batch's mean-loss gradients.
        loss = self._loss_fn(output, target)
        if hasattr(loss, "full_tensor"):  # vocabulary-parallel head: a replicated DTensor loss
            loss = loss.full_tensor()
        return loss * self._scale

    def _loss_context(self) -> contextlib.AbstractContextManager:
        """torch's ``loss_parallel()`` around the whole schedule step when this rank's last
        stage has a vocabulary-parallel head (its ``Layout.loss_parallel``): the schedule
        computes the loss, and runs its backward, inside ``step``, so the train step cannot wrap
        them apart."""
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _build_schedule(self) -> Any:
        from torch.distributed.pipelining import schedules

        cls = getattr(schedules, _SCHEDULE_CLASSES[self.plan.pp_schedule])
        m = self.plan.microbatches
        if self.plan.virtual_stages == 1 and self.plan.pp_schedule in ("gpipe", "1f1b"):
            return cls(self.stages[0], m, loss_fn=self._loss, scale_grads=False)
        return cls(self.stages, m, loss_fn=self._loss, scale_grads=False)

    def step(self, batch: Any, loss_fn: Callable, *, plan: Plan,
             device: torch.device) -> torch.Tensor:
        """Forward and backward of ``batch`` through the pipeline; gradients left in ``.grad``.

        Returns the mean loss over the batch on the rank holding the last stage, NaN elsewhere.
        """
        from ..train import autocast

        inputs, targets = batch
        if isinstance(inputs, dict):
            raise ValueError("pipeline inputs are passed from stage to stage positionally: give "
                             "the model a tensor or a tuple of tensors, not a dict")
        rows = _rows(inputs)
        m, accum = plan.microbatches, plan.grad_accum
        if rows % (m * accum):
            raise ValueError(f"batch of {rows} rows does not split into microbatches={m}"
                             + (f" x grad_accum={accum}" if accum > 1 else "")
                             + f" equal parts; make the per-replica batch a multiple of "
                             f"{m * accum}")
        self._loss_fn = loss_fn
        self._scale = 1.0 / (m * accum)
        if self._schedule is None:
            self._schedule = self._build_schedule()
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        total = torch.zeros((), device=device)
        chunk = rows // accum
        for a in range(accum):
            part_args = tuple(x[a * chunk:(a + 1) * chunk] for x in args)
            part_target = targets[a * chunk:(a + 1) * chunk]
            losses: list[torch.Tensor] = []
            with self._loss_context(), autocast(plan, device):
                self._schedule.step(*(part_args if self.has_first else ()),
                                    target=part_target if self.has_last else None,
                                    losses=losses if self.has_last else None,
                                    return_outputs=False)
            if self.has_last:
                total += sum(loss.detach().float() for loss in losses)
            self.timeline.next_step()
        return total if self.has_last else torch.full((), float("nan"), device=device)


class PipelinedModel(nn.Module):
    """This rank's pipeline stages, as one module for the optimizer and the train step.

    ``parameters()`` yields every local stage's parameters. Its
    :func:`~plait.parallel.layout.layout_of` gives the stage modules (their parameter names are
    the full model's), their block ranges, and the ``pipeline`` whose ``step(...)`` runs the
    schedule. Calling the module directly is not a pipeline step and is refused.
    """

    def __init__(self, stage_modules: list[nn.Module]):
        super().__init__()
        self.stages = nn.ModuleList(stage_modules)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipelined model runs through its schedule: call "
                           "run.step(model, batch, loss_fn, opt) (or layout_of(model).pipeline"
                           ".step(batch, loss_fn, plan=..., device=...), from "
                           "plait.parallel.layout)")


def apply_pipeline(model: nn.Module, mesh: Mesh, plan: Plan, *, device: torch.device,
                   parallelize_stage: Callable[..., nn.Module]) -> PipelinedModel:
    """Split ``model`` into ``plan.pp x plan.virtual_stages`` stages, keep this rank's, and
    return them with their schedule, recorded in the returned model's ``Layout``."""
    check_schedule_args(plan.pp_schedule, plan.pp, plan.microbatches, plan.virtual_stages)
    path, specs = plan_stages(model, plan)
    pp_mesh = mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()
    mine = local_stages(plan.pp_schedule, plan.pp, plan.virtual_stages, pp_rank)
    modules = [build_stage_module(model, path, specs[s]) for s in mine]
    check_no_shared_parameters(model, path, specs)
    modules = [parallelize_stage(m, mesh, plan, device=device) for m in modules]
    stages = [TimedStage(m, s, len(specs), device, group=pp_mesh.get_group())
              for m, s in zip(modules, mine, strict=True)]
    # Only the last stage holds the head, so only it can need loss_parallel().
    loss_parallel = any(layout_of(m).loss_parallel
                        for m, s in zip(modules, mine, strict=True) if specs[s].is_last)
    runner = PipelineRunner(stages, plan, rank=torch.distributed.get_rank(),
                            loss_parallel=loss_parallel)
    layout = Layout(applied=("pipeline", *layout_of(modules[0]).applied), stages=tuple(modules),
                    stage_specs=tuple(specs[s] for s in mine), pipeline=runner,
                    loss_parallel=loss_parallel)
    return record_layout(PipelinedModel(modules), layout)
