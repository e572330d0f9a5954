"""Sharded data parallelism: ZeRO-1, ZeRO-2, ZeRO-3 and HSDP, on PyTorch's own building blocks.

What each stage shards, per rank, with Ψ parameters, d = ``dp_shard`` ranks, Adam in fp32
(4 bytes of parameter, 4 of gradient, 8 of moments per parameter):

========  =====================================  ====================  =========================
stage     building block                          model state / rank     traffic per step
========  =====================================  ====================  =========================
ZeRO-1    DDP + ``ZeroRedundancyOptimizer``       4Ψ + 4Ψ + 8Ψ/d        all-reduce(grads)
                                                                        + broadcast(params)
ZeRO-2    ``fully_shard(reshard_after_forward=    16Ψ/d, plus the        all-gather(params) once
          False)``                                gathered 4Ψ held       + reduce-scatter(grads)
                                                  from forward to
                                                  backward
ZeRO-3    ``fully_shard(reshard_after_forward=    16Ψ/d (one block       all-gather twice
          True)`` per block, root last            gathered at a time)    + reduce-scatter
HSDP      the same on a 2-D (dp_replicate,        16Ψ/d_shard            + all-reduce over
          dp_shard) mesh                                                 dp_replicate
========  =====================================  ====================  =========================

Why these blocks:

* **ZeRO-3** is exactly what FSDP2 ``fully_shard`` does with ``reshard_after_forward=True``:
  parameters, gradients and optimizer state (which the optimizer allocates like the sharded
  DTensor parameters) are all 1/d per rank; each block is all-gathered before its forward and
  again before its backward.
* **ZeRO-2** is ``fully_shard`` with ``reshard_after_forward=False`` (torch documents it as the
  ZeRO-2 analogue, FSDP1's SHARD_GRAD_OP): gradients are reduce-scattered (sharded) and the
  optimizer state is sharded, while the gathered parameters stay in memory between forward and
  backward, saving the second all-gather. Unlike DeepSpeed's ZeRO-2, FSDP2 frees the gathered
  copy after backward instead of keeping it through the optimizer step (and all-gathers it
  again in the next forward): the same bytes on the wire as an all-gather after the step, and
  the optimizer step runs with only the shards resident.
* **ZeRO-1** cannot be expressed with FSDP2: ``fully_shard`` always reduce-scatters gradients,
  so gradients would be sharded (that is ZeRO-2). ZeRO-1 keeps parameters and gradients
  replicated and shards only the optimizer state, which is DDP (bucketed all-reduce of
  gradients) plus ``torch.distributed.optim.ZeroRedundancyOptimizer`` (each rank runs the
  user's optimizer on its partition of the parameters, then broadcasts the updated parameters
  from their owners). The optimizer is rebuilt here too, by :func:`zero1_optimizer`, which
  ``Run.step`` calls on the user's ``torch.optim.AdamW(model.parameters())`` before every step,
  so the training script does not change. ZeroRedundancyOptimizer partitions whole parameters
  (greedy, largest first), not elements, so per-rank optimizer state is 8Ψ/d only up to that
  granularity.
* **HSDP** is FSDP2 on a 2-D mesh ``(dp_replicate, dp_shard)``: shard inside a group (a node),
  replicate across groups; FSDP2 reduce-scatters inside and all-reduces across.

Mixed precision (``plan.mixed_precision="bf16"``) is FSDP2's ``MixedPrecisionPolicy``: bf16
gathered parameters and compute, gradients reduced in fp32, the sharded fp32 parameters are the
master copy the optimizer updates. CPU offload (``plan.offload``, ZeRO-3 only) is FSDP2's
``CPUOffloadPolicy``: sharded parameters, gradients and optimizer state live in host memory and
the optimizer step runs on the CPU.

On gloo (CPU ranks) the shard group's reduce-scatter and all-gather run as all-to-alls
(:mod:`plait.parallel.gloo_collectives`, installed through FSDP2's custom-collective hooks);
``options.gloo_all_to_all = False`` keeps FSDP2's own.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import Shard

from .._torch_compat import is_strided
from ..mesh import Mesh
from ..plan import Plan
from ..warn import user_stacklevel
from .gloo_collectives import use_gloo_collectives
from .units import select_units, sparse_embeddings

_PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def data_mesh(mesh: Mesh, plan: Plan) -> DeviceMesh:
    """The mesh FSDP2 shards over: 1-D ``dp_shard``, 2-D ``(dp_replicate, dp_shard)`` (HSDP);
    with context parallelism ``dp_shard x cp`` flattened in place of ``dp_shard``."""
    if plan.cp > 1:  # cp ranks hold the same parameters: FSDP2 shards over them too
        if plan.dp_replicate > 1:
            return mesh.root["dp_replicate", "dp_shard_cp"]
        return mesh["dp_shard_cp"]
    if plan.dp_replicate > 1:
        return mesh.root["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def _check_mesh(mesh: Mesh, plan: Plan) -> None:
    for axis in ("dp_replicate", "dp_shard", "tp"):
        if mesh.size(axis) != getattr(plan, axis):
            raise ValueError(f"mesh axis {axis} has {mesh.size(axis)} ranks but the plan asks for "
                             f"{axis}={getattr(plan, axis)}; build the mesh from the same plan "
                             f"(plait.mesh.build_mesh(plan, ...))")


def mixed_precision_policy(plan: Plan) -> MixedPrecisionPolicy:
    """bf16/fp16: gathered parameters and compute in bf16/fp16, gradient reduction in fp32 (an
    fp16 gradient that overflowed arrives as inf, which the loss scaler sees); fp32: no
    casts."""
    return MixedPrecisionPolicy(param_dtype=_PARAM_DTYPES[plan.mixed_precision],
                                reduce_dtype=torch.float32 if plan.mixed_precision != "fp32"
                                else None)


def offload_policy(plan: Plan, device_type: str) -> OffloadPolicy:
    if not plan.offload:
        return OffloadPolicy()
    # Pinned host memory only exists next to an accelerator.
    return CPUOffloadPolicy(pin_memory=device_type not in ("cpu", "meta"))


def quiet_view_output_warning() -> None:
    """Silence FSDP2's forward-time warning that a unit "returned a view tensor", for this
    process (warning filters are per process), and only that warning, only from FSDP2.

    torch 2.13 warns whenever an FSDP2 unit's output is a view (pytorch/pytorch#181850, for
    #181832: an in-place op on such a view drops the unit's pre-backward hook). Ordinary
    models return views: ``nn.Linear`` with a bias on an input of more than two dims computes
    on the flattened input and views the result back, so every block or model ending in one
    warns on every rank, whether anything writes to the output in place or not (torch's
    pytorch/pytorch#197154 moves the warning to the in-place write itself). plait's step does
    not write to a model's output in place, and a user's forward that does is what
    ``plait check`` catches: its gradients differ from the one-device run's."""
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor",
                            category=UserWarning, module=r"torch\.distributed\.fsdp")


def _refuse_scalar_parameters(module: nn.Module, plan: Plan) -> None:
    """FSDP2 shards each parameter on its first dimension and refuses a 0-dim one (a learned
    temperature such as CLIP's ``logit_scale``) with a traceback on every rank; refused here
    by name, with the layouts that do train it, before any unit is sharded."""
    scalars = [name for name, p in module.named_parameters() if p.ndim == 0]
    if scalars:
        shown = ", ".join(scalars[:3]) + (f" and {len(scalars) - 3} more"
                                          if len(scalars) > 3 else "")
        raise ValueError(
            f"zero={plan.zero} shards every parameter of {type(module).__name__} over dp_shard "
            f"on its first dimension, and {shown} has none (a 0-dim parameter, which torch's "
            f"fully_shard refuses); use zero=1 (dp_shard=N,zero=1: optimizer state sharded, "
            f"parameters whole) or dp_replicate, or make it a 1-element tensor "
            f"(nn.Parameter(t.reshape(1)))")


def _refuse_sparse_gradients(module: nn.Module, plan: Plan) -> None:
    """FSDP2 reduce-scatters every gradient as one flat dense buffer, and a sparse one (an
    ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``, a recommender's usual table)
    fails there on every rank with ``Could not run 'fsdp::chunk_cat' with arguments from the
    'SparseCPU' backend``; refused here by name, with the layouts that do train it (DDP
    all-reduces sparse gradients, and ZeRO-1 is DDP with a sharded optimizer)."""
    shown = sparse_embeddings(module)
    if shown:
        raise ValueError(
            f"zero={plan.zero} reduce-scatters every gradient of {type(module).__name__} as "
            f"dense shards, and {shown} gives sparse gradients (sparse=True), which torch's "
            f"fully_shard cannot reduce; use sparse=False for zero={plan.zero}, or keep "
            f"sparse=True with dp_shard=N,zero=1 (optimizer state sharded) or dp_replicate=N")


def apply_fsdp(module: nn.Module, mesh: Mesh, plan: Plan) -> nn.Module:
    """Shard ``module`` for ``plan.zero`` (1, 2 or 3) over the data axes of ``mesh``.

    ZeRO-2/3: ``fully_shard`` on each unit (the repeated blocks, or ``plan.options.
    shard_patterns``), then on the root, which groups whatever is left (embeddings, final
    norm, head) and drives the lazy init. ZeRO-1: DDP here; the optimizer is sharded by
    :func:`zero1_optimizer` (called by ``Run.step`` on the user's optimizer).
    """
    if plan.zero not in (1, 2, 3):
        raise ValueError(f"apply_fsdp needs zero=1, 2 or 3, got zero={plan.zero!r}")
    if plan.offload and plan.zero != 3:
        raise ValueError(f"offload=True needs zero=3 (got zero={plan.zero}): only ZeRO-3 keeps "
                         f"parameters sharded between uses, so only it can park them on the CPU")
    if plan.zero != 1:
        _refuse_scalar_parameters(module, plan)
        _refuse_sparse_gradients(module, plan)
    _check_mesh(mesh, plan)
    units = _units(module, plan)  # raises on a pattern that matches nothing
    if plan.zero == 1:
        return _apply_zero1(module, mesh, plan)
    dm = data_mesh(mesh, plan)
    kwargs: dict[str, Any] = dict(mesh=dm, mp_policy=mixed_precision_policy(plan),
                                  offload_policy=offload_policy(plan, dm.device_type))
    if plan.tp > 1:
        kwargs["shard_placement_fn"] = _shard_placement(module, plan)
    reshard = plan.zero == 3
    quiet_view_output_warning()
    for _, unit in units:
        fully_shard(unit, reshard_after_forward=reshard, **kwargs)
    # Root last. ZeRO-3: None lets FSDP2 keep the root's own parameters gathered from forward to
    # backward (backward needs them first thing); ZeRO-2: keep everything gathered.
    fully_shard(module, reshard_after_forward=None if reshard else False, **kwargs)
    if plan.options.gloo_all_to_all:
        # On gloo (CPU), FSDP2's reduce-scatter/all-gather become all-to-alls: gloo's own are
        # ~2x slower (reduce-scatter is a full all-reduce there). NCCL and every other backend
        # keep FSDP2's defaults; see plait/parallel/gloo_collectives.py.
        # HSDP: the inner dim (dp_shard, or dp_shard_cp under context parallelism)
        shard_group = dm.get_group(1) if dm.ndim == 2 else dm.get_group()
        use_gloo_collectives(module, shard_group, dm.device_type)
    _reduce_unused(module, plan)
    return module


def _shard_placement(module: nn.Module, plan: Plan) -> Callable[[nn.Parameter], Shard | None]:
    """FSDP2's ``shard_placement_fn`` over tensor parallelism: a parameter TP split with a
    strided placement on dim 0 (a fused q|k|v weight: rank r holds ``[q_r, k_r, v_r]``) is
    sharded on another dim; the others on dim 0, FSDP2's default.

    Why: FSDP2 shards dim 0 of the local ``[q_r, k_r, v_r]`` into contiguous pieces and
    describes them as a strided shard of a strided shard, which they are not: training is
    right (every rank gathers its own rows back), but ``full_tensor()``, the state a
    checkpoint or ``run.full_state_dict`` writes, put rows of q, k and v in each other's
    places."""
    names = {id(p): n for n, p in module.named_parameters()}
    # FSDP2 shards over dp_shard, and over dp_shard x cp under context parallelism (data_mesh)
    shards = plan.dp_shard * plan.cp
    over = f"dp_shard={plan.dp_shard}" + (f" x cp={plan.cp}" if plan.cp > 1 else "")

    def place(param: nn.Parameter) -> Shard | None:
        strided = {pl.dim for pl in getattr(param, "placements", ()) if is_strided(pl)}
        if 0 not in strided:
            return None
        for dim in range(1, param.ndim):
            if dim not in strided and param.shape[dim] % shards == 0:
                return Shard(dim)
        raise ValueError(
            f"{names.get(id(param), 'a parameter')} (shape {tuple(param.shape)}) is a fused "
            f"layer split over tp with its parts kept apart; ZeRO-2/3 must shard it on another "
            f"dim, and {over} = {shards} shards divide none of {tuple(param.shape[1:])}: "
            f"pick a dp_shard (x cp) that divides its input size, or zero=0 with "
            f"dp_replicate")
    return place


def _units(module: nn.Module, plan: Plan) -> list[tuple[str, nn.Module]]:
    """The FSDP2 units of ``module``: ``plan.options.shard_patterns``; without them the
    repeated blocks, or none under ``find_unused`` (the root's one group then holds all).

    ``find_unused`` says the forward skips some modules on some ranks. FSDP2 gathers and
    reduces a unit only on the ranks whose forward called it, so a skipped module that is a
    unit of its own (each expert of an MoE whose experts are the largest container, hence the
    default units) has its ranks run different collectives, and torch aborts them. The root's
    group is gathered and reduced on every rank whatever the forward calls, zeros reduced for
    what it left unused; ``shard_patterns`` naming modules every forward calls shards finer.
    """
    patterns = plan.options.shard_patterns
    if plan.find_unused and patterns is None:
        blocks = select_units(module, None)
        if plan.zero == 3 and blocks:
            # ZeRO-3 then gathers every parameter at once in the forward, not block by block:
            # the peak a large model may not fit. The blocks are safe units when every forward
            # calls each of them (a transformer whose blocks all run, unused parameters inside).
            names = ", ".join(sorted({name.rsplit(".", 1)[0] + ".*" for name, _ in blocks}))
            warnings.warn(f"plait: find_unused with zero=3 shards {type(module).__name__} as one "
                          f"unit, gathered whole in the forward (a unit a forward skips on some "
                          f"ranks would stall the others); if every forward calls each of its "
                          f"blocks, shard them one by one with "
                          f"options={{'shard_patterns': ['{names}']}}",
                          stacklevel=user_stacklevel())
        return []
    return select_units(module, patterns)


def _reduce_unused(module: nn.Module, plan: Plan) -> None:
    """``Plan.find_unused``: each unit reduces a zero gradient for a parameter the step left
    without one, so every rank reduces the same tensors whichever branches its forward took
    (without it FSDP2 reduces only the parameters with gradients)."""
    if not plan.find_unused:
        return
    reduce_unused = getattr(module, "set_reduce_scatter_unused_params", None)
    if reduce_unused is None:
        raise ValueError(f"find_unused with zero={plan.zero} or replicated DP over TP needs "
                         f"FSDP2's set_reduce_scatter_unused_params (torch {torch.__version__} "
                         f"has none): upgrade torch, or use zero=0 or 1 (DDP)")
    reduce_unused(True)


def _apply_zero1(module: nn.Module, mesh: Mesh, plan: Plan) -> nn.Module:
    # Plan.validate refuses zero=1 with tp > 1: DDP cannot bucket TP's DTensor parameters.
    from .data import apply_ddp

    device = next(module.parameters()).device
    # Gradients are averaged over every data rank (replicate x shard), and under context
    # parallelism over the cp ranks too (they compute partial gradients of the same
    # parameters); the optimizer state is partitioned over dp_shard (x cp: shard_optimizer).
    from ..mesh import DP_CP

    return apply_ddp(module, mesh[DP_CP if plan.cp > 1 else "dp"], device=device,
                     find_unused=plan.find_unused)


def reshard_after_forward_only(model: nn.Module) -> None:
    """Register the sharded parameters of every FSDP2 module of ``model`` again after forwards
    with no backward (``run.evaluate``), as a step's backward does.

    A module FSDP2 does not reshard after its forward (ZeRO-2's, the replicated layouts over
    tp and cp, the root's under ZeRO-3) keeps its unsharded parameters registered until the
    backward: without one, ``model.parameters()`` stays those, so an optimizer built after an
    evaluation would hold tensors the next backward unregisters and train nothing, and the
    gathered parameters would stay in memory. Local (it frees the gathered copies; no
    collective), so it runs on every rank whatever the forward raised; the next forward
    gathers again, as after a step."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def apply_replicate(module: nn.Module, mesh: Mesh, plan: Plan) -> nn.Module:
    """Replicated data parallelism over ``dp_replicate`` for models whose parameters are DTensors.

    DDP cannot bucket DTensors (the parameters TP creates), so replicas go through FSDP2 on the
    2-D ``(dp_replicate, dp_shard)`` mesh with ``dp_shard == 1``: HSDP whose shard groups have
    one rank, i.e. parameters, gradients and optimizer state replicated (the same memory as DDP)
    and one all-reduce of gradients per unit over ``dp_replicate``.
    """
    if plan.dp_shard != 1 or plan.zero != 0:
        raise ValueError(f"apply_replicate is replicated DP (zero=0, dp_shard=1); got "
                         f"zero={plan.zero}, dp_shard={plan.dp_shard}: use apply_fsdp")
    _check_mesh(mesh, plan)
    dm = mesh.root["dp_replicate", "dp_shard"]
    kwargs: dict[str, Any] = dict(mesh=dm, mp_policy=mixed_precision_policy(plan))
    for _, unit in _units(module, plan):
        fully_shard(unit, reshard_after_forward=False, **kwargs)
    quiet_view_output_warning()
    fully_shard(module, reshard_after_forward=False, **kwargs)
    _reduce_unused(module, plan)
    return module


def apply_replicate_cp(module: nn.Module, mesh: Mesh, plan: Plan) -> nn.Module:
    """Replicated data parallelism over the data x cp ranks (``dp_cp``) for a tensor-parallel
    model under context parallelism (zero=0): the cp ranks compute partial gradients of the
    same TP shards, summed with the data replicas' in one all-reduce per unit.

    DDP cannot take DTensor parameters (its broadcast of the module states has no DTensor
    rule), and :func:`apply_replicate`'s 2-D (dp_replicate, dp_shard) mesh leaves the cp ranks
    out; torch's FSDP2-based ``replicate`` takes the flattened 1-D ``dp_cp`` mesh (gradients,
    parameters and optimizer state replicated, as under DDP)."""
    from .._torch_compat import fsdp_replicate

    replicate = fsdp_replicate()
    if replicate is None:  # older torch: no FSDP2-based replicate
        raise ValueError(f"cp={plan.cp} with tp={plan.tp} replicates the TP shards with "
                         f"torch's FSDP2-based replicate, which torch {torch.__version__} "
                         f"lacks: upgrade torch, or use tp=1 with cp")
    from ..mesh import DP_CP

    kwargs: dict[str, Any] = dict(mesh=mesh[DP_CP], mp_policy=mixed_precision_policy(plan))
    for _, unit in _units(module, plan):
        replicate(unit, **kwargs)
    quiet_view_output_warning()
    replicate(module, **kwargs)
    return module


# ---------------------------------------------------------------------------------- ZeRO-1
ShardedOptimizers = dict[int, tuple[torch.optim.Optimizer, torch.optim.Optimizer]]


def zero1_optimizer(optimizer: torch.optim.Optimizer, mesh: Mesh, plan: Plan,
                    cache: ShardedOptimizers) -> torch.optim.Optimizer:
    """The optimizer a training step steps: ``optimizer`` itself, or under ``zero=1`` its sharded
    twin (built on first use and kept in ``cache``) with the user's current hyperparameters.

    ZeRO-1 shards the optimizer state, which needs the optimizer rebuilt as a
    ``ZeroRedundancyOptimizer``; doing it at step time keeps the user's script unchanged (they
    create ``torch.optim.AdamW(model.parameters())`` as on one device). The user's optimizer stays
    the source of hyperparameters (a scheduler's lr) and is copied into the sharded one before
    every step. ``cache`` maps ``id(optimizer)`` to (optimizer, sharded): holding the user's
    optimizer keeps its id from being reused while the entry lives.
    """
    if plan.zero != 1:
        return optimizer
    entry = cache.get(id(optimizer))
    if entry is None:
        entry = (optimizer, shard_optimizer(optimizer, mesh, plan))
        cache[id(optimizer)] = entry
    copy_hyperparameters(optimizer, entry[1])
    return entry[1]


def shard_optimizer(optimizer: torch.optim.Optimizer, mesh: Mesh, plan: Plan
                    ) -> torch.optim.Optimizer:
    """ZeRO-1: the user's optimizer, rebuilt as a ``ZeroRedundancyOptimizer`` over ``dp_shard``
    (``dp_shard x cp`` under context parallelism, whose ranks hold the same parameters).

    Same class, same parameter groups and hyperparameters; each rank keeps the state of its
    partition only. Call it before the first step (the user's optimizer must hold no state yet:
    it would be silently dropped).
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if len(optimizer.state):
        raise ValueError("zero=1 shards the optimizer state, but this optimizer already holds "
                         "state (it has stepped or loaded a checkpoint); create it after "
                         "run.parallelize() and let run.step() shard it before its first step")
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(g) for g in optimizer.param_groups]
    from ..mesh import DP_SHARD_CP

    shards = mesh[DP_SHARD_CP if plan.cp > 1 else "dp_shard"]
    return ZeroRedundancyOptimizer(groups, optimizer_class=cls,
                                   process_group=shards.get_group(), **defaults)


def copy_hyperparameters(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Copy every parameter-group setting except the parameters (lr, betas, ...) to ``target``."""
    for src, dst in zip(source.param_groups, target.param_groups, strict=True):
        for key, value in src.items():
            if key != "params":
                dst[key] = value
