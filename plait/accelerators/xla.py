"""TPUs (and the XLA CPU device) through PyTorch/XLA, laid out with SPMD.

Detection reads package metadata only: importing ``torch_xla`` starts the PJRT runtime, which
plait does only once the user picks this accelerator (``--accelerator xla``).

Under SPMD one process per host drives every device of the host, and the compiler (GSPMD)
partitions one program over the whole mesh from sharding annotations. So the process group is
a CPU one (gloo) that carries host-side objects only (the run summary, checkpoint planning);
the training collectives are in the compiled program, not in torch.distributed.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .base import Accelerator, module_present
from .chips import lookup_memory_bytes
from .versions import stack_mismatch

#: PJRT_DEVICE values torch_xla accepts for the devices plait lays out
PJRT_DEVICES = ("TPU", "CPU", "CUDA")


class XLAAccelerator(Accelerator):
    name = "xla"
    device_type = "xla"
    backend = "gloo"
    spmd = True

    @staticmethod
    def is_available() -> bool:
        return module_present("torch_xla") and stack_mismatch("torch_xla") is None

    def unavailable_reason(self) -> str | None:
        if not module_present("torch_xla"):
            return ("torch_xla is not installed; install PyTorch/XLA with the torch it was "
                    "built for: pip install torch==2.9.0 'torch-xla[tpu]==2.9.0'")
        mismatch = stack_mismatch("torch_xla")
        if mismatch:
            return mismatch
        device = os.environ.get("PJRT_DEVICE")
        if device is not None and device.upper() not in PJRT_DEVICES:
            return (f"PJRT_DEVICE={device!r} is not one of {', '.join(PJRT_DEVICES)}; set "
                    f"PJRT_DEVICE=TPU on a TPU VM (CPU to try the XLA CPU device)")
        return None

    def device_count(self) -> int:
        """Devices this process drives (all of its host's under SPMD)."""
        if not self.is_available():
            return 0
        import torch_xla.runtime as xr

        return xr.addressable_runtime_device_count()

    def global_device_count(self) -> int:
        """Devices of the whole slice: the size of the SPMD mesh."""
        import torch_xla.runtime as xr

        return xr.global_runtime_device_count()

    def device(self, local_rank: int = 0) -> torch.device:
        import torch_xla

        return torch_xla.device()

    def synchronize(self, device: torch.device | None = None) -> None:
        """Cut the lazy graph here and wait for the device: the step boundary."""
        import torch_xla
        import torch_xla.core.xla_model as xm

        torch_xla.sync()
        xm.wait_device_ops()

    def peak_memory_bytes(self) -> int | None:
        info = self._memory_info()
        peak = info.get("peak_bytes_used") if info else None
        return int(peak) if peak else None

    def memory_bytes(self) -> int | None:
        info = self._memory_info()
        if info and info.get("bytes_limit"):
            return int(info["bytes_limit"])
        return lookup_memory_bytes(self.device_name())

    def _memory_info(self) -> dict[str, Any] | None:
        """torch_xla's allocator figures for the default device; None where the runtime has
        none (the XLA CPU device reports no peak)."""
        try:
            import torch_xla.core.xla_model as xm

            return dict(xm.get_memory_info())
        except (RuntimeError, ValueError, TypeError, AttributeError):
            return None

    def device_name(self) -> str:
        """The device kind ("TPU v5 lite", "TPU v6 lite", "CPU"): what the chip table matches."""
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        try:
            return str(xm.xla_device_kind() or xr.device_type() or "xla")
        except (RuntimeError, AttributeError):
            return str(xr.device_type() or "xla")
