"""Save and load a training state with ``torch.distributed.checkpoint`` (collective calls).

``save`` writes every rank's shards with DCP into a temporary folder and publishes it atomically
(:mod:`plait.checkpoint.store`); ``load`` checks the checkpoint against this model before reading
a byte of tensor data, so a wrong checkpoint fails with one line instead of a DCP traceback, and
on every rank alike (the checks are agreed over the process group, so no rank is left waiting in
a collective while another raises).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from ..parallel.layout import local_modules
from . import state as st
from . import store, xla
from .errors import CheckpointError
from .safe import read_metadata, read_tensors

MODEL = "model"
OPTIM = "optim"


@dataclass
class PendingSave:
    """A save in flight (``async_save``) or done. ``wait()`` publishes it on rank 0."""

    folder: Path
    tmp: Path
    step: int
    manifest: dict[str, Any] | None  # rank 0 only
    keep: int | None
    future: Any = None  # DCP's Future (or AsyncSaveResponse) while a background save runs
    path: Path | None = None
    started: float = field(default_factory=time.perf_counter)

    def done(self) -> bool:
        return self.path is not None or self.future is None or self.future.done()

    def wait(self) -> Path:
        """Block until this rank's writes are done; rank 0 then publishes the checkpoint."""
        if self.path is not None:
            return self.path
        if self.future is not None:
            self.future.result()
        if self.manifest is not None:  # rank 0: DCP's metadata is written, so is every shard
            self.path = store.publish(self.tmp, self.manifest)
            store.prune(self.folder, self.keep)
        else:
            self.path = self.folder / store.step_name(self.step)
        return self.path


def _gather_to_main(value: Any, group: dist.ProcessGroup | None) -> list[Any] | None:
    world = dist.get_world_size(group)
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out if dist.get_rank(group) == 0 else None


def _agree(error: str | None) -> None:
    """Raise the same CheckpointError on every rank when any rank found one."""
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def _group_settings(per_rank: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Optimizer settings of every rank, as groups of parameter names with identical settings."""
    import json

    groups: dict[str, dict[str, Any]] = {}
    for settings in per_rank:
        for fqn, values in settings.items():
            plain = store.to_plain(values, f"optimizer settings of {fqn}")
            key = json.dumps(plain, sort_keys=True)
            entry = groups.setdefault(key, {"settings": plain, "params": []})
            if fqn not in entry["params"]:
                entry["params"].append(fqn)
    return list(groups.values())


def _describe(model: nn.Module) -> dict[str, Any]:
    """The user's model class, and a Hugging Face model's config (``plait export`` writes it as
    config.json)."""
    import sys

    stages = local_modules(model)
    user = st._unwrap(stages[0])
    # FSDP2 swaps the class for a subclass named FSDP<class>.
    info: dict[str, Any] = {"class": type(user).__name__.removeprefix("FSDP")}
    transformers = sys.modules.get("transformers")  # imported iff the model is one of theirs
    if transformers is not None and isinstance(user, transformers.PreTrainedModel):
        try:
            info["hf_config"] = store.to_plain(user.config.to_dict(), "config")
        except CheckpointError:  # a config field that is not plain data: export needs a file
            pass
    return info


def save(folder: str | Path, *, step: int, model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
         plan: Any = None, loader: Any = None, device: torch.device | None = None,
         keep: int | None = None, async_group: dist.ProcessGroup | None = None,
         extra: dict[str, Any] | None = None) -> PendingSave:
    """Save this job's training state as ``folder/step-NNNNNNNN`` (collective: every rank).

    Returns a ``PendingSave``: with ``async_group`` (a gloo group used only for checkpoints)
    the shards are copied to host memory now and written in the background (on XLA too, see
    :func:`plait.checkpoint.xla.save_in_background`); call ``wait()`` before the next save and
    before exit. Without it the checkpoint is published on return.
    ``keep`` deletes all but the newest ``keep`` checkpoints after publishing.
    """
    from .. import __version__

    folder = Path(folder)
    device = device or torch.device("cpu")
    on_xla = xla.is_xla(device)
    if on_xla:
        xla.materialize()  # every tensor read below holds its value and its sharding
    model_sd, optim_tensors, settings, _ = st.collect(model, optimizer)
    local = {"rng": st.rng_state(device), "settings": settings}
    gathered = _gather_to_main(local, None)
    manifest = None
    error = None
    tmp = store.temp_dir(folder, step)
    if gathered is not None:
        try:
            tmp = store.begin(folder, step)
            manifest = {
                "format": store.FORMAT, "plait_version": __version__,
                "torch_version": torch.__version__, "step": step,
                "world_size": dist.get_world_size(), "saved_at": time.time(),
                "plan": plan.to_dict() if plan is not None else None,
                "optimizer": ({"class": type(st.stateful_optimizer(optimizer)).__name__,
                               "param_groups": _group_settings([g["settings"]
                                                                for g in gathered])}
                              if optimizer is not None else None),
                "scheduler": (store.to_plain(scheduler.state_dict(), "scheduler state")
                              if scheduler is not None else None),
                "loader": (store.to_plain(loader.state_dict(), "loader state")
                           if loader is not None else None),
                "rng": [g["rng"] for g in gathered],
                "model": _describe(model),
                "extra": store.to_plain(extra or {}, "extra"),
            }
        except (OSError, CheckpointError) as exc:
            error = f"cannot save to {folder}: {exc}"
    _agree(error)
    state = {MODEL: model_sd}
    if optim_tensors:
        state[OPTIM] = optim_tensors
    writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True,
                                  thread_count=1)
    pending = PendingSave(folder=folder, tmp=tmp, step=step, manifest=manifest, keep=keep)
    if async_group is not None:
        pending.future = (xla.save_in_background(state, writer, async_group) if on_xla
                          else dcp.async_save(state, storage_writer=writer,
                                              process_group=async_group))
        return pending
    dcp.save(state, storage_writer=writer, planner=xla.save_planner() if on_xla else None)
    error = None
    if manifest is not None:
        try:
            pending.wait()
        except OSError as exc:
            error = f"cannot publish {tmp} in {folder}: {exc}"
    _agree(error)
    pending.path = folder / store.step_name(step)
    return pending


@dataclass
class Loaded:
    """What ``load`` restored, for the caller (the runtime) to act on."""

    path: Path
    step: int
    plan: dict[str, Any] | None
    world_size: int
    loader: dict[str, Any] | None
    extra: dict[str, Any]
    rng_restored: bool
    rng_rank: int | None = None  # the saved rank whose random states this rank now has
    notes: list[str] = field(default_factory=list)  # what was not loaded, and why


def _shape(value: Any) -> list[int]:
    return list(value.shape)


def _check_model(path: Path, metadata: Any, model_sd: dict[str, Any]) -> str | None:
    """Compare the whole model (every rank's share) with the checkpoint; None when they match."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    local = {k: _shape(v) for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    mine: dict[str, list[int]] = {}
    for part in everyone:
        mine.update(part)
    saved = {k[len(MODEL) + 1:]: list(v.size) for k, v in metadata.state_dict_metadata.items()
             if k.startswith(MODEL + ".") and isinstance(v, TensorStorageMetadata)}
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    shapes = sorted(k for k in set(mine) & set(saved) if mine[k] != saved[k])
    if not (missing or unexpected or shapes):
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} parameter(s) of this model are not in it ("
                     + ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "") + ")")
    if unexpected:
        parts.append(f"it holds {len(unexpected)} this model lacks ("
                     + ", ".join(unexpected[:3]) + (", ..." if len(unexpected) > 3 else "") + ")")
    for k in shapes[:3]:
        parts.append(f"{k} is {saved[k]} there, {mine[k]} here")
    return (f"checkpoint {path} is of another model: " + "; ".join(parts)
            + "; load it into the model it was saved from")


def load(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         scheduler: Any = None, device: torch.device | None = None,
         restore_rng: bool = True, read_model: bool = True, resuming: bool = False) -> Loaded:
    """Load the checkpoint at ``path`` (a step folder, or the latest in a checkpoint folder)
    into ``model`` (any layout) and ``optimizer`` (collective: every rank).

    Random states: at the world size saved, each rank gets its own back; at another, every
    rank gets saved rank 0's (see :func:`rng_source`). ``restore_rng=False`` leaves them alone.
    ``read_model=False``: the model already holds these weights (:func:`load_weights`); only
    the rest is read.

    ``resuming``: a run continuing from its checkpoint folder, where the LR scheduler may come
    or go between runs (one added to fine-tune, one dropped to hold the LR): a scheduler with
    no saved state starts fresh and saved state with no scheduler to take it is not loaded,
    each said in ``Loaded.notes``. An explicit load with a scheduler the checkpoint lacks is
    refused instead.
    """
    device = device or torch.device("cpu")
    on_xla = xla.is_xla(device)
    step_dir = manifest = metadata = None
    error = None
    try:
        step_dir = store.resolve(path)
        manifest = store.read_manifest(step_dir)
        metadata = read_metadata(step_dir)
    except CheckpointError as exc:
        error = str(exc)
    _agree(error)
    assert step_dir is not None and manifest is not None and metadata is not None
    model_sd, optim_tensors, wanted, strided = st.collect(model, optimizer)
    if on_xla:  # the optimizer state collect made for a fresh optimizer, computed and
        xla.materialize()  # sharded as the parameters are, so DCP writes into each shard
    _agree(_check_model(step_dir, metadata, model_sd))
    error = None
    if optimizer is not None:
        keys = metadata.state_dict_metadata
        absent = sorted(k for k in optim_tensors if f"{OPTIM}.{k}" not in keys)
        if manifest.get("optimizer") is None:
            error = f"checkpoint {step_dir} holds no optimizer state; load it without an optimizer"
        elif absent:
            error = (f"checkpoint {step_dir} has no optimizer state {absent[0]!r}: it was saved "
                     f"with a {manifest['optimizer'].get('class')} optimizer; use that class")
    notes = []
    saved_scheduler = manifest.get("scheduler")
    if scheduler is not None and saved_scheduler is None:
        if not resuming:
            error = error or (f"checkpoint {step_dir} holds no LR scheduler state; load it "
                              f"without a scheduler")
        notes.append(f"checkpoint {step_dir} holds no LR scheduler state: "
                     f"{type(scheduler).__name__} starts from its first step")
        scheduler = None
    elif scheduler is None and saved_scheduler is not None and resuming:
        notes.append(f"checkpoint {step_dir} holds an LR scheduler's state (last step "
                     f"{saved_scheduler.get('last_epoch', '?')}), and run.step was given no "
                     f"scheduler: the learning rate stays where the optimizer left it; pass "
                     f"run.step(..., scheduler=sched) to continue the schedule")
    _agree(error)
    request: dict[str, Any] = {MODEL: model_sd} if read_model else {}
    if optimizer is not None and optim_tensors:
        request[OPTIM] = optim_tensors
    if request:
        read_tensors(step_dir, request, planner=xla.load_planner() if on_xla else None)
    settings: dict[str, dict[str, Any]] = {}
    for group in (manifest.get("optimizer") or {}).get("param_groups", []):
        values = store.from_plain(group["settings"])
        for fqn in group["params"]:
            settings[fqn] = values
    st.apply(model, optimizer, model_sd, optim_tensors if optimizer is not None else {},
             settings, wanted if optimizer is not None else {}, strided)
    if scheduler is not None:
        saved = store.from_plain(manifest["scheduler"])
        changed = _schedule_changed(scheduler.state_dict(), saved)
        if changed:
            notes.append(
                f"checkpoint {step_dir} holds {type(scheduler).__name__} with "
                f"{', '.join(f'{k}={v!r}' for k, (v, _) in changed.items())}, and the script "
                f"passes {', '.join(f'{k}={v!r}' for k, (_, v) in changed.items())}: the "
                f"checkpoint's replace the script's (torch's load_state_dict restores every "
                f"setting), so the saved schedule continues; to change it, set it on the "
                f"scheduler after the first run.step of the resumed run (e.g. sched."
                f"{next(iter(changed))} = {next(iter(changed.values()))[1]!r})")
        scheduler.load_state_dict(saved)
    if on_xla:
        xla.materialize()  # the loaded values in place before the next step's graph
    rank, world = dist.get_rank(), dist.get_world_size()
    rngs = manifest.get("rng") or []
    source = rng_source(rank, world, len(rngs)) if restore_rng else None
    if source is not None:
        st.set_rng_state(rngs[source], device)
    return Loaded(path=step_dir, step=int(manifest["step"]), plan=manifest.get("plan"),
                  world_size=int(manifest.get("world_size", 0)),
                  loader=store.from_plain(manifest.get("loader")),
                  extra=store.from_plain(manifest.get("extra") or {}),
                  rng_restored=source is not None, rng_rank=source, notes=notes)


def _schedule_changed(current: dict[str, Any], saved: dict[str, Any]
                      ) -> dict[str, tuple[Any, Any]]:
    """{setting: (saved, current)} for each plain setting of an LR scheduler (``T_max``,
    ``step_size``, ``total_steps``) that differs between the checkpoint and the scheduler the
    resumed script built: a cosine schedule sized by ``--steps`` keeps the saved length when
    the run is resumed with more steps. Progress (``last_epoch``, the learning rates reached)
    and torch's private fields are not settings."""
    progress = {"last_epoch", "base_lrs"}
    return {k: (saved[k], v) for k, v in current.items()
            if k not in progress and not k.startswith("_") and k in saved
            and isinstance(v, (int, float, str, bool)) and saved[k] != v}


def load_weights(path: str | Path, model: nn.Module, device: torch.device | None = None
                 ) -> bool:
    """Load only the model's weights from the checkpoint at ``path`` when ``model`` is the model
    it holds (the same parameter names and shapes, any layout); False, with nothing read, when
    it is another model. Collective: every rank calls it and all get the same answer.

    A resumed run calls this as ``run.parallelize`` returns the model, so that the model holds
    the checkpoint's weights from then on: an evaluation before the first step, or a run with
    no steps left, sees the trained model. The optimizer, scheduler and random states wait for
    the first step (``load(..., read_model=False)``), where the optimizer exists."""
    step_dir = metadata = None
    error = None
    try:
        step_dir = store.resolve(path)
        metadata = read_metadata(step_dir)
    except CheckpointError as exc:
        error = str(exc)
    _agree(error)
    assert step_dir is not None and metadata is not None
    on_xla = xla.is_xla(device)
    if on_xla:
        xla.materialize()
    model_sd, _, _, strided = st.collect(model, None)
    if _check_model(step_dir, metadata, model_sd) is not None:
        return False
    read_tensors(step_dir, {MODEL: model_sd}, planner=xla.load_planner() if on_xla else None)
    st.apply(model, None, model_sd, {}, {}, {}, strided)
    if on_xla:
        xla.materialize()
    return True


def rng_source(rank: int, world: int, saved_world: int) -> int | None:
    """Which saved rank's random states rank ``rank`` of a ``world``-rank job resumes with.

    The same world size: its own (an exact resume). Another: rank 0's, on every rank. Why that
    one: ``plait.init`` gives every rank the same seed and random state, and a saved rank's
    states are where its stream had got to; rank 0's continues that stream on every rank, as a
    fresh start would begin it on every rank, instead of replaying the seed's first numbers (dropout
    masks of step 1 again) or inventing per-rank streams that a layout sharing random numbers
    across ranks (tensor-parallel dropout on replicated activations) would then see differ.
    None when the checkpoint holds no states."""
    if saved_world == 0:
        return None
    return rank if saved_world == world else 0
