"""Multi-process workers for the communication tests (module-level so spawn can import them).

The layouts here are built directly from torch's pieces (DDP, FSDP2 ``fully_shard``, DTensor
``parallelize_module``, ``torch.distributed.pipelining``) because plait's own parallelize is
being written at the same time; when it lands these should call ``plait.parallelize`` instead so
the ledger test covers exactly what plait issues.
"""

from __future__ import annotations

import torch

from plait.comm.ledger import Ledger
from plait.mesh import build_mesh
from plait.models import transformer as tfm
from plait.plan import Plan

MODEL = "test"
BATCH = 4
SEQ = 32
WARMUP = 2  # DDP rebuilds its buckets (and broadcasts the new order) in step 2
STEPS = 2


def batch(step: int, rank: int = 0, batch_size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, tfm.preset(MODEL).vocab_size, (batch_size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model, opt, ledger, rank, step_fn=None, expected=None):
    """WARMUP steps outside the ledger (lazy init, bucket rebuilds), then STEPS inside it."""
    def step(i):
        if step_fn is not None:
            return step_fn(i)
        x, y = batch(i, rank)
        loss = tfm.lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for i in range(WARMUP):
        step(i)
    for i in range(WARMUP, WARMUP + STEPS):
        with ledger:
            step(i)
    return ledger.report(expected=expected)


def ddp(rank: int, world: int, expected=None) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    mesh = build_mesh(Plan(dp_replicate=world), "cpu", world)
    model = DDP(tfm.build(MODEL), process_group=mesh["dp_replicate"].get_group())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report = _train(model, opt, Ledger(mesh), rank, expected=expected)
    del model
    return report.to_dict()


def fsdp(rank: int, world: int, expected=None) -> dict:
    from torch.distributed.fsdp import fully_shard
    mesh = build_mesh(Plan(dp_shard=world, zero=3), "cpu", world)
    model = tfm.build(MODEL)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report = _train(model, opt, Ledger(mesh), rank, expected=expected)
    del model
    return report.to_dict()


def tp_plan(sp: bool, n_layers: int | None = None) -> dict:
    from plait.comm._layouts import tp_plan as plan
    return plan(n_layers or tfm.preset(MODEL).n_layers, sp)


def tp(rank: int, world: int, sp: bool = False, expected=None) -> dict:
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = build_mesh(Plan(tp=world, sp=sp), "cpu", world)
    model = parallelize_module(tfm.build(MODEL), mesh["tp"], tp_plan(sp))
    # foreach=False: TP leaves some parameters plain and others DTensors (FIELD-NOTES).
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    # rank=0: every TP rank must see the same batch.
    report = _train(model, opt, Ledger(mesh), rank=0, expected=expected)
    del model
    return report.to_dict()


def pp(rank: int, world: int, microbatches: int = 2, expected=None) -> dict:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    mesh = build_mesh(Plan(pp=world, microbatches=microbatches, pp_schedule="gpipe"), "cpu",
                      world)
    model = tfm.build(MODEL)
    n = len(model.layers)
    per = n // world
    keep = set(range(rank * per, (rank + 1) * per))
    model.layers = torch.nn.ModuleList(b for i, b in enumerate(model.layers) if i in keep)
    if rank != 0:
        model.tok_embeddings = None
    if rank != world - 1:
        model.norm = None
        model.output = None
    stage = PipelineStage(model, rank, world, torch.device("cpu"),
                          group=mesh["pp"].get_group())
    sched = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=tfm.lm_loss)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i):
        x, y = batch(i)
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y)
        else:
            sched.step()
        opt.step()
        opt.zero_grad()

    report = _train(model, opt, Ledger(mesh), rank, step_fn=step, expected=expected)
    return report.to_dict()



def outside_block(rank: int, world: int) -> list[dict]:
    """One all-reduce inside the ledger, one before and one after: only the middle one counts."""
    import torch.distributed as dist
    ledger = Ledger()
    dist.all_reduce(torch.ones(2))
    with ledger:
        dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(8))
    return [{k: v for k, v in e.items() if k != "time_s"} for e in ledger.local_entries()]
