"""The communication ledger: every collective a rank issues, counted while it is active.

``Ledger`` is a context manager. While a rank is inside ``with ledger:``, each collective it
issues is recorded under (mesh axis, collective) with its count, payload bytes, wire bytes and
wall time. Leaving the block stops recording; when no ledger is active nothing is installed, so a
run that never asks for the ledger pays nothing.

How it sees the traffic. torch routes every collective through the dispatcher: the classic c10d
ops (``torch.ops.c10d.allreduce_`` ...) behind ``torch.distributed.*``, the process-group calls
of DDP's C++ reducer and of FSDP2, and the point-to-point ops behind ``batch_isend_irecv`` that
``torch.distributed.pipelining`` uses; and the functional collectives
(``torch.ops._c10d_functional.*``) that DTensor emits for tensor/sequence parallelism. A kernel
on those ops alone (see ``_Interceptor``) therefore sees all of them, with no hooks in DDP, FSDP
or the pipeline schedules. Not ``CommDebugMode``: it is a TorchDispatchMode (every aten op pays
a Python call, 10-20% of a small step) and it counts calls only (no bytes, group or time).

Byte convention: ``plait.comm.volumes`` (payload = the tensor the call is made on, the full
buffer for all-gather/reduce-scatter; wire = payload x bus factor). Point-to-point traffic is
recorded as ``send_recv`` counting the bytes this rank *sent*; what it received is kept beside
it (``recv_bytes``) so the sum over ranks is not counted twice.

Time: from issue to completion of the collective's ``Work`` future (c10d ops) or to the
``wait_tensor`` that consumes a functional collective. Asynchronous collectives overlap each other
and compute, so per-op bandwidth is an achieved figure, not a link measurement.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from .volumes import OPS, wire_bytes

# Collectives outside volumes.OPS that the ledger still records (a barrier moves no payload; a
# rooted gather/scatter moves (n-1)/n of the full buffer through the root).
EXTRA_OPS = ("gather", "scatter", "barrier")


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def op_wire_bytes(op: str, payload: float, n: int) -> float:
    """Wire bytes per rank for any op the ledger records (volumes.wire_bytes for OPS)."""
    if op in OPS:
        return wire_bytes(op, payload, n)
    if op in ("gather", "scatter"):
        return payload * (n - 1) / n if n > 1 else 0.0
    return 0.0


# ---------------------------------------------------------------------------------------------
# op -> (canonical name, payload bytes, index of the group argument)
# Payload per volumes.py: all-gather counts the full output, reduce-scatter the full input.
def _c10d_table() -> dict[Any, tuple[str, Any, int]]:
    c = torch.ops.c10d
    return {
        c.allreduce_.default: ("all_reduce", lambda a: _nbytes(a[0]), 1),
        c.allreduce_coalesced_.default: ("all_reduce", lambda a: _nbytes(a[0]), 1),
        c.allgather_.default: ("all_gather", lambda a: _nbytes(a[0]), 2),
        c._allgather_base_.default: ("all_gather", lambda a: _nbytes(a[0]), 2),
        c.allgather_coalesced_.default: ("all_gather", lambda a: _nbytes(a[0]), 2),
        c.allgather_into_tensor_coalesced_.default: ("all_gather", lambda a: _nbytes(a[0]), 2),
        c.reduce_scatter_.default: ("reduce_scatter", lambda a: _nbytes(a[1]), 2),
        c._reduce_scatter_base_.default: ("reduce_scatter", lambda a: _nbytes(a[1]), 2),
        c.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", lambda a: _nbytes(a[1]), 2),
        c.alltoall_base_.default: ("all_to_all", lambda a: _nbytes(a[1]), 2),
        c.alltoall_.default: ("all_to_all", lambda a: _nbytes(a[1]), 2),
        c.broadcast_.default: ("broadcast", lambda a: _nbytes(a[0]), 1),
        c.reduce_.default: ("reduce", lambda a: _nbytes(a[0]), 1),
        c.gather_.default: ("gather", lambda a: _nbytes(a[0]) or _nbytes(a[1]), 2),
        c.scatter_.default: ("scatter", lambda a: _nbytes(a[1]) or _nbytes(a[0]), 2),
        c.send.default: ("send", lambda a: _nbytes(a[0]), 1),
        c.recv_.default: ("recv", lambda a: _nbytes(a[0]), 1),
        c.recv_any_source_.default: ("recv", lambda a: _nbytes(a[0]), 1),
        c.barrier.default: ("barrier", lambda a: 0, 1),
    }


def _funcol_table() -> dict[Any, tuple[str, Any, int]]:
    f = torch.ops._c10d_functional
    return {
        f.all_reduce.default: ("all_reduce", lambda a: _nbytes(a[0]), 2),
        f.all_reduce_.default: ("all_reduce", lambda a: _nbytes(a[0]), 2),
        f.all_reduce_coalesced.default: ("all_reduce", lambda a: _nbytes(a[0]), 2),
        f.all_reduce_coalesced_.default: ("all_reduce", lambda a: _nbytes(a[0]), 2),
        f.all_gather_into_tensor.default: ("all_gather", lambda a: _nbytes(a[0]) * a[1], 2),
        f.all_gather_into_tensor_out.default: ("all_gather", lambda a: _nbytes(a[0]) * a[1], 2),
        f.all_gather_into_tensor_coalesced.default:
            ("all_gather", lambda a: _nbytes(a[0]) * a[1], 2),
        f.reduce_scatter_tensor.default: ("reduce_scatter", lambda a: _nbytes(a[0]), 3),
        f.reduce_scatter_tensor_out.default: ("reduce_scatter", lambda a: _nbytes(a[0]), 3),
        f.reduce_scatter_tensor_coalesced.default:
            ("reduce_scatter", lambda a: _nbytes(a[0]), 3),
        f.all_to_all_single.default: ("all_to_all", lambda a: _nbytes(a[0]), 3),
        f.broadcast.default: ("broadcast", lambda a: _nbytes(a[0]), 2),
        f.broadcast_.default: ("broadcast", lambda a: _nbytes(a[0]), 2),
    }


# ---------------------------------------------------------------------------------------------
@dataclass
class Entry:
    """Totals for one (mesh axis, collective) on one rank."""

    axis: str
    op: str
    group_size: int
    count: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    time_s: float = 0.0
    recv_count: int = 0   # send_recv only: messages / bytes received (not added to payload)
    recv_bytes: int = 0
    via: str = ""         # the c10d op that carried it, when not the op itself (see issued_as)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        if not d["via"]:
            del d["via"]
        return d


def _group_ranks_of_axes(root: Any, dims: tuple[int, ...]) -> frozenset[int] | None:
    """Ranks sharing this rank's coordinates on every dim of ``root`` not in ``dims``."""
    coord = root.get_coordinate()
    if coord is None:
        return None
    index = tuple(slice(None) if d in dims else c for d, c in enumerate(coord))
    return frozenset(int(r) for r in root.mesh[index].flatten().tolist())


def axis_names_by_ranks(mesh: Any) -> dict[frozenset[int], str]:
    """Map the rank set of each group this rank belongs to onto a mesh axis name.

    ``mesh`` is a ``plait.mesh.Mesh`` or a dict ``{axis_name: DeviceMesh}``. Single axes of size
    > 1 win, then plait's flattened views (``dp``), then joined names (``dp_replicate+tp``) for
    any other product of axes, so every group a parallelism can use has a readable name.
    """
    names: dict[frozenset[int], str] = {}
    if mesh is None:
        return names
    if isinstance(mesh, Mapping):
        for name, dm in mesh.items():
            ranks = frozenset(int(r) for r in dm.mesh.flatten().tolist())
            if len(ranks) > 1:
                names.setdefault(ranks, name)
        return names
    root = mesh.root
    dim_names = root.mesh_dim_names or tuple(f"dim{i}" for i in range(root.ndim))
    big = [d for d in range(root.ndim) if root.mesh.shape[d] > 1]
    for d in big:
        ranks = _group_ranks_of_axes(root, (d,))
        if ranks is not None:
            names.setdefault(ranks, dim_names[d])
    for name, dm in getattr(mesh, "flat", {}).items():
        ranks = frozenset(int(r) for r in dm.mesh.flatten().tolist())
        if len(ranks) > 1:
            names.setdefault(ranks, name)
    for k in range(2, len(big) + 1):
        for combo in itertools.combinations(big, k):
            ranks = _group_ranks_of_axes(root, combo)
            if ranks is not None:
                names.setdefault(ranks, "+".join(dim_names[d] for d in combo))
    return names


class _Interceptor:
    """Routes the collective ops through the active ledgers while at least one is active.

    A Python kernel is registered for each collective at the ``BackendSelect`` dispatch key,
    whose default for every op is a fallthrough: only the collectives pay a Python call, every
    other op dispatches exactly as before. (A ``TorchDispatchMode`` would see every aten op and
    cost ~10 us each: 10-20% of a small model's step on CPU.) ``BackendSelect`` is the last
    functionality key before the backend, so it is reached even from inside other kernels:
    autograd's ``ADInplaceOrView`` would miss the collectives DTensor issues from within an aten
    op (e.g. the Partial->Replicate all-reduce of a sequence-parallel norm gradient in
    ``optimizer.step``). Dispatcher registrations are process-wide by nature, so this one
    object is too; the kernels are removed when the last ledger leaves, so a process that never
    activates a ledger, or has left it, pays nothing.
    """

    def __init__(self) -> None:
        self.ledgers: list["Ledger"] = []
        self.libs: list[Any] = []
        # Holders that keep the kernels installed between `with ledger:` blocks (a training run
        # that enters the ledger once per step): registering and removing dispatcher kernels
        # costs far more than the bookkeeping itself, so it is done once per run, not per step.
        self.retained = 0
        self.lock = threading.Lock()
        # A functional collective runs the c10d op underneath: count the outer call only.
        self.inside = threading.local()
        # issued_as(): the logical collective the next c10d op implements (see issued_as).
        self.logical = threading.local()

    def push(self, ledger: "Ledger") -> None:
        with self.lock:
            if not self.libs:
                self._register()
            self.ledgers.append(ledger)

    def pop(self, ledger: "Ledger") -> None:
        with self.lock:
            self.ledgers.remove(ledger)
            self._maybe_unregister()

    def retain(self) -> None:
        with self.lock:
            self.retained += 1
            if not self.libs:
                self._register()

    def release(self) -> None:
        with self.lock:
            self.retained = max(0, self.retained - 1)
            self._maybe_unregister()

    def _maybe_unregister(self) -> None:
        if not self.ledgers and not self.retained:
            for lib in self.libs:
                lib._destroy()
            self.libs.clear()

    def _register(self) -> None:
        after = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
        tables = (("c10d", _c10d_table()), ("_c10d_functional", _funcol_table()))
        for ns, table in tables:
            lib = torch.library.Library(ns, "IMPL")
            self.libs.append(lib)
            for op, spec in table.items():
                lib.impl(op._schema.name.split("::")[1], self._kernel(op, spec, after),
                         "BackendSelect", with_keyset=True)
            if ns == "_c10d_functional":
                wait = torch.ops._c10d_functional.wait_tensor.default
                lib.impl("wait_tensor", self._wait_kernel(wait, after), "BackendSelect",
                         with_keyset=True)

    def _kernel(self, op: Any, spec: tuple[str, Any, int], after: Any) -> Any:
        funcol = op.namespace == "_c10d_functional"

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.ledgers or getattr(self.inside, "on", False):
                return op.redispatch(keyset & after, *args, **kwargs)
            ledgers = list(self.ledgers)
            logical = getattr(self.logical, "spec", None)
            if logical is not None:  # issued_as(): record the logical op, once
                self.logical.spec = None
                op_name, payload = logical
                rec_spec: tuple = (op_name, lambda a: payload, spec[2], spec[0])
            else:
                rec_spec = spec
            self.inside.on = True
            t0 = time.perf_counter()
            try:
                out = op.redispatch(keyset & after, *args, **kwargs)
            finally:
                self.inside.on = False
            issued = time.perf_counter() - t0
            for ledger in ledgers:
                ledger._record(rec_spec, args, out, t0, issued, funcol)
            return out

        return kernel

    def _wait_kernel(self, op: Any, after: Any) -> Any:
        def kernel(keyset: Any, tensor: Any) -> Any:
            out = op.redispatch(keyset & after, tensor)
            if not self.ledgers:
                return out
            for ledger in list(self.ledgers):
                ledger._waited(tensor)
            return out

        return kernel


_INTERCEPTOR = _Interceptor()


class issued_as:  # noqa: N801 - a context manager used like a function
    """Record the next collective issued inside the block as ``op`` with ``payload_bytes``.

    For code that implements one collective with another, e.g. plait.parallel.gloo_collectives
    running FSDP2's reduce-scatter and all-gather as gloo ``all_to_all``: the ledger then counts
    the logical collective (the one the closed forms in volumes.py predict, with the same
    payload convention), and the entry says ``via="all_to_all"``. Costs two thread-local writes
    when no ledger is active.
    """

    def __init__(self, op: str, payload_bytes: int):
        self.spec = (op, int(payload_bytes))

    def __enter__(self) -> "issued_as":
        _INTERCEPTOR.logical.spec = self.spec
        return self

    def __exit__(self, *exc: Any) -> None:
        _INTERCEPTOR.logical.spec = None


class Ledger:
    """Count every collective this rank issues while inside ``with ledger:``.

    ``mesh``: a ``plait.mesh.Mesh`` or a dict ``{axis_name: DeviceMesh}``; groups are reported
    under those axis names (a group spanning several axes gets a joined name, ``dp`` for plait's
    flattened data view). Without a mesh, groups are named ``world`` or by their ranks.

    Each entry into the block counts as one step unless ``report(steps=...)`` says otherwise, so
    the natural use is one ``with ledger:`` per training step::

        ledger = Ledger(mesh)
        for batch in loader:
            with ledger:
                loss = step(batch)
        report = ledger.report(expected=volumes_for_plan)  # collective: call on every rank
        if dist.get_rank() == 0:
            print(report.table())
    """

    def __init__(self, mesh: Any = None):
        self.mesh = mesh
        self.entries: dict[tuple[str, str], Entry] = {}
        self.regions = 0
        self._active = False
        self._pending: dict[int, tuple[Entry, float]] = {}
        self._lock = threading.Lock()
        self._axis_cache: dict[str, tuple[str, int]] = {}
        self._names: dict[frozenset[int], str] | None = None
        self._installed = False

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> "Ledger":
        if self._active:
            raise RuntimeError("this Ledger is already active; nest a second Ledger instead")
        _INTERCEPTOR.push(self)
        self._active = True
        self.regions += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active = False
        _INTERCEPTOR.pop(self)

    @property
    def active(self) -> bool:
        return self._active

    def install(self) -> None:
        """Keep the collective kernels installed until ``uninstall()``, so that entering and
        leaving the ledger every step costs only a list append (the runtime does this)."""
        if not self._installed:
            _INTERCEPTOR.retain()
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            _INTERCEPTOR.release()
            self._installed = False

    def reset(self) -> None:
        """Forget everything recorded (e.g. after warm-up steps)."""
        with self._lock:
            self.entries.clear()
            self._pending.clear()
            self.regions = 0

    # ------------------------------------------------------------------ recording
    def _axis(self, group: Any) -> tuple[str, int]:
        """(axis name, group size) for a ProcessGroup (boxed or not) or a group name."""
        if isinstance(group, str):
            key = group
        else:
            if isinstance(group, torch.ScriptObject):
                group = dist.ProcessGroup.unbox(group)
            key = group.group_name
        hit = self._axis_cache.get(key)
        if hit is not None:
            return hit
        from torch.distributed.distributed_c10d import _resolve_process_group
        pg = _resolve_process_group(key) if isinstance(group, str) else group
        ranks = frozenset(dist.get_process_group_ranks(pg))
        if self._names is None:
            self._names = axis_names_by_ranks(self.mesh)
        name = self._names.get(ranks)
        if name is None:
            if len(ranks) == dist.get_world_size():
                name = "world"
            elif len(ranks) == 1:
                name = "self"
            else:
                name = "ranks(" + ",".join(str(r) for r in sorted(ranks)) + ")"
        hit = (name, len(ranks))
        self._axis_cache[key] = hit
        return hit

    def _entry(self, axis: str, op: str, n: int) -> Entry:
        e = self.entries.get((axis, op))
        if e is None:
            e = self.entries[(axis, op)] = Entry(axis=axis, op=op, group_size=n)
        return e

    def _record(self, spec: tuple, args: tuple, out: Any, t0: float,
                issued: float, funcol: bool) -> None:
        op, payload_fn, group_idx = spec[:3]
        via = spec[3] if len(spec) > 3 else ""  # issued_as(): the op that really ran
        axis, n = self._axis(args[group_idx])
        payload = payload_fn(args)
        recv = op == "recv"
        if op in ("send", "recv"):
            op = "send_recv"
        with self._lock:
            e = self._entry(axis, op, n)
            if via:
                e.via = via
            if recv:
                e.recv_count += 1
                e.recv_bytes += payload
            else:
                e.count += 1
                e.payload_bytes += payload
                e.wire_bytes += op_wire_bytes(op, payload, n)
        if funcol:
            # Completion is the wait_tensor that consumes the result.
            self._pending[id(out)] = (e, t0)
            return
        work = out[-1] if isinstance(out, tuple) else out
        try:
            fut = dist.Work.unbox(work).get_future()
        except Exception:  # noqa: BLE001 - a backend without futures: time the call itself
            with self._lock:
                e.time_s += issued
            return

        def done(_: Any, e: Entry = e, t0: float = t0) -> None:
            with self._lock:
                e.time_s += time.perf_counter() - t0

        fut.then(done)

    def _waited(self, tensor: Any) -> None:
        if not self._pending:
            return
        item = self._pending.pop(id(tensor), None)
        if item is not None:
            e, t0 = item
            with self._lock:
                e.time_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ results
    def local_entries(self) -> list[dict[str, Any]]:
        """This rank's entries as plain dicts (sorted by axis, op)."""
        with self._lock:
            return [self.entries[k].to_dict() for k in sorted(self.entries)]

    def report(self, expected: Any = None, steps: int | None = None,
               group: Any = None) -> "CommReport":
        """Gather every rank's entries and build the report (a collective: call on all ranks).

        ``expected``: predicted bytes per rank per step, as ``{(axis, op): bytes}``,
        ``{axis: {op: bytes}}`` or ``{"axis/op": bytes}`` (payload bytes, volumes.py's
        convention). ``steps``: how many steps the recorded traffic covers (default: how many
        times the ledger was entered). Must be called outside ``with ledger:``.
        """
        from .report import CommReport
        if self.active:
            raise RuntimeError("call Ledger.report() after leaving the `with ledger:` block")
        mine = self.local_entries()
        backend = None
        if dist.is_available() and dist.is_initialized():
            per_rank: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(per_rank, mine, group=group)
            backend = str(dist.get_backend(group))
        else:
            per_rank = [mine]
        return CommReport.from_ranks(per_rank, steps=steps or max(self.regions, 1),
                                     expected=expected, backend=backend)


def ledger_for(enabled: bool, mesh: Any = None) -> "Ledger | _Null":
    """A Ledger when ``enabled``, else a no-op context manager (so callers need no if/else)."""
    return Ledger(mesh) if enabled else _Null()


class _Null:
    """The ledger-off stand-in: entering it does nothing at all."""

    active = False

    def __enter__(self) -> "_Null":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None
