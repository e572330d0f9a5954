"""Apple GPUs through Metal (MPS). Single device; gloo carries any collectives."""

from __future__ import annotations

import torch

from .base import Accelerator


class MPSAccelerator(Accelerator):
    name = "mps"
    device_type = "mps"
    backend = "gloo"

    @staticmethod
    def is_available() -> bool:
        mps = getattr(torch.backends, "mps", None)
        return bool(mps and mps.is_available())

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("mps")

    def synchronize(self, device: torch.device | None = None) -> None:
        torch.mps.synchronize()

    def device_name(self) -> str:
        return "apple-mps"
