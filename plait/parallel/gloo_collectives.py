"""FSDP2's reduce-scatter and all-gather on gloo, built on ``all_to_all_single``.

Why this exists (we write our own here instead of using PyTorch's collective): gloo has no
native reduce-scatter — ``reduce_scatter_tensor`` runs a full all-reduce and keeps a slice,
twice the bytes of a reduce-scatter — and its ``all_gather_into_tensor`` is slower than an
all-to-all of the same bytes. Measured with 2 gloo processes on the 2-core CPU machine, fp32,
150 MiB, buffers allocated per call as FSDP2 does (``bench/gloo_collectives.py``):
reduce-scatter ~300 ms vs ~75 ms as all-to-all + local sum, all-gather ~290 ms vs ~60 ms as an
all-to-all (torch's with buffers kept alive: ~220 and ~170 ms). ZeRO-3 issues both for every
block on every step, so on CPU they decide whether ZeRO-3 keeps up with DDP.

FSDP2 lets a module replace both (``FSDPModule.set_custom_reduce_scatter`` /
``set_custom_all_gather``, protocol in ``torch.distributed.fsdp._fully_shard._fsdp_api``:
``allocate`` a buffer, then ``__call__``); :func:`use_gloo_collectives` installs these on every
FSDP module of a model, and only when the shard group runs on gloo: NCCL's reduce-scatter and
all-gather are the fast path on GPUs and are never replaced.

Reduce-scatter as all-to-all: the input holds n equal chunks, chunk j destined for rank j.
After an all-to-all, rank r holds chunk r of every rank; summing them locally is the
reduce-scatter. Each rank sends and receives (n-1)/n of the input, the ring reduce-scatter's
bytes. All-gather as all-to-all: each rank sends its shard to every rank; rank r receives the
shards in rank order, which is the gathered tensor. (n-1)/n of the output, again the ring bytes.

With 2 ranks both skip the chunk a rank keeps for itself (all-to-all split sizes 0 to and from
itself): no staging copy of the input for the all-gather, and a receive buffer of one chunk
for the reduce-scatter.

The buffers (FSDP2's flat all-gather output and reduce-scatter input, our receive/staging
buffers) come from a :class:`BufferPool` that hands a buffer out again once nothing uses it:
allocating them anew for every block costs more than the communication on CPU (see there).

Each call is recorded by the communication ledger as the logical collective (reduce_scatter or
all_gather, volumes.py's payload convention) with ``via="all_to_all"``
(:class:`plait.comm.ledger.issued_as`), so the ledger's measured bytes keep matching the closed
forms.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ReduceOp

from .._torch_compat import fsdp_comm_protocol, storage_use_count
from ..comm.ledger import issued_as

# FSDP2's Comm protocol for custom collectives; without it use_gloo_collectives installs nothing.
if TYPE_CHECKING:
    from .._torch_compat import FSDPAllGather as AllGather
    from .._torch_compat import FSDPReduceScatter as ReduceScatter
else:
    AllGather, ReduceScatter = fsdp_comm_protocol() or (object, object)


def _reduce_kind(op: Any) -> tuple[Any, Any]:
    """(RedOpType, PREMUL_SUM factor or None) for a ``ReduceOp`` object or a ``RedOpType``."""
    kind = getattr(op, "op", op)
    factor = getattr(op, "factor", None) if kind == ReduceOp.PREMUL_SUM else None
    return kind, factor


_COMBINE_PAIR: dict[Any, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PREMUL_SUM: torch.add,
    ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum, ReduceOp.PRODUCT: torch.mul}


def _combine_rows(rows: torch.Tensor, kind: Any, out: torch.Tensor) -> None:
    """Reduce the rows of ``rows`` (n x k) into ``out`` (k) with the op ``kind``."""
    if kind in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM):
        torch.sum(rows, dim=0, out=out)
    elif kind == ReduceOp.MAX:
        torch.amax(rows, dim=0, out=out)
    elif kind == ReduceOp.MIN:
        torch.amin(rows, dim=0, out=out)
    else:  # PRODUCT (checked by the caller)
        torch.prod(rows, dim=0, out=out)


def _shard_sizes(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup,
                 what: str) -> tuple[int, int, int]:
    """(group size n, this rank, shard numel k), after checking ``full`` holds n x k elements."""
    n, k = group.size(), shard.numel()
    if full.numel() != n * k:
        raise ValueError(f"{what} has {full.numel()} elements, expected {n} x {k} "
                         f"(shard numel x group size)")
    return n, group.rank(), k


class BufferPool:
    """Reuse FSDP2's communication buffers across blocks and steps instead of allocating anew.

    Why: the flat all-gather output and reduce-scatter input of a block are tens of MiB; glibc
    serves allocations above 32 MiB with a fresh ``mmap`` and returns them with ``munmap`` on
    free, so every block of every step pays first-touch page faults on the whole buffer (on
    the 2-core test machine ~1 ms per MiB: more than the all-to-all itself). Keeping them is
    what FSDP2's ``Comm.allocate`` protocol allows ("reuse a persistent buffer").

    A buffer is handed out again only when nothing references its storage any more: every
    tensor viewing it (FSDP2's views, an in-flight gloo work) holds a reference, counted by
    ``plait._torch_compat.storage_use_count`` (private torch; without it the pool allocates
    every time). At most ``per_size`` buffers are kept per (numel, dtype, device); beyond that,
    a call gets a plain new tensor. Buffers under ``min_bytes`` are not pooled (the allocator's
    free lists already reuse those).
    """

    def __init__(self, per_size: int = 4, min_bytes: int = 1 << 20):
        self.per_size, self.min_bytes = per_size, min_bytes
        self.buffers: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self.use_count = storage_use_count()

    def _free(self, buf: torch.Tensor) -> bool:
        # The pool's own tensor plus the temporary storage object of this call: 2.
        return self.use_count is not None and self.use_count(buf) <= 2

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        numel = 1
        for d in size:
            numel *= int(d)
        if self.use_count is None or numel * dtype.itemsize < self.min_bytes:
            return torch.empty(*size, dtype=dtype, device=device)
        kept = self.buffers.setdefault((numel, dtype, torch.device(device)), [])
        for buf in kept:
            if self._free(buf):
                return buf.view(*size)  # a new tensor on the kept storage: counted while used
        fresh = torch.empty(numel, dtype=dtype, device=device)
        if len(kept) < self.per_size:
            kept.append(fresh)
        return fresh.view(*size)


class GlooReduceScatter(ReduceScatter):
    """Reduce-scatter = all-to-all of the input's n chunks, then a local reduction.

    Supports SUM, AVG (sum / n), PREMUL_SUM (sum x factor: FSDP2's gradient divide factor; the
    factor is applied once to the sum rather than to every input, which is the same value up to
    rounding), MAX, MIN and PRODUCT.
    """

    def __init__(self, pool: BufferPool | None = None):
        self.pool = pool or BufferPool()

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return self.pool.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any = ReduceOp.SUM,
                 async_op: bool = False) -> dist.Work | None:
        if async_op:
            # FSDP2 issues its reduce-scatter synchronously (foreach_reduce); the local
            # reduction after the all-to-all would need a completion callback otherwise.
            raise ValueError("GlooReduceScatter runs synchronously (async_op=False)")
        kind, factor = _reduce_kind(op)
        if kind not in _COMBINE_PAIR:
            raise ValueError(f"GlooReduceScatter does not support reduce op {kind}")
        n, rank, k = _shard_sizes(input_tensor, output_tensor, group, "reduce-scatter input")
        flat_in = input_tensor.reshape(-1)
        out = output_tensor.view(-1)
        payload = input_tensor.numel() * input_tensor.element_size()
        if n == 2:
            # Send the other rank its chunk, receive ours from it; keep our own chunk in place.
            other = 1 - rank
            splits = [k if j == other else 0 for j in range(2)]
            recv = self.pool.allocate((k,), dtype=input_tensor.dtype, device=input_tensor.device)
            with issued_as("reduce_scatter", payload):
                dist.all_to_all_single(recv, flat_in.narrow(0, other * k, k),
                                       output_split_sizes=splits, input_split_sizes=splits,
                                       group=group)
            _COMBINE_PAIR[kind](flat_in.narrow(0, rank * k, k), recv, out=out)
        else:
            recv = self.pool.allocate((n * k,), dtype=input_tensor.dtype,
                                      device=input_tensor.device)
            with issued_as("reduce_scatter", payload):
                dist.all_to_all_single(recv, flat_in.contiguous(), group=group)
            _combine_rows(recv.view(n, k), kind, out)
        if kind == ReduceOp.AVG:
            out.div_(n)
        elif factor is not None:
            out.mul_(factor)
        return None


class GlooAllGather(AllGather):
    """All-gather = all-to-all in which every rank sends its shard to every rank."""

    def __init__(self, pool: BufferPool | None = None):
        self.pool = pool or BufferPool()

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return self.pool.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        n, rank, k = _shard_sizes(output_tensor, input_tensor, group, "all-gather output")
        out = output_tensor.view(-1)
        shard = input_tensor.reshape(-1)
        payload = output_tensor.numel() * output_tensor.element_size()
        if n == 2:
            # FSDP2 copies the local shard into its slot of the output before the call (the
            # input is a view of it); copy only if a caller did not.
            own = out.narrow(0, rank * k, k)
            if own.data_ptr() != shard.data_ptr():
                own.copy_(shard)
            other = 1 - rank
            splits = [k if j == other else 0 for j in range(2)]
            with issued_as("all_gather", payload):
                return dist.all_to_all_single(out.narrow(0, other * k, k), shard,
                                              output_split_sizes=splits,
                                              input_split_sizes=splits, group=group,
                                              async_op=async_op)
        # n copies of the shard, copy j for rank j. An async all-to-all's work holds the tensor
        # it sends, which keeps the staging buffer out of the pool until it completes.
        staged = self.pool.allocate((n, k), dtype=shard.dtype, device=shard.device)
        staged.copy_(shard.expand(n, k))
        staged = staged.view(-1)
        with issued_as("all_gather", payload):
            return dist.all_to_all_single(out, staged, group=group, async_op=async_op)


def gloo_collectives_apply(group: dist.ProcessGroup | None, device_type: str) -> bool:
    """Whether :func:`use_gloo_collectives` replaces FSDP2's collectives for this group.

    Only on gloo with CPU tensors, a group of >= 2 ranks, and a torch whose FSDP2 has the
    custom-collective hooks. Not on NCCL (or any other backend): their native reduce-scatter
    and all-gather are the fast path there.
    """
    from torch.distributed.fsdp import FSDPModule

    if group is None or device_type != "cpu" or AllGather is object:
        return False
    if not hasattr(FSDPModule, "set_custom_all_gather"):
        return False
    return group.size() >= 2 and str(dist.get_backend(group)) == "gloo"


def use_gloo_collectives(module: nn.Module, group: dist.ProcessGroup | None,
                         device_type: str = "cpu") -> bool:
    """Install the all-to-all reduce-scatter / all-gather on every FSDP2 module in ``module``.

    ``group``: the shard group FSDP2 all-gathers and reduce-scatters over (``dp_shard``).
    Returns whether they were installed (see :func:`gloo_collectives_apply`); otherwise FSDP2
    keeps its defaults. One pair of objects, sharing one buffer pool, serves every module.
    """
    from torch.distributed.fsdp import FSDPModule

    if not gloo_collectives_apply(group, device_type):
        return False
    pool = BufferPool()
    reduce_scatter, all_gather = GlooReduceScatter(pool), GlooAllGather(pool)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_custom_reduce_scatter(reduce_scatter)
            sub.set_custom_all_gather(all_gather)
    return True
