"""TPUs through TorchTPU (``torch_tpu``): a native ``tpu`` device for torch.

TorchTPU registers itself as a torch device backend (the ``torch.backends`` entry point
``torch_tpu``), so ``import torch`` loads it wherever it is installed and ``torch.tpu`` exists.
It asks callers to use the device-generic ``torch.accelerator`` API rather than ``torch.tpu``,
which is what this class does. Its process-group backend is ``tpu_dist`` (also registered as
``tpu``); DeviceMesh, DTensor and FSDP2 run on it as on any other device type, so plait's
DTensor/FSDP2 layouts apply unchanged on the ``tpu`` device type.

Launching needs one step before the workers start: every rank must agree on the slice
builder addresses and the topology, which TorchTPU's ``set_tpu_launch_env`` decides in the
launching process (see ``prepare_launch``).
"""

from __future__ import annotations

import torch

from .base import Accelerator, module_present
from .chips import lookup_memory_bytes
from .versions import installed_version, stack_mismatch, torch_requirement


def _current_accelerator_type() -> str | None:
    accel = getattr(torch, "accelerator", None)
    if accel is None or not accel.is_available():
        return None
    current = accel.current_accelerator()
    return current.type if current is not None else None


class TPUAccelerator(Accelerator):
    name = "tpu"
    device_type = "tpu"
    backend = "tpu_dist"

    @staticmethod
    def is_available() -> bool:
        if not module_present("torch_tpu") or stack_mismatch("torch_tpu") is not None:
            return False
        return _current_accelerator_type() == "tpu"

    def unavailable_reason(self) -> str | None:
        if self.is_available():
            return None
        if not module_present("torch_tpu"):
            if module_present("torch_xla"):
                return ("torch_tpu (TorchTPU) is not installed, PyTorch/XLA is: use "
                        "--accelerator xla, or pip install torch-tpu for the native device")
            return ("torch_tpu (TorchTPU) is not installed; on a TPU VM: pip install "
                    "torch-tpu (it needs torch" + (torch_requirement("torch-tpu") or
                                                    ">=2.11,<=2.15") + ")")
        mismatch = stack_mismatch("torch_tpu")
        if mismatch:
            return mismatch
        found = _current_accelerator_type()
        return (f"torch_tpu {installed_version('torch-tpu')} is installed but torch.accelerator "
                f"finds {'a ' + found + ' device' if found else 'no device'}, not a TPU; run on "
                f"a TPU VM (if this is one, `plait doctor` checks libtpu and the process "
                f"holding the TPU)")

    def device_count(self) -> int:
        return torch.accelerator.device_count() if self.is_available() else 0

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("tpu", local_rank % max(1, self.device_count()))

    def set_device(self, device: torch.device) -> None:
        torch.accelerator.set_device_index(device)

    def synchronize(self, device: torch.device | None = None) -> None:
        torch.accelerator.synchronize(device)

    def peak_memory_bytes(self) -> int | None:
        memory = getattr(torch.accelerator, "max_memory_allocated", None)
        if memory is None or not self.is_available():
            return None
        try:
            return int(memory())
        except (RuntimeError, NotImplementedError):  # a backend without allocator statistics
            return None

    def process_group_kwargs(self, device: torch.device) -> dict:
        return {"device_id": device}

    def device_name(self) -> str:
        module = torch.get_device_module("tpu")
        return str(module.get_device_name())

    def memory_bytes(self) -> int | None:
        return lookup_memory_bytes(self.device_name())

    @staticmethod
    def prepare_launch(nnodes: int, nproc_per_node: int) -> None:
        """Decide the slice builder addresses and topology every rank must share, in the
        launching process, before the workers start (TorchTPU's own bootstrap; it sets only
        variables that are unset)."""
        from torch.tpu import distributed

        distributed.set_tpu_launch_env(nnodes=nnodes, nproc_per_node=nproc_per_node)
