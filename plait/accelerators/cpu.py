"""CPU: always present; gloo is the backend (the embedded default: everything runs on a laptop)."""

from __future__ import annotations

import os
import platform

import torch

from .base import Accelerator


class CPUAccelerator(Accelerator):
    name = "cpu"
    device_type = "cpu"
    backend = "gloo"

    @staticmethod
    def is_available() -> bool:
        return True

    def device_count(self) -> int:
        # One "device" per process: CPU workers share the host, threads are the parallelism.
        return 1

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def device_name(self) -> str:
        return platform.processor() or platform.machine() or "cpu"

    def memory_bytes(self) -> int | None:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None

    def peak_flops(self, dtype: torch.dtype = torch.bfloat16) -> float | None:
        # CPUs vary too much for a table: the planner measures them (plait plan --calibrate).
        return None
