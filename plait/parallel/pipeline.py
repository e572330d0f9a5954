"""Pipeline parallelism, part 3: the stage runtime, and ``apply_pipeline``, its entry point.

``apply_pipeline`` cuts the model (:mod:`plait.parallel.pipeline_split`), keeps the stages this
rank owns, lays each out with ``parallelize_stage`` and runs them with torch's schedules.

Schedules are torch's (``torch.distributed.pipelining``): GPipe, 1F1B, interleaved 1F1B, looped
BFS, interleaved zero-bubble and ZB-V, with ``PipelineStage`` doing the point-to-point sends.
Backward runs on each microbatch's loss *sum* (torch's ``scale_grads`` is off); the step
returns the (sum, count) of its microbatches and the train step divides the gradients by the
global count of items once (``plait.loss``), so a mean over a variable number of tokens per
microbatch is the single-device mean, with accumulation over several pipeline steps too. The
schedule is given row indices as its target and the real targets (any structure: a tensor, a
tuple, a dict) are looked up per microbatch, since torch's schedules split tensor targets only.

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
from ..loss import loss_sum_and_count
from ..mesh import Mesh
from ..plan import Plan
from .layout import Layout, layout_of, record_layout
from .pipeline_split import build_stage_module, plan_stages, shared_parameters
from .schedules import check_schedule_args, local_stages, stage_to_rank
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
        self._targets: Any = None  # this accumulation step's targets (any structure)
        # [loss sum, count] per (accumulation step, microbatch's first row): torch's stage also
        # calls the loss once on its shape-inference outputs, which the real call replaces.
        self._totals: dict[tuple[int, int], torch.Tensor] = {}
        self._accum_index = 0
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        # Tied weights held by several stages: (this rank's copy, the group of ranks holding
        # the copies); see sync_tied_gradients.
        self.tied: list[tuple[nn.Parameter, Any]] = []

    def _loss(self, output: Any, rows: torch.Tensor) -> torch.Tensor:
        """The schedule's loss for one microbatch. torch's schedules split a *tensor* target
        into microbatches, so they are given the row indices and the real targets (a tensor,
        tuple or dict) are looked up here. Backward runs on the microbatch's loss *sum*; the
        train step divides the gradients by the global count of items (``plait.loss``)."""
        assert self._loss_fn is not None
        target = _take_rows(self._targets, rows)
        total, count = loss_sum_and_count(self._loss_fn(output, target), target)
        key = (self._accum_index, int(rows[0]))
        self._totals[key] = torch.stack([total.detach().float(), count.float()])
        return total

    def sync_tied_gradients(self) -> None:
        """A weight several stages hold (embedding = head) gets its gradient in pieces, one per
        stage that uses it; summing them over the ranks holding the copies gives every copy the
        one-device gradient, so the copies, equal at the start, stay equal (Megatron's
        embedding group). Copies sharded by TP or FSDP are sharded alike: their local shards
        are summed."""
        for param, group in self.tied:
            grad = param.grad
            if grad is None:
                grad = param.grad = torch.zeros_like(param)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            torch.distributed.all_reduce(local, group=group)

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

        Returns ``[loss sum, item count]`` over the batch on the rank holding the last stage,
        NaN elsewhere (see ``plait.train.forward_backward``).
        """
        from ..train import autocast, split_microbatches

        if loss_fn is None:
            raise ValueError("a pipeline computes the loss on its last stage from the model's "
                             "output: pass a loss_fn (the model's own output.loss is not "
                             "available under pp > 1)")
        if isinstance(batch, dict) or not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError("a pipeline step takes (inputs, targets); inputs are passed from "
                             "stage to stage positionally (a tensor or a tuple of tensors)")
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
        self._totals = {}
        if self._schedule is None:
            self._schedule = self._build_schedule()
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        chunk = rows // accum
        for a, (part_args, part_targets) in enumerate(zip(
                split_microbatches(args, accum), split_microbatches(targets, accum), strict=True)):
            self._targets, self._accum_index = part_targets, a
            index = torch.arange(chunk, device=device)
            with self._loss_context(), autocast(plan, device):
                self._schedule.step(*(part_args if self.has_first else ()),
                                    target=index if self.has_last else None,
                                    losses=[] if self.has_last else None,
                                    return_outputs=False)
            self.timeline.next_step()
        self._targets = None
        self.sync_tied_gradients()
        if not self.has_last:
            return torch.full((2,), float("nan"), device=device)
        return torch.stack(list(self._totals.values())).sum(0).to(device)


def _take_rows(value: Any, rows: torch.Tensor) -> Any:
    """The rows ``rows`` (dim 0) of every tensor in a tensor/tuple/list/dict structure."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, rows.to(value.device))
    if isinstance(value, dict):
        return {k: _take_rows(v, rows) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_take_rows(v, rows) for v in value)
    return value


def _tie_groups(ties: list[dict[int, str]], mesh: Mesh, plan: Plan) -> list[Any]:
    """Per tie, the process group of this rank's peers holding the other copies: the pp ranks
    of the stages involved, at this rank's data/tensor coordinate. ``dist.new_group`` is
    collective, so every rank creates every coordinate's group, in the same order."""
    owner = stage_to_rank(plan.pp_schedule, plan.pp, plan.virtual_stages)
    ranks = mesh.root.mesh  # (pp, dp_replicate, dp_shard, cp, tp) -> global rank
    me = torch.distributed.get_rank()
    groups = []
    for names in ties:
        pp_ranks = sorted({owner[s] for s in names})
        if len(pp_ranks) == 1:
            stages = ", ".join(str(s) for s in sorted(names))
            raise ValueError(f"weight {next(iter(names.values()))} is tied across stages "
                             f"{stages}, which schedule {plan.pp_schedule} puts on one rank; "
                             f"untie it (e.g. tie_word_embeddings=False) or use 1f1b or "
                             f"interleaved_1f1b")
        mine = None
        for coord in ranks[0].reshape(-1).tolist():
            index = (ranks[0] == coord).nonzero()[0].tolist()
            members = [int(ranks[(p, *index)]) for p in pp_ranks]
            group = torch.distributed.new_group(members)
            if me in members:
                mine = group
        groups.append(mine)
    return groups


def _local_ties(ties: list[dict[int, str]], groups: list[Any], local: dict[int, nn.Module]
                ) -> list[tuple[nn.Parameter, Any]]:
    """This rank's copies of the tied weights (after parallelize_stage), with their groups.
    The copies on stages other than the first holding the weight are marked, so the gradient
    norm counts the weight once."""
    out = []
    for names, group in zip(ties, groups, strict=True):
        first = min(names)
        for stage, name in names.items():
            if stage in local and group is not None:
                param = _param_named(local[stage], name)
                if stage != first:
                    param._plait_tied_copy = True  # type: ignore[attr-defined]
                out.append((param, group))
    return out


def _param_named(module: nn.Module, name: str) -> nn.Parameter:
    """The parameter ``name`` (a name in the unwrapped stage) of a laid-out stage module."""
    from ..check import canonical_name

    for n, p in module.named_parameters(remove_duplicate=False):
        if canonical_name(n) == name:
            return p
    raise ValueError(f"tied weight {name} not found in its pipeline stage after layout")


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
    ties = shared_parameters(model, path, specs)
    groups = _tie_groups(ties, mesh, plan)  # collective: every rank creates every group
    modules = [parallelize_stage(m, mesh, plan, device=device) for m in modules]
    stages = [TimedStage(m, s, len(specs), device, group=pp_mesh.get_group())
              for m, s in zip(modules, mine, strict=True)]
    # Only the last stage holds the head, so only it can need loss_parallel().
    loss_parallel = any(layout_of(m).loss_parallel
                        for m, s in zip(modules, mine, strict=True) if specs[s].is_last)
    runner = PipelineRunner(stages, plan, rank=torch.distributed.get_rank(),
                            loss_parallel=loss_parallel)
    runner.tied = _local_ties(ties, groups, dict(zip(mine, modules, strict=True)))
    layout = Layout(applied=("pipeline", *layout_of(modules[0]).applied), stages=tuple(modules),
                    stage_specs=tuple(specs[s] for s in mine), pipeline=runner,
                    loss_parallel=loss_parallel)
    return record_layout(PipelinedModel(modules), layout)
