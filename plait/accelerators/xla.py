"""TPUs (and the XLA CPU device) through PyTorch/XLA.

Detection only checks that ``torch_xla`` is installed: importing it starts the PJRT runtime,
which we do only when the user actually picks this accelerator.
"""

from __future__ import annotations

import torch

from .base import Accelerator, module_present


class XLAAccelerator(Accelerator):
    name = "xla"
    device_type = "xla"
    backend = "xla"

    @staticmethod
    def is_available() -> bool:
        return module_present("torch_xla")

    def device_count(self) -> int:
        if not self.is_available():
            return 0
        import torch_xla.runtime as xr

        return xr.addressable_runtime_device_count()

    def device(self, local_rank: int = 0) -> torch.device:
        import torch_xla

        return torch_xla.device()

    def device_name(self) -> str:
        import torch_xla.runtime as xr

        return str(xr.device_type() or "xla").lower()
