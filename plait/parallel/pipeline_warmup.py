"""Pipeline parallelism with ``compile``: every stage compiles its blocks at once, before the
first step's schedule.

Why: torch's stages learn their input shapes through the sends (the first stage runs its
forward on microbatch 0 and sends the output's shapes on, the last stage runs the backward and
sends the gradients' shapes back), so at the first step a later stage's blocks meet
``torch.compile`` only once every earlier stage has compiled its forward, and an earlier
stage's backward only once every later stage has compiled its own: the stages' compile times
add up, a pipeline of ``pp`` stages pays about ``pp`` compiles of the forward and of the
backward one after another where data parallelism pays one of each.

Each rank already knows its stages' input shapes before anything is sent: the forward of a
meta-device copy of the model, stage after stage, on the first microbatch's inputs. So each rank
runs its own stages once on inputs of those shapes and dtypes (the first stage on its real
first microbatch, a later stage on random hidden states), forward and, when training, backward,
under the autocast the schedule runs in: torch.compile builds the graphs the real microbatches
then use (the same shapes, dtypes, grad mode and autocast state: no recompile), on every rank
at the same time. Nothing of the model's state moves: the backward asks for the gradients
(``torch.autograd.grad``) instead of accumulating them in ``.grad``, the buffers the forward
writes (BatchNorm's running statistics) are put back, and the RNG (dropout) is restored.

Only for stages whose forward holds no collective: no data parallel wrapper (DDP's forward
broadcasts buffers and marks the graph it is compiled in, FSDP gathers parameters), no tensor
or context parallelism. There the warm-up would add collectives of its own; those layouts keep
torch's order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .layout import layout_of
from .pipeline_chain import meta_replica, on_meta
from .pipeline_split import StageSpec, build_stage_module

# What a stage's layout may hold for the warm-up to add no collective to its forward.
_LOCAL_STEPS = frozenset({"activation_checkpointing", "compile"})


@dataclass(frozen=True)
class InputMeta:
    """A stage input's shape, dtype and whether the schedule hands it over needing a grad."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def warms_locally(stage_modules: list[nn.Module]) -> bool:
    """Whether every one of this rank's laid-out stage modules is compiled and runs its
    forward without a collective (see the module's docstring)."""
    applied = [set(layout_of(m).applied) for m in stage_modules]
    return all("compile" in a and a <= _LOCAL_STEPS for a in applied)


def _narrow(value: Any, rows: int) -> Any:
    """The first ``rows`` rows (dim 0) of every tensor in ``value``, as views: the strides
    torch's schedule gives a microbatch (it splits with ``tensor_split``)."""
    if isinstance(value, torch.Tensor):
        return value.narrow(0, 0, rows)
    if isinstance(value, dict):
        return {k: _narrow(v, rows) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_narrow(v, rows) for v in value)
    return value


def _as_tuple(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def stage_input_finder(model: nn.Module, path: str, specs: list[StageSpec]
                       ) -> Callable[[torch.Tensor, dict[str, Any], bool],
                                     list[tuple[InputMeta, ...]] | None] | None:
    """A function of the first microbatch's inputs (the chained one, the keywords every stage
    gets) and the grad mode, giving each stage's chained inputs as the schedule will hand them
    over: the stage modules of a meta-device copy of ``model`` run one after the other (None
    from it when a stage does not run on the meta device: data-dependent code). None when the
    model cannot be copied. Copied now, before the layout compiles the blocks (a
    compiled forward is bound to the real block, which does not run on meta tensors)."""
    replica = meta_replica(model)
    if replica is None:
        return None
    stages = [build_stage_module(replica, path, s) for s in specs[:-1]]

    def find(first: torch.Tensor, kwargs: dict[str, Any], train: bool
             ) -> list[tuple[InputMeta, ...]] | None:
        x: tuple[Any, ...] = (on_meta(first),)
        metas = [tuple(InputMeta(tuple(t.shape), t.dtype, False) for t in x)]
        kw = {k: on_meta(v) for k, v in kwargs.items()}
        with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(train):
            for stage in stages:
                try:
                    x = _as_tuple(stage(*x, **kw))
                except Exception:  # noqa: BLE001 - not runnable on meta: torch's order then
                    return None
                if not all(isinstance(t, torch.Tensor) for t in x):
                    return None
                metas.append(tuple(
                    InputMeta(tuple(t.shape), t.dtype,
                              train and t.requires_grad and t.is_floating_point())
                    for t in x))
        return metas

    return find


def _fork_rng(device: torch.device) -> Any:
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)


def _hidden(metas: tuple[InputMeta, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Hidden states of the given shapes, dtypes and grad requirement (values random: the
    graphs do not depend on them)."""
    out = []
    for m in metas:
        if m.dtype.is_floating_point:
            t = torch.randn(m.shape, dtype=m.dtype, device=device)
        else:
            t = torch.zeros(m.shape, dtype=m.dtype, device=device)
        out.append(t.requires_grad_(m.requires_grad))
    return tuple(out)


def _run_once(stage: nn.Module, args: tuple[torch.Tensor, ...], kwargs: dict[str, Any],
              train: bool) -> None:
    outputs = [t for t in _as_tuple(stage(*args, **kwargs))
               if isinstance(t, torch.Tensor) and t.requires_grad]
    if not train or not outputs:
        return
    wrt: list[torch.Tensor] = [p for p in stage.parameters() if p.requires_grad]
    wrt += [a for a in args if a.requires_grad]
    if wrt:  # the gradients handed back, none accumulated in .grad
        torch.autograd.grad(outputs, wrt, grad_outputs=[torch.ones_like(t) for t in outputs],
                            allow_unused=True)


def warm_stages(stages: list[tuple[int, nn.Module]], metas: list[tuple[InputMeta, ...]],
                first: torch.Tensor, kwargs: dict[str, Any], *, train: bool,
                device: torch.device, buffers_kept: Callable[[nn.Module], Any]) -> None:
    """Run each (stage index, module) of this rank once, forward and, when ``train``,
    backward: the first stage on ``first``, a later one on hidden states shaped as ``metas``
    says, each with ``kwargs``, in the caller's autocast. Parameters, their ``.grad``, the
    buffers and the RNG are left as they were; what stays is torch.compile's graphs.
    ``buffers_kept``: the context that puts back the buffers a forward wrote (the one
    torch's shape inference runs in)."""
    with _fork_rng(device), torch.set_grad_enabled(train):
        for index, stage in stages:
            args = (first,) if index == 0 else _hidden(metas[index], device)
            with buffers_kept(stage):
                _run_once(stage, args, kwargs, train)


def first_microbatch(first: torch.Tensor, kwargs: dict[str, Any], rows: int
                     ) -> tuple[torch.Tensor, dict[str, Any]]:
    """The first microbatch (``rows`` rows) of the chained input and of the keywords."""
    return _narrow(first, rows), _narrow(kwargs, rows)


__all__ = ["InputMeta", "first_microbatch", "stage_input_finder", "warm_stages", "warms_locally"]
