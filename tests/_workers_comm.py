"""Multi-process workers for the communication tests (module-level so spawn can import them).

The exact-bytes tests train through plait's own runtime, via ``plait comm``'s worker
(``plait.comm.cli.comm_worker``: ``plait.init(plan, ledger=True)``, ``run.parallelize``,
``run.step``), so the ledger covers exactly what plait issues.
"""

from __future__ import annotations

import contextlib
import io

import torch

from plait.comm.ledger import Ledger

MODEL = "test"
BATCH = 4  # per data replica
SEQ = 32
WARMUP = 2  # DDP rebuilds its buckets (and broadcasts the new order) in step 2
STEPS = 2


def outside_block(rank: int, world: int) -> list[dict]:
    """One all-reduce inside the ledger, one before and one after: only the middle one counts."""
    import torch.distributed as dist
    ledger = Ledger()
    dist.all_reduce(torch.ones(2))
    with ledger:
        dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(8))
    return [{k: v for k, v in e.items() if k != "time_s"} for e in ledger.local_entries()]


def futureless_times(rank: int, world: int, sizes: list[int], reps: int) -> dict:
    """gloo's send/recv and reduce-scatter return a Work without a completion future; the
    ledger times them to their wait. Per size: the ledger's time for ``reps`` ring shifts
    (batch_isend_irecv, as the pipeline schedules) and ``reps`` functional reduce-scatters (as
    sequence parallelism), and the same calls timed here from issue to wait without a ledger,
    interleaved call by call so that load hits both alike."""
    import time

    import torch.distributed as dist

    from plait._torch_compat import functional_collectives

    funcol = functional_collectives()

    group = dist.group.WORLD
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def shift(send: torch.Tensor, recv: torch.Tensor) -> None:
        ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def scatter(x: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(x, "sum", 0, group))

    out: dict = {"sizes": sizes}
    for size in sizes:
        send, recv = torch.full((size // 4,), float(rank)), torch.empty(size // 4)
        x = torch.ones(size // 4)
        shift(send, recv)
        scatter(x)  # first use of the pair / op: connection set-up, not timed
        ledger = Ledger(time_every=1)
        ledger.install()  # registering the kernels (once per run) is not what is timed
        raw = {"send_recv": 0.0, "reduce_scatter": 0.0}
        for _ in range(reps):
            dist.barrier()  # a rank's time includes waiting for its peer: start together
            with ledger:
                shift(send, recv)
                y = scatter(x)
            assert recv[0].item() == prv and torch.equal(y, torch.full_like(y, world))
            dist.barrier()
            t0 = time.perf_counter()
            shift(send, recv)
            raw["send_recv"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            scatter(x)
            raw["reduce_scatter"] += time.perf_counter() - t0
            dist.barrier()
        ledger.uninstall()
        rows = {e["op"]: e for e in ledger.local_entries()}
        out[size] = {op: {"time_s": rows[op]["time_s"], "raw_s": raw[op],
                          "count": rows[op]["count"], "recv_count": rows[op]["recv_count"],
                          "payload_bytes": rows[op]["payload_bytes"]}
                     for op in raw}
    return out


def sampled_counts(rank: int, world: int, calls: int, time_every: int) -> list[dict]:
    """Timing is sampled; counting is not: ``calls`` all-reduces of 16 bytes, all counted."""
    import torch.distributed as dist
    ledger = Ledger(time_every=time_every)
    t = torch.ones(4)
    with ledger:
        for _ in range(calls):
            dist.all_reduce(t)
    return ledger.local_entries()


def gate_order(rank: int, world: int) -> list[str]:
    """What runs, in order, around collectives while a gate is armed (as the watchdog's
    step-start check arms one): the gate before the first collective only, then never again
    until it is armed anew; nothing once the kernels are released."""
    import torch.distributed as dist

    from plait.comm.ledger import arm_gate, disarm_gate, hold_kernels, release_kernels

    events: list[str] = []

    def gate() -> None:
        disarm_gate(gate)
        events.append("gate")

    t = torch.ones(2)
    hold_kernels()
    arm_gate(gate)
    events.append("armed")
    dist.all_reduce(t)
    events.append("all_reduce")
    dist.all_reduce(t)
    events.append("all_reduce")
    arm_gate(gate)
    dist.barrier()
    events.append("barrier")
    release_kernels()
    arm_gate(gate)  # armed, but with no kernels installed nothing calls it
    dist.all_reduce(t)
    events.append("all_reduce")
    disarm_gate(gate)
    return events


def ledger_summary(rank: int, world: int, steps: int) -> str:
    """What ``run.finish()`` prints under ``plait.init(ledger=True)`` after ``steps`` steps
    (rank 0's text; the others print nothing)."""
    import plait
    from plait.data import TextDataset
    from plait.models.transformer import build, lm_loss

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run = plait.init(f"dp={world}", ledger=True, seed=0)
        model = run.parallelize(build(MODEL))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for batch in run.loader(TextDataset(seq_len=SEQ), batch_size=BATCH * world, steps=steps):
            run.step(model, batch, lm_loss, opt)
        run.finish()
    return out.getvalue()
