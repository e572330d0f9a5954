"""Per-call cost of the ledger's interception: microseconds per collective, ledger on vs off.

A training step issues tens to hundreds of collectives; what the ledger adds to each is what it
adds to the step. This measures it directly, on a tensor so small that the collective itself is
as cheap as it gets, for the three ways plait's strategies issue collectives:

* ``c10d``: ``dist.all_reduce(t)`` (DDP's reducer, FSDP2, clipping: the classic c10d ops);
* ``funcol``: ``funcol.all_reduce`` + ``wait_tensor`` (DTensor's TP/SP collectives);
* ``p2p``: ``batch_isend_irecv`` of one send and one recv, then ``wait`` (pipeline stages;
  gloo gives these no completion future, so the ledger times them to the wait).

Each case runs ``--rounds`` rounds of ``--calls`` calls on three sides, in ABBA order (off, bare,
on, on, bare, off, ...): ``off``, no kernel; ``bare``, a pass-through Python kernel on the same
ops (the floor of any Python-level interception); ``on``, the ledger. Per call it reports the
median over rounds (slowest rank) of off and of each side's paired difference to off, in wall
and CPU time, and the calls the ledger recorded (which must be exactly calls x rounds, plus the
bench's own: it checks).

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/ledger_percall.py [--nproc 2] [--calls 1000] \\
        [--rounds 8] [--time-every 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def _cases(rank: int, world: int) -> dict[str, Callable[[], Any]]:
    import torch.distributed as dist

    from plait._torch_compat import functional_collectives

    funcol = functional_collectives()

    t = torch.ones(4)
    group = dist.group.WORLD

    def c10d() -> None:
        dist.all_reduce(t)

    def functional() -> None:
        funcol.wait_tensor(funcol.all_reduce(t, "sum", group))

    send, recv = torch.ones(4), torch.empty(4)
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def p2p() -> None:
        ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    cases = {"c10d": c10d, "funcol": functional}
    if world > 1:
        cases["p2p"] = p2p
    return cases


def _timed(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call, slowest rank. CPU time is the whole process's (the
    ledger's completion callbacks run on gloo's threads) and, unlike wall time, does not grow
    while the rank waits for a core on a loaded machine."""
    import torch.distributed as dist
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    mine = torch.tensor([(time.perf_counter() - t0) / calls, (time.process_time() - c0) / calls],
                        dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine[0]), float(mine[1])


def _bare_kernels() -> Any:
    """A pass-through Python kernel on every op the ledger intercepts, registered the same way
    (BackendSelect, with keyset): the floor any Python-level interception pays, the
    dispatcher's call into Python, with none of the ledger's own work."""
    from plait._torch_compat import keyset_after_backend_select
    from plait.comm.ledger import _c10d_table
    after = keyset_after_backend_select()
    lib = torch.library.Library("c10d", "IMPL")
    for op in _c10d_table():
        def kernel(keyset: Any, *args: Any, _op: Any = op, **kwargs: Any) -> Any:
            return _op.redispatch(keyset & after, *args, **kwargs)
        lib.impl(op.name().split("::")[1], kernel, "BackendSelect", with_keyset=True)
    return lib


def worker(rank: int, world: int, calls: int, rounds: int, time_every: int) -> list[dict]:
    from plait._torch_compat import destroy_library
    from plait.comm.ledger import Ledger

    torch.set_num_threads(1)
    out = []
    for name, fn in _cases(rank, world).items():
        for _ in range(min(calls, 200)):  # warm up the op and the process group
            fn()
        ledger = Ledger(time_every=time_every)
        got: dict[str, list[tuple[float, float]]] = {"off": [], "bare": [], "on": []}
        for r in range(rounds):
            for side in ("off", "bare", "on") if r % 2 == 0 else ("on", "bare", "off"):
                if side == "off":
                    got["off"].append(_timed(fn, calls))
                elif side == "bare":
                    lib = _bare_kernels()
                    got["bare"].append(_timed(fn, calls))
                    destroy_library(lib)
                else:
                    ledger.install()  # as a run does: kernels stay installed across steps
                    with ledger:
                        got["on"].append(_timed(fn, calls))
                    ledger.uninstall()
        # The ledger also saw the two collectives of each _timed (barrier, the MAX all-reduce).
        recorded = sum(e["count"] + e["recv_count"] for e in ledger.local_entries()
                       if e["op"] != "barrier")
        expected = calls * rounds * (2 if name == "p2p" else 1) + rounds
        row = {"case": name, "recorded": recorded, "expected": expected}
        off = got["off"]
        for i, kind in enumerate(("wall", "cpu")):
            row[f"{kind}_off_us"] = statistics.median(x[i] for x in off) * 1e6
            for side in ("bare", "on"):
                row[f"{kind}_{side}_us"] = statistics.median(
                    a[i] - b[i] for a, b in zip(got[side], off, strict=True)) * 1e6
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    from plait.spawn import run_distributed
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--calls", type=int, default=1000, help="calls per measurement")
    p.add_argument("--rounds", type=int, default=8, help="ABBA rounds (even)")
    p.add_argument("--time-every", type=int, default=8,
                   help="Ledger(time_every=...): 1 times every call")
    args = p.parse_args(argv)
    if args.nproc < 1 or args.calls < 1 or args.rounds < 2:
        p.error("--nproc >= 1, --calls >= 1 and --rounds >= 2")
    rows = run_distributed(worker, args.nproc, args.calls, args.rounds, args.time_every,
                           timeout=1800)[0]
    print(f"us per call, median of {args.rounds} ABBA rounds of {args.calls} calls "
          f"(time_every={args.time_every}, {args.nproc} ranks); +bare = a pass-through Python "
          f"kernel alone, +ledger = the ledger on (both minus off, paired by round)")
    print(f"{'case':8} {'wall off':>9} {'+bare':>8} {'+ledger':>8} {'cpu off':>9} {'+bare':>8} "
          f"{'+ledger':>8} {'recorded':>9} {'expected':>9}")
    bad = False
    for r in rows:
        print(f"{r['case']:8} {r['wall_off_us']:>9.2f} {r['wall_bare_us']:>8.2f} "
              f"{r['wall_on_us']:>8.2f} {r['cpu_off_us']:>9.2f} {r['cpu_bare_us']:>8.2f} "
              f"{r['cpu_on_us']:>8.2f} {r['recorded']:>9} {r['expected']:>9}")
        bad |= r["recorded"] != r["expected"]
    if bad:
        print("error: the ledger did not record every call")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
