"""The automatic planner: pure Python, no process group (torch only to look at a model on meta).

    from plait.planner import auto_plan, plan_model
    plan = auto_plan("llama-8b", world_size=64, cluster="dgx-h100", global_batch=512, seq=4096)

``plan_model`` returns the ranked estimates; ``auto_plan`` the best ``Plan`` (what the runtime's
``plan="auto"`` uses). See docs/planner.md for the cost model and its accuracy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from plait.plan import Plan

from .cost import DEFAULT_CONSTANTS, Constants, Estimate, Workload, evaluate
from .cpu.overheads import CPU_PROFILE, HostOverheads
from .hardware import Cluster, load_cluster, presets
from .model_stats import ModelStats, NoBlockStackError, load_model
from .search import SearchResult, search

if TYPE_CHECKING:
    from plait.parallel.tp_example import Example

__all__ = ["auto_plan", "plan_model", "evaluate_plan", "constants_for", "CALIBRATED_KEYS",
           "Cluster", "Constants",
           "Estimate", "ModelStats", "SearchResult", "Workload", "load_cluster", "load_model",
           "presets", "search", "evaluate"]


# Constants a cluster profile may carry under ``extra`` (written by ``plait plan --calibrate``):
# every host-side constant (plait.planner.cpu.overheads, their one home) and the profile's
# overlap and link efficiency.
CALIBRATED_KEYS = tuple([(name, type(value)) for name, value in CPU_PROFILE.items()] + [
    (f.name, float) for f in dataclasses.fields(HostOverheads)])


def constants_for(cluster: Cluster, base: Constants = DEFAULT_CONSTANTS) -> Constants:
    """The cost constants for ``cluster``: a calibrated profile carries its own efficiency."""
    extra = dict(cluster.extra or {})
    # Each value has its field's type (float or bool, as CALIBRATED_KEYS says): Any, because
    # mypy checks a `**dict` passed to dataclasses.replace against every field at once.
    changes: dict[str, Any] = {}
    eff = extra.get("compute_efficiency")
    if eff is not None:
        if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not 0 < float(eff) <= 1:
            raise ValueError(f"cluster {cluster.name!r}: extra.compute_efficiency={eff!r} must be "
                             f"in (0, 1]")
        changes["compute_efficiency"] = float(eff)
    for key, kind in CALIBRATED_KEYS:
        if key in extra:
            raw = extra[key]
            if not isinstance(raw, (int, float)) or (kind is float and isinstance(raw, bool)):
                raise ValueError(f"cluster {cluster.name!r}: extra.{key}={raw!r} must be a "
                                 f"{'number' if kind is float else 'boolean'}")
            value = kind(raw)
            # per-call costs may be negative (overlapping calls); collective_time floors the
            # whole call at 0
            if kind is float and value < 0 and not key.endswith("_call_s"):
                raise ValueError(f"cluster {cluster.name!r}: extra.{key}={value} must be >= 0")
            changes[key] = value
    return dataclasses.replace(base, **changes) if changes else base


def _example(model: Any, example: Any) -> Example | None:
    """``example`` (one batch as ``run.step`` takes it) as the forward's arguments; only an
    ``nn.Module`` runs on it (a factory is measured on its dataset, a preset or config is not
    run)."""
    if example is None:
        return None
    import torch.nn as nn

    from plait.parallel.tp_example import from_batch
    if not isinstance(model, nn.Module):
        raise ValueError(f"example= is for a model given as an nn.Module, not "
                         f"{type(model).__name__}: a factory is measured on its own dataset's "
                         f"first sample; leave example out")
    return from_batch(model, example)


def _workload(stats: ModelStats, global_batch: int, seq: int | None,
              stack_seqs: Mapping[str, int] | None = None) -> Workload:
    """What is priced: ``seq``, else the sequence the user's input (or a factory's dataset)
    hands a model of several stacks, each further stack at its own length (an
    encoder-decoder's source beside its target), else the model's maximum; ``seq`` given
    prices every stack at it but those ``stack_seqs`` names (by first block)."""
    firsts = [m.first for m in stats.more_stacks]
    for first in stack_seqs or {}:
        if first not in firsts:
            where = (f"its further stacks start at {', '.join(firsts)}" if firsts else
                     "it has one stack of blocks, whose sequence is seq")
            raise ValueError(f"stack_seqs={dict(stack_seqs or {})!r}: {first} is not the first "
                             f"block of a further stack of {stats.name} ({where})")
    read = dict(stats.data_stack_seqs) if seq is None else {}
    stacks = {**read, **(stack_seqs or {})}
    seq = seq or (stats.data_seq if read else None) or stats.max_seq
    if seq is None:
        raise ValueError("seq is required (the model does not say its sequence length)")
    return Workload(global_batch, seq, stack_seqs=tuple(stacks.items()))


def _resolve(model: Any, cluster: Any, world_size: int | None, example: Example | None = None
             ) -> tuple[ModelStats, Cluster]:
    stats = load_model(model, example=example)
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    c = load_cluster(cluster, devices=world_size) if world_size else load_cluster(cluster)
    return stats, c


def plan_model(model: Any, cluster: Any = "cpu", *, world_size: int | None = None,
               global_batch: int, seq: int | None = None, dtype: str | None = None,
               top: int = 10, constants: Constants | None = None,
               layout_check: Callable[[Plan], str | None] | None = None,
               example: Any = None,
               stack_seqs: Mapping[str, int] | None = None) -> SearchResult:
    """Search layouts for ``model`` on ``cluster`` (resized to ``world_size`` devices);
    ``layout_check`` as in :func:`plait.planner.search.search`. ``example``: for an
    ``nn.Module``, one batch as ``run.step`` takes it (labels are left out), which the model's
    forward is measured on instead of a guessed input: a forward of several inputs
    (``forward(x, t)``) or a dict of features cannot be guessed."""
    ex = _example(model, example)
    try:
        stats, c = _resolve(model, cluster, world_size, ex)
    except NoBlockStackError:
        # a ConvNet, an RNN: its data-parallel layouts, from measured facts
        return _whole_model(model, cluster, world_size, global_batch, dtype, top, constants, ex)
    work = _workload(stats, global_batch, seq, stack_seqs)
    dtype = dtype or ("fp32" if c.device == "cpu" else "bf16")
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"dtype={dtype!r} must be 'fp32', 'bf16' or 'fp16'")
    from .uncertainty import with_uncertainty

    k = constants or constants_for(c)
    result = search(stats, c, work, dtype=dtype, top=top, constants=k,
                    layout_check=layout_check)
    for e in result.ranked[:top or None]:
        with_uncertainty(e, stats, c, work, k)
    return result


def _whole_model(model: Any, cluster: Any, world_size: int | None, global_batch: int,
                 dtype: str | None, top: int, constants: Constants | None,
                 example: Example | None = None) -> SearchResult:
    """``plan_model`` for a model without a stack of repeated matmul blocks
    (:mod:`plait.planner.whole_model`): a factory measured on its dataset's first sample, a
    module on a guessed input."""
    from .whole_model import from_factory, from_module, rank

    whole = from_factory(model)[0] if isinstance(model, str) else from_module(model, example)
    c = load_cluster(cluster, devices=world_size) if world_size else load_cluster(cluster)
    return rank(whole, c, global_batch, dtype=dtype or ("fp32" if c.device == "cpu" else "bf16"),
                c=constants or constants_for(c), top=top)


def auto_plan(model: Any, world_size: int, cluster: Any = "cpu", *, global_batch: int,
              seq: int | None = None, dtype: str | None = None,
              constants: Constants | None = None, example: Any = None,
              stack_seqs: Mapping[str, int] | None = None) -> Plan:
    """The best Plan for ``model`` on ``world_size`` devices of ``cluster`` (a preset name, YAML
    path or Cluster); ``example`` and ``stack_seqs`` as in :func:`plan_model`. Raises
    ValueError saying why when no layout fits."""
    result = plan_model(model, cluster, world_size=world_size, global_batch=global_batch,
                        seq=seq, dtype=dtype, top=1, constants=constants, example=example,
                        stack_seqs=stack_seqs)
    if result.best is None:
        from .cli import explain_nothing_fits
        if not _has_blocks(model, _example(model, example)):
            from .whole_model import nothing_fits
            raise ValueError(nothing_fits(result))
        raise ValueError(explain_nothing_fits(result, load_model(
            model, example=_example(model, example)),
                                              load_cluster(cluster, devices=world_size)))
    return result.best.plan.validate(world_size)


def _has_blocks(model: Any, example: Example | None = None) -> bool:
    """Whether the planner prices ``model`` by its blocks (not :mod:`.whole_model`)."""
    try:
        load_model(model, example=example)
    except NoBlockStackError:
        return False
    return True


def evaluate_plan(plan: Plan | str, model: Any, cluster: Any = "cpu", *,
                  world_size: int | None = None, global_batch: int, seq: int | None = None,
                  constants: Constants | None = None, balance: bool = False,
                  example: Any = None, stack_seqs: Mapping[str, int] | None = None
                  ) -> Estimate:
    """Predict one given layout (the ``--plan`` path); ``example`` and ``stack_seqs`` as in
    :func:`plan_model`."""
    plan = Plan.load(plan)
    stats, c = _resolve(model, cluster, world_size or plan.world_size, _example(model, example))
    work = _workload(stats, global_batch, seq, stack_seqs)
    from .uncertainty import with_uncertainty

    k = constants or constants_for(c)
    return with_uncertainty(evaluate(plan, stats, c, work, k, balance=balance), stats, c, work, k)
