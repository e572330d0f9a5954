"""Memory per device: model state by ZeRO stage, activations by schedule, logits, buffers.

* Parameters (fp32), gradients (fp32), AdamW state (2 x fp32), the last two for trainable
  parameters only. FSDP2 (ZeRO-2/3) shards
  parameters and gradients over dp_shard, each rank holding its padded shard (dim 0 rounded
  up to a multiple of dp_shard: ``plait.planner.fsdp_rows``, in each rank's share); ZeRO-1 is
  DDP + ZeroRedundancyOptimizer in plait's runtime, so only AdamW's state is sharded. A
  compute-dtype copy of the parameters under bf16; ZeRO-2 keeps the whole stage gathered from
  forward to backward (docs/zero.md: 16 Psi / d + C Psi), ZeRO-3 two gathered blocks.
* Activations per block after Korthikanti et al. 2022 (table 2), generalised to GQA, SwiGLU and
  any ffn size: 2-byte figures scaled to the compute dtype; the replicated part (norm inputs,
  inputs of QKV/MLP, dropout masks: 10sbh for GPT) is not divided by tp unless sp; attention
  scores (5as^2b) only without flash attention. The dropout masks (2sbh after the attention
  output and the MLP, as^2b on the attention probabilities, whose dropped copy is 2as^2b more)
  only for a model that trains with dropout (``ModelStats.dropout``): 32sbh + 2as^2b without.
  A module's block that runs alone is measured by running it (:mod:`plait.planner.saved`):
  the bytes per token it saves beyond this count are added (whole under TP unless sp), and
  where it saves its scores (attention written as matmuls, on any device) they are priced
  at what it saves, flash attention or not.
  Full recomputation keeps the block input (plus one block being recomputed); "selective"
  checkpoints every k-th block; "op" is approximated as keeping 60% of a block's activations
  and replaying 5% of its forward.
* Cross-attention (an encoder-decoder's decoder block): its keys, values and scores on the
  other stack's tokens, its queries on the block's own; the other stack's output it reads is
  one tensor all the stack's blocks share, counted once.
* Context parallelism: the activations of each rank's ``s / cp`` tokens, plus per block the
  whole sequence's keys and values that attention gathered and saves for backward
  (``2 b s kv_heads head_dim``, not kept by a checkpointed block) and one ``(s/cp) x s``
  boolean mask; FSDP2 shards the model state over dp_shard x cp.
* Microbatches in flight per schedule (:func:`plait.planner.pipeline.inflight`).
* The logits on the last stage (:mod:`plait.planner.logits`): what the model hands its loss
  (``ModelStats.head_logits``: a language model's tokens x vocab, 1/tp where the plan splits
  the head), the loss's fp32 log-softmax output per microbatch held (and the logits
  themselves, which a pipeline's schedule keeps), and the gradients of its backward; a
  reserve from the cluster description.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from plait.comm.predict import LocalModel
from plait.plan import Plan

from .hardware import Cluster
from .logits import logits_bytes
from .memo import Memo
from .model_stats import ModelStats
from .pipeline import Stages, inflight
from .traffic import act_dtype_bytes, state_shards

if TYPE_CHECKING:
    from .cost import Constants


def activation_bytes_per_block(m: ModelStats, b: int, s: int, tp: int, sp: bool, dtype_bytes: int,
                               c: Constants, keys: int | None = None,
                               side_seq: int | None = None) -> float:
    """Korthikanti et al. 2022 activation memory of one block and microbatch (no recompute),
    of ``b`` rows of ``s`` tokens whose queries attend to ``keys`` keys each (``s`` unless
    context parallelism split the sequence: then ``s`` is the rank's slice, ``keys`` the
    whole sequence, and the scores without flash attention are (s/cp) x s per head).
    Cross-attention layers (``m.cross_attentions``) read another stack's ``side_seq`` tokens
    (default ``keys``): their keys and values and their scores follow that length, their
    queries this block's; the other stack's output they read is one tensor every block of
    the stack shares, not counted here (:func:`side_input_bytes`)."""
    h, f, a = m.hidden, m.ffn, m.n_heads
    kv = m.kv_heads * (h // m.n_heads)
    mask = 1 if m.dropout else 0
    n = m.attentions  # attention layers (a decoder block's self- and cross-attention: 2)
    x = m.cross_attentions if m.attention else 0  # of which cross-attention
    keys = keys or s
    other = keys if side_seq is None else side_seq
    # 2-byte units of s*b: self-attention: QKV input 2h, q/k/v 2(h+2kv), o_proj input 2h,
    # mask h; cross-attention: q input 2h, q 2h, o_proj input 2h, mask h per own token and
    # k/v 4kv per token of the other stack
    attn = (n - x) * (2 * h + 2 * (h + 2 * kv) + 2 * h + mask * h) + x * (6 * h + mask * h)
    side = x * 4 * kv  # per token of the other stack, split over tp (column-parallel k, v)
    # what the activation saves besides its output (``m.act_saved``, else by kind: a ReLU
    # its output only, a GELU or SiLU its input)
    act = m.act_saved if m.act_saved is not None else (0 if m.mlp == "relu" else 1)
    if m.mlp == "swiglu":  # any gated MLP: input, act's, act output, up output, down input
        mlp = 2 * h + 2 * f * (act + 3) + mask * h
    else:  # input, act's, act output (the down projection's input)
        mlp = 2 * h + 2 * f * (act + 1) + mask * h
    # one before each attention layer and the MLP: its input, and the normalized copy its
    # weight's multiply saves where the norm is Python ops (``m.norm_copy``)
    norms = 2 * h * (n + 1) * (2 if m.norm_copy else 1)
    # stays whole under TP without SP: each norm's input, each sublayer's input, the masks
    replicated = norms + (n + 1) * (2 * h + mask * h)
    sharded = attn + mlp + norms - replicated
    # the scores without flash attention: softmax output 2as (the input of the matmul with V
    # when nothing drops), with dropout its mask as and its output 2as (Korthikanti's 5as)
    scores = 0.0 if (c.flash_attention or not m.attention) else \
        (2 + 3 * mask) * a * ((n - x) * keys + x * other)  # per token
    # a block measured to save its scores (attention written as matmuls and a softmax)
    # saves them whatever kernels the device has: what they take, in 2-byte units
    measured = m.saved_scores[0 if dtype_bytes == 4 else 1] if m.saved_scores else 0.0
    if measured and m.attention and not x:
        scores = measured * 2 / dtype_bytes * keys
    elif measured and m.attention and m.saved_cross_scores is not None:
        # the self-attention's on this stack's keys, the cross-attention's on the other's
        cross = m.saved_cross_scores[0 if dtype_bytes == 4 else 1]
        scores = (measured * keys + cross * other) * 2 / dtype_bytes
    elif measured and m.attention:
        # measured with as many keys in every attention layer: each layer's share, on its own
        # keys (the cross-attention's, the other stack's tokens)
        scores = measured * 2 / dtype_bytes * ((n - x) * keys + x * other) / n
    per_token = (replicated / (tp if sp else 1)) + (sharded + scores) / tp
    # what the block's own ops save beyond this count, measured (bytes, whole under TP)
    extra = m.saved_extra[0 if dtype_bytes == 4 else 1] / (tp if sp else 1)
    # per token of the other stack (autocast's casts of its output, which every rank reads
    # whole), measured
    extra_side = m.saved_side[0 if dtype_bytes == 4 else 1] * other
    return max((per_token * s + side / tp * other) * dtype_bytes / 2 + extra * s
               + extra_side, 0.0) * b


def side_input_bytes(m: ModelStats, b: int, side_seq: int, dtype_bytes: int) -> float:
    """Bytes of the other stack's output that the cross-attention of ``m``'s blocks saves for
    backward (its keys' and values' input): one tensor of ``b`` rows of ``side_seq`` tokens,
    whole on every tp rank, that every block of the stack reads; 0 without cross-attention.
    Under 16-bit autocast (``dtype_bytes`` < 4) the key and value projections save
    autocast's cast of it, not the fp32 output itself: where the blocks' casts are measured
    (``m.saved_side``, per block) nothing more is saved, so 0; else the one 16-bit copy."""
    if not (m.attention and m.cross_attentions):
        return 0.0
    if dtype_bytes < 4 and m.saved_side[1] > 0:
        return 0.0
    return float(b) * side_seq * m.hidden * dtype_bytes


def checkpointed(plan: Plan, layers: int) -> tuple[int, float]:
    """(blocks whose activations are dropped, fraction of a block's forward replayed per block
    of this rank) for the plan's checkpointing mode."""
    mode = plan.activation_checkpointing
    if mode == "full":
        return layers, 1.0
    if mode == "selective":
        n = math.ceil(layers / plan.checkpoint_every)
        return n, n / layers if layers else 0.0
    if mode == "op":
        return 0, 0.05
    return 0, 0.0


def more_stacks_activations(plan: Plan, model: ModelStats, b: int, s: int,
                            stack_seqs: dict[str, int], ab: int, c: Constants) -> float:
    """Bytes the further stacks of blocks (``model.more_stacks``: an encoder-decoder's other
    stack) save for backward in one microbatch, each block priced by its own shape
    (:meth:`ModelStats.stack_block`) on the stack's own sequence (``stack_seqs`` by first
    block, default ``s``), those the plan's checkpointing drops keeping their input only,
    plus the stack's input. None under a pipeline: plait does not cut a model with several
    stacks into stages."""
    if plan.pp > 1:
        return 0.0
    total = 0.0
    for more in model.more_stacks:
        seq = stack_seqs.get(more.first, s) // plan.cp
        block = model.stack_block(more)
        full = activation_bytes_per_block(block, b, seq, plan.tp, plan.sp, ab, c, keys=seq,
                                          side_seq=s)
        kept_input = b * seq * model.hidden * ab / (plan.tp if plan.sp else 1)
        dropped, _ = checkpointed(plan, more.n_layers)
        total += (more.n_layers - dropped) * full + dropped * kept_input + kept_input
        total += side_input_bytes(block, b, s, ab)
    return total


def peak_memory(plan: Plan, model: ModelStats, cluster: Cluster, b: int, s: int,
                st: Stages, shares: Sequence[LocalModel], c: Constants,
                stack_seqs: dict[str, int] | None = None, *,
                memo: Memo | None = None) -> tuple[float, dict[str, float]]:
    """(bytes on the busiest pipeline rank, its breakdown). Peak memory sits on the first rank
    (most microbatches in flight) or the last (logits); rank 1 is checked too for the
    interleaved warm-up. A model's further stacks of blocks (``model.more_stacks``, without a
    pipeline) save their blocks' activations on their own sequences (``stack_seqs`` by first
    block, default ``s``): :func:`more_stacks_activations`. ``memo``: the search's
    (:class:`plait.planner.memo.Memo`), else the pieces are read afresh."""
    pp, tp, cp, R, zero = plan.pp, plan.tp, plan.cp, plan.dp_replicate, plan.zero
    S = state_shards(plan)  # ZeRO-1's optimizer: dp_shard (x cp)
    dtype = plan.mixed_precision
    ab = act_dtype_bytes(dtype)
    m = plan.microbatches if pp > 1 else 1
    chunks = len(st.sizes)
    local = s // cp  # context parallelism: this rank's tokens of each sequence
    tokens = b * local
    # the further stack's sequence the blocks' cross-attention reads (an encoder's source)
    side = model.side_seq(s, stack_seqs or {})
    act_full = activation_bytes_per_block(model, b, local, tp, plan.sp, ab, c, keys=s,
                                          side_seq=side)
    # the whole sequence's keys and values, gathered over cp, which attention saves for backward
    kv_saved = 2.0 * b * s * model.kv_dim(tp) * ab if cp > 1 else 0.0
    act_full += kv_saved
    act_input = tokens * model.hidden * ab / (tp if plan.sp else 1)
    # the boolean mask of the rank's queries against every key, built once per step
    mask = float(local) * s if cp > 1 and model.attention else 0.0
    pads = (Memo() if memo is None else memo).uneven_pieces(plan, model)
    # alike on every rank: the further stacks' activations, the other stack's output the
    # cross-attention reads (per microbatch in flight), the buffers
    more = more_stacks_activations(plan, model, b, s, stack_seqs or {}, ab, c)
    side_input = side_input_bytes(model, b, side, ab)
    buffers = 2 * c.bucket_bytes if (R > 1 or S > 1 or cp > 1) else 0.0
    best, breakdown = -1.0, {}
    for r in sorted({0, min(1, pp - 1), pp - 1}):
        ids = st.rank_chunks[r]
        layers = st.rank_layers[r]
        Pr, Gr = shares[r].params, shares[r].grads
        # fp32 master parameters and gradients: sharded under FSDP2 (ZeRO-2/3). ZeRO-1 is
        # DDP + ZeroRedundancyOptimizer in plait's runtime, so only AdamW's state is sharded.
        # Frozen parameters (a LoRA base) hold no gradient and no AdamW state.
        params = 4 * Pr / (S if zero >= 2 else 1)
        grads = 4 * Gr / (S if zero >= 2 else 1)
        optim = 8 * Gr / (S if zero >= 1 else 1)
        copy = 0.0
        if zero == 2:
            # reshard_after_forward=False: the whole stage is gathered in the compute dtype
            # from forward to backward (docs/zero.md: 16 Psi / d + C Psi)
            copy = Pr * act_dtype_bytes(dtype)
        elif dtype in ("bf16", "fp16") and zero < 2:
            copy = 2 * Pr
        if zero == 3:  # two blocks gathered, at FSDP2's padded rows
            block = model.block_params / tp + (pads[0].all if pads else 0.0)
            copy += 2 * 2 * block * ab / 2 * (2 if dtype == "fp32" else 1)
        dropped, _ = checkpointed(plan, layers)
        per_mb = (layers - dropped) * act_full + dropped * act_input
        if plan.activation_checkpointing == "op":
            per_mb = 0.6 * layers * act_full
        held = inflight(plan, r, m)
        acts = per_mb * held
        if dropped:
            acts += act_full  # the block being recomputed
        if 0 in ids:
            acts += act_input * held  # embedding output
        acts += more
        # the other stack's output, read by every block's cross-attention (kept by a
        # checkpointed block too: it is one of the block's inputs)
        acts += side_input * held
        logits = 0.0
        if chunks - 1 in ids:
            kept = m if (pp > 1 and plan.pp_schedule == "gpipe") else 1
            logits = logits_bytes(model.head_logits, b, local, tp, ab, kept, pp > 1)
        acts += mask
        total = params + grads + optim + copy + acts + logits + buffers + cluster.reserve_bytes
        if total > best:
            best = total
            breakdown = {"params": params, "grads": grads, "optimizer": optim,
                         "compute_copy": copy, "activations": acts, "logits": logits,
                         "buffers": buffers, "reserve": cluster.reserve_bytes,
                         "pipeline_rank": r}
    return best, breakdown
