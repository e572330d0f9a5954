"""Ledger on vs off: step time ratio (target < 1.02).

Runs the reference model under DDP, FSDP2 (ZeRO-3) and TP on 2 gloo ranks and times training
steps with the ledger on and off, interleaved (on, off, on, off, ...) so machine noise hits both
alike; prints the median step time of each and their ratio.

    PYTHONPATH=. python bench/comm_overhead.py [--model tiny] [--steps 20] [--layouts ddp,fsdp,tp]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _worker(rank: int, world: int, layout: str, model_name: str, steps: int, batch: int,
            seq: int) -> dict:
    import torch.distributed as dist

    from plait.comm.ledger import Ledger
    from plait.mesh import build_mesh
    from plait.models import transformer as tfm
    from plait.plan import Plan

    model = tfm.build(tfm.preset(model_name, max_seq_len=seq))
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        mesh = build_mesh(Plan(dp_replicate=world), "cpu", world)
        model = DDP(model, process_group=mesh["dp_replicate"].get_group())
    elif layout == "fsdp":
        from torch.distributed.fsdp import fully_shard
        mesh = build_mesh(Plan(dp_shard=world, zero=3), "cpu", world)
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    elif layout == "tp":
        from plait.comm._layouts import tp_plan  # the Megatron layout the ledger tests use
        from torch.distributed.tensor.parallel import parallelize_module
        mesh = build_mesh(Plan(tp=world), "cpu", world)
        model = parallelize_module(model, mesh["tp"], tp_plan(model.config.n_layers, False))
    else:
        raise ValueError(f"unknown layout {layout!r}")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)
    g = torch.Generator().manual_seed(rank if layout != "tp" else 0)
    x = torch.randint(0, model_cfg_vocab(model), (batch, seq + 1), generator=g)
    ledger = Ledger(mesh)

    def step():
        loss = tfm.lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    on, off = [], []
    for i in range(2 * steps):
        dist.barrier()
        t0 = time.perf_counter()
        if i % 2 == 0:
            with ledger:
                step()
        else:
            step()
        (on if i % 2 == 0 else off).append(time.perf_counter() - t0)
    calls = sum(e["count"] + e["recv_count"] for e in ledger.local_entries()) / steps
    del model
    return {"on": on, "off": off, "calls": calls}


def model_cfg_vocab(model) -> int:
    inner = getattr(model, "module", model)
    return inner.config.vocab_size


def main(argv: list[str] | None = None) -> int:
    from plait.spawn import run_distributed
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layouts", default="ddp,fsdp,tp")
    args = p.parse_args(argv)
    print(f"{'layout':8} {'calls/step':>10} {'off ms':>8} {'on ms':>8} {'on/off':>7}")
    for layout in args.layouts.split(","):
        res = run_distributed(_worker, 2, layout, args.model, args.steps, args.batch, args.seq,
                              timeout=900)
        # The step is as slow as its slowest rank.
        on = statistics.median(max(r["on"][i] for r in res) for i in range(args.steps))
        off = statistics.median(max(r["off"][i] for r in res) for i in range(args.steps))
        print(f"{layout:8} {res[0]['calls']:>10.0f} {off * 1e3:>8.2f} {on * 1e3:>8.2f} "
              f"{on / off:>7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
