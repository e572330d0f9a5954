"""``plait plan``: rank layouts for a model on a cluster, or evaluate one, or calibrate.

The lead's ``plait/cli.py`` registers it::

    sub = subparsers.add_parser("plan", help="...")
    add_plan_arguments(sub); sub.set_defaults(func=plan_command)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from plait.outputs import plot_path
from plait.plan import Plan

from ..outputs import add_format, command_failed
from .cost import Estimate, Workload, evaluate
from .hardware import GB, Cluster, load_cluster, presets, save_cluster
from .model_stats import (
    ModelStats,
    NoBlockStackError,
    _build,
    _model_of,
    build_factory,
    load_model,
    sample_keys,
    uneven_first_input,
)
from .search import MIN_CP_TOKENS, SearchResult, cp_searched, divisors, search
from .uncertainty import with_uncertainty

GiB = 2**30



# How the header says where the priced sequence length came from.
_SEQ_FROM = {"--seq": "", "dataset": " (the dataset's)", "model": " (the model's maximum)"}


def _stack_seqs(given: list[str], model: ModelStats,
                read: tuple[tuple[str, int], ...] = ()) -> tuple[tuple[str, int], ...]:
    """``--stack-seq BLOCK=N`` values as ``Workload.stack_seqs``; each BLOCK must be the first
    block of one of the model's further stacks (``ModelStats.more_stacks``). ``read``: the
    lengths read off the dataset (``ModelStats.data_stack_seqs``), for the stacks not given."""
    firsts = [m.first for m in model.more_stacks]
    out = []
    for item in given:
        block, _, n = item.partition("=")
        if not n.strip().isdigit() or int(n) < 1:
            raise ValueError(f"--stack-seq {item!r}: give BLOCK=N, a block's module path and a "
                             f"positive sequence length, e.g. encoder.block.0=48")
        if block not in firsts:
            where = (f"its further stacks start at {', '.join(firsts)}" if firsts else
                     "it has one stack of blocks, whose sequence is --seq")
            raise ValueError(f"--stack-seq {item!r}: {block} is not the first block of a "
                             f"further stack of {model.name} ({where})")
        out.append((block, int(n)))
    named = {block for block, _ in out}
    return tuple(out) + tuple((block, n) for block, n in read if block not in named)


def _stacks_said(work: Workload) -> str:
    """" (encoder.block.0's stack: seq 48)": each further stack priced at its own length."""
    if not work.stack_seqs:
        return ""
    return " (" + ", ".join(f"{block}'s stack: seq {n}" for block, n in work.stack_seqs) + ")"


def _seq_said(seq_from: str, model: ModelStats) -> str:
    """" (the model's maximum: the 512 rows of its position embedding pos)": where the
    sequence priced came from, read off the model's structure when no setting says it."""
    if seq_from == "model" and model.max_seq_from:
        return f" (the model's maximum: {model.max_seq_from})"
    return _SEQ_FROM[seq_from]

def _count(n: float) -> str:
    """1.2B, 345M, 12.3K or 812: a parameter count at a readable scale."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


def _params(model: ModelStats) -> str:
    """"47B params", or for a routed mixture of experts "46.7B params, 12.9B active: top-2 of
    8 experts)": compute is priced on the active ones, memory on all."""
    text = f"{_count(model.num_params)} params"
    if model.experts:
        k, count = model.experts
        text += f", {_count(model.active_params)} active: top-{k} of {count} experts"
    return text


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    p.add_argument("--model", help="reference preset (e.g. gpt-175b), HF config.json, model YAML, "
                                    "or 'package.module:factory'")
    p.add_argument("--cluster", default=None,
                   help=f"preset ({', '.join(presets())}) or a cluster YAML")
    p.add_argument("--nodes", type=int, default=None, metavar="N",
                   help="nodes of the --cluster preset (default: its own count, or what --plan "
                   "needs)")
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help="devices in all, instead of --nodes")
    p.add_argument("--global-batch", "--batch-size", "--batch", dest="global_batch",
                   metavar="N", type=int, default=None,
                   help="sequences per optimizer step, over all devices (required; also spelt "
                   "--batch-size, --batch)")
    p.add_argument("--seq", "--seq-len", dest="seq", metavar="N", type=int, default=None,
                   help="tokens per sequence (default: the longest sample among the first 64 "
                   "of a factory's dataset, else the model's maximum: a config's "
                   "max_position_embeddings, or the rows of a position nn.Embedding; also "
                   "spelt --seq-len)")
    p.add_argument("--stack-seq", dest="stack_seq", metavar="BLOCK=N", action="append",
                   default=[], help="a model with several stacks of blocks (an "
                   "encoder-decoder): the sequence of the stack whose first block is BLOCK, "
                   "when it is not --seq (e.g. --seq 16 --stack-seq encoder.block.0=48 for a "
                   "target of 16 tokens and a source of 48); repeatable")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="compute dtype (default: bf16; fp32 on cpu); fp16 for GPUs without "
                   "bf16 (T4, V100): mixed_precision=fp16, the loss scaled dynamically")
    p.add_argument("--top", type=int, default=5, metavar="N",
                   help="plans to list (default: 5)")
    p.add_argument("--plan", default=None, help="evaluate this layout only, e.g. 'dp=24,tp=8,pp=8'")
    p.add_argument("--memory-gb", type=float, default=None, metavar="GB",
                   help="memory per device in GB (10^9 bytes), instead of the cluster's")
    p.add_argument("--efficiency", type=float, default=None, metavar="FRACTION",
                   help="compute efficiency, a fraction of peak FLOP/s in (0, 1], instead of the "
                   "cluster's")
    add_format(p, "table")
    p.add_argument("--show-schedule", action="store_true",
                   help="also print the pipeline schedule of the best (or given) plan as a "
                        "step x rank grid (F0 F1 B0 ...)")
    p.add_argument("--pareto", default=None, metavar="PNG",
                   help="write a step time vs memory Pareto plot (needs the plot extra)")
    p.add_argument("--time-model", choices=("auto", "on", "off"), default="auto",
                   help="for a model without a stack of blocks (a ConvNet, an LSTM): time its "
                   "own forward + backward on this machine at each layout's per-rank batch, in "
                   "place of FLOPs at the profile's efficiency. auto (default): where --cluster "
                   "is a profile --calibrate wrote on this machine; on: the same, an error "
                   "where it is not; off: FLOPs always")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine and save a cluster profile: on a GPU/TPU the "
                        "compute efficiency of a block against --cluster's peak; on a CPU "
                        "matmul, block efficiency, gloo collectives")
    p.add_argument("--calibrate-world", type=int, default=2, metavar="N",
                   help="processes for --calibrate's collective measurement (default: 2)")
    p.add_argument("--profile-out", default="plait-cluster.yaml", metavar="YAML",
                   help="where --calibrate writes the profile (default: plait-cluster.yaml)")
    return p


def _positive(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, (int, float)) or not 0 < value < math.inf):
        raise ValueError(f"{name}={value!r} must be a positive number")


def _gb(x: float) -> str:
    return f"{x / GiB:.1f}"


def _fmt_axes(d: dict[str, float]) -> str:
    """Bytes per axis in GiB, as the memory column (KiB/MiB where smaller: no 1.2e-05)."""
    def size(v: float) -> str:
        for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if v >= scale:
                x = v / scale
                return (f"{x:.3g}" if x < 1000 else f"{x:,.0f}") + unit
        return f"{v:.0f}B"
    return " ".join(f"{k}:{size(v)}" for k, v in sorted(d.items())) or "-"


def estimate_json(e: Estimate) -> dict[str, Any]:
    return e.to_dict()


def format_table(estimates: list[Estimate]) -> str:
    head = ("#", "layout", "step s", "tokens/s", "TFLOP/s", "w/recomp", "MFU", "mem GiB",
            "bubble", "bytes/step by axis (wire, per rank)")
    rows = [head]
    for i, e in enumerate(estimates, 1):
        rows.append((str(i), e.plan.describe(), f"{e.step_time_s:.4g}", f"{e.tokens_per_s:,.0f}",
                     f"{e.tflops_per_device:.4g}", f"{e.tflops_per_device_hw:.4g}",
                     f"{e.mfu:.1%}", _gb(e.memory_bytes_per_device),
                     f"{e.bubble_fraction:.1%}", _fmt_axes(e.comm_bytes_per_step)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    notes: dict[str, list[str]] = {}
    for i, e in enumerate(estimates, 1):
        for note in e.notes:
            notes.setdefault(note, []).append(f"#{i}")
    lines += [f"note ({', '.join(rows)}): {note}" for note, rows in notes.items()]
    return "\n".join(lines)


def explain_winner(ranked: list[Estimate], cluster: Cluster,
                   result: SearchResult | None = None) -> list[str]:
    """A few lines on why the best plan wins and what limits it (``result``: the search it
    won, which says what a context-parallel winner was chosen over)."""
    best = ranked[0]
    tb = best.time_breakdown
    step = best.step_time_s
    out = [f"best: {best.plan.describe()} — {step:.4g} s/step, {best.mfu:.1%} MFU, "
           f"{_gb(best.memory_bytes_per_device)} of {_gb(cluster.memory_bytes)} GiB"]
    if best.stage_layers and best.plan.pp > 1:
        out.append(f"  stages (blocks per chunk): {list(best.stage_layers)}")
    if best.plan.cp > 1:
        out += _why_cp(best, result)
    flat = result.best_without_cp if result is not None and best.plan.cp > 1 else None
    for other in ranked[1:]:
        if other is flat:
            break  # said by _why_cp
        if other.plan.degrees() != best.plan.degrees() or other.plan.zero != best.plan.zero:
            gain = other.step_time_s / step - 1
            out.append(f"  beats {other.plan.describe()} by {gain:.1%}: " + _diff(best, other))
            break
    limits = []
    tp_share = tb.get("tp_comm", 0.0) > 0.01 * step and best.plan.tp > 1
    if best.bubble_fraction > 0.05:
        limits.append(f"pipeline bubble {best.bubble_fraction:.0%} (more microbatches or "
                      f"virtual stages shrink it)")
    exposed = tb["dp_grad_exposed"] + tb["param_gather"] + tb["zero3_gather_exposed"]
    if exposed / step > 0.03:
        limits.append(f"exposed data-parallel communication {exposed / step:.0%} of the step")
    if tp_share:
        limits.append(_tp_critical_path(best))
    headroom = cluster.memory_bytes - best.memory_bytes_per_device
    if headroom < 0.1 * cluster.memory_bytes:
        limits.append(f"memory: {_gb(headroom)} GiB headroom")
    if best.plan.activation_checkpointing != "none":
        limits.append(f"recomputation ({best.plan.activation_checkpointing}) costs "
                      f"{best.tflops_per_device_hw / best.tflops_per_device - 1:.0%} extra FLOPs "
                      f"to fit in memory")
    out.append("  limited by: " + ("; ".join(limits) if limits else "compute (the efficiency "
                                   "constant): nothing else is significant"))
    return out


def _why_cp(best: Estimate, result: SearchResult | None) -> list[str]:
    """Why a context-parallel layout won: what the best layout without cp costs, or why none
    fits; and what cp's own collectives cost."""
    out = []
    flat = result.best_without_cp if result is not None else None
    near = result.closest_without_cp if result is not None else None
    act = best.memory_breakdown.get("activations", 0.0)
    if result is not None and flat is None:
        detail = f": the closest, {near.plan.describe()}, {near.reason}" if near else ""
        out.append(f"  why cp={best.plan.cp}: no layout without context parallelism fits"
                   f"{detail}; cp={best.plan.cp} splits each sequence, {_gb(act)} GiB of "
                   f"activations per device here")
    elif flat is not None:
        gain = flat.step_time_s / best.step_time_s - 1
        out.append(f"  why cp={best.plan.cp}: {gain:.1%} faster than the best layout without "
                   f"it, {flat.plan.describe()} ({flat.step_time_s:.4g} s/step, "
                   f"{_gb(flat.memory_bytes_per_device)} GiB): " + _diff(best, flat))
    calls: dict[str, tuple[float, float]] = {}
    for t in best.traffic:
        if t.axis == "cp" and t.what in ("keys, values", "key, value grads") and t.calls:
            n, payload = calls.get(t.op, (0, 0.0))
            calls[t.op] = (n + t.calls, payload + t.payload)
    sizes = ", ".join(f"{n:,.0f} {op.replace('_', '-')}s of {payload / n / 2**20:.3g} MiB"
                      for op, (n, payload) in calls.items())
    cp_time = best.time_breakdown.get("cp_comm", 0.0)
    out.append(f"  cp's K/V collectives, waited for inside attention: {sizes} per step, "
               f"{cp_time:.3g}s ({cp_time / best.step_time_s:.0%} of the step)")
    return out


def _diff(a: Estimate, b: Estimate) -> str:
    ta, tb = a.time_breakdown, b.time_breakdown
    parts = []
    if b.bubble_fraction - a.bubble_fraction > 0.01:
        parts.append(f"bubble {a.bubble_fraction:.1%} vs {b.bubble_fraction:.1%}")
    ea = ta["dp_grad_exposed"] + ta["param_gather"] + ta["zero3_gather_exposed"]
    eb = tb["dp_grad_exposed"] + tb["param_gather"] + tb["zero3_gather_exposed"]
    if eb - ea > 0.01 * a.step_time_s:
        parts.append(f"exposed DP comm {ea:.3g}s vs {eb:.3g}s")
    if b.tflops_per_device_hw / max(b.tflops_per_device, 1e-12) > \
            a.tflops_per_device_hw / max(a.tflops_per_device, 1e-12) + 0.01:
        parts.append("less recomputation")
    cp_a, cp_b = ta.get("cp_comm", 0.0), tb.get("cp_comm", 0.0)
    if cp_b - cp_a > 0.01 * a.step_time_s:
        parts.append(f"less context-parallel traffic ({cp_a:.3g}s vs {cp_b:.3g}s per step)")
    tp_a, tp_b = a.comm_bytes_per_step.get("tp", 0.0), b.comm_bytes_per_step.get("tp", 0.0)
    if tb.get("tp_comm", 0.0) - ta.get("tp_comm", 0.0) > 0.01 * a.step_time_s:
        what = "less tensor-parallel traffic" if tp_a < 0.99 * tp_b else \
            "tensor-parallel collectives on faster links"
        parts.append(f"{what} ({ta.get('tp_comm', 0.0):.3g}s vs {tb['tp_comm']:.3g}s per step, "
                     f"{tp_a / 1e9:.3g} vs {tp_b / 1e9:.3g} GB per rank)")
    return ", ".join(parts) or "small differences in compute and communication"


def _tp_critical_path(e: Estimate) -> str:
    """The TP collectives the step waits for: how many, how large, how long."""
    calls: dict[str, tuple[float, float]] = {}
    for t in e.traffic:
        if t.axis == "tp" and t.calls:
            n, payload = calls.get(t.op, (0, 0.0))
            calls[t.op] = (n + t.calls, payload + t.payload)
    sizes = ", ".join(f"{n:,.0f} {op.replace('_', '-')}s of {payload / n / 2**20:.3g} MiB"
                      for op, (n, payload) in calls.items())
    share = e.time_breakdown["tp_comm"] / e.step_time_s
    return (f"tensor-parallel collectives on the critical path: {sizes} per step on the busiest "
            f"rank, {e.time_breakdown['tp_comm']:.3g}s ({share:.0%} of the step)")


def _most_devices(model: ModelStats, cluster: Cluster, work: Workload) -> int:
    """The most devices, up to the cluster's, that some dp x cp x tp x pp layout of ``model``
    uses for ``work``: dp divides the global batch, pp is at most one stage per block, tp
    divides what tensor parallelism splits, cp is one the search tries
    (:func:`~plait.planner.search.cp_searched`), and a pipeline's microbatches are at least its
    stages (as :func:`~plait.planner.search.candidate_plans` asks)."""
    tps = [t for t in range(1, cluster.world_size + 1) if not model.tp_refuses(t)]
    cps = [c for c in range(1, cluster.world_size + 1) if cp_searched(model, work, c)]
    return max((d * t * p * c for t in tps for c in cps for p in range(1, model.n_layers + 1)
                for d in divisors(work.global_batch)
                if d * t * p * c <= cluster.world_size
                and (p == 1 or work.global_batch // d >= p)), default=1)


def explain_nothing_fits(result: SearchResult, model: ModelStats, cluster: Cluster,
                         work: Workload | None = None, dtype: str = "bf16") -> str:
    if work is not None and not result.evaluated and not result.rejected:
        # No layout was priced at all: none splits this many devices, which no amount of
        # memory changes (a small model, a small batch, a large --devices or preset).
        most = _most_devices(model, cluster, work)
        return (f"no layout of {model.name} spreads over {cluster.world_size} x {cluster.name}: "
                f"the data-parallel degree divides the global batch {work.global_batch}, a "
                f"pipeline has at most one stage per block ({model.n_layers}), tensor "
                f"parallelism divides the ffn ({model.ffn})"
                + (f" and the heads ({model.n_heads}), 2 x cp the sequence ({work.seq}) "
                   f"leaving each cp rank at least {MIN_CP_TOKENS:,} tokens"
                   if model.attention else "") + "; "
                f"at most {most} devices take part. Plan for --devices {most}, or a larger "
                f"--global-batch")
    lines = [f"no layout of {model.name} ({model.num_params / 1e9:.3g}B parameters) fits on "
             f"{cluster.world_size} x {cluster.name} ({_gb(cluster.memory_bytes)} GiB each)."]
    if result.rejected:
        why = ", ".join(f"{k}: {v}" for k, v in sorted(result.rejected.items()))
        lines.append(f"  rejected layouts: {why}")
    if result.closest is not None:
        lines.append(f"  closest: {result.closest.plan.describe()} — {result.closest.reason}")
    state = 16 * model.num_params
    need = math.ceil(state / max(cluster.memory_bytes - cluster.reserve_bytes, 1))
    lines.append(f"  model state alone (fp32 params + grads + AdamW = 16 B/param) is "
                 f"{state / GiB:,.0f} GiB: at least {need} devices with ZeRO-3 before activations")
    if work is not None:
        for factor in (2, 4, 8, 16, 32, 64):
            devices = cluster.world_size * factor
            try:
                bigger = cluster.with_world(devices)
            except ValueError:
                continue
            if devices < need:
                continue
            r = search(model, bigger, work, dtype=dtype, top=1)
            if r.best is not None:
                lines.append(f"  smallest cluster that fits (x2 steps): {devices} devices — "
                             f"{r.best.plan.describe()}")
                break
        else:
            lines.append("  nothing fits up to 64x this cluster: reduce the sequence length, "
                         "the model, or use devices with more memory")
    if dtype == "fp32":
        lines.append("  try --dtype bf16 (halves activation memory)")
    return "\n".join(lines)


def pareto_front(estimates: list[Estimate]) -> list[Estimate]:
    front, best_mem = [], math.inf
    for e in sorted(estimates, key=lambda e: (e.step_time_s, e.memory_bytes_per_device)):
        if e.memory_bytes_per_device < best_mem:
            front.append(e)
            best_mem = e.memory_bytes_per_device
    return front


def write_pareto(path: str, estimates: list[Estimate]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--pareto needs matplotlib: pip install 'plait[plot]'") from None
    front = pareto_front(estimates)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([e.memory_bytes_per_device / GiB for e in estimates],
               [e.step_time_s for e in estimates], s=8, alpha=0.4, label="feasible layouts")
    ax.plot([e.memory_bytes_per_device / GiB for e in front], [e.step_time_s for e in front],
            "o-", color="C3", label="Pareto front")
    for e in front[:6]:
        ax.annotate(e.plan.to_string()[:40], (e.memory_bytes_per_device / GiB, e.step_time_s),
                    fontsize=6)
    ax.set_xlabel("peak memory per device (GiB)")
    ax.set_ylabel("predicted step time (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plan_command(args: argparse.Namespace) -> int:
    """Run ``plait plan``; returns the exit code (0 ok, 1 nothing fits, 2 bad input)."""
    try:
        if args.format != "json":
            return _plan(args, sys.stdout)
        # stdout is the JSON report alone: what a model factory of the user's prints as it is
        # imported and built (to be asked about layouts) goes to stderr
        out = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            return _plan(args, out)
    except ValueError as exc:
        return command_failed("plan", f"error: {exc}", 2, args.format)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, then as it was. A search makes
    hundreds of thousands of short-lived objects, which start full collections that walk
    every object alive: about 170k where torch is imported (a model given as a factory or a
    Hugging Face model), 55-250 ms each, about 15% of the command's time after its imports;
    3-7% on a preset model, which imports no torch. What the search frees, it frees by
    reference counting all the same."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _plan(args: argparse.Namespace, out: TextIO) -> int:
    """The command; its JSON report goes to ``out``."""
    from . import constants_for

    started = time.perf_counter()  # the header says what "priced in" leaves out

    if args.calibrate and _accelerator() is not None:
        from .block_probe import calibrate_accelerator
        if not args.cluster:
            raise ValueError(f"--calibrate on {_accelerator()} needs --cluster (the preset or "
                             f"YAML whose bf16 peak the efficiency is measured against)")
        cluster = calibrate_accelerator(load_cluster(args.cluster), str(_accelerator()))
        path = save_cluster(cluster, args.profile_out)
        _calibrated(args, path, cluster, out,
                    f"wrote {path}: compute efficiency {cluster.extra['compute_efficiency']:.3f}"
                    f" of {cluster.peak('bf16') / 1e12:.0f} TFLOP/s bf16 on {_accelerator()}")
        if not args.model:
            return 0
        args.cluster = str(path)
    elif args.calibrate:
        from .cpu.probes import calibrate
        cluster = calibrate(world=args.calibrate_world)
        path = save_cluster(cluster, args.profile_out)
        _calibrated(args, path, cluster, out,
                    f"wrote {path}: peak {cluster.peak('fp32') / 1e9:.1f} GFLOP/s per process, "
                    f"block efficiency {cluster.extra['compute_efficiency']:.2f}, all-reduce "
                    f"{cluster.intra_bw / 1e9:.2f} GB/s, {cluster.intra_latency * 1e6:.0f} "
                    f"us/step")
        if not args.model:
            return 0
        args.cluster = args.cluster or str(path)
    if args.pareto:  # checked before the search: a missing folder must not cost the work
        args.pareto = plot_path(args.pareto, "--pareto", "pareto.png")
    for name in ("nodes", "devices", "global_batch", "seq", "top", "memory_gb", "efficiency"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if not args.model:
        raise ValueError("--model is required (a preset, config.json, YAML or module:factory)")
    if not args.cluster:
        raise ValueError(f"--cluster is required ({', '.join(presets())} or a YAML path)")
    if args.global_batch is None:
        raise ValueError("--global-batch is required (sequences per optimizer step)")
    if args.efficiency is not None and args.efficiency > 1:
        raise ValueError(f"--efficiency={args.efficiency} must be a fraction of peak in (0, 1]")
    given = Plan.load(args.plan) if args.plan else None
    devices = args.devices
    if given is not None and devices is None and args.nodes is None:
        devices = given.world_size
    cluster = load_cluster(args.cluster, nodes=args.nodes, devices=devices)
    if args.memory_gb is not None:
        cluster = cluster.with_memory(args.memory_gb * GB)
    dtype = args.dtype or ("fp32" if cluster.device == "cpu" else "bf16")
    # under 16-bit compute, context parallelism gathers K and V in the dtypes the model's own
    # code hands attention (a rotary embedding in fp32 promotes the keys): read off a factory's
    # forward pass, as the ledger reads them
    half = (given.mixed_precision if given is not None else dtype) != "fp32"
    try:
        model = load_model(args.model, attention_dtypes=half)
    except NoBlockStackError:
        if not isinstance(args.model, str) or ":" not in args.model:
            raise
        return _plan_whole(args, cluster, dtype, given, out)
    # The sequence priced: --seq, else what the factory's dataset holds (what training runs),
    # else the model's maximum (a Hugging Face config's max_position_embeddings).
    seq, seq_from = next(((value, source) for value, source in (
        (args.seq, "--seq"), (model.data_seq, "dataset"), (model.max_seq, "model"))
        if value), (None, "--seq"))
    if seq is None:
        raise ValueError("--seq is required (the model does not say its sequence length: no "
                         "max_position_embeddings, n_positions or max_seq_len, and no dataset "
                         "row of token ids or (positions, features) to read it from); pass the "
                         "positions each block sees per sample, e.g. --seq 196 for a ViT's 14 x "
                         "14 patches")
    constants = constants_for(cluster)
    if args.efficiency is not None:
        import dataclasses
        constants = dataclasses.replace(constants, compute_efficiency=args.efficiency)
    # each further stack's sequence: --stack-seq, else the dataset's where it says the main
    # stack's (an encoder-decoder's source beside its target), else the main stack's
    read = model.data_stack_seqs if seq_from == "dataset" else ()
    work = Workload(args.global_batch, seq, stack_seqs=_stack_seqs(args.stack_seq, model, read))
    usable = [d for d in divisors(cluster.world_size) if args.global_batch % d == 0]
    if given is None and len(usable) == 1 and cluster.world_size > 1:
        raise ValueError(f"global-batch={args.global_batch} shares no factor with "
                         f"{cluster.world_size} devices: data parallelism is impossible; use a "
                         f"batch divisible by a factor of the device count, e.g. "
                         f"{cluster.world_size * max(1, args.global_batch // cluster.world_size)}")

    check, not_asked = _ask_the_model(args.model, model)
    if given is not None:
        if given.world_size != cluster.world_size:
            raise ValueError(f"--plan uses {given.world_size} devices, the cluster has "
                             f"{cluster.world_size}; pass --devices {given.world_size}")
        refused = check(given) if check is not None else None
        if refused is not None:
            message = f"{args.model} refuses {given.to_string()}: {refused}"
            if args.format == "json":
                print(json.dumps({"model": model.name, "cluster": cluster.name,
                                  "devices": cluster.world_size, "plans": [],
                                  "message": message}, indent=2), file=out)
            else:
                print(message)
            return 1
        est = with_uncertainty(evaluate(given, model, cluster, work, constants), model, cluster,
                               work, constants)
        if args.format == "json":
            print(json.dumps({"model": model.name, "cluster": cluster.name,
                              "devices": cluster.world_size, "global_batch": args.global_batch,
                              "seq": seq, "seq_from": seq_from,
                              "seq_read_from": model.max_seq_from or None,
                              "stack_seqs": dict(work.stack_seqs),
                              "plans": [estimate_json(est)]}, indent=2), file=out)
        else:
            if seq_from != "--seq":
                print(f"{given.describe()}: global batch {args.global_batch} x seq {seq}"
                      f"{_seq_said(seq_from, model)}{_stacks_said(work)}")
            if est.step_time_s < math.inf:
                print(format_table([est]))
            if not est.feasible:
                print(f"does not fit / cannot run: {est.reason}")
            else:
                print("\n".join(explain_winner([est], cluster)))
                _print_schedule(args, given)
        return 0 if est.feasible else 1

    # Asked only about what is shown (or plotted): the check may run the model.
    reading = time.perf_counter() - started  # the model read (built, traced), its check made
    with _collector_paused():
        result = search(model, cluster, work, dtype=dtype, constants=constants,
                        top=0 if check is None or args.pareto else args.top, layout_check=check)
    ranked = result.ranked
    asked = [f"left out {n} layout{'s' * (n > 1)} that would have ranked: {kind}"
             for kind, n in sorted(result.rejected.items()) if kind.startswith("refused by")]
    asked += [not_asked] if not_asked else []
    for e in ranked[:args.top]:
        with_uncertainty(e, model, cluster, work, constants)
    if args.pareto and ranked:
        write_pareto(args.pareto, ranked)
    if args.format == "json":
        print(json.dumps({"model": model.name, "cluster": cluster.name,
                          "devices": cluster.world_size, "global_batch": args.global_batch,
                          "seq": seq, "seq_from": seq_from,
                          "seq_read_from": model.max_seq_from or None,
                          "stack_seqs": dict(work.stack_seqs),
                          "search_seconds": result.seconds, "read_seconds": reading,
                          "evaluated": result.evaluated, "fit": result.fit,
                          "rejected": result.rejected,
                          "plans": [estimate_json(e) for e in ranked[:args.top]],
                          "explain": explain_winner(ranked, cluster, result) if ranked else [],
                          "model_check": asked,
                          "message": None if ranked else
                          explain_nothing_fits(result, model, cluster, work, dtype)},
                         indent=2), file=out)
        return 0 if ranked else 1
    if not ranked:
        print(explain_nothing_fits(result, model, cluster, work, dtype))
        return 1
    print(f"{model.name} ({_params(model)}) on {cluster.world_size} x "
          f"{cluster.name}, global batch {args.global_batch} x seq {seq}"
          f"{_seq_said(seq_from, model)}{_stacks_said(work)}, {dtype}: "
          f"{result.evaluated} layouts priced in {result.seconds:.2f}s (after {reading:.2f}s "
          f"reading the model), {result.fit} fit in memory"
          + (f", the best {min(args.top, len(ranked))} shown" if result.fit > args.top else ""))
    print(format_table(ranked[:args.top]))
    print("\n".join(explain_winner(ranked, cluster, result)))
    for line in asked:
        print(line)
    _print_schedule(args, ranked[0].plan)
    if args.pareto:
        print(f"Pareto plot: {args.pareto}")
    return 0


def _plan_whole(args: argparse.Namespace, cluster: Cluster, dtype: str,
                given: Plan | None, out: TextIO) -> int:
    """``plait plan`` for a factory model without a stack of repeated matmul blocks (a ConvNet,
    an LSTM): its data-parallel layouts ranked from measured facts
    (:mod:`plait.planner.whole_model`), tp and pp left out with the model's reasons. The report
    goes to ``out``."""
    import dataclasses
    import functools

    from ..auto import layout_check
    from . import constants_for
    from .whole_model import estimate, excluded, explain, from_factory, nothing_fits, rank

    say = functools.partial(print, file=out)
    whole, module = from_factory(args.model)
    timing, why = _time_model(args, cluster)
    check, real, built = None, None, None
    if whole.num_params <= ASK_LIMIT:
        built = _build(args.model, "cpu") if timing or any(
            p.is_meta for p in module.parameters()) else module
        real = _model_of(built, args.model)
        check = layout_check(real, dict_keys=sample_keys(args.model),
                             uneven_rows=uneven_first_input(args.model))
    elif timing:
        timing, why = False, (f"not timed: {args.model} ({_count(whole.num_params)} "
                              f"parameters) is over the {_count(ASK_LIMIT)} plait builds on "
                              f"the host")
    reasons = excluded(whole, check, real)
    constants = constants_for(cluster)
    if args.efficiency is not None:
        constants = dataclasses.replace(constants, compute_efficiency=args.efficiency)
    timer = None
    if timing:
        from .model_timing import factory_timer

        timer = factory_timer(args.model, whole.saved_per_sample, cluster, built=built,
                              progress=functools.partial(print, file=sys.stderr))
    head = {"model": whole.name, "cluster": cluster.name, "devices": cluster.world_size,
            "global_batch": args.global_batch, "kind": "data parallelism only",
            "measured": {"params": whole.num_params, "buffer_bytes": whole.buffer_bytes,
                         "forward_flops_per_sample": whole.flops_per_sample,
                         "saved_bytes_per_sample": whole.saved_per_sample,
                         "forward_ops": whole.forward_ops, "backward_ops": whole.backward_ops,
                         "update_ops": whole.update_ops_fixed
                         + whole.update_ops_per_tensor * whole.param_tensors,
                         "sample_shape": list(whole.sample_shape),
                         "sample_from": whole.sample_from,
                         "batchnorm_layers": len(whole.batchnorm),
                         "checkpointed_blocks": [b.name for b in whole.blocks]},
            "compute_timed": timing, "compute_timing": why,
            "excluded": reasons}
    if given is not None:
        if given.tp > 1 or given.pp > 1:
            axis = "tp" if given.tp > 1 else "pp"
            message = f"{args.model} refuses {given.to_string()}: {reasons[axis]}"
            say(json.dumps({**head, "plans": [], "message": message}, indent=2)
                  if args.format == "json" else message)
            return 1
        est = estimate(whole, given, cluster, args.global_batch, constants, timer)
        if args.format == "json":
            say(json.dumps({**head, "plans": [estimate_json(est)]}, indent=2))
        else:
            say(why)
            if est.step_time_s < math.inf:
                say(format_table([est]))
            if not est.feasible:
                say(f"does not fit / cannot run: {est.reason}")
        return 0 if est.feasible else 1
    result = rank(whole, cluster, args.global_batch, dtype=dtype, c=constants, top=args.top,
                  timer=timer)
    ranked = result.ranked
    if args.format == "json":
        say(json.dumps({**head, "evaluated": result.evaluated, "fit": result.fit,
                          "rejected": result.rejected,
                          "plans": [estimate_json(e) for e in ranked],
                          "explain": explain(ranked),
                          "message": None if ranked else nothing_fits(result)}, indent=2))
        return 0 if ranked else 1
    if not ranked:
        say(nothing_fits(result))
        return 1
    say(f"{whole.name} ({_count(whole.num_params)} parameters, no stack of repeated matmul "
          f"blocks: data-parallel layouts only) on {cluster.world_size} x {cluster.name}, "
          f"global batch {args.global_batch}, {dtype}: {result.evaluated} layouts priced, "
          f"{result.fit} fit in memory")
    say(why)
    say(format_table(ranked))
    say("\n".join(explain(ranked)))
    for axis, why in reasons.items():
        say(f"not searched: {axis}: {why}")
    return 0


def _time_model(args: argparse.Namespace, cluster: Cluster) -> tuple[bool, str]:
    """Whether ``plait plan`` times the model's own forward + backward on this machine
    (``--time-model``, :mod:`plait.planner.model_timing`), and a line saying where each
    layout's compute time comes from. Local timings price only a profile calibrated on this
    machine: ``on`` where the cluster is not one is an error, never a silent FLOP count."""
    from .model_timing import is_this_machine, rank_threads

    mode = getattr(args, "time_model", "auto")
    if mode == "off":
        return False, "compute: from FLOPs and aten ops (--time-model off)"
    here, why = is_this_machine(cluster)
    if not here:
        if mode == "on":
            raise ValueError(f"--time-model on: {why}")
        return False, f"compute: from FLOPs and aten ops, not timed: {why}"
    if args.efficiency is not None and mode == "auto":
        return False, (f"compute: from FLOPs at --efficiency {args.efficiency:g} (give "
                       f"--time-model on to time the model on this machine instead)")
    threads = rank_threads(cluster)
    return True, (f"compute: the model's forward + backward timed on this machine (cluster "
                  f"{cluster.name} was calibrated here) at each layout's per-rank batch, "
                  f"{threads} thread{'s' if threads != 1 else ''} per rank as plait run gives "
                  f"each of {min(cluster.world_size, cluster.devices_per_node)} ranks; ranks "
                  f"that outnumber the cores are priced by their share of one, contention "
                  f"between ranks is not measured")


# The largest factory model ``plait plan`` builds on the host to ask it about layouts (fp32:
# 1.2 GB and a few seconds to initialise); larger ones are priced from their sizes only.
ASK_LIMIT = 300_000_000


def _ask_the_model(spec: Any, stats: ModelStats
                   ) -> tuple[Callable[[Plan], str | None] | None, str | None]:
    """For a ``pkg.mod:factory`` model: the check of what the model itself refuses
    (``plait.auto.layout_check``: sequence parallelism its blocks do not allow, a tp its layer
    plan cannot take, a pipeline it cannot be cut into), built from a real copy on the host
    (the stats came from one on the meta device, which cannot be run). None, and a line saying
    so, for a model above ``ASK_LIMIT`` parameters; None and None for presets and configs,
    which are plait's reference transformer."""
    if not isinstance(spec, str) or ":" not in spec or Path(spec).exists():
        return None, None
    if stats.num_params > ASK_LIMIT:
        return None, (f"not asked: {spec} ({_count(stats.num_params)} parameters) is priced "
                      f"from its sizes only (plait builds models up to "
                      f"{_count(ASK_LIMIT)} on the host to ask them); plan='auto' asks it "
                      f"when it is laid out")
    from ..auto import layout_check

    return layout_check(build_factory(spec, "cpu"), dict_keys=sample_keys(spec),
                        uneven_rows=uneven_first_input(spec)), None


def _accelerator() -> str | None:
    """The local accelerator's device type (cuda, xla, ...), or None on a CPU-only machine."""
    import torch

    if not torch.accelerator.is_available():
        return None
    acc = torch.accelerator.current_accelerator()
    return acc.type if acc is not None else None


def _calibrated(args: argparse.Namespace, path: Path, cluster: Cluster, out: TextIO,
                line: str) -> None:
    """Say where ``--calibrate`` wrote the profile: ``line`` on stdout; under ``--format
    json`` the profile itself as the JSON report when it is the whole answer (no --model),
    else ``line`` on stderr (stdout is then the plan's one JSON object)."""
    if args.format != "json":
        print(line)
    elif not args.model:
        print(json.dumps({"profile": str(path), "cluster": cluster.to_yaml_dict()}, indent=2),
              file=out)
    else:
        print(line, file=sys.stderr)


def _print_schedule(args: argparse.Namespace, plan: Plan) -> None:
    if not getattr(args, "show_schedule", False):
        return
    if plan.pp == 1:
        print("schedule: no pipeline in this plan (pp=1)")
        return
    from ..parallel.schedules import format_schedule

    print(format_schedule(plan.pp_schedule, plan.pp, plan.microbatches, plan.virtual_stages))


def main(argv: list[str] | None = None) -> int:  # for `python -m plait.planner.cli`
    parser = add_plan_arguments(argparse.ArgumentParser(prog="plait plan"))
    return plan_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
