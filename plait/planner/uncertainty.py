"""How sure a prediction is: the step time at both ends of the chip's compute-efficiency range.

Compute efficiency is the one constant a prediction rests on most, and it differs by chip
generation and software stack. Each preset states its value, the range published runs put
around it and where it comes from (``extra.compute_efficiency``, ``_range``, ``_source``); a
chip no published run was checked on says "extrapolated". A user's own value
(``--efficiency``, ``plait plan --calibrate``) replaces the range with the value itself.
"""

from __future__ import annotations

import dataclasses

from .cost import Constants, Estimate, Workload, evaluate
from .hardware import Cluster
from .model_stats import ModelStats


def efficiency_range(cluster: Cluster, c: Constants) -> tuple[float, float] | None:
    """(low, high) efficiency from the cluster's profile, when it states one and the constant
    in use is the profile's own (not a user override)."""
    extra = cluster.extra or {}
    span = extra.get("compute_efficiency_range")
    if not span or float(extra.get("compute_efficiency", -1)) != c.compute_efficiency:
        return None
    ok = isinstance(span, (list, tuple)) and len(span) == 2 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in span)
    if not ok:
        raise ValueError(f"cluster {cluster.name!r}: extra.compute_efficiency_range={span!r} "
                         f"must be two numbers [low, high], e.g. [0.33, 0.45]")
    lo, hi = (float(x) for x in span)
    if not 0 < lo <= c.compute_efficiency <= hi <= 1:
        raise ValueError(f"cluster {cluster.name!r}: extra.compute_efficiency_range={list(span)} "
                         f"must bracket compute_efficiency={c.compute_efficiency} within (0, 1]")
    return lo, hi


def with_uncertainty(est: Estimate, model: ModelStats, cluster: Cluster, work: Workload,
                     c: Constants) -> Estimate:
    """``est`` with ``step_time_range_s`` (fastest, slowest) and a note naming the efficiency's
    source; the plan is priced again at both ends of the range (its stage split kept)."""
    span = efficiency_range(cluster, c)
    source = (cluster.extra or {}).get("compute_efficiency_source", "")
    if not est.feasible:
        return est
    if span is None:
        given = (cluster.extra or {}).get("compute_efficiency")
        how = ("given, not the profile's" if given is not None and
               float(given) != c.compute_efficiency else
               "calibrated on this machine" if cluster.source == "calibrated" else
               "no range stated for this cluster")
        est.notes.append(f"compute efficiency {c.compute_efficiency:.2f} ({how})")
        return est
    times = []
    for eff in (span[1], span[0]):
        k = dataclasses.replace(c, compute_efficiency=eff)
        times.append(evaluate(est.plan, model, cluster, work, k).step_time_s)
    est.step_time_range_s = (min(times), max(times))
    est.notes.append(f"compute efficiency {c.compute_efficiency:.2f} (range {span[0]:.2f}-"
                     f"{span[1]:.2f}: step {times[0]:.3g}-{times[1]:.3g} s), {source}")
    return est
