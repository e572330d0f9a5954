"""CUDA devices: NVIDIA GPUs, and AMD GPUs through ROCm (torch exposes both as "cuda")."""

from __future__ import annotations

import torch

from .base import Accelerator


class CUDAAccelerator(Accelerator):
    name = "cuda"
    device_type = "cuda"
    backend = "nccl"  # RCCL answers to "nccl" on ROCm builds

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.is_available() else 0

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def synchronize(self, device: torch.device | None = None) -> None:
        torch.cuda.synchronize(device)

    def peak_memory_bytes(self) -> int | None:
        if not (self.is_available() and torch.cuda.is_initialized()):
            return None
        return int(torch.cuda.max_memory_allocated())

    def process_group_kwargs(self, device: torch.device) -> dict:
        # Binding the group to the device lets NCCL connect eagerly and avoids its guess of
        # the device from the rank (a warning, and a hang when the guess is wrong).
        return {"device_id": device}

    def device_name(self) -> str:
        return torch.cuda.get_device_name(0)

    def memory_bytes(self) -> int | None:
        return torch.cuda.get_device_properties(0).total_memory

    @property
    def is_rocm(self) -> bool:
        return torch.version.hip is not None
