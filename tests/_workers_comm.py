"""Multi-process workers for the communication tests (module-level so spawn can import them).

The exact-bytes tests train through plait's own runtime, via ``plait comm``'s worker
(``plait.comm.cli.comm_worker``: ``plait.init(plan, ledger=True)``, ``run.parallelize``,
``run.step``), so the ledger covers exactly what plait issues.
"""

from __future__ import annotations

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
