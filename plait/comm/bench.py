"""``plait bench comm``: the collective primitives over a size sweep, with nccl-tests' figures.

For each op and message size, every rank runs ``warmup`` untimed calls, then ``iters`` timed
ones between barriers; the time of a call is the slowest rank's mean (a collective is as fast as
its slowest member). Then, as nccl-tests defines them:

* ``algbw = size / time``, where ``size`` is volumes.py's payload (the full buffer: the gathered
  output of all-gather, the input of reduce-scatter, the whole input of all-to-all);
* ``busbw = algbw * bus_factor(op, n)`` (all-reduce 2(n-1)/n; all-gather, reduce-scatter,
  all-to-all (n-1)/n; broadcast, reduce, send/recv 1): the per-link rate a ring would need,
  comparable across ops and group sizes, and what the planner calibrates its links with.

send_recv is a ring shift: rank r sends ``size`` bytes to r+1 and receives from r-1, at once.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .volumes import bus_factor

if TYPE_CHECKING:
    import torch

BENCH_OPS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
             "send_recv")
DEFAULT_MIN_BYTES = 1 << 10
DEFAULT_MAX_BYTES = 256 << 20
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


@dataclass
class BenchResult:
    op: str
    size_bytes: int      # payload (volumes.py convention)
    elements: int
    world_size: int
    time_us: float       # per call, slowest rank's mean
    algbw_gbps: float
    busbw_gbps: float


def parse_size(text: str | int) -> int:
    """``"1K"``, ``"256MB"``, ``"4096"`` -> bytes (binary units, as nccl-tests)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: use bytes or a unit, e.g. 1K, 64M, 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_ops(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """Comma list of op names (default: all) -> validated tuple."""
    if text is None or text == "" or text == "all":
        return BENCH_OPS
    names = [t.strip().replace("-", "_") for t in
             (text.split(",") if isinstance(text, str) else text) if t.strip()]
    aliases = {"allreduce": "all_reduce", "allgather": "all_gather",
               "reducescatter": "reduce_scatter", "alltoall": "all_to_all",
               "sendrecv": "send_recv", "p2p": "send_recv"}
    names = [aliases.get(n, n) for n in names]
    unknown = [n for n in names if n not in BENCH_OPS]
    if unknown:
        raise ValueError(f"unknown collective {', '.join(map(repr, unknown))}; known: "
                         f"{', '.join(BENCH_OPS)}")
    return tuple(dict.fromkeys(names))


def size_sweep(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """Sizes from ``min_bytes`` to ``max_bytes``, multiplying by ``factor`` (nccl-tests' -f)."""
    if min_bytes < 1:
        raise ValueError(f"--min-bytes={min_bytes} must be >= 1")
    if min_bytes > max_bytes:
        raise ValueError(f"--min-bytes={min_bytes} is larger than --max-bytes={max_bytes}; "
                         f"swap them or raise --max-bytes")
    if factor < 2:
        raise ValueError(f"factor={factor} must be >= 2")
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def validate_world(world_size: int) -> None:
    if world_size < 2:
        raise ValueError(f"--nproc={world_size}: a collective needs at least 2 ranks "
                         f"(use --nproc 2 or more)")


# ---------------------------------------------------------------------------------------------
def _runner(op: str, numel: int, n: int, rank: int, device: Any, dtype: torch.dtype) -> Any:
    """A zero-argument function issuing one ``op`` whose payload is ``numel`` elements."""
    import torch
    import torch.distributed as dist

    def buf(k: int) -> torch.Tensor:
        return torch.ones(k, device=device, dtype=dtype)

    if op == "all_reduce":
        t = buf(numel)
        return lambda: dist.all_reduce(t)
    if op == "broadcast":
        t = buf(numel)
        return lambda: dist.broadcast(t, src=0)
    if op == "reduce":
        t = buf(numel)
        return lambda: dist.reduce(t, dst=0)
    if op == "all_gather":
        out, inp = buf(numel), buf(numel // n)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp)
    if op == "reduce_scatter":
        inp, out = buf(numel), buf(numel // n)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp)
    if op == "all_to_all":
        inp, out = buf(numel), buf(numel)
        return lambda: dist.all_to_all_single(out, inp)
    if op == "send_recv":
        send, recv = buf(numel), buf(numel)
        nxt, prv = (rank + 1) % n, (rank - 1) % n

        def shift() -> None:
            ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return shift
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(BENCH_OPS)}")


def elements_for(op: str, size_bytes: int, n: int, elem: int) -> int:
    """Elements of payload for ``size_bytes``, rounded down so it splits evenly over ``n``."""
    numel = max(1, size_bytes // elem)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        numel = max(n, numel // n * n)
    return numel


def time_op(fn: Any, iters: int, warmup: int, device: Any) -> float:
    """Mean seconds per call of ``fn`` on this rank, slowest rank's value (all ranks return it)."""
    import torch
    import torch.distributed as dist

    from ..accelerators import accelerator_for
    acc = accelerator_for(torch.device(device))
    for _ in range(warmup):
        fn()
    acc.synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    acc.synchronize(device)
    mine = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine.item())


def bench_worker(rank: int, world_size: int, ops: Sequence[str], sizes: Sequence[int],
                 iters: int, warmup: int, dtype_name: str = "float32") -> list[dict]:
    """Runs on every rank (under plait.spawn.run_distributed or torchrun)."""
    import torch
    import torch.distributed as dist

    from ..accelerators import get_accelerator
    acc = get_accelerator("cuda" if dist.get_backend() == "nccl" else "cpu")
    device = acc.device(rank)
    acc.set_device(device)
    dtype = getattr(torch, dtype_name)
    elem = torch.empty((), dtype=dtype).element_size()
    out = []
    for op in ops:
        for size in sizes:
            numel = elements_for(op, size, world_size, elem)
            fn = _runner(op, numel, world_size, rank, device, dtype)
            t = time_op(fn, iters, warmup, device)
            payload = numel * elem
            algbw = payload / t / 1e9
            out.append(asdict(BenchResult(op=op, size_bytes=payload, elements=numel,
                                          world_size=world_size, time_us=t * 1e6,
                                          algbw_gbps=algbw,
                                          busbw_gbps=algbw * bus_factor(op, world_size))))
            del fn
    return out


def bench_comm(ops: str | Sequence[str] | None = None, min_bytes: int | str = DEFAULT_MIN_BYTES,
               max_bytes: int | str = DEFAULT_MAX_BYTES, nproc: int = 2, iters: int = 10,
               warmup: int = 2, backend: str = "gloo", timeout: float = 3600.0) -> list[dict]:
    """Spawn ``nproc`` local ranks and run the sweep; returns one dict per (op, size).

    Raises ValueError for an unknown op, ``min > max`` or fewer than 2 ranks, before spawning.
    """
    from ..spawn import run_distributed
    names = parse_ops(ops)
    sizes = size_sweep(parse_size(min_bytes), parse_size(max_bytes))
    validate_world(nproc)
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters={iters} must be >= 1 and warmup={warmup} >= 0")
    return run_distributed(bench_worker, nproc, names, sizes, iters, warmup, backend=backend,
                           timeout=timeout)[0]


def format_table(results: Sequence[dict]) -> str:
    head = f"{'op':<15}{'size':>10}{'elements':>12}{'time (us)':>12}{'algbw GB/s':>12}" \
           f"{'busbw GB/s':>12}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r['op']:<15}{_human(r['size_bytes']):>10}{r['elements']:>12}"
                     f"{r['time_us']:>12.1f}{r['algbw_gbps']:>12.3f}{r['busbw_gbps']:>12.3f}")
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"
