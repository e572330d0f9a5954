"""What the ledger should measure for a plan on the reference transformer: volumes.py, composed.

``plait.comm.volumes`` holds the per-strategy closed forms (shared with the planner). This module
applies them to one plan and one model and adds the few terms that depend on *how* plait lays the
reference model out rather than on the strategy, so that the prediction can be compared with the
ledger row by row (ratio 1.000):

* FSDP2 keeps the root unit's parameters (embeddings, final norm, head) gathered between forward
  and backward (``reshard_after_forward`` defaults to False for the root), so the root is
  all-gathered once per micro-step, the other units twice.
* Megatron TP covers the blocks (volumes.tp_traffic); the vocab-parallel embedding adds one
  all-reduce of b*s*h in forward, the column-parallel head one all-reduce in backward (its input
  gradient) and one all-gather of the b*s*V logits in forward. With SP the two all-reduces become
  a reduce-scatter plus an all-gather each (the head's is the gather of its sequence-sharded
  input), and every norm weight (replicated, fed sequence shards) has its gradient
  all-reduced: 2 per block + the final norm, of ``hidden`` elements each.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .volumes import Traffic, dtype_bytes, pp_traffic, tp_traffic, zero_traffic, ddp_traffic


def _tp_ends(batch: int, seq: int, hidden: int, vocab: int, tp: int, dtype: str, sp: bool,
             norms: int, microbatches: int, head: bool, embed: bool) -> list[Traffic]:
    b = dtype_bytes(dtype)
    act = float(batch) * seq * hidden * b * microbatches
    out: list[Traffic] = []
    ends = int(head) + int(embed)
    if ends:
        if sp:
            out += [Traffic("tp", "all_gather", act * ends, ends * microbatches, tp, "ends"),
                    Traffic("tp", "reduce_scatter", act * ends, ends * microbatches, tp, "ends")]
        else:
            out.append(Traffic("tp", "all_reduce", act * ends, ends * microbatches, tp, "ends"))
    if head:
        logits = float(batch) * seq * vocab * b * microbatches
        out.append(Traffic("tp", "all_gather", logits, microbatches, tp, "logits"))
    if sp and norms:
        out.append(Traffic("tp", "all_reduce", float(norms) * hidden * b, norms, tp,
                           "norm weight grads"))
    return out


def predict(plan: Any, cfg: Any, batch: int, seq: int, *, root_params: int = 0,
            params: int | None = None, stage: int | None = None) -> list[Traffic]:
    """Traffic one rank should see in one optimizer step of ``plan`` on the model ``cfg``.

    ``batch`` is the batch per data-parallel replica per micro-step (split into
    ``plan.microbatches`` for a pipeline). ``params`` is the parameter count this rank's data
    parallelism reduces (default: the whole model, which is right when tp == pp == 1);
    ``root_params`` those FSDP2's root unit holds. ``stage``: the pipeline rank (default: the
    busiest). Supports DDP, ZeRO-3, TP/SP and PP and their products; ZeRO-1/2 follow
    volumes.zero_traffic.
    """
    dtype = "bf16" if plan.mixed_precision == "bf16" else "fp32"
    total = params if params is not None else cfg.num_params()
    out: list[Traffic] = []
    accum = plan.grad_accum
    if plan.dp_replicate > 1:
        out += ddp_traffic(total, plan.dp_replicate, "fp32")
    if plan.dp_shard > 1:
        z = zero_traffic(total, plan.dp_shard, plan.zero, param_dtype=dtype, micro_steps=accum)
        if plan.zero == 3 and root_params:
            root = float(root_params) * dtype_bytes(dtype) * accum
            z = [Traffic(t.axis, t.op, t.payload - root, t.calls - accum, t.group, t.what)
                 if t.op == "all_gather" else t for t in z]
        out += z
    pp, v, m = plan.pp, plan.virtual_stages, plan.microbatches
    mb = batch // m if pp > 1 else batch
    micro = (m if pp > 1 else 1) * accum
    layers = cfg.n_layers // (pp * v) * v if pp > 1 else cfg.n_layers
    first = stage in (None, 0)
    last = stage in (None, pp - 1) if pp > 1 else True
    if plan.tp > 1:
        out += tp_traffic(mb, seq, cfg.dim, layers, plan.tp, dtype, sp=plan.sp,
                          microbatches=micro)
        norms = 2 * layers + (1 if last else 0)
        out += _tp_ends(mb, seq, cfg.dim, cfg.vocab_size, plan.tp, dtype, plan.sp,
                        norms if plan.sp else 0, micro, head=last, embed=first)
    if pp > 1:
        stages = [stage] if stage is not None else range(pp)
        per_stage = [pp_traffic(mb, seq, cfg.dim, pp, dtype, microbatches=m * accum,
                                virtual_stages=v, stage=s, tp=plan.tp, sp=plan.sp)
                     for s in stages]
        out += max(per_stage, key=lambda ts: sum(t.payload for t in ts))
    return out


def by_axis_op(traffic: list[Traffic]) -> dict[tuple[str, str], float]:
    """Sum payload bytes per (axis, op): the shape ``Ledger.report(expected=...)`` takes."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for t in traffic:
        out[(t.axis, t.op)] += t.payload
    return dict(out)


def _find_config(model: Any) -> Any:
    """The reference TransformerConfig under any wrapper (DDP, pipeline stages), or None."""
    from ..models.transformer import TransformerConfig

    for module in getattr(model, "plait_stages", None) or [model]:
        for sub in module.modules():
            cfg = getattr(sub, "config", None)
            if isinstance(cfg, TransformerConfig):
                return cfg
    return None


def _dp_param_counts(model: Any) -> tuple[int, int]:
    """(parameters this rank's data parallelism reduces, those outside the repeated blocks).

    Counted at their tensor-parallel-local size: a DTensor's global numel divided by the degree
    of every ``tp`` mesh dimension it is sharded on (FSDP's own sharding is what DP undoes).
    """
    from ..check import canonical_name

    total = root = 0
    for module in getattr(model, "plait_stages", None) or [model]:
        for name, p in module.named_parameters():
            n = p.numel()
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None and mesh.mesh_dim_names:
                for dim, placement in zip(mesh.mesh_dim_names, p.placements):
                    if dim == "tp" and placement.is_shard():
                        n //= mesh.size(mesh.mesh_dim_names.index(dim))
            total += n
            if not canonical_name(name).startswith("layers."):
                root += n
    return total, root


def expected_for_models(models: list[Any], plan: Any,
                        batch_shape: tuple[int, ...] | None) -> dict[tuple[str, str], float] | None:
    """Predicted payload bytes per (axis, op) per step for a run of the reference transformer.

    ``batch_shape`` is the shape of one rank's input batch (per data replica, all micro-steps).
    Returns None for models other than the reference transformer (the ledger then reports the
    measured side alone).
    """
    if not models or batch_shape is None or len(batch_shape) != 2:
        return None
    model = models[-1]
    cfg = _find_config(model)
    if cfg is None:
        return None
    params, root = _dp_param_counts(model)
    batch, seq = batch_shape
    return by_axis_op(predict(plan, cfg, batch // plan.grad_accum, seq, params=params,
                              root_params=root if plan.zero == 3 else 0))
