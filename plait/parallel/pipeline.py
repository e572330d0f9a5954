"""Pipeline parallelism, part 3: the stage runtime, and ``apply_pipeline``, its entry point.

``apply_pipeline`` cuts the model (:mod:`plait.parallel.pipeline_split`), keeps the stages this
rank owns, lays each out with ``parallelize_stage`` and runs them with torch's schedules.

Schedules are torch's (``torch.distributed.pipelining``): GPipe, 1F1B, interleaved 1F1B, looped
BFS, interleaved zero-bubble and ZB-V, with ``PipelineStage`` doing the point-to-point sends.
Backward runs on each microbatch's loss *sum* (torch's ``scale_grads`` is off; under fp16 times
the loss scale, ``plait.loss_scale``); the step
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
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from .._torch_compat import pipeline_stage_base, pytree, stage_backward_split
from ..batch_rows import MicroBatches
from ..dict_batch import whole_dict_parameter
from ..loss import label_shift, loss_sum_and_count, missing_labels_fix, shifts_labels
from ..mean_probe import check_mean, own_loss_unexplained, split_batch, weighted_module_count
from ..mesh import Mesh
from ..plan import PP_SCHEDULES, ZERO_BUBBLE_SCHEDULES, Plan, reduces_after_schedule
from .context import ContextGroup, context_group
from .layout import Layout, layout_of, record_layout
from .pipeline_buffers import (
    broadcast_owned,
    buffer_owners,
    every_stage_buffers,
    foreign_kept,
    named_buffer,
)
from .pipeline_chain import (
    chain_break,
    chain_source,
    chain_source_message,
    loss_reads_before,
    meta_replica,
    on_meta,
    side_input,
    unchained_message,
)
from .pipeline_errors import unwrapped
from .pipeline_hf import TOKEN_IDS, is_hf_model, pools_by_pad_token
from .pipeline_split import (
    StageOutputError,
    StageSpec,
    add_zero_stand_ins,
    additive_by_running,
    additive_modules,
    build_stage_module,
    held_on_path,
    plan_stages,
    shared_parameters,
)
from .pipeline_warmup import first_microbatch, stage_input_finder, warm_stages, warms_locally
from .schedules import check_schedule_args, local_stages, schedule_class, stage_to_rank
from .tensor import plan_for_stages
from .timeline import Timeline, now
from .tp_example import Example
from .unused import UnusedTracker

# Each term's global count is needed before the first backward, which a pipeline schedule
# runs while later microbatches are still to come through the stages.
TERMS_UNDER_PP = (
    "the loss function returned a dict of {terms} (sum, count) terms, each to be divided by "
    "its own count over the global batch, which a pipeline cannot weigh: its schedule runs "
    "the first backward before the last microbatch's counts exist. Train without pp (dp=N, "
    "or dp_shard=N,zero=3 for memory), or return one (sum, count) pair")


pipeline_stage_base()  # TimedStage overrides a private method: fail clearly if torch changed it


@contextlib.contextmanager
def _buffers_kept(module: nn.Module) -> Iterator[None]:
    """Put ``module``'s buffers back as they were after torch's shape inference.

    torch 2.13 infers a stage's shapes by running its forward for real, in the model's mode:
    the first stage on microbatch 0, a later stage on ``torch.empty`` tensors (whatever the
    memory held), at the first step and again at each switch back from evaluation. A forward
    that updates buffers in training (BatchNorm's running statistics and step count, an EMA
    the model keeps) would take one more update than one device makes, from garbage on a
    later stage (NaN the next step where the model reads the buffer, else silently wrong
    running statistics, saved in checkpoints and used at evaluation). Only the buffers the
    forward wrote are put back (their version moved or, as BatchNorm's kernel updates its
    running statistics without moving it, their values; this rank's shard of a DTensor buffer,
    as comparing DTensors would be a collective), through ``.data``: the forward saved them
    for the backward torch infers next (BatchNorm's backward takes its running statistics),
    which refuses a tensor whose version an in-place write moved since."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    saved = [(b, b._version, local(b).detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, version, value in saved:
                if buffer._version != version or not torch.equal(local(buffer), value):
                    local(buffer).data.copy_(value)


class TimedStage(PipelineStage):
    """A PipelineStage that reports each forward/backward to a Timeline while one records."""

    timeline: Timeline | None = None
    # The buffers this stage holds that another stage's part of the forward writes: what this
    # stage's forward writes to them is put back (plait.parallel.pipeline_buffers).
    foreign: list[torch.Tensor] = []
    # find_unused under ZeRO-2/3: notes the parameters each training forward's outputs reach
    # (plait.parallel.unused), set by the runner for the step.
    unused: UnusedTracker | None = None
    # Keyword inputs of this accumulation step's microbatches that are not one row per example
    # (an EmbeddingBag's flat ids and offsets), one dict per microbatch, set by the runner:
    # torch's schedule splits every tensor input by rows (its TensorChunkSpec), which cannot
    # cut these, so each microbatch's own are added here, by the chunk torch runs.
    ragged: list[dict[str, Any]] | None = None
    # The job's plan, which an unused-parameter error's suggested fix is written for.
    plan: Plan | None = None

    def _prepare_forward_infra(self, *args, **kwargs):
        if self.ragged:  # (n_microbatches, args, kwargs, ...): shapes inferred on microbatch 0
            args, kwargs = _add_inputs(args, kwargs, 2, self.ragged[0])
        # torch 2.13 infers stage shapes by running the submodule once, outside DDP's no_sync.
        # That DDP forward arms the reducer for a backward that never comes, so the first real
        # (no_sync) microbatch backward is recorded for bucket rebuilding too and the second
        # step dies in Reducer._rebuild_buckets ("rebuilt parameter indices size is not same as
        # original model parameters size"). Running the inference under no_sync avoids it.
        with _buffers_kept(self.submod):
            if isinstance(self.submod, DDP):
                with self.submod.no_sync():
                    return super()._prepare_forward_infra(*args, **kwargs)
            return super()._prepare_forward_infra(*args, **kwargs)

    def _to_tensor(self, arg):
        # torch 2.13 infers a later stage's shapes by running its forward once on tensors it
        # makes with torch.empty_strided from the previous stage's metadata: uninitialised
        # memory, different on each rank (torch 2.9 used zeros). A forward whose collectives
        # depend on values then runs different collectives on ranks that must agree: a routed
        # MoE under tp picks its experts by value, so the tp ranks' all-reduces differ in size
        # and gloo aborts ("Received data size doesn't match expected size") or hangs. A
        # forward that checks its input (NaN, a range) may raise. Zeros are the same on every
        # rank. Torch versions without this method never call it.
        out = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor):
            with torch.no_grad():
                (out.to_local() if isinstance(out, DTensor) else out).zero_()
        return out

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        if self.ragged:  # (args, kwargs, ...) after the chunk id
            args, kwargs = _add_inputs(args, kwargs, 1, self.ragged[fwd_chunk_id])
        start = now()
        with foreign_kept(self.foreign):
            try:
                out = unwrapped("forward", self.stage_index, fwd_chunk_id,
                                super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)
            except RuntimeError as exc:
                # A parameter of this stage no forward used (as on one device, where it only
                # keeps no gradient): DDP refuses the next forward, said as under data
                # parallelism alone, with the plan's fix.
                from ..train import DDP_UNUSED, unused_message

                if isinstance(self.submod, DDP) and DDP_UNUSED in str(exc):
                    raise ValueError(unused_message(self.submod, str(exc), self.plan)) from exc
                raise
        if self.unused is not None and torch.is_grad_enabled():
            for leaf in pytree()[0](out)[0]:
                if isinstance(leaf, torch.Tensor):
                    self.unused.note(leaf)
        if self.timeline is not None:
            self.timeline.add(self.stage_index, "F", fwd_chunk_id, start, now())
        return out

    def get_local_bwd_output(self, mb_index):
        # Where torch falls short: in a V layout (ZB-V: rank 0 holds the first and the last
        # stage, the turn-around stages sit on one rank) torch's schedule runtime hands a
        # stage's input gradient to the stage before it on the same rank after each backward
        # action (get_local_bwd_output, then set_local_bwd_input), and runs those actions in
        # ``schedule.eval`` too, where the stages have no backward and both raise ("can't
        # steal_bwd_input if this stage doesn't have backward"). Without a backward there is no
        # gradient to hand on: nothing passes, and the schedule's forward actions (the whole
        # of an evaluation) run as torch orders them.
        if not self.has_backward:
            return ()
        return super().get_local_bwd_output(mb_index)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
        if not self.has_backward:  # see get_local_bwd_output
            return
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True,
                           last_backward=False):
        start = now()
        if not full_backward and self.has_backward:
            self._gather_for_split_backward()
        out = unwrapped("backward", self.stage_index, bwd_chunk_id, super().backward_one_chunk,
                        bwd_chunk_id, loss=loss, full_backward=full_backward,
                        last_backward=last_backward)
        if self.timeline is not None and self.has_backward:
            self.timeline.add(self.stage_index, "B" if full_backward else "I", bwd_chunk_id,
                              start, now())
        return out

    def _gather_for_split_backward(self) -> None:
        """Gather the stage's FSDP2 units (ZeRO-2/3) before a zero-bubble schedule's input
        (I) or weight (W) step. torch's split backward finds the parameters the forward graph
        used by their gradient accumulators, reading them off ``self.submod.parameters()``:
        at I to group them (stage_backward_input), at W to hand each its gradient
        (stage_backward_weight). FSDP2 registers the gathered parameters on the module only
        while the unit is gathered, the sharded ones otherwise. Where torch falls short:
        its runtime's UNSHARD action gathers the units once, before the stage's first
        forward, but ZeRO-3 reshards each unit after every forward, so an I after another
        microbatch's forward would find the sharded parameters, which the graph never used,
        and its W would compute no weight gradient. Gathered here, the module holds the
        parameters the graph used; FSDP2's own pre-backward would gather them at I anyway,
        W gathers again where a forward resharded the unit in between. The gradients
        accumulate on the gathered parameters, unreduced (torch's stage runs every backward
        with FSDP2's gradient sync off), and torch's REDUCE_GRAD step (perform_reduce_grad)
        reduce-scatters them once after the stage's last W, as for 1F1B."""
        for module in self.submod.modules():
            if isinstance(module, FSDPModule):
                module.unshard()

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs,
                                   last_backward=False):
        # A zero-bubble schedule's weight step (torch's stage_backward_weight) runs one
        # autograd.grad per parameter group, from the nodes where the group's parameters meet
        # the stage's input-dependent graph, and frees the graph as it goes (retain_graph
        # False). A parameter read at several depths of one stage (a shift the model's own
        # forward adds after every block, a block reused at several depths) meets that graph
        # at several nodes, and the walk from the deepest back to the params passes through
        # the other groups' nodes between those depths (the blocks in between): whichever group
        # runs second finds its saved tensors freed ("Trying to backward through the graph a
        # second time"). Those groups run first here with the graph kept (torch's own clamps
        # on their nodes keep each use counted once), the others after them as torch runs
        # them. The graph is released when the chunk's weight step ends, as before; the cost
        # is the walk through the blocks between the uses, once per microbatch.
        split = stage_backward_split()
        if backward_type == "weight" and split is not None:
            groups = bwd_kwargs["param_groups"]
            spanning = [g for g in groups if len(g["intermediates"]) > 1]
            if spanning:
                split[1](self.submod.parameters(), spanning, retain_graph=True)
                bwd_kwargs = {**bwd_kwargs,
                              "param_groups": [g for g in groups
                                               if all(g is not s for s in spanning)]}
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs,
                                                  last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        start = now()
        if self.has_backward:  # evaluation runs a zero-bubble schedule's W actions as no-ops
            self._gather_for_split_backward()
        out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        if self.timeline is not None and self.has_backward:
            self.timeline.add(self.stage_index, "W", bwd_chunk_id, start, now())
        return out


def _add_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], index: int,
                extra: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A torch stage method's arguments with ``extra`` added to the model's keyword inputs,
    which it takes as its parameter ``kwargs``: positional number ``index`` of ``args``, or by
    name."""
    if len(args) > index:
        return (*args[:index], {**(args[index] or {}), **extra}, *args[index + 1:]), kwargs
    return args, {**kwargs, "kwargs": {**(kwargs.get("kwargs") or {}), **extra}}


def _rows(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.shape[0]
    raise ValueError(f"a pipeline's first-stage input must be a tensor with the batch in dim "
                     f"0, got {type(x).__name__}")


# torch's schedule.step takes these keywords itself: a model input of that name cannot pass.
_STEP_KEYWORDS = ("target", "losses", "return_outputs", "loss_kwargs")


@dataclass(frozen=True)
class StageInputs:
    """One step's batch laid out for the stages: ``first`` goes positionally to the first stage
    (later stages receive the hidden states there instead), ``every`` as keywords to every
    stage (an attention mask, token type ids), ``last_only`` as keywords to the last stage only
    (``labels`` when the model computes its own loss), ``targets`` to the loss."""

    first: torch.Tensor
    every: dict[str, Any]
    last_only: dict[str, Any]
    targets: Any


def whole_dict_refusal(model_name: str, name: str, keys: Any) -> str:
    """Why a pipeline cannot run a forward that takes a dict batch whole (``forward(self,
    batch)``): torch's stages hand one tensor from stage to stage, in the forward's first
    parameter, where this forward expects the dict."""
    return (f"{model_name}.forward takes the whole dict batch as one argument ({name}), and a "
            f"pipeline hands each later stage the previous stage's hidden states in that "
            f"argument, not a dict: take the entries as parameters, e.g. def forward(self, "
            f"{', '.join(sorted(keys)[:3])}), or run with pp=1")


def _per_example_lists(batch: Any) -> list[str]:
    """Where ``batch`` (a dict, or ``(inputs, targets)``) holds a list of one dict per example
    (:func:`~plait.batch_rows.per_example`), written as a user indexes it."""
    from ..batch_rows import per_example

    if isinstance(batch, dict):
        return [repr(k) for k, v in batch.items() if per_example(v, repr(k))]
    if isinstance(batch, (tuple, list)):
        return [f"[{i}]" + (f"[{k!r}]" if k is not None else "")
                for i, part in enumerate(batch)
                for k, v in (part.items() if isinstance(part, dict) else [(None, part)])
                if per_example(v, "x")]
    return []


def stage_inputs(batch: Any, loss_fn: Callable | None, signature: inspect.Signature,
                 model_name: str) -> StageInputs:
    """Lay out a batch in any of the train step's conventions (``plait.train.call_model``):
    ``(inputs, targets)`` with inputs a tensor, a tuple of positional arguments or a dict of
    keyword arguments, or one Hugging Face dict (``labels`` held back for the loss, or, with
    ``loss_fn=None``, given to the last stage, whose model computes ``output.loss``).

    The forward's first parameter is what the stages chain (the first stage gets the batch's
    value, later stages the hidden states); every other argument is passed by name to every
    stage. Raises ValueError (one line) for a batch the stages cannot be given."""
    last_only: dict[str, Any] = {}
    listed = _per_example_lists(batch)
    if listed:
        raise ValueError(
            f"batch entry {listed[0]} is a list of one dict per example (a detector's "
            f"targets), which torch's pipeline schedule does not cut into microbatches (it "
            f"cuts tensors, and hands anything else whole to every microbatch): train "
            f"{model_name} without pp (dp=N, or dp_shard=N,zero=3 for memory)")
    if isinstance(batch, dict):
        if "labels" not in batch:
            raise ValueError(f"a dict batch under pp > 1 needs a 'labels' entry (keys: "
                             f"{sorted(batch)}): the last stage's loss reads it"
                             f"{missing_labels_fix(batch)}")
        targets = batch["labels"]
        inputs: Any = {k: v for k, v in batch.items() if k != "labels"}
        if loss_fn is None:
            last_only["labels"] = targets
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        if loss_fn is None:
            raise ValueError("loss_fn=None under pp > 1 needs the Hugging Face dict batch "
                             "({'input_ids': ..., 'labels': ...}) so that the last stage's "
                             "model gets the labels; or pass a loss_fn")
        inputs, targets = batch
    else:
        raise ValueError(f"a pipeline step takes (inputs, targets) or a dict batch with "
                         f"'labels'; got {type(batch).__name__}")
    params = [p for p in signature.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    if isinstance(inputs, torch.Tensor):
        first, every = inputs, {}
    elif isinstance(inputs, (tuple, list)):
        if not inputs:
            raise ValueError("pipeline inputs are an empty tuple; give the model's input")
        if len(inputs) > max(len(params), 1):
            raise ValueError(f"{model_name}.forward names {len(params)} positional "
                             f"parameters but the batch gives {len(inputs)} inputs: later "
                             f"stages get the extra inputs by name, so give them as a dict "
                             f"of keyword arguments")
        first = inputs[0]
        every = {p.name: v for p, v in zip(params[1:], inputs[1:], strict=False)}
    elif isinstance(inputs, dict):
        name = params[0].name if params else None
        keyword_only = [p.name for p in signature.parameters.values() if p.kind == p.KEYWORD_ONLY]
        if name is None and keyword_only:
            # torch's stages hand the hidden states to the next stage's forward positionally,
            # so a forward that takes every input by keyword has nothing for them to fill.
            raise ValueError(
                f"{model_name}.forward takes its inputs by keyword only ({', '.join(keyword_only)}"
                f"), and a pipeline passes the input it chains from stage to stage (the hidden "
                f"states) as the forward's first positional parameter: make the first input "
                f"positional, e.g. def forward(self, {keyword_only[0]}, *, ...), or run with "
                f"pp=1")
        if name is None:
            raise ValueError(f"{model_name}.forward names no positional parameter (it takes "
                             f"*args), so a pipeline cannot tell which entry of the dict batch "
                             f"(keys: {sorted(inputs)}) it chains from stage to stage: name the "
                             f"first input in the forward, or give (inputs, targets) batches")
        if name is not None and whole_dict_parameter(signature, inputs) == name:
            raise ValueError(whole_dict_refusal(model_name, name, inputs))
        if name not in inputs:
            raise ValueError(f"a pipeline chains {model_name}.forward's first parameter "
                             f"({name}) from stage to stage, and the batch has no {name!r} "
                             f"entry (keys: {sorted(inputs)}); name the model's first input "
                             f"in the batch")
        first = inputs[name]
        every = {k: v for k, v in inputs.items() if k != name}
    else:
        raise ValueError(f"pipeline inputs are a tensor, a tuple or a dict; got "
                         f"{type(inputs).__name__}")
    if not isinstance(first, torch.Tensor):
        raise ValueError(f"the first-stage input of {model_name} must be a tensor with the "
                         f"batch in dim 0, got {type(first).__name__}")
    named = {p.name for p in signature.parameters.values()}
    for key in [*every, *last_only]:
        if key in _STEP_KEYWORDS:
            raise ValueError(f"model input {key!r} has the name of a keyword of torch's "
                             f"pipeline schedule step ({', '.join(_STEP_KEYWORDS)}); rename "
                             f"that argument of {model_name}.forward")
        if key not in named and not takes_any and key in last_only:
            raise ValueError(f"loss_fn=None: the model computes its own loss from the batch's "
                             f"labels, but {model_name}.forward has no parameter {key!r}; "
                             f"pass a loss_fn")
        if key not in named and not takes_any:
            raise ValueError(f"{model_name}.forward has no parameter {key!r} (a batch "
                             f"entry); remove it from the batch or add it to the forward")
    return StageInputs(first, every, last_only, targets)


_TENSOR = object()  # OutputPacker's placeholder for a tensor leaf


class OutputPacker:
    """The last stage's output as torch's stages take it, and back for the loss.

    torch's ``PipelineStage`` accepts a tensor or a tuple of tensors from a stage (it infers
    their shapes before the first step), while models return ``(logits, aux)``, dicts or
    Hugging Face ``ModelOutput``s. The last stage therefore returns the tensors of its output
    (a pytree flattening) and the loss gets the structure rebuilt, the same object one
    device's loss gets. Non-tensor leaves are kept from the latest forward."""

    def __init__(self) -> None:
        self._spec: Any = None
        self._template: list[Any] = []  # non-tensor leaves; _TENSOR where a tensor goes

    def pack(self, out: Any) -> Any:
        tree_flatten, _ = pytree()
        if isinstance(out, torch.Tensor):
            self._spec = None
            return out
        leaves, self._spec = tree_flatten(out)
        self._template = [_TENSOR if isinstance(v, torch.Tensor) else v for v in leaves]
        return tuple(v for v in leaves if isinstance(v, torch.Tensor))

    def unpack(self, output: Any) -> Any:
        _, tree_unflatten = pytree()
        if self._spec is None:
            return output
        tensors = iter([output] if isinstance(output, torch.Tensor) else output)
        leaves = [next(tensors) if v is _TENSOR else v for v in self._template]
        return tree_unflatten(leaves, self._spec)

    def install(self, stage: nn.Module) -> None:
        """Make ``stage``'s forward return its output packed."""
        forward = stage.forward

        def packed(*args: Any, **kwargs: Any) -> Any:
            return self.pack(forward(*args, **kwargs))

        stage.forward = packed


class PipelineRunner:
    """The schedule of this rank's stages; ``step`` runs one optimizer step's worth of it."""

    def __init__(self, stages: list[TimedStage], plan: Plan, rank: int, *,
                 loss_parallel: bool = False, signature: inspect.Signature | None = None,
                 model_name: str = "model", shifts_labels: bool = False,
                 packer: OutputPacker | None = None):
        self.stages = stages
        # The last stage's modules, where a model's own weighted loss module is looked for
        # (plait.mean_probe.weighted_module_count): one holder, not one per microbatch.
        self._last_submods = nn.ModuleList([s.submod for s in stages if s.is_last])
        self.plan = plan
        self.loss_parallel = loss_parallel
        # The model's forward signature (how a batch maps onto the stages' arguments), its
        # name for messages, and whether its own loss skips each row's first label.
        self.signature = signature or inspect.Signature(
            [inspect.Parameter("x", inspect.Parameter.POSITIONAL_OR_KEYWORD)])
        self.model_name = model_name
        self.shifts_labels = shifts_labels
        self.packer = packer or OutputPacker()
        # Runs once, on the first step's inputs, before the schedule (see check_split).
        self.check_split: Callable[[StageInputs], set[str]] | None = None
        # Runs once, on the first step's inputs and loss (see loss_checker).
        self.check_loss: Callable[[StageInputs, Callable | None], None] | None = None
        self.timeline = Timeline(rank=rank)
        for s in stages:
            s.timeline = self.timeline
        self._schedule: Any = None
        self._loss_fn: Callable | None = None
        self._targets: Any = None  # this accumulation step's targets (any structure)
        # Per loss function: whether its scalar mean skips each row's first label (plait.loss),
        # as the real microbatches of a finished step answered it; and the answers of this
        # step's latest real microbatch, kept once the step ends (see _loss).
        self._first_label_skipped: dict[Any, bool] = {}
        self._step_answers: dict[Any, bool] | None = None
        # What plait.mean_probe learnt of the loss function (asked on a step's microbatches,
        # which a pipeline always cuts the batch into).
        self._loss_checks: dict[Any, Any] = {}
        self._microbatch_rows = 0  # rows of one real microbatch (set by each step)
        # (training?, input shapes) the stages inferred their activation shapes from: torch's
        # schedule infers them at its first step and again at each switch between training
        # and evaluation, never on a change of shape (see _check_shapes).
        self._built_for: tuple[bool, tuple[Any, ...]] | None = None
        # [loss sum, count] per (accumulation step, microbatch's first row): torch's stage also
        # calls the loss once on its shape-inference outputs, which the real call replaces.
        self._totals: dict[tuple[int, int], torch.Tensor] = {}
        self._accum_index = 0
        self._loss_scale = 1.0  # fp16: the step's loss scale, see step()
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        # Tied weights held by several stages: (this rank's copy, the group of ranks holding
        # the copies); see sync_tied_gradients.
        self.tied: list[tuple[nn.Parameter, Any]] = []
        # The group whose ranks' gradients the step averages after the schedule (the data
        # and cp ranks of a zero-bubble schedule's stages, see sync_data_gradients); None:
        # DDP or FSDP2 reduce them, or there are none.
        self.grad_group: Any = None
        # Whether the model has weights tied across stages (on any rank), and this rank's
        # copies by (one-device name, stage, name in the stage, copy): see check_tied_settings.
        self.has_ties = False
        self.tied_copies: list[tuple[str, int, str, nn.Parameter]] = []
        # Buffers every stage holds: which stage writes each, asked once on the first step's
        # inputs (find_owners), then this rank's copies with their owners' pp ranks, broadcast
        # after each training step over pp_group (plait.parallel.pipeline_buffers).
        self.find_owners: Callable[[StageInputs], dict[str, int]] | None = None
        self.stage_rank: list[int] = []
        self.pp_group: Any = None
        self.owned: list[tuple[torch.Tensor, int]] = []
        # A Hugging Face model that pools at its last non-pad token: its last stage reads the
        # first stage's input (the token ids) too (plait.parallel.pipeline_hf.TOKEN_IDS).
        self.token_ids_to_last = False
        # Under compile: each stage's input shapes, asked on the first inputs of training and of
        # evaluation (``_warmed``: the modes done), for every stage of this rank to compile
        # before the schedule runs (plait.parallel.pipeline_warmup).
        self.find_inputs: Callable[..., Any] | None = None
        self._warmed: set[bool] = set()
        # find_unused under ZeRO-2/3: the ranks holding this rank's stages (their data
        # replicas), over which the parameters no rank used are found after each training step
        # (plait.parallel.unused); None without find_unused or FSDP2.
        self.unused_group: Any = None
        # Context parallelism: this rank's cp group (the ranks of its stage that split each
        # sequence); the step gives the stages its slice of each sequence, and their
        # attention runs over the whole sequence (plait.parallel.context).
        self.context: ContextGroup | None = None
        # Under cp, whether this step's loss (on the last stage) shifted the labels, which
        # cp refuses (it would shift each rank's slice). Only the last stage sees it, and a
        # raise there mid-schedule would leave the other stages waiting on their sends: the
        # train step sums it over the job with the step's totals and refuses on every rank
        # (see take_refusal).
        self.shift_seen = False
        # How many terms this step's loss returned as a dict of (sum, count) pairs (0: not
        # such a loss), which a pipeline refuses (TERMS_UNDER_PP); seen on the last stage only,
        # and refused on every rank as shift_seen is.
        self.terms_seen = 0
        # Whether this step's loss function was first found not to be a mean over the items
        # plait counts (plait.mean_probe), which every rank warns about, rank 0 among them.
        self.not_a_mean_seen = False
        # Whether this step's model's own loss (loss_fn=None) was first found to be neither a
        # mean over its labels nor a weighted loss module's (plait.mean_probe), warned about
        # on every rank as not_a_mean_seen is.
        self.own_loss_seen = False

    def _loss(self, output: Any, rows: torch.Tensor) -> torch.Tensor:
        """The schedule's loss for one microbatch. torch's schedules split a *tensor* target
        into microbatches, so they are given the row indices and the real targets (a tensor,
        tuple or dict) are looked up here. The loss gets the model's output as the model
        returned it (:class:`OutputPacker`), or with ``loss_fn=None`` the model's own
        ``output.loss``. Backward runs on the microbatch's loss *sum*; the train step divides
        the gradients by the global count of items (``plait.loss``)."""
        from ..train import model_loss

        target = _take_rows(self._targets, rows)
        out = self.packer.unpack(output)
        value = model_loss(out, self._loss_fn, target)
        # torch's stage may also call the loss during its shape inference (torch 2.13 does, at
        # the first step and at each switch between training and evaluation), before any real
        # microbatch, for microbatch 0's rows (or the whole chunk's), on the outputs of
        # uninitialised buffers: whatever the memory held, often zeros, whose nearly uniform
        # logits leave a loss unmoved by ignoring the first labels. An answer taken there must
        # not be kept: each call asks on a copy of the kept answers, and the copy of the last
        # real call is kept once the step ends. That call's total is overwritten by
        # microbatch 0's.
        real = rows.numel() == self._microbatch_rows
        answers = dict(self._first_label_skipped)
        shift = label_shift(self._loss_fn, out, value, target, known=answers,
                            model_shifts=self.shifts_labels)
        if real:
            self._step_answers = answers
        if self.context is not None and shift is True:
            self.shift_seen = True
        if (self._loss_fn is not None and not isinstance(shift, torch.Tensor)
                and split_batch(self.plan)):
            if check_mean(self._loss_fn, value, out, target, shift=shift,
                          known=self._loss_checks, plan=self.plan, warn=False):
                self.not_a_mean_seen = True  # warned on every rank (take_refusal)
        weighted = self._own_weighted_count(value, out, target, real)
        if weighted is not None:  # the mean of a class-weighted loss module the model holds
            total = value.reshape(()) * weighted.to(value.device)
            total = torch.where(weighted > 0, total, torch.zeros_like(total))
            count = weighted
        else:
            total, count = loss_sum_and_count(value, target, shift=shift)
        if total.ndim:  # refused on every rank after the schedule (take_refusal)
            self.terms_seen = total.numel()
            total, count = total.sum(), count.sum()
        key = (self._accum_index, int(rows[0]))
        self._totals[key] = torch.stack([total.detach().float(), count.float()])
        return total * self._loss_scale if self._loss_scale != 1.0 else total

    def _own_weighted_count(self, value: Any, out: Any, target: Any, real: bool
                            ) -> torch.Tensor | None:
        """With ``loss_fn=None``: the labels' summed class weight when the model's own loss is
        the mean of a weighted ``nn.CrossEntropyLoss``/``nn.NLLLoss`` a last stage holds
        (:func:`plait.mean_probe.weighted_module_count`), by which the microbatch's loss is
        weighed as one device's; else None, after asking once whether the loss is a mean over
        the labels plait counts (:func:`plait.mean_probe.own_loss_unexplained`), which every
        rank warns about (:meth:`take_refusal`). Learnt on real microbatches only: a copy of
        what is known is asked on torch's shape-inference call."""
        if self._loss_fn is not None:
            return None
        known = self._loss_checks if real else dict(self._loss_checks)
        weighted = weighted_module_count(self._last_submods, value, out, target, known)
        if (weighted is None and real and split_batch(self.plan)
                and own_loss_unexplained(value, out, target, known, self.plan, warn=False)):
            self.own_loss_seen = True
        return weighted

    def sync_tied_gradients(self) -> None:
        """A weight several stages hold (embedding = head) gets its gradient in pieces, one per
        stage that uses it; summing them over the ranks holding the copies gives every copy the
        one-device gradient, so the copies, equal at the start, stay equal (Megatron's
        embedding group). Copies sharded by TP or FSDP are sharded alike: their local shards
        are summed. A frozen weight (``requires_grad=False``) is left without a gradient: a
        zero one would let the optimizer's weight decay move it. So is a weight no stage used
        this step (a head a branch skipped, a parameter the forward does not read), as on one
        device: which copies got a gradient is summed first, one all-reduce of a flag per
        copy per tie group, which then spares the gradient's all-reduce when none did."""
        tied = [(param, group) for param, group in self.tied if param.requires_grad]
        groups: dict[int, list[int]] = {}
        for i, (_, group) in enumerate(tied):
            groups.setdefault(id(group), []).append(i)
        used = [True] * len(tied)
        for members in groups.values():
            first = tied[members[0]][0]
            flags = torch.tensor([float(tied[i][0].grad is not None) for i in members],
                                 device=_local(first).device)
            torch.distributed.all_reduce(flags, group=tied[members[0]][1])
            for i, flag in zip(members, flags.tolist(), strict=True):
                used[i] = flag > 0
        for (param, group), any_grad in zip(tied, used, strict=True):
            if not any_grad:
                continue
            grad = param.grad
            if grad is None:
                grad = param.grad = torch.zeros_like(param)
            placements = getattr(param, "placements", None)
            if placements is not None and isinstance(grad, DTensor) \
                    and grad.placements != placements:
                # A vocabulary-parallel embedding's gradient can come back in another layout
                # than its weight's (Partial or Replicate where the weight is Shard(0)): lay it
                # out as the weight is, so the copies' local pieces line up.
                grad = param.grad = grad.redistribute(placements=placements)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            torch.distributed.all_reduce(local, group=group)

    def sync_data_gradients(self) -> None:
        """Average every gradient over ``grad_group`` (this stage's data and cp ranks) once the
        schedule has run, as DDP would. A zero-bubble schedule's stages compute the weight
        gradients in a later step with ``torch.autograd.grad``, outside DDP's reducer (which
        would reduce only what exists at the last input-gradient step), so their stages are
        not wrapped in DDP and reduce here instead.

        A parameter no rank of the group used this step (a branch every rank skipped, a head
        no microbatch reached) keeps no gradient, as on one device, where AdamW then leaves it
        alone: a zero gradient would let weight decay and momentum move it. Which ranks hold a
        gradient is summed first (one all-reduce of a flag per parameter, all in one tensor);
        a parameter some ranks used gets a zero gradient on the others before the average.
        Tensor-parallel parameters average their local shards (the group's ranks hold the
        same shard)."""
        if self.grad_group is None:
            return
        # once each (two stages of this rank can share a parameter), in the same order on
        # every rank of the group: they hold the same stages
        params = list({id(p): p for stage in self.stages for p in stage.submod.parameters()
                       if p.requires_grad}.values())
        if not params:
            return
        flags = torch.tensor([float(p.grad is not None) for p in params],
                             device=_local(params[0]).device)
        torch.distributed.all_reduce(flags, group=self.grad_group)
        grads = []
        for param, held in zip(params, flags.tolist(), strict=True):
            if held == 0:
                continue  # no rank used it: None, as on one device
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            placements = getattr(param, "placements", None)
            if placements is not None and isinstance(param.grad, DTensor) \
                    and param.grad.placements != placements:
                # a replicated weight's gradient can come back Partial over tp (sequence
                # parallel): lay it out as the weight is, so every rank's local piece is whole
                param.grad = param.grad.redistribute(placements=placements)
            grads.append(_local(param.grad))
        average_in_buckets(grads, self.grad_group)

    def own_buffers(self, owners: dict[str, int]) -> None:
        """Set up the buffers every stage holds that the forward writes, ``owners`` giving the
        stage that writes each: the other local stages put back their writes, and
        :func:`~plait.parallel.pipeline_buffers.broadcast_owned` gives every rank the owner's."""
        for stage in self.stages:
            stage.foreign = [named_buffer(stage.submod, n) for n, s in sorted(owners.items())
                             if s != stage.stage_index]
        holder = self.stages[0].submod
        self.owned = [(named_buffer(holder, n), self.stage_rank[s])
                      for n, s in sorted(owners.items())]

    def check_tied_settings(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer that gives the copies of a weight tied across stages different
        settings (collective over the job: every rank calls it, with the same answer).

        One device holds the weight once, in one parameter group. A pipeline holds a copy per
        stage under the stage's name for it (``head.weight`` on the last, ``embed.weight`` on
        the first), so an optimizer grouped by name ("no weight decay for embeddings") can put
        the copies in groups with another learning rate or weight decay: their gradients are
        summed (:meth:`sync_tied_gradients`) but their updates differ, and the copies drift
        apart, training neither model silently (measured: 3e-3 relative loss after 3 steps).
        A frozen copy takes no update and is not compared."""
        if not self.has_ties:
            return
        held: dict[int, dict[str, Any]] = {}
        for group in optimizer.param_groups:
            plain = {k: (v.tolist() if isinstance(v, torch.Tensor) else v)
                     for k, v in group.items() if k != "params"}
            for p in group["params"]:
                held[id(p)] = plain
        mine = [(one, stage, name, held.get(id(p))) for one, stage, name, p in self.tied_copies
                if p.requires_grad]
        everyone: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
        copies: dict[str, dict[tuple[int, str], dict[str, Any] | None]] = {}
        for part in everyone:
            for one, stage, name, settings in part:
                copies.setdefault(one, {})[(stage, name)] = settings
        for one, where in sorted(copies.items()):
            if len({repr(sorted((s or {}).items())) if s is not None else None
                    for s in where.values()}) <= 1:
                continue
            keys = sorted({k for s in where.values() if s for k in s
                           if len({repr((x or {}).get(k)) for x in where.values()}) > 1})
            described = "; ".join(
                f"as {name} (stage {stage}): "
                + (", ".join(f"{k}={s.get(k)!r}" for k in keys) if s is not None
                   else "not in the optimizer")
                for (stage, name), s in sorted(where.items()))
            raise ValueError(
                f"weight {one} is tied across pipeline stages, and the optimizer gives its "
                f"copies different settings ({described}): their updates would differ and the "
                f"copies drift apart, while one device steps one weight in one group. Put every "
                f"name of it in the same parameter group (the pipeline's stages name it as "
                f"above; group by tensor, e.g. by id(p), or match every name)")

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
        cls = schedule_class(self.plan.pp_schedule)
        m = self.plan.microbatches
        if self.plan.virtual_stages == 1 and self.plan.pp_schedule in ("gpipe", "1f1b"):
            return cls(self.stages[0], m, loss_fn=self._loss, scale_grads=False)
        return cls(self.stages, m, loss_fn=self._loss, scale_grads=False)

    def step(self, batch: Any, loss_fn: Callable | None, *, plan: Plan,
             device: torch.device, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of ``batch`` through the pipeline; gradients left in ``.grad``.

        Returns ``[loss sum, item count]`` over the batch on the rank holding the last stage,
        NaN elsewhere (see ``plait.train.forward_backward``). ``loss_scale`` (fp16): what the
        loss the schedule runs backward on is multiplied by; the totals stay unscaled.
        """
        self._loss_scale = loss_scale
        try:
            return self._run(batch, loss_fn, plan=plan, device=device, train=True)
        finally:
            self._loss_scale = 1.0

    def evaluate(self, batch: Any, loss_fn: Callable | None, *, plan: Plan,
                 device: torch.device) -> torch.Tensor:
        """Forward only, through the same schedule (torch's ``schedule.eval``: its
        microbatches, no backward, no gradients); ``[loss sum, item count]`` as :meth:`step`."""
        with torch.no_grad():
            return self._run(batch, loss_fn, plan=plan, device=device, train=False)

    def _run(self, batch: Any, loss_fn: Callable | None, *, plan: Plan, device: torch.device,
             train: bool) -> torch.Tensor:
        from ..batch_rows import refuse_ragged
        from ..train import COLLATE_EACH, autocast, split_microbatches

        seq = 0
        extra: dict[str, torch.Tensor] = {}
        m, accum = plan.microbatches, plan.grad_accum
        # Per microbatch, its keyword inputs that are not one row per example (see
        # TimedStage.ragged); None for a batch cut by rows.
        ragged: list[dict[str, Any]] | None = None
        if isinstance(batch, MicroBatches):
            if self.context is not None:
                raise ValueError(f"cp={self.context.size} cuts each sequence of the batch, and "
                                 f"this batch comes as {len(batch.parts)} micro-batches "
                                 f"collated one by one (plait.MicroBatches): give one batch of "
                                 f"one row per example under cp, or run with cp=1")
            laid_out, probe, ragged = self._lay_out_parts(batch, loss_fn, m * accum)
        else:
            if self.context is not None:
                # Every stage runs on this rank's slice of each sequence (its activations are
                # what the stages send): cut before the layout; attention over the whole
                # sequence while the schedule runs (forward and backward)
                from .context import split_batch

                batch, seq, extra = split_batch(batch, self.context)
            laid_out = stage_inputs(batch, loss_fn, self.signature, self.model_name)
            if extra:  # position_ids beside a tensor input: every stage computes positions
                laid_out = replace(laid_out, every={**laid_out.every, **extra})
            probe = laid_out
        rows = _rows(laid_out.first)
        if rows % (m * accum):
            raise ValueError(f"batch of {rows} rows does not split into microbatches={m}"
                             + (f" x grad_accum={accum}" if accum > 1 else "")
                             + f" equal parts; make the per-replica batch a multiple of "
                             f"{m * accum}")
        if m * accum > 1 and ragged is None:  # the schedule and accumulation cut by rows
            parts = f"microbatches={m}" + (f" x grad_accum={accum}" if accum > 1 else "")
            refuse_ragged({**laid_out.every, **laid_out.last_only}, f"{parts} pipeline parts",
                          "pp=1" if m > 1 else "grad_accum=1", rows=rows, fix=COLLATE_EACH)
        self._check_shapes(laid_out, train)  # the ragged inputs vary by batch: not in it
        # The first step's checks run a meta-device forward: on the first micro-batch where
        # the inputs come per micro-batch (its flat ids and offsets fit its own rows only).
        if self.check_split is not None:  # the first step: every rank, before any sends
            add_zero_stand_ins([s.submod for s in self.stages], self.check_split(probe))
            self.check_split = None
        if self.find_owners is not None:
            self.own_buffers(self.find_owners(probe))
            self.find_owners = None
        if self.check_loss is not None:
            self.check_loss(probe, loss_fn)
            self.check_loss = None
        # Under compile, warmed on the first microbatch cut by rows; with ragged inputs the
        # stages compile on the schedule's first microbatch instead.
        if (self.find_inputs is not None and train not in self._warmed
                and ragged is None):
            self._warm(laid_out, train, plan=plan, device=device)
            self._warmed.add(train)
        self._loss_fn = loss_fn
        self._totals = {}
        if self._schedule is None:
            self._schedule = self._build_schedule()
        chunk = rows // accum
        self._microbatch_rows = chunk // m
        kwargs = {**laid_out.every, **(laid_out.last_only if self.has_last else {})}
        if self.has_last and self.token_ids_to_last:
            kwargs[TOKEN_IDS] = laid_out.first
        unused = None
        if train and self.unused_group is not None:
            unused = UnusedTracker(nn.ModuleList([s.submod for s in self.stages]))
        for stage in self.stages:
            stage.unused = unused
        for a, (first, part_kwargs, part_targets) in enumerate(zip(
                split_microbatches(laid_out.first, accum), split_microbatches(kwargs, accum),
                split_microbatches(laid_out.targets, accum), strict=True)):
            self._targets, self._accum_index = part_targets, a
            for stage in self.stages:
                stage.ragged = None if ragged is None else ragged[a * m:(a + 1) * m]
            index = torch.arange(chunk, device=device)
            with self._loss_context(), autocast(plan, device), self._sequence(seq):
                if train:
                    self._schedule.step(*((first,) if self.has_first else ()),
                                        target=index if self.has_last else None,
                                        losses=[] if self.has_last else None,
                                        return_outputs=False, **part_kwargs)
                else:  # eval() passes return_outputs on to step()
                    self._schedule.eval(*((first,) if self.has_first else ()),
                                        target=index if self.has_last else None,
                                        losses=[] if self.has_last else None,
                                        return_outputs=False, **part_kwargs)
            if train:
                self.timeline.next_step()
        self._targets = None
        for stage in self.stages:
            stage.ragged = None
        if self._step_answers is not None:  # the last real microbatch's (see _loss)
            self._first_label_skipped, self._step_answers = self._step_answers, None
        for stage in self.stages:
            stage.unused = None
        if unused is not None:  # before the tied sum, which gives its copies a gradient
            unused.finish(self.unused_group)
        if train:
            self.sync_data_gradients()
            self.sync_tied_gradients()
            if self.owned:
                broadcast_owned(self.owned, self.pp_group)
        if not self.has_last:
            return torch.full((2,), float("nan"), device=device)
        return torch.stack(list(self._totals.values())).sum(0).to(device)

    def _lay_out_parts(self, batch: MicroBatches, loss_fn: Callable | None, parts: int
                       ) -> tuple[StageInputs, StageInputs, list[dict[str, Any]]]:
        """A step's micro-batches collated one by one, laid out for the schedule: (the inputs
        that are one row per example, each part's rows one after another, which torch's
        schedule cuts back into the same parts; part 0 laid out alone, for the first step's
        checks; per part, its keyword inputs that are not one row per example, which the
        stages add by microbatch, see :attr:`TimedStage.ragged`)."""
        from ..batch_rows import ragged_entries

        if len(batch.parts) != parts:
            raise ValueError(f"the batch comes as {len(batch.parts)} micro-batches collated one "
                             f"by one (plait.MicroBatches), and the pipeline runs "
                             f"microbatches={self.plan.microbatches} x grad_accum="
                             f"{self.plan.grad_accum} = {parts}: make the loader under this "
                             f"plan (run.loader collates as many), or give {parts} parts")
        outs = [stage_inputs(p, loss_fn, self.signature, self.model_name) for p in batch.parts]
        sizes = [_rows(o.first) for o in outs]
        if len(set(sizes)) > 1:
            first = next(iter(self.signature.parameters), "first")
            raise ValueError(
                f"the micro-batches of this batch (plait.MicroBatches) have {sizes} rows in "
                f"{self.model_name}.forward's first input {first!r}, which the stages chain: "
                f"torch's pipeline sends activations of one shape between stages, so every "
                f"part needs as many rows. Where the rows are not examples (a batch of graphs, "
                f"whose rows are nodes), pad each part in the collate_fn to one row count "
                f"(padding nodes without edges, left out of the pooling and the loss), or "
                f"train without pp (dp=N, or dp_shard=N,zero=3 for memory)")
        odd = {k for o in outs for k, v in {**o.every, **o.last_only}.items()
               if ragged_entries(v, sizes[0])[1]}
        for o in outs:
            _refuse_ragged_targets(o.targets, sizes[0])
        try:
            laid_out = StageInputs(
                torch.cat([o.first for o in outs]),
                {k: _cat_rows([o.every[k] for o in outs]) for k in outs[0].every
                 if k not in odd},
                {k: _cat_rows([o.last_only[k] for o in outs]) for k in outs[0].last_only
                 if k not in odd},
                _cat_rows([o.targets for o in outs]))
        except RuntimeError as exc:
            raise ValueError(f"the micro-batches of this batch (plait.MicroBatches) do not "
                             f"join into one pipeline input ({str(exc).rstrip('.')}): a "
                             f"pipeline takes one shape for every microbatch, so pad every "
                             f"part to one length") from exc
        ragged = [{k: v for k, v in {**o.every, **(o.last_only if self.has_last else {})
                                     }.items() if k in odd} for o in outs]
        return laid_out, outs[0], ragged

    def take_refusal(self) -> list[float]:
        """[1.0 when this rank's last step computed a loss that context parallelism refuses
        (one that shifts the labels itself), else 0.0; the number of terms of a loss that
        returned a dict of (sum, count) pairs, else 0.0; 1.0 when its loss function was first
        found not to be a mean over what plait counts, else 0.0; 1.0 when the model's own loss
        was first found to be neither a mean over its labels nor a weighted loss module's,
        else 0.0]; reset for the next step.
        Summed over the pipeline and data ranks, they let every rank refuse (or warn)
        together (:func:`refuse_if_seen`)."""
        seen, self.shift_seen = self.shift_seen, False
        terms, self.terms_seen = self.terms_seen, 0
        not_a_mean, self.not_a_mean_seen = self.not_a_mean_seen, False
        own, self.own_loss_seen = self.own_loss_seen, False
        return [1.0 if seen else 0.0, float(terms), 1.0 if not_a_mean else 0.0,
                1.0 if own else 0.0]

    def _sequence(self, seq: int) -> contextlib.AbstractContextManager:
        """Under context parallelism: attention over the whole ``seq``-token sequence."""
        if self.context is None:
            return contextlib.nullcontext()
        from .context import cp_attention

        return cp_attention(self.context, seq)

    def _warm(self, laid_out: StageInputs, train: bool, *, plan: Plan,
              device: torch.device) -> None:
        """Compile this rank's stages on their first microbatch's shapes, every rank at once,
        before the schedule's sends would make them compile one after another
        (:mod:`plait.parallel.pipeline_warmup`)."""
        from ..train import autocast

        assert self.find_inputs is not None
        rows = _rows(laid_out.first) // (plan.microbatches * plan.grad_accum)
        every = {**laid_out.every, **(laid_out.last_only if self.has_last else {})}
        first, kwargs = first_microbatch(laid_out.first, every, rows)
        metas = self.find_inputs(first, {k: kwargs[k] for k in laid_out.every}, train)
        if metas is None:  # shapes not known before the sends: torch's order
            return
        try:
            with autocast(plan, device):
                warm_stages([(s.stage_index, s.submod) for s in self.stages], metas, first,
                            kwargs, train=train, device=device, buffers_kept=_buffers_kept)
        except Exception:  # noqa: BLE001 - e.g. a forward that needs real hidden states: the
            pass  # schedule compiles on them (a real error shows there, on the real inputs)

    def _check_shapes(self, laid_out: StageInputs, train: bool) -> None:
        """Refuse a batch whose input shapes differ from those the stages were set up for.

        torch's stages size their receive buffers from the shapes they inferred, and receive
        into them whatever the previous stage sends: a shorter sequence arrived as the old
        length's buffer, partly stale, and the loss ran on it (a label count mismatch at best,
        a silently wrong loss when the sizes happen to agree). Re-inferring on a change is a
        forward of every stage with collectives inside it (FSDP's gathers), which data replicas
        that padded to other lengths would enter out of step with each other; so one shape per
        run, checked on every rank of the pipeline before anything is sent.
        """
        shapes = (_shapes(laid_out.first), _shapes(laid_out.every), _shapes(laid_out.last_only))
        if self._built_for is None or self._built_for[0] != train:
            self._built_for = (train, shapes)  # torch infers (again) at this call
            return
        built = self._built_for[1]
        if shapes != built:
            raise ValueError(
                f"pipeline parallelism (pp={self.plan.pp}) sets its stages up for one input "
                f"shape: this batch's inputs are {_describe(shapes)}, the stages were set up "
                f"for {_describe(built)}; give every batch one shape (a collate_fn that pads "
                f"to a fixed length, the same batch_size for every step)")


# What one all-reduce of sync_data_gradients carries at most (DDP's default bucket size).
BUCKET_BYTES = 25 * 2**20


def average_in_buckets(grads: list[torch.Tensor], group: Any) -> None:
    """Average ``grads`` (plain tensors, in the same order on every rank of ``group``) over
    ``group`` in place, flattened into buckets of up to :data:`BUCKET_BYTES` per dtype and
    device: one all-reduce per bucket rather than one per parameter, as DDP's reducer does
    (whose buckets a zero-bubble schedule's deferred weight gradients miss)."""
    size = torch.distributed.get_world_size(group)
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for grad in grads:
        kinds.setdefault((grad.dtype, grad.device), []).append(grad)
    for same in kinds.values():
        bucket: list[torch.Tensor] = []
        held = 0
        for i, grad in enumerate(same):
            bucket.append(grad)
            held += grad.numel() * grad.element_size()
            if held >= BUCKET_BYTES or i == len(same) - 1:
                flat = torch.cat([g.reshape(-1) for g in bucket])
                torch.distributed.all_reduce(flat, group=group)
                flat.div_(size)
                for g, part in zip(bucket, flat.split([g.numel() for g in bucket]),
                                   strict=True):
                    g.copy_(part.view_as(g))
                bucket, held = [], 0


def _refuse_ragged_targets(targets: Any, rows: int) -> None:
    """Refuse targets of a micro-batch collated on its own (plait.MicroBatches) that are not
    one row per example, naming the entry: the last stage's loss takes each microbatch's
    targets by row (torch's schedule hands it row indices), so a flat list of boxes with each
    box's image index would be read as other rows."""
    from ..batch_rows import ragged_entries

    _, odd = ragged_entries(targets, rows)
    if odd:
        where, n = odd[0]
        raise ValueError(
            f"the targets' entry {where} has {n} rows in a micro-batch of {rows} examples: "
            f"not one row per example (a flat list of boxes or symbols beside their image or "
            f"length), which a pipeline's loss cannot take by microbatch (torch's schedule "
            f"gives it the rows of each); pad it to one row per example in the collate_fn, or "
            f"train without pp (dp=N, or dp_shard=N,zero=3 for memory)")


# How many flags PipelineRunner.take_refusal gives.
REFUSAL_FLAGS = 4


def refuse_if_seen(flags: list[float], cp: int, stages_with_loss: int = 1,
                   plan: Plan | None = None) -> None:
    """Raise, on every rank, when the summed :meth:`PipelineRunner.take_refusal` flags say a
    last stage computed a loss that shifts the labels under context parallelism, or a loss of
    several terms (``stages_with_loss``: how many last stages' counts were summed); warn, on
    every rank, when a last stage found its loss function not to be a mean over what plait
    counts (``plan``: the run's, which the warning names)."""
    if flags[2] > 0 and plan is not None:
        import warnings

        from ..mean_probe import not_a_mean_message
        from ..warn import user_stacklevel

        warnings.warn(not_a_mean_message(None, "the items plait counts", plan),
                      stacklevel=user_stacklevel())
    if flags[3] > 0 and plan is not None:
        import warnings

        from ..mean_probe import own_loss_message
        from ..warn import user_stacklevel

        warnings.warn(own_loss_message(plan), stacklevel=user_stacklevel())
    if flags[0] > 0:
        from .context import SHIFTED_LABELS

        raise ValueError(SHIFTED_LABELS.format(cp=cp))
    if flags[1] > 0:
        raise ValueError(TERMS_UNDER_PP.format(terms=round(flags[1] / max(stages_with_loss, 1))))


def _shapes(value: Any) -> Any:
    """The shapes of every tensor in a tensor/tuple/list/dict structure (None elsewhere)."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, dict):
        return tuple((k, _shapes(v)) for k, v in sorted(value.items()))
    if isinstance(value, (tuple, list)):
        return tuple(_shapes(v) for v in value)
    return None


def _describe(shapes: tuple[Any, ...]) -> str:
    first, every, last = shapes
    extra = ", ".join(f"{k} {v}" for k, v in (*every, *last) if v is not None)
    return f"{first}" + (f" ({extra})" if extra else "")


def _cat_rows(values: list[Any]) -> Any:
    """Structures alike (tensors, dicts, tuples, lists of them) joined along dim 0; a 0-dim
    tensor or other leaf as the first holds it."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(values) if first.ndim else first
    if isinstance(first, dict):
        return {k: _cat_rows([v[k] for v in values]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_cat_rows(list(vs)) for vs in zip(*values, strict=True))
    return first


def _take_rows(value: Any, rows: torch.Tensor) -> Any:
    """The rows ``rows`` (dim 0) of every tensor in a tensor/tuple/list/dict structure."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, rows.to(value.device))
    if isinstance(value, dict):
        return {k: _take_rows(v, rows) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_take_rows(v, rows) for v in value)
    return value


def _first_parameter(model: nn.Module) -> str:
    """The name of ``model.forward``'s first positional parameter (what a pipeline chains)."""
    signature = _signature(model)
    params = [] if signature is None else [
        p.name for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return params[0] if params else "the first input"


def _signature(model: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward without a readable signature (a C builtin)
        return None


def split_checker(model: nn.Module, path: str, specs: list[StageSpec]
                  ) -> Callable[[StageInputs], set[str]] | None:
    """A check that the stages chain, run by every rank on the first step's inputs before the
    schedule sends anything: the stage modules of a meta-device replica, each fed what the
    previous one hands on. A forward that never reaches what a stage sends on (it skips its
    last block, :func:`~plait.parallel.pipeline_split.hand_on`) is then refused on every rank
    with one line, instead of failing on the first stage's rank inside torch's runtime while
    the other ranks wait for it. Written here because torch's stages infer shapes rank by
    rank, through sends. A forward that does not run on the meta device (data-dependent code) is not
    checked.

    When torch.fx cannot trace the forward that calls the blocks, the stages were built as if
    no block's output is added to its input in that forward; the check runs it once and
    returns the modules whose output is (``h = h + block(h)``: their stand-ins must add zero,
    not pass the hidden states on, which would double them), for
    :func:`~plait.parallel.pipeline_split.add_zero_stand_ins`."""
    replica = meta_replica(model)
    if replica is None:
        return None
    untraced = additive_modules(model, path) is None and not any(
        is_hf_model(m) for m in model.modules())  # HF forwards: their adapter handles them

    def check(inputs: StageInputs) -> set[str]:
        x, kwargs = on_meta(inputs.first), {k: on_meta(v) for k, v in inputs.every.items()}
        if not specs[0].chained:  # not seen at the split: asked on the real inputs
            broken = chain_break(replica, path, x, kwargs)
            if isinstance(broken, tuple):
                raise ValueError(unchained_message(type(model).__name__, path or
                                                   type(model).__name__, broken))
        crossed = side_input(replica, path, x, kwargs)
        if crossed is not None:  # a later stage would run without it
            raise ValueError(side_input_message(model, path, crossed))
        source = chain_source(replica, path, x, kwargs) if kwargs else None
        if source is not None:  # later stages would give the hidden states to another input
            raise ValueError(chain_source_message(
                type(model).__name__, _first_parameter(model), path or type(model).__name__,
                source))
        found = additive_by_running(replica, path, x, kwargs) if untraced else set()
        for spec in specs[:-1]:
            stage = build_stage_module(replica, path, spec)
            try:
                with torch.no_grad():
                    x = stage(x, **kwargs)
            except StageOutputError:
                raise
            except Exception:  # noqa: BLE001 - not runnable on meta: left to the real run
                break
        return found

    return check


def loss_checker(model: nn.Module, path: str, specs: list[StageSpec]
                 ) -> Callable[[StageInputs, Callable | None], None] | None:
    """A check, run by every rank on the first step's inputs and loss before the schedule sends
    anything, that the loss can be computed on the last stage: one forward and loss of a
    meta-device replica (:func:`~plait.parallel.pipeline_chain.loss_reads_before`). A loss that
    reads what earlier stages' blocks compute besides the hidden states they hand on (a
    balance loss gathered from every block) is refused on every rank, naming those blocks;
    without the check, a forward that skips what a stand-in lacks trains on the last stage's
    part of that term, silently."""
    replica = meta_replica(model)
    if replica is None:
        return None
    last = specs[-1]
    name = type(model).__name__

    def check(inputs: StageInputs, loss_fn: Callable | None) -> None:
        from ..train import model_loss

        kwargs = {k: on_meta(v) for k, v in {**inputs.every, **inputs.last_only}.items()}
        targets = on_meta(inputs.targets)
        read = loss_reads_before(replica, path, last.start, on_meta(inputs.first), kwargs,
                                 lambda out: model_loss(out, loss_fn, targets))
        if not read:
            return
        held = f"{read[0]}" if len(read) == 1 else f"{read[0]} .. {read[-1]}"
        raise ValueError(
            f"the loss reads what {held} compute besides the hidden states they pass on "
            f"(e.g. a mixture-of-experts balance loss each block keeps or returns): under "
            f"pp={last.num_stages} the loss is computed on the last stage, where those blocks "
            f"(held by earlier stages) compute nothing, so {name} would train on the last "
            f"stage's part of that term only. Run with pp=1 (dp_shard/zero or tp split the "
            f"model instead), or leave that term out of the loss under a pipeline")

    return check


def owner_finder(model: nn.Module, path: str, specs: list[StageSpec]
                 ) -> Callable[[StageInputs], dict[str, int]] | None:
    """Which stage's part of the forward writes each buffer every stage holds, asked on the
    first step's inputs (:func:`~plait.parallel.pipeline_buffers.buffer_owners`) of a
    meta-device replica; None when no buffer is on every stage (or the model cannot be
    copied: then each rank keeps what its stages wrote, as without this)."""
    names = every_stage_buffers([build_stage_module(model, path, s) for s in specs])
    replica = meta_replica(model) if names else None
    if replica is None:
        return None
    bounds = [(s.start, s.end) for s in specs]

    def find(inputs: StageInputs) -> dict[str, int]:
        return buffer_owners(replica, path, bounds, names, on_meta(inputs.first),
                             {k: on_meta(v) for k, v in inputs.every.items()})

    return find


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
            looped = [s for s in PP_SCHEDULES if s != "zbv"]  # zbv alone places stages in a V
            stages = ", ".join(str(s) for s in sorted(names))
            raise ValueError(f"weight {next(iter(names.values()))} is tied across stages "
                             f"{stages}, which schedule {plan.pp_schedule} puts on one rank; "
                             f"untie it (e.g. tie_word_embeddings=False) or use a schedule "
                             f"that places stages in a loop: {', '.join(looped)}")
        mine = None
        for coord in ranks[0].reshape(-1).tolist():
            index = (ranks[0] == coord).nonzero()[0].tolist()
            # (p,) + tuple(...): mypy reads a starred subscript as Python 3.11 syntax
            members = [int(ranks[(p,) + tuple(index)]) for p in pp_ranks]
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
        # Two stages of this rank (an interleaved schedule) can hold one parameter object (a
        # parameter of the model's own module, which every stage shares): its gradient already
        # sums both stages' shares, and it is summed over the ranks once.
        held: dict[int, tuple[nn.Parameter, bool]] = {}
        for stage, name in names.items():
            if stage in local and group is not None:
                param = _param_named(local[stage], name)
                copy = held.get(id(param), (param, True))[1] and stage != first
                held[id(param)] = (param, copy)
        for param, copy in held.values():
            if copy:
                param._plait_tied_copy = True  # type: ignore[attr-defined]
            out.append((param, group))
    return out


def _named_copies(model: nn.Module, ties: list[dict[int, str]], local: dict[int, nn.Module]
                  ) -> list[tuple[str, int, str, nn.Parameter]]:
    """(the one-device model's name, stage, the stage's name, the laid-out copy) of every copy
    of a tied weight this rank holds."""
    first = {id(p): n for n, p in model.named_parameters()}
    every = dict(model.named_parameters(remove_duplicate=False))
    out = []
    for names in ties:
        for stage, name in names.items():
            if stage in local:
                one = first.get(id(every[name]), name) if name in every else name
                out.append((one, stage, name, _param_named(local[stage], name)))
    return out


def _one_device_names(model: nn.Module, ties: list[dict[int, str]], mine: list[int]
                      ) -> dict[str, str]:
    """{the name a stage of this rank (``mine``) holds a tied weight by: the one-device model's
    name for it} where they differ (``named_parameters`` names a shared parameter once, by
    its first name)."""
    first = {id(p): n for n, p in model.named_parameters()}
    every = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for names in ties:
        for stage, name in names.items():
            if stage not in mine:
                continue
            own = first.get(id(every[name])) if name in every else None
            if own is not None and own != name:
                out[name] = own
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece, a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _param_named(module: nn.Module, name: str) -> nn.Parameter:
    """The parameter ``name`` (a name in the unwrapped stage) of a laid-out stage module."""
    from .units import by_canonical_name

    return by_canonical_name(module.named_parameters(remove_duplicate=False), name,
                             "tied weight")  # type: ignore[return-value]


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
                           "run.step(model, batch, loss_fn, opt) to train, "
                           "run.evaluate(model, batch, loss_fn) for a loss without training, "
                           "or load run.full_state_dict(model) into a one-device copy of the "
                           "model for anything else (generation); a model the loop only calls "
                           "(a frozen teacher giving distillation targets) needs no pipeline: "
                           "leave it out of run.parallelize and move it to the device, "
                           "teacher.to(run.device)")


def pp_refusal(model: nn.Module, plan: Plan,
               chains: dict[str, tuple[str, str] | bool | None] | None = None,
               example: Example | None = None) -> str | None:
    """Why ``model`` cannot be split as ``plan`` asks, or None: what :func:`apply_pipeline`
    would refuse before its first step (the split, every stage's module, a weight tied across
    stages one rank holds), asked before anything is laid out (the planner asks it about the
    layouts it would pick). Stage modules are shallow copies (the blocks are shared, not
    copied), built and dropped; the RNG is restored after the fake-tensor forwards. Not
    covered: what only the real first step shows (a forward that reads a stage's input).
    ``chains``, ``example``: as for :func:`~plait.parallel.pipeline_split.plan_stages`."""
    try:
        with torch.random.fork_rng(devices=[]):
            check_schedule_args(plan.pp_schedule, plan.pp, plan.microbatches,
                                plan.virtual_stages)
            path, specs = plan_stages(model, plan, chains, example)
            # Stages first: their refusals name the model's own reason (T5's position bias,
            # computed in block 0 and handed to every later block, is also a side input).
            for spec in specs:
                build_stage_module(model, path, spec)
            crossed = _side_input(model, path, example)
            if crossed is not None:
                return crossed
            source = _chain_source(model, path, example)
            if source is not None:
                return source
            owner = stage_to_rank(plan.pp_schedule, plan.pp, plan.virtual_stages)
            for names in shared_parameters(model, path, specs):
                if len({owner[s] for s in names}) == 1:
                    return (f"weight {next(iter(names.values()))} is tied across stages that "
                            f"{plan.pp_schedule} puts on one rank")
    except ValueError as exc:
        return str(exc).split("; ")[0]
    return None


def _side_input(model: nn.Module, path: str, given: Example | None = None) -> str | None:
    """Why a block of ``path`` cannot start a pipeline stage: it takes a second tensor the
    forward computed before it (:func:`~plait.parallel.pipeline_chain.side_input`), which a
    later stage is never sent; None where none is seen (or no input can be guessed). Run on
    ``given`` (the user's input) where there is one."""
    from .pipeline_split import meta_call

    call = meta_call(model, given)
    found = None if call is None else side_input(call[0], path, call[1], call[2])
    return None if found is None else side_input_message(model, path, found)


def _chain_source(model: nn.Module, path: str, given: Example | None = None) -> str | None:
    """Why the blocks of ``path`` cannot be chained by a pipeline: they run on another input
    than the forward's first (:func:`~plait.parallel.pipeline_chain.chain_source`); None
    where they do not (or no input can be guessed). Run on ``given`` where there is one."""
    from .pipeline_split import meta_call

    call = meta_call(model, given)
    if call is None:
        return None
    replica, x, kwargs = call
    first = _first_parameter(model)
    if x is None and first in kwargs:  # a dict of inputs by name: the first one chains
        kwargs = dict(kwargs)
        x = kwargs.pop(first)
    source = chain_source(replica, path, x, kwargs) if kwargs else None
    return None if source is None else chain_source_message(
        type(model).__name__, first, path or type(model).__name__, source)


def side_input_message(model: nn.Module, path: str, found: tuple[str, int]) -> str:
    """The refusal for a block given a tensor computed before it (``found``: the block's
    name and the argument's position), naming the fix."""
    block, position = found
    return (f"{block} takes a tensor the forward computed before it as its argument "
            f"{position + 1} (a skip connection across the blocks of "
            f"{path or type(model).__name__}, as a U-Net's decoder takes the encoder's "
            f"output), and a pipeline stage is sent only the previous stage's output: run "
            f"with pp=1 (data parallelism, dp_shard=N,zero=3 to shard its state)")


def refuse_split_backward_temperature(model: nn.Module, plan: Plan) -> None:
    """Refuse a zero-bubble schedule on a contrastive model (a ``logit_scale`` or
    ``logit_bias``, :mod:`plait.parallel.contrastive`). Such a model returns its temperature
    (``self.logit_scale.exp()``) from the last stage beside the embeddings: an output computed
    from a parameter alone, whose op saved that very output for its backward. torch's split
    backward (ZB-V, interleaved zero bubble) frees a last stage's outputs with ``detach_()``
    once their input gradients exist and computes the weight gradients after that, through
    the freed tensor ("Trying to use a saved tensor that has been detached in-place").
    Handing the outputs on as views gets past it, but then trains another temperature (1.4e-2
    off one device's after 3 SGD steps on the tests' two-tower model), so the schedule is
    refused up front instead."""
    from .contrastive import contrastive_parameters

    if plan.pp_schedule not in ZERO_BUBBLE_SCHEDULES:
        return
    found = contrastive_parameters(model)
    if found:
        raise ValueError(
            f"pp_schedule='{plan.pp_schedule}' cannot train {type(model).__name__}'s "
            f"{found[0]} (a contrastive temperature the last stage returns): a zero-bubble "
            f"schedule computes the weight gradients after the last stage's outputs are "
            f"freed, and an output computed from a parameter alone (logit_scale.exp()) fails "
            f"there; use pp_schedule='1f1b', 'gpipe' or 'interleaved_1f1b'")


def apply_pipeline(model: nn.Module, mesh: Mesh, plan: Plan, *, device: torch.device,
                   parallelize_stage: Callable[..., nn.Module],
                   say: Callable[[str], None] | None = None,
                   example: Example | None = None) -> PipelinedModel:
    """Split ``model`` into ``plan.pp x plan.virtual_stages`` stages, keep this rank's, and
    return them with their schedule, recorded in the returned model's ``Layout``. ``say``
    tells the user what the layout decided (an inferred tensor-parallel plan). ``example``:
    the user's input the split's checks and an inferred tensor-parallel plan run on, in place
    of a guessed one."""
    check_schedule_args(plan.pp_schedule, plan.pp, plan.microbatches, plan.virtual_stages)
    refuse_split_backward_temperature(model, plan)
    path, specs = plan_stages(model, plan, example=example)
    if plan.cp > 1:
        specs = [replace(s, context_parallel=True) for s in specs]
    pp_mesh = mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()
    mine = local_stages(plan.pp_schedule, plan.pp, plan.virtual_stages, pp_rank)
    modules = [build_stage_module(model, path, specs[s]) for s in mine]
    packer = OutputPacker()
    for m, s in zip(modules, mine, strict=True):
        if specs[s].is_last:
            packer.install(m)  # before the layout: DDP/FSDP call the packed forward
    ties = shared_parameters(model, path, specs)
    groups = _tie_groups(ties, mesh, plan)  # collective: every rank creates every group
    stage_plan = plan_for_stages(model, plan, say, example)
    if stage_plan.zero <= 1 and stage_plan.tp == 1 and not stage_plan.find_unused and any(
            model.get_parameter(n).requires_grad for n in held_on_path(model, path)):
        # Every stage holds the parameters on the root module (and on the modules on the path
        # to the blocks), and a stage may not use them (a gain applied after the blocks): DDP's
        # reducer would wait for that copy's gradient and fail the next step ("Expected to have
        # finished reduction in the prior iteration"). find_unused makes DDP reduce a zero for
        # it there; the sum over the stages is unchanged. Costs DDP's walk of the graph each
        # forward, on such models only.
        stage_plan = replace(stage_plan, find_unused=True)
    # The split's check copies the model to the meta device before the layout changes its
    # blocks in place: a compiled block's forward is bound to the real block, so a copy taken
    # after it would run the real (compiled) block on meta tensors, which fails (the check then
    # skipped, residual stand-ins not found) and leaves torch.compile a frame at the whole
    # batch's shape, after which the microbatches compile with a dynamic batch size. The
    # buffer owners' replica is copied then too, for the same reason.
    check_split = split_checker(model, path, specs)
    find_owners = owner_finder(model, path, specs)
    check_loss = loss_checker(model, path, specs)
    find_inputs = stage_input_finder(model, path, specs) if plan.compile else None
    modules = [parallelize_stage(m, mesh, stage_plan, device=device) for m in modules]
    stages = [TimedStage(m, s, len(specs), device, group=pp_mesh.get_group())
              for m, s in zip(modules, mine, strict=True)]
    for stage in stages:
        stage.plan = plan
    # Only the last stage holds the head, so only it can need loss_parallel().
    loss_parallel = any(layout_of(m).loss_parallel
                        for m, s in zip(modules, mine, strict=True) if specs[s].is_last)
    runner = PipelineRunner(stages, plan, rank=torch.distributed.get_rank(),
                            loss_parallel=loss_parallel, signature=_signature(model),
                            model_name=type(model).__name__,
                            shifts_labels=shifts_labels(model), packer=packer)
    runner.check_split = check_split
    runner.token_ids_to_last = is_hf_model(model) and pools_by_pad_token(model)
    runner.find_owners = find_owners
    runner.check_loss = check_loss
    runner.find_inputs = find_inputs if warms_locally(modules) else None
    runner.stage_rank = stage_to_rank(plan.pp_schedule, plan.pp, plan.virtual_stages)
    runner.pp_group = pp_mesh.get_group()
    if plan.find_unused and (plan.zero >= 2 or plan.tp > 1):  # FSDP2 reduces zeros for them
        # The data replicas of these stages (and their cp ranks, which read other positions
        # of the same rows); tp peers read the same rows and take the same branches.
        from ..mesh import DP_CP

        runner.unused_group = mesh[DP_CP if plan.cp > 1 else "dp"].get_group()
    runner.tied = _local_ties(ties, groups, dict(zip(mine, modules, strict=True)))
    runner.has_ties = bool(ties)
    runner.tied_copies = _named_copies(model, ties, dict(zip(mine, modules, strict=True)))
    if plan.cp > 1:  # the whole model must take the slice's positions (context_group)
        runner.context = context_group(model, mesh)
    if reduces_after_schedule(plan):
        from ..mesh import DP_CP

        runner.grad_group = mesh[DP_CP if plan.cp > 1 else "dp"].get_group()
    layout = Layout(applied=("pipeline", *layout_of(modules[0]).applied), stages=tuple(modules),
                    stage_specs=tuple(specs[s] for s in mine), pipeline=runner,
                    loss_parallel=loss_parallel, tied_names=_one_device_names(model, ties, mine))
    return record_layout(PipelinedModel(modules), layout)
