"""plait's DDP step vs a hand-written DistributedDataParallel loop: same model, data, world.

Both run in the same processes, interleaved in rounds (plait, raw, plait, raw, ...) so machine
noise hits both alike; the figure is the median per-step time ratio plait / raw. Target <= 1.02.

    python bench/ddp_overhead.py [--nproc 2] [--model tiny] [--rounds 6] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import plait
from plait.data import TextDataset
from plait.data.loader import DistributedLoader
from plait.models.transformer import build, lm_loss, preset
from plait.spawn import run_distributed


def worker(rank: int, world: int, model_name: str, rounds: int, steps: int, batch: int,
           seq: int) -> dict[str, list[float]]:
    run = plait.init(f"dp={world}", quiet=True, log_every=10**9)
    cfg = preset(model_name, max_seq_len=seq)
    ours = run.parallelize(build(cfg, seed=0))
    raw = DDP(build(cfg, seed=0))
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    opt_raw = torch.optim.AdamW(raw.parameters(), lr=1e-3)
    loader = DistributedLoader(TextDataset(seq_len=seq), batch, dp_rank=rank, dp_size=world)
    times: dict[str, list[float]] = {"plait": [], "raw": []}

    def raw_step(model, x, y):
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt_raw.step()
        opt_raw.zero_grad(set_to_none=True)

    step = 0
    for r in range(rounds + 1):  # round 0 warms both up and is discarded
        for name in ("plait", "raw") if r % 2 else ("raw", "plait"):
            for _ in range(steps):
                x, y = loader.batch(step)
                step += 1
                torch.distributed.barrier()
                t0 = time.perf_counter()
                if name == "plait":
                    run.step(ours, (x, y), lm_loss, opt_ours)
                else:
                    raw_step(raw, x, y)
                if r:
                    times[name].append(time.perf_counter() - t0)
    del raw, ours
    run.close()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="tiny")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    a = p.parse_args()
    out = run_distributed(worker, a.nproc, a.model, a.rounds, a.steps, a.batch_size, a.seq_len,
                          timeout=1800)
    ours = statistics.median(out[0]["plait"])
    raw = statistics.median(out[0]["raw"])
    print(f"DDP step, {a.model} model, world {a.nproc}, global batch {a.batch_size}x{a.seq_len}, "
          f"{a.rounds} interleaved rounds of {a.steps} steps")
    print(f"{'':>8} {'median ms/step':>15}")
    print(f"{'raw DDP':>8} {1000 * raw:>15.2f}")
    print(f"{'plait':>8} {1000 * ours:>15.2f}")
    print(f"ratio plait/raw = {ours / raw:.3f}  (target <= 1.02)")


if __name__ == "__main__":
    main()
