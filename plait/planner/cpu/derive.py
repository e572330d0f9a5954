"""Cost-model constants from raw CPU timings: pure arithmetic, unit-tested by hand.

:mod:`plait.planner.cpu.probes` times a training step's parts on real processes (every rank
sharing the machine's cores); the functions here turn those medians into the constants of
:class:`plait.planner.cost.Constants`, pricing only what the cost model does not already price.
The probe sizes below are the contract between the two modules.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SMALL_BYTES = 1024           # all-reduce latency payload
LARGE_BYTES = 4 * 2**20      # bandwidth payload
TENSOR_COUNTS = (8, 32)      # parameter tensors in the optimizer micro-benchmark
FSDP_UNITS = 2               # fully_shard-ed reference blocks in the FSDP2 micro-benchmark
PROBE = dict(dim=128, n_heads=4, vocab=256, seq=64, batch=4)  # the TP / outside-block probe


@dataclass(frozen=True)
class LineFit:
    """``time = slope * x + intercept`` fitted robustly; ``residual`` is the median relative
    misfit |t - fit| / t over the points (how well one line explains them)."""

    slope: float
    intercept: float
    residual: float
    points: int


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> LineFit:
    """Theil-Sen fit: the median of all pairwise slopes, then the median intercept.

    Why not two points or least squares: on a shared machine a timing is only ever inflated
    (another process took the core), so single points are outliers, not Gaussian noise. The
    median of slopes ignores up to ~29% of bad points. The intercept (fixed time: launches,
    Python) cannot be negative; if the data say it is, it is clamped to 0 and the slope refitted
    through the origin (median of y/x), so a clamped fit still passes through the bulk.
    """
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"fit_line needs >= 2 paired points, got {len(xs)} x and {len(ys)} y")
    if len(set(xs)) < 2:
        raise ValueError(f"fit_line needs >= 2 distinct x values, got {sorted(set(xs))}")
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i])
              for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    slope = max(statistics.median(slopes), 0.0)
    intercept = statistics.median(y - slope * x for x, y in zip(xs, ys, strict=True))
    if intercept < 0:
        intercept = 0.0
        slope = statistics.median(y / x for x, y in zip(xs, ys, strict=True) if x > 0)
    residual = statistics.median(abs(y - (slope * x + intercept)) / y
                                 for x, y in zip(xs, ys, strict=True) if y > 0)
    return LineFit(slope, intercept, residual, len(xs))


def derive_constants(raw: dict, *, alpha: float, bw: float, rate: float) -> dict:
    """Cost-model constants from ``measure_group``'s timings (medians over ranks).

    ``alpha``/``bw``: the all-reduce's per-step latency and bus bandwidth on this world;
    ``rate``: achieved block FLOP/s (peak x efficiency). Every term is what the measurement shows
    beyond what the cost model already prices, clamped at 0 (noise cannot make a cost negative):

    * per collective op: the per-byte slope between the two payloads over the ring ideal at
      ``bw`` (``<op>_factor``), and the small-payload time beyond ``alpha x ring steps`` and its
      bytes (``<op>_call_s``); broadcasts from the asynchronous burst, as ZeroRedundancyOptimizer
      issues them (may be below the latency: they overlap);
    * ``tensor_step_s`` / ``dtensor_step_s``: slope of clip + AdamW + zero_grad over tensors;
    * ``fsdp_unit_s``: FSDP2 stack minus plain stack per unit, minus one modelled all-gather;
      ``fsdp_reduce_s``: with the gradient sync on minus off, per unit, minus one modelled
      reduce-scatter; ``fsdp_regather_s``: ZeRO-3 minus ZeRO-2 (both syncing), per unit, minus
      one modelled all-gather;
    * ``micro_overhead_s``: the probe model's time outside its blocks (1 block minus the 2-1
      difference) minus the head's FLOPs at ``rate``;
    * ``tp_block_overhead_s``: the TP+SP per-block time minus half the plain per-block time
      minus the block's modelled TP collectives; ``tp_micro_overhead_s`` the same outside the
      blocks (embedding, head, loss_parallel collectives modelled);
    * ``zb_backward_factor``: the zero-bubble split's extra time per block (2-block extra minus
      1-block extra) over a block's backward (2/3 of its forward + backward); ``zb_call_s``: the
      1-block extra minus that per-block part (the per-call graph walk).
    """
    import dataclasses

    from plait.comm.predict import tp_block_traffic, tp_end_traffic
    from plait.comm.volumes import Traffic, bus_factor

    from ..cost import DEFAULT_CONSTANTS
    from ..traffic import collective_time
    from .overheads import CPU_PROFILE

    world = int(raw["world"])
    out: dict[str, float] = {}
    span = LARGE_BYTES - SMALL_BYTES
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        t_s, t_l = raw[f"{op}@{SMALL_BYTES}"], raw[f"{op}@{LARGE_BYTES}"]
        slope = max(t_l - t_s, 0.0) / span                  # s per payload byte
        ideal = bus_factor(op, world) / bw
        steps = 2 * (world - 1) if op == "all_reduce" else world - 1
        if op != "all_reduce":
            out[f"{op}_factor"] = slope / ideal if ideal else 1.0
        small = raw["broadcast_async@1024"] if op == "broadcast" else t_s
        out[f"{op}_call_s"] = max(-alpha * steps, small - alpha * steps - SMALL_BYTES * slope)
    out["all_reduce_call_s"] = max(0.0, out["all_reduce_call_s"])
    for kind, key in (("plain", "tensor_step_s"), ("dtensor", "dtensor_step_s")):
        n1, n2 = TENSOR_COUNTS
        out[key] = max(0.0, (raw[f"{kind}@{n2}"] - raw[f"{kind}@{n1}"]) / (n2 - n1))
    # what the cost model would now charge for a collective, with the factors above
    from ..hardware import Cluster

    cluster = Cluster(name="probe", device="cpu", nodes=1, devices_per_node=world,
                      memory_bytes=1e12, peak_flops={"fp32": rate}, intra_bw=bw, inter_bw=bw,
                      intra_latency=alpha, inter_latency=alpha)
    changes: dict[str, Any] = dict(out)
    c = dataclasses.replace(DEFAULT_CONSTANTS, link_efficiency=CPU_PROFILE["link_efficiency"],
                            **changes)
    gather = collective_time(Traffic("dp_shard", "all_gather", raw["fsdp_unit_bytes"], 1, world),
                             cluster, 1, c)
    out["fsdp_unit_s"] = max(0.0, (raw["fsdp_nosync"] - raw["fsdp_plain"]) / FSDP_UNITS - gather)
    if "fsdp_sync" in raw:  # older stored profiles lack the reduce / re-gather probes
        scatter = collective_time(Traffic("dp_shard", "reduce_scatter", raw["fsdp_unit_bytes"], 1,
                                          world), cluster, 1, c)
        out["fsdp_reduce_s"] = max(0.0, (raw["fsdp_sync"] - raw["fsdp_nosync"]) / FSDP_UNITS
                                   - scatter)
        out["fsdp_regather_s"] = max(0.0, (raw["fsdp_zero3"] - raw["fsdp_sync"]) / FSDP_UNITS
                                     - gather)
    p = PROBE
    tokens = p["batch"] * p["seq"]
    head = 3 * 2 * p["dim"] * p["vocab"] * tokens / rate
    block_plain = raw["probe_plain@2"] - raw["probe_plain@1"]
    outside_plain = raw["probe_plain@1"] - block_plain
    out["micro_overhead_s"] = max(0.0, outside_plain - head)
    if "probe_tp@1" in raw:
        comm = sum(collective_time(t, cluster, 1, c) for t in
                   tp_block_traffic(p["batch"], p["seq"], p["dim"], 2, "fp32", True))
        ends = sum(collective_time(t, cluster, 1, c) for t in
                   tp_end_traffic(p["batch"], p["seq"], p["dim"], 2, "fp32", True, embed=True,
                                  head=True))
        block_tp = raw["probe_tp@2"] - raw["probe_tp@1"]
        outside_tp = raw["probe_tp@1"] - block_tp
        out["tp_block_overhead_s"] = max(0.0, block_tp - block_plain / 2 - comm)
        out["tp_micro_overhead_s"] = max(0.0, outside_tp - out["micro_overhead_s"] - head / 2
                                         - ends)
    if "zb_split@1" in raw:
        extra1 = raw["zb_split@1"] - raw["zb_full@1"]
        per_block = max(0.0, (raw["zb_split@2"] - raw["zb_full@2"]) - extra1)
        backward = 2 / 3 * max(raw["zb_full@2"] - raw["zb_full@1"], 1e-12)
        out["zb_backward_factor"] = per_block / backward
        out["zb_call_s"] = max(0.0, extra1 - per_block)
    return out


def median_of(dicts: Sequence[dict]) -> dict:
    """Per-key median of numeric dicts (one per rank, or before/after)."""
    return {k: statistics.median(d[k] for d in dicts) for k in dicts[0]}
