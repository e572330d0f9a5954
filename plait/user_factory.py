"""The user's ``pkg.module:function`` factory that ``plait check`` and ``plait comm`` train.

The factory returns ``(model, dataset, loss_fn)`` or ``(model, dataset, loss_fn,
collate_fn)``. Both commands import it the same way, build its parts under the run's seed, and
refuse a wrong part, a factory that raises, a dataset smaller than one global batch or a
pipeline the model cannot be cut into with the same one line (the bad value and the fix),
instead of a traceback from every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.nn as nn

    from .plan import Plan


@dataclass(frozen=True)
class FactoryParts:
    """What a factory returned, each part checked: ``collate_fn`` None when it gave three."""

    model: nn.Module
    dataset: Any
    loss_fn: Callable[..., Any] | None
    collate_fn: Callable[[list[Any]], Any] | None


def load_factory(spec: str) -> Callable[[], Any]:
    """Import ``pkg.module:function`` (from the current directory too, as ``python -m`` does)."""
    import importlib
    import os
    import sys

    from .factory_spec import file_path_hint

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model {spec!r}: expected a reference preset or "
                         f"pkg.module:function, e.g. --model mymodels:build"
                         f"{file_path_hint(module_name, attr)}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = file_path_hint(module_name, attr)
        if hint:
            raise ValueError(f"--model {spec!r}: cannot import it{hint}") from None
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r} ({exc}); run from "
                         f"the directory that holds it or put it on PYTHONPATH") from None
    except Exception as exc:  # noqa: BLE001 - the module's own code failed as it was imported
        raise ValueError(f"--model {spec!r}: importing "
                         f"{factory_failure(repr(module_name), exc)}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--model {spec!r}: {module_name} has no function {attr!r}")
    return fn


def factory_failure(spec: str, exc: BaseException) -> str:
    """``"--model 'pkg.mod:fn' raised FileNotFoundError: ... (pkg/mod.py line 12, in fn)"``: what
    the user's factory raised and the line of theirs that raised it (the innermost frame outside
    Python's and installed packages' files; a data path that does not exist fails inside
    ``torch.load`` or ``open``), instead of a traceback through plait's worker processes."""
    import sysconfig

    installed = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                          "platlib"))
    where = ""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # past this frame
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(installed) or not where:
            where = f" ({code.co_filename} line {tb.tb_lineno}, in {code.co_name})"
        tb = tb.tb_next
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{spec} raised {type(exc).__name__}: {message}{where}"


def build_parts(spec: str, seed: int) -> FactoryParts:
    """Call the factory ``spec`` under ``torch.manual_seed(seed)`` and check each part it
    returns where its name is known, rather than failing later inside the step as "'str'
    object is not callable"."""
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    factory = load_factory(spec)
    name = f"--model {spec!r}"
    try:
        out = factory()
    except (ValueError, OSError) as exc:
        # Bad input to the factory (a value it refuses, a data path that does not exist): one
        # line naming what it raised and the line of theirs that raised it. Anything else is a
        # bug in their code, whose traceback (shown once, by the rank) is what they need.
        raise ValueError(factory_failure(name, exc)) from None
    if not isinstance(out, (tuple, list)) or len(out) not in (3, 4):
        raise ValueError(f"{name} must return (model, dataset, loss_fn), got "
                         f"{type(out).__name__}")
    got = ", ".join(type(x).__name__ for x in out)
    model, dataset, loss_fn = out[:3]
    if not isinstance(model, nn.Module):
        raise ValueError(f"{name} must return (model, dataset, loss_fn) in that order, got "
                         f"({got}): the first item must be the nn.Module")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"{name}: loss_fn is {type(loss_fn).__name__} {loss_fn!r:.40}, not a "
                         f"function; return loss_fn(output, targets) -> scalar, or None when "
                         f"the model returns its own loss (output.loss)")
    if len(out) == 4 and not callable(out[3]):
        raise ValueError(f"{name}: the fourth item, the collate_fn, is {type(out[3]).__name__} "
                         f"{out[3]!r:.40}, not a function; return (model, dataset, loss_fn, "
                         f"collate_fn) with collate_fn(list of items) -> batch, or the three")
    return FactoryParts(model, dataset, loss_fn, out[3] if len(out) == 4 else None)


def dataset_refusal(spec: str, dataset: Any, global_batch: int, parts: int = 1) -> str | None:
    """Why ``dataset`` cannot give one global batch of ``global_batch`` items (empty, or
    fewer items), naming the ``--global-batch`` that fits: a multiple of ``parts``, the pieces
    the plan splits each global batch into (data-parallel replicas x micro-batches); None
    when it can or has no ``len()`` (a stream, whose end the loader finds)."""
    if not hasattr(dataset, "__len__"):
        return None
    n = len(dataset)
    if n == 0:
        return f"--model {spec!r}: the dataset is empty"
    if n >= global_batch:
        return None
    fits = n // parts * parts  # the largest global batch the plan splits evenly
    if parts == 1:
        fix = f"use --global-batch {n} or less"
    elif fits:
        fix = (f"use --global-batch {fits} or less, a multiple of {parts} (the plan's "
               f"data-parallel replicas x micro-batches), or more data")
    else:
        fix = (f"the plan splits each global batch into {parts} (data-parallel replicas x "
               f"micro-batches): give at least {parts} items")
    # as plait.data.loader refuses it for a run
    return (f"--model {spec!r}: the dataset has {n} items, fewer than one global batch of "
            f"{global_batch}; {fix}")


def pipeline_refusal(plan: Plan, spec: str) -> str | None:
    """Why the factory's model cannot run ``plan``'s pipeline (no container of blocks, skips
    that cross the blocks as a U-Net's do, a forward that takes the whole dict batch), with
    the cause the planner names for it (:func:`plait.auto.layout_check`'s pipeline part), so
    it is refused before any process starts rather than at the first step of a stage; None
    without a pipeline, when it can, or when the model cannot be built here (the ranks build
    it again and say why)."""
    if plan.pp < 2:
        return None
    from .dict_batch import signature_of, whole_dict_parameter
    from .parallel.pipeline import pp_refusal, whole_dict_refusal
    from .planner.model_stats import build_factory, sample_keys

    try:
        model = build_factory(spec, "cpu")
    except ValueError:
        return None
    # the pipeline's own refusals only: BatchNorm cut into microbatches trains (plait check
    # shows it beside one device, a FAIL that says why), it is not refused
    keys = sample_keys(spec)
    whole = whole_dict_parameter(signature_of(model.forward), keys) if keys is not None else None
    why = (whole_dict_refusal(type(model).__name__, whole, keys) if whole is not None
           else pp_refusal(model, plan))
    return None if why is None else f"--model {spec} cannot run {plan.to_string()}: {why}"


def factory_or_preset(model: str) -> str | None:
    """``--model`` as typed: the factory spec (imported here, so a bad one fails before any
    rank starts) or None for a reference preset; ValueError naming the fix for anything else
    (a file path, a module without its function, a preset misspelt)."""
    from .factory_spec import file_path_hint
    from .models.config import PRESETS

    if ":" in model and model not in PRESETS:
        load_factory(model)
        return model
    hint = file_path_hint(model, "")
    if hint:  # a file path, its factory forgotten too
        raise ValueError(f"--model {model!r}: expected a reference preset or "
                         f"pkg.module:function{hint}")
    if model not in PRESETS and "." in model:  # a module, its factory forgotten
        raise ValueError(f"--model {model!r}: expected a reference preset or "
                         f"pkg.module:function; name your factory after a colon, e.g. "
                         f"--model {model}:factory")
    if model not in PRESETS:  # one line here, not a traceback from every rank
        raise ValueError(f"--model {model!r} is not a reference preset "
                         f"({', '.join(PRESETS)}); for a factory of your own give "
                         f"pkg.module:function, e.g. --model {model}:build")
    return None
