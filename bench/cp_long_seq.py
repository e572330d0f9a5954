"""Context parallelism at long sequences: step time and activation memory per rank, one device
vs cp=2 vs dp=2, side by side.

    PYTHONPATH=. python bench/cp_long_seq.py                       # seq 512, 1024, 2048
    PYTHONPATH=. python bench/cp_long_seq.py --seqs 1024,4096 --format json
    PYTHONPATH=. python bench/cp_long_seq.py --smoke               # tiny, 2 steps, no timing

The same global batch (``--batch`` sequences of ``--seq`` tokens) of plait's reference
transformer (``plait.models.transformer``: rotary, grouped-query attention, SwiGLU) trains with
AdamW under three layouts, each in fresh processes:

* ``one``: one process, the whole batch;
* ``cp=2``: two processes, each holding half of every sequence (head and tail chunks): its
  activations are those of ``batch x seq/2`` tokens plus, per attention block, the gathered
  keys and values and the ``(seq/2) x seq`` mask;
* ``dp=2``: two processes, half of the sequences each: the same process count and tokens per
  rank as cp=2, moving no activations; the baseline cp must beat on memory to be worth it.

Per layout, on rank 0 (every rank holds the same amount under all three):

* ``saved``: bytes of the tensors autograd saves for backward during one step's forward (a
  ``saved_tensors_hooks`` pack hook; storages counted once, parameters left out): the
  activation memory of the step, exact, independent of the allocator;
* ``RSS steps``: peak resident memory during the timed steps above the process's RSS before
  the model was built (a 5 ms sampler, as ``bench/zero_memory.py``); the allocator's view,
  including attention's transient score matrices (the CPU's SDPA math path materialises
  ``heads x (seq/cp) x seq`` of them per block under cp's boolean mask);
* median step time (steps after the first).

Ratios are to ``one``. Below the table: what cp=2 saves beyond dp=2 (the same tokens per rank)
beside its closed form. On a CPU that is mostly the mask: SDPA keeps an fp32 additive copy of
cp's boolean ``(seq/cp) x seq`` mask per block for backward (4 bytes per element per block,
not 1 per step), which grows as seq squared and overtakes the gathered K/V past ~1k tokens.
Two processes share two cores here, so a world-2 step is not expected to be 2x faster than
one process on one core; times carry +-10-20% noise on a loaded machine: compare ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from zero_memory import RssSampler

from plait.memory import current_rss
from plait.plan import Plan
from plait.spawn import run_distributed

LAYOUTS = [("one", "dp=1"), ("cp=2", "cp=2"), ("dp=2", "dp=2")]


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while inside, parameters
    excluded: the step's activation memory, read off the autograd graph rather than the
    allocator (which pools and fragments)."""

    def __init__(self, model: torch.nn.Module):
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.skip:
            self.seen[ptr] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def worker(rank: int, world_size: int, plan: Plan, args: dict[str, Any]) -> dict[str, Any]:
    from plait.models.transformer import TransformerConfig, build, lm_loss
    from plait.runtime import init

    run = init(plan, seed=0, quiet=True, log_every=10**9)
    baseline = current_rss()
    seq = args["seq"]
    cfg = TransformerConfig(dim=args["dim"], n_layers=args["layers"], n_heads=args["heads"],
                            n_kv_heads=args["kv_heads"], max_seq_len=seq)
    model = run.parallelize(build(cfg, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    local = args["batch"] // run.dp_size

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab_size, (args["batch"], seq + 1), generator=g)
        tokens = tokens[run.dp_rank * local:(run.dp_rank + 1) * local]
        return tokens[:, :-1], tokens[:, 1:]

    times, losses = [], []
    with RssSampler() as sampler:
        for _ in range(args["steps"]):
            data = batch()
            start = time.perf_counter()
            losses.append(float(run.step(model, data, lm_loss, opt)))
            times.append(time.perf_counter() - start)
    saved = SavedBytes(model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        losses.append(float(run.step(model, batch(), lm_loss, opt)))
    run.close()
    return {"step_s": statistics.median(times[1:] or times), "saved": saved.total,
            "rss_steps": sampler.peak - baseline, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="512,1024,2048", help="comma list of sequence lengths")
    parser.add_argument("--batch", type=int, default=2, help="global batch (sequences)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps (the first is not "
                        "counted), then one more with the saved-tensor hook")
    parser.add_argument("--only", default=None, help="comma list of layouts (one,cp=2,dp=2)")
    parser.add_argument("--smoke", action="store_true",
                        help="seq 64, a 2-block model, 2 steps: checks it runs, times mean nothing")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    args = parser.parse_args()
    if args.smoke:
        args.seqs, args.dim, args.layers, args.heads, args.kv_heads, args.steps = \
            "64", 32, 2, 4, 2, 2
    layouts = [lay for lay in LAYOUTS if not args.only or lay[0] in args.only.split(",")]
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        params = {**vars(args), "seq": seq}
        for name, plan_text in layouts:
            plan = Plan.from_string(plan_text)
            out = run_distributed(worker, plan.world_size, plan, params, timeout=1800)[0]
            rows.append({"seq": seq, "layout": name, "plan": plan_text, **out})
            if args.format == "text":
                print(f"  seq {seq} {name}: {out['step_s']:.3f} s/step", flush=True)
    for r in rows:
        one = next((o for o in rows if o["seq"] == r["seq"] and o["layout"] == "one"), None)
        for key in ("step_s", "saved", "rss_steps"):
            r[f"{key}_vs_one"] = r[key] / one[key] if one and one[key] > 0 else None
    for r in rows:
        dp = next((o for o in rows if o["seq"] == r["seq"] and o["layout"] == "dp=2"), None)
        if r["layout"] == "cp=2" and dp:
            r["saved_beyond_dp"] = r["saved"] - dp["saved"]
            r["saved_beyond_dp_closed_form"] = sum(extra_saved(args, r["seq"]))
    if args.format == "json":
        print(json.dumps({"args": vars(args), "rows": rows}, indent=2))
        return
    mb = 2**20
    print(f"\nreference transformer dim {args.dim}, {args.layers} blocks, {args.heads} heads "
          f"({args.kv_heads} kv), global batch {args.batch}, AdamW, fp32; per rank 0")
    print(f"{'seq':>6} {'layout':<6}{'saved':>11}{'vs one':>8}{'RSS steps':>12}{'vs one':>8}"
          f"{'s/step':>9}{'vs one':>8}")
    for r in rows:
        print(f"{r['seq']:>6} {r['layout']:<6}{r['saved'] / mb:>7,.1f} MiB{_x(r['saved_vs_one'])}"
              f"{r['rss_steps'] / mb:>8,.0f} MiB{_x(r['rss_steps_vs_one'])}"
              f"{r['step_s']:>9.3f}{_x(r['step_s_vs_one'])}")
    print("\ncp=2 saves beyond dp=2 (the same tokens per rank), against its closed form: per "
          "block, the (seq/2) x seq mask as the fp32 additive mask SDPA keeps for backward, "
          "and K and V of all sequences at the kv heads' width where dp=2 keeps its own half")
    for seq in sorted({r["seq"] for r in rows}):
        cp = next((r for r in rows if r["seq"] == seq and r["layout"] == "cp=2"), None)
        dp = next((r for r in rows if r["seq"] == seq and r["layout"] == "dp=2"), None)
        if cp and dp:
            mask, kv = extra_saved(args, seq)
            print(f"{seq:>6}: {(cp['saved'] - dp['saved']) / mb:>8.2f} MiB measured, "
                  f"closed form {(mask + kv) / mb:.2f} MiB (mask {mask / mb:.2f} + K/V "
                  f"{kv / mb:.2f})")


def extra_saved(args: argparse.Namespace, seq: int) -> tuple[int, int]:
    """Bytes cp=2 saves for backward beyond dp=2 (fp32): every block's float copy of the
    ``(seq/2) x seq`` mask, and its K and V over all ``--batch`` sequences at the kv heads'
    width, where a dp=2 rank saves them for its half of the sequences."""
    kv_dim = args.kv_heads * (args.dim // args.heads)
    mask = args.layers * (seq // 2) * seq * 4
    kv = args.layers * 2 * (args.batch - args.batch // 2) * seq * kv_dim * 4
    return mask, kv


def _x(v: float | None) -> str:
    return f"{'-':>8}" if v is None else f"{v:>7.2f}x"


if __name__ == "__main__":
    main()
