"""The communication ledger: every collective a rank issues, counted while it is active.

``Ledger`` is a context manager. While a rank is inside ``with ledger:``, each collective it
issues is recorded under (mesh axis, collective) with its count, payload bytes and wall time
(wire bytes follow from the payload at report time). Leaving the block stops recording; when no
ledger is active nothing is installed, so a run that never asks for the ledger pays nothing.

How it sees the traffic. torch routes every collective through the dispatcher's c10d ops
(``torch.ops.c10d.allreduce_`` ...): ``torch.distributed.*``, the process-group calls of DDP's
C++ reducer and of FSDP2, the point-to-point ops behind ``batch_isend_irecv`` that
``torch.distributed.pipelining`` uses, and also the functional collectives
(``torch.ops._c10d_functional.*``) that DTensor emits for tensor/sequence parallelism, whose C++
implementations call the process group, which dispatches the same c10d ops. A kernel on the c10d
ops alone (see ``_Interceptor``) therefore sees all of them, once each, with no hooks in DDP,
FSDP or the pipeline schedules. Not ``CommDebugMode``: it is a TorchDispatchMode (every aten op
pays a Python call, 10-20% of a small step) and it counts calls only (no bytes, group or time).

Byte convention: ``plait.comm.volumes`` (payload = the tensor the call is made on, the full
buffer for all-gather/reduce-scatter; wire = payload x bus factor). Point-to-point traffic is
recorded as ``send_recv`` counting the bytes this rank *sent*; what it received is kept beside
it (``recv_bytes``) so the sum over ranks is not counted twice. Bytes and counts are recorded on
every call: they are exact.

Time: from issue to completion. Completion is the collective's ``Work`` future where the backend
gives one (gloo's collectives; every nccl op), else (gloo's send/recv and reduce-scatter) the
``wait`` on the ``Work``: the ledger hands back a thin ``Work`` that notes the time when it is
waited on, by Python (``work.wait()``) or C++ (``wait_tensor`` of a functional collective).
Timing is what costs (a completion callback, a GIL hand-off), so it is sampled: the first
``time_first`` calls of each (axis, op) are timed, then each call with probability
1/``time_every``, weighted by ``time_every`` (an unbiased estimate of the total; random, not every
k-th call, so a step's periodic pattern of sizes cannot alias with the sampling).
``Ledger(mesh, time_every=1)`` times every call. Asynchronous collectives overlap each other and
compute, so per-op bandwidth is an achieved figure, not a link measurement.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .._torch_compat import (
    c10d_op,
    destroy_library,
    keyset_after_backend_select,
    redispatch_boxed,
    resolve_process_group,
)
from .volumes import OPS, wire_bytes

if TYPE_CHECKING:
    from .report import CommReport

# Collectives outside volumes.OPS that the ledger still records (a barrier moves no payload; a
# rooted gather/scatter moves (n-1)/n of the full buffer through the root).
EXTRA_OPS = ("gather", "scatter", "barrier")


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.nbytes
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _first(a: Any) -> int:
    """Bytes of argument 0, a list of tensors (or of lists): the per-call hot path."""
    total = 0
    for t in a[0]:
        total += t.nbytes if isinstance(t, torch.Tensor) else _nbytes(t)
    return total


def _second(a: Any) -> int:
    """Bytes of argument 1, a list of tensors (or of lists)."""
    total = 0
    for t in a[1]:
        total += t.nbytes if isinstance(t, torch.Tensor) else _nbytes(t)
    return total


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
# The functional collectives land here too (torch 2.13: all_gather_into_tensor ->
# allgather_into_tensor_coalesced_, reduce_scatter_tensor -> reduce_scatter_tensor_coalesced_,
# all_reduce -> allreduce_, all_to_all_single -> alltoall_base_, broadcast -> broadcast_), with
# the same full buffers as arguments, so their payload is the same by construction.
def _c10d_table() -> dict[Any, tuple[str, Any, int]]:
    c = c10d_op
    return {
        c("allreduce_"): ("all_reduce", _first, 1),
        c("allreduce_coalesced_"): ("all_reduce", _first, 1),
        c("allgather_"): ("all_gather", _first, 2),
        c("_allgather_base_"): ("all_gather", lambda a: a[0].nbytes, 2),
        c("allgather_coalesced_"): ("all_gather", _first, 2),
        c("allgather_into_tensor_coalesced_"): ("all_gather", _first, 2),
        c("reduce_scatter_"): ("reduce_scatter", _second, 2),
        c("_reduce_scatter_base_"): ("reduce_scatter", lambda a: a[1].nbytes, 2),
        c("reduce_scatter_tensor_coalesced_"): ("reduce_scatter", _second, 2),
        c("alltoall_base_"): ("all_to_all", lambda a: a[1].nbytes, 2),
        c("alltoall_"): ("all_to_all", _second, 2),
        c("broadcast_"): ("broadcast", _first, 1),
        c("reduce_"): ("reduce", _first, 1),
        c("gather_"): ("gather", lambda a: _nbytes(a[0]) or _nbytes(a[1]), 2),
        c("scatter_"): ("scatter", lambda a: _nbytes(a[1]) or _nbytes(a[0]), 2),
        c("send"): ("send", _first, 1),
        c("recv_"): ("recv", _first, 1),
        c("recv_any_source_"): ("recv", _first, 1),
        c("barrier"): ("barrier", lambda a: 0, 1),
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
    wire_bytes: float = 0.0  # filled in by to_dict(): payload x bus factor, not kept per call
    time_s: float = 0.0      # estimated total (sampled: see the module docstring)
    recv_count: int = 0   # send_recv only: messages / bytes received (not added to payload)
    recv_bytes: int = 0
    via: str = ""         # the c10d op that carried it, when not the op itself (see issued_as)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["wire_bytes"] = op_wire_bytes(self.op, self.payload_bytes, self.group_size)
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
        group = _group_ranks_of_axes(root, (d,))
        if group is not None:
            names.setdefault(group, dim_names[d])
    for name, dm in getattr(mesh, "flat", {}).items():
        ranks = frozenset(int(r) for r in dm.mesh.flatten().tolist())
        if len(ranks) > 1:
            names.setdefault(ranks, name)
    for k in range(2, len(big) + 1):
        for combo in itertools.combinations(big, k):
            group = _group_ranks_of_axes(root, combo)
            if group is not None:
                names.setdefault(group, "+".join(dim_names[d] for d in combo))
    return names


class _Interceptor:
    """Routes the c10d collective ops through the active ledgers while at least one is active.

    A Python kernel is registered for each c10d collective at the ``BackendSelect`` dispatch
    key, whose default for every op is a fallthrough: only the collectives pay a Python call,
    every other op dispatches exactly as before. (A ``TorchDispatchMode`` would see every aten op
    and cost ~10 us each: 10-20% of a small model's step on CPU.) ``BackendSelect`` is the last
    functionality key before the backend, so it is reached even from inside other kernels:
    autograd's ``ADInplaceOrView`` would miss the collectives DTensor issues from within an aten
    op (e.g. the Partial->Replicate all-reduce of a sequence-parallel norm gradient in
    ``optimizer.step``). The functional collectives are not intercepted themselves: each one
    runs a c10d op, which is seen here (intercepting both cost a second Python call per
    collective for nothing). Dispatcher registrations are process-wide by nature, so this one
    object is too; the kernels are removed when the last holder leaves (a ledger, or the hang
    watchdog's check), so a process that holds none pays nothing.

    Gates (``arm_gate``): functions called before the next collective is issued, on any group
    and from any thread, outside its timing. The hang watchdog's step-start check uses one to
    wait for its own all-gather just before the step's first collective, not at the step's start
    (``plait.diagnostics.watchdog``). A gate disarms itself before it waits.
    """

    def __init__(self) -> None:
        # The active ledgers, as a tuple replaced (never mutated) under the lock, so a kernel
        # reads one consistent snapshot without taking the lock.
        self.active: tuple[Ledger, ...] = ()
        self.libs: list[Any] = []
        # Holders that keep the kernels installed between `with ledger:` blocks (a training run
        # that enters the ledger once per step): registering and removing dispatcher kernels
        # costs far more than the bookkeeping itself, so it is done once per run, not per step.
        self.retained = 0
        self.lock = threading.Lock()
        # Which (process group, op) hand back a Work with a completion future (asked once: a
        # Work without one answers with an exception, ~15 us).
        self.has_future: dict[tuple[Any, Any], bool] = {}
        # _TimedWork objects not yet waited on. The C++ side of a Python Work subclass only
        # finds its Python `wait` while the Python object lives (without it, C++ runs the base
        # Work::wait, which never returns: checked, a functional reduce-scatter hangs); a
        # functional collective keeps the Work in C++ alone until `wait_tensor`, so the ledger
        # keeps it alive until then, and the last few waited ones a while longer, in case C++
        # waits again on a Work that Python waited on and dropped.
        self.in_flight: set[_TimedWork] = set()
        self.recently_waited: collections.deque[_TimedWork] = collections.deque(maxlen=256)
        # issued_as(): the logical collective the next c10d op implements (see issued_as).
        self.logical = threading.local()
        # arm_gate(): called before the next collective, replaced (never mutated) under the lock.
        self.gates: tuple[Callable[[], None], ...] = ()

    def push(self, ledger: Ledger) -> None:
        with self.lock:
            if not self.libs:
                self._register()
            self.active = self.active + (ledger,)

    def pop(self, ledger: Ledger) -> None:
        with self.lock:
            rest = list(self.active)
            rest.remove(ledger)
            self.active = tuple(rest)
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
        if not self.active and not self.retained:
            for lib in self.libs:
                destroy_library(lib)
            self.libs.clear()

    def _register(self) -> None:
        after = keyset_after_backend_select()
        lib = torch.library.Library("c10d", "IMPL")
        self.libs.append(lib)
        for op, spec in _c10d_table().items():
            lib.impl(op.name().split("::")[1], self._kernel(op, spec, after),
                     "BackendSelect", with_keyset=True)

    def _kernel(self, op: Any, spec: tuple[str, Any, int], after: Any) -> Any:
        name, payload_fn, group_idx = spec
        recv = name == "recv"
        canonical = "send_recv" if name in ("send", "recv") else name
        redispatch = redispatch_boxed(op)
        unbox = dist.ProcessGroup.unbox
        clock = time.perf_counter

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            for gate in self.gates:
                gate()
            ledgers = self.active
            if not ledgers:
                return redispatch(keyset & after, *args, **kwargs)
            t0 = clock()
            out = redispatch(keyset & after, *args, **kwargs)
            group = args[group_idx]
            pg = unbox(group) if isinstance(group, torch.ScriptObject) else group
            logical = getattr(self.logical, "spec", None)
            if logical is None:
                rec_op, payload, via = canonical, payload_fn(args), ""
            else:  # issued_as(): record the logical op, once
                self.logical.spec = None
                rec_op, payload = logical
                via = canonical
            timers = None
            for ledger in ledgers:
                timer = ledger._record(pg, rec_op, recv, payload, via)
                if timer is not None:
                    timers = [timer] if timers is None else timers + [timer]
            if timers is None:
                return out
            return self._time(op, pg, out, t0, timers)

        return kernel

    def _time(self, op: Any, pg: Any, out: Any, t0: float, timers: list[Any]) -> Any:
        """Note the time from ``t0`` to the completion of the Work in ``out`` into ``timers``
        ([(ledger, entry, weight)]); returns ``out``, its Work wrapped where that is how."""
        boxed = out[-1] if isinstance(out, tuple) else out
        work = dist.Work.unbox(boxed)
        key = (pg, op)
        future = None
        if self.has_future.get(key, True):
            try:
                future = work.get_future()
            except RuntimeError:  # "Work::getFuture not implemented" (gloo p2p, reduce-scatter)
                self.has_future[key] = False
            else:
                self.has_future[key] = True
        if future is not None:
            def done(_: Any) -> None:
                _note(timers, time.perf_counter() - t0)

            future.add_done_callback(done)
            return out
        timed = _TimedWork(work, t0, timers, self)
        with self.lock:
            self.in_flight.add(timed)
        boxed = timed.boxed()
        return (*out[:-1], boxed) if isinstance(out, tuple) else boxed


def _note(timers: list[Any], elapsed: float) -> None:
    for ledger, entry, weight in timers:
        with ledger._lock:
            entry.time_s += weight * elapsed


class _TimedWork(dist.Work):
    """A ``Work`` standing in for one without a completion future, to time the collective to
    the moment someone waits for it.

    Our own instead of a torch building block: gloo's send/recv and reduce-scatter Works have no
    future (``get_future`` raises) and ``Work`` has no completion hook, so the only place the
    ledger can see the end is the ``wait``. Callers reach the Python methods below either
    directly (``work.wait()`` in the pipeline schedules and ``torch.distributed``) or through
    ``Work``'s pybind trampoline (``wait_tensor`` of a functional collective calls the C++
    ``wait``, which finds this Python override). Everything else is forwarded to the real Work.
    No waiter thread: a thread blocking on each Work contended with the pipeline for the GIL and
    hung its tests.
    """

    def __init__(self, inner: Any, t0: float, timers: list[Any], owner: _Interceptor) -> None:
        super().__init__()
        self._inner = inner
        self._t0 = t0
        self._timers: list[Any] | None = timers  # None once the completion is noted
        self._owner = owner

    def _finished(self) -> None:
        timers, self._timers = self._timers, None
        if timers is not None:  # the first wait (or completed poll) counts
            _note(timers, time.perf_counter() - self._t0)
            self._owner.recently_waited.append(self)
            self._owner.in_flight.discard(self)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        ok = self._inner.wait(timeout)
        self._finished()
        return ok

    def is_completed(self) -> bool:
        done = self._inner.is_completed()
        if done:
            self._finished()
        return done

    def get_future(self) -> Any:
        return self._inner.get_future()

    def get_future_result(self) -> Any:
        return self._inner.get_future_result()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def _source_rank(self) -> int:
        return self._inner._source_rank()

    def result(self) -> Any:
        return self._inner.result()

    def synchronize(self) -> None:
        return self._inner.synchronize()

    def block_current_stream(self) -> None:
        return self._inner.block_current_stream()

    def _get_duration(self) -> float:
        return self._inner._get_duration()

    def _get_op_type(self) -> Any:
        return self._inner._get_op_type()


_INTERCEPTOR = _Interceptor()


def arm_gate(gate: Callable[[], None]) -> None:
    """Call ``gate()`` before the next collective this process issues (see ``_Interceptor``);
    the collective kernels must be held installed (``hold_kernels``)."""
    with _INTERCEPTOR.lock:
        if gate not in _INTERCEPTOR.gates:
            _INTERCEPTOR.gates = _INTERCEPTOR.gates + (gate,)


def disarm_gate(gate: Callable[[], None]) -> None:
    with _INTERCEPTOR.lock:
        _INTERCEPTOR.gates = tuple(g for g in _INTERCEPTOR.gates if g != gate)


def hold_kernels() -> None:
    """Keep the collective kernels installed (for gates) until the matching ``release_kernels``:
    one Python call per collective, none per other op."""
    _INTERCEPTOR.retain()


def release_kernels() -> None:
    _INTERCEPTOR.release()


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

    def __enter__(self) -> issued_as:
        _INTERCEPTOR.logical.spec = self.spec
        return self

    def __exit__(self, *exc: Any) -> None:
        _INTERCEPTOR.logical.spec = None


class Ledger:
    """Count every collective this rank issues while inside ``with ledger:``.

    ``mesh``: a ``plait.mesh.Mesh`` or a dict ``{axis_name: DeviceMesh}``; groups are reported
    under those axis names (a group spanning several axes gets a joined name, ``dp`` for plait's
    flattened data view). Without a mesh, groups are named ``world`` or by their ranks.

    ``time_every`` / ``time_first``: timing is sampled (bytes and counts never are): the first
    ``time_first`` calls per (axis, op) are timed, then one call in ``time_every`` on average;
    ``time_every=1`` times every call (exact times, at a higher cost per call).

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

    def __init__(self, mesh: Any = None, time_every: int = 8, time_first: int = 8):
        if time_every < 1 or time_first < 0:
            raise ValueError(f"time_every={time_every} must be >= 1 and time_first={time_first} "
                             f">= 0")
        self.mesh = mesh
        self.time_every = time_every
        self.time_first = time_first
        self.entries: dict[tuple[str, str], Entry] = {}
        self.regions = 0
        self._active = False
        self._lock = threading.Lock()
        # (process group, op) -> its Entry: the per-call lookup, O(1) with no name resolution.
        self._by_group: dict[tuple[Any, str], Entry] = {}
        self._axis_cache: dict[str, tuple[str, int]] = {}
        self._names: dict[frozenset[int], str] | None = None
        self._installed = False
        self._rng = random.Random(0)  # sampling only; seeded so a run is repeatable

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Ledger:
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

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside a ``with ledger:`` block, leave out the collectives issued in this one (the
        runtime's own bookkeeping, such as the step's loss and item count)."""
        if not self._active:
            yield
            return
        _INTERCEPTOR.pop(self)
        try:
            yield
        finally:
            _INTERCEPTOR.push(self)

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
            self._by_group.clear()
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
        pg = resolve_process_group(key) if isinstance(group, str) else group
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

    def _record(self, pg: Any, op: str, recv: bool, payload: int,
                via: str = "") -> tuple | None:
        """Count one call of ``op`` on process group ``pg`` (every call: bytes stay exact).

        Returns ``(self, entry, weight)`` when this call's time is to be measured (the first
        ``time_first`` calls of the (axis, op), then each with probability 1/time_every,
        weighted by time_every), else None.
        """
        with self._lock:
            e = self._by_group.get((pg, op))
            if e is None:
                axis, n = self._axis(pg)
                e = self._by_group[(pg, op)] = self._entry(axis, op, n)
                e.via = via
            if recv:
                e.recv_count += 1
                e.recv_bytes += payload
            else:
                e.count += 1
                e.payload_bytes += payload
            seen = e.count + e.recv_count
        if seen <= self.time_first or self.time_every == 1:
            return (self, e, 1.0)
        if self._rng.random() * self.time_every < 1.0:
            return (self, e, float(self.time_every))
        return None

    # ------------------------------------------------------------------ results
    def local_entries(self) -> list[dict[str, Any]]:
        """This rank's entries as plain dicts (sorted by axis, op)."""
        with self._lock:
            return [self.entries[k].to_dict() for k in sorted(self.entries)]

    def report(self, expected: Any = None, steps: int | None = None,
               group: Any = None) -> CommReport:
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


def ledger_for(enabled: bool, mesh: Any = None) -> Ledger | _Null:
    """A Ledger when ``enabled``, else a no-op context manager (so callers need no if/else)."""
    return Ledger(mesh) if enabled else _Null()


class _Null:
    """The ledger-off stand-in: entering it does nothing at all."""

    active = False

    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None
