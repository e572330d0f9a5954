"""Intel Gaudi (HPU) through the habana_frameworks plug-in; backend hccl."""

from __future__ import annotations

import torch

from .base import Accelerator, module_present


class HPUAccelerator(Accelerator):
    name = "hpu"
    device_type = "hpu"
    backend = "hccl"

    @staticmethod
    def is_available() -> bool:
        if not module_present("habana_frameworks"):
            return False
        hpu = getattr(torch, "hpu", None)
        return bool(hpu and hpu.is_available())

    def device_count(self) -> int:
        return torch.hpu.device_count() if self.is_available() else 0

    def set_device(self, device: torch.device) -> None:
        torch.hpu.set_device(device)

    def synchronize(self, device: torch.device | None = None) -> None:
        torch.hpu.synchronize()

    def device_name(self) -> str:
        return torch.hpu.get_device_name()
