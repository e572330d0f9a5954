"""What ``parallelize`` did to a model, as one typed record the rest of plait reads.

The train step, the correctness check, the memory tracker and the traffic prediction all need to
know a few facts about a laid-out model: which parallelisms were applied, whether it is split
into pipeline stages (and which), and whether the loss must run inside torch's
``loss_parallel()`` because the head keeps vocabulary-sharded logits. The step that decides a
fact records it here; nothing else is attached to the user's model.

The record lives in one attribute of the returned model (``LAYOUT_ATTR``), so any function that
receives the model (``train_step``, ``plait.check.full_state``, the memory tracker) finds it
without a ``Run`` at hand; read it with :func:`layout_of`, never with ``getattr``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch.nn as nn

if TYPE_CHECKING:
    from .bn_running import RunningStats
    from .buffer_sync import WrittenBuffers
    from .context import ContextGroup
    from .pipeline import PipelineRunner
    from .pipeline_split import StageSpec

LAYOUT_ATTR = "_plait_layout"
M = TypeVar("M", bound=nn.Module)


@dataclass(frozen=True)
class Layout:
    """How a model was laid out on this rank.

    ``applied``: the composition steps that ran, in order (``"pipeline"``, ``"tensor_parallel"``,
    ``"activation_checkpointing"``, then one of ``"zero"``, ``"replicate"``, ``"ddp"``).
    ``stages``: this rank's pipeline stage modules (their parameter names are the full model's);
    empty without a pipeline. ``stage_specs``: the block range of each of those stages.
    ``pipeline``: the schedule runner that steps them. ``loss_parallel``: the head is
    vocabulary-parallel, so the loss and its backward run inside ``loss_parallel()``.
    ``first_label_skipped``: per loss function, whether its scalar mean leaves out each row's
    first label (``plait.loss.first_label_skipped``); filled in by the first steps.
    ``loss_checks``: what ``plait.mean_probe`` learnt of the losses (whether a scalar is a mean
    over its counted items, a model's own class-weighted loss module).
    ``tied_names``: a weight tied across pipeline stages, under the name a stage holds it by
    where the one-device model names it otherwise (the last stage's ``head.weight``:
    ``embed.weight``); checkpoints name its optimizer state as the one-device model does.
    ``context``: under context parallelism, this rank's cp group
    (``plait.parallel.context.ContextGroup``): the train step splits each batch's sequences
    over it and runs attention over the whole sequence.
    ``running_stats``: under FSDP2 without ``sync_bn``, the BatchNorm running statistics that
    are averaged over the data ranks before the model is read
    (``plait.parallel.bn_running``). ``written_buffers``: under FSDP2, the buffers outside
    BatchNorm whose first data rank's copy is broadcast before each step and before the model
    is read, as DDP does (``plait.parallel.buffer_sync``).
    """

    applied: tuple[str, ...] = ()
    stages: tuple[nn.Module, ...] = ()
    stage_specs: tuple[StageSpec, ...] = ()
    pipeline: PipelineRunner | None = None
    loss_parallel: bool = False
    first_label_skipped: dict[Any, bool] = field(default_factory=dict, compare=False)
    loss_checks: dict[Any, Any] = field(default_factory=dict, compare=False)
    tied_names: dict[str, str] = field(default_factory=dict, compare=False)
    context: ContextGroup | None = None
    running_stats: RunningStats | None = None
    written_buffers: WrittenBuffers | None = None


def layout_of(model: nn.Module) -> Layout:
    """The layout recorded on ``model``; an empty ``Layout()`` for a model plait did not touch."""
    layout = model.__dict__.get(LAYOUT_ATTR)
    return layout if isinstance(layout, Layout) else Layout()


def record_layout(model: M, layout: Layout) -> M:
    """Attach ``layout`` to ``model`` (replacing any earlier record) and return ``model``."""
    model.__dict__[LAYOUT_ATTR] = layout
    return model


def local_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding this rank's parameters under their full-model names: the pipeline
    stages of a pipelined model, else the model itself."""
    return list(layout_of(model).stages) or [model]
