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

    def device_name(self) -> str:
        return torch.cuda.get_device_name(0)

    def memory_bytes(self) -> int | None:
        return torch.cuda.get_device_properties(0).total_memory

    @property
    def is_rocm(self) -> bool:
        return torch.version.hip is not None
