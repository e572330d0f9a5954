"""How far to trust the planner: published results, search speed, and measurement on this machine.

    python bench/planner_accuracy.py                # --published --speed (pure, seconds)
    python bench/planner_accuracy.py --calibrate    # + measure this machine, predicted vs measured

--published  Narayanan et al. 2021 table 1 (Megatron-LM GPT on DGX A100): plait's prediction at
             their layout vs their TFLOP/s per GPU (their FLOP formula), the one efficiency
             constant that zeroes the median error over all rows (the default is this value,
             rounded), and the planner's own pick for each model, cluster and batch.
--speed      search time for 175B on 1,024 and 16,384 A100s (targets < 1 s and < 10 s).
--calibrate  measure this CPU (plait.planner.cpu.probes), then time layouts of the small
             reference model at world 2 and 4 through plait's runtime (plait.init /
             run.parallelize / run.step: DDP, ZeRO-1/2/3, TP+SP, pipelines with 1f1b / gpipe /
             interleaved / zbv, their compositions), each layout in fresh processes of its own
             (as a user's job runs it), in interleaved rounds with a calibration job in each
             (median of rounds, warm-up discarded), and compare with the prediction: median
             absolute error (target <= 15%), Spearman rank correlation (>= 0.8), where the
             planner's pick among the measured layouts ranks (target: within 10% of the
             measured best), and the noise floor (spread of the rounds of one layout), which
             bounds what any model can reach.
--quick      --calibrate with fewer layouts and steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plait.planner import constants_for
from plait.planner.cost import DEFAULT_CONSTANTS, Constants, Workload, evaluate
from plait.planner.cpu.measured import (
    describe_constants,
    in_group_profile,
    layout_time,
    report_world,
)
from plait.planner.hardware import load_cluster, save_cluster
from plait.planner.model_stats import load_model
from plait.planner.published import NARAYANAN_2021, SEQ, VOCAB, megatron_flops, row_setup
from plait.planner.search import search


# ----------------------------------------------------------------------------- published
def predict_rows(constants: Constants):
    out = []
    for row in NARAYANAN_2021:
        model, cluster, work, plan = row_setup(row)
        e = evaluate(plan, model, cluster, work, constants)
        flops = megatron_flops(row.batch, SEQ, row.layers, row.hidden, VOCAB)
        tf = flops / e.step_time_s / row.gpus / 1e12 if e.feasible else float("nan")
        out.append((row, e, tf, flops))
    return out


def fit_efficiency() -> float:
    """The one compute efficiency that makes the median log error over the table zero."""
    lo, hi = 0.2, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        rows = predict_rows(dataclasses.replace(DEFAULT_CONSTANTS, compute_efficiency=mid))
        med = statistics.median(math.log(tf / r.tflops) for r, _, tf, _ in rows)
        lo, hi = (mid, hi) if med < 0 else (lo, mid)
    return (lo + hi) / 2


def published() -> dict:
    fitted = fit_efficiency()
    print(f"\n== Narayanan et al. 2021, table 1 (DGX A100 80GB, seq {SEQ}, vocab {VOCAB}) ==")
    print(f"compute efficiency: default {DEFAULT_CONSTANTS.compute_efficiency} (one constant, all "
          f"rows); the value zeroing the median error over the table is {fitted:.3f}")
    head = (f"{'model':>8} {'GPUs':>5} {'tp':>3} {'pp':>3} {'dp':>4} {'v':>2} {'batch':>5} "
            f"{'published':>9} {'predicted':>9} {'error':>7} {'bubble':>6} {'mem GiB':>7} | "
            f"{'planner pick':<58} {'pick/paper':>10}")
    print(head)
    print("-" * len(head))
    rows_out = []
    for row, e, tf, flops in predict_rows(DEFAULT_CONSTANTS):
        model, cluster, work, _ = row_setup(row)
        t0 = time.perf_counter()
        pick = search(model, cluster, work, dtype="bf16", top=1).best
        secs = time.perf_counter() - t0
        pick_tf = flops / pick.step_time_s / row.gpus / 1e12 if pick else float("nan")
        err = tf / row.tflops - 1
        print(f"{row.params_b:>7}B {row.gpus:>5} {row.tp:>3} {row.pp:>3} {row.dp:>4} "
              f"{e.plan.virtual_stages:>2} {row.batch:>5} {row.tflops:>9.0f} {tf:>9.1f} "
              f"{err:>+7.1%} {e.bubble_fraction:>6.1%} {e.memory_bytes_per_device / 2**30:>7.1f} | "
              f"{(pick.plan.describe() if pick else 'none')[:58]:<58} "
              f"{(e.step_time_s / pick.step_time_s if pick else float('nan')):>9.2f}x")
        rows_out.append({"params_b": row.params_b, "gpus": row.gpus, "published_tflops":
                         row.tflops, "predicted_tflops": tf, "error": err,
                         "pick": pick.plan.to_string() if pick else None,
                         "pick_speedup_over_paper_layout": e.step_time_s / pick.step_time_s,
                         "pick_formula_tflops": pick_tf, "search_s": secs})
    row = next(r for r in NARAYANAN_2021 if r.params_b == 145.6)
    model, cluster, work, plan = row_setup(row)
    no_flash = dataclasses.replace(DEFAULT_CONSTANTS, flash_attention=False)
    paper = evaluate(plan, model, cluster, work, no_flash)
    pick = search(model, cluster, work, dtype="bf16", top=1, constants=no_flash).best
    print(f"145.6B with 2021 attention kernels (s^2 scores stored, no flash attention): pick "
          f"{pick.plan.describe()}, {paper.step_time_s / pick.step_time_s:.2f}x the paper "
          f"layout's predicted speed")
    errs = [abs(r["error"]) for r in rows_out]
    print(f"median |error| {statistics.median(errs):.1%}, max {max(errs):.1%}; "
          f"'pick/paper' = predicted paper-layout step time / predicted pick step time "
          f"(>= 1: the pick predicts no worse)")
    print("TFLOP/s use their formula 96 B s l h^2 (1 + s/6h + V/16lh) (recomputation counted); a "
          "pick without recomputation gets the same credit per step, so the ratio is a "
          "step-time ratio.")
    return {"fitted_efficiency": fitted, "rows": rows_out}


# ----------------------------------------------------------------------------- speed
def published_runs(held_back: bool = False) -> list[dict]:
    """Every published run beyond Megatron's table: prediction at the published layout beside
    the publication, and the planner's own pick for the same model, cluster and batch. Rows
    flagged ``held_back`` only with ``held_back=True``, in a section of their own."""
    from plait.planner.published import PUBLISHED_RUNS

    runs = [r for r in PUBLISHED_RUNS if not r.held_back]
    out = _runs_table("published runs (tokens/s per GPU; 'held out': nothing was fitted to it)",
                      runs)
    if held_back:
        out += _runs_table("held back (chosen before any new row was priced; priced only after "
                           "every change to the cost model)",
                           [r for r in PUBLISHED_RUNS if r.held_back])
    for role in ("fitted", "held out", "held back"):
        errs = [abs(r["error"]) for r in out if r["role"] == role and r["error"] is not None]
        if errs:
            print(f"{role:>9}: {len(errs)} rows, median |error| {statistics.median(errs):.1%}, "
                  f"max {max(errs):.1%}")
    print("'pick/paper': predicted step time at the published layout / the pick's (>= 1: the "
          "planner predicts its pick no slower); 'pick/published': the pick's predicted speed "
          "over the published one")
    return out


def _runs_table(title: str, runs: list) -> list[dict]:
    from plait.planner.published import MISS_BAND, published_tokens_per_s_per_gpu, run_setup

    print(f"\n== {title} ==")
    head = (f"{'run':<48} {'':>9} {'published':>9} {'predicted':>9} {'error':>7} "
            f"{'range':>13} {'mem GiB':>7} | {'planner pick':<60} {'pick/paper':>10} "
            f"{'pick/published':>14}")
    print(head)
    print("-" * len(head))
    out = []
    for run in runs:
        model, cluster, work, plan = run_setup(run)
        published = published_tokens_per_s_per_gpu(run)
        k = constants_for(cluster)
        e = evaluate(plan, model, cluster, work, k)
        role = "fitted" if run.fitted else "held back" if run.held_back else "held out"
        pick = search(model, cluster, work, top=1, constants=k).best
        pick_tps = pick.tokens_per_s / run.devices if pick else float("nan")
        if not e.feasible:
            print(f"{run.name:<48} {role:>9} {published:>9,.0f} {'-':>9} {'-':>7} {'':>13} "
                  f"{e.memory_bytes_per_device / 2**30:>7.1f} | NOT FEASIBLE: {e.reason}")
            out.append({"run": run.name, "role": role, "published": published,
                        "predicted": None, "error": None, "reason": e.reason,
                        "pick": pick.plan.to_string() if pick else None,
                        "pick_predicted": pick_tps})
            continue
        tps = e.tokens_per_s / run.devices
        lo = evaluate(plan, model, cluster, work, dataclasses.replace(
            k, compute_efficiency=cluster.extra["compute_efficiency_range"][0]))
        hi = evaluate(plan, model, cluster, work, dataclasses.replace(
            k, compute_efficiency=cluster.extra["compute_efficiency_range"][1]))
        span = f"{lo.tokens_per_s / run.devices:,.0f}-{hi.tokens_per_s / run.devices:,.0f}"
        err = tps / published - 1
        print(f"{run.name:<48} {role:>9} {published:>9,.0f} {tps:>9,.0f} {err:>+7.1%} "
              f"{span:>13} {e.memory_bytes_per_device / 2**30:>7.1f} | "
              f"{pick.plan.describe()[:60] if pick else '-':<60} "
              f"{e.step_time_s / pick.step_time_s if pick else float('nan'):>9.2f}x "
              f"{pick_tps / published:>13.2f}x")
        if run.miss:
            print(f"    miss (outside the stated +-{MISS_BAND:.0%}): {run.miss}")
        out.append({"run": run.name, "role": role, "published": published, "predicted": tps,
                    "error": err, "miss": run.miss, "bubble": e.bubble_fraction,
                    "memory_gib": e.memory_bytes_per_device / 2**30,
                    "time_breakdown": e.time_breakdown,
                    "pick": pick.plan.to_string() if pick else None,
                    "pick_predicted": pick_tps})
    return out


def cp_speedups() -> list[dict]:
    """Context parallelism's published speed-up over the best layout without it (NeMo's Llama 2
    7B table) beside the planner's: the published layout priced over plait's best layout
    without cp, and plait's own pick."""
    from plait.planner.published import (
        CP_SEQS_PER_REPLICA,
        MISS_BAND,
        NEMO_LLAMA2_7B_CP,
        check_cp_speedup,
    )

    print(f"\n== context parallelism's speed-up, Llama 2 7B on H100 (NeMo; held out; "
          f"{CP_SEQS_PER_REPLICA} sequences per replica) ==")
    head = (f"{'seq':>6} {'GPUs':>5} {'published layout':<26} {'published':>9} "
            f"{'predicted':>9} {'error':>7} | {'planner pick':<58} {'best without cp':<50}")
    print(head)
    print("-" * len(head))
    out = []
    for row in NEMO_LLAMA2_7B_CP:
        c = check_cp_speedup(row)
        layout = f"tp={row.tp},pp={row.pp},dp={row.dp},cp={row.cp}"
        pred = c.predicted_speedup
        err = pred / row.published_speedup - 1 if pred is not None else None
        shown = f"{pred:>8.2f}x" if pred is not None else f"{'only cp':>9}"
        print(f"{row.seq_k:>5}k {row.gpus:>5} {layout:<26} {row.published_speedup:>8.2f}x "
              f"{shown} {(f'{err:+.1%}' if err is not None else '-'):>7} | "
              f"{c.pick.plan.describe()[:58] if c.pick else '-':<58} "
              f"{c.without_cp.plan.describe()[:50] if c.without_cp else 'nothing fits':<50}")
        if row.note:
            print(f"    {row.note}")
        out.append({"seq": row.seq, "gpus": row.gpus, "layout": layout,
                    "published": row.published_speedup, "predicted": pred, "error": err,
                    "pick": c.pick.plan.to_string() if c.pick else None,
                    "without_cp": c.without_cp.plan.to_string() if c.without_cp else None,
                    "note": row.note})
    errs = [abs(r["error"]) for r in out if r["error"] is not None]
    print(f"{len(errs)} rows priced both ways, median |error| {statistics.median(errs):.1%}, "
          f"max {max(errs):.1%} (band {MISS_BAND:.0%}); 'only cp': no layout without cp fits")
    return out


def picks(held_back: bool = False) -> list[dict]:
    """The planner's pick for every published model, cluster and batch beside the publication:
    its speed-up split into work it skips (recomputation) and a faster chip rate (HFU), and the
    published run that achieved that speed where the pick is faster."""
    from plait.planner.published import check_pick, published_cases

    print("\n== the planner's picks beside the publications (tokens/s per GPU) ==")
    head = (f"{'case':<48} {'published':>9} {'pick':>9} {'ratio':>6} = {'work':>5} x "
            f"{'HFU (published -> pick)':>23} | named run that achieved it")
    print(head)
    print("-" * len(head))
    out = []
    for case in published_cases(include_held_back=held_back):
        k = check_pick(case)
        ratio = k.tokens_per_s_per_gpu / case.tokens_per_s_per_gpu
        run = k.achieved
        named = "-" if not k.faster else (
            f"{run.name}: {run.tokens_per_s_per_gpu:,.0f} tokens/s" if run.tokens_per_s_per_gpu
            else f"{run.name}: HFU {run.hfu:.1%}") if run else "NONE"
        broken = f"  (RULE BROKEN: {k.problem()})" if k.problem() else ""
        print(f"{case.name:<48} {case.tokens_per_s_per_gpu:>9,.0f} "
              f"{k.tokens_per_s_per_gpu:>9,.0f} {ratio:>5.2f}x = {k.work_ratio:>4.2f}x x "
              f"{k.published_hfu:>10.1%} -> {k.hfu:>6.1%}    | {named}{broken}")
        out.append({"case": case.name, "published": case.tokens_per_s_per_gpu,
                    "pick": k.pick.plan.to_string() if k.pick else None,
                    "pick_tokens_per_s_per_gpu": k.tokens_per_s_per_gpu,
                    "work_ratio": k.work_ratio, "published_hfu": k.published_hfu,
                    "pick_hfu": k.hfu, "named_run": run.name if (run and k.faster) else None,
                    "rule_holds": not k.problem()})
    print("work: FLOPs per token of the published layout over the pick's (recomputation the "
          "pick skips); HFU: FLOPs executed per second over the datasheet peak (plait's count)")
    return out


def speed() -> dict:
    print("\n== search speed (plans every layout; one core of this machine) ==")
    out = {}
    for name, devices, batch, target in (("gpt-175b", 1024, 1536, 1.0),
                                         ("gpt-175b", 16384, 8192, 10.0),
                                         ("gpt-145b", 1536, 2304, None)):
        model = load_model(name)
        cluster = load_cluster("dgx-a100-80gb", devices=devices)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            r = search(model, cluster, Workload(batch, 2048), top=5)
            times.append(time.perf_counter() - t0)
        t = min(times)
        tgt = f"target < {target:g} s, {t / target:.2f} of it" if target else ""
        print(f"{name} on {devices:>6} devices, batch {batch}: {t:.3f} s (best of 3), "
              f"{r.evaluated} layouts priced; {tgt}")
        out[f"{name}@{devices}"] = {"seconds": t, "evaluated": r.evaluated}
    return out


# ----------------------------------------------------------------------------- measured
def choose_layouts(model, cluster, work, constants, limit: int) -> list:
    """The layouts to time: the planner's best-predicted variant of every structure (degrees,
    ZeRO stage, SP, schedule, virtual stages), in the planner's order, then for as many as fit
    in ``limit``: the most-accumulation variant, full recomputation, and GPipe for pipelines.
    Structures first, so a small ``limit`` still covers every kind of parallelism."""
    cands = search(model, cluster, work, dtype="fp32", top=0, constants=constants).ranked
    groups: dict = {}
    for e in cands:
        p = e.plan.replace(options={}) if e.plan.options else e.plan
        key = (tuple(p.degrees().items()), p.zero, p.sp, p.pp_schedule, p.virtual_stages)
        groups.setdefault(key, []).append(p)
    plans = [g[0] for g in groups.values()]
    extras = []
    for g in groups.values():
        base = g[0]
        most = max(g, key=lambda p: p.grad_accum * p.microbatches)
        if most != base:
            extras.append(most)
        if base.activation_checkpointing == "none":
            extras.append(base.replace(activation_checkpointing="full"))
        if base.pp > 1 and base.pp_schedule == "1f1b" and base.virtual_stages == 1:
            extras.append(base.replace(pp_schedule="gpipe"))
    # round-robin over structures so every kind of variant is represented
    for p in extras:
        if len(plans) >= limit:
            break
        if p not in plans:
            plans.append(p)
    return plans[:limit]


def run_jobs(plans: list, args, world: int, shape: dict) -> dict:
    """Every layout in fresh processes of its own, once per round, with a calibration job in
    each round; rounds alternate direction and rotate their start, so slow drift in the
    machine's load hits every layout alike. Returns the raw measurements: the calibration jobs'
    results (``cals``, one dict per rank per round), per layout its jobs' compute calibrations
    (``computes``, one per rank per job), its rounds (``got``: per round, per rank, step times;
    or an error string) and the CPU seconds of those steps (``cpu``, same shape)."""
    from _planner_workers import calibration_job

    from plait.spawn import run_distributed

    raw: dict = {"cals": [], "computes": [[] for _ in plans], "got": [[] for _ in plans],
                 "cpu": [[] for _ in plans]}
    jobs = [None] + list(range(len(plans)))
    for rnd in range(args.rounds):
        t0 = time.perf_counter()
        # Alternate the direction and rotate the start, so no layout always runs at the same
        # moment of a round or next to the same job.
        shift = rnd * len(jobs) // max(1, args.rounds)
        order = jobs[shift:] + jobs[:shift]
        for job in (order if rnd % 2 == 0 else order[::-1]):
            if job is None:
                raw["cals"].extend(run_distributed(calibration_job, world, shape,
                                                   timeout=args.timeout))
            else:
                run_layout(raw, job, plans[job], args, world, shape)
        print(f"  round {rnd + 1}/{args.rounds}: {len(plans)} layouts + calibration in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    return raw


def run_layout(raw: dict, job: int, plan, args, world: int, shape: dict) -> None:
    """One job of one layout; its step times, CPU seconds and compute calibration appended to
    ``raw`` (or the error that stopped it, which retires the layout)."""
    from _planner_workers import layout_job, step_times

    from plait.spawn import WorkerError, run_distributed

    if isinstance(raw["got"][job], str):
        return
    try:
        got = run_distributed(layout_job, world, plan.to_dict(), args.model, args.global_batch,
                              args.seq, args.steps, args.warmup, shape, timeout=args.timeout)
    except (WorkerError, TimeoutError) as exc:
        got = [f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"]
    bad = next((g for g in got if isinstance(g, str)), None)
    if bad is not None:
        raw["got"][job] = bad
        return
    # one list of step times per job (the latest rank's end to the latest rank's end), kept in
    # the per-rank nesting of stored sets timed between barriers (one list per rank) so both load
    raw["got"][job].append([step_times(got)])
    raw["cpu"][job].append([g["cpu"] for g in got])
    raw["computes"][job].extend(g["compute"] for g in got)


def finalists(raw: dict, plans: list, cluster, world: int, model, work, count: int) -> list[int]:
    """The layouts whose comparison decides the pick target: the planner's pick and the
    measured fastest layouts (up to ``count`` in all, the pick included; at least the pick and
    the fastest other one). Why: the measured best is the minimum of many noisy medians, which
    is biased low (the winner's curse), and two layouts a few percent apart swap places from run
    to run on this machine; timing just these again, back to back, measures the one comparison
    the target is about more tightly than more rounds of everything would for the same time."""
    timed = [i for i, g in enumerate(raw["got"]) if not isinstance(g, str) and g]
    if len(timed) < 2:
        return []
    c, k = in_group_profile(cluster, raw["cals"], raw["cals"] + sum(raw["computes"], []),
                            world, quiet=True)
    pick = min(timed, key=lambda i: evaluate(plans[i], model, c, work, k).step_time_s)
    by_time = sorted(timed, key=lambda i: layout_time(raw["got"][i]))
    chosen = [pick] + [i for i in by_time if i != pick][:max(1, count - 1)]
    # no layout measured slower than the pick can be the best: keep the pick's rivals only,
    # but always one, so a pick that measured best is confirmed against the runner-up
    limit = layout_time(raw["got"][pick])
    rivals = [i for i in chosen[1:] if layout_time(raw["got"][i]) <= limit]
    return [pick] + (rivals or chosen[1:2])


def measured(args) -> dict:
    from _planner_workers import probe_shape

    from plait.planner.cpu.probes import calibrate

    print("\n== predicted vs measured on this machine (plait runtime: init/parallelize/step) ==")
    if args.reprice:
        return reprice(args)
    if args.profile and Path(args.profile).exists():
        cluster = load_cluster(args.profile)
        print(f"profile: {args.profile}")
    else:
        cluster = calibrate(world=2)
        if args.profile:
            save_cluster(cluster, args.profile)
        print(f"calibrated: {cluster.peak('fp32') / 1e9:.1f} GFLOP/s per process, block "
              f"efficiency {cluster.extra['compute_efficiency']:.2f}, block overhead "
              f"{cluster.extra['block_overhead_s'] * 1e3:.2f} ms (fit residual "
              f"{cluster.extra['block_fit_residual']:.1%}), all-reduce "
              f"{cluster.intra_bw / 1e9:.2f} GB/s, {cluster.intra_latency * 1e6:.0f} us/step, "
              f"{cluster.compute_units} cores")
        from plait.planner import CALIBRATED_KEYS
        print("  " + describe_constants({k: cluster.extra[k] for k, kind in CALIBRATED_KEYS
                                          if kind is float and k in cluster.extra}))
    constants = constants_for(cluster)
    model = load_model(args.model)
    work = Workload(args.global_batch, args.seq)
    results = {}
    for world in args.worlds:
        t_start = time.perf_counter()
        plans = choose_layouts(model, cluster.with_world(world), work, constants,
                               args.max_layouts)
        print(f"\nworld {world}: {len(plans)} layouts of {args.model} (global batch "
              f"{args.global_batch} x seq {args.seq}, fp32), each in fresh processes, "
              f"{args.rounds} interleaved rounds x {args.steps} steps after {args.warmup} "
              f"warm-up steps", flush=True)
        shape = probe_shape(args.model, args.global_batch, args.seq)
        raw = run_jobs(plans, args, world, shape)
        raw.update({"cluster": cluster.to_yaml_dict(), "model": args.model,
                    "global_batch": args.global_batch, "seq": args.seq,
                    "plans": [p.to_dict() for p in plans], "finalists": []})
        if args.final_rounds:
            final = finalists(raw, plans, cluster, world, model, work, args.finalists)
            raw["finalists"] = final
            t0 = time.perf_counter()
            for rnd in range(args.final_rounds):
                for job in (final if rnd % 2 == 0 else final[::-1]):
                    run_layout(raw, job, plans[job], args, world, shape)
            rounds = f"{args.final_rounds} more round{'s' if args.final_rounds != 1 else ''}"
            print(f"  finalists (the pick and its measured rivals): "
                  f"{', '.join(plans[j].describe() for j in final)}; {rounds} each, back to "
                  f"back, in {time.perf_counter() - t0:.0f} s", flush=True)
        results[world] = report_world(world, raw, t_start)
    return results


def reprice(args) -> dict:
    """Price the measurements stored by an earlier ``--json`` run again, with this checkout's
    cost model: model changes are checked against the same measurements, in seconds."""
    stored = json.loads(Path(args.reprice).read_text())
    # a --json output ({"measured": {world: {"raw": ...}}}) or a trimmed set ({world: raw})
    raws = {w: e["raw"] for w, e in stored["measured"].items()} if "measured" in stored \
        else stored
    print(f"repricing the measurements stored in {args.reprice}")
    results = {}
    for world, raw in raws.items():
        print(f"\nworld {world}: {len(raw['plans'])} layouts (stored)")
        results[int(world)] = report_world(int(world), raw, time.perf_counter())
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--published", action="store_true")
    ap.add_argument("--held-back", action="store_true",
                    help="with --published: also price the runs flagged held_back in "
                         "plait/planner/published.py")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--profile", default=None, help="reuse/save the calibrated cluster YAML")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per layout per round")
    ap.add_argument("--warmup", type=int, default=2, help="discarded steps per layout")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repetitions")
    ap.add_argument("--max-layouts", type=int, default=16)
    ap.add_argument("--finalists", type=int, default=4,
                    help="layouts timed again after the rounds: the planner's pick and its "
                         "measured rivals (at most this many in all)")
    ap.add_argument("--final-rounds", type=int, default=4,
                    help="back-to-back rounds of the finalists (0: none)")
    ap.add_argument("--quick", action="store_true",
                    help="8 layouts, 2 rounds x 2 steps, 1 warm-up step, 1 finalist round (a few "
                         "minutes)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per job")
    ap.add_argument("--json", default=None, help="also write the figures (and the raw "
                    "measurements, for --reprice) here")
    ap.add_argument("--reprice", default=None, metavar="JSON",
                    help="no measuring: price the measurements of an earlier --json run again "
                         "with this checkout's cost model")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_layouts, args.rounds, args.steps, args.warmup = 8, 2, 2, 1
        args.final_rounds = 1
        args.calibrate = True
    if args.reprice:
        args.calibrate = True
    if not (args.published or args.speed or args.calibrate):
        args.published = args.speed = True
    out = {}
    if args.published:
        out["published"] = published()
        out["published_runs"] = published_runs(args.held_back)
        out["cp_speedups"] = cp_speedups()
        out["picks"] = picks(args.held_back)
    if args.speed:
        out["speed"] = speed()
    if args.calibrate:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        out["measured"] = measured(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
