"""What one rank sends in one step of a plan, as plait's runtime issues it: the ledger's prediction
and the planner's traffic.

``plait.comm.volumes`` holds the per-strategy closed forms. This module applies them to one plan
and to what one rank holds of the model (``LocalModel``: read off a model ``plait.parallelize``
returned, built from a config, or the planner's share of a pipeline rank), and adds the terms
that come from *how* plait's runtime trains rather than from the strategy, so that the
prediction can be compared with the ledger row by row (ratio 1.000 on the runs
tests/test_comm_ledger.py covers). The planner prices exactly these collectives
(``dp_traffic``, ``tp_rank_traffic``, ``pp_rank_traffic``, ``clip_traffic``). Any other model
is predicted under data parallelism alone, read off the laid-out model (``plait.comm.held``):

* DDP (``plait.parallel.data``): the fp32 gradients all-reduced once per optimizer step on
  ``dp_replicate`` (``no_sync`` while accumulating), one call per bucket as DDP fills them
  (``volumes.ddp_bucket_calls``, read off the tensors ``local_model`` finds).
* ZeRO-1 (``plait.parallel.zero``): DDP over the flattened ``dp`` axis, then
  ``ZeroRedundancyOptimizer`` broadcasts every parameter from the rank that updated it: one
  broadcast per parameter tensor on ``dp_shard``, the whole model's bytes.
* ZeRO-2/3 (FSDP2): a reduce-scatter per unit, and the gathers. FSDP2 keeps the root unit's
  parameters (embeddings, final norm, head) gathered between forward and backward, so under
  ZeRO-3 the root is all-gathered once per micro-step, the blocks twice. HSDP: the
  reduce-scattered gradient shard (``1/dp_shard`` of the gradients) is then all-reduced over
  ``dp_replicate``.
* Replicated DP over TP shards (``apply_replicate``: FSDP2 with one-rank shard groups): one
  all-reduce of the TP-local gradients on ``dp_replicate``.
* TP (plait's reference plan): Megatron's 4 all-reduces per block (volumes.tp_traffic), the
  vocabulary-parallel embedding's forward all-reduce and the column-parallel head's input-gradient
  all-reduce. The logits stay vocabulary-sharded and the loss runs under ``loss_parallel()``,
  which all-reduces three fp32 values per token (max, sum of exponentials, target logit) in
  forward. With SP the two end all-reduces become an all-gather plus a reduce-scatter each, and
  every sequence-parallel norm's weight gradient is all-reduced once per backward (a hook in
  ``plait.parallel.tensor``): 2 per block + the final norm, ``hidden`` fp32 elements each.
* Gradient clipping (``plan.grad_clip``, default on): ``get_total_norm`` over DTensor gradients
  (FSDP2, TP) all-reduces one fp32 norm per parameter tensor on every mesh axis the gradients
  are sharded on, in one call over the flattened ``dp_shard_tp`` view (``dp_shard_cp_tp``
  under context parallelism) where they are sharded on both (``plait.mesh``); with pipelines
  the squared norm (one fp32) is all-reduced over ``pp``.
* PP: per microbatch and boundary one activation sent forward, one gradient sent back, per
  stage this rank holds (a neighbour stage on the same rank is handed over locally).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from math import prod
from typing import Any

from ..mesh import DP, DP_CP, DP_SHARD_CP, DP_SHARD_CP_TP, DP_SHARD_TP
from ..parallel.tp_kv import replicated_kv_elements
from ..plan import reduces_after_schedule
from .report import Expected
from .volumes import (
    DDP_BUCKET_BYTES,
    Traffic,
    cp_traffic,
    ddp_bucket_calls,
    ddp_traffic,
    dtype_bytes,
)

FP32 = 4
# Compute dtypes of 16 bits: bf16 and fp16 cast and autocast alike (FSDP2's param_dtype, the
# same autocast op lists), so their collectives carry the same bytes.
HALF = ("bf16", "fp16")


def _compute_dtype(plan: Any) -> str:
    """The dtype a plan's activations and cast parameters travel in."""
    return plan.mixed_precision if plan.mixed_precision in HALF else "fp32"

# The ledger table's note where ``expected_for_models`` has no closed form.
_BY_PLAN = ("`plait plan --model pkg.mod:factory --plan <plan> --cluster <cluster> "
            "--global-batch <n>` gives the planner's bytes per axis")
NO_EXPECTED_NOTE = ("no 'expected' column: tensor and pipeline parallelism move activations, "
                    "whose bytes need the model's shapes (hidden size, blocks, sequence), which "
                    "plait reads off a stack of repeated blocks fed token ids (b, s); this "
                    "model, its input or the plan is not that; " + _BY_PLAN)

def no_expected_note(models: list[Any], plan: Any, stats: Any,
                     batch_shape: tuple[int, ...] | None, tokens: bool = True) -> str:
    """The ledger table's note where :func:`expected_for_models` returned None: for a model
    other than plait's reference transformer under tensor or pipeline parallelism, naming
    the reason (:func:`why_no_expected`)."""
    if plan.cp > 1 and not (models and _find_config(models[-1])):
        why = why_no_cp_expected(plan, stats, batch_shape, tokens)
        return f"no 'expected' column: {why}; {_BY_PLAN}" if why else NO_EXPECTED_NOTE
    reason = None
    if (plan.tp > 1 or plan.pp > 1) and not (models and _find_config(models[-1])):
        reason = why_no_expected(plan, stats, batch_shape, tokens)
    if reason is None:
        return NO_EXPECTED_NOTE
    return f"no 'expected' column: {reason}; {_BY_PLAN}"


def why_no_cp_expected(plan: Any, stats: Any, batch_shape: tuple[int, ...] | None,
                       tokens: bool = True) -> str | None:
    """Why the ledger cannot predict context parallelism's traffic for a model other than
    plait's reference transformer, or None where it can: the K/V all-gathers' widths are
    read off the model's attention (kv heads x head dim, ``planner_stats``), per token of a
    batch of token ids, without pipeline parallelism; beside tensor parallelism where its
    traffic is predicted too (:func:`why_no_expected`), in fp32."""
    if stats is None:
        return ("context parallelism gathers keys and values, whose widths plait reads off a "
                "stack of repeated blocks (an nn.ModuleList/Sequential of alike blocks with "
                "nn.Linear layers); this model has none")
    if not stats.attention:
        return ("context parallelism gathers the keys and values of each block's attention, "
                "and the stack of repeated blocks plait found in this model has none (its "
                "attention lives outside that stack, or nowhere)")
    if batch_shape is None or len(batch_shape) != 2 or not tokens:
        shape = "?" if batch_shape is None else tuple(batch_shape)
        return (f"the first input has shape {shape}, not token ids (b, s), whose sequence "
                "context parallelism splits")
    if plan.pp > 1:
        return (f"context parallelism beside pp={plan.pp} is predicted for plait's reference "
                "transformer only")
    if plan.tp > 1:
        why = why_no_expected(plan, stats, batch_shape, tokens)
        if why is not None:
            return why
        if plan.mixed_precision != "fp32":
            return (f"context parallelism beside tp={plan.tp} under "
                    f"mixed_precision={plan.mixed_precision} is predicted for plait's "
                    "reference transformer only (the dtypes of a tp rank's keys and values "
                    "are read in fp32 only)")
    if plan.mixed_precision != "fp32" and stats.kv_element_bytes(casts_params(plan)) is None:
        return (f"under mixed_precision={plan.mixed_precision} the keys and values travel in "
                "the dtype the model's own code hands attention (a rotary embedding in fp32 "
                "promotes them), read off a forward pass on token ids under the device's "
                "autocast rules, and that pass did not run on this model or device, or its "
                "attention calls are not one per block at the kv heads' width")
    return None


def why_no_expected(plan: Any, stats: Any, batch_shape: tuple[int, ...] | None,
                    tokens: bool = True) -> str | None:
    """Why the ledger cannot predict tensor- or pipeline-parallel traffic for a model other than
    plait's reference transformer (``stats``: ``planner_stats`` of the model given to
    parallelize; ``batch_shape``, ``tokens``: the first input's shape and whether it held
    integer token ids), or None where it can. Activations' bytes need the model's shapes; bf16
    needs the dtype each collective travels in and checkpointing what a block replays, both
    read off a traced forward pass (``TPBlock.trace``)."""
    if stats is None:
        return ("tensor and pipeline parallelism move activations, whose bytes need the "
                "model's shapes, which plait reads off a stack of repeated blocks (an "
                "nn.ModuleList/Sequential of alike blocks with nn.Linear layers); this model "
                "has none")
    block = stats.tp_block
    shape = "?" if batch_shape is None else tuple(batch_shape)
    if batch_shape is None or len(batch_shape) < 2 or (tokens and len(batch_shape) != 2):
        return (f"the first input has shape {shape}, neither token ids (b, s) nor feature "
                "vectors (b, [s,] features)")
    if not tokens and (block is None or any(block.vocab_ends) or plan.sp):
        return (f"the first input is not a batch of token ids (b, s) but of shape {shape}; "
                "plait prices activations per token of a sequence of ids, or per row of "
                "feature vectors fed through plain layers (no vocabulary embedding or head, "
                "no sequence parallelism)")
    if plan.tp > 1 and plan.options.tp_plan is not None:
        return ("options.tp_plan is given by hand; plait predicts the blocks it ships or "
                "infers a layer plan for")
    def traced() -> bool:  # the forward pass runs only where its answer is needed
        return block is not None and block.trace is not None

    if plan.mixed_precision != "fp32" and not traced():
        return (f"under mixed_precision={plan.mixed_precision} each collective travels in "
                "the dtype the model's own code leaves its input in, read off a forward pass "
                "on token ids under the device's autocast rules (CPU, CUDA), and that pass "
                "did not run on this model or device")
    if plan.tp > 1 and plan.activation_checkpointing != "none":
        if plan.activation_checkpointing == "op":
            return ("activation_checkpointing=op under tensor parallelism: torch's "
                    "selective-checkpoint policy decides which collectives replay")
        if not traced():
            return (f"activation_checkpointing={plan.activation_checkpointing} under tensor "
                    "parallelism replays the forward collectives a block saves a tensor "
                    "after, read off a forward pass on token ids (CPU, CUDA), and that pass "
                    "did not run on this model or device")
    return None


@dataclass(frozen=True)
class TPBlock:
    """The tensor-parallel collectives one block issues, in features per token, read off the
    layer plan plait lays the block out with (``plait.planner.tp_block``).

    ``forward``: each row-parallel layer's output, all-reduced in forward; ``backward``: each
    region's input and each column-parallel layer's input outside a region, all-reduced in
    backward (with SP a reduce-scatter and an all-gather in place of each, same bytes).
    ``bias_gathers``: elements of fused q|k|v biases whose gradients are all-gathered in
    backward (``colwise_qkv``); ``sp_norms``: elements of each trainable parameter tensor that
    runs on sequence shards under SP (the norms), whose gradients are all-reduced once per
    backward, one call each; ``summed``: the same for layers whose gradients are all-reduced
    in every backward (``grad_allreduce``). A LoRA layer is its base and its low-rank parts: a
    row-parallel A adds a forward all-reduce of its rank, a column-parallel B a backward one.
    ``sp_in_blocks``: under SP the sequence is split at the first block and gathered after the
    last (transformers models, inferred plans) rather than from the embedding to the head
    (plait's reference transformer); ``input_grad``: whether the first block's input needs a
    gradient (a frozen embedding: no all-gather of it under SP); ``vocab_ends``: whether the
    plan splits a vocabulary embedding and a vocabulary head (a model fed feature vectors
    through plain layers has neither: no collectives outside the blocks).
    ``fwd_grad`` / ``bwd_grad``: per ``forward`` / ``backward`` entry, whether the backward
    pass issues its collective's counterpart (the row-parallel output's gradient all-gathered
    under SP; the input's gradient all-reduced, under SP reduce-scattered): the tensor needs a
    gradient (``plait.planner.tp_trace.needs_grad``); None: every one, as in a block the
    backward pass enters whole. ``trains``: a parameter of the block trains (replicated k/v
    weights' gradients are summed).
    """

    forward: tuple[int, ...]
    backward: tuple[int, ...]
    bias_gathers: tuple[int, ...] = ()
    sp_norms: tuple[int, ...] = ()
    summed: tuple[int, ...] = ()
    sp_in_blocks: bool = False
    input_grad: bool = True
    vocab_ends: tuple[bool, bool] = (True, True)
    # Elements of each trainable tensor of the norm after the stack that runs on sequence
    # shards (a LayerNorm: weight and bias), its gradients all-reduced once per backward under
    # SP; None: one weight of ``hidden`` (the reference's RMSNorm). Read where the sequence is
    # split from the embedding to the head (not ``sp_in_blocks``).
    end_norms: tuple[int, ...] | None = None
    fwd_grad: tuple[bool, ...] | None = None
    bwd_grad: tuple[bool, ...] | None = None
    trains: bool = True
    # Per ``backward`` entry, whether it is a column-parallel layer reading another stack's
    # output whole (cross-attention's keys and values, ``TPPlan.side_inputs``): its input's
    # gradient is all-reduced over that stack's sequence, under SP too (no gather in forward);
    # empty: none is.
    side: tuple[bool, ...] = ()
    # plait.planner.tp_trace.Trace, or a callable that makes it (or None) on first use: the
    # forward pass behind it costs seconds on a 7B model and only a 16-bit dtype or
    # checkpointing under tp read it (:attr:`trace`)
    traced: Any = field(default=None, compare=False, repr=False)

    @property
    def trace(self) -> Any:
        """What the forward pass on fake tensors showed (None: no pass, or it did not run),
        made on first use and kept."""
        if callable(self.traced):
            object.__setattr__(self, "traced", self.traced())
        return self.traced

    def sizes(self, dtype: str, cast_params: bool = False) -> Any:
        """Bytes per element of each collective (``plait.planner.tp_sizes.Sizes``): fp32 all
        4; bf16 as the traced forward pass showed (``cast_params``: FSDP2 casts the parameters
        to bf16), or every activation at 2 bytes where there is no trace (the reference
        block: the planner's estimate)."""
        from ..planner.tp_sizes import Sizes

        n, m = len(self.forward), len(self.backward)
        if dtype not in HALF:  # the trace is not made: fp32 moves 4 bytes whatever it shows
            return Sizes.uniform(FP32, n, m)
        if self.trace is None:
            return Sizes.uniform(2, n, m)
        return self.trace.bf16_params if cast_params else self.trace.bf16

    @classmethod
    def reference(cls, hidden: int) -> TPBlock:
        """plait's reference block: attention and an MLP, each a region ending in a row-parallel
        layer (Megatron's 4 all-reduces), two RMSNorms of ``hidden`` weights."""
        return cls(forward=(hidden, hidden), backward=(hidden, hidden),
                   sp_norms=(hidden, hidden))


@dataclass(frozen=True)
class LocalModel:
    """What one rank holds of the reference model once plait has laid it out.

    ``params``: parameters at their tensor-parallel-local size (what data parallelism reduces);
    ``root_params``: those outside the repeated blocks (FSDP2's root unit); ``tensors``: the
    number of parameter tensors (gradient clipping reduces one norm each); ``layers``: blocks
    this rank runs, ``recomputed`` of them under activation checkpointing; ``embed``/``head``:
    whether this rank runs the embedding / the head; ``stages``: the global pipeline stages it
    holds, out of ``num_stages``; ``clip_axes``: mesh axes its gradients are sharded on (where
    the clip norm is all-reduced); ``tied``: elements of a trainable weight the embedding and
    the head share that this rank holds a copy of while another pipeline rank holds the other:
    the piece of its gradient summed over the two each step (TP-local, and under ZeRO-2/3 the
    FSDP2 shard: ``plait.planner.traffic.tied_piece``), ``tied_tensors`` tensors (one
    all-reduce each); ``grad_params`` /
    ``grad_tensors``: the trainable ones among ``params`` / ``tensors`` (None: all of them);
    ``grad_units``: FSDP2 units with a gradient to reduce (None: all ``units``; FSDP2 issues
    no reduce-scatter for a unit whose parameters are all frozen). Of the ``layers`` blocks,
    ``trained_layers`` have a parameter that trains (the others issue no collective of a
    parameter gradient over tp), ``reached_layers`` are reached by the backward pass (the
    others, leading frozen blocks, issue no backward collective at all) and
    ``regathered_layers`` are gathered again for backward under ZeRO-3 (``plait.comm.reach``);
    None: all of them. ``tp_blocks``: each of this rank's blocks' own tensor-parallel
    collectives where the blocks differ in what trains and what the backward pass reaches
    (``plait.planner.tp_block.grad_flow``); None: the counts above say it. ``stage_layers`` /
    ``stage_params`` / ``stage_roots``: per stage this rank holds (``stages`` order), its
    blocks, its parameters and its root unit's parameters, which FSDP2 gathers per stage
    under a pipeline (:meth:`stage_parts`); None: derived from the totals.
    """

    params: float
    root_params: float
    tensors: int
    layers: int
    recomputed: int = 0
    embed: bool = True
    head: bool = True
    stages: tuple[int, ...] = (0,)
    num_stages: int = 1
    clip_axes: tuple[str, ...] = ()
    tied: float = 0.0
    tied_tensors: int = 1
    grad_params: float | None = None
    grad_tensors: int | None = None
    grad_units: int | None = None
    trained_layers: int | None = None
    reached_layers: int | None = None
    regathered_layers: int | None = None
    tp_blocks: tuple[TPBlock, ...] | None = None
    stage_layers: tuple[int, ...] | None = None
    stage_roots: tuple[float, ...] | None = None
    stage_params: tuple[float, ...] | None = None
    # Per module this rank holds (a pipeline stage, or the model), the (dtype, bytes) of each
    # trainable parameter tensor at its local size, in the module's parameter order: what
    # DDP's buckets are filled from (ddp_bucket_calls); None: not read (from_config)
    grad_tensor_bytes: tuple[tuple[tuple[str, float], ...], ...] | None = None
    # Where the rank holds one module under DDP: the order its gradients became ready in the
    # run (indices into grad_tensor_bytes[0], ``plait.comm.ready_order``); None: the
    # parameters' reversed, as a forward that runs the modules in their order makes it
    grad_ready_order: tuple[int, ...] | None = None

    def stage_parts(self) -> list[tuple[int, int, float, float]]:
        """``(stage, blocks, block parameters, root parameters)`` of each stage this rank
        holds, in ``stages`` order: ``stage_layers`` / ``stage_params`` / ``stage_roots``
        where known; otherwise the blocks split evenly, the root's parameters on the stages
        holding the embedding (the first) and the head (the last), halved where one rank
        holds both (ZB-V's rank 0)."""
        k = len(self.stages)
        layers = self.stage_layers or tuple(self.layers // k + (i < self.layers % k)
                                            for i in range(k))
        roots = self.stage_roots
        if roots is None:
            ends = [i for i, s in enumerate(self.stages)
                    if (s == 0 and self.embed) or (s == self.num_stages - 1 and self.head)]
            ends = ends or list(range(k))
            roots = tuple(self.root_params / len(ends) if i in ends else 0.0 for i in range(k))
        blocks = float(self.params) - float(self.root_params)
        out = []
        for i, s in enumerate(self.stages):
            own = (self.stage_params[i] - roots[i] if self.stage_params is not None
                   else blocks * layers[i] / self.layers if self.layers else 0.0)
            out.append((s, layers[i], own, roots[i]))
        return out

    @property
    def grads(self) -> float:
        """Gradient elements data parallelism reduces: the trainable ``params``."""
        return self.params if self.grad_params is None else self.grad_params

    @property
    def clip_tensors(self) -> int:
        """Parameter tensors with a gradient (gradient clipping reduces one norm each)."""
        return self.tensors if self.grad_tensors is None else self.grad_tensors

    @property
    def units(self) -> int:
        """FSDP2 units on this rank: every block, and each stage's root that holds parameters
        (FSDP2 makes no unit of a root left empty, a middle pipeline stage's)."""
        if len(self.stages) == 1 and self.num_stages == 1:
            return self.layers + 1
        return self.layers + sum(root > 0 for *_, root in self.stage_parts())

    @property
    def layers_trained(self) -> int:
        """Blocks with a parameter that trains."""
        return self.layers if self.trained_layers is None else self.trained_layers

    @property
    def layers_reached(self) -> int:
        """Blocks the backward pass reaches."""
        return self.layers if self.reached_layers is None else self.reached_layers

    @property
    def layers_regathered(self) -> int:
        """Blocks ZeRO-3 gathers again for backward."""
        return self.layers if self.regathered_layers is None else self.regathered_layers

    @property
    def reducing_units(self) -> int:
        """FSDP2 units on this rank that reduce gradients (one reduce-scatter each)."""
        return self.units if self.grad_units is None else self.grad_units

    @classmethod
    def from_config(cls, plan: Any, cfg: Any, stage: int | None = None) -> LocalModel:
        """The closed form without a model: blocks split evenly over stages, the linears and
        embeddings divided by ``tp``, the norms and row-parallel biases (GPT-style blocks)
        whole on every rank, as plait's layer plan lays them out; a tied head's weight counted
        once where one stage holds the embedding and the head."""
        from ..parallel.checkpointing import checkpointed_blocks
        from ..parallel.schedules import local_stages

        pp, v = plan.pp, plan.virtual_stages
        n = pp * v if pp > 1 else 1
        stages = tuple(local_stages(plan.pp_schedule, pp, v, stage or 0)) if pp > 1 else (0,)
        per = cfg.n_layers // n
        layers = per * len(stages)
        recomputed = len(checkpointed_blocks(per, plan)) * len(stages)
        embed, head = 0 in stages, n - 1 in stages
        norm = cfg.dim * (2 if cfg.norm == "layernorm" else 1)  # LayerNorm: weight and bias
        block = (cfg.num_params(embeddings=False) - norm) // cfg.n_layers
        block_whole = 2 * norm + (2 * cfg.dim if cfg.mlp == "gelu" else 0)  # o, down biases
        table = cfg.vocab_size * cfg.dim
        root = (table if embed else 0) + \
            (table if head and not (cfg.tie_embeddings and embed) else 0)
        root_whole = norm if head else 0
        whole = replicated_kv_elements(cfg.dim, cfg.kv_heads, cfg.head_dim, plan.tp)
        params = ((block - block_whole) * layers + root) // plan.tp + block_whole * layers + \
            root_whole + whole * layers * (plan.tp - 1) // plan.tp
        # each stage's root: the embedding on the first, the head (and final norm) on the last
        roots = tuple(float((table if s == 0 else 0) // plan.tp) + (
            (0 if cfg.tie_embeddings and embed else table) // plan.tp + root_whole
            if s == n - 1 else 0) for s in stages)
        return cls(params=params, root_params=root // plan.tp + root_whole, tensors=0,
                   layers=layers,
                   recomputed=recomputed, embed=embed, head=head, stages=stages, num_stages=n,
                   clip_axes=clip_axes(plan), stage_layers=(per,) * len(stages),
                   stage_roots=roots)


def clip_axes(plan: Any) -> tuple[str, ...]:
    """Mesh axes plait's runtime shards gradients on (where the clip norm is all-reduced):
    ``dp_shard`` under FSDP2's ZeRO-2/3 (HSDP too: it replicates over dp_replicate), ``tp``
    under tensor parallelism; under context parallelism FSDP2 shards over ``dp_shard_cp``."""
    fsdp = plan.zero >= 2
    return tuple(axis for axis, sharded in (
        ("dp_shard", fsdp and plan.cp == 1 and plan.dp_shard > 1),
        (DP_SHARD_CP, fsdp and plan.cp > 1), ("tp", plan.tp > 1)) if sharded)


def _dp_axis(plan: Any) -> str:
    """The ledger's name for plait's flattened data axis (a single axis keeps its own name)."""
    if plan.dp_replicate > 1 and plan.dp_shard > 1:
        return "dp"
    return "dp_replicate" if plan.dp_replicate > 1 else "dp_shard"


# plait.mesh's flattened views, by the axes they join: the ledger names a group of those ranks
# so where no single axis of size > 1 holds the same ranks (plait.comm.ledger
# axis_names_by_ranks: single axes first, then these views in this order).
_FLAT = ((DP, ("dp_replicate", "dp_shard")), (DP_SHARD_CP, ("dp_shard", "cp")),
         (DP_CP, ("dp_replicate", "dp_shard", "cp")), (DP_SHARD_TP, ("dp_shard", "tp")),
         (DP_SHARD_CP_TP, ("dp_shard", "cp", "tp")))


def _ledger_axis(plan: Any, axes: tuple[str, ...]) -> str:
    """The ledger's name for the group of ranks that the mesh axes ``axes`` span together:
    the one axis of size > 1 among them, else plait's flattened view of the same ranks."""
    big = tuple(a for a in axes if getattr(plan, a) > 1)
    if len(big) == 1:
        return big[0]
    for name, joined in _FLAT:
        if tuple(a for a in joined if getattr(plan, a) > 1) == big:
            return name
    return "+".join(big)


def _axis_size(plan: Any, axis: str) -> int:
    """Ranks in mesh axis ``axis``, a flattened view (``dp_shard_cp``...) included."""
    joined = dict(_FLAT).get(axis, (axis,))
    return prod(getattr(plan, a) for a in joined)


def _shard_axes(plan: Any) -> tuple[str, ...]:
    """What FSDP2 shards over (``plait.parallel.zero.data_mesh``): dp_shard, and with context
    parallelism dp_shard x cp (cp ranks hold the same parameters)."""
    return ("dp_shard", "cp") if plan.cp > 1 else ("dp_shard",)


def reference_block(cfg: Any) -> TPBlock:
    """The tensor-parallel collectives of one block of plait's reference transformer ``cfg``:
    Megatron's 4 all-reduces, and under SP each norm tensor's gradient summed, a LayerNorm's
    weight and bias one call each (two norms per block and the final one)."""
    norms = (cfg.dim,) * (2 if cfg.norm == "layernorm" else 1)
    return TPBlock(forward=(cfg.dim, cfg.dim), backward=(cfg.dim, cfg.dim),
                   sp_norms=norms * 2, end_norms=norms)


def predict(plan: Any, cfg: Any, batch: int, seq: int, *, local: LocalModel | None = None,
            stage: int | None = None) -> list[Traffic]:
    """Traffic one rank should see in one optimizer step of ``plan`` on the model ``cfg``.

    ``batch`` is the batch per data-parallel replica per micro-step (``plan.grad_accum``
    micro-steps per optimizer step; a pipeline splits it further into ``plan.microbatches``).
    ``local`` describes what this rank holds (``local_model(model, plan)`` on a real model);
    without it, ``LocalModel.from_config(plan, cfg, stage)``.
    """
    if local is None:
        local = LocalModel.from_config(plan, cfg, stage)
    mb = batch // plan.microbatches if plan.pp > 1 else batch
    kv_whole = replicated_kv_elements(cfg.dim, cfg.kv_heads, cfg.head_dim, plan.tp)
    # tp's collectives and the stages' sends move this rank's tokens: its cp slice of each
    # sequence
    return (dp_traffic(plan, local)
            + tp_rank_traffic(plan, local, mb, seq // plan.cp, cfg.dim, kv_whole,
                              reference_block(cfg))
            + pp_rank_traffic(plan, local, mb, seq // plan.cp, cfg.dim)
            + cp_rank_traffic(plan, local, mb, seq,
                              max(1, cfg.kv_heads // plan.tp) * cfg.head_dim)
            + clip_traffic(plan, local))


def cp_rank_traffic(plan: Any, local: LocalModel, mb: int, seq: int, kv_dim: int,
                    element_bytes: float | None = None) -> list[Traffic]:
    """Context parallelism's collectives of one rank in one optimizer step
    (``plait.parallel.context``): per attention layer and microbatch of ``mb`` whole
    sequences of ``seq`` tokens (``plan.grad_accum`` micro-steps, each split into
    ``plan.microbatches`` under a pipeline), K and V all-gathered in forward (again in each
    recomputed layer) and their gradients reduce-scattered in backward, in the dtype attention
    runs in
    (``volumes.cp_traffic``); ``kv_dim``: the K (or V) features this rank holds per token,
    its tp share of the kv heads; ``element_bytes``: a key's and a value's mean bytes per
    element where the model's code decides them (a traced forward), else the plan's compute
    dtype's. Gradients are reduced over dp x cp in :func:`dp_traffic`. Under a pipeline each
    of this rank's stages gathers per microbatch; ``local.layers``: the attention layers of
    this rank's stages."""
    if plan.cp == 1 or not local.layers:
        return []
    parts = plan.microbatches if plan.pp > 1 else 1
    return cp_traffic(mb, seq, kv_dim, local.layers, plan.cp, _compute_dtype(plan),
                      micro_steps=plan.grad_accum * parts, recomputed_layers=local.recomputed,
                      element_bytes=element_bytes)


def dp_traffic(plan: Any, local: LocalModel, *, grad_dtype: str = "fp32",
               bucket_bytes: float = DDP_BUCKET_BYTES, gathers: bool = True) -> list[Traffic]:
    """Data-parallel traffic of one rank in one optimizer step, as plait's runtime issues it.

    Gradients are reduced in ``grad_dtype`` (plait: fp32); DDP in ``bucket_bytes`` buckets, FSDP2
    one call per unit (``local.units``). A pipeline runs one schedule per accumulation step and
    torch's stage runtime syncs DDP/FSDP2 on the last backward of each: gradients are reduced
    ``grad_accum`` times per step. FSDP2's gathers follow each schedule's order
    (:func:`_param_gathers`); ``gathers=False`` leaves them out (what the gradients' reduction
    alone costs)."""
    R, S, accum = plan.dp_replicate, plan.dp_shard, plan.grad_accum
    syncs = accum if plan.pp > 1 else 1
    g = dtype_bytes(grad_dtype)
    P, G = float(local.params), float(local.grads)
    out: list[Traffic] = []
    if reduces_after_schedule(plan):
        return _after_schedule_traffic(plan, local, grad_dtype, bucket_bytes)
    if plan.cp > 1:  # the cp ranks reduce gradients with the data ranks (plait.parallelize)
        return _dp_cp_traffic(plan, local, g, grad_dtype, bucket_bytes, syncs, gathers)
    # DDP wraps nothing where nothing trains (a frozen pipeline stage: plait.parallel.data)
    if plan.zero == 1 and R * S > 1:
        if G:
            out += _times(_ddp_grads(local, G, R * S, grad_dtype, _dp_axis(plan),
                                     bucket_bytes, find_unused=plan.find_unused), syncs)
        if S > 1:
            # ZeroRedundancyOptimizer broadcasts each parameter from the rank that updated it
            out.append(Traffic("dp_shard", "broadcast", P * FP32, max(1, local.tensors), S,
                               "params (ZeroRedundancyOptimizer)"))
    elif plan.zero in (2, 3) and S > 1:
        units = local.reducing_units  # a unit with nothing to train reduces nothing
        if units:
            out += _times([Traffic("dp_shard", "reduce_scatter", G * g, units, S, "grads")],
                          syncs)
        if R > 1 and units:  # HSDP: the reduce-scattered shard all-reduced across replicas
            out += _times([Traffic("dp_replicate", "all_reduce", G / S * g, units, R,
                                   "grads")], syncs)
        out += _param_gathers(plan, local) if gathers else []
    elif R > 1:
        if plan.tp > 1:  # replicated DP over TP shards: FSDP2, one all-reduce per unit
            if local.reducing_units:
                out += _times([Traffic("dp_replicate", "all_reduce", G * g,
                                       local.reducing_units, R, "grads")], syncs)
        elif G:
            out += _times(_ddp_grads(local, G, R, grad_dtype, "dp_replicate", bucket_bytes,
                                     find_unused=plan.find_unused), syncs)
    return out


def _ddp_grads(local: LocalModel, grads: float, n: int, grad_dtype: str, axis: str,
               bucket_bytes: float, *, after_schedule: bool = False,
               find_unused: bool = False) -> list[Traffic]:
    """DDP's gradient all-reduce (``volumes.ddp_traffic``) with its bucket count taken from
    the tensors this rank holds where ``local`` has them: each stage's DDP fills its own
    buckets in the order the backward pass makes gradients ready (recorded in the run where
    the rank holds one DDP module, ``LocalModel.grad_ready_order``; otherwise the parameters'
    order reversed, a stack run front to back), or under ``find_unused`` (which never rebuilds
    them) in the parameters' order, each DDP then also all-reducing which parameters its
    rank used (one int32 per gradient tensor) once a step; after a zero-bubble schedule
    plait's own ``average_in_buckets`` fills them in parameter order, over all of the rank's
    stages."""
    out = ddp_traffic(grads, n, grad_dtype, axis=axis, bucket_bytes=bucket_bytes)
    sizes = local.grad_tensor_bytes
    if not out or sizes is None:
        return out
    if after_schedule:
        calls = ddp_bucket_calls([t for module in sizes for t in module], bucket_bytes)
    elif local.grad_ready_order is not None and len(sizes) == 1 and not find_unused:
        calls = ddp_bucket_calls([sizes[0][i] for i in local.grad_ready_order], bucket_bytes)
    else:
        calls = sum(ddp_bucket_calls(module if find_unused else module[::-1], bucket_bytes)
                    for module in sizes if module)
    grads_row = dataclasses.replace(out[0], calls=calls, calls_known=True)
    if find_unused and not after_schedule:
        ddps = [module for module in sizes if module]
        return [grads_row, Traffic(axis, "all_reduce", 4.0 * sum(len(m) for m in ddps),
                                   len(ddps), n, "used parameters (find_unused)")]
    return [grads_row]


def _after_schedule_traffic(plan: Any, local: LocalModel, grad_dtype: str,
                            bucket_bytes: float) -> list[Traffic]:
    """:func:`dp_traffic` where a zero-bubble schedule's data (and cp) ranks average their
    gradients after the schedule, once per optimizer step whatever ``grad_accum``
    (``plait.plan.reduces_after_schedule``): first one fp32 flag per trainable tensor (which
    ranks hold a gradient), then the gradients in DDP-sized buckets, tensor-parallel shards
    at their local size; ZeRO-1 then broadcasts every parameter as
    ``ZeroRedundancyOptimizer`` does."""
    cp = plan.cp > 1
    axis = _ledger_axis(plan, ("dp_replicate", "dp_shard", "cp")) if cp else _dp_axis(plan)
    n = _axis_size(plan, DP_CP) if cp else plan.dp_replicate * plan.dp_shard
    G = float(local.grads)
    out: list[Traffic] = []
    if local.clip_tensors:
        out.append(Traffic(axis, "all_reduce", float(local.clip_tensors) * FP32, 1, n,
                           "gradient used flags"))
    if G:
        out += _ddp_grads(local, G, n, grad_dtype, axis, bucket_bytes, after_schedule=True)
    if plan.zero == 1:
        shard = _axis_size(plan, DP_SHARD_CP) if cp else plan.dp_shard
        if shard > 1:
            out.append(Traffic(_ledger_axis(plan, _shard_axes(plan)), "broadcast",
                               float(local.params) * FP32, max(1, local.tensors), shard,
                               "params (ZeroRedundancyOptimizer)"))
    return out


def _dp_cp_traffic(plan: Any, local: LocalModel, g: int, grad_dtype: str,
                   bucket_bytes: float, syncs: int, gathers: bool = True) -> list[Traffic]:
    """:func:`dp_traffic` under context parallelism: the cp ranks compute partial gradients
    of the same parameters, so they join the data ranks. DDP all-reduces over dp x cp
    (``dp_cp``), and with tp FSDP2's replicate one all-reduce per unit; FSDP2 shards and
    reduce-scatters over dp_shard x cp (``dp_shard_cp``), HSDP all-reducing that shard over
    dp_replicate; ZeRO-1 is DDP over dp x cp, then ZeroRedundancyOptimizer's broadcast of
    every parameter over dp_shard x cp. A pipeline's stages reduce ``syncs`` times a step."""
    G = float(local.grads)
    dp_cp = _ledger_axis(plan, ("dp_replicate", "dp_shard", "cp"))
    units = local.reducing_units  # a unit with nothing to train reduces nothing
    if plan.zero in (2, 3):
        n = _axis_size(plan, DP_SHARD_CP)
        grads = [Traffic(_ledger_axis(plan, _shard_axes(plan)), "reduce_scatter", G * g,
                         units, n, "grads")] if units else []
        if plan.dp_replicate > 1 and units:
            grads.append(Traffic("dp_replicate", "all_reduce", G / n * g, units,
                                 plan.dp_replicate, "grads"))
        return _times(grads, syncs) + (_param_gathers(plan, local) if gathers else [])
    if plan.tp > 1:  # TP shards replicated over dp x cp (apply_replicate_cp): one per unit
        return _times([Traffic(dp_cp, "all_reduce", G * g, units, _axis_size(plan, DP_CP),
                               "grads")] if units else [], syncs)
    out = _times(_ddp_grads(local, G, _axis_size(plan, DP_CP), grad_dtype, dp_cp,
                            bucket_bytes, find_unused=plan.find_unused) if G else [], syncs)
    if plan.zero == 1:
        out.append(Traffic(_ledger_axis(plan, _shard_axes(plan)), "broadcast",
                           float(local.params) * FP32, max(1, local.tensors),
                           _axis_size(plan, DP_SHARD_CP), "params (ZeroRedundancyOptimizer)"))
    return out


def _param_gathers(plan: Any, local: LocalModel) -> list[Traffic]:
    """FSDP2's parameter all-gathers per optimizer step, one call per unit gathered.

    Without a pipeline FSDP2 reshards after every backward, so ZeRO-2 gathers once per
    micro-step; ZeRO-3 before each forward and each backward, the root unit (kept gathered
    from forward to backward) once, and a leading frozen block the backward pass never
    reaches in forward alone unless the block after it prefetches it
    (``local.regathered_layers``, :mod:`plait.comm.reach`).

    Under a pipeline torch's stage runtime keeps every unit gathered between backwards until
    the stage's last one (its REDUCE_GRAD step), and ZeRO-3 reshards each block after every
    forward, so a block is gathered again by its stage's next step after each forward (a
    forward or a backward, which FSDP2's hooks gather for; an input- or weight-gradient step,
    which ``TimedStage`` gathers for). The multi-stage schedules also gather each stage at
    torch's UNSHARD step, and a rank holding more than three stages has its stages evicted
    (RESHARD) and gathered again mid-schedule, the root units included
    (:func:`plait.parallel.schedules.stage_gathers` counts both off torch's order): m + 1
    gathers per block per schedule where a stage is never evicted (GPipe, 1F1B, and up to
    three stages per rank), more where it is; each stage's root that holds parameters (the
    embedding's, the head's: two on ZB-V's rank 0) once per UNSHARD."""
    accum = plan.grad_accum
    b = dtype_bytes(_compute_dtype(plan))
    root = float(local.root_params)
    if plan.pp == 1:
        blocks = local.layers
        if plan.zero == 3:  # forward, and backward where the backward pass reaches the block
            blocks += local.layers_regathered
        # the blocks are alike (a stack of repeated blocks): each the mean of the rank's blocks
        gathered = (float(local.params) - root) * blocks / local.layers if local.layers \
            else 0.0
        payload, calls = (gathered + root) * accum * b, (blocks + 1) * accum
    else:
        from ..parallel.schedules import stage_gathers

        every = stage_gathers(plan.pp_schedule, plan.pp, plan.microbatches,
                              plan.virtual_stages)
        payload, calls = 0.0, 0
        for stage, layers, block_params, root_params in local.stage_parts():
            g = every[stage]
            per_block = g.block(plan.microbatches, plan.zero)
            payload += (block_params * per_block + root_params * g.root) * accum * b
            calls += (layers * per_block + (g.root if root_params > 0 else 0)) * accum
    axes = _shard_axes(plan)
    return [Traffic(_ledger_axis(plan, axes), "all_gather", payload, calls,
                    prod(getattr(plan, a) for a in axes), "params")]


def tp_rank_traffic(plan: Any, local: LocalModel, mb: int, seq: int, hidden: int,
                    kv_whole: int = 0, block: TPBlock | None = None,
                    side_seq: int | None = None) -> list[Traffic]:
    """TP collectives of one rank in one optimizer step: its blocks' (``tp_block_traffic``,
    ``local.recomputed`` of them replayed) and the embedding's / head's (``tp_end_traffic``),
    per microbatch of ``mb`` sequences. ``kv_whole``: weight elements of one block's k and v
    projections kept whole on every rank (fewer kv heads than tp), whose gradients are
    all-reduced over tp. ``block``: the collectives of one block (default: the reference
    block's). ``side_seq``: the length of the other stack's sequence that cross-attention's
    keys and values read (:func:`tp_block_traffic`)."""
    if plan.tp == 1:
        return []
    dtype = _compute_dtype(plan)
    cast = casts_params(plan)
    micro = plan.grad_accum * (plan.microbatches if plan.pp > 1 else 1)
    out: list[Traffic] = []
    if local.layers and local.tp_blocks is not None:
        # each block as its own parameters and the gradients reaching it make it
        kinds: dict[TPBlock, int] = {}
        for one in local.tp_blocks:
            kinds[one] = kinds.get(one, 0) + 1
        for kind, count in kinds.items():
            live = kind.fwd_grad is None or any(kind.fwd_grad) or any(kind.bwd_grad or ())
            per_block = tp_block_traffic(mb, seq, hidden, plan.tp, dtype, plan.sp,
                                         recomputed=local.recomputed / local.layers,
                                         kv_whole=kv_whole if kind.trains else 0, block=kind,
                                         cast_params=cast, backward=live, side_seq=side_seq)
            out += _times(per_block, count * micro)
    elif local.layers:
        # blocks that train; frozen ones the backward pass reaches (no parameter gradient to
        # sum over tp); leading frozen ones it never reaches (forward collectives only)
        trained, reached = local.layers_trained, local.layers_reached
        ref = block or TPBlock.reference(hidden)
        # the same block without parameter gradients; its trace is the block's, made once
        frozen = dataclasses.replace(ref, sp_norms=(), summed=(), bias_gathers=(),
                                     traced=lambda: ref.trace) if trained < local.layers \
            else ref
        for kind, count, kv, backward in ((ref, trained, kv_whole, True),
                                          (frozen, reached - trained, 0, True),
                                          (frozen, local.layers - reached, 0, False)):
            if count:
                per_block = tp_block_traffic(mb, seq, hidden, plan.tp, dtype, plan.sp,
                                             recomputed=local.recomputed / local.layers,
                                             kv_whole=kv, block=kind, cast_params=cast,
                                             backward=backward, side_seq=side_seq)
                out += _times(per_block, count * micro)
    out += _times(tp_end_traffic(mb, seq, hidden, plan.tp, dtype, plan.sp, embed=local.embed,
                                 head=local.head, block=block, cast_params=cast), micro)
    return out


def casts_params(plan: Any) -> bool:
    """Whether FSDP2 holds the parameters in bf16 during compute (``MixedPrecisionPolicy``):
    bf16 under ZeRO-2/3, and under replicated DP over TP shards (FSDP2 too); elsewhere plait
    computes under autocast over fp32 parameters."""
    fsdp = plan.zero >= 2 or (plan.zero == 0 and plan.tp > 1 and plan.dp_replicate > 1)
    return plan.mixed_precision in HALF and fsdp


def pp_rank_traffic(plan: Any, local: LocalModel, mb: int, seq: int, hidden: int,
                    block: TPBlock | None = None) -> list[Traffic]:
    """Pipeline sends of one rank in one optimizer step: per microbatch and stage boundary it
    holds, the activation forward and its gradient back; a neighbour stage on the same rank
    (the V of ZB-V) is handed over locally. With SP the message is the TP shard."""
    if plan.pp == 1:
        return []
    from ..parallel.schedules import stage_to_rank

    dtype = _compute_dtype(plan)
    owner = stage_to_rank(plan.pp_schedule, plan.pp, plan.virtual_stages)
    # a block's output: the dtype the traced forward showed (``block.trace``), else the plan's
    e = (block.sizes(dtype, casts_params(plan)).stack_out if block is not None
         else dtype_bytes(dtype))
    per = float(mb) * seq * hidden * e / (plan.tp if plan.sp else 1)
    sends = 0
    for s in local.stages:
        sends += s + 1 < local.num_stages and owner[s + 1] != owner[s]  # activation
        sends += s > 0 and owner[s - 1] != owner[s]                     # its gradient
    out = []
    if sends:
        n = sends * plan.microbatches * plan.grad_accum
        out.append(Traffic("pp", "send_recv", per * n, n, 2, "activations and grads"))
    if local.tied:  # plait.parallel.pipeline sync_tied_gradients: once per optimizer step
        # First whether any copy got a gradient (one flag per tie), then the gradients.
        out.append(Traffic("pp", "all_reduce", local.tied_tensors * FP32, local.tied_tensors,
                           2, "tied weight used flags"))
        out.append(Traffic("pp", "all_reduce", local.tied * FP32, local.tied_tensors, 2,
                           "tied weight grads"))
    return out


def clip_traffic(plan: Any, local: LocalModel) -> list[Traffic]:
    """Gradient clipping (``plan.grad_clip``): ``get_total_norm`` over DTensor gradients
    all-reduces one fp32 norm per parameter tensor on every mesh axis they are sharded on, in one
    call over the flattened ``dp_shard_tp`` (``dp_shard_cp_tp``) view where they are sharded
    on both; with pipelines each stage holds only its own gradients, so the squared norm (one
    fp32) is all-reduced over ``pp`` too (``plait.train.clip_grad_norm``): a blocking call
    every stage waits in."""
    if not plan.grad_clip:
        return []
    out: list[Traffic] = []
    axes, sizes = list(local.clip_axes), {a: _axis_size(plan, a) for a in local.clip_axes}
    for pair, joined in ((("dp_shard", "tp"), DP_SHARD_TP),
                         ((DP_SHARD_CP, "tp"), DP_SHARD_CP_TP)):
        if set(pair) <= set(axes):
            # plait.mesh builds the flattened (dp_shard[, cp], tp) view, so DTensor reduces
            # norms partial over both axes in one all-reduce over it, not one per axis
            axes = [a for a in axes if a not in pair] + [joined]
            sizes[joined] = _axis_size(plan, joined)
    for axis in axes:
        name = _ledger_axis(plan, dict(_FLAT).get(axis, (axis,)))  # dp_shard_cp at dp_shard=1: cp
        out.append(Traffic(name, "all_reduce", float(local.clip_tensors) * FP32, 1, sizes[axis],
                           "clip: per-tensor norms"))
    if plan.pp > 1:
        out.append(Traffic("pp", "all_reduce", float(FP32), 1, plan.pp, "clip: squared norm"))
    return out


def tp_block_traffic(b: int, s: int, h: int, tp: int, dtype: str, sp: bool,
                     recomputed: float = 0.0, kv_whole: int = 0,
                     block: TPBlock | None = None, cast_params: bool = False,
                     backward: bool = True, side_seq: int | None = None) -> list[Traffic]:
    """TP collectives of one block for one microbatch (forward + backward), as plait's runtime
    issues them for ``block`` (default: the reference block, Megatron's 4 all-reduces of
    b*s*h; with SP 4 all-gathers + 4 reduce-scatters plus the 2 sequence-parallel norms'
    weight-gradient all-reduces, h fp32 each). A block with an MLP only issues half of that:
    the count follows the block's row- and column-parallel layers, not a fixed 4.
    ``recomputed`` (0..1): share of the block replayed by checkpointing. torch's non-reentrant
    checkpoint stops once the last tensor the block saves is recomputed: a traced block
    (``block.trace``) replays the forward collectives followed by a save; otherwise every
    forward collective but the last (the reference block: 1 all-reduce; SP: 2 all-gathers + 1
    reduce-scatter). Under bf16 each collective travels in the dtype the traced forward showed
    (``block.sizes``; ``cast_params``: FSDP2 holds the parameters in bf16). ``kv_whole``:
    elements of k and v weights kept whole on every rank (fewer kv heads than tp); their
    gradients are all-reduced in each backward, one call each. ``backward``: whether the
    backward pass reaches the block (False: a leading frozen block, :mod:`plait.comm.reach`:
    its forward collectives alone, SP's all-gather of each region's input and reduce-scatter
    of each row-parallel output). Of a block the backward pass enters in part, only the
    counterparts ``block.fwd_grad`` / ``block.bwd_grad`` name are issued in backward.
    ``side_seq``: the sequence length of the other stack whose output ``block.side`` entries
    read (cross-attention's keys and values; default ``s``): each all-reduces the gradient of
    that whole input in backward, under SP too."""
    if tp == 1:
        return []
    block = block or TPBlock.reference(h)
    e = block.sizes(dtype, cast_params)
    tokens = float(b) * s
    side = block.side or (False,) * len(block.backward)
    other = tokens if side_seq is None else float(b) * side_seq
    every = [(other if sd else tokens) * f * k
             for f, k, sd in zip(block.backward, e.backward, side, strict=True)]
    # the backward counterparts the backward pass issues: those whose tensor needs a gradient
    issued = block.bwd_grad or (backward,) * len(every)
    bwd = [x for x, sd in zip(every, side, strict=True) if not sd]
    bwd_back = [x for x, y, sd in zip(every, issued, side, strict=True)
                if y and backward and not sd]
    side_back = [x for x, y, sd in zip(every, issued, side, strict=True)
                 if y and backward and sd]
    fwd = [tokens * f * k for f, k in zip(block.forward, e.forward, strict=True)]
    fwd_back = [x for x, y in zip(fwd, block.fwd_grad or (backward,) * len(fwd), strict=True)
                if y and backward]
    # the reference block's parameter gradients: at the activations' size (the planner's
    # estimate); a traced block's: as the trace showed (fp32: 4 bytes either way, no trace)
    half = dtype in HALF
    g = e.grads if half and block.trace is not None else FP32
    out: list[Traffic] = []
    if fwd or bwd:
        if sp:  # forward: each input gathered, each output scattered; backward the reverse
            out += [Traffic("tp", "all_gather", sum(bwd) + sum(fwd_back),
                            len(bwd) + len(fwd_back), tp, "activations"),
                    Traffic("tp", "reduce_scatter", sum(fwd) + sum(bwd_back),
                            len(fwd) + len(bwd_back), tp, "activations")]
        else:
            out.append(Traffic("tp", "all_reduce", sum(fwd) + sum(bwd_back),
                               len(fwd) + len(bwd_back), tp, "activations"))
    if side_back:
        out.append(Traffic("tp", "all_reduce", sum(side_back), len(side_back), tp,
                           "other stack's output grad"))
    if not backward:  # no parameter gradient, nothing replayed
        return [t for t in out if t.calls]
    if sp and block.sp_norms:
        out.append(Traffic("tp", "all_reduce", float(sum(block.sp_norms)) * g,
                           len(block.sp_norms), tp, "norm weight grads"))
    if block.summed:
        out.append(Traffic("tp", "all_reduce", float(sum(block.summed)) * g,
                           len(block.summed), tp, "grad_allreduce weight grads"))
    if block.bias_gathers:
        out.append(Traffic("tp", "all_gather", float(sum(block.bias_gathers)) * g,
                           len(block.bias_gathers), tp, "fused qkv bias grads"))
    if kv_whole:
        kv = e.grads if half and block.trace is not None else dtype_bytes(dtype)
        out.append(Traffic("tp", "all_reduce", float(kv_whole) * kv, 2, tp,
                           "replicated kv weight grads"))
    if recomputed and fwd:
        # calls per block averaged over the blocks (selective checkpointing replays some):
        # fractional, which Traffic's int annotation does not foresee
        r: Any = recomputed
        trace = block.trace
        again = [x for x, y in zip(fwd, trace.replayed, strict=True) if y] if trace else fwd[:-1]
        gathers = [x for x, y, sd in zip(every, trace.replayed_gathers, side, strict=True)
                   if y and not sd] if trace else bwd
        if sp:
            out += [Traffic("tp", "all_gather", sum(gathers) * r, len(gathers) * r, tp,
                            "checkpoint replay"),
                    Traffic("tp", "reduce_scatter", sum(again) * r, len(again) * r, tp,
                            "checkpoint replay")]
        else:
            out.append(Traffic("tp", "all_reduce", sum(again) * r, len(again) * r, tp,
                               "checkpoint replay"))
    return [t for t in out if t.calls]


def tp_end_traffic(b: int, s: int, h: int, tp: int, dtype: str, sp: bool, *, embed: bool,
                   head: bool, block: TPBlock | None = None,
                   cast_params: bool = False) -> list[Traffic]:
    """TP collectives outside the blocks per microbatch: the vocabulary-parallel embedding and
    the head each an all-reduce of b*s*h (SP: all-gather + reduce-scatter), loss_parallel's 3
    fp32 values per token, and with SP the final norm's weight-gradient all-reduce. Where the
    sequence is split inside the block stack only (``block.sp_in_blocks``), the embedding and
    head keep their all-reduces under SP, and the stack's output is all-gathered in forward,
    the gradient of its input in backward (where the input needs one). Under bf16 each in the
    dtype a traced block showed (``TPBlock.sizes``)."""
    if tp == 1:
        return []
    e = (block or TPBlock.reference(h)).sizes(dtype, cast_params)
    if block is not None and not sp:  # plain input and output layers: nothing at the ends
        embed, head = embed and block.vocab_ends[0], head and block.vocab_ends[1]
    tokens = float(b) * s * h
    ends = int(embed) + int(head)
    act = tokens * (e.embed_out * embed + e.head_in * head)
    ends_what = " + ".join(["embedding output"] * embed + ["head input grad"] * head)
    out = []
    if sp and block is not None and block.sp_in_blocks:
        # the stack's ends are gathered whatever surrounds them; the embedding and the head
        # all-reduce only where they are vocabulary-parallel (a tower fed by a convolution and
        # read by a projection kept whole has neither)
        vocab_embed, vocab_head = embed and block.vocab_ends[0], head and block.vocab_ends[1]
        split = int(vocab_embed) + int(vocab_head)
        if split:
            out.append(Traffic("tp", "all_reduce",
                               tokens * (e.embed_out * vocab_embed + e.head_in * vocab_head),
                               split, tp, " + ".join(["embedding output"] * vocab_embed
                                                     + ["head input grad"] * vocab_head)))
        into = embed and block.input_grad
        edges = int(head) + int(into)
        if edges:
            out.append(Traffic("tp", "all_gather",
                               tokens * (e.stack_out * head + e.stack_in * into), edges, tp,
                               "block stack output + input grad"))
        if vocab_head:
            out.append(Traffic("tp", "all_reduce", 3.0 * b * s * 4, 3, tp, "loss_parallel"))
        return out
    if ends:
        if sp:
            out += [Traffic("tp", "all_gather", act, ends, tp, ends_what),
                    Traffic("tp", "reduce_scatter", act, ends, tp, ends_what)]
        else:
            out.append(Traffic("tp", "all_reduce", act, ends, tp, ends_what))
    if head:
        out.append(Traffic("tp", "all_reduce", 3.0 * b * s * 4, 3, tp, "loss_parallel"))
        norms = (h,) if block is None or block.end_norms is None else block.end_norms
        if sp and norms:
            out.append(Traffic("tp", "all_reduce", float(sum(norms)) * 4, len(norms), tp,
                               "final norm grad"))
    return out


def tp_stack_traffic(plan: Any, mb: int, seq: int, hidden: int, block: TPBlock, layers: int,
                     *, embedded: bool, side_seq: int | None = None,
                     recomputed: float = 0.0) -> list[Traffic]:
    """TP collectives of one rank in one optimizer step of a further stack of ``layers``
    blocks like ``block`` (an encoder-decoder's other stack, a two-tower model's other tower)
    on its own sequence of ``seq`` positions, per microbatch of ``mb`` sequences: its blocks'
    (:func:`tp_block_traffic`, ``recomputed`` (0..1) of each replayed, ``side_seq`` the length
    its cross-attention reads), the vocabulary-parallel embedding's all-reduce where that
    embedding makes this stack's input (``embedded``), and under SP, which splits each stack's
    sequence at its first block and gathers it after its last, its output all-gathered in
    forward and its input's gradient in backward (where the input needs one)."""
    if plan.tp == 1 or not layers:
        return []
    dtype, cast, tp = _compute_dtype(plan), casts_params(plan), plan.tp
    micro = plan.grad_accum * (plan.microbatches if plan.pp > 1 else 1)
    out = _times(tp_block_traffic(mb, seq, hidden, tp, dtype, plan.sp, recomputed=recomputed,
                                  block=block, cast_params=cast, side_seq=side_seq), layers)
    e = block.sizes(dtype, cast)
    tokens = float(mb) * seq * hidden
    if embedded and block.vocab_ends[0]:
        out.append(Traffic("tp", "all_reduce", tokens * e.embed_out, 1, tp, "embedding output"))
    if plan.sp and block.sp_in_blocks:
        edges = 1 + int(block.input_grad)
        out.append(Traffic("tp", "all_gather",
                           tokens * (e.stack_out + e.stack_in * block.input_grad), edges, tp,
                           "block stack output + input grad"))
    return _times(out, micro)


def _times(traffic: list[Traffic], k: int) -> list[Traffic]:
    """``traffic`` repeated ``k`` times (:meth:`Traffic.times`)."""
    if k == 1:
        return traffic
    return [t.times(k) for t in traffic]


def by_axis_op(traffic: list[Traffic]) -> dict[tuple[str, str], float]:
    """Sum payload bytes per (axis, op): the shape ``Ledger.report(expected=...)`` takes."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for t in traffic:
        out[(t.axis, t.op)] += t.payload
    return dict(out)


def calls_by_axis_op(traffic: list[Traffic]) -> dict[tuple[str, str], float | None]:
    """Sum calls per (axis, op); None for a row where any of its traffic's count is not known
    (``Traffic.calls_known``)."""
    out: dict[tuple[str, str], float | None] = {}
    for t in traffic:
        key = (t.axis, t.op)
        was = out.get(key, 0.0)
        out[key] = None if was is None or not t.calls_known else was + t.calls
    return out


def expected_rows(traffic: list[Traffic]) -> Expected:
    """Payload bytes and calls per (axis, op): what ``Ledger.report(expected=...)`` compares
    row by row."""
    return Expected(by_axis_op(traffic), calls_by_axis_op(traffic))


def _find_config(model: Any) -> Any:
    """The reference TransformerConfig under any wrapper (DDP, pipeline stages), or None."""
    from ..models.config import TransformerConfig
    from ..parallel.layout import local_modules

    for module in local_modules(model):
        for sub in module.modules():
            cfg = getattr(sub, "config", None)
            if isinstance(cfg, TransformerConfig):
                return cfg
    return None


def local_model(model: Any, plan: Any, ready_order: tuple[int, ...] | None = None
                ) -> LocalModel:
    """Read a ``LocalModel`` off a model ``plait.parallelize`` returned; ``ready_order``: the
    order its gradients became ready in the run, where it is one DDP module
    (``plait.comm.ready_order``).

    Parameters are counted at their tensor-parallel-local size, the piece this rank holds (a
    dim tp does not divide is cut as ``torch.chunk`` cuts it, the first piece the largest):
    where FSDP2 holds them (ZeRO-2/3, replicated DP over tp) at the size FSDP2 gathers and
    reduces, its padded shard of the tp-local tensor times the shard count
    (``plait.comm.held.fsdp_padded_numels``: dim 0 rounded up to a multiple of dp_shard);
    a DTensor split on tp alone, its local tensor (FSDP's own sharding is what data
    parallelism undoes).
    """
    from torch.distributed.tensor import DTensor

    from .._torch_compat import checkpoint_wrapper_api, is_split
    from ..parallel.layout import layout_of, local_modules
    from ..parallel.pipeline_split import PipelineSkip
    from ..parallel.units import canonical_name
    from .held import fsdp_padded_numels

    modules = local_modules(model)
    specs = layout_of(model).stage_specs
    total = root = tensors = layers = recomputed = grads = grad_tensors = 0
    clip: set[str] = set()
    embed = head = False
    stage_layers: list[int] = []
    stage_roots: list[float] = []
    stage_params: list[float] = []
    sizes: list[tuple[tuple[str, float], ...]] = []
    seen: set[int] = set()
    for module in modules:
        inner = getattr(module, "module", module)  # DDP
        padded = fsdp_padded_numels(module)  # FSDP2's own sizes, where it holds parameters
        before = (total, root, layers)
        mine: list[tuple[str, float]] = []
        for name, p in module.named_parameters():
            n = p.numel()
            if isinstance(p, DTensor) and (mesh := p.device_mesh).mesh_dim_names:
                split = [dim for dim, placement in zip(mesh.mesh_dim_names, p.placements,
                                                       strict=True) if is_split(placement)]
                clip.update(split)
                if split == ["tp"]:  # this rank's piece, as torch.chunk cuts an uneven dim
                    n = p.to_local().numel()
                elif "tp" in split:
                    n //= mesh.size(mesh.mesh_dim_names.index("tp"))
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                mine.append((str(p.dtype), float(n * p.element_size())))
            n = padded.get(id(p), n)
            total += n
            tensors += 1
            if p.requires_grad:
                grads += n
                grad_tensors += 1
            if not canonical_name(name).startswith("layers."):
                root += n
        for block in getattr(inner, "layers", []):
            if isinstance(block, PipelineSkip):
                continue
            layers += 1
            recomputed += isinstance(block, checkpoint_wrapper_api()[2])
        embed |= not isinstance(getattr(inner, "tok_embeddings", None), (PipelineSkip, type(None)))
        head |= not isinstance(getattr(inner, "output", None), (PipelineSkip, type(None)))
        sizes.append(tuple(mine))
        stage_params.append(float(total - before[0]))
        stage_roots.append(float(root - before[1]))
        stage_layers.append(layers - before[2])
    stages = tuple(s.index for s in specs) if specs else (0,)
    num_stages = specs[0].num_stages if specs else 1
    # A tied head on a rank that holds the embedding or the head alone: its copy's local
    # piece (TP-local, FSDP2's shard) is summed with the other stage's every step
    # (plait.parallel.pipeline sync_tied_gradients); a frozen one is not.
    cfg = _find_config(model)
    tied = 0
    if cfg is not None and cfg.tie_embeddings and embed != head:
        for module in modules:
            inner = getattr(module, "module", module)
            owner = getattr(inner, "tok_embeddings" if embed else "output", None)
            weight = getattr(owner, "weight", None)
            if weight is not None and weight.requires_grad:
                tied += (weight.to_local() if hasattr(weight, "to_local") else weight).numel()
    # Flattened names: FSDP2 over (dp_replicate, dp_shard) shards on dp_shard only (on
    # dp_shard_cp under context parallelism).
    order = ("dp_replicate", "dp_shard", DP_SHARD_CP, "tp")
    per_stage = len(stage_layers) == len(stages)
    return LocalModel(params=total, root_params=root, tensors=tensors, layers=layers,
                      recomputed=recomputed, embed=embed, head=head, stages=stages,
                      num_stages=num_stages,
                      clip_axes=tuple(a for a in order if a in clip and _axis_size(plan, a) > 1),
                      grad_params=grads, grad_tensors=grad_tensors, tied=float(tied),
                      # each stage's own blocks and root, where the modules are the stages
                      stage_layers=tuple(stage_layers) if per_stage else None,
                      stage_roots=tuple(stage_roots) if per_stage else None,
                      stage_params=tuple(stage_params) if per_stage else None,
                      grad_tensor_bytes=tuple(sizes),
                      grad_ready_order=ready_order if len(sizes) == 1 and ready_order is not None
                      and sorted(ready_order) == list(range(len(sizes[0]))) else None)


def reads_trace(plan: Any) -> bool:
    """Whether ``plan``'s predicted traffic reads the traced forward pass (``TPBlock.trace``):
    a 16-bit dtype, or checkpointing under tensor parallelism. Otherwise fp32 moves 4 bytes
    per element and nothing is replayed, whatever the pass would show."""
    return plan.mixed_precision in HALF or (
        plan.tp > 1 and plan.activation_checkpointing != "none")


def planner_stats(model: Any, device_type: str = "cpu", plan: Any = None,
                  example: Any = None) -> Any:
    """The planner's stats of ``model`` (``plait.planner.model_stats.from_module``), taken
    before it is laid out; None for plait's reference transformer (its closed form is exact)
    and for a model the planner cannot read (no stack of blocks). Its forward is traced under
    ``device_type``'s autocast rules now, while the model is as the user built it, where
    ``plan`` reads the trace (:func:`reads_trace`) or no plan is given; otherwise not at
    all. ``example``: the user's input (``run.parallelize(model, example=batch)``) the forward
    passes run on, in place of token ids."""
    from ..planner.model_stats import from_module

    if _find_config(model) is not None:
        return None
    # under cp and bf16: the dtypes K and V reach attention in, read now, before layout
    # changes the model (as ``plait plan`` reads them)
    dtypes = plan is not None and plan.cp > 1 and plan.mixed_precision in HALF
    try:
        stats = from_module(model, name=type(model).__name__, device_type=device_type,
                            attention_dtypes=dtypes, example=example)
    except ValueError:
        return None
    block = stats.tp_block
    if block is not None:
        if plan is None or reads_trace(plan):
            block.trace  # noqa: B018 - made before layout changes the model
        elif callable(block.traced):
            object.__setattr__(block, "traced", None)  # never made on a laid-out model
    return stats


def expected_for_models(models: list[Any], plan: Any, batch_shape: tuple[int, ...] | None,
                        optimizer_params: list[Any] | None = None, stats: Any = None,
                        pp_rank: int = 0, tokens: bool = True,
                        input_grad: bool | None = None,
                        ready_orders: dict[int, tuple[int, ...] | None] | None = None,
                        stack_seqs: dict[str, int] | None = None) -> Expected | None:
    """Predicted payload bytes per (axis, op) per step, with the calls carrying them
    (:class:`plait.comm.report.Expected`), or None where plait has no closed form.

    The reference transformer: every layout (``predict``); ``batch_shape`` is the shape of one
    rank's input batch (per data replica, all micro-steps). Any other model: layouts without
    tensor or pipeline parallelism (``plait.comm.held``: data-parallel traffic depends on the
    parameters each rank holds, not on the architecture; ``optimizer_params``: what ZeRO-1's
    optimizer updates and broadcasts); under tensor or pipeline parallelism, the planner's
    traffic for pipeline rank ``pp_rank`` of the model ``stats`` describes
    (``planner_stats``, taken before layout; ``plait.planner.cost.rank_traffic``), whose
    blocks it prices from the layer plan plait lays them out with (``tokens``: the first input
    was integer token ids; :func:`why_no_expected` says where it cannot); ``input_grad``:
    whether the first block's input needs a gradient (``plait.comm.held.stack_input_grad``,
    taken before layout; None: where an embedding trains); ``ready_orders``: by ``id`` of each
    DDP module, the order its gradients became ready in the run (``plait.comm.ready_order``),
    which DDP's bucket count follows; ``stack_seqs``: the sequence length each stack of
    blocks ran on, by its first block's path (``plait.comm.stack_lengths``), for a model
    with several. The ledger's report
    compares each row's busiest rank, and ranks hold different parts of the model (pipeline
    stages), so each rank predicts its own traffic and the per-(axis, op) maximum over ranks is
    returned, with the calls of the rank predicted the most bytes: a collective when a process
    group is up (call it on every rank, as ``Run.summary`` does).
    """
    import torch.distributed as dist

    mine: Expected | None = None
    cfg = _find_config(models[-1]) if models else None
    if plan.cp > 1 and cfg is None:  # every rank returns here alike: no collective unpaired
        if not models or why_no_cp_expected(plan, stats, batch_shape, tokens) is not None:
            return None
        from ..planner.cost import cp_step_traffic
        from .held import held_model, held_traffic

        assert batch_shape is not None  # why_no_cp_expected said so
        batch, seq = batch_shape
        if plan.tp > 1:
            from ..planner.cost import rank_traffic

            # tp's rows on the rank's seq / cp tokens, cp's K/V rows of its share of the kv
            # heads, the gradients over dp x cp: the planner's, as under tp alone
            per_rank = rank_traffic(plan, stats, batch * plan.dp, seq)
            mine = expected_rows(per_rank[0]) if per_rank else None
        else:
            held = held_model(models[-1], optimizer_params,
                              ready_order=(ready_orders or {}).get(id(models[-1])))
            mine = expected_rows(held_traffic(plan, held)
                                 + cp_step_traffic(plan, stats, batch // plan.grad_accum, seq))
    elif cfg is not None and batch_shape is not None and len(batch_shape) == 2:
        batch, seq = batch_shape
        local = local_model(models[-1], plan, (ready_orders or {}).get(id(models[-1])))
        mine = expected_rows(predict(plan, cfg, batch // plan.grad_accum, seq, local=local))
    elif cfg is None and (plan.tp > 1 or plan.pp > 1):
        if batch_shape is not None and why_no_expected(plan, stats, batch_shape, tokens) is None:
            from ..planner.cost import rank_traffic

            # token ids (b, s); feature vectors (b, [s, ...,] features): a token per row;
            # a model with several stacks: the length its main stack ran on
            seq = batch_shape[1] if tokens else prod(batch_shape[1:-1])
            seqs = stack_seqs or {}
            per_rank = rank_traffic(plan, stats, batch_shape[0] * plan.dp,
                                    seqs.get(stats.stack_first, seq), seqs)
            mine = expected_rows(per_rank[pp_rank]) if per_rank else None
    elif cfg is None and models and plan.tp == 1 and plan.pp == 1:
        from .held import held_model, held_traffic

        mine = expected_rows(held_traffic(plan, held_model(
            models[-1], optimizer_params, input_grad,
            ready_order=(ready_orders or {}).get(id(models[-1])))))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, None if mine is None else (dict(mine), mine.calls))
    if any(e is None for e in everyone):
        return None
    out: dict[tuple[str, str], float] = {}
    for payload, _ in everyone:
        for key, value in payload.items():
            out[key] = max(out.get(key, 0.0), value)
    # the ledger's row is its busiest rank's: the calls of the rank(s) sending the most bytes
    calls: dict[tuple[str, str], float | None] = {}
    for key, most in out.items():
        counts = [c.get(key) for payload, c in everyone if payload.get(key) == most]
        calls[key] = None if any(c is None for c in counts) else max(
            c for c in counts if c is not None)
    return Expected(out, calls)
