"""Tokens/s and MFU of a ~1B-parameter reference model in bf16 on one GPU.

MFU = model FLOPs per second / the chip's peak dense bf16 FLOP/s from plait's accelerator table
(``plait.accelerators.chips``). Model FLOPs per step come from the planner's count
(``plait.planner.load_model(cfg).model_flops``): 2 per matmul weight per token forward, the
s x s attention square, backward twice the forward (no recomputation counted), the output head
included, the embedding lookup not. Target: MFU >= 45% with ``torch.compile``.

The model trains through plait's own step (``plait.init`` with ``mixed_precision=bf16``: fp32
master weights, bf16 autocast; fused AdamW) with ``compile`` in the plan (each transformer
block compiled separately after the layout, as torchtitan does), so the figure is what a plait
user gets from ``--plan mixed_precision=bf16,compile``.

    python bench/mfu.py                          # llama-1b, seq 2048, batch 4, compiled
    python bench/mfu.py --no-compile             # eager, for the compile speed-up
    python bench/mfu.py --dry-run                # CPU: tiny model, 3 steps, the arithmetic only
    python bench/mfu.py --format json

Without a CUDA device (and without --dry-run) it prints why it skipped and exits 0, so
``make bench`` on a CPU machine passes over it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def train_flops(cfg, tokens: int, seq: int) -> float:
    """Training FLOPs of ``tokens`` tokens of length ``seq`` through ``cfg``'s model."""
    from plait.planner import load_model

    return load_model(cfg).model_flops(tokens, seq)


def mfu(flops_per_step: float, step_s: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the chip's peak."""
    return flops_per_step / step_s / peak


def measure(model_name: str, seq: int, batch: int, steps: int, warmup: int, compile_: bool,
            device_type: str) -> dict:
    import plait
    from plait.data import TextDataset
    from plait.models.transformer import build, lm_loss, preset

    cfg = preset(model_name, max_seq_len=seq)
    plan = [p for p, on in (("mixed_precision=bf16", device_type == "cuda"),
                            ("compile", compile_)) if on]
    run = plait.init(",".join(plan) or None, quiet=True, accelerator=device_type)
    model = run.parallelize(build(cfg, device=run.device, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device_type == "cuda")
    data = TextDataset(seq_len=seq)
    times = []
    for i, batch_ in enumerate(run.loader(data, batch_size=batch, steps=warmup + steps)):
        t0 = time.perf_counter()
        run.step(model, batch_, lm_loss, opt)  # synchronises the device before it returns
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    flops = train_flops(cfg, batch * seq, seq)
    peak = run.accelerator.peak_flops(torch.bfloat16 if device_type == "cuda" else torch.float32)
    peak_mem = (torch.cuda.max_memory_allocated(run.device) if device_type == "cuda" else None)
    out = {
        "model": model_name, "params": cfg.num_params(), "seq": seq, "batch": batch,
        "compile": compile_, "device": run.accelerator.device_name(),
        "dtype": "bf16" if device_type == "cuda" else "fp32",
        "steps_timed": len(times), "step_s": step_s, "tokens_per_s": batch * seq / step_s,
        "model_flops_per_step": flops, "achieved_tflops": flops / step_s / 1e12,
        "peak_tflops": peak / 1e12 if peak else None,
        "mfu": mfu(flops, step_s, peak) if peak else None,
        "peak_memory_bytes": peak_mem,
    }
    run.finish(print_summary=False)
    return out


def format_result(r: dict, target: float) -> str:
    lines = [f"MFU bench: {r['model']} ({r['params'] / 1e9:.2f}B parameters), seq {r['seq']}, "
             f"batch {r['batch']}, {r['dtype']}, compile={r['compile']}, on {r['device']}",
             f"step time      {1000 * r['step_s']:.1f} ms (median of {r['steps_timed']})",
             f"throughput     {r['tokens_per_s']:,.0f} tokens/s",
             f"model FLOPs    {r['achieved_tflops']:.1f} TFLOP/s achieved"]
    if r["mfu"] is not None:
        met = "met" if r["mfu"] >= target else "MISSED"
        lines.append(f"MFU            {100 * r['mfu']:.1f}% of {r['peak_tflops']:.0f} TFLOP/s "
                     f"peak (target >= {100 * target:.0f}%: {met})")
    else:
        lines.append("MFU            - (this chip is not in plait.accelerators.chips)")
    if r["peak_memory_bytes"]:
        lines.append(f"peak memory    {r['peak_memory_bytes'] / 2**30:.1f} GiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps not timed (compilation)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--target", type=float, default=0.45)
    p.add_argument("--dry-run", action="store_true",
                   help="on the CPU: the test model, 3 steps, no compile (checks the code path)")
    p.add_argument("--format", choices=["table", "json"], default="table")
    a = p.parse_args(argv)
    if a.dry_run:
        a.model, a.seq, a.batch, a.steps, a.warmup, a.compile = "test", 32, 4, 3, 1, False
        device_type = "cpu"
    elif not torch.cuda.is_available():
        print("mfu: skipped: no CUDA device (run it on a GPU machine; --dry-run checks the code "
              "path on the CPU)")
        return 0
    else:
        device_type = "cuda"
    r = measure(a.model, a.seq, a.batch, a.steps, a.warmup, a.compile, device_type)
    print(json.dumps(r, indent=2) if a.format == "json" else format_result(r, a.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
