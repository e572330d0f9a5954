"""Pipeline parallelism for any model whose repeated blocks form a sequence.

The model is taken as it is: no LayerSpec rewrite, no tracing. plait finds the sequence of
blocks (the ``nn.ModuleList`` / ``nn.Sequential`` holding most of the parameters, e.g.
``model.layers``), cuts it into ``pp x virtual_stages`` contiguous stages, and builds for each
stage this rank owns a *stage module*: a shallow copy of the model in which

* blocks of other stages are replaced by ``PipelineSkip`` (a parameter-free pass-through), so the
  kept blocks keep their canonical names (``layers.3.attention.q_proj.weight``) for checkpoints,
  TP plans and ``plait check``;
* modules registered before the block sequence (embeddings) stay on the first stage only, those
  after it (final norm, head) on the last stage only; elsewhere they are skipped too. Modules
  without parameters (activations, rotary tables) stay everywhere.

The model's own ``forward`` then runs unchanged on each stage: a skipped embedding passes the
previous stage's hidden states through, skipped blocks do nothing, a skipped head returns the
hidden states to send on. This works for any forward that chains its modules (the reference
transformer, a Sequential MLP or CNN); models whose forward feeds a module something other than
the running activation (HF decoders' position embeddings and masks) need an adapter.

Stages are cut by parameter count (embedding on the first stage and head on the last count
too), or by per-block costs (``options.stage_costs``), or at user-named split points
(``options.split_points = ("layers.4", "layers.8")``: a stage starts at each name), or
by blocks per stage (``options.pp_stage_layers = (3, 5)``, what the planner emits when
its cost-balanced split is uneven).

Schedules are torch's (``torch.distributed.pipelining``): GPipe, 1F1B, interleaved 1F1B, looped
BFS, interleaved zero-bubble and ZB-V, with ``PipelineStage`` doing the point-to-point sends.
The loss is divided by the number of microbatches inside the schedule's ``loss_fn`` (torch's
``scale_grads`` is off) so that gradients equal the single-device mean-loss gradients even when
the train step accumulates several pipeline steps.

Each stage module goes through ``parallelize_stage`` (TP/SP, checkpointing, FSDP/DDP) before it
becomes a PipelineStage, so data parallelism composes per stage: torch's stage runtime keeps DDP
in ``no_sync`` for all but the last backward of a step, and drives FSDP2's reduction itself.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel as DDP

from .._torch_compat import is_view, pipeline_stage_base
from ..mesh import Mesh
from ..plan import Plan
from .schedules import check_schedule_args, local_stages
from .timeline import Timeline, now

Containers = (nn.ModuleList, nn.Sequential)


class PipelineZero(nn.Module):
    """Stands in, on stages after the first, for an HF position embedding whose output the
    decoder adds to ``inputs_embeds``: the hidden states received already contain it."""

    plait_pipeline_skip = True

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return torch.zeros((), device=x.device)


class PipelineSkip(nn.Module):
    """Stands in for a module another stage owns: returns its first input unchanged."""

    # Read by later composition steps (tensor parallelism) to leave it alone: a layer plan's
    # "output: vocab_head" still names it on stages that do not own the head.
    plait_pipeline_skip = True

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


# ----------------------------------------------------------------------------- splitting
@dataclass(frozen=True)
class StageSpec:
    """Global stage ``index`` holds blocks ``start`` .. ``end - 1`` of the block sequence."""

    index: int
    start: int
    end: int
    num_stages: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def find_blocks(model: nn.Module, name: str | None = None) -> tuple[str, nn.Module]:
    """The block sequence: ``name`` if given, else the ModuleList/Sequential with >= 2 children
    holding the most parameters (the shallowest on ties; the model itself if it is one)."""
    if name is not None:
        try:
            container = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"options.pp_blocks={name!r} is not a submodule of "
                             f"{type(model).__name__}") from None
        if not isinstance(container, Containers):
            raise ValueError(f"options.pp_blocks={name!r} is a {type(container).__name__}, "
                             f"not an nn.ModuleList or nn.Sequential of blocks")
        return name, container
    best: tuple[int, int, str, nn.Module] | None = None
    for mod_name, module in model.named_modules():
        if isinstance(module, Containers) and len(module) >= 2:
            n_params = sum(p.numel() for p in module.parameters())
            key = (n_params, -mod_name.count(".") - (mod_name != ""))
            if best is None or key > best[:2]:
                best = (*key, mod_name, module)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList or nn.Sequential of "
                         f"blocks to split into pipeline stages; put the repeated blocks in one "
                         f"(e.g. self.layers = nn.ModuleList(...)) or run with pp=1")
    return best[2], best[3]


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _side_modules(model: nn.Module, path: str) -> tuple[list[nn.Module], list[nn.Module]]:
    """Modules registered before / after the block sequence along its path from the root."""
    before, after = [], []
    module = model
    for part in path.split(".") if path else []:
        seen = False
        for child_name, child in module.named_children():
            if child_name == part:
                seen = True
            elif child is not None:
                (after if seen else before).append(child)
        module = getattr(module, part)
    return before, after


def partition(costs: list[float], n_stages: int, first_extra: float = 0.0,
              last_extra: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous split of ``costs`` into ``n_stages`` non-empty parts minimising the largest
    part (``first_extra``/``last_extra`` are added to the first/last part)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def part_cost(k: int, i: int, j: int) -> float:
        extra = (first_extra if k == 0 else 0.0) + (last_extra if k == n_stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    # best[k][j]: smallest max-part cost splitting blocks [0, j) into k + 1 parts.
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = part_cost(0, 0, j)
    for k in range(1, n_stages):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                value = max(best[k - 1][i], part_cost(k, i, j))
                if value < best[k][j] - 1e-12:
                    best[k][j], cut[k][j] = value, i
    bounds, j = [], n
    for k in range(n_stages - 1, 0, -1):
        i = cut[k][j]
        bounds.append((i, j))
        j = i
    bounds.append((0, j))
    return bounds[::-1]


def plan_stages(model: nn.Module, plan: Plan) -> tuple[str, list[StageSpec]]:
    """Where to cut: the block sequence's name and every global stage's block range."""
    n_stages = plan.pp * plan.virtual_stages
    path, container = find_blocks(model, plan.options.pp_blocks)
    n_blocks = len(container)
    where = f"{path or type(model).__name__}"
    if n_stages > n_blocks:
        raise ValueError(f"pp={plan.pp} x virtual_stages={plan.virtual_stages} = {n_stages} "
                         f"stages but {where} has only {n_blocks} blocks; use at most "
                         f"{n_blocks} stages (lower pp or virtual_stages) or a deeper model")
    # Plan validation allows at most one of these, with one entry per stage (or cut).
    split_points = plan.options.split_points
    stage_costs = plan.options.stage_costs
    stage_layers = plan.options.pp_stage_layers
    if stage_layers is not None:
        bounds = _bounds_from_layers(stage_layers, n_stages, n_blocks, plan, where)
    elif split_points is not None:
        names = [f"{path}.{k}" if path else k for k in container._modules]
        starts = []
        for point in split_points:
            if point not in names:
                raise ValueError(f"split point {point!r} is not a block of {where}; blocks are "
                                 f"{names[0]} .. {names[-1]}")
            starts.append(names.index(point))
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise ValueError(f"split_points={list(split_points)} must be increasing and start "
                             f"after {names[0]} (each names the first block of a stage)")
        edges = [0, *starts, n_blocks]
        bounds = list(zip(edges[:-1], edges[1:], strict=True))
    else:
        if stage_costs is not None:
            if len(stage_costs) != n_blocks:
                raise ValueError(f"stage_costs has {len(stage_costs)} entries but {where} has "
                                 f"{n_blocks} blocks; give one cost per block")
            costs = [float(c) for c in stage_costs]
            first_extra = last_extra = 0.0
        else:
            costs = [float(_param_count(b)) for b in container]
            before, after = _side_modules(model, path)
            first_extra = float(sum(_param_count(m) for m in before))
            last_extra = float(sum(_param_count(m) for m in after))
        bounds = partition(costs, n_stages, first_extra, last_extra)
    return path, [StageSpec(k, i, j, n_stages) for k, (i, j) in enumerate(bounds)]


def _even_counts(n_blocks: int, n_stages: int) -> list[int]:
    return [n_blocks // n_stages + (i < n_blocks % n_stages) for i in range(n_stages)]


def _bounds_from_layers(stage_layers: Any, n_stages: int, n_blocks: int, plan: Plan,
                       where: str) -> list[tuple[int, int]]:
    """Block ranges from ``options.pp_stage_layers``: blocks per model chunk, in global stage
    order (the planner writes it when its cost-balanced split is not the even one, so the
    runtime builds exactly the layout that was priced)."""
    try:
        counts = [int(c) for c in stage_layers]
        exact = all(int(c) == c for c in stage_layers)
    except (TypeError, ValueError):
        counts, exact = [], False
    if not exact or len(counts) != n_stages or sum(counts) != n_blocks or min(counts) < 1:
        raise ValueError(f"options.pp_stage_layers={stage_layers!r} must list {n_stages} "
                         f"positive whole block counts (pp={plan.pp} x virtual_stages="
                         f"{plan.virtual_stages}), one per stage in stage order, summing to the "
                         f"{n_blocks} blocks of {where}; e.g. "
                         f"{_even_counts(n_blocks, n_stages)}")
    edges = [0]
    for c in counts:
        edges.append(edges[-1] + c)
    return list(zip(edges[:-1], edges[1:], strict=True))


def build_stage_module(model: nn.Module, path: str, spec: StageSpec) -> nn.Module:
    """A shallow copy of ``model`` holding only stage ``spec``'s modules (names unchanged)."""
    parts = path.split(".") if path else []

    hf_done = False
    added: set[int] = set()  # HF position embeddings: their skip adds zero

    def rebuild(module: nn.Module, depth: int) -> nn.Module:
        nonlocal hf_done
        clone = copy.copy(module)
        clone._modules = dict(module._modules)  # own registry; children shared, not copied
        if not hf_done and _is_hf_model(module):
            hf_done = True  # the outermost HF model on the path is the one that gets called
            added.update(id(m) for m in _hf_added_embeddings(module, parts[depth:]))
            _adapt_hf_forward(clone, spec, returns_logits=depth == 0)
        if depth == len(parts):  # the block sequence
            for idx, key in enumerate(module._modules):
                if not spec.start <= idx < spec.end:
                    clone._modules[key] = PipelineSkip()
            return clone
        own = [n for n, p in module.named_parameters(recurse=False)]
        if own:
            raise ValueError(f"{type(module).__name__} holds parameters {own} directly, outside "
                             f"any submodule, on the path to the blocks ({path}); a pipeline "
                             f"cannot tell which stage owns them: move them into a submodule")
        seen = False
        for key, child in module._modules.items():
            if key == parts[depth]:
                seen = True
                clone._modules[key] = rebuild(child, depth + 1)
            elif child is not None and _param_count(child) > 0:
                keep = spec.is_last if seen else spec.is_first
                if not keep:
                    clone._modules[key] = PipelineZero() if id(child) in added else PipelineSkip()
        return clone

    return rebuild(model, 0)


# ----------------------------------------------------------------------------- HF decoders
# Hugging Face decoder layers take masks and rotary position embeddings that the decoder's
# forward computes from its input, so a stage cannot feed its hidden states to a layer alone.
# What HF offers instead: ``*ForCausalLM.forward(inputs_embeds=h)`` skips the token embedding and
# builds the mask and positions from ``h``. So a later stage calls the (skip-replaced) model with
# ``inputs_embeds=`` its input; skipped layers pass the hidden states through, and on stages
# without the head the skipped final norm and ``lm_head`` make ``.logits`` those hidden states.
def _is_hf_model(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers not installed: no HF models to adapt
        return False
    return isinstance(module, PreTrainedModel)


def _hf_added_embeddings(hf: nn.Module, parts: list[str]) -> list[nn.Module]:
    """The embeddings before the layers other than the token embedding (GPT-2's ``wpe``, OPT's
    learned positions): HF decoders add their output to ``inputs_embeds``, so on later stages
    (which receive hidden states that already include them) their stand-in must add zero.

    Other parameterised modules there are refused: whether the decoder adds or applies them
    cannot be told from outside, and a wrong guess trains silently wrong."""
    embed = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    before, _ = _side_modules(hf, ".".join(parts))
    other = [m for m in before if m is not embed and _param_count(m) > 0]
    unknown = [m for m in other if not isinstance(m, nn.Embedding)]
    if unknown:
        names = [n for n, m in hf.named_modules() if any(m is u for u in unknown)]
        raise ValueError(f"{type(hf).__name__} has parameterised modules {names} before its "
                         f"decoder layers that are neither the token embedding nor an "
                         f"embedding added to it; plait's HF pipeline adapter cannot tell how "
                         f"later stages should skip them: run this model with pp=1, or wrap "
                         f"it so those modules live inside the first block")
    return other


def _adapt_hf_forward(clone: nn.Module, spec: StageSpec, returns_logits: bool) -> None:
    """Give the stage copy of an HF model a forward that takes hidden states on later stages.

    The user's code calls ``hf(x)`` / ``hf(input_ids=x)`` as usual; on every stage after the
    first, ``x`` is the previous stage's hidden states and goes in as ``inputs_embeds``. No KV
    cache (training). When the HF model is the pipelined model itself, stages return
    ``.logits`` (pipeline stages pass tensors; the loss gets logits).
    """
    forward = type(clone).forward

    def stage_forward(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("use_cache", False)
        if not spec.is_first:
            if args:
                hidden, args = args[0], args[1:]
            else:
                hidden = kwargs.pop("input_ids", None)
            if hidden is not None:
                kwargs["inputs_embeds"] = hidden
        out = forward(clone, *args, **kwargs)
        if not spec.is_last and getattr(out, "logits", None) is not None \
                and is_view(out.logits):
            # Here ``.logits`` is the hidden states sliced by ``logits_to_keep`` (a view), and
            # torch's split backward (zero-bubble schedules) frees stage outputs with detach_(),
            # which views refuse: hand on an owned copy (one activation copy per microbatch).
            out.logits = out.logits.clone()
        return out.logits if returns_logits else out

    clone.forward = stage_forward


# ----------------------------------------------------------------------------- runtime
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

    def __init__(self, stages: list[TimedStage], plan: Plan, rank: int):
        self.stages = stages
        self.plan = plan
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
        """torch's ``loss_parallel()`` around the whole schedule step when the last stage's head
        is vocabulary-parallel (TP marks it ``plait_loss_parallel``): the schedule computes the
        loss, and runs its backward, inside ``step``, so the train step cannot wrap them apart."""
        if any(getattr(s.submod, "plait_loss_parallel", False) for s in self.stages
               if s.is_last):
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

    ``parameters()`` yields every local stage's parameters; ``plait_stages`` lists the stage
    modules (their parameter names are the full model's); ``plait_pipeline.step(...)`` runs the
    schedule. Calling the module directly is not a pipeline step and is refused.
    """

    def __init__(self, stage_modules: list[nn.Module], runner: PipelineRunner,
                 specs: list[StageSpec]):
        super().__init__()
        self.stages = nn.ModuleList(stage_modules)
        self.plait_pipeline = runner
        self.plait_stage_specs = specs

    @property
    def plait_stages(self) -> list[nn.Module]:
        return list(self.stages)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipelined model runs through its schedule: call "
                           "run.step(model, batch, loss_fn, opt) (or "
                           "model.plait_pipeline.step(batch, loss_fn, plan=..., device=...))")


def apply_pipeline(model: nn.Module, mesh: Mesh, plan: Plan, *, device: torch.device,
                   parallelize_stage: Callable[..., nn.Module]) -> PipelinedModel:
    """Split ``model`` into ``plan.pp x plan.virtual_stages`` stages, keep this rank's, and
    return them with their schedule (see the module docstring)."""
    check_schedule_args(plan.pp_schedule, plan.pp, plan.microbatches, plan.virtual_stages)
    path, specs = plan_stages(model, plan)
    pp_mesh = mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()
    mine = local_stages(plan.pp_schedule, plan.pp, plan.virtual_stages, pp_rank)
    modules = [build_stage_module(model, path, specs[s]) for s in mine]
    _check_no_shared_parameters(model, path, specs)
    modules = [parallelize_stage(m, mesh, plan, device=device) for m in modules]
    stages = [TimedStage(m, s, len(specs), device, group=pp_mesh.get_group())
              for m, s in zip(modules, mine, strict=True)]
    runner = PipelineRunner(stages, plan, rank=torch.distributed.get_rank())
    return PipelinedModel(modules, runner, [specs[s] for s in mine])


def _check_no_shared_parameters(model: nn.Module, path: str, specs: list[StageSpec]) -> None:
    """Tied weights across stages (e.g. embedding = head) would be trained twice, apart."""
    owner: dict[int, int] = {}
    for spec in specs:
        stage = build_stage_module(model, path, spec)
        for name, p in stage.named_parameters():
            other = owner.setdefault(id(p), spec.index)
            if other != spec.index:
                raise ValueError(f"parameter {name} is shared by stages {other} and "
                                 f"{spec.index} (tied weights, e.g. tie_embeddings=True, "
                                 f"or a Hugging Face config's tie_word_embeddings=True); untie "
                                 f"them "
                                 f"(tie_word_embeddings=False when building the HF model) or "
                                 f"put both users on one stage (split_points)")
