"""Closed-form communication volumes: the one place plait says how many bytes a collective moves.

Shared by the planner (predictions), the ledger (measured records are converted with the same
factors) and the reports, so "predicted" and "measured" can only differ because the traffic
differs, never because two formulas disagree.

Convention, used everywhere in plait:

* ``payload`` is the size in bytes of the tensor the collective is called on, as the caller sees
  it: the buffer for all-reduce/broadcast/reduce, the *full* (gathered) output for all-gather,
  the *full* input for reduce-scatter, the whole input for all-to-all, the message for send/recv.
* ``wire`` bytes per rank are what a bandwidth-optimal (ring) algorithm sends out of each rank:
  ``payload * bus_factor(op, n)``, with the factors nccl-tests uses for bus bandwidth —
  all-reduce ``2(n-1)/n``, all-gather / reduce-scatter / all-to-all ``(n-1)/n``, broadcast /
  reduce / send-recv ``1``.

Backends may move more than this (gloo has no native reduce-scatter and runs it as a full
all-reduce); reports say so next to the figure rather than change the convention.
"""

from __future__ import annotations

import torch

# Canonical collective names (the ledger and the planner use exactly these).
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce",
       "send_recv")

_DTYPE_BYTES = {"fp32": 4, "float32": 4, "tf32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2,
                "float16": 2, "fp8": 1, "int8": 1, "int64": 8}


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element of ``dtype`` (a torch dtype or a short name like "bf16")."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


def bus_factor(op: str, n: int) -> float:
    """Bytes a ring algorithm sends per rank, per byte of payload, on ``n`` ranks."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    if n < 1:
        raise ValueError(f"group size n={n} must be >= 1")
    if n == 1:
        return 0.0 if op != "send_recv" else 1.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def wire_bytes(op: str, payload: float, n: int) -> float:
    """Bytes sent per rank by one ``op`` of ``payload`` bytes on ``n`` ranks (ring)."""
    return payload * bus_factor(op, n)
