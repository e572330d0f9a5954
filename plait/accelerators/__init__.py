"""Accelerators: one small class per device kind, and detection that picks the best present.

Order of preference when none is named: cuda, tpu (TorchTPU), hpu, mps, cpu. XLA is chosen only
by name (`--accelerator xla`): importing torch_xla starts a runtime, which plait never does
uninvited.
"""

from __future__ import annotations

import torch

from .base import Accelerator
from .cpu import CPUAccelerator
from .cuda import CUDAAccelerator
from .hpu import HPUAccelerator
from .mps import MPSAccelerator
from .tpu import TPUAccelerator
from .xla import XLAAccelerator

ACCELERATORS: dict[str, type[Accelerator]] = {
    "cuda": CUDAAccelerator,
    "tpu": TPUAccelerator,
    "xla": XLAAccelerator,
    "hpu": HPUAccelerator,
    "mps": MPSAccelerator,
    "cpu": CPUAccelerator,
}


def get_accelerator(name: str | None = None) -> Accelerator:
    """The accelerator called ``name``, or the best one present when ``name`` is None/"auto"."""
    if name in (None, "auto"):
        for key in ("cuda", "tpu", "hpu", "mps"):
            if ACCELERATORS[key].is_available():
                return ACCELERATORS[key]()
        return CPUAccelerator()
    if name not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; choose one of {', '.join(ACCELERATORS)}")
    acc = ACCELERATORS[name]()
    reason = acc.unavailable_reason()
    if reason is not None:
        raise ValueError(f"accelerator {name!r} is not available: {reason}; `plait doctor` "
                         f"checks this machine")
    return acc


def accelerator_for(device: torch.device) -> Accelerator:
    """The accelerator whose tensors live on ``device`` (its device type); CPU if none claims it."""
    for cls in ACCELERATORS.values():
        if cls.device_type == device.type:
            return cls()
    return CPUAccelerator()


def all_accelerators() -> list[Accelerator]:
    return [cls() for cls in ACCELERATORS.values()]


__all__ = ["Accelerator", "ACCELERATORS", "accelerator_for", "all_accelerators", "get_accelerator",
           "CPUAccelerator", "CUDAAccelerator", "HPUAccelerator", "MPSAccelerator",
           "TPUAccelerator", "XLAAccelerator"]
