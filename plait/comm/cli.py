"""CLI logic for ``plait bench comm`` and ``plait comm`` (plait/cli.py registers these).

Kept as plain functions ``add_*_arguments(parser)`` / ``*_command(args) -> int`` so the top-level
CLI stays thin and these can be called from tests without a subprocess.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
from typing import TYPE_CHECKING, Any

from ..outputs import add_format, command_failed, plot_path
from . import bench

if TYPE_CHECKING:
    from ..plan import Plan


# ------------------------------------------------------------------------- plait bench comm
def add_bench_comm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", default="all",
                        help="comma list of collectives (default all: "
                             f"{','.join(bench.BENCH_OPS)})")
    parser.add_argument("--min-bytes", default="1K", metavar="BYTES",
                        help="smallest message in bytes; K, M, G are powers of 1024 (default: "
                        "1K)")
    parser.add_argument("--max-bytes", default="256M", metavar="BYTES",
                        help="largest message in bytes, as --min-bytes (default: 256M)")
    parser.add_argument("--nproc", type=int, default=2, metavar="N",
                        help="local ranks (processes) to spawn (default: 2)")
    parser.add_argument("--iters", type=int, default=10, metavar="N",
                        help="timed calls per size (default: 10)")
    parser.add_argument("--warmup", type=int, default=2, metavar="N",
                        help="untimed calls per size before the timed ones (default: 2)")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                        help="process-group backend (default: gloo)")
    add_format(parser, "table")
    parser.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS",
                        help="seconds before the run is declared hung (default: 3600)")


def bench_comm_command(args: argparse.Namespace) -> int:
    try:
        if not args.timeout > 0:
            raise ValueError(f"--timeout={args.timeout} must be a positive number of seconds")
        if args.backend == "nccl":
            import torch

            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if have < args.nproc:
                raise ValueError(f"--backend nccl needs one CUDA GPU per rank: --nproc "
                                 f"{args.nproc}, {have} GPU(s) here; use --backend gloo")
        results = bench.bench_comm(args.ops, args.min_bytes, args.max_bytes, nproc=args.nproc,
                                   iters=args.iters, warmup=args.warmup, backend=args.backend,
                                   timeout=args.timeout)
    except ValueError as e:
        return command_failed("bench comm", f"error: {e}", 2, args.format)
    if args.format == "json":
        print(json.dumps({"world_size": args.nproc, "backend": args.backend,
                          "definitions": "algbw = size/time; busbw = algbw * bus_factor "
                                         "(nccl-tests); size = payload per volumes.py",
                          "results": results}, indent=2))
    else:
        print(f"plait bench comm: {args.nproc} ranks, {args.backend}, {args.iters} iters/size")
        print(bench.format_table(results))
    return 0


# ------------------------------------------------------------------------- plait comm
# Sequences per data-parallel replica when neither --global-batch nor --replica-batch is given.
REPLICA_BATCH = 4


class _Spelled(argparse.Action):
    """Store the value and the spelling typed (``args.global_batch_flag``): ``--batch`` meant
    sequences per replica on ``plait comm`` before it meant the global batch, as on every other
    command, and a user who typed it is told when the two meanings differ."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_flag", option_string)


def add_comm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, help="plan string or file, e.g. 'tp=2,sp=true'")
    parser.add_argument("--model", default="test",
                        help="a reference model preset, or your pkg.module:function returning "
                        "(model, dataset, loss_fn) or (model, dataset, loss_fn, collate_fn), "
                        "as plait check takes (default: test)")
    parser.add_argument("--steps", type=int, default=2, metavar="N",
                        help="measured training steps (default: 2)")
    parser.add_argument("--warmup", type=int, default=2, metavar="N",
                        help="training steps before measuring, not counted: lazy init, DDP "
                        "bucket rebuild (default: 2)")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--global-batch", "--batch-size", "--batch", dest="global_batch",
                       metavar="N", type=int, default=None, action=_Spelled,
                       help="sequences per step over all data-parallel replicas, as on every "
                       "plait command; a multiple of the plan's data-parallel degree (default: "
                       f"{REPLICA_BATCH} per replica; also spelt --batch-size, --batch)")
    sizes.add_argument("--replica-batch", dest="replica_batch", metavar="N", type=int,
                       default=None, help="sequences per data-parallel replica per step, "
                       "instead of --global-batch: the global batch is this times the "
                       f"data-parallel degree (default: {REPLICA_BATCH})")
    parser.add_argument("--seq", "--seq-len", dest="seq", metavar="N", type=int, default=None,
                        help="tokens per sequence of a reference preset (default: the model's "
                        "max, at most 128; also spelt --seq-len); a factory's dataset sets its "
                        "own")
    add_format(parser, "table")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="write a bar chart (needs the plot extra: matplotlib)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="seconds before the run is declared hung (default: 600)")


def comm_worker(rank: int, world: int, plan: Plan | str, model_name: str, steps: int,
                warmup: int, batch: int, seq: int, ledger: bool = True,
                overrides: dict | None = None) -> dict:
    """One rank of ``plait comm``: plait's own runtime (``plait.init(plan, ledger=True)``,
    ``run.parallelize``, ``run.step``) trains the reference model on the bundled corpus for
    ``warmup`` + ``steps`` steps; the ledger records the last ``steps`` and ``run.summary()``
    puts them beside ``plait.comm.predict``'s closed form. ``overrides``: fields of the
    preset's TransformerConfig to change (``{"n_kv_heads": 1}``)."""
    import torch

    from .. import runtime
    from ..data import TextDataset
    from ..models import transformer as tfm

    torch.set_num_threads(1)
    # format given: not the --format of the command that spawned this worker (its sys.argv)
    run = runtime.init(plan, quiet=True, ledger=ledger, format="text", seed=0)
    run.ledger_warmup = warmup
    try:
        cfg = tfm.preset(model_name, max_seq_len=max(seq, tfm.preset(model_name).max_seq_len),
                         **(overrides or {}))
        model = run.parallelize(tfm.build(cfg, seed=run.seed))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dataset = TextDataset(seq_len=seq, split="train")
        for b in run.loader(dataset, batch_size=batch * run.dp_size, steps=warmup + steps):
            run.step(model, b, tfm.lm_loss, opt)
        info = run.summary()
        del model, opt
        return info.get("comm", {})
    finally:
        run.close()


def factory_comm_worker(rank: int, world: int, plan: Plan, spec: str, steps: int,
                        warmup: int, global_batch: int) -> dict:
    """One rank of ``plait comm --model pkg.module:function``: the user's factory's model,
    built under the run's seed, laid out with this rank's first batch as ``example`` (the
    ledger's expected column under tp, sp and pp is priced on it), trained for ``warmup`` +
    ``steps`` steps on the factory's dataset through ``run.loader`` with AdamW; returns
    ``run.summary()["comm"]``, as :func:`comm_worker` does for the reference model."""
    import torch

    from .. import runtime
    from ..user_factory import build_parts, dataset_refusal

    torch.set_num_threads(1)
    # format given: not the --format of the command that spawned this worker (its sys.argv)
    run = runtime.init(plan, quiet=True, ledger=True, format="text", seed=0)
    run.ledger_warmup = warmup
    try:
        parts = build_parts(spec, run.seed)
        micro = plan.grad_accum * (plan.microbatches if plan.pp > 1 else 1)
        refusal = dataset_refusal(spec, parts.dataset, global_batch, plan.dp * micro)
        if refusal is not None:
            raise ValueError(refusal)
        batches = iter(run.loader(parts.dataset, batch_size=global_batch, steps=warmup + steps,
                                  collate_fn=parts.collate_fn))
        first = next(batches)
        model = run.parallelize(parts.model, example=first)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # as a user's loop builds it
        for batch in itertools.chain((first,), batches):  # loaded one step at a time
            run.step(model, batch, parts.loss_fn, opt)
        info = run.summary()
        del model, opt
        return info.get("comm", {})
    finally:
        run.close()


def comm_command(args: argparse.Namespace) -> int:
    from ..plan import Plan
    from ..spawn import run_distributed, user_errors
    from ..user_factory import factory_or_preset, pipeline_refusal
    from .report import CommReport
    # --format json: stdout is the report alone; what the user's model code prints (at import,
    # when built, in the ranks) goes to stderr
    own_output = (contextlib.redirect_stdout(sys.stderr) if args.format == "json"
                  else contextlib.nullcontext())
    try:
        plan = Plan.load(args.plan) if args.plan.endswith((".yaml", ".yml", ".json")) \
            else Plan.from_string(args.plan)
        with own_output:
            factory = factory_or_preset(args.model)  # a bad spec fails here, before any rank
        if factory is not None and args.seq is not None:
            raise ValueError(f"--seq={args.seq} sets the length of a reference preset's "
                             f"batches; with --model {args.model} the sequences are what your "
                             f"dataset returns: drop --seq")
        if args.steps < 1 or args.warmup < 0:
            raise ValueError(f"--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0")
        replica = replica_batch(args, plan)
        if args.seq is not None and not 1 <= args.seq <= 4096:
            raise ValueError(f"--seq={args.seq} must be in 1..4096 (tokens per sequence)")
        if not args.timeout > 0:
            raise ValueError(f"--timeout={args.timeout} must be a positive number of seconds")
        if args.plot:
            args.plot = plot_path(args.plot, "--plot", "comm.png")
        if plan.world_size < 2:
            raise ValueError(f"plan {args.plan!r} runs on 1 rank: nothing is communicated; "
                             f"give a plan with a degree > 1, e.g. 'dp_replicate=2'")
        seq: int | None = None
        if factory is None:
            from ..models.transformer import preset

            seq = args.seq or min(preset(args.model).max_seq_len, 128)
        else:
            with own_output:
                refusal = pipeline_refusal(plan, factory)
            if refusal is not None:
                raise ValueError(refusal)
    except ValueError as e:
        return command_failed("comm", f"error: {e}", 2, args.format)
    warning = batch_warning(args, plan)
    if warning:
        print(f"plait comm: warning: {warning}", file=sys.stderr)
    # The Plan itself, not its string form: that one leaves out plan.options.
    with user_errors(), own_output:
        if factory is None:
            results = run_distributed(comm_worker, plan.world_size, plan, args.model,
                                      args.steps, args.warmup, replica, seq,
                                      timeout=args.timeout)
        else:
            results = run_distributed(factory_comm_worker, plan.world_size, plan, factory,
                                      args.steps, args.warmup, replica * plan.dp,
                                      timeout=args.timeout,
                                      stdout_to_stderr=args.format == "json")
    data = results[0]
    if args.format == "json":
        print(json.dumps({"plan": _plan_text(plan), "model": args.model,
                          "global_batch": replica * plan.dp, "replica_batch": replica,
                          "seq": seq, **data}, indent=2))
    else:
        report = _from_dict(CommReport, data)
        shape = f" x seq {seq}" if seq is not None else ""
        print(f"plait comm: plan {_plan_text(plan)}, model {args.model}, global batch "
              f"{replica * plan.dp} ({replica} per replica){shape}")
        print(report.table())
    if args.plot:
        written = _from_dict(CommReport, data).plot(args.plot)
        if written is None:
            print("plait comm: --plot needs matplotlib (pip install 'plait[plot]')",
                  file=sys.stderr)
        else:
            print(f"wrote {written}", file=sys.stderr if args.format == "json" else sys.stdout)
    return 0


def replica_batch(args: argparse.Namespace, plan: Plan) -> int:
    """Sequences per data-parallel replica per step, from ``--global-batch`` or
    ``--replica-batch`` (or the default); ValueError (the value and a fix) when it is not
    positive or does not split evenly over the replicas and their micro-batches."""
    micro = plan.grad_accum * (plan.microbatches if plan.pp > 1 else 1)
    split = " x ".join([*([f"grad_accum={plan.grad_accum}"] if plan.grad_accum > 1 else []),
                        *([f"{plan.microbatches} microbatches"] if plan.pp > 1 else [])])
    if args.global_batch is not None:
        flag = getattr(args, "global_batch_flag", None) or "--global-batch"
        parts = plan.dp * micro
        if args.global_batch < 1:
            raise ValueError(f"{flag}={args.global_batch} must be >= 1 (sequences per step over "
                             f"all replicas)")
        if args.global_batch % parts:
            raise ValueError(
                f"{flag}={args.global_batch} does not split over {plan.dp} data-parallel "
                f"replica(s){f' x {split} = {parts}' if micro > 1 else ''}: use a multiple "
                f"of {parts}, e.g. "
                f"--global-batch {parts * max(1, args.global_batch // parts)}, or "
                f"--replica-batch N for N sequences per replica")
        return int(args.global_batch // plan.dp)
    if args.replica_batch is None:  # the default, made to split into the micro-batches
        return -(-REPLICA_BATCH // micro) * micro
    if args.replica_batch < 1:
        raise ValueError(f"--replica-batch={args.replica_batch} must be >= 1 (sequences per "
                         f"replica)")
    if args.replica_batch % micro:
        raise ValueError(f"--replica-batch={args.replica_batch} does not split into {split} "
                         f"= {micro} micro-batches: use a multiple of {micro}, e.g. "
                         f"--replica-batch {micro * max(1, args.replica_batch // micro)}")
    return int(args.replica_batch)


def batch_warning(args: argparse.Namespace, plan: Plan) -> str | None:
    """The line a user of ``--batch`` is shown where its earlier meaning on ``plait comm``
    (sequences per replica) differs from its meaning now (the global batch): with more than
    one data-parallel replica; else None. ``--global-batch`` and ``--batch-size`` never meant
    anything else and say nothing."""
    if getattr(args, "global_batch_flag", None) != "--batch" or plan.dp == 1:
        return None
    return (f"--batch {args.global_batch} is the global batch, as on every plait command: "
            f"{args.global_batch // plan.dp} sequences per replica over {plan.dp} replicas "
            f"(plait comm read it per replica before; for that, --replica-batch "
            f"{args.global_batch})")


def _plan_text(plan: Any) -> str:
    return plan.to_string() if hasattr(plan, "to_string") else str(plan)


def _from_dict(cls: Any, data: dict) -> Any:
    from .report import Row
    rows = [Row(**r) for r in data["rows"]]
    return cls(rows=rows, steps=data["steps"], world_size=data["world_size"],
               backend=data["backend"], notes=data["notes"])
