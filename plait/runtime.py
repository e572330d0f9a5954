"""``plait.init()`` and the ``Run`` it returns: the few calls a training script changes.

A Run owns what is per-process and per-job: the process group, the device, the Plan, the named
mesh, the progress output and the end-of-run summary. It holds no global state: two Runs in one
process (in tests) do not see each other, and nothing is read from the environment except the
variables torchrun itself defines (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

The same script runs as ``python train.py`` (one process: a one-rank group, so every code path
is the same) and as ``plait run --nproc 8 train.py --plan dp=2,tp=2,pp=2``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import socket
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn, cast, overload

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import Dataset

from . import report
from .accelerators import Accelerator, get_accelerator
from .argv import accelerator_from_argv, format_from_argv, plan_from_argv
from .batch_rows import MicroBatches
from .data.loader import DistributedLoader, is_stream
from .data.stream import StreamLoader
from .job_steps import Call, JobSteps
from .mesh import Mesh, build_mesh
from .parallel.layout import layout_of
from .parallelize import parallelize as _parallelize
from .plan import Plan
from .progress import Progress, check_extras
from .train import (
    LossFn,
    TotalsExchange,
    apply_update,
    forward_backward,
    pipeline_totals,
    reduce_totals,
)
from .warn import user_stacklevel

if TYPE_CHECKING:
    from .comm.report import Expected
    from .parallel.xla_spmd import SPMDLayout

PlanSource = Plan | str | Path | Mapping[str, Any] | None


@dataclass
class StepStats:
    """What the runtime measured per step, for progress and the summary."""

    losses: list[torch.Tensor] = field(default_factory=list)  # 0-dim, read when printed
    step_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # throughput units per step, see ``unit``
    skipped: list[int] = field(default_factory=list)  # steps whose update was dropped (NaN/inf)
    # fp16: steps whose update a gradient overflow dropped, and the loss scale after the last.
    overflows: list[int] = field(default_factory=list)
    loss_scale: float | None = None
    # time.perf_counter() as each step ended: the wall time per step between them includes what
    # the loop does outside run.step (loading data, evaluating), which the ETA must count.
    step_ends: list[float] = field(default_factory=list)
    unit: str = "tokens"  # or "samples" (images, feature rows): see _count_items
    # Several models stepped on each batch (a GAN's two): the latest loss of each, by the
    # label the progress line gives it (its class name, numbered where two share one).
    named_losses: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Run:
    """One training job as seen from one rank. Create it with ``plait.init()``."""

    plan: Plan
    mesh: Mesh | None  # None only while plan="auto" waits for the model (see plait.auto)
    accelerator: Accelerator
    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    # PyTorch/XLA: the SPMD layout (the XLA mesh); mesh is then None and never built.
    spmd: SPMDLayout | None = None
    seed: int = 0
    log_every: int = 10
    quiet: bool = False
    # What rank 0 writes on stdout: "text" for people, or "json" for programs: one JSON
    # object per line, each an event (plan, message, progress, ledger, summary), see say().
    format: str = "text"
    owns_group: bool = False
    total_steps: int | None = None
    stats: StepStats = field(default_factory=StepStats)
    # The communication ledger (plait.comm.ledger.Ledger) when init(ledger=True): it records
    # the collectives of every training step after the first ``ledger_warmup`` (one-off traffic:
    # DDP's bucket rebuild, pipeline shape inference).
    ledger: Any = None
    ledger_warmup: int = 2
    # The planner's view of the model given to parallelize (plait.planner.model_stats), taken
    # before layout when the ledger is on under tp or pp: its expected column for that model.
    _stats: Any = None
    # Whether the first block's input needs a gradient (plait.comm.held.stack_input_grad),
    # read before layout when the ledger is on under ZeRO-3 alone: which blocks FSDP2 gathers
    # again for backward. None: not read.
    _input_grad: bool | None = None
    # id(laid-out model) -> (_stats, _input_grad) as read for it: the ledger's expected column
    # prices the model run.step trains, which need not be the last one laid out (a frozen
    # teacher after its student).
    _ledger_inputs: dict[int, tuple[Any, bool | None]] = field(default_factory=dict)
    # id(DDP module) -> plait.comm.ready_order.ReadyOrder when the ledger is on: the order its
    # gradients became ready in its first reducing step, which DDP's buckets follow (its hooks
    # leave the model once that step is read).
    _ready: dict[int, Any] = field(default_factory=dict)
    _tokens: bool = True  # whether the first input held integer token ids
    # The sequence length each stack of blocks ran on, by its first block's path, for a model
    # with several (an encoder-decoder): plait.comm.stack_lengths.
    _stack_seqs: dict[str, int] = field(default_factory=dict)
    # Rank 0's bar / plain lines and TensorBoard scalars (plait.progress.Progress), made at
    # the first step unless init() made it; ``plot``: a PNG of loss and per-rank step time
    # written at finish().
    progress: Any = None
    plot: str | None = None
    _batch_shape: tuple[int, ...] | None = None
    _started: float = field(default_factory=time.perf_counter)
    _models: list[nn.Module] = field(default_factory=list)
    _gathers: int = 0  # run.all_gather calls so far (a contrastive loss must make some)
    # id(model) -> its contrastive temperature parameters (plait.parallel.contrastive), read
    # once per model rather than every step.
    _contrastive: dict[int, list[str]] = field(default_factory=dict)
    # whether a loss over the whole batch cut into grad_accum/microbatch parts was warned about
    _chunk_warned: list[bool] = field(default_factory=lambda: [False])
    # ZeRO-1: the user's optimizer -> its ZeroRedundancyOptimizer (see zero1_optimizer).
    _sharded_optimizers: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    # (id(model), id(optimizer)) pairs whose parameters were checked at their first step.
    _checked_optimizers: set[tuple[int, int]] = field(default_factory=set)
    _memory: Any = None  # plait.memory.MemoryTracker of the first model/optimizer stepped
    # Checkpoints (plait.checkpoint.schedule.Checkpointing) when init(checkpoint=...).
    checkpointing: Any = None
    # Optimizer steps done before this process started (a resumed run): step numbers, the
    # loader's position and saving every N steps count from here.
    first_step: int = 0
    _last_step_args: tuple[Any, Any, Any] | None = None  # (model, optimizer, scheduler)
    # Which job step each run.step call belongs to, the models' labels and the progress line
    # drawn (plait.job_steps): a step of the job is one batch, whatever models step on it.
    _steps: JobSteps = field(default_factory=JobSteps)
    # id(laid-out model) -> the class name of the model given to run.parallelize (the layout
    # wraps it: DDP, FSDP's FSDPNet, a pipeline's stages).
    _class_names: dict[int, str] = field(default_factory=dict)
    _loader: DistributedLoader | StreamLoader | None = None
    # What a NaN/inf loss or gradient norm does: "stop" (raise) or "skip" (see plait.guard).
    nonfinite: str = "stop"
    _guard: Any = None  # plait.guard.StepGuard, made at the first step
    # mixed_precision=fp16: the dynamic loss scale (plait.loss_scale.LossScaler), made at the
    # first step with torch.amp.GradScaler's defaults; set it before then for other settings.
    # Checkpoints keep it.
    loss_scaler: Any = None
    _exchange: Any = None  # (TotalsExchange | None, flags travel), made at the first step
    _data_share: tuple[int, int] | None = None  # (dp rank, dp size), once the mesh exists
    timeout: float = 300.0  # the hang watchdog's (plait.diagnostics.watchdog)
    desync_check: bool = True  # its step-start comparison of the ranks' collective counts
    _watchdog: Any = None  # its thread on this rank, once the mesh exists
    # SIGTERM handling when a final checkpoint is wanted (see _stop_on_sigterm).
    _stop: Any = None
    _final_save: Any = None
    _attempt: Any = None  # plait.lifecycle.AttemptRecord under torchrun --max-restarts
    auto: Any = None  # plait.auto.AutoRequest until run.parallelize chooses the plan
    # plait.diagnostics.xla.XLADiagnostics on PyTorch/XLA: recompilations, CPU fallbacks and
    # host syncs per step, reported at finish(); strict mode raises at the step instead.
    xla: Any = None
    # format="json": the sys.stdout and sys.excepthook plait.json_stdout replaced, put back
    # at close().
    _json_stdout: Any = None

    # ------------------------------------------------------------------ identity
    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that prints."""
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self._data_rank_and_size()[0]

    @property
    def dp_size(self) -> int:
        return self._data_rank_and_size()[1]

    @overload
    def all_gather(self, t: torch.Tensor, *, return_index: Literal[False] = ...
                   ) -> torch.Tensor: ...

    @overload
    def all_gather(self, t: torch.Tensor, *, return_index: Literal[True]
                   ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def all_gather(self, t: torch.Tensor, *, return_index: bool = False
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``t``'s rows from every data rank, concatenated in data-rank order (the order of
        the global batch's slices), with a gradient that flows back to the rank that computed
        each row: for a loss that compares every row with the whole batch (contrastive,
        InfoNCE, CLIP), which on one rank's slice alone is not one device's loss. Call it
        inside the loss function, on every data rank; ``t`` itself on one data rank.

        ``return_index=True`` returns ``(gathered, index)``, ``index`` the places of this
        rank's rows among the gathered ones: a contrastive loss's labels. Under
        ``grad_accum`` and a pipeline's microbatches each call gathers the micro-batch's rows
        of every data rank (one device's gradient accumulation over those chunks), so a row's
        index in the global batch is not its place there. Under a pipeline call it where the
        loss runs, on the last stage. See docs/data_parallel.md, "A loss over the whole
        batch"."""
        if self.spmd is not None:
            raise ValueError("run.all_gather is not available on XLA (SPMD): there the loss "
                             "already sees the global batch of each host, so pass the "
                             "tensor as it is")
        from .parallel.gather import all_gather_rows

        group = self._mesh()["dp"].get_group() if self.dp_size > 1 else None
        self._gathers += 1
        gathered, index = all_gather_rows(t, group)
        return (gathered, index) if return_index else gathered

    def all_reduce(self, t: torch.Tensor | float, *, sliced: bool | None = None
                   ) -> torch.Tensor:
        """``t`` summed over the data replicas, the same on every rank: a metric counted on
        this rank's rows (correct predictions, a confusion matrix, examples seen) made the
        global batch's, the value one device counts. Call it on every rank, as a step.

        The sum runs over the data replicas alone: the tensor- and pipeline-parallel peers of
        a replica hold the same rows, so summing over every rank (``dist.all_reduce``
        on the default group) would count them once per peer. Under a pipeline the value is
        the last stage's (the stage whose loss function sees the outputs, e.g. counts kept by
        the loss function given to :meth:`evaluate`), sent to every stage. Returns a new
        tensor (``t`` is left as it is) on ``t``'s device, float for a Python number.

        ``sliced`` says, under context parallelism, what each cp rank of a replica counted:
        ``True`` for counts taken in the loss function given to :meth:`evaluate` (or
        :meth:`step`), which sees this rank's slice of every sequence, so per-token counts
        are summed over the cp ranks too; ``False`` for counts the cp ranks of a replica hold
        alike (from ``model(x)`` on the loader's rows, which runs the whole sequence on each,
        or a per-row count), summed over the data replicas alone. Under ``cp=1`` there is
        no slice and it changes nothing; under ``cp>1`` it must be given.

        A DTensor (a count taken on a vocabulary-parallel head's logits, split over the tp
        ranks: ``(logits > 0).sum()`` is partial over them) is made whole on its mesh first
        (``full_tensor()``, a collective over the tp ranks, which call this alike), so that
        the sum over the data replicas reads a plain tensor; the value returned is one."""
        if sliced is not None and not isinstance(sliced, bool):
            raise ValueError(f"run.all_reduce(sliced={sliced!r}): sliced is True (counted on "
                             f"this rank's slice of each sequence) or False (on whole rows)")
        if self.spmd is not None:
            raise ValueError("run.all_reduce is not available on XLA (SPMD): there each "
                             "host's tensors already cover its whole share of the batch")
        if self.plan.cp > 1 and sliced is None:
            raise ValueError(
                f"run.all_reduce under cp={self.plan.cp} needs sliced=True or sliced=False: "
                f"sliced=True for counts taken in the loss function given to run.evaluate, "
                f"which sees this rank's slice of every sequence (per-token counts, summed "
                f"over the cp ranks too), sliced=False for counts from model(x) on the "
                f"loader's rows, which every cp rank of a replica runs whole, or for a "
                f"per-row count (summed over the data replicas alone)")
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            t = t.full_tensor()
        value = torch.as_tensor(t, dtype=torch.float if not isinstance(t, torch.Tensor)
                                else None)
        pp_group, last_pp = None, 0
        if self.plan.pp > 1:
            from .parallel.schedules import stage_to_rank

            pp_group = self._mesh()["pp"].get_group()
            last_pp = stage_to_rank(self.plan.pp_schedule, self.plan.pp,
                                    self.plan.virtual_stages)[-1]
        work = value.detach().to(self.device, copy=True)
        if pp_group is not None:
            dist.broadcast(work, src=dist.get_global_rank(pp_group, last_pp), group=pp_group)
        summed = self._count_group(sliced is True)
        if summed is not None:
            dist.all_reduce(work, group=summed)
        return work.to(value.device)

    def _count_group(self, sliced: bool) -> dist.ProcessGroup | None:
        """The ranks whose counts :meth:`all_reduce` sums (None: this rank alone): the data
        replicas, and under context parallelism with ``sliced`` their cp ranks too (the
        group that sums a step's loss totals)."""
        if sliced and self.plan.cp > 1:
            from .mesh import DP_CP

            return self._mesh()[DP_CP].get_group()
        return self._mesh()["dp"].get_group() if self.dp_size > 1 else None

    def _data_rank_and_size(self) -> tuple[int, int]:
        """Which share of each global batch this process loads, and of how many (on XLA: this
        host's, every device of the host splitting it)."""
        if self._data_share is None:
            self._data_share = (self.spmd.data_rank_and_size() if self.spmd is not None
                                else self._mesh().data_rank_and_size())
        return self._data_share

    def _mesh(self) -> Mesh:
        if self.mesh is None:
            raise ValueError("plan='auto' is chosen for the model: call run.parallelize(model) "
                             "before run.loader() or run.step()")
        return self.mesh

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on rank 0 only (and not at all when quiet); under ``format="json"`` the
        text is a ``{"event": "message", "text": ...}`` line."""
        if self.format == "json":
            self.say(kwargs.get("sep", " ").join(map(str, args)))
        elif self.is_main and not self.quiet:
            print(*args, **kwargs, flush=True)

    def say(self, text: str, event: str = "message", **fields: Any) -> None:
        """Tell the user something on rank 0 (nothing when quiet): ``text`` for people, or,
        under ``format="json"``, ``{"event": event, "text": text, **fields}`` on one line,
        so that a program reads the figures without parsing the sentence."""
        if not self.is_main or self.quiet:
            return
        if self.format == "json":
            from .outputs import json_event

            print(json_event(event, text=text, **fields), flush=True)
        else:
            print(text, flush=True)

    def _say_plan(self) -> None:
        """Under ``format="json"``, the plan in force as a ``plan`` event (in text, a script
        prints its plan as it likes: ``plait demo`` says it in words)."""
        if self.format == "json":
            self.say(f"plan: {self.plan.describe()} on {self.world_size} process(es)", "plan",
                     plan=self.plan.to_string(), layout=self.plan.describe(),
                     world_size=self.world_size, accelerator=self.accelerator.name,
                     backend=self.accelerator.backend, seed=self.seed)

    # ------------------------------------------------------------------ the four calls
    def parallelize(self, model: nn.Module, *, example: Any = None) -> nn.Module:
        """Lay ``model`` out for the plan (pipeline split, TP/SP, checkpointing, FSDP/DDP).

        ``example``: one batch as ``run.step`` receives it (``(inputs, targets)``, a dict, or
        the input tensor alone), of this rank's size. What runs the model before training
        (``plan="auto"``'s measurements and refusals, an inferred tensor-parallel plan's and
        sequence parallelism's checks, a pipeline split's) runs on its inputs, labels left
        out, in place of an input it guesses (token ids, features, images of a few sizes):
        pass it when the model's forward takes several inputs or images of another size.

        With ``plan="auto"`` the first call asks the planner for this model's layout, prints the
        choice and why (rank 0), and builds the mesh for it (see ``plait.auto``). A model or
        plan it refuses raises ValueError; under ``format="json"`` its ``error`` event, if
        uncaught, is written once (rank 0's): every rank lays out the same model and plan.

        The random stream is left where building the model left it, as on one device, and is
        the same on every rank (rank 0's): see ``plait.seeding``."""
        from .seeding import kept_stream

        try:
            # the random stream goes on from where building the model left it: what laying
            # out draws (the planner's measurements, a layout's checks) is undone
            with kept_stream(self.device, share=self.spmd is None):
                out = self._lay_out(model, example)
            self._resume_weights(out)
            return out
        except ValueError as exc:
            if self.format == "json":
                from .json_stdout import mark_every_rank

                mark_every_rank(exc)
            raise

    def _lay_out(self, model: nn.Module, batch: Any = None) -> nn.Module:
        from .parallel.compile import compiled_original
        from .parallel.tp_example import from_batch

        original = compiled_original(model)
        if original is not None:  # torch.compile(model): lay out the model, compile its blocks
            model = original
        # read now: FSDP2's fully_shard swaps the class in place (FSDPNet for a Net)
        name = type(model).__name__
        example = None if batch is None else from_batch(model, batch)
        held = next((p.device for p in model.parameters() if not p.is_meta), None)
        if example is not None and held is not None:
            # where the model is until it is laid out: the checks before that run it there
            example = example.to(held)
        if self.auto is not None:
            from .auto import resolve

            self.plan, why = resolve(model, self.auto, example)
            for line in why:
                self.print(line)
            self.mesh = build_mesh(self.plan, self.device.type, self.world_size)
            self.auto = None
            self._say_plan()
        if original is not None and not self.plan.compile and self.spmd is None:
            self.plan = self.plan.replace(compile=True)
            self.print("plait: the model came through torch.compile; plait lays out the model "
                       "and compiles each block's forward instead (compile in the plan), the "
                       "way compile composes with data, sharded and pipeline parallelism")
        from .parallel.copy_refusal import refuse_averaged_pipeline

        refuse_averaged_pipeline(model, self.plan.pp)
        if self.spmd is not None:
            from .parallel.xla_spmd import apply_spmd

            out = apply_spmd(model, self.spmd, device=self.device, example=example,
                             say=self.say if self.format == "json" else None)
            self._models.append(out)
            self._class_names[id(out)] = name
            return out
        if self.ledger is not None and (self.plan.tp > 1 or self.plan.pp > 1
                                        or self.plan.cp > 1):
            from .comm.predict import planner_stats

            self._stats = planner_stats(model, self.device.type, self.plan, example)
        elif self.ledger is not None and self.plan.zero == 3:
            from .comm.held import stack_input_grad

            self._input_grad = stack_input_grad(model, self.device.type)
        # Under format="json" what the layout tells the user (an inferred tp plan) is a
        # message event on stdout; in text it goes to rank 0's stderr.
        out = _parallelize(model, self._mesh(), self.plan, device=self.device,
                           say=self.say if self.format == "json" else None, example=example)
        if self._stats is not None and self._stats.more_stacks:
            from .comm.stack_lengths import watch_stack_lengths

            # after layout, whose checks run the blocks on a guessed input
            self._stack_seqs = watch_stack_lengths(model, [
                self._stats.stack_first, *(m.first for m in self._stats.more_stacks)])
        from .parallel.copy_refusal import copy_refusal, refuse_copies

        uncopyable = copy_refusal(out, bool(layout_of(out).stages))
        if uncopyable is not None:
            refuse_copies(out, uncopyable)
        if self.ledger is not None and isinstance(out, nn.parallel.DistributedDataParallel):
            from .comm.ready_order import ReadyOrder

            self._ready[id(out)] = ReadyOrder(out)
        self._models.append(out)
        self._class_names[id(out)] = name
        self._ledger_inputs[id(out)] = (self._stats, self._input_grad)
        return out

    def _resume_weights(self, model: nn.Module) -> None:
        """A resumed run's weights go into the model it is for as soon as it is laid out, so
        that it is the trained model before the first step too (an evaluation first, or no
        steps left). Another model (a frozen teacher parallelized first) is left alone: the
        checkpoint's parameter names or shapes do not match it."""
        ckpt = self.checkpointing
        if (ckpt is None or ckpt.resume_path is None or ckpt.resumed
                or ckpt.weights_in is not None):
            return
        from .checkpoint import load_weights

        if load_weights(ckpt.resume_path, model, device=self.device):
            ckpt.weights_in, ckpt.weights_state = model, _tensor_versions(model)

    def loader(self, dataset: Dataset | Iterable[Any], batch_size: int, *,
               steps: int | None = None, shuffle: bool | None = None,
               start_step: int | None = None, evaluation: bool = False,
               collate_fn: Callable[[list[Any]], Any] | None = None, num_workers: int = 0,
               persistent_workers: bool = False,
               pin_memory: bool = False) -> DistributedLoader | StreamLoader:
        """Iterate this rank's share of each *global* batch of ``batch_size`` items.

        Ranks of one data replica (TP/PP peers) get the same rows; one device gets them all.
        ``dataset`` is map-style (``len`` and ``dataset[i]``). ``steps`` counts from step 0;
        the loader starts at the run's step (``run.steps_done``: the step saved, in a run
        resumed from a checkpoint; the next epoch's first batch, for a loader made again after
        an epoch), ``start_step`` overrides it. ``steps=None`` runs to the end of that epoch.
        An epoch is ``len(dataset) // batch_size`` global batches, reshuffled each epoch.
        ``collate_fn`` builds this rank's batch from its list of items (padding
        variable-length sequences, say); the default stacks them. ``num_workers``,
        ``persistent_workers`` and ``pin_memory`` are torch DataLoader's: the same batches,
        loaded in worker processes; pinning applies on CUDA only (elsewhere it is left off,
        with nothing to speed up). Randomness drawn in ``dataset[i]`` comes from (seed, epoch,
        i): the same with or without workers, on every peer, and after a resume.

        An iterable ``dataset`` (``IterableDataset``, a streaming ``datasets`` dataset, a
        generator's iterable) is read in its own order by a :class:`StreamLoader`: step k's
        global batch is the stream's items [k*B, (k+1)*B) of the epoch, split over the data
        replicas as above; an epoch ends where the stream does, on every replica at the same
        step (a last incomplete global batch is dropped). ``shuffle`` is the stream's own
        business there (``shuffle=True`` is refused). A loader made again after an epoch
        continues with the next one, and a resumed run at the step it saved, under any data
        parallel size.

        ``evaluation=True``: batches for :meth:`evaluate`. Such a loader always starts at its
        first batch (a resumed run too) and is not the training loader: checkpoints do not
        record its position, and the progress bar's step total stays the training loader's.
        """
        dp_rank, dp_size = self._data_rank_and_size()
        # The run's step, not the step it started at: a loader made again for each epoch
        # continues the stream (the next epoch's order) instead of replaying the first epoch.
        first = 0 if evaluation else self.steps_done
        common: dict[str, Any] = dict(
            dp_rank=dp_rank, dp_size=dp_size, seed=self.seed, steps=steps,
            start_step=first if start_step is None else start_step, collate_fn=collate_fn,
            num_workers=num_workers, persistent_workers=persistent_workers,
            pin_memory=pin_memory and self.device.type == "cuda",
            # A batch the collate_fn builds across rows comes as its micro-batches (grad_accum,
            # times a pipeline's microbatches), each collated on its own
            # (plait.data.loader.collate_each). Not under XLA SPMD, which places one host
            # batch over the data axes.
            micro_batches=self.plan.grad_accum * (self.plan.microbatches if self.plan.pp > 1
                                                  else 1) if self.spmd is None else 1)
        loader: DistributedLoader | StreamLoader
        if is_stream(dataset):
            if shuffle:
                raise ValueError(f"shuffle=True: dataset {type(dataset).__name__} is a stream, "
                                 f"read in its own order; shuffle it in the stream (a shuffle "
                                 f"buffer, e.g. datasets' .shuffle(seed=..., buffer_size=...)) "
                                 f"and leave shuffle out")
            epoch, epoch_start = self._stream_epoch(common["start_step"], evaluation)
            loader = StreamLoader(dataset, batch_size, epoch=epoch, epoch_start=epoch_start,
                                  **common)
        else:
            loader = DistributedLoader(dataset, batch_size,  # type: ignore[arg-type]
                                       shuffle=shuffle is not False, **common)
        local = batch_size // dp_size
        micro = self.plan.grad_accum * (self.plan.microbatches if self.plan.pp > 1 else 1)
        if local % micro:
            raise ValueError(f"per-replica batch {local} (global {batch_size} / {dp_size} "
                             f"replicas) does not split into {micro} micro-batches "
                             f"(grad_accum={self.plan.grad_accum}"
                             + (f" x microbatches={self.plan.microbatches}" if self.plan.pp > 1
                                else "") + f"); use a global batch that is a multiple of "
                             f"{dp_size * micro}")
        if evaluation:
            return loader
        self._loader = loader
        if steps is not None:
            self.total_steps = steps
        return loader

    def _stream_epoch(self, start: int, evaluation: bool) -> tuple[int, int]:
        """(epoch, the step it began at) for a stream loader starting at ``start``: a stream's
        epochs have no length known in advance, so they come from the training loader before
        this one (a loader made again for each epoch) or from the checkpoint resumed from."""
        if evaluation:
            return 0, 0
        before = self._loader
        ckpt = self.checkpointing
        saved = ckpt.resume_loader if ckpt is not None and not ckpt.resumed else None
        state: dict[str, Any]
        if isinstance(before, StreamLoader) and before.step == start:
            state = dict(before.state_dict())
        elif saved is not None and int(saved.get("step", -1)) == start:
            state = saved
        else:
            return 0, 0
        return int(state.get("epoch", 0)), int(state.get("epoch_start", 0))

    def step(self, model: nn.Module, batch: Any, loss_fn: LossFn | None,
             optimizer: torch.optim.Optimizer, scheduler: Any = None, *,
             inner: bool = False) -> torch.Tensor:
        """Forward, backward (a pipeline schedule when pp > 1), clip, optimizer step, and
        ``scheduler.step()`` when an LR scheduler is given (it is then checkpointed too).

        ``batch`` is ``(inputs, targets)`` or a dict of model arguments (the Hugging Face
        convention; ``loss_fn=None`` then uses the model's own ``output.loss``), see
        ``plait.train.call_model``. ``loss_fn`` returns a scalar mean over the counted items or
        a ``(sum, count)`` pair, see ``plait.loss``.

        Returns the step's loss over the *global* batch, the same value on every rank and the
        value one device computes: a 0-dim tensor on the device, already computed when the step
        returns (the step ends by waiting for the device, to time it), so reading it
        (``float(loss)``, ``loss.item()``, ``f"{loss:.3f}"``) costs one copy, not a wait.
        It comes from the one 2-element all-reduce of (loss sum, item count) over the data
        replicas that every step makes anyway, since the count scales the gradients. With
        ``init(checkpoint=...)`` the first call loads the checkpoint being resumed, and every
        ``every``-th step saves one.

        Several models (a GAN's generator and discriminator): call it once per model on each
        batch, each with its own optimizer, which it clips by its own norm and steps. It
        starts from no gradient on ``model``, dropping any another model's backward left there
        (the generator's runs through the discriminator), as ``opt.zero_grad()`` at the top of
        a one-device loop does. The calls on one batch are one step of the job (the most calls
        of any one model): ``steps_done``, the loader's position and the progress line count
        batches, and the line shows each model's loss.

        ``inner=True``: an update inside the job's step, which the next call without it ends
        (a WGAN critic's n_critic updates on each batch before the generator's update): every
        call still steps ``model``'s optimizer, but the step count, the loader's position, the
        progress line and checkpoints' step number count the job's steps (the generator's),
        however many inner calls come before the call that ends each one. Inner calls share
        the step's batch: one after another batch was drawn from ``run.loader`` is refused
        (leave ``inner`` out when each update draws its own batch; each batch is then a step).
        """
        _refuse_compiled_wrapper(model)
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError("run.step(..., scheduler) calls scheduler.step() with no metric, "
                             "which ReduceLROnPlateau needs: leave it out and call "
                             "plateau.step(float(loss)) after run.step (its loss, or "
                             "run.evaluate's, is the same on every rank)")
        loss_fn = self._contrastive_guard(model, loss_fn)
        # The job's step this call is part of (plait.job_steps): a later model stepped on the
        # same batch (a GAN's generator after its discriminator) joins the step the first one
        # began, and so does any call after inner ones only.
        loader = self._loader
        call = self._steps.begin(
            id(model), self._class_names.get(id(model), type(model).__name__), inner=inner,
            loader=None if loader is None else (id(loader), loader.step),
            one_model=self.checkpointing is not None)
        joins = call.joins
        # Counted on the batch as given (host tensors from a loader): an attention mask read
        # on the device would be one more transfer, and on XLA one more graph, every step.
        items, self.stats.unit = _count_items(batch)
        if self.spmd is None:
            batch = _to_device(batch, self.device)
        else:  # XLA: the batch goes to the devices already split over the data axes
            batch = self.spmd.place_batch(batch, self.device)
        self._start_watchdog()
        if self._watchdog is not None:
            self._watchdog.step_started(self.first_step + len(self.stats.step_times)
                                        + (0 if joins else 1))
        self._last_step_args = (model, optimizer, scheduler)
        user_optimizer = optimizer
        ckpt = self.checkpointing
        if ckpt is not None and ckpt.resume_path is not None and not ckpt.resumed:
            ckpt.resumed = True
            # The loader already started at the saved step (init read it): only the state loads.
            # The weights again unless they are the ones loaded at parallelize, untouched
            # since (a script that loads other weights after parallelize still resumes).
            untouched = (model is ckpt.weights_in
                         and _tensor_versions(model) == ckpt.weights_state)
            self._load(ckpt.resume_path, model, optimizer, scheduler, move_loader=False,
                       read_model=not untouched, resuming=True)
        if self.plan.pp > 1 and (id(model), id(user_optimizer)) not in self._checked_optimizers:
            from .parallel.layout import layout_of

            runner = layout_of(model).pipeline
            if runner is not None:  # the copies of a tied weight in groups alike, or refused
                runner.check_tied_settings(user_optimizer)
        optimizer = self._optimizer_for(optimizer)
        # Not on XLA: an SPMD tensor shows its global size on the host, so per-device bytes
        # cannot be read off the parameters there.
        if self._memory is None and self.spmd is None:
            from .memory import MemoryTracker

            self._memory = MemoryTracker(model, optimizer, track_gathered=self.plan.zero >= 2)
        start = time.perf_counter()
        pp_group = self._mesh()["pp"].get_group() if self.plan.pp > 1 else None
        # the job's step: the ledger leaves out its first steps for every model alike
        recording = self.ledger is not None and (
            len(self.stats.step_times) - joins >= self.ledger_warmup)
        if self._batch_shape is None:
            first = _first_input(batch)
            self._batch_shape = tuple(getattr(first, "shape", ()))
            # the planner prices sequences of token ids (b, s) at the blocks' width, not
            # another input: no expected column under tp/pp (why_no_expected)
            self._tokens = isinstance(first, torch.Tensor) and not first.is_floating_point()
        watch = self.xla.step(_parts(batch)) if self.xla is not None else contextlib.nullcontext()
        exchange, flags_travel = self._totals_exchange()
        agreed: torch.Tensor | None = None
        # The job's items (tokens or samples) this step, summed over the data ranks inside the
        # step's (sum, count) all-reduce: ranks can keep different numbers of tokens (padding).
        # Under XLA SPMD each host's share is counted on its host, outside the program.
        job_items: torch.Tensor | float = float(items * self.dp_size)
        if exchange is not None:
            # cp ranks count the same rows (each holds a slice of them): counted once
            exchange.items = items / self.plan.cp
        # Buffers the first step changes (outside BatchNorm) are statistics each data rank
        # keeps from its own rows: warned about once (a copy of the buffers, first step only).
        statistics = None
        if call.first and self.world_size > 1 and self.spmd is None:
            from .data.replicas import check_rank_batches
            from .parallel.batchnorm import forward_statistics

            if self.dp_size > 1:
                statistics = forward_statistics(model)
            sizes = self._mesh().axis_sizes()
            with self.ledger.paused() if recording else contextlib.nullcontext():
                check_rank_batches(_parts(batch), self.dp_rank, self.dp_size, sizes,
                                   self.device)
        with self.ledger if recording else contextlib.nullcontext(), watch:
            scaler = self._loss_scaler()
            if scaler is not None and scaler.reference is None:
                with self.ledger.paused() if recording else contextlib.nullcontext():
                    scaler.reference = self._first_reference(items)
            loss_scale = scaler.backward_factor() if scaler is not None else 1.0
            drop_stale_gradients(model)
            local = forward_backward(model, batch, loss_fn, plan=self.plan, device=self.device,
                                     exchange=exchange, loss_scale=loss_scale)
            if call.first and self.world_size > 1 and self.spmd is None:
                from .parallel.buffer_sync import learn_written_buffers

                with self.ledger.paused() if recording else contextlib.nullcontext():
                    learn_written_buffers(model)  # FSDP2: which to broadcast from rank 0
            if statistics:
                from .parallel.batchnorm import warn_forward_statistics

                warn_forward_statistics(model, statistics, self.dp_size)
            totals_in: torch.Tensor | Callable[[], torch.Tensor]
            if exchange is not None:
                def exchanged() -> torch.Tensor:
                    """Waited for inside apply_update, once the gradient norm is computed."""
                    nonlocal agreed, job_items
                    totals, job_items, flags = exchange.finish()
                    # The clipped norm is the job-wide one: with the flags summed, a clean step
                    # needs no agreement of its own (plait.guard).
                    agreed = flags if flags_travel and self.plan.grad_clip else None
                    return totals

                totals_in = exchanged
            else:
                # Not in the ledger: the (sum, count) exchange is the runtime's, not the
                # layout's.
                with self.ledger.paused() if recording else contextlib.nullcontext():
                    if self.spmd is None:
                        # cp ranks count the same rows (each holds a slice): counted once
                        share = float(items) / self.plan.cp
                        local = torch.cat([local.detach().float(),
                                           torch.full((1,), share, device=local.device)])
                    if self.spmd is None and self.plan.pp > 1:
                        totals_in, agreed = self._pipeline_totals(local, model)
                    else:
                        totals_in = self._global_totals(local)
                    if self.spmd is None:
                        job_items = totals_in[2]
            # Under XLA SPMD the program is the global batch's: its gradients are of the global
            # sum, not an average over replicas.
            guard = self._step_guard()
            # Not on XLA: the guard reads the loss and the gradient norm on the host, which
            # there executes the graph mid-step (a host sync every step).
            totals = apply_update(optimizer, totals_in, plan=self.plan, pp_group=pp_group,
                                  data_replicas=1 if self.spmd is not None else None,
                                  guard=None if self.spmd is not None
                                  else lambda norm: guard(local[0], norm, agreed=agreed),
                                  loss_scale=loss_scale)
            loss = (totals[0] / totals[1].clamp_min(1)).detach()
            if scheduler is not None:
                with warnings.catch_warnings():
                    # ZeRO-1 steps its sharded copy of the user's optimizer, so the scheduler
                    # sees the user's never step and warns about the call order; nothing is
                    # skipped. The message is a regular expression: its "()" escaped.
                    warnings.filterwarnings("ignore", re.escape(
                        "Detected call of `lr_scheduler.step()` before `optimizer.step()`"))
                    scheduler.step()
            self.accelerator.synchronize(self.device)
        if self.spmd is not None:  # XLA: no NaN/inf check there; the stop request alone
            guard.agree_stop()
        _check_optimizer(model, user_optimizer, self._checked_optimizers,
                         [(self._class_names.get(id(m), type(m).__name__), m)
                          for m in self._models if m is not model])
        if self.xla is not None:
            self.xla.step_end()
            from .loss import settle_answers
            from .parallel.layout import layout_of

            settle_answers(layout_of(model).first_label_skipped)  # read now the graph ran
        elapsed = time.perf_counter() - start
        step = self.first_step + len(self.stats.step_times) + (0 if joins else 1)
        if scaler is not None:
            self._update_loss_scale(scaler, step, float(totals[1]))
        self._apply_verdict(step)
        if self._watchdog is not None:
            self._watchdog.active = False  # between steps, time spent is the user's
        self._record_call(call, step, elapsed, job_items, loss)
        if ckpt is not None:
            if ckpt.pending is not None and ckpt.pending.done():
                ckpt.pending.wait()  # rank 0 publishes a finished background save
            if ckpt.due(step):
                self.save()
        if self._attempt is not None:
            self._attempt.write(first=self.first_step, last=step)
        self._stop_if_asked(step)
        return loss

    def _record_call(self, call: Call, step: int, elapsed: float,
                     job_items: torch.Tensor | float, loss: torch.Tensor) -> None:
        """A finished ``run.step`` call in the stats of its job step ``step``, and the lines
        it draws: a call that joins the step adds its time to the step's, whose items and
        loss are its first call's; each model's loss shows by its label."""
        self._steps.done(call)
        if call.joins:
            self.stats.step_times[-1] += elapsed
            self.stats.step_ends[-1] = time.perf_counter()
        else:
            self._draw_line(step - 1)  # the step before, where no call drew its line
            # the line shows the losses of this step's models and the step before's
            keep = self._steps.shown()
            self.stats.named_losses = {k: v for k, v in self.stats.named_losses.items()
                                       if k in keep}
            self.stats.step_times.append(elapsed)
            self.stats.step_ends.append(time.perf_counter())
            self.stats.tokens.append(int(job_items))
            self.stats.losses.append(loss)
        self.stats.named_losses[self._steps.labels[call.model]] = loss  # shown for two or more
        if self._steps.ends_step(call):
            self._draw_line(step)

    def _draw_line(self, step: int) -> None:
        """The progress line (bar, JSON event, TensorBoard scalars) of ``step``, the last one
        in the stats, once (:meth:`plait.job_steps.JobSteps.draw`)."""
        if not self.stats.losses or not self._steps.draw(step):
            return
        if self.progress is None:
            self.progress = Progress(enabled=self.is_main and not self.quiet,
                                     log_every=self.log_every, events=self.format == "json")
        self.progress.total = self.total_steps
        self.progress.update(step, float(self.stats.losses[-1]), self.stats)

    def _contrastive_guard(self, model: nn.Module, loss_fn: LossFn | None) -> Any:
        """``loss_fn`` refused on a contrastive model under data parallelism unless it gathers
        (:func:`plait.parallel.contrastive.guard_loss`), for a step and an evaluation alike:
        the mean of the replicas' losses over their own rows is neither's one-device value."""
        if self.spmd is not None:  # on XLA each host's loss already reads its whole share
            return loss_fn
        from .parallel.contrastive import contrastive_parameters, guard_loss, warn_chunked

        if id(model) not in self._contrastive:
            self._contrastive[id(model)] = contrastive_parameters(model)
        found = self._contrastive[id(model)]
        guarded = guard_loss(model, loss_fn, self.dp_size, lambda: self._gathers, found)
        pipelined = self.plan.microbatches if self.plan.pp > 1 else 1
        parts = self.plan.grad_accum * pipelined
        named = " x ".join(([f"grad_accum={self.plan.grad_accum}"]
                            if self.plan.grad_accum > 1 else [])
                           + ([f"microbatches={pipelined}"] if pipelined > 1 else []))
        return warn_chunked(guarded, parts, named, lambda: self._gathers, found,
                            self._chunk_warned)

    def evaluate(self, model: nn.Module, batch: Any, loss_fn: LossFn | None = None
                 ) -> torch.Tensor:
        """The loss of ``batch`` without training: the global batch's mean, the value one device
        computes, under every layout (a pipeline runs its schedule forward only).

        The model runs in eval mode (dropout off) and goes back to the modes it had; no
        gradients are computed or touched, the optimizer and the step count are left alone.
        The batch is split into the plan's ``grad_accum`` micro-batches (or a pipeline's
        ``microbatches``) as a step's is, so that what fits in a step fits here.
        ``batch`` and ``loss_fn`` are as for :meth:`step`: each rank passes its share (a
        ``run.loader`` batch). Collective: every rank calls it, as it calls ``step``. Returns a
        0-dim tensor, the same on every rank. For generation or other inference with a layout,
        take ``run.full_state_dict(model)`` into a one-device copy of the model.
        """
        from .train import forward_only

        _refuse_compiled_wrapper(model)
        loss_fn = self._contrastive_guard(model, loss_fn)  # one device's loss, or refused
        if self.spmd is None:
            batch = _to_device(batch, self.device)
        else:
            batch = self.spmd.place_batch(batch, self.device)
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        # Watched like a step: a rank that skips the call (evaluating on rank 0 only) leaves
        # the others waiting in its collectives, and the watchdog names them at its timeout.
        self._start_watchdog()
        if self._watchdog is not None:
            self._watchdog.active = True
        try:
            group = self._totals_group()[0] if self.spmd is None else None
            local = forward_only(model, batch, loss_fn, plan=self.plan, device=self.device,
                                 dp_group=group)
            runner = layout_of(model).pipeline
            if runner is not None:  # the last stage's refusals, with the totals it sends
                local = torch.cat([local.float(), torch.tensor(runner.take_refusal(),
                                                               device=local.device)])
            totals = self._global_totals(local)
            if runner is not None:
                from .parallel.pipeline import REFUSAL_FLAGS, refuse_if_seen

                refuse_if_seen(totals[2:2 + REFUSAL_FLAGS].tolist(), self.plan.cp,
                               self._totals_group()[1], self.plan)
        finally:
            for module, training in modes:
                module.training = training
            if self.spmd is None:
                from .parallel.zero import reshard_after_forward_only

                reshard_after_forward_only(model)
            if self._watchdog is not None:
                self._watchdog.active = False
        return (totals[0] / totals[1].clamp_min(1)).detach()

    # ------------------------------------------------------------------ checkpoints
    @property
    def steps_done(self) -> int:
        """Steps taken by this job, those before a resume included: optimizer steps of the
        model stepped most (with several models stepped on each batch, batches; with
        ``run.step(..., inner=True)``, the steps of the calls without it)."""
        return self.first_step + len(self.stats.step_times)

    def save(self, path: str | Path | None = None, *, model: nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None) -> Path:
        """Save a checkpoint now (collective: every rank calls it) and return its folder.

        ``path``: the checkpoint folder (default: ``init(checkpoint=...)``'s); the checkpoint
        goes to ``path/step-NNNNNNNN``. Model, optimizer and scheduler default to those of the
        last ``run.step``. It holds them, the step, the Plan, the loader's position and every
        rank's random states, and loads under any other plan or world size (``run.load``).
        """
        from .checkpoint import CheckpointError, save

        ckpt = self.checkpointing
        if path is None and ckpt is None:
            raise CheckpointError("run.save() needs a folder: run.save('ckpt/') or "
                                  "plait.init(checkpoint='ckpt/')")
        last = self._last_step_args or (None, None, None)
        chosen: nn.Module | None = model or last[0] or (
            self._models[0] if len(self._models) == 1 else None)
        if not isinstance(chosen, nn.Module):
            raise CheckpointError("run.save() does not know which model to save: pass "
                                  "model=... (and optimizer=...) or call it after run.step()")
        if optimizer is None and chosen is last[0]:
            optimizer, scheduler = last[1], scheduler or last[2]
        folder = Path(path) if path is not None else ckpt.folder
        same = ckpt is not None and folder == ckpt.folder
        if same and ckpt.pending is not None:
            ckpt.pending.wait()
        group = None
        if same and ckpt.async_save:
            if ckpt.group is None:  # checkpoint collectives run beside training's, apart
                ckpt.group = dist.new_group(backend="gloo")
            group = ckpt.group
        loader = self._loader
        extra: dict[str, Any] = {"batch_size": loader.batch_size if loader is not None else None}
        scaler = self._loss_scaler()
        if scaler is not None:  # fp16: a resumed run goes on with the scale it had
            extra["loss_scale"] = scaler.state_dict()
        from .parallel.bn_running import average_running_stats

        average_running_stats(cast(nn.Module, chosen))  # FSDP2 without sync_bn: one value
        from .parallel.buffer_sync import broadcast_ddp_buffers, broadcast_written_buffers

        broadcast_written_buffers(cast(nn.Module, chosen))  # and rank 0's other buffers
        broadcast_ddp_buffers(cast(nn.Module, chosen))  # DDP: rank 0's, as its next forward
        pending = save(folder, step=self.steps_done, model=cast(nn.Module, chosen),
                       optimizer=self._optimizer_for(optimizer) if optimizer else None,
                       scheduler=scheduler, plan=self.plan, device=self.device,
                       loader=loader, keep=ckpt.keep if same else None, async_group=group,
                       extra=extra)
        if same:
            ckpt.last_saved = self.steps_done
            ckpt.pending = pending if group is not None else None
        return folder / f"step-{self.steps_done:08d}"

    def load(self, path: str | Path, *, model: nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None) -> int:
        """Load a checkpoint (a step folder, or the newest in a checkpoint folder) into this
        run's model and optimizer, whatever plan and world size it was saved under; later
        ``run.loader(...)`` calls and step numbers continue from its step, which is returned.
        Collective: every rank calls it."""
        return self._load(path, model, optimizer, scheduler, move_loader=True)

    def _load(self, path: str | Path, model: nn.Module | None,
              optimizer: torch.optim.Optimizer | None, scheduler: Any,
              move_loader: bool, read_model: bool = True, resuming: bool = False) -> int:
        from .checkpoint import CheckpointError, load

        model = model or (self._models[0] if len(self._models) == 1 else None)
        if model is None:
            raise CheckpointError("run.load() does not know which model to load into: pass "
                                  "model=...")
        from .parallel.zero import copy_hyperparameters

        target = self._optimizer_for(optimizer) if optimizer is not None else None
        info = load(path, model=model, optimizer=target, scheduler=scheduler,
                    device=self.device, read_model=read_model, resuming=resuming)
        if self.is_main:
            for note in info.notes:
                warnings.warn(f"plait: {note}", stacklevel=user_stacklevel())
        if optimizer is not None and target is not None and target is not optimizer:
            # ZeRO-1: the loaded settings go back to the user's optimizer too
            copy_hyperparameters(target, optimizer)
        saved_batch = info.extra.get("batch_size")
        if self._loader is not None and saved_batch not in (None, self._loader.batch_size):
            raise CheckpointError(f"checkpoint {info.path} was trained with global batch "
                                  f"{saved_batch}, this loader's is {self._loader.batch_size}; "
                                  f"resume with batch_size={saved_batch}")
        self.first_step = info.step - len(self.stats.step_times)
        self._steps.rewind(info.step)  # an earlier step's lines again
        scaler = self._loss_scaler()
        if scaler is not None and info.extra.get("loss_scale"):
            scaler.load_state_dict(info.extra["loss_scale"])
        if move_loader and self._loader is not None and info.loader is not None:
            self._loader.load_state_dict(info.loader)
        plan = Plan.from_dict(info.plan) if info.plan else None
        moved = f", resharded from {plan.to_string()}" if plan and plan != self.plan else ""
        if info.rng_restored and info.world_size != self.world_size:
            moved += (f"; saved by {info.world_size} rank(s): every rank continues rank 0's "
                      f"random states")
        self.print(f"loaded {info.path} (step {info.step}{moved})")
        return info.step

    def _start_watchdog(self) -> None:
        """The hang watchdog of a multi-rank job, once the mesh exists (plan='auto': after
        run.parallelize)."""
        if self._watchdog is None and self.world_size > 1 and self.mesh is not None:
            from .diagnostics import watchdog

            self._watchdog = watchdog.start(self.rank, self.world_size, self.mesh,
                                            self.timeout, dict(os.environ),
                                            desync_check=self.desync_check)

    def _step_guard(self) -> Any:
        """The per-step agreement on NaN/inf and stop requests (plait.guard)."""
        if self._guard is None:
            from .guard import StepGuard

            holds_loss = True
            if self.plan.pp > 1:  # only the last pipeline stage computes the loss
                from .parallel.schedules import stage_to_rank

                last = stage_to_rank(self.plan.pp_schedule, self.plan.pp,
                                     self.plan.virtual_stages)[-1]
                holds_loss = self._mesh()["pp"].get_local_rank() == last
            self._guard = StepGuard(self.nonfinite, self.rank, self.world_size,
                                    holds_loss=holds_loss, device=self.device,
                                    stop_request=self._stop,
                                    pause=self.ledger.paused if self.ledger is not None else None)
        return self._guard

    def _stop_on_sigterm(self, save: Any) -> None:
        """On SIGTERM (a cluster's preemption notice), finish the current step on every rank,
        call ``save()`` (collective: a final checkpoint) and exit with 143. Without this,
        SIGTERM ends a worker at once, as it does any process."""
        from .lifecycle import StopRequest

        if self._stop is None:
            self._stop = StopRequest().install()
        self._final_save = save
        if self._guard is not None:
            self._guard.stop_request = self._stop

    def _final_checkpoint(self) -> None:
        """The save SIGTERM asks for: the state after the last step (unless just saved),
        written to the end, not in the background."""
        ckpt = self.checkpointing
        if self._last_step_args is not None and ckpt.last_saved != self.steps_done:
            self.save()
        if ckpt.pending is not None:
            ckpt.pending.wait()

    def _stop_if_asked(self, step: int) -> None:
        """After a step that some rank got SIGTERM (or Ctrl-C) during: every rank saves and
        leaves here, with 128 + the signal (a rank told by another: SIGTERM's 143)."""
        if self._guard is None or not self._guard.last.stop:
            return
        signum = getattr(self._stop, "signum", None) or signal.SIGTERM
        self.print(f"step {step}: stopping on {signal.Signals(signum).name}"
                   + (", saving a final checkpoint" if self._final_save else ""))
        if self._final_save is not None:
            self._final_save()
        self.close()
        from .lifecycle import under_torchrun

        if self.format == "json" and self.is_main and not under_torchrun(os.environ):
            # the event a program reading `python train.py --format json` ends on (under
            # plait run the launcher writes it, once, for the whole job)
            from .outputs import json_error

            print(json_error(_script_name(), f"stopped by {signal.Signals(signum).name}",
                             128 + signum), flush=True)
        raise SystemExit(128 + signum)

    def _loss_scaler(self) -> Any:
        """The fp16 loss scale (``plait.loss_scale.LossScaler``), None under fp32 and bf16."""
        if self.plan.mixed_precision != "fp16":
            return None
        if self.loss_scaler is None:
            from .loss_scale import LossScaler

            self.loss_scaler = LossScaler()
        return self.loss_scaler

    def _first_reference(self, items: int) -> float:
        """The first fp16 step's reference count (``plait.loss_scale``): the job's throughput
        count, the largest rank's times the data replicas, one number on every rank (one
        all-reduce, once per run)."""
        value = torch.full((1,), float(max(items, 1)), device=self.device)
        if self.world_size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value) * self.dp_size

    def _update_loss_scale(self, scaler: Any, step: int, count: float) -> None:
        """fp16: a non-finite gradient norm with a finite loss is an overflow of the scaled
        gradients, not an error: every rank skipped the update (the guard's verdict, agreed on
        every rank) and the scale halves. A non-finite loss is left to the guard's policy."""
        verdict = self._guard.last
        overflow = verdict.bad_grad_rank is not None and verdict.bad_loss_rank is None
        before = scaler.scale
        scaler.update(step, overflow=overflow, clean=not verdict.nonfinite, count=count)
        self.stats.loss_scale = scaler.scale
        if overflow:
            self.stats.overflows.append(step)
            self.print(f"step {step}: fp16 gradients overflowed at loss scale {before:g}: "
                       f"update skipped, scale now {scaler.scale:g}")

    def _apply_verdict(self, step: int) -> None:
        """Act on what the ranks agreed about this step: raise on NaN/inf under "stop", note a
        skipped update under "skip". Under fp16 a non-finite gradient norm with a finite loss
        is the loss scale's overflow (:meth:`_update_loss_scale`), not an error."""
        from .guard import NonFiniteError

        verdict = self._guard.last
        if not verdict.nonfinite:
            return
        if self._loss_scaler() is not None and verdict.bad_loss_rank is None:
            return
        if self.nonfinite == "stop":
            raise NonFiniteError(f"{verdict.describe(step)}: stopped there (plait.init("
                                 f"nonfinite='skip') drops such a step's update instead)")
        self.stats.skipped.append(step)
        self.print(f"{verdict.describe(step)}: update skipped")

    def _optimizer_for(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer that steps: the user's, or its ZeRO-1 sharded twin (see
        ``plait.parallel.zero.zero1_optimizer``)."""
        if self.spmd is not None:  # XLA refuses ZeRO-1 up front: nothing to shard here
            return optimizer
        from .parallel.zero import zero1_optimizer

        return zero1_optimizer(optimizer, self._mesh(), self.plan, self._sharded_optimizers)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's ``state_dict()`` under the user's own names (wrappers stripped),
        as full CPU tensors (floating point in fp32), on every rank, whatever the layout: TP
        and FSDP shards are gathered and pipeline stages pooled. The one-device model's
        ``load_state_dict`` takes it as it is (persistent buffers only, tied weights under each
        name). Collective: every rank must call it. Every rank holds the whole model for a
        moment: this is for inspection, export and comparison, not for checkpoints of large
        models."""
        from .check import full_state
        from .parallel.bn_running import average_running_stats
        from .parallel.buffer_sync import broadcast_ddp_buffers, broadcast_written_buffers

        average_running_stats(model)  # FSDP2 without sync_bn: one value on every data rank
        broadcast_written_buffers(model)  # and rank 0's other buffers, as DDP
        broadcast_ddp_buffers(model)  # DDP: rank 0's, which its next forward would take
        pp_group = self._mesh()["pp"].get_group() if self.plan.pp > 1 else None
        return full_state(model, pp_group, buffers=True, user_names=True)

    def memory_report(self) -> dict[str, Any] | None:
        """Model-state bytes per rank beside the plan's closed form (collective; None before the
        first step). Format it with ``plait.memory.format_memory_report``."""
        if self._memory is None:
            return None
        from .memory import memory_report

        return memory_report(self._memory, self.plan, accelerator=self.accelerator)

    def _totals_exchange(self) -> tuple[TotalsExchange | None, bool]:
        """The step's (loss sum, count) all-reduce, started after the last backward
        (``plait.train.TotalsExchange``), and whether the step guard's flags travel in it
        (when the data replicas are the whole job: DDP, ZeRO, HSDP). None with pipelines
        (their totals exist only once the schedule ends), on XLA SPMD and with one replica:
        those take :meth:`_global_totals` after backward. Made once, reused every step."""
        if self._exchange is None:
            self._exchange = self._make_totals_exchange()
        return self._exchange

    def _make_totals_exchange(self) -> tuple[TotalsExchange | None, bool]:
        if self.spmd is not None or self.plan.pp > 1:
            return None, False
        group, size = self._totals_group()
        if group is None:
            return None, False
        whole_job = size == self.world_size
        pause = self.ledger.paused if self.ledger is not None else contextlib.nullcontext
        return TotalsExchange(group,
                              extra=self._step_guard().local_flags if whole_job else None,
                              pause=pause), whole_job

    def _global_totals(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's ``[loss sum, count]`` summed over the data replicas; with pipelines,
        taken from the last stage (see ``plait.train.reduce_totals``). Under XLA SPMD the
        step's program already covers the global batch."""
        if self.spmd is not None:
            return local.detach().float()
        pp_group, last_pp = None, 0
        if self.plan.pp > 1:
            from .parallel.schedules import stage_to_rank

            pp_group = self._mesh()["pp"].get_group()
            # The last stage's pp rank: pp - 1, except for V schedules (ZB-V) where it is 0.
            last_pp = stage_to_rank(self.plan.pp_schedule, self.plan.pp,
                                    self.plan.virtual_stages)[-1]
        dp_group, _ = self._totals_group()
        return reduce_totals(local, dp_group=dp_group, pp_group=pp_group, last_pp_rank=last_pp)

    def _totals_group(self) -> tuple[Any, int]:
        """The group the step's (loss sum, count) is summed over, and its size: the data
        replicas, and with context parallelism their cp ranks too (each holds the loss of its
        slice of the sequences); None for one rank."""
        if self.plan.cp > 1:
            from .mesh import DP_CP

            return self._mesh()[DP_CP].get_group(), self.dp_size * self.plan.cp
        if self.dp_size > 1:
            return self._mesh()["dp"].get_group(), self.dp_size
        return None, 1

    def _pipeline_totals(self, local: torch.Tensor, model: nn.Module
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """With pipelines: the global ``[loss sum, count, items]`` and the step guard's flags in
        the same collectives (``plait.train.pipeline_totals``), and those flags as the guard's
        ``agreed`` when they were summed over the whole job and the gradient norm is the
        job's (clipping): a clean step then needs no agreement of its own (``plait.guard``).
        Under cp the last stage's refusal of its loss travels with the flags too
        (``PipelineRunner.take_refusal``), refused on every rank before the update."""
        from .parallel.pipeline import REFUSAL_FLAGS, refuse_if_seen

        guard = self._step_guard()  # it knows which rank holds the last stage's loss
        pp_group = self._mesh()["pp"].get_group()
        dp_group, replicas = self._totals_group()  # the data ranks (x cp)
        own = guard.local_flags(local[0])
        runner = layout_of(model).pipeline
        if runner is not None:  # the last stage's refusals travel with the flags
            own = torch.cat([own.float(), torch.tensor(runner.take_refusal(),
                                                       device=own.device)])
        totals, flags = pipeline_totals(local, own, holds_loss=guard.holds_loss,
                                        pp_group=pp_group, dp_group=dp_group)
        if runner is not None:
            refuse_if_seen(flags[-REFUSAL_FLAGS:].tolist(), self.plan.cp, replicas, self.plan)
            flags = flags[:-REFUSAL_FLAGS]
        whole_job = self.plan.pp * replicas == self.world_size
        return totals, flags if whole_job and self.plan.grad_clip else None

    # ------------------------------------------------------------------ end of run
    def summary(self) -> dict[str, Any]:
        """End-of-run figures for this job (gathered to every rank)."""
        local = report.local_memory(self.accelerator)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local)
        # Warm-up steps left out of the rates: the first (allocation, autotuning), and on
        # PyTorch/XLA the ones its diagnostics call warm-up (they compile the step).
        warmup = self.xla.warmup if self.xla is not None else 1
        info = report.summarize(self.plan, self.stats, gathered, world_size=self.world_size,
                                accelerator=self.accelerator.name,
                                wall_s=time.perf_counter() - self._started, warmup=warmup)
        if self.ledger is not None:
            stepped = list(self._steps.labels.values())  # in the order first stepped
            # every rank steps the same models: no collective unpaired
            if len(stepped) > 1 or self._steps.inner_calls:
                comm = self.ledger.report(
                    steps=max(len(self.stats.step_times) - self.ledger_warmup, 1))
                if comm.rows and len(stepped) == 1:
                    comm.notes.append(
                        f"run.step(..., inner=True) stepped {stepped[0]} several times per "
                        f"step: the bytes are all of those updates' per step; the expected "
                        f"column prices one update, so it is left out")
                elif comm.rows:
                    comm.notes.append(
                        f"run.step trained {len(stepped)} models on each batch ("
                        f"{', '.join(stepped)}): the bytes are all of theirs per step (a "
                        f"backward through another model, as a GAN's generator's through its "
                        f"discriminator, reduces that model's gradients too); the expected "
                        f"column prices one model, so it is left out")
            else:
                expected = self._expected_traffic()
                comm = self.ledger.report(expected=expected)
                if expected is None and comm.rows:
                    from .comm.predict import no_expected_note

                    comm.notes.append(no_expected_note(self._models, self.plan, self._stats,
                                                       self._batch_shape, self._tokens))
            info["comm"] = comm.to_dict()
            info["comm_table"] = comm.table()
        if self.xla is not None:
            info["xla"] = self.xla.report()
        return info

    def _expected_traffic(self) -> Expected | None:
        """Closed-form bytes and calls per (axis, op) (``expected_for_models``), or None where
        plait has none: tensor or pipeline parallelism on a model other than its reference
        transformer."""
        from .comm.predict import expected_for_models

        # ZeRO-1 broadcasts what its optimizer holds, which may differ from the trainable
        # parameters (frozen ones given to it too)
        zero1 = [p for _, sharded in self._sharded_optimizers.values()
                 for group in sharded.param_groups for p in group["params"]]
        pp_rank = self._mesh()["pp"].get_local_rank() if self.plan.pp > 1 else 0
        from .comm.ready_order import agreed_order

        # rank 0's order on every rank, as DDP rebuilds its buckets (every rank holds the same
        # DDP modules, recorded alike)
        orders = {key: agreed_order(recorder) for key, recorder in self._ready.items()}
        # the model run.step trains (a frozen teacher laid out after it moves no gradient)
        models = [m for m in self._models if id(m) in self._steps.labels] or self._models
        stats, input_grad = self._ledger_inputs.get(id(models[-1]) if models else 0,
                                                    (self._stats, self._input_grad))
        return expected_for_models(models, self.plan, self._batch_shape,
                                   optimizer_params=zero1 or None, stats=stats,
                                   pp_rank=pp_rank, tokens=self._tokens,
                                   input_grad=input_grad, ready_orders=orders,
                                   stack_seqs=self._stack_seqs)

    def finish(self, print_summary: bool = True) -> dict[str, Any]:
        """Print the summary on rank 0, free the models and leave the process group; with
        ``init(checkpoint=...)``, save the final state first unless it was just saved."""
        ckpt = self.checkpointing
        if ckpt is not None and self._last_step_args is not None \
                and ckpt.last_saved != self.steps_done:
            self.save()
        self._draw_line(self.steps_done)  # the last step's, if no call drew it
        if self.progress is not None:
            self.progress.close()
        if self._watchdog is not None:  # a rank that skipped a collective is caught here too
            self._watchdog.step_started(self.first_step + len(self.stats.step_times) + 1,
                                        finishing=True)
            self._watchdog.await_check()  # now: no collective need follow
        info = self.summary()
        if self.plot is not None:
            info["plot"] = self._plot(self.plot)
        memory = self.memory_report()
        if memory is not None:
            info["model_memory"] = memory
        if print_summary and self.format == "json":
            self._say_summary(info)
        elif print_summary:
            self.print(report.format_summary(info))
            if "comm_table" in info:
                steps = max(0, len(self.stats.step_times) - self.ledger_warmup)
                if steps:
                    self.print(f"--- communication ledger: per rank per step, {steps} "
                               f"step{'s' * (steps != 1)} measured ---")
                    self.print(info["comm_table"])
                else:  # a table of zeros beside the expected bytes would read as a fault
                    self.print(f"--- communication ledger: no step measured (the first "
                               f"{self.ledger_warmup} carry one-off traffic and are not "
                               f"counted); train more than {self.ledger_warmup} steps ---")
            if memory is not None:
                from .memory import format_memory_report

                self.print(format_memory_report(memory))
            if "xla" in info:
                from .diagnostics.xla import format_report

                self.print(format_report(info["xla"]))
        self.close()
        return info

    def _say_summary(self, info: dict[str, Any]) -> None:
        """``format="json"``: one ``ledger`` event per row of the communication ledger, then
        the ``summary`` event: every figure of the text summary (and the ledger's totals and
        notes under "comm", without its rows)."""
        if not self.is_main or self.quiet:
            return
        from .outputs import json_event

        data = {k: v for k, v in info.items() if k != "comm_table"}
        comm = data.get("comm")
        if comm is not None:
            for row in comm["rows"]:
                print(json_event("ledger", **row, steps=comm["steps"]), flush=True)
            data["comm"] = {k: v for k, v in comm.items() if k != "rows"}
        print(json_event("summary", **data), flush=True)

    def _plot(self, path: str) -> str:
        """Rank 0 draws every rank's step times (gathered: collective) beside the loss."""
        from .progress import plot_run

        times: list[Any] = [None] * self.world_size
        dist.all_gather_object(times, self.stats.step_times)
        if self.is_main:
            plot_run(path, [float(v) for v in self.stats.losses], times,
                     title=f"{self.plan.describe()} on {self.world_size} x {self.accelerator.name}")
            self.print(f"plot: {path}")
        return path

    def close(self, *, leaving: bool = False) -> None:
        """Free parallel modules before the group goes: a DDP reducer still alive after
        ``destroy_process_group`` can deadlock on the GIL at exit (its teardown joins a gloo
        thread that waits for the GIL). ``leaving``: the process is exiting on an error (see
        :func:`_close_at_exit`); peers may be gone, so no barrier, and an unfinished
        asynchronous save is not waited for (the previous checkpoint stays whole)."""
        if self.checkpointing is not None and self.checkpointing.pending is not None:
            if not leaving:
                self.checkpointing.pending.wait()
            self.checkpointing.pending = None
        if self.ledger is not None:
            self.ledger.uninstall()
        if self.progress is not None:
            self.progress.close()
        self._models.clear()
        for recorder in self._ready.values():  # it holds its DDP module: freed with the rest
            recorder.close()
        self._ready.clear()
        self._sharded_optimizers.clear()
        if self._memory is not None:
            self._memory.remove()
            self._memory = None
        import gc

        gc.collect()
        if self.owns_group and dist.is_initialized() and not leaving:
            dist.barrier()
        if self._watchdog is not None:  # before its process groups go
            self._watchdog.close()
            self._watchdog = None
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False
        if self._json_stdout is not None:  # the script's stdout and excepthook, as found
            from .json_stdout import restore

            restore(self._json_stdout)
            self._json_stdout = None
        if self._stop is not None:  # Ctrl-C and SIGTERM act at once again after the run
            self._stop.uninstall()


def _close_at_exit(ref: weakref.ref) -> None:
    """At interpreter exit, close a Run that still holds its process group: the script ended
    on an error (a NonFiniteError, a user's exception) before ``finish()``. Left to static
    destruction, the group's C++ threads were sometimes still joinable and the rank died with
    SIGABRT ("terminate called without an active exception") after its traceback, which then
    read as a crash in C++."""
    run = ref()
    if run is not None and run.owns_group and dist.is_initialized():
        with contextlib.suppress(Exception):
            run.close(leaving=True)


def drop_stale_gradients(model: nn.Module) -> None:
    """Drop the gradients ``model``'s parameters hold before its step's backward, as
    ``opt.zero_grad()`` at the top of a one-device loop does: another model's backward put
    them there (a GAN's generator step runs backward through the discriminator), and the step
    would otherwise add them, at the scale of that step's loss sums, to its own."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad = None


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer,
                     checked: set[tuple[int, int]],
                     others: list[tuple[str, nn.Module]] | None = None) -> None:
    """Refuse an optimizer built on the parameters the layout replaced.

    FSDP2 and tensor parallelism swap a module's parameters for new (DTensor) ones, so an
    optimizer made before ``run.parallelize`` holds tensors that no longer get gradients while
    the model's own go unstepped: training silently moves only what the layout left in place.
    Both signs together (the optimizer holds foreign tensors and misses trainable ones of the
    model) name that mistake; either alone is a choice (an optimizer for a subset, a learnable
    parameter of the loss). Checked once per model and optimizer, at the end of their first
    step: from a forward to its backward FSDP2 leaves a root module's unsharded parameters
    registered, and only its backward puts back the sharded ones that an optimizer built
    after ``run.parallelize`` holds. ``others``: the run's other
    models, by class name: an optimizer of one of them (a GAN's generator's handed to the
    discriminator's step) is named as such."""
    key = (id(model), id(optimizer))
    if key in checked:
        return
    own = {id(p) for p in model.parameters()}
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    foreign = len(held - own)
    missing = sum(1 for p in model.parameters() if p.requires_grad and id(p) not in held)
    if foreign and missing:
        held_by = next((name for name, other in others or []
                        if held <= {id(p) for p in other.parameters()}), None)
        if held_by is not None:
            raise ValueError(f"run.step got the optimizer of another model: it holds "
                             f"{foreign} parameter(s) of {held_by}, laid out with "
                             f"run.parallelize, and none of the {missing} trainable ones of "
                             f"the model it steps; pass each model its own optimizer, built "
                             f"on that model's parameters (run.step(disc, batch, loss_fn, "
                             f"opt_d))")
        raise ValueError(f"the optimizer holds {foreign} tensor(s) that are not the model's "
                         f"parameters and misses {missing} of the model's trainable ones: "
                         f"run.parallelize replaced them (sharded or split), so an optimizer "
                         f"built before it trains the old copies; build it after, on the "
                         f"returned model: opt = torch.optim.AdamW(model.parameters())")
    checked.add(key)


def _parts(batch: Any) -> Any:
    """What a step's bookkeeping reads of ``batch``: a tuple of its micro-batches for
    :class:`~plait.batch_rows.MicroBatches`, the batch itself otherwise."""
    return batch.parts if isinstance(batch, MicroBatches) else batch


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, MicroBatches):
        return MicroBatches(tuple(_to_device(p, device) for p in batch.parts))
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _first_input(batch: Any) -> Any:
    """The first input tensor of a batch ((inputs, targets) or a dict of model arguments; its
    first micro-batch's for :class:`~plait.batch_rows.MicroBatches`)."""
    if isinstance(batch, MicroBatches):
        return _first_input(batch.parts[0])
    inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
    if isinstance(inputs, dict):
        inputs = next(iter(inputs.values()), None)
    if isinstance(inputs, (tuple, list)):
        inputs = inputs[0]
    return inputs


def _refuse_compiled_wrapper(model: nn.Module) -> None:
    from .parallel.compile import wrapped_after_layout

    why = wrapped_after_layout(model)
    if why is not None:
        raise ValueError(why)


def _count_items(batch: Any) -> tuple[int, str]:
    """What throughput counts in a local batch, and its unit: token ids (an integer input of
    one or two dimensions) count each id; a sequence of vectors (a float input of batch x
    positions x features) counts its positions; anything else (images, rows of features)
    counts samples, not the numbers in them. Token ids that come with an ``attention_mask``
    (the Hugging Face convention) count the positions it keeps: padding is not throughput."""
    inputs = _first_input(batch)
    if not isinstance(inputs, torch.Tensor) or inputs.ndim == 0:
        return 0, "tokens"
    if not inputs.is_floating_point() and inputs.ndim <= 2:
        mask = _attention_mask(batch)
        if mask is not None and mask.shape == inputs.shape:
            return int(mask.count_nonzero()), "tokens"
        return int(inputs.numel()), "tokens"
    if inputs.is_floating_point() and inputs.ndim == 3:
        return int(inputs.shape[0] * inputs.shape[1]), "tokens"
    return int(inputs.shape[0]), "samples"


def _tensor_versions(model: nn.Module) -> list[tuple[int, int]]:
    """(id, in-place version) of every parameter and buffer: any load or in-place write since
    changes it (a DTensor's own counter moves with writes through it)."""
    return [(id(t), t._version) for t in (*model.parameters(), *model.buffers())]


def _attention_mask(batch: Any) -> torch.Tensor | None:
    """The ``attention_mask`` of a dict batch, or of the dict of inputs in ``(inputs,
    targets)``; None when there is none."""
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    return mask if isinstance(mask, torch.Tensor) else None


def init(plan: PlanSource = None, *, accelerator: str | None = None, seed: int | None = None,
         log_every: int = 10, quiet: bool = False, ledger: bool = False,
         checkpoint: str | Path | None = None, every: int | None = None, keep: int | None = 3,
         async_save: bool = False, cluster: Any = None, global_batch: int | None = None,
         seq: int | None = None, strict: bool = False, tensorboard: str | None = None,
         plot: str | None = None, nonfinite: str = "stop", timeout: float = 300.0,
         desync_check: bool = True, format: str | None = None) -> Run:
    """Join (or create) the process group, pick the device, build the mesh for ``plan``.

    ``plan``: a Plan, a plan string (``"dp=2,tp=2"``), a dict, or a .yaml/.json path; when None,
    the script's ``--plan`` argument, else plain data parallelism over every rank. ``"auto"``:
    the planner chooses when ``run.parallelize(model)`` shows it the model, for this world size
    and accelerator (``cluster``: a calibrated profile instead of the accelerator's preset;
    ``global_batch`` and ``seq``: the workload to plan for), see ``plait.auto``.
    Under torchrun (or ``plait run``) the rank and world size come from its variables; without
    them this is a one-process job. ``ledger=True`` records every collective of the training
    steps and prints, at ``finish()``, bytes per mesh axis and collective beside the closed form.

    ``seed``: None takes the seed the script set, ``torch.manual_seed(s)`` before this call
    (rank 0's ``torch.initial_seed()``: random in a script that never seeds), and gives it and
    rank 0's random state to every rank, so replicas start from the same weights; an integer
    seeds every rank with it. Rank 0 prints the seed in use (``run.seed``; the ``plan`` event
    under ``format="json"``): ``plait.init(seed=run.seed)`` runs that job again.

    ``checkpoint="ckpt/"`` saves there every ``every`` steps (and at ``finish()``), keeping the
    newest ``keep``, and resumes from the newest one when the folder holds any: the first
    ``run.step`` loads it and ``run.loader`` continues at its step. ``async_save=True`` writes in
    the background. Bad values and an unwritable folder are refused here, before any work.

    ``accelerator``: "cpu", "cuda", "tpu" (TorchTPU), "xla" (PyTorch/XLA), ...; when None, the
    script's ``--accelerator`` argument, else the best one present. On XLA the plan's degrees
    count the slice's devices, ``finish()`` reports recompilations, CPU fallbacks and host
    syncs, and ``strict=True`` raises at the step where one appears instead.

    Bad input raises ValueError before any work starts; when it came from the script's command
    line (``--plan``, ``--accelerator``) the process ends as argparse ends it: one line on
    stderr, exit status 2, no traceback.

    ``tensorboard=DIR`` writes loss, tokens/s and step time there (rank 0); ``plot=PATH`` saves
    a PNG of the loss and every rank's step time at ``finish()``. On a terminal rank 0 shows a
    live progress bar, elsewhere a plain line every ``log_every`` steps.
    ``format``: ``"text"`` for people, ``"json"`` for programs: rank 0 then writes JSON Lines
    on stdout, one event per line (plan, message, progress, ledger, summary; see
    ``Run.say``); when None, the script's ``--format`` argument (as ``plait run --format json``
    passes it), else text. Under "json" every line on stdout is an event until ``finish()``:
    ``sys.stdout`` writes the script's own prints as ``output`` events and an uncaught
    exception ends with an ``error`` event (``plait.json_stdout`` says why a library may do
    that here), and a bad ``--plan`` is an ``error`` event too, for a script run without
    ``plait run`` (``python train.py --format json | jq``, or under torchrun).
    ``nonfinite``: what a NaN/inf loss or gradient norm does, found on the step it appears on
    every rank: ``"stop"`` raises ``plait.guard.NonFiniteError`` naming the step and the rank,
    ``"skip"`` drops that step's update and carries on (the summary lists skipped steps).
    ``timeout``: seconds a rank may wait in a collective of a step before the hang watchdog
    (plait.diagnostics.watchdog) ends every rank with a report naming the ranks that did not
    reach it, the mesh axis and the step; torch's own process-group timeout is set a minute
    longer, so that its report (which names no rank) does not come first.
    ``desync_check``: at the start of every step the ranks compare how many collectives each
    issued (one small all-gather on a gloo group of its own, waited for just before the step's
    first collective), so that a rank that skipped or added one is named before the next
    collective pairs with the wrong one. On two CPU processes it costs 0.5-1 ms of a 17 ms DDP
    step (bench/guard_cost.py); ``False`` drops it, and a desynchronised job is then reported
    at the timeout, without naming the rank at fault.
    """
    from_argv = False
    try:
        if format is None:
            format = format_from_argv() or "text"
        if accelerator is None:
            accelerator = accelerator_from_argv()
            from_argv = accelerator is not None
        if plan is None:
            plan = plan_from_argv()
            from_argv = from_argv or plan is not None
    except ValueError as exc:
        _refuse_argv(exc, format)
    try:
        return _init(plan, accelerator, seed=seed, log_every=log_every, quiet=quiet,
                     ledger=ledger, checkpoint=checkpoint, every=every, keep=keep,
                     async_save=async_save, cluster=cluster, global_batch=global_batch,
                     seq=seq, strict=strict, tensorboard=tensorboard, plot=plot,
                     nonfinite=nonfinite, timeout=timeout, desync_check=desync_check,
                     format=format)
    except ValueError as exc:
        if not from_argv:
            if format == "json":  # every rank refuses the same plan: one error event
                from .json_stdout import say_if_uncaught

                say_if_uncaught(_script_name(), exc, _env_rank())
            raise
        _refuse_argv(exc, format)


def _refuse_argv(exc: ValueError, format: str | None) -> NoReturn:
    """End the process on a bad ``--plan``/``--accelerator`` as argparse would (one line on
    stderr, exit 2, no traceback), and under ``--format json`` with the ``error`` event on
    stdout that ``plait run --format json`` ends with."""
    from .json_stdout import refuse

    refuse(_script_name(), str(exc), json=format == "json", rank=_env_rank())


def _env_rank() -> int:
    """This process's rank as torchrun sets it (0 without torchrun, or where unreadable)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _script_name() -> str:
    """What the ``command`` of a script's own ``error`` event names: the script's file
    (``train.py``), as the user ran it."""
    return Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"


def _init(plan: PlanSource, accelerator: str | None, *, seed: int | None, log_every: int,
          quiet: bool, ledger: bool, checkpoint: str | Path | None, every: int | None,
          keep: int | None, async_save: bool, cluster: Any, global_batch: int | None,
          seq: int | None, strict: bool, tensorboard: str | None = None, plot: str | None = None,
          nonfinite: str = "stop", timeout: float = 300.0, desync_check: bool = True,
          format: str = "text") -> Run:
    from .guard import check_policy
    from .seeding import check_seed, start

    check_policy(nonfinite)
    check_seed(seed)
    if format not in ("text", "table", "json"):
        raise ValueError(f"format={format!r}: use 'text' (for people) or 'json' (JSON Lines, "
                         f"for programs)")
    checkpointing = None
    if checkpoint is not None:
        from .checkpoint.schedule import Checkpointing

        checkpointing = Checkpointing.configure(checkpoint, every, keep, async_save)
    elif every is not None or async_save:
        raise ValueError("every= and async_save= need a folder: plait.init(checkpoint='ckpt/', "
                         "every=...)")
    acc = get_accelerator(accelerator)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if (world_size != 1 or rank != 0) and "MASTER_ADDR" not in os.environ \
            and not acc.spmd and not dist.is_initialized():
        # A launcher sets all of them; without MASTER_ADDR the process would make a one-rank
        # group and fail later in torch's mesh ("Mesh should not be bigger than default world
        # size 1"), which does not say where the 2 came from.
        raise ValueError(f"WORLD_SIZE={world_size} and RANK={rank} are set but MASTER_ADDR is "
                         f"not, so no launcher started this process (variables left in the "
                         f"shell by another job?): unset WORLD_SIZE RANK LOCAL_RANK to run one "
                         f"process, or start it with plait run --nproc {world_size}")
    auto = isinstance(plan, str) and plan.strip() == "auto"
    layout = None
    if acc.spmd:  # PyTorch/XLA: one process per host, the plan spans the slice's devices
        if ledger or auto:
            raise ValueError("ledger= and plan='auto' are not built on XLA SPMD (its "
                             "collectives are inside the compiled program); drop them with "
                             "--accelerator xla")
        from .parallel.xla_spmd import build_layout

        layout = build_layout(Plan.load(plan) if plan is not None else None)  # before tensors
        resolved = layout.plan
    elif auto:
        if ledger:
            raise ValueError("ledger=True needs the plan up front, not plan='auto'; run the "
                             "script with the plan auto chose (it prints it: --plan P) and "
                             "ledger=True")
        resolved = Plan(dp_replicate=world_size)  # replaced by the planner's in parallelize
    else:
        resolved = Plan.load(plan) if plan is not None else Plan(dp_replicate=world_size)
        resolved.validate(world_size)  # before touching the network: a bad plan fails fast
        if acc.name == "tpu" and resolved.mixed_precision == "fp16":
            raise ValueError("mixed_precision=fp16 on a TPU: TPUs compute in bf16, which keeps "
                             "fp32's range and needs no loss scaling; use mixed_precision=bf16")
    check_extras(tensorboard=tensorboard, plot=plot)
    device = acc.device(local_rank)
    acc.set_device(device)
    owns_group = False
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            from .lifecycle import die_with_parent, job_store, under_torchrun

            if under_torchrun(os.environ):
                die_with_parent()  # torchrun killed: no orphaned worker
            dist.init_process_group(acc.backend, rank=rank, world_size=world_size,
                                    store=job_store(rank, world_size, os.environ),
                                    timeout=timedelta(seconds=timeout + 60),
                                    **acc.process_group_kwargs(device))
        else:  # plain `python train.py`: a one-rank group keeps every code path the same
            dist.init_process_group(acc.backend if acc.backend != "nccl" else "gloo",
                                    store=dist.HashStore(), rank=0, world_size=1)
        owns_group = True
    else:
        rank, world_size = dist.get_rank(), dist.get_world_size()
    # a resumed job goes on with the seed of the run it resumes (its data order), unless given
    saved = checkpointing.resume_loader if checkpointing is not None else None
    resumed = None if seed is not None or not saved or "seed" not in saved else int(saved["seed"])
    chosen = start(seed if resumed is None else resumed, share=layout is None)
    request = None
    if auto:
        from .auto import AutoRequest

        name = acc.device_name() if device.type == "cuda" else ""
        request = AutoRequest(world_size=world_size, device_type=device.type, device_name=name,
                              cluster=cluster, global_batch=global_batch, seq=seq)
    mesh = None if auto or layout is not None else build_mesh(resolved, device.type, world_size)
    run = Run(plan=resolved, mesh=mesh, accelerator=acc, device=device, rank=rank,
              world_size=world_size, local_rank=local_rank, seed=chosen, log_every=log_every,
              quiet=quiet, owns_group=owns_group, auto=request, spmd=layout,
              plot=plot, nonfinite=nonfinite, timeout=timeout, desync_check=desync_check,
              format="json" if format == "json" else "text")
    if layout is not None:
        from .diagnostics.xla import XLADiagnostics

        run.xla = XLADiagnostics(strict=strict)
    if run.format == "json":  # before anything prints: see plait.json_stdout for why
        from .json_stdout import install

        run._json_stdout = install(_script_name(), rank)
    run.progress = Progress(enabled=run.is_main and not quiet, log_every=log_every,
                            tensorboard=tensorboard, events=run.format == "json")
    if checkpointing is not None:
        run.checkpointing = checkpointing
        run.first_step = checkpointing.resume_step
        run.print(checkpointing.note)
        run._stop_on_sigterm(run._final_checkpoint)  # preemption: save, then leave
    from .lifecycle import AttemptRecord, node_note

    run._attempt = AttemptRecord.for_worker(rank, os.environ)
    note = node_note(rank, world_size, os.environ, socket.gethostname()) if owns_group else None
    if note and not quiet and run.format == "json":
        from .outputs import json_event

        print(json_event("message", text=note), flush=True)  # every node's rank 0 says it
    elif note and not quiet:
        print(note, flush=True)
    if owns_group:
        atexit.register(_close_at_exit, weakref.ref(run))
    run._start_watchdog()
    if ledger:
        from .comm.ledger import Ledger

        run.ledger = Ledger(mesh)
        run.ledger.install()
    if seed is None and run.format == "text":  # json: a field of the plan event
        whence = ("the checkpoint's, of the run it resumes" if resumed is not None else
                  "the script's torch.manual_seed, or drawn when it sets none")
        run.print(f"plait: seed {chosen} ({whence}); plait.init(seed={chosen}) runs this job "
                  f"again")
    if not auto:  # plan="auto": said once the planner chose, in parallelize
        run._say_plan()
    return run


