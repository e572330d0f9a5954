"""Human and JSON output for a run: the progress line and the end-of-run summary.

Formatting only; the numbers come from the Run. Rank 0 prints; nothing is printed once per rank.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
from typing import Any

from .plan import Plan


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _after_warmup(values: list, window: int) -> list:
    """The last ``window`` values, the first step's left out once there are others (it
    allocates, compiles and tunes: a one-off, not the rate)."""
    return (values[1:] if len(values) > 1 else values)[-window:]


def recent_throughput(stats: Any, window: int = 10) -> tuple[float, float]:
    """(tokens/s, median ms/step) over the last ``window`` steps after the first."""
    recent = _after_warmup(stats.step_times, window)
    tokens = _after_warmup(stats.tokens, window)
    tps = sum(tokens) / sum(recent) if recent and sum(recent) > 0 else 0.0
    return tps, 1000 * _median(recent)


def eta(step: int, total: int | None, stats: Any, window: int = 10) -> str:
    """Time left, as ``H:MM:SS`` (``?`` without a total): the steps left at the recent wall
    time per step, measured between step ends so that what the loop does between steps
    (loading data, evaluating) counts; the median step time until two steps have ended."""
    left = eta_seconds(step, total, stats, window)
    if left is None:
        return "?"
    h, rem = divmod(int(round(left)), 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"


def eta_seconds(step: int, total: int | None, stats: Any, window: int = 10) -> float | None:
    """Seconds left (see :func:`eta`); None without a total or a timed step."""
    if not total or not stats.step_times:
        return None
    ends = getattr(stats, "step_ends", [])[-(window + 1):]  # after step 1 ended: no warm-up
    per_step = ((ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) >= 2
                else _median(_after_warmup(stats.step_times, window)))
    return float(max(0, total - step) * per_step)


def loss_text(loss: float, stats: Any) -> str:
    """``loss 2.3456``, or with several models stepped on each batch each one's latest loss
    by its class name: ``loss Discriminator 0.6931, Generator 0.7120``."""
    named = getattr(stats, "named_losses", {})
    if len(named) < 2:
        return f"loss {loss:.4f}"
    return "loss " + ", ".join(f"{name} {float(value):.4f}" for name, value in named.items())


def progress_line(step: int, total: int | None, loss: float, stats: Any) -> str:
    """``step 50/300 | loss 2.3456 | 12,345 tok/s | 45.6 ms/step | ETA 0:00:11``; under fp16
    the loss scale after the step follows the step time (``| scale 65536``). Several models
    stepped on each batch: each one's loss (:func:`loss_text`)."""
    tps, ms = recent_throughput(stats)
    width = len(str(total)) if total else 0
    where = f"{step:>{width}}/{total}" if total else f"{step}"
    unit = "tok" if getattr(stats, "unit", "tokens") == "tokens" else "samples"
    line = f"step {where} | {loss_text(loss, stats)} | {tps:,.0f} {unit}/s | {ms:.1f} ms/step"
    scale = getattr(stats, "loss_scale", None)
    if scale is not None:
        line += f" | scale {scale:g}"
    return line + (f" | ETA {eta(step, total, stats)}" if total else "")


def progress_event(step: int, total: int | None, loss: float, stats: Any) -> str:
    """The progress line's figures as one JSON event (``--format json``): ``step``, ``total``
    (null without one), ``loss`` (null until a step's loss is known), ``tokens_per_s`` or
    ``samples_per_s`` and ``step_time_ms`` (the recent rate and median, as the line shows),
    ``eta_s``, under fp16 ``loss_scale``, and with several models stepped on each batch
    ``losses``, each one's latest by its class name (``loss`` is the first model's)."""
    from .outputs import json_event

    tps, ms = recent_throughput(stats)
    unit = "tokens" if getattr(stats, "unit", "tokens") == "tokens" else "samples"
    fields: dict[str, Any] = {"step": step, "total": total, "loss": loss,
                              f"{unit}_per_s": tps, "step_time_ms": ms,
                              "eta_s": eta_seconds(step, total, stats)}
    scale = getattr(stats, "loss_scale", None)
    if scale is not None:
        fields["loss_scale"] = scale
    named = getattr(stats, "named_losses", {})
    if len(named) > 1:
        fields["losses"] = {name: float(value) for name, value in named.items()}
    return json_event("progress", **fields)


def local_memory(accelerator: Any = None) -> dict[str, float]:
    """Peak memory of this process: host RSS, and ``accelerator``'s allocator peak where it
    has one (an ``plait.accelerators.Accelerator``)."""
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss = rss_kb * (1 if sys.platform == "darwin" else 1024)
    out = {"peak_rss_bytes": float(rss)}
    peak = accelerator.peak_memory_bytes() if accelerator is not None else None
    if peak is not None:
        out["peak_device_bytes"] = float(peak)
    return out


def summarize(plan: Plan, stats: Any, memory: list[dict[str, float]], *, world_size: int,
              accelerator: str, wall_s: float, warmup: int = 1) -> dict[str, Any]:
    """End-of-run figures. The first ``warmup`` steps (allocation, autotuning, compilation)
    are left out of the step time and the throughput when at least 3 steps remain. The
    throughput is the whole rate (items over time) of the steps kept, so it matches their mean
    step time, given beside the median: a slow step (a recompilation, a checkpoint) moves the
    mean and the throughput, not the median."""
    steps = len(stats.step_times)
    skip = warmup if steps - warmup >= 3 else 0
    times = stats.step_times[skip:]
    toks = stats.tokens[skip:]
    final = float(stats.losses[-1]) if stats.losses else None
    rate = (sum(toks) / sum(times)) if times and sum(times) > 0 else None
    samples = getattr(stats, "unit", "tokens") == "samples"
    info = {
        "plan": plan.to_string(),
        "layout": plan.describe(),
        "world_size": world_size,
        "accelerator": accelerator,
        "steps": steps,
        "skipped_steps": list(getattr(stats, "skipped", [])),
        # fp16: steps a gradient overflow skipped, and the loss scale at the end
        "overflow_steps": list(getattr(stats, "overflows", [])),
        "loss_scale": getattr(stats, "loss_scale", None),
        "final_loss": final if final == final else None,
        "step_time_s": _median(times),
        "mean_step_time_s": sum(times) / len(times) if times else None,
        "warmup_steps": skip,
        "tokens_per_s": None if samples else rate,
        "samples_per_s": rate if samples else None,
        "wall_s": wall_s,
        "memory_per_rank": memory,
    }
    named = final_losses(stats)
    if named is not None:
        info["final_losses"] = named
    return info


def final_losses(stats: Any) -> dict[str, float | None] | None:
    """Several models stepped on each batch (a GAN's two): each one's latest loss by the label
    the progress line gives it (None where NaN); None for one model, whose loss is
    ``final_loss``."""
    named = getattr(stats, "named_losses", {})
    if len(named) < 2:
        return None
    values = {name: float(value) for name, value in named.items()}
    return {name: v if v == v else None for name, v in values.items()}


def format_summary(info: dict[str, Any]) -> str:
    lines = [f"--- run summary: {info['layout']} on {info['world_size']} x "
             f"{info['accelerator']} ---"]
    named = info.get("final_losses")
    if named:
        lines.append("final loss      " + ", ".join(
            f"{name} {'nan' if v is None else f'{v:.4f}'}" for name, v in named.items()))
    elif info["final_loss"] is not None:
        lines.append(f"final loss      {info['final_loss']:.4f}")
    lines.append(f"steps           {info['steps']}")
    if info.get("skipped_steps"):
        lines.append(f"skipped (NaN)   {len(info['skipped_steps'])}: steps "
                     f"{', '.join(map(str, info['skipped_steps'][:10]))}"
                     + (" ..." if len(info["skipped_steps"]) > 10 else ""))
    if info.get("loss_scale") is not None:
        over = info.get("overflow_steps") or []
        lines.append(f"loss scale      {info['loss_scale']:g} (fp16), {len(over)} overflow"
                     f"{'s' * (len(over) != 1)} skipped"
                     + (": steps " + ", ".join(map(str, over[:10])) if over else "")
                     + (" ..." if len(over) > 10 else ""))
    if info["tokens_per_s"]:
        lines.append(f"throughput      {info['tokens_per_s']:,.0f} tokens/s")
    elif info.get("samples_per_s"):
        lines.append(f"throughput      {info['samples_per_s']:,.0f} samples/s")
    mean = info.get("mean_step_time_s")
    if not info["steps"]:  # resumed at the last step: nothing was timed
        lines.append("step time       - (no step ran)")
    else:
        lines.append(f"step time       {1000 * info['step_time_s']:.1f} ms (median)"
                     + (f", {1000 * mean:.1f} ms (mean)" if mean else "")
                     + (f", after {info['warmup_steps']} warm-up step"
                        f"{'s' * (info['warmup_steps'] > 1)}" if info.get("warmup_steps")
                        else ""))
    peaks = [m["peak_rss_bytes"] / 2**20 for m in info["memory_per_rank"]]
    lines.append("peak host RSS   " + ", ".join(f"r{i}: {p:,.0f} MiB" for i, p in enumerate(peaks)))
    dev = [m.get("peak_device_bytes") for m in info["memory_per_rank"]]
    if any(d is not None for d in dev):
        lines.append("peak device mem " + ", ".join(f"r{i}: {(d or 0) / 2**20:,.0f} MiB"
                                                     for i, d in enumerate(dev)))
    lines.append(f"wall time       {info['wall_s']:.1f} s")
    return "\n".join(lines)


def to_json(info: dict[str, Any]) -> str:
    return json.dumps(info, indent=2, default=str)
