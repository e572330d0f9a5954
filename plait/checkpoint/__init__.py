"""Checkpoints: save, resume exactly, load into any other layout or world size, export.

    run = plait.init(checkpoint="ckpt/", every=100, keep=3)   # resumes if ckpt/ holds one
    ...
    run.save()                       # or explicitly, at any step (collective)
    run.load("ckpt/step-00000600")   # into any plan, any world size

Built on ``torch.distributed.checkpoint`` (DCP) and its ``get_state_dict``/``set_state_dict``:
every rank writes only its own shards, names are the user's parameter names whatever the layout
(pipeline stages, DDP/FSDP/TP wrappers and shards are invisible in the file), and DCP reshards
at load. plait adds atomic publishing and keep-last-K (:mod:`.store`), loading without running
code from the file (:mod:`.safe`), checks that name the mismatch before any tensor is read
(:mod:`.api`), and the training state around the tensors: step, Plan, optimizer settings, LR
scheduler, data-loader position and every rank's random states (``plait.json``).

``save``, ``load``, ``load_weights``, ``Loaded`` and ``PendingSave`` are imported on first use
(PEP 562), not with the package: they need torch.distributed and DCP (seconds of CPU), and
``plait export --help`` or a refused ``plait export`` need neither.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError
from .store import check_writable, latest_step, resolve

if TYPE_CHECKING:
    from .api import Loaded, PendingSave, load, load_weights, save

__all__ = ["CheckpointError", "Loaded", "PendingSave", "check_writable", "latest_step", "load",
           "load_weights",
           "resolve", "save"]

_LAZY = {"Loaded", "PendingSave", "load", "load_weights", "save"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(".api", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'plait.checkpoint' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
