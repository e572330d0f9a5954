"""The device ABC: what plait needs to know about one kind of accelerator.

Deliberately small (in the spirit of Lightning Fabric's accelerator): detection must not import
optional packages that are absent, and nothing here touches a process group.
"""

from __future__ import annotations

import abc
import importlib.util

import torch


class Accelerator(abc.ABC):
    """One kind of device: its torch device type, process-group backend and capabilities."""

    #: name used on the command line and in reports ("cpu", "cuda", "mps", "xla", "hpu")
    name: str = ""
    #: torch device type for tensors ("cpu", "cuda", "mps", "xla", "hpu")
    device_type: str = ""
    #: default torch.distributed backend for this kind
    backend: str = ""
    #: True where one process drives every device of its host and the compiler partitions one
    #: program over the mesh (PyTorch/XLA SPMD); False for one process per device
    spmd: bool = False

    @staticmethod
    @abc.abstractmethod
    def is_available() -> bool:
        """True when this kind of device can be used in this process."""

    def unavailable_reason(self) -> str | None:
        """Why this kind cannot be used here, with the fix, in one line; None when it can."""
        if self.is_available():
            return None
        return f"no {self.name} device is visible to this process"

    @abc.abstractmethod
    def device_count(self) -> int:
        """Devices of this kind visible to this process."""

    def device(self, local_rank: int = 0) -> torch.device:
        """The device a worker with ``local_rank`` should use."""
        return torch.device(self.device_type, local_rank % max(1, self.device_count()))

    def set_device(self, device: torch.device) -> None:  # noqa: B027 - a no-op by default
        """Make ``device`` current for this process (no-op where there is no notion of it)."""

    def synchronize(self, device: torch.device | None = None) -> None:  # noqa: B027 - a no-op by default
        """Wait until the work queued on ``device`` has run (step timing); a no-op where ops
        run synchronously, as on the CPU."""

    def peak_memory_bytes(self) -> int | None:
        """The device allocator's high-water mark in this process, or None where there is no
        device allocator (the CPU: the host RSS covers it) or it was never used."""
        return None

    def process_group_kwargs(self, device: torch.device) -> dict:
        """Extra keyword arguments for ``torch.distributed.init_process_group`` on ``device``."""
        return {}

    def device_name(self) -> str:
        return self.name

    def memory_bytes(self) -> int | None:
        """Total memory of one device, or None when unknown."""
        return None

    def peak_flops(self, dtype: torch.dtype = torch.bfloat16) -> float | None:
        """Peak dense FLOP/s of one device for ``dtype`` from the chip table, or None."""
        from .chips import lookup_peak_flops

        return lookup_peak_flops(self.device_name(), dtype)

    def describe(self) -> dict:
        """Everything `plait env` prints about this kind."""
        count = self.device_count() if self.is_available() else 0
        return {
            "name": self.name,
            "available": self.is_available(),
            "device_type": self.device_type,
            "backend": self.backend,
            "count": count,
            "device_name": self.device_name() if count else None,
            "memory_bytes": self.memory_bytes() if count else None,
            "peak_bf16_flops": self.peak_flops(torch.bfloat16) if count else None,
        }


def module_present(name: str) -> bool:
    """Whether ``name`` is importable, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
