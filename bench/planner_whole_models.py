"""How far the planner's prices for models without blocks (a ResNet, an LSTM) are from this CPU.

    python bench/planner_whole_models.py [--world 2] [--steps 12] [--batch 32] [--cluster cpu]
                                         [--stat median|min]

For each data-parallel layout the planner ranks for the ResNet and the LSTM language model of
tests/_any_models.py (DDP, ZeRO-1/2/3; sync_bn for the ResNet's BatchNorm), train a few steps
through plait's runtime (plait.init / run.parallelize / run.step, gloo, ``--world`` processes)
with the ledger on, and print beside the prediction: step time (median of the steps after two
warm-up steps), bytes per step as the ledger measured them (payload per rank, all axes) and
the collective calls, with ratios measured / predicted. The bytes are the ledger's own formula
applied to measured facts of the model, so they should match to the byte; the times rest on
the cluster profile (``--cluster``: a preset, or the YAML ``plait plan --calibrate`` writes),
whose compute efficiency was fitted on transformer matmuls, not convolutions or LSTM cells,
and whose per-op host time (``op_latency_us``) the pricing charges for each aten op of a
forward, backward and optimizer update. A last row per model runs DDP at grad_accum=2 (not in
the ranking: the search gives grad_accum only where nothing fits without it).

Then the parts of one rank's step, timed in this process with nothing else of plait around
them: forward + backward on the rank's rows beside the prediction's FLOP time plus its ops'
host time, and plait's update (``plait.train.apply_update``) beside the update's ops' host
time; and the same forward + backward on ``--world`` processes at once with no collective
between them, which is what ranks sharing the machine's cores do to each other's compute.

Each prediction is printed twice: ``flops``, the compute priced from FLOPs at the profile's
efficiency plus its aten ops' host time, and ``timed``, the model's own forward + backward
timed in this process at each layout's per-rank batch (``plait plan --time-model``), which the
planner uses only where ``--cluster`` is a profile calibrated on this machine (else the two
columns are equal and the header says why). Both are priced against the same measured runs.

``--stat min`` reports the fastest step instead of the median: on a machine shared with
other jobs a timing is only ever inflated, so the least disturbed one is the closest to the
machine's own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plait.plan import Plan
from plait.planner import constants_for, load_cluster
from plait.planner.model_timing import factory_timer, is_this_machine
from plait.planner.whole_model import estimate, from_factory, rank

MODELS = ("resnet", "lstm_lm")


def worker(rank_: int, world: int, name: str, plan: str, batch: int, steps: int) -> dict:
    """Train factory ``name`` under ``plan``: per-step seconds and the ledger's bytes."""
    import torch
    from torch.utils.data import default_collate

    from plait.runtime import init
    from tests import _any_models as A

    torch.manual_seed(0)
    model, data, loss_fn = getattr(A, name)()
    run = init(plan, quiet=True, ledger=True)
    run.ledger_warmup = 2
    try:
        model = run.parallelize(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        per = batch // run.dp_size
        times = []
        for step in range(steps):
            rows = default_collate([data[(step * batch + i) % len(data)] for i in range(batch)])
            mine = [t[run.dp_rank * per:(run.dp_rank + 1) * per] for t in rows]
            start = time.perf_counter()
            run.step(model, mine, loss_fn, opt)
            times.append(time.perf_counter() - start)
        comm = run.summary()["comm"]
    finally:
        run.close()
    return {"times": times[2:], "comm": comm}


def time_parts(name: str, rows: int, steps: int, pick: Any) -> dict[str, float]:
    """Seconds of forward + backward (loss included) on ``rows`` rows of factory ``name``, and
    of plait's update over its parameters, in this process (one thread, no process group)."""
    import torch
    from torch.utils.data import default_collate

    from plait.plan import Plan
    from plait.train import apply_update
    from tests import _any_models as A

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, data, loss_fn = getattr(A, name)()
    x, y = default_collate([data[i % len(data)] for i in range(rows)])
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    totals = torch.tensor([1.0, float(rows)])
    fb, up = [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss_fn(model(x), y).backward()
        middle = time.perf_counter()
        apply_update(opt, totals, plan=Plan())
        fb.append(middle - start)
        up.append(time.perf_counter() - middle)
    return {"forward_backward": pick(fb[2:]), "update": pick(up[2:])}


def parts_worker(rank_: int, world: int, name: str, rows: int, steps: int, stat: str
                 ) -> dict[str, float]:
    """:func:`time_parts` on every rank at once, no collective between them: what the ranks
    sharing this machine's cores do to each other's compute."""
    return time_parts(name, rows, steps, statistics.median if stat == "median" else min)


def measured_bytes(comm: dict) -> tuple[float, float]:
    """(payload bytes per rank per step, collective calls per step) over the ledger's rows."""
    rows = comm.get("rows") or []
    return (sum(r["payload_bytes"] for r in rows), sum(r["count"] for r in rows))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--cluster", default="cpu")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="the step time reported: median or fastest of the timed steps")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from plait.spawn import run_distributed

    pick = statistics.median if args.stat == "median" else min
    cluster = load_cluster(args.cluster, devices=args.world)
    constants = constants_for(cluster)
    here, why = is_this_machine(cluster)
    out = []
    print(f"{args.world} x {cluster.name} (gloo), global batch {args.batch}, "
          f"{args.steps - 2} timed steps ({args.stat}); ratio = measured / predicted; "
          f"flops: compute priced from FLOPs and aten ops; timed: the model's forward + "
          f"backward timed in this process (plait plan --time-model)"
          + ("" if here else f"; not timed: {why}"))
    print(f"{'model':8} {'layout':34} {'flops ms':>8} {'timed ms':>8} {'meas ms':>8} "
          f"{'ratio':>6} {'ratio':>6}  {'pred KiB':>9} {'meas KiB':>9} {'ratio':>6}  calls")
    print(f"{'':8} {'':34} {'':>8} {'':>8} {'':>8} {'flops':>6} {'timed':>6}")
    for name in MODELS:
        spec = f"tests._any_models:{name}"
        whole, _ = from_factory(spec)
        timer = factory_timer(spec, whole.saved_per_sample, cluster) if here else None
        result = rank(whole, cluster, args.batch, dtype="fp32", c=constants, top=0)
        # and DDP at grad_accum=2: two micro-steps of half the rows, one gradient reduction
        accum = Plan(dp_replicate=args.world, sync_bn=bool(whole.batchnorm), grad_accum=2)
        accumulated = estimate(whole, accum, cluster, args.batch, constants)
        for est in result.ranked + ([accumulated] if accumulated.feasible else []):
            plan = est.plan.to_string()
            timed = estimate(whole, est.plan, cluster, args.batch, constants, timer)
            got = run_distributed(worker, args.world, name, plan, args.batch, args.steps,
                                  timeout=600)[0]
            step = pick(got["times"])
            wire = sum(t.payload for t in est.traffic)
            meas, calls = measured_bytes(got["comm"])
            row = {"model": name, "plan": plan, "predicted_s": est.step_time_s,
                   "predicted_timed_s": timed.step_time_s, "measured_s": step,
                   "time_ratio": step / est.step_time_s,
                   "time_ratio_timed": step / timed.step_time_s,
                   "compute_from": timed.compute_from,
                   "predicted_payload_bytes": wire, "measured_payload_bytes": meas,
                   "bytes_ratio": meas / wire if wire else None,
                   "predicted_calls": sum(t.calls for t in est.traffic),
                   "measured_calls": calls, "time_breakdown": est.time_breakdown,
                   "time_breakdown_timed": timed.time_breakdown}
            out.append(row)
            ratio = f"{row['bytes_ratio']:.3f}" if row["bytes_ratio"] else "-"
            print(f"{name:8} {est.plan.describe():34} {est.step_time_s * 1e3:8.2f} "
                  f"{timed.step_time_s * 1e3:8.2f} {step * 1e3:8.2f} "
                  f"{row['time_ratio']:6.2f} {row['time_ratio_timed']:6.2f}  "
                  f"{wire / 1024:9.1f} {meas / 1024:9.1f} {ratio:>6}  "
                  f"{calls:g}/{row['predicted_calls']}", flush=True)
    # The compute alone: one process on one rank's rows, beside the prediction's compute and
    # optimizer terms (what the step would be without any collective).
    per_rank = args.batch // args.world
    single = load_cluster(args.cluster, devices=1)
    for name in MODELS:
        spec = f"tests._any_models:{name}"
        whole, _ = from_factory(spec)
        k = constants_for(single)
        est = rank(whole, single, per_rank, dtype="fp32", c=k, top=1).best
        timer = factory_timer(spec, whole.saved_per_sample, single) if here else None
        timed = estimate(whole, est.plan, single, per_rank, k, timer)
        got = run_distributed(worker, 1, name, "dp=1", per_rank, args.steps, timeout=600)[0]
        step = pick(got["times"])
        tb, tt = est.time_breakdown, timed.time_breakdown
        out.append({"model": name, "plan": "single", "predicted_s": est.step_time_s,
                    "predicted_timed_s": timed.step_time_s,
                    "measured_s": step, "time_ratio": step / est.step_time_s,
                    "time_ratio_timed": step / timed.step_time_s,
                    "predicted_payload_bytes": 0.0, "measured_payload_bytes": 0.0,
                    "bytes_ratio": None, "predicted_calls": 0, "measured_calls": 0,
                    "time_breakdown": est.time_breakdown})
        print(f"{name:8} {'1 process, ' + str(per_rank) + ' rows':34} "
              f"{est.step_time_s * 1e3:8.2f} {timed.step_time_s * 1e3:8.2f} {step * 1e3:8.2f} "
              f"{step / est.step_time_s:6.2f} {step / timed.step_time_s:6.2f}  "
              f"(compute and optimizer alone)", flush=True)
        parts = time_parts(name, per_rank, args.steps, pick)
        ops = tb.get("dispatch", 0.0)
        fb = parts["forward_backward"]
        print(f"{name:8} {'  forward + backward':34} {tb['compute'] * 1e3:8.2f} "
              f"{tt['compute'] * 1e3:8.2f} {fb * 1e3:8.2f} {fb / tb['compute']:6.2f} "
              f"{fb / tt['compute']:6.2f}  (flops: FLOPs {(tb['compute'] - ops) * 1e3:.2f} ms "
              f"+ ops' host time {ops * 1e3:.2f} ms; timed: {timed.compute_from})")
        print(f"{name:8} {'  update (clip, AdamW)':34} {tb['optimizer'] * 1e3:8.2f} "
              f"{tt['optimizer'] * 1e3:8.2f} {parts['update'] * 1e3:8.2f} "
              f"{parts['update'] / tb['optimizer']:6.2f} {parts['update'] / tt['optimizer']:6.2f}",
              flush=True)
        together = run_distributed(parts_worker, args.world, name, per_rank, args.steps,
                                   args.stat, timeout=600)
        both = max(r["forward_backward"] for r in together)
        print(f"{name:8} {'  ' + str(args.world) + ' processes at once':34} "
              f"{tb['compute'] * 1e3:8.2f} {tt['compute'] * 1e3:8.2f} {both * 1e3:8.2f} "
              f"{both / tb['compute']:6.2f} {both / tt['compute']:6.2f}  (forward + backward "
              f"on each of {args.world} processes, no collective: the slowest; "
              f"{both / fb:.2f}x one process alone)", flush=True)
        parts["forward_backward_together"] = both
        out.append({"model": name, "plan": "parts", "predicted": {
            "forward_backward_s": tb["compute"], "update_s": tb["optimizer"]},
            "predicted_timed": {"forward_backward_s": tt["compute"],
                                "update_s": tt["optimizer"]},
            "measured": parts})
    ranks = {}
    for name in MODELS:
        rows = [r for r in out if r["model"] == name and r["plan"] not in ("single", "parts")
                and "grad_accum" not in r["plan"]]
        by_pred = sorted(rows, key=lambda r: r["predicted_s"])
        by_meas = sorted(rows, key=lambda r: r["measured_s"])
        ranks[name] = {"predicted_order": [r["plan"] for r in by_pred],
                       "measured_order": [r["plan"] for r in by_meas]}
        print(f"{name}: predicted order {' > '.join(r['plan'] for r in by_pred)}")
        print(f"{name}: measured order  {' > '.join(r['plan'] for r in by_meas)}")
        by_timed = sorted(rows, key=lambda r: r["predicted_timed_s"])
        ranks[name]["predicted_timed_order"] = [r["plan"] for r in by_timed]
        print(f"{name}: timed order     {' > '.join(r['plan'] for r in by_timed)}")
    layouts = [r for r in out if r["plan"] not in ("single", "parts")]
    ratios = sorted({round(r["bytes_ratio"] or 0, 3) for r in layouts})
    for label, key in (("flops", "time_ratio"), ("timed", "time_ratio_timed")):
        errors = [abs(r[key] - 1) for r in layouts]
        print(f"{label}: median |time error| {statistics.median(errors):.0%}, worst "
              f"{max(errors):.0%}")
    print(f"bytes ratios {ratios}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": out, "order": ranks}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
