"""Which convention a dict batch follows for a given forward: the Hugging Face one (each key is
a keyword argument, ``model(**batch)``) or a forward that takes the whole dict as its one
argument (``model(batch)``, as many vision and multi-modal models do). Pure: no torch import,
so the planner reads it too."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any


def signature_of(forward: Callable[..., Any]) -> inspect.Signature | None:
    """``forward``'s signature, or None where it has none readable (a C builtin)."""
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        return None


def whole_dict_parameter(signature: inspect.Signature | None, keys: Iterable[str]) -> str | None:
    """The name of the parameter that takes a dict batch whole, or None when the forward takes
    the dict's entries by keyword (the Hugging Face convention).

    It takes the dict whole when it names none of the batch's keys, has no ``**kwargs`` to
    take them in, and has a positional parameter with at most that one required: ``forward(
    self, batch)`` with a batch of ``{"features": ..., "labels": ...}``. ``model(**batch)``
    would fail there with ``unexpected keyword argument 'features'``."""
    if signature is None:
        return None
    params = list(signature.parameters.values())
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    names = {p.name for p in params}
    if any(k in names for k in keys):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not positional or len(required) > 1 or (required and required[0] is not positional[0]):
        return None
    return positional[0].name
