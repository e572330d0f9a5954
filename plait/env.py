"""`plait env`: what this machine offers — accelerators, process-group backends, versions."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Any

import torch
import torch.distributed as dist

from .accelerators import all_accelerators

_PACKAGES = ("torch", "plait", "numpy", "transformers", "torch_xla", "matplotlib", "pyyaml")


def _version(name: str) -> str | None:
    dist_name = {"torch_xla": "torch-xla"}.get(name, name)
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect() -> dict[str, Any]:
    backends = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
        "ucc": getattr(dist, "is_ucc_available", lambda: False)(),
        "xla": _version("torch_xla") is not None,
    }
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": __import__("os").cpu_count(),
        "versions": {name: _version(name) for name in _PACKAGES},
        "torch_cuda": torch.version.cuda,
        "torch_hip": torch.version.hip,
        "accelerators": [acc.describe() for acc in all_accelerators()],
        "backends": backends,
    }


def format_text(info: dict[str, Any]) -> str:
    lines = [f"python      {info['python']} on {info['platform']} ({info['cpu_count']} CPUs)"]
    lines.append("versions    " + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v))
    missing = [k for k, v in info["versions"].items() if not v]
    if missing:
        lines.append("not found   " + ", ".join(missing))
    lines.append("backends    " + ", ".join(f"{k}{'' if v else ' (no)'}"
                                            for k, v in info["backends"].items()))
    lines.append("accelerators:")
    for acc in info["accelerators"]:
        if not acc["available"]:
            lines.append(f"  {acc['name']:<5} not available")
            continue
        mem = f", {acc['memory_bytes'] / 2**30:.1f} GiB" if acc["memory_bytes"] else ""
        peak = (f", {acc['peak_bf16_flops'] / 1e12:.0f} TFLOP/s bf16 peak"
                if acc["peak_bf16_flops"] else "")
        lines.append(f"  {acc['name']:<5} {acc['count']} x {acc['device_name']} "
                     f"(backend {acc['backend']}{mem}{peak})")
    return "\n".join(lines)
