"""Intel Gaudi (HPU) through the habana_frameworks plug-in; backend hccl."""

from __future__ import annotations

from typing import Any

import torch

from .base import Accelerator, module_present


def _hpu() -> Any:
    """``torch.hpu``: the habana_frameworks plug-in attaches it at import, so torch's own type
    hints do not declare it."""
    return torch.hpu  # type: ignore[attr-defined]  # added at run time by habana_frameworks


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
        return _hpu().device_count() if self.is_available() else 0

    def set_device(self, device: torch.device) -> None:
        _hpu().set_device(device)

    def synchronize(self, device: torch.device | None = None) -> None:
        _hpu().synchronize()

    def device_name(self) -> str:
        return _hpu().get_device_name()
