"""Peak dense FLOP/s per chip and dtype (vendor datasheets, dense, no sparsity).

Used by `plait env`, the planner's cluster presets and MFU figures. Keys are matched as
lower-case substrings of the device name torch reports (e.g. "NVIDIA H100 80GB HBM3").
"""

from __future__ import annotations

import torch

T = 1e12

# name fragment -> {dtype name: FLOP/s}; more specific fragments first.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "a100": {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T},
    "h100": {"fp32": 67 * T, "tf32": 495 * T, "bf16": 989 * T, "fp16": 989 * T, "fp8": 1979 * T},
    "h200": {"fp32": 67 * T, "tf32": 495 * T, "bf16": 989 * T, "fp16": 989 * T, "fp8": 1979 * T},
    "b200": {"fp32": 80 * T, "tf32": 1100 * T, "bf16": 2250 * T, "fp16": 2250 * T, "fp8": 4500 * T},
    "mi300x": {"fp32": 163.4 * T, "bf16": 1307 * T, "fp16": 1307 * T, "fp8": 2615 * T},
    # TPUs: the names torch_xla reports as the device kind ("TPU v5 lite" is v5e, "TPU v5" is
    # v5p, "TPU v6 lite" is v6e, "TPU7x" is Ironwood), then the marketing names.
    "tpuv5lite": {"bf16": 197 * T, "fp32": 197 * T / 2, "int8": 394 * T},
    "tpuv6lite": {"bf16": 918 * T, "fp32": 918 * T / 2, "int8": 1836 * T},
    "tpu7x": {"bf16": 2307 * T, "fp8": 4614 * T},
    "tpuv7": {"bf16": 2307 * T, "fp8": 4614 * T},
    "v4": {"bf16": 275 * T, "fp32": 275 * T / 2},
    "v5e": {"bf16": 197 * T, "fp32": 197 * T / 2},
    "v5litepod": {"bf16": 197 * T, "fp32": 197 * T / 2},
    "v5p": {"bf16": 459 * T, "fp32": 459 * T / 2},
    "tpuv5": {"bf16": 459 * T, "fp32": 459 * T / 2},
    "v6e": {"bf16": 918 * T, "fp32": 918 * T / 2},
    "gaudi3": {"bf16": 1835 * T, "fp32": 229 * T},
    "gaudi2": {"bf16": 432 * T, "fp32": 108 * T},
}

GiB = 2**30
# High-bandwidth memory per chip, for devices whose runtime does not report it (TPUs), keyed
# like PEAK_FLOPS.
MEMORY_BYTES: dict[str, int] = {
    "tpuv5lite": 16 * GiB, "tpuv6lite": 32 * GiB, "tpu7x": 192 * GiB, "tpuv7": 192 * GiB,
    "v4": 32 * GiB, "v5e": 16 * GiB, "v5litepod": 16 * GiB, "v5p": 95 * GiB, "tpuv5": 95 * GiB,
    "v6e": 32 * GiB,
}

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def chip_key(device_name: str) -> str | None:
    """The table key that matches ``device_name``, or None."""
    lowered = device_name.lower().replace(" ", "").replace("-", "")
    for key in PEAK_FLOPS:
        if key in lowered:
            return key
    return None


def lookup_peak_flops(device_name: str, dtype: torch.dtype | str = torch.bfloat16) -> float | None:
    key = chip_key(device_name)
    if key is None:
        return None
    name = dtype if isinstance(dtype, str) else _DTYPE_NAMES.get(dtype, str(dtype))
    return PEAK_FLOPS[key].get(name)


def lookup_memory_bytes(device_name: str) -> int | None:
    """Memory of one chip from the table, or None."""
    key = chip_key(device_name)
    return MEMORY_BYTES.get(key) if key else None
