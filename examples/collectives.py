"""Each collective on 4 ranks, with the tensors before and after: the teaching version.

    PYTHONPATH=. python examples/collectives.py        # 4 local CPU processes (gloo)

Rank r starts with small tensors holding r's number so you can follow where each value goes.
Bytes are per volumes.py: "payload" is the full buffer, "wire" what a ring sends per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

WORLD = 4


# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor to all_gather_single and
# reduce_scatter_single (the old names now warn); older torch has only the old ones.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def show(rank: int, lines: list, name: str, before: torch.Tensor, after: torch.Tensor) -> None:
    lines.append((name, rank, before.tolist(), after.tolist()))


def demo(rank: int, world: int) -> list:
    from plait.comm.ledger import Ledger
    out: list = []
    ledger = Ledger()
    with ledger:
        # all-reduce: everyone ends with the sum of everyone's tensor.
        t = torch.full((2,), float(rank))
        b = t.clone()
        dist.all_reduce(t)
        show(rank, out, "all_reduce (sum)", b, t)

        # broadcast: rank 0's tensor is copied to every rank.
        t = torch.full((2,), float(rank))
        b = t.clone()
        dist.broadcast(t, src=0)
        show(rank, out, "broadcast (from 0)", b, t)

        # reduce: the sum lands on rank 0; the others are left with undefined scratch values.
        t = torch.full((2,), float(rank))
        b = t.clone()
        dist.reduce(t, dst=0)
        show(rank, out, "reduce (sum to 0; others: scratch)", b, t)

        # all-gather: each rank contributes one piece; everyone gets all pieces in rank order.
        piece = torch.tensor([float(rank)])
        full = torch.empty(world)
        all_gather(full, piece)
        show(rank, out, "all_gather", piece, full)

        # reduce-scatter: sum everyone's full tensor, rank r keeps the r-th piece of the sum.
        full = torch.arange(world, dtype=torch.float32) + 10 * rank
        piece = torch.empty(1)
        reduce_scatter(piece, full)
        show(rank, out, "reduce_scatter (sum)", full, piece)

        # all-to-all: rank r sends its j-th piece to rank j (a transpose across ranks).
        send = torch.arange(world, dtype=torch.float32) + 10 * rank
        recv = torch.empty(world)
        dist.all_to_all_single(recv, send)
        show(rank, out, "all_to_all", send, recv)

        # send/recv: a ring shift, rank r sends to r+1 and receives from r-1.
        send = torch.full((2,), float(rank))
        recv = torch.empty(2)
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world),
               dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        show(rank, out, "send_recv (ring shift)", send, recv)
    report = ledger.report()
    return [out, report.table() if rank == 0 else None]


def main() -> None:
    from plait.spawn import run_distributed
    results = run_distributed(demo, WORLD)
    names = [line[0] for line in results[0][0]]
    for i, name in enumerate(names):
        print(f"\n{name}")
        for rank, (lines, _) in enumerate(results):
            _, _, before, after = lines[i]
            print(f"  rank {rank}: {before!s:<24} -> {after}")
    print("\nWhat the ledger counted on each rank:")
    print(results[0][1])


if __name__ == "__main__":
    main()
