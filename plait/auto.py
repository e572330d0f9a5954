"""``plan="auto"``: the planner picks the layout for this model, world size and accelerator.

The runtime cannot plan in ``plait.init()``: the model is not known yet. So ``init("auto")``
joins the process group and waits; ``run.parallelize(model)`` asks the planner
(``plait.planner.plan_model``, its public API) for the model's layout on the job's world size
and accelerator, prints the choice and why on rank 0, builds the mesh and lays the model out.
Rank 0 plans and broadcasts the result, so every rank runs the same layout even if the search
were to tie differently somewhere.

What the planner is told:

* the model's own refusals: the cost model reads sizes, so before a layout is picked the model
  is asked whether its layer plan takes that tp, its blocks sequence parallelism, and its
  structure that pipeline split (:func:`layout_check`); a refused layout is skipped, and said;

* the cluster: a calibrated profile when one is given (``init("auto", cluster="my.yaml")``,
  written by ``plait plan --calibrate``), else the preset of this accelerator (``cpu`` for CPU
  processes; a CUDA device by its name, e.g. H100 -> ``dgx-h100``, H200 -> ``h200``), resized
  to the world size;
* the workload: ``global_batch`` and ``seq`` passed to ``init`` (the batch the loader will be
  asked for); by default 8 rows per rank and the model's own maximum sequence length, or 128
  tokens when the model does not say. The maximum is a setting of the model or its config
  (``max_position_embeddings``, ``n_positions``, ``max_seq_len``), else the rows of a learned
  position table (the one ``nn.Embedding`` named for positions: ``pos``, ``pos_emb``, ``wpe``),
  which the printed choice then names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from .parallel.tp_example import PASS_EXAMPLE, Example
from .plan import Plan

# CUDA device names (substrings, upper case) -> the planner's cluster preset.
_CUDA_PRESETS = (("H200", "h200"), ("H100", "dgx-h100"), ("A100-SXM4-40GB", "dgx-a100-40gb"),
                 ("A100", "dgx-a100-80gb"), ("MI300", "mi300x"))
DEFAULT_SEQ = 128
ROWS_PER_RANK = 8


@dataclass(frozen=True)
class AutoRequest:
    """What ``init("auto", ...)`` was told; the model comes with ``run.parallelize``."""

    world_size: int
    device_type: str
    device_name: str = ""
    cluster: Any = None
    global_batch: int | None = None
    seq: int | None = None


def cluster_for(request: AutoRequest) -> Any:
    """The cluster the planner prices: the given profile, else this accelerator's preset."""
    if request.cluster is not None:
        return request.cluster
    if request.device_type == "cuda":
        name = request.device_name.upper()
        for key, preset in _CUDA_PRESETS:
            if key in name:
                return preset
        raise ValueError(f"plan='auto': no planner preset for the GPU {request.device_name!r}; "
                         f"pass cluster= a profile written by `plait plan --calibrate`")
    if request.device_type == "cpu":
        return "cpu"
    raise ValueError(f"plan='auto': no planner preset for {request.device_type!r} devices; pass "
                     f"cluster= a profile (see `plait plan --help`)")


def choose(model: nn.Module, request: AutoRequest, example: Example | None = None
           ) -> tuple[Plan, list[str]]:
    """The planner's best plan for ``model`` and the lines that say why (pure: no collectives).
    ``example``: the forward's arguments in the user's batch (``run.parallelize(model,
    example=batch)``), which the model's refusals are checked on and a model without a stack
    of blocks is measured on, in place of a guessed input."""
    from .planner import load_cluster, load_model, plan_model
    from .planner.cli import explain_nothing_fits, explain_winner
    from .planner.model_stats import NoBlockStackError

    # BatchNorm trains what one device trains only with its statistics over the data axes.
    sync_bn = _has_batchnorm(model) and request.world_size > 1
    try:
        stats = load_model(model, example=example)
    except NoBlockStackError:
        return _choose_data_parallel(model, request, sync_bn, example)
    # a model of several stacks run on the user's batch: each stack at the length it got
    # there (an encoder-decoder's source beside its target), unless init(seq=) says one
    stacks = () if request.seq else stats.data_stack_seqs
    seq = request.seq or (stats.data_seq if stacks else None) or stats.max_seq or DEFAULT_SEQ
    batch = request.global_batch or ROWS_PER_RANK * request.world_size
    cluster = cluster_for(request)
    result = plan_model(stats, cluster, world_size=request.world_size, global_batch=batch,
                        seq=None if stacks else seq,
                        layout_check=layout_check(model, example=example))
    resized = load_cluster(cluster, devices=request.world_size)
    if result.best is None:
        raise ValueError("plan='auto': " + explain_nothing_fits(result, stats, resized))
    plan = result.best.plan.validate(request.world_size)
    if sync_bn and plan.dp > 1:
        plan = plan.replace(sync_bn=True)
    # Say where a figure the user did not give came from: a planned-for batch or sequence
    # other than the run's picks another layout, and init(global_batch=, seq=) is the fix.
    batch_from = "" if request.global_batch else (
        f" ({ROWS_PER_RANK} rows per rank; plait.init(global_batch=N) for yours)")
    read = f": {stats.max_seq_from}" if stats.max_seq_from else ""
    seq_from = "" if request.seq else (
        " (your batch's" + "".join(f", {first}'s stack: {n}" for first, n in stacks) + ")"
        if stacks else f" (the model's maximum{read})" if stats.max_seq else
        " (a default; plait.init(seq=N) for yours)")
    why = [f"plait: plan 'auto' for {type(model).__name__} on {request.world_size} x "
           f"{resized.name} (global batch {batch}{batch_from}, seq {seq}{seq_from}): "
           f"{plan.to_string()}"]
    why += ["  " + line for line in explain_winner(result.ranked, resized)]
    why += [f"  skipped {n} faster layout{'s' * (n > 1)}: {kind}"
            for kind, n in sorted(result.rejected.items()) if kind.startswith("refused by")]
    return plan, why


def _choose_data_parallel(model: nn.Module, request: AutoRequest, sync_bn: bool,
                          example: Example | None = None) -> tuple[Plan, list[str]]:
    """The best data-parallel layout of a model without a stack of repeated matmul blocks (a
    ConvNet, an LSTM), ranked from its measured FLOPs, saved bytes and traffic
    (:mod:`plait.planner.whole_model`) on ``example`` (the user's), else a guessed input;
    plain DDP, said so, where the model does not run on the guess, whose message names
    ``example=``. Tensor and pipeline parallelism are left out with the model's reasons."""
    from .planner import constants_for, load_cluster
    from .planner.whole_model import excluded, explain, from_module, nothing_fits, rank

    name = type(model).__name__
    try:
        whole = from_module(model, example)
    except ValueError as exc:
        plan = Plan(dp_replicate=request.world_size, sync_bn=sync_bn)
        fix = "" if example is not None else f"; to have it priced, {PASS_EXAMPLE}"
        return plan, [f"plait: plan 'auto' for {name} on {request.world_size} ranks: "
                      f"{plan.to_string()} (no stack of repeated blocks for tensor or pipeline "
                      f"parallelism to split, so data parallelism; not priced: {exc}{fix})"]
    cluster = load_cluster(cluster_for(request), devices=request.world_size)
    batch = request.global_batch or ROWS_PER_RANK * request.world_size
    dtype = "fp32" if cluster.device == "cpu" else "bf16"
    result = rank(whole, cluster, batch, dtype=dtype, c=constants_for(cluster), top=0)
    if result.best is None:
        raise ValueError(f"plan='auto' for {name} on {request.world_size} x {cluster.name}: "
                         + nothing_fits(result))
    plan = result.best.plan.validate(request.world_size)
    batch_from = "" if request.global_batch else (
        f" ({ROWS_PER_RANK} rows per rank; plait.init(global_batch=N) for yours)")
    why = [f"plait: plan 'auto' for {name} on {request.world_size} x {cluster.name} (global "
           f"batch {batch}{batch_from}; no stack of repeated blocks for tensor or pipeline "
           f"parallelism to split: data-parallel layouts ranked, measured on "
           f"{_measured_on(whole)}): {plan.to_string()}"]
    why += ["  " + line for line in explain(result.ranked)]
    why += [f"  not searched: {axis}: {reason}"
            for axis, reason in excluded(whole, layout_check(model, example=example),
                                         model).items()]
    return plan, why


def _measured_on(whole: Any) -> str:
    if whole.sample_from == "guessed":
        return f"a guessed input {whole.sample_shape}"
    return "the example given to run.parallelize"


def _has_batchnorm(model: nn.Module) -> bool:
    from .parallel.batchnorm import batchnorm_modules

    return bool(batchnorm_modules(model))


def batchnorm_pieces_refusal(model: nn.Module, plan: Plan) -> str | None:
    """Why a plan that cuts each step's batch into pieces (pipeline microbatches, gradient
    accumulation) is refused for a model with BatchNorm, or None: each piece is normalised
    with its own statistics, which no synchronisation repairs (plait warns when a user asks
    for it; the planner does not pick it)."""
    from .parallel.batchnorm import batchnorm_modules

    parts = plan.grad_accum * (plan.microbatches if plan.pp > 1 else 1)
    names = batchnorm_modules(model) if parts > 1 else []
    if not names:
        return None
    return (f"BatchNorm {names[0]} would normalise each of the {parts} pieces of a step's "
            f"batch (pipeline microbatches, grad_accum) with its own statistics, not the "
            f"whole batch's as on one device")


def layout_check(model: nn.Module, dict_keys: Any = None, example: Example | None = None,
                 uneven_rows: str | None = None) -> Callable[[Plan], str | None]:
    """What ``model`` itself refuses of a plan the planner ranks
    (:func:`plait.parallel.tensor.tp_refusal`, :func:`plait.parallel.pipeline.pp_refusal`):
    the cost model reads sizes only, and would propose sequence parallelism for blocks that
    mix positions, a tp the model's layer plan cannot take, a pipeline for a model that
    cannot be cut (an encoder-decoder), or context parallelism for a model whose forward is
    not told its positions (:func:`plait.parallel.context.cp_refusal`). Each tp/sp, each split
    and each cp is checked once. ``dict_keys``: the keys of the model's dict batch, where the
    caller has a sample: a forward that takes that dict whole refuses every pipeline
    (:func:`plait.parallel.pipeline.whole_dict_refusal`). ``example``: the user's input (the
    forward's arguments) the checks run the model on, in place of a guessed one; a dict it
    passes whole gives ``dict_keys``. ``uneven_rows``: why the data refuses every pipeline
    (:func:`plait.planner.model_stats.uneven_first_input`: the rows of the input the stages
    chain are not one per example)."""
    from .dict_batch import signature_of, whole_dict_parameter
    from .parallel.context import cp_refusal

    if (dict_keys is None and example is not None and len(example.args) == 1
            and not example.kwargs and isinstance(example.args[0], dict)):
        dict_keys = list(example.args[0])

    whole = (whole_dict_parameter(signature_of(model.forward), dict_keys)
             if dict_keys is not None else None)

    seen: dict[Any, str | None] = {}
    chains: dict[str, Any] = {}  # whether the blocks chain: asked once, whatever the pp

    def check(plan: Plan) -> str | None:
        pieces = batchnorm_pieces_refusal(model, plan)
        if pieces is not None:
            return pieces
        if plan.pp > 1 and uneven_rows is not None:
            return uneven_rows
        keys: list[tuple[Any, ...]] = []
        if plan.tp > 1:
            keys.append(("tp", plan.tp, plan.sp))
        if plan.pp > 1:
            keys.append(("pp", plan.pp, plan.virtual_stages, plan.pp_schedule,
                         plan.options.pp_stage_layers))
        if plan.cp > 1:
            keys.append(("cp", plan.cp))
        for key in keys:
            if key not in seen:
                # On first use: torch.distributed.pipelining imports torch._dynamo (seconds),
                # plait.parallel.tensor DTensor and FSDP (a CPU second), which a plan without
                # a pipeline or tensor parallelism does not need.
                if key[0] == "pp":
                    from .parallel.pipeline import pp_refusal, whole_dict_refusal

                    seen[key] = (whole_dict_refusal(type(model).__name__, whole, dict_keys)
                                 if whole is not None
                                 else pp_refusal(model, plan, chains, example))
                elif key[0] == "tp":
                    from .parallel.tensor import tp_refusal

                    seen[key] = tp_refusal(model, plan.tp, plan.sp, example)
                else:
                    seen[key] = cp_refusal(model, plan.cp)
            if seen[key] is not None:
                return seen[key]
        return None
    return check


def resolve(model: nn.Module, request: AutoRequest, example: Example | None = None
            ) -> tuple[Plan, list[str]]:
    """:func:`choose` on rank 0, broadcast to every rank (a collective)."""
    payload: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            plan, why = choose(model, request, example)
            payload = [(plan.to_dict(), why, None)]
        except ValueError as exc:
            payload = [(None, [], str(exc))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    data, why, error = payload[0]
    if error is not None:
        raise ValueError(error)
    return Plan.from_dict(data), why
