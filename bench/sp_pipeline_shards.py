"""What a pipeline stage sends under sequence parallelism, and what a step costs.

    PYTHONPATH=<plait tree> OMP_NUM_THREADS=1 python bench/sp_pipeline_shards.py \
        [--models mlp llama] [--width 256] [--seq 256] [--batch 8] [--steps 6]

Trains each model under ``pp=2,tp=2,microbatches=2`` with and without ``sp=1`` (4 CPU
processes on gloo, fp32, SGD) with the comm ledger on, and prints per layout the median step
time and, per step of the busiest rank, the bytes of the pipeline's sends (``pp send_recv``)
and of tp's all-gathers, beside the ledger's prediction (its ratio), and the sp=1 / sp=0
ratios. Models: ``mlp``, residual pre-norm MLP blocks written here (their tensor-parallel plan
is inferred); ``llama``, a Hugging Face Llama built from a config (transformers' plan, SP inside
the layer stack). Run it against two trees (PYTHONPATH) to compare them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 512


class Block(nn.Module):
    """x + down(gelu(up(norm(x))))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPLM(nn.Module):
    """Embedding, 4 blocks, final norm, head."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(4))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class Logits(nn.Module):
    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens).logits


def build(name: str, width: int, seq: int) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return MLPLM(width)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=4 * width,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=seq)
    return Logits(LlamaForCausalLM(cfg))


def worker(rank: int, world_size: int, plan: str, name: str, width: int, seq: int, batch: int,
           steps: int) -> dict[str, Any]:
    import plait
    from plait.runtime import init

    torch.set_num_threads(1)
    run = init(plan, quiet=True, ledger=True)
    run.ledger_warmup = 2
    try:
        model = run.parallelize(build(name, width, seq))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(0)

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

        times = []
        for _ in range(2 + steps):
            tokens = torch.randint(0, VOCAB, (batch, seq), generator=gen)
            start = time.perf_counter()
            run.step(model, (tokens, tokens.roll(-1, 1)), loss_fn, opt)
            times.append(time.perf_counter() - start)
        rows = {f"{r['axis']} {r['op']}": (r["payload_bytes"], r["count"], r["ratio"])
                for r in run.summary()["comm"]["rows"]}
        return {"step_s": statistics.median(times[2:]), "rows": rows, "plait": plait.__file__}
    finally:
        run.close()


def main() -> None:
    from plait.spawn import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "llama"])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    plans = ["pp=2,tp=2,microbatches=2", "pp=2,tp=2,sp=1,microbatches=2"]
    print(f"width {args.width}, seq {args.seq}, batch {args.batch}, fp32, median of "
          f"{args.steps} steps after 2")
    for name in args.models:
        got = {}
        for plan in plans:
            got[plan] = run_distributed(worker, 4, plan, name, args.width, args.seq,
                                        args.batch, args.steps, timeout=900)[0]
        print(f"\n{name} (plait from {got[plans[0]]['plait']})")
        print(f"  {'':34} {'step s':>8} {'pp send_recv B':>15} {'ratio':>6} "
              f"{'tp all_gather B':>16} {'ratio':>6}")
        for plan in plans:
            r = got[plan]
            pp = r["rows"].get("pp send_recv", (0.0, 0, 0.0))
            ag = r["rows"].get("tp all_gather", (0.0, 0, 0.0))
            print(f"  {plan:34} {r['step_s']:8.3f} {pp[0]:15.0f} {pp[2]:6.3f} {ag[0]:16.0f} "
                  f"{ag[2]:6.3f}")
        off, on = (got[p] for p in plans)
        pp_off = off["rows"].get("pp send_recv", (0.0,))[0]
        pp_on = on["rows"].get("pp send_recv", (0.0,))[0]
        print(f"  sp=1 / sp=0: step time {on['step_s'] / off['step_s']:.3f}, "
              f"pp bytes {pp_on / pp_off:.3f}")


if __name__ == "__main__":
    main()
