"""What goes into a checkpoint from this rank: model and optimizer tensors under the user's own
parameter names, optimizer settings, and random-number-generator states.

Names are torch's: ``torch.distributed.checkpoint.state_dict.get_state_dict`` strips wrapper
prefixes (DDP's ``module.``, activation checkpointing's ``_checkpoint_wrapped_module.``) and
keeps FSDP2/TP parameters as DTensors, which DCP saves as shards and reshards at load. The
optimizer state is flattened per parameter name (``state.layers.0.w.exp_avg``) so that any
layout can load it: a pipeline stage or a ZeRO-1 rank asks only for its own parameters' entries.

Two things torch's helpers do not cover, done here:

* **Pipelines.** A pipelined model is this rank's stage modules, each a shallow copy of the
  user's model sharing the blocks it owns. :func:`state_module` merges them into one module
  tree holding every local parameter under its name in the full model, so one
  ``get_state_dict`` call covers the optimizer (which spans all local stages) and the names
  match a model that is not pipelined.
* **Optimizer settings** (learning rate, betas, ...) go to ``plait.json`` as plain data, one
  entry per group, instead of one pickled DCP item per parameter per setting.
* **Fused layers under TP.** A fused q|k|v weight split over tp holds ``[q_r, k_r, v_r]`` on
  rank r (a ``_StridedShard`` placement), rows that are not one block of the whole: DCP, which
  stores each rank's shard as one block at one offset, would write overlapping blocks (a save
  fails) and read the wrong rows (a load trains another model). Such a tensor, and its
  optimizer state, goes to DCP whole on every rank (:func:`_whole`; saved once, as a replicated
  tensor is) and is cut back to this rank's rows after a load.
"""

from __future__ import annotations

import base64
import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import distribute_tensor

from .._torch_compat import is_strided
from ..parallel.layout import layout_of, local_modules
from ..parallel.tp_record import quiet_logger

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_GROUPS = "param_groups."


def _unwrap(module: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return module.module if isinstance(module, DDP) else module


def _holds_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _merge(modules: list[nn.Module]) -> nn.Module:
    distinct = list({id(m): m for m in modules}.values())
    if len(distinct) == 1:
        return distinct[0]
    real = [m for m in distinct if _holds_state(m)]  # drop the stages' parameter-free stand-ins
    if len(real) <= 1:
        return (real or distinct)[0]
    merged = nn.Module()
    first = real[0]
    # The stage copies share their own parameters and buffers (shallow copies of one module).
    merged._parameters = first._parameters
    merged._buffers = first._buffers
    merged._non_persistent_buffers_set = first._non_persistent_buffers_set
    keys: list[str] = []
    for m in real:
        keys += [k for k in m._modules if k not in keys]
    for key in keys:
        children = [c for m in real if (c := m._modules.get(key)) is not None]
        if children:
            merged._modules[key] = _merge(children)
    return merged


def state_module(model: nn.Module) -> nn.Module:
    """One module whose state dict is this rank's whole share of the model, under the names of
    the user's model (a pipeline's local stages merged; see the module docstring)."""
    stages = local_modules(model)
    if len(stages) == 1 and stages[0] is model:
        # DDP's own module, not the wrapper: torch's set_state_dict adds DDP's "module." to the
        # keys by walking each module once, so a module registered under two names (T5's
        # shared embedding) keeps its second name unprefixed and the load refuses it. The
        # names are the same either way (torch strips the prefix), as are the tensors.
        return _unwrap(model)
    return _merge([_unwrap(s) for s in stages])


def stateful_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: ZeRO-1's local optimizer over this rank's
    partition (its state is saved per parameter name, each rank writing its own), else itself."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


@contextlib.contextmanager
def _without_empty_groups(optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Hide parameter groups with no parameters (a ZeRO-1 rank whose partition of a group is
    empty): torch's flattened optimizer state cannot name them, and they hold no state."""
    if optimizer is None:
        yield
        return
    groups = optimizer.param_groups
    kept = [g for g in groups if g["params"]]
    if len(kept) == len(groups):
        yield
        return
    optimizer.param_groups = kept
    try:
        yield
    finally:
        optimizer.param_groups = groups


def collect(model: nn.Module, optimizer: torch.optim.Optimizer | None
            ) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]], Strided]:
    """(model tensors, optimizer tensors, optimizer settings per parameter name, the strided
    tensors given whole) of this rank.

    The tensors are the live ones (DCP reads them for a save and writes into them for a load),
    but for strided ones, given whole (:class:`Strided`; :func:`apply` cuts them back).
    """
    module = state_module(model)
    optim = stateful_optimizer(optimizer) if optimizer is not None else None
    if optimizer is not None and optim is not None and optim is not optimizer:
        # ZeRO-1 copies its settings (a scheduler's lr) into the local optimizer only when it
        # steps: copy them now so the checkpoint holds the settings of the next step.
        for src, dst in zip(optimizer.param_groups, optim.param_groups, strict=True):
            dst.update({k: v for k, v in src.items() if k != "params"})
    with _without_empty_groups(optim):
        model_sd, optim_sd = get_state_dict(module, [optim] if optim is not None else [],
                                            options=_OPTIONS)
    settings: dict[str, dict[str, Any]] = {}
    tensors: dict[str, Any] = {}
    own = layout_of(model).tied_names
    for key, value in (optim_sd or {}).items():
        if key.startswith(_GROUPS):
            fqn, _, setting = key[len(_GROUPS):].rpartition(".")
            settings.setdefault(own.get(fqn, fqn), {})[setting] = value
        else:
            tensors[_renamed(key, own)] = value
    names = _wrapped_names(module)
    if names:
        back = {one: name for name, one in names.items()}
        model_sd = {back.get(k, k): v for k, v in model_sd.items()}
        tensors = {_renamed(k, back): v for k, v in tensors.items()}
        settings = {back.get(k, k): v for k, v in settings.items()}
    model_sd, model_live = _whole(model_sd)
    tensors, optim_live = _whole(tensors)
    return model_sd, tensors, settings, Strided(model_live, optim_live, names)


def _wrapped_names(module: nn.Module) -> dict[str, str]:
    """{the user's name: the live name} of each parameter and buffer whose live name holds
    FSDPv2's wrapper part (PyTorch/XLA), which ``get_state_dict`` keeps; empty elsewhere."""
    if not any(type(m).__name__ == "SpmdFullyShardedDataParallel" for m in module.modules()):
        return {}
    from .xla import user_name

    return {user_name(k): k for k in module.state_dict(keep_vars=True) if user_name(k) != k}


def _renamed(key: str, names: dict[str, str]) -> str:
    """A flattened optimizer state key (``state.<parameter name>.<state name>``) with its
    parameter renamed by ``names``."""
    if not names or not key.startswith("state."):
        return key
    fqn, _, item = key[len("state."):].rpartition(".")
    return f"state.{names.get(fqn, fqn)}.{item}"


@dataclass
class Strided:
    """The tensors :func:`collect` handed to DCP whole (see the module docstring), by key:
    the live ones they stand for, for :func:`apply` to cut a load back into."""

    model: dict[str, Any] = field(default_factory=dict)
    optim: dict[str, Any] = field(default_factory=dict)
    # {the user's name: the live one} where a wrapper torch's helpers do not strip (FSDPv2 on
    # PyTorch/XLA) is in the live name: the checkpoint holds the user's, the model the live one.
    names: dict[str, str] = field(default_factory=dict)


def _whole(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``state`` with every tensor split by a strided placement replaced by its whole value
    on this rank, {key: the tensor replaced})."""
    out, live = {}, {}
    for key, value in state.items():
        if any(is_strided(p) for p in getattr(value, "placements", ())):
            live[key] = value
            # Two all-gathers (one per mesh axis), which torch logs on every rank as
            # "suboptimal ... may give inconsistent results between ranks due to different
            # reduction orders": a gather reduces nothing, and a save is not the step.
            with quiet_logger("torch.distributed.tensor._redistribute"):
                value = value.full_tensor()
        out[key] = value
    return out, live


def _cut(state: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each whole tensor :func:`_whole` made (now holding what DCP read) cut
    back to this rank's rows, laid out as the tensor it stood for."""
    out = dict(state)
    for key, was in live.items():
        if key in out:
            out[key] = distribute_tensor(out[key].to(was.device), was.device_mesh,
                                         was.placements, src_data_rank=None)
    return out


def apply(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict[str, Any],
          optim_tensors: dict[str, Any], settings: dict[str, dict[str, Any]],
          wanted: dict[str, dict[str, Any]], strided: Strided | None = None) -> None:
    """Set the loaded state: ``model_sd``/``optim_tensors`` (already filled in place by DCP;
    the ``strided`` ones whole) and the optimizer ``settings`` per parameter name, for the
    names and keys in ``wanted``."""
    module = state_module(model)
    optim = stateful_optimizer(optimizer) if optimizer is not None else None
    if strided is not None:
        model_sd = _cut(model_sd, strided.model)
        optim_tensors = _cut(optim_tensors, strided.optim)
    stage = {one: name for name, one in layout_of(model).tied_names.items()}
    live = strided.names if strided is not None else {}
    model_sd = {live.get(k, k): v for k, v in model_sd.items()}
    optim_sd: dict[str, Any] = {_renamed(_renamed(k, stage), live): v
                                for k, v in optim_tensors.items()}
    for fqn, current in wanted.items():
        saved = settings.get(fqn, {})
        name = stage.get(fqn, fqn)
        for key, value in current.items():
            optim_sd[f"{_GROUPS}{live.get(name, name)}.{key}"] = saved.get(key, value)
    with _without_empty_groups(optim):
        set_state_dict(module, [optim] if optim is not None else [],
                       model_state_dict=model_sd, optim_state_dict=optim_sd, options=_OPTIONS)
    if optimizer is not None and optim is not None and optim is not optimizer:
        # ZeRO-1: the wrapper's groups follow the local optimizer's
        for src, dst in zip(optim.param_groups, optimizer.param_groups, strict=True):
            dst.update({k: v for k, v in src.items() if k != "params"})


# ------------------------------------------------------------------------------ RNG
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's random states: torch (CPU and the accelerator), Python, NumPy."""
    from .store import to_plain

    state: dict[str, Any] = {"torch": _b64(torch.get_rng_state()),
                             "python": to_plain(random.getstate(), "random state")}
    if device.type == "xla":  # torch_xla's generator: one integer, not a device module's
        from .xla import rng_state as xla_rng_state

        state["xla"] = xla_rng_state()
    elif device.type not in ("cpu", "meta"):
        module = torch.get_device_module(device)
        if hasattr(module, "get_rng_state"):
            state["accelerator"] = _b64(module.get_rng_state(device).cpu())
    try:
        import numpy as np

        state["numpy"] = to_plain(np.random.get_state(), "numpy random state")
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    from .store import from_plain

    torch.set_rng_state(_tensor(state["torch"]))
    random.setstate(from_plain(state["python"]))
    if "xla" in state and device.type == "xla":
        from .xla import set_rng_state as set_xla_rng_state

        set_xla_rng_state(state["xla"])
    if "accelerator" in state and device.type not in ("cpu", "meta", "xla"):
        torch.get_device_module(device).set_rng_state(_tensor(state["accelerator"]), device)
    if "numpy" in state:
        try:
            import numpy as np

            np.random.set_state(from_plain(state["numpy"]))
        except ImportError:
            pass
