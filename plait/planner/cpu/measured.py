"""Predicted vs measured on stored CPU measurements of whole layouts.

``bench/planner_accuracy.py --calibrate --json`` times layouts of a small model through plait's
runtime (each in fresh processes, in interleaved rounds, with calibration jobs beside them) and
stores every step time and calibration. The functions here price those measurements with the
current cost model: the error per layout, the rank correlation, where the planner's pick lands
among the measured layouts, and the noise floor of the rounds. The bench prints them after
measuring; the tests reprice stored sets (tests/data/) in seconds, without timing anything.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

from plait.comm.volumes import bus_factor

from .. import constants_for
from ..cost import Workload, evaluate
from ..model_stats import load_model
from .derive import LARGE_BYTES, SMALL_BYTES, derive_constants, median_of
from .overheads import CPU_PROFILE


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else float("nan")


def in_group_profile(cluster, cals: list[dict], computes: list[dict], world: int,
                     quiet: bool = False):
    """The profile measured in this world's jobs (medians over ranks and jobs): the group
    micro-benchmarks from the calibration jobs (``cals``), compute and the all-reduce latency
    from ``computes`` (compute calibrations: the calibration jobs' and every layout job's). The
    block rate is the median of the measured rates, not of peak x (efficiency capped at 1): the
    matmul peak swings with the machine's load and the efficiency is measured against it, so
    separate medians do not multiply back to what the blocks achieved."""

    med = median_of(cals)
    med.update(median_of([{"peak": c["peak"], "rate": c["rate"],
                           "overhead": c["overhead"], "residual": c["residual"]}
                          for c in computes]))
    small = [c["all_reduce_small"] for c in computes if "all_reduce_small" in c]
    if small:  # the latency probe of every job, when recorded (else the calibration jobs')
        med[f"all_reduce@{SMALL_BYTES}"] = statistics.median(small)
    alpha = med[f"all_reduce@{SMALL_BYTES}"] / (2 * (world - 1))
    bw = (LARGE_BYTES - SMALL_BYTES) * bus_factor("all_reduce", world) / max(
        med[f"all_reduce@{LARGE_BYTES}"] - med[f"all_reduce@{SMALL_BYTES}"], 1e-9)
    eff = min(1.0, med["rate"] / med["peak"])
    derived = derive_constants(med, alpha=alpha, bw=bw, rate=med["peak"] * eff)
    extra = dict(cluster.extra)
    extra.update(compute_efficiency=eff, block_overhead_s=med["overhead"], **CPU_PROFILE,
                 **derived)
    # Every rank calibrated at once, so the figures are per process with the cores shared; the
    # cost model wants a whole core's peak and the core count, and applies the share itself
    # (it also needs the count to know that a pipeline's idle stages free their cores).
    cores = cluster.compute_units or world
    oversubscribed = world / cores if world > cores else 1.0
    c = dataclasses.replace(cluster.with_world(world),
                            peak_flops={"fp32": med["peak"] * oversubscribed},
                            intra_bw=bw, inter_bw=bw, intra_latency=alpha, inter_latency=alpha,
                            compute_units=cores, extra=extra)
    if not quiet:
        print(f"  calibration (median over ranks and jobs: {len(computes)} compute, "
              f"{len(cals)} group): {med['peak'] / 1e9:.1f} GFLOP/s x {eff:.2f} efficiency, "
              f"block overhead {med['overhead'] * 1e3:.2f} ms (fit residual "
              f"{med['residual']:.1%}), all-reduce {bw / 1e9:.2f} GB/s, {alpha * 1e6:.0f} us/step")
        print("  " + describe_constants(derived))
    return c, constants_for(c)


def describe_constants(derived: dict) -> str:
    parts = []
    for key, value in derived.items():
        parts.append(f"{key}={value * 1e3:.3g}ms" if key.endswith("_s") else f"{key}={value:.2f}")
    return ", ".join(parts)


def round_times(got: list) -> list[float]:
    """A step's time is its slowest rank's (a round holds one list of step times per rank, or
    one list per job already taken from its latest rank); a round's, the median of its steps."""
    return [statistics.median(max(ts) for ts in zip(*ranks, strict=True)) for ranks in got]


def layout_time(got: list) -> float:
    """A layout's time: the median of its rounds."""
    return statistics.median(round_times(got))


def report_world(world: int, raw: dict, t_start: float) -> dict:
    """Predicted vs measured for one world from its raw measurements (``raw``: the profile it
    started from, the layouts, the calibrations and the step times); the figures and ``raw``."""
    from plait.plan import Plan
    from plait.planner.hardware import cluster_from_dict

    cluster = cluster_from_dict(raw["cluster"])
    model = load_model(raw["model"])
    work = Workload(raw["global_batch"], raw["seq"])
    plans = [Plan.from_dict(p) for p in raw["plans"]]
    cals, computes, got_all = raw["cals"], raw["computes"], raw["got"]
    cpu_all = raw.get("cpu") or [None] * len(plans)  # CPU seconds per step, when recorded
    final = set(raw.get("finalists") or [])
    cores = min(world, cluster.compute_units or world)
    c, constants_w = in_group_profile(cluster, cals, cals + sum(computes, []), world)
    out: dict = {"raw": raw}
    rows = []
    for i, (p, got, comp) in enumerate(zip(plans, got_all, computes, strict=True)):
        pred = evaluate(p, model, c, work, constants_w)  # the world's profile
        if isinstance(got, str):
            print(f"  {p.describe():<62} failed: {got}")
            continue
        # the same model with the compute calibrations of this layout's own jobs (same
        # processes, same minutes): what the error would be without the machine's drift
        c_own, k_own = in_group_profile(cluster, cals, comp, world, quiet=True)
        own = evaluate(p, model, c_own, work, k_own).step_time_s
        per_round = round_times(got)
        meas = statistics.median(per_round)
        spread = statistics.median(abs(x / meas - 1) for x in per_round)
        busy = float("nan")
        if cpu_all[i]:
            # cores busy: CPU seconds of all ranks over (cores x the step's wall time), per step
            busy = statistics.median(
                sum(cs) / (cores * max(ts))
                for ranks, cranks in zip(got, cpu_all[i], strict=True)
                for ts, cs in zip(zip(*ranks, strict=True), zip(*cranks, strict=True), strict=True))
        rows.append((p, pred.step_time_s, meas, spread, per_round, own, busy, i in final))
    print(f"  {'layout':<62} {'predicted s':>11} {'measured s':>10} {'error':>7} "
          f"{'round spread':>12} {'own-jobs error':>14} {'cores busy':>10}")
    for p, pred_s, meas, spread, per_round, own, busy, fin in rows:
        name = p.describe() + (f" *{len(per_round)}" if fin else "")
        print(f"  {name:<62} {pred_s:>11.4f} {meas:>10.4f} {pred_s / meas - 1:>+7.1%} "
              f"{spread:>12.1%} {own / meas - 1:>+14.1%} "
              f"{'-' if math.isnan(busy) else f'{busy:.0%}':>10}")
    if final:
        print("  *N: a finalist, timed in N rounds (the interleaved ones and the back-to-back "
              "finalist rounds)")
    if len(rows) >= 2:
        errs = [abs(r[1] / r[2] - 1) for r in rows]
        own_errs = [abs(r[5] / r[2] - 1) for r in rows]
        rho = spearman([r[1] for r in rows], [r[2] for r in rows])
        pick = min(rows, key=lambda r: r[1])
        best = min(r[2] for r in rows)
        rank = sorted(r[2] for r in rows).index(pick[2]) + 1
        noise = statistics.median(r[3] for r in rows)
        print(f"  median |error| {statistics.median(errs):.1%} (target <= 15%), Spearman "
              f"{rho:.2f} (target >= 0.8); planner's pick {pick[0].describe()} measured "
              f"rank {rank}/{len(rows)}, {pick[2] / best - 1:+.1%} vs the measured best "
              f"(target within 10%)")
        print(f"  noise floor: median |round / median - 1| over layouts {noise:.1%}; "
              f"own-jobs median |error| {statistics.median(own_errs):.1%} (each layout "
              f"priced with the compute calibrations of its own jobs: the error without "
              f"the machine's drift; diagnostic, not the target); "
              f"{time.perf_counter() - t_start:.0f} s for this world")
        out.update({"median_abs_error": statistics.median(errs), "spearman": rho,
                    "pick": pick[0].to_string(), "pick_rank": rank,
                    "pick_vs_best": pick[2] / best - 1, "noise_floor": noise,
                    "own_jobs_median_abs_error": statistics.median(own_errs),
                    "rows": [(p.to_string(), pr, me, sp, rr, ow, bu)
                             for p, pr, me, sp, rr, ow, bu, _ in rows]})
    return out
