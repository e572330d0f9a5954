"""What the planner needs to know about a model, from any of the ways a user can name one.

The cost model never touches a module: it reads a ``ModelStats`` — per block parameters, the
parameters inside matmuls (2 FLOPs per token each), the dims tensor parallelism must divide, and
the embedding/head that sit on the first/last pipeline stage. Sources:

* a reference preset name (``gpt-145b``) or a ``TransformerConfig`` — exact closed forms;
* a Hugging Face ``config.json`` (parsed here; no transformers import);
* a YAML file with ``TransformerConfig`` fields (or ``preset:`` plus overrides, or HF keys);
* ``"package.module:function"``: any ``nn.Module`` factory, instantiated on the meta device; the
  largest ``ModuleList``/``Sequential`` of repeated blocks is taken as the layer stack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

from ..comm.predict import TPBlock, reference_block
from ..parallel.tp_kv import replicated_kv_elements, tp_fits_kv
from .dropout import config_dropout, module_dropout
from .fsdp_rows import ParamRows, Rows, config_rows, param_rows
from .hf_layout import Dims, Layout, layout
from .logits import Logits
from .moe import config_top_k, routed_layers, summary
from .outside_flops import Outside
from .tp_block import Held, rows_held


@dataclass(frozen=True)
class MoreStack:
    """A further stack of blocks (:attr:`ModelStats.more_stacks`): the path of its first
    block, its block count, one block's tensor-parallel collectives (None: not priced),
    whether the vocabulary-parallel embedding makes its input (called again for it, on its
    sequence: an encoder-decoder's shared embedding), and one block's own shape where it
    differs from the main stack's (an encoder block has no cross-attention): its matmul
    weights (None: the main stack's block's), attention layers, and of those the ones reading
    the main stack's output (:attr:`ModelStats.side_matmul_params`,
    :attr:`ModelStats.cross_attentions`)."""

    first: str
    n_layers: int
    tp_block: TPBlock | None
    embedded: bool = False
    matmul_params: int | None = None
    attentions: int = 1
    side_matmul_params: int = 0
    cross_attentions: int = 0
    # what one of its blocks saves beyond the formula's count and its scores, measured as the
    # main stack's (:attr:`ModelStats.saved_extra`, :attr:`ModelStats.saved_scores`)
    saved_extra: tuple[float, float] = (0.0, 0.0)
    saved_scores: tuple[float, float] | None = None
    saved_side: tuple[float, float] = (0.0, 0.0)
    saved_cross_scores: tuple[float, float] | None = None


@dataclass(frozen=True)
class ModelStats:
    """A decoder-style model as the planner sees it (all counts are whole-model, unsplit)."""

    name: str
    n_layers: int
    hidden: int
    n_heads: int
    kv_heads: int
    ffn: int
    vocab: int
    mlp: str                 # "gelu", "swiglu" (any gated), "relu" or "other" (activation memory)
    block_params: int        # parameters of one block
    block_matmul_params: int  # of which inside matmuls (weights of Linear layers)
    embed_params: int        # input embedding (first pipeline stage)
    head_params: int         # final norm + output head (last pipeline stage)
    attention: bool = True   # add the s^2 attention FLOPs/activations
    # Attention layers per block, each with its own scores, q/k/v/o inputs and norm (a
    # decoder block's self- and cross-attention: 2); the FLOPs and activations of each.
    attentions: int = 1
    # Of ``block_matmul_params``, the weights of layers reading another stack's output (a
    # decoder block's cross-attention keys and values): they run on that stack's tokens, the
    # source, not the block's own (module factories; 0: none).
    side_matmul_params: int = 0
    # Of ``attentions``, those whose keys and values are another stack's tokens
    # (cross-attention): their scores are (own sequence) x (that stack's sequence).
    cross_attentions: int = 0
    tied: bool = False       # head shares the embedding weight
    max_seq: int | None = None
    # Where a module's max_seq was read when no setting says it: "the N rows of its position
    # embedding NAME" (printed beside the sequence it prices); "" when a setting says it.
    max_seq_from: str = ""
    # Positions per sample of the dataset a (model, dataset, loss_fn) factory returns (or of
    # the user's input a module was read with, where it has several stacks): the sequence
    # that training will run, which a model's max_seq only bounds.
    data_seq: int | None = None
    # A model with several stacks (an encoder-decoder): (first block, length) of each further
    # stack's sequence in the dataset's first sample (or the user's input), read with
    # ``data_seq`` (the main stack's) from one forward on it: the source beside the target.
    data_stack_seqs: tuple[tuple[str, int], ...] = ()
    # Relative cost of each block when blocks differ (module factories); None = all equal.
    layer_weights: tuple[float, ...] | None = None
    # Parameter tensors (not elements) per block, in the embedding and in the head (final norm
    # included): per-step costs that scale with tensors, not bytes (optimizer loops, gradient
    # clipping, ZeroRedundancyOptimizer's broadcasts). 0 = unknown: those costs are not priced.
    block_tensors: int = 0
    embed_tensors: int = 0
    head_tensors: int = 0
    # The tensor-parallel collectives of one block, read off the layer plan plait lays a
    # module's blocks out with (module factories); None: plait's reference block (attention
    # and an MLP, 4 all-reduces).
    tp_block: TPBlock | None = None
    # Each block's own, where the blocks differ in what trains (frozen norms in one block, a
    # frozen attention the backward pass never enters): per block in forward order; None: all
    # as ``tp_block``, or the counts of trained and reached blocks say it.
    tp_blocks: tuple[TPBlock, ...] | None = None
    # Elements of a trainable weight the embedding and the head share (module factories: the
    # head's copy is not in head_params); under pipelines the first and last stages each hold
    # a copy and sum their gradients every step.
    tied_params: int = 0
    # The shape of each such weight: a copy is one more parameter tensor on the last stage, and
    # FSDP2 shards it on dim 0, so under ZeRO-2/3 each copy's gradient is summed across stages
    # in dp_shard pieces of whole rows (empty: not read, an even split).
    tied_shapes: tuple[tuple[int, ...], ...] = ()
    # The shapes of frozen weights the embedding and the head share: under pipelines the last
    # stage holds a copy too (gathered, broadcast by ZeRO-1 when the optimizer holds it), whose
    # gradient nobody reduces or sums across stages.
    frozen_tied_shapes: tuple[tuple[int, ...], ...] = ()
    # The shapes of the trainable (``shared_shapes``) and frozen parameters held by the root
    # module or a module on the path to the blocks (a ``logit_scale``), counted among the head's
    # (module factories): under pipelines every stage holds them, and each trainable one's
    # gradient is summed over the stages like a tied weight's (plait.parallel.pipeline_split).
    shared_shapes: tuple[tuple[int, ...], ...] = ()
    frozen_shared_shapes: tuple[tuple[int, ...], ...] = ()
    # Parameters of (a block, the embeddings, the rest outside the blocks) as tensor
    # parallelism lays them out, trainable or not (module factories); None: all split over
    # tp and trainable, as plait's reference transformer.
    held: tuple[Held, Held, Held] | None = None
    # Every parameter tensor's shape, the dim tensor parallelism splits and whether it trains
    # (module factories): FSDP2 pads dim 0 to a multiple of dp_shard under ZeRO-2/3, which
    # element counts cannot show (plait.planner.fsdp_rows). None: not read, no padding priced.
    rows: ParamRows | None = None
    # Routed mixture-of-experts blocks: (experts each token is routed to, experts per layer).
    # ``block_matmul_params`` then counts the k routed experts a token passes through (and the
    # router), ``block_params`` every expert: compute follows the active parameters, memory and
    # gradient traffic all of them. None: a dense model.
    experts: tuple[int, int] | None = None
    # Parameters of one block a token passes through (routed MoE: k of E experts); None: all.
    block_active_params: int | None = None
    # Features of one attention head's key (and value); None: hidden / n_heads. Context
    # parallelism all-gathers kv_heads x head_dim features per token and layer.
    head_dim: int | None = None
    # What each F.scaled_dot_product_attention call of one forward receives (plait.planner
    # .tp_trace.attention_keys: key features, bytes of a key and a value element under
    # autocast, the same with bf16 parameters), read where the ledger needs cp's dtypes under
    # bf16; None: not read.
    attention_keys: tuple[tuple[int, int, int], ...] | None = None
    # The first BatchNorm layer of the model ("" for none; module factories): its statistics
    # are the batch's, so the search takes them over the data axes (sync_bn) and never cuts a
    # step's batch into pieces (pipeline microbatches, gradient accumulation).
    batchnorm: str = ""
    # The module path of the main stack's first block (module factories), where the ledger
    # reads the length of the sequence the stack runs on; "" where not read.
    stack_first: str = ""
    # Further stacks of blocks the layer plan splits (an encoder-decoder's other stack, a
    # two-tower model's other tower; module factories): under tensor parallelism each issues
    # its blocks' collectives on its own sequence. Their parameters count among the head's.
    more_stacks: tuple[MoreStack, ...] = ()
    # Whether the blocks train with dropout (p > 0): Korthikanti et al. 2022's one-byte masks
    # (attention probabilities, after the attention output, after the MLP) are saved for
    # backward only then (plait.planner.memory). Read from the config or the module; True (the
    # paper's GPT block) where a ModelStats is built by hand.
    dropout: bool = True
    # Whether the blocks' norms are written as Python ops (Hugging Face's T5LayerNorm,
    # LlamaRMSNorm), not torch's fused kernels: their weight's multiply saves the normalized
    # input, one more hidden-wide tensor per norm besides its input (plait.planner.memory).
    norm_copy: bool = False
    # Ffn-wide tensors the feed-forward's activation saves for backward besides its output
    # (which the next layer saves anyway): GELU and SiLU their input (1), ReLU none (0), a
    # GELU written as Python ops (transformers' NewGELUActivation, GPT-2's and T5 v1.1's) its
    # input and three intermediates (4). Measured on the activation module (plait.planner
    # .memory); None: by ``mlp`` (relu 0, else 1).
    act_saved: int | None = None
    # Bytes per token one block saves for backward beyond what the formula counts, in fp32
    # and under bf16/fp16 autocast over fp32 weights (the fp32 residual at each norm's input,
    # autocast's copy of a shared input per Linear reading it, a Python norm's fp32
    # intermediates): measured by running one block (plait.planner.saved: on zeros, on fake
    # tensors for a large block; module factories), whole on every tp rank like the norms'
    # inputs; (0, 0): not measured.
    saved_extra: tuple[float, float] = (0.0, 0.0)
    # Bytes attention's scores take per query and key (all heads, every attention layer of a
    # block) where attention is not flash, fp32 and under bf16/fp16 autocast, measured as
    # ``saved_extra``; None: Korthikanti's count (softmax output, with dropout its mask and
    # its dropped copy, in the compute dtype).
    saved_scores: tuple[float, float] | None = None
    # A block whose cross-attention reads another stack, measured at two lengths of it: the
    # bytes it saves per token of that stack beyond the formula's count (autocast's cast of
    # the stack's output per key and value projection), and its cross-attention's scores per
    # query and key (``saved_scores`` then the self-attention's); fp32 and under autocast.
    # (0, 0) and None: not told apart, all per token of the block's own stack.
    saved_side: tuple[float, float] = (0.0, 0.0)
    saved_cross_scores: tuple[float, float] | None = None
    # Forward FLOPs outside the blocks, counted on one forward (module factories): a stem, a
    # projection before the stack, a head per token or on one pooled row
    # (plait.planner.outside_flops), or a language model's head by the formula, split
    # by tp where its plan splits it; None: a preset's or a config's, whose reference plan
    # splits the head by the vocabulary: 2 x hidden x vocab per token, 1/tp on each rank.
    outside_flops: Outside | None = None
    # The output the loss reads (module factories: plait.planner.logits.Logits, read with
    # ``outside_flops``): a language model's head per token, split by tp where its plan splits
    # it; a classifier per pooled row; its own width. None: a preset's or a config's, whose
    # reference plan splits the head by the vocabulary (:attr:`head_logits`).
    logits: Logits | None = None

    def __post_init__(self) -> None:
        errors = [f"{k}={getattr(self, k)!r} must be >= 1"
                  for k in ("n_layers", "hidden", "n_heads", "kv_heads", "ffn", "vocab")
                  if getattr(self, k) < 1]
        errors += [f"{k}={getattr(self, k)!r} must be >= 0"
                   for k in ("block_params", "block_matmul_params", "embed_params", "head_params",
                             "block_tensors", "embed_tensors", "head_tensors")
                   if getattr(self, k) < 0]
        if self.layer_weights is not None and len(self.layer_weights) != self.n_layers:
            errors.append(f"layer_weights has {len(self.layer_weights)} entries for "
                          f"n_layers={self.n_layers}")
        if errors:
            raise ValueError(f"invalid model {self.name!r}: " + "; ".join(errors))

    @property
    def head_logits(self) -> Logits:
        """The logits the loss reads (:attr:`logits`), else a language model's: ``vocab`` per
        token, split over the tp ranks."""
        return self.logits if self.logits is not None else Logits(float(self.vocab))

    def tp_refuses(self, tp: int) -> str:
        """Why tensor parallelism of degree ``tp`` cannot split these blocks ("" when it can):
        it splits the ffn, and the attention heads (kv heads divided or replicated). A block
        without attention (an MLP stack, a model whose mixer is no attention) has no heads to
        divide: its ``n_heads`` of 1 says nothing, and the model itself, asked by ``plait
        plan``, refuses a tp its layers cannot take."""
        if self.attention:
            if self.n_heads % tp:
                return f"tp={tp} does not divide attention heads={self.n_heads}"
            if not tp_fits_kv(self.kv_heads, tp):
                return (f"tp={tp} neither divides kv heads={self.kv_heads} nor is a multiple "
                        f"of them (then each rank would compute one, replicated)")
        if self.ffn % tp:
            return f"tp={tp} does not divide ffn={self.ffn}"
        return ""

    def kv_whole(self, tp: int) -> int:
        """Weight elements of one block's k and v projections kept whole on every rank at
        ``tp`` (fewer kv heads than tp; see :mod:`plait.parallel.tp_kv`), else 0. A block
        without attention has none (its ``kv_heads`` of 1 says nothing)."""
        if not self.attention:
            return 0
        return replicated_kv_elements(self.hidden, self.kv_heads, self.hidden // self.n_heads, tp)

    def kv_dim(self, tp: int = 1) -> int:
        """Features of the keys (and of the values) one rank holds per token and attention
        layer at ``tp``: its share of the kv heads (all of them where there are fewer kv heads
        than tp, each rank computing one) x head_dim; 0 for a block without attention. What
        context parallelism all-gathers: the kv heads, not the query heads (grouped-query
        attention gathers kv_heads / n_heads of the hidden size)."""
        if not self.attention:
            return 0
        head_dim = self.head_dim or self.hidden // self.n_heads
        return max(1, self.kv_heads // tp) * head_dim

    def kv_element_bytes(self, fsdp_params: bool) -> float | None:
        """Bytes per element of the keys and values attention receives under bf16 (autocast
        over fp32 parameters, or ``fsdp_params``: FSDP2's bf16 parameters), the mean of a key's
        and a value's (fp32 keys beside bf16 values: 3), where a forward pass read them
        (``attention_keys``), one call per block at the kv heads' width, every call alike;
        None otherwise."""
        keys = self.attention_keys
        if not keys or len(keys) != self.n_layers or any(k[0] != self.kv_dim() for k in keys):
            return None
        sizes = {k[2] if fsdp_params else k[1] for k in keys}
        return sizes.pop() / 2 if len(sizes) == 1 else None

    @property
    def num_params(self) -> int:
        head = self.head_params - (self.embed_params if self.tied else 0)
        return self.n_layers * self.block_params + self.embed_params + max(head, 0)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: all of them, but k of E experts in a routed
        mixture-of-experts block."""
        if self.block_active_params is None:
            return self.num_params
        return self.num_params - self.n_layers * (self.block_params - self.block_active_params)

    def block_flops_per_token(self, seq: int, side_seq: int | None = None) -> float:
        """Forward FLOPs of one block per token of its own sequence ``seq``: 2 per matmul
        weight + 4*s*h per attention layer.

        A routed mixture-of-experts block counts the weights of the k experts each token is
        routed to and the router's, not all E experts' (``block_matmul_params``).

        Attention is counted over the full s x s square (QK^T and AV), as Megatron-LM's formula
        does, so TFLOP/s figures are comparable with published ones. Cross-attention
        (``cross_attentions``) reads another stack's ``side_seq`` tokens (default ``seq``):
        its scores are seq x side_seq, and its key and value projections
        (``side_matmul_params``) run on side_seq tokens per row, side_seq / seq per token of
        this block's.
        """
        other = seq if side_seq is None else side_seq
        side = float(self.side_matmul_params)
        matmul = 2.0 * (self.block_matmul_params - side) + 2.0 * side * other / seq
        if not self.attention:
            return matmul
        own = self.attentions - self.cross_attentions
        return matmul + 4.0 * self.hidden * (seq * own + other * self.cross_attentions)

    def side_seq(self, seq: int, seqs: Mapping[str, int]) -> int:
        """The sequence the main stack's cross-attention reads: the first further stack's
        (``seqs`` by its first block, default ``seq``); ``seq`` where there is none."""
        return next((seqs.get(m.first, seq) for m in self.more_stacks), seq)

    def more_stacks_flops(self, rows: float, seq: int, seqs: Mapping[str, int]) -> float:
        """Forward FLOPs of the further stacks' blocks (:attr:`more_stacks`) for ``rows``
        sequences, each stack on its own sequence (``seqs`` by its first block, default
        ``seq``), each block by its own shape (:meth:`stack_block`)."""
        total = 0.0
        for more in self.more_stacks:
            n = seqs.get(more.first, seq)
            total += more.n_layers * self.stack_block(more).block_flops_per_token(
                n, side_seq=seq) * rows * n
        return total

    def stack_block(self, more: MoreStack) -> ModelStats:
        """These stats with one block of the further stack ``more`` in place of the main
        stack's (its matmul weights and attention layers; the widths are the main stack's):
        what its blocks' FLOPs and saved activations are priced from."""
        return dataclasses.replace(
            self, attentions=more.attentions, side_matmul_params=more.side_matmul_params,
            cross_attentions=more.cross_attentions,
            block_matmul_params=self.block_matmul_params if more.matmul_params is None
            else more.matmul_params, saved_extra=more.saved_extra,
            saved_scores=more.saved_scores, saved_side=more.saved_side,
            saved_cross_scores=more.saved_cross_scores)

    def head_flops_per_token(self, seq: int) -> float:
        """Forward FLOPs outside the blocks per token at sequence length ``seq``: as counted
        (``outside_flops``: a stem, a head on a pooled row spread over the row's tokens),
        else the head's matmul, 2 per weight of a hidden x vocab projection."""
        if self.outside_flops is not None:
            return self.outside_flops.per_token_at(seq)
        return 2.0 * self.hidden * self.vocab

    def stem_flops_per_token(self) -> float:
        """Of :meth:`head_flops_per_token`, the forward FLOPs per token that run before the
        blocks (a ViT's patchify convolution, a projection of input features), counted: on a
        pipeline's first chunk, the rest on its last. 0 for the language model's formula
        (an embedding lookup)."""
        return self.outside_flops.before if self.outside_flops is not None else 0.0

    def outside_flops_per_rank(self, seq: int, tp: int) -> tuple[float, float]:
        """(forward FLOPs per token before the blocks, outside them after) that each of
        ``tp`` tensor-parallel ranks runs at sequence length ``seq``: a module the plan splits
        (a vocabulary-parallel head) 1/tp of its FLOPs, the rest (a patchify convolution, a
        projection, a classifier the plan leaves whole) all of them, as every rank runs it
        (:meth:`plait.planner.outside_flops.Outside.per_rank_at`); the language model's
        formula, its head split by the vocabulary, ``(0, 2 x hidden x vocab / tp)``."""
        if self.outside_flops is not None:
            return self.outside_flops.per_rank_at(seq, tp)
        return 0.0, self.head_flops_per_token(seq) / tp

    def model_flops(self, tokens: float, seq: int, recompute_layers: float = 0.0,
                    side_seq: int | None = None) -> float:
        """Training FLOPs (forward + backward = 3x forward) for ``tokens`` tokens of length
        ``seq``; ``recompute_layers`` blocks' forwards are run a second time. ``side_seq``:
        the other stack's sequence the blocks' cross-attention reads (default ``seq``)."""
        block = self.block_flops_per_token(seq, side_seq) * tokens
        head = 3 * self.head_flops_per_token(seq) * tokens
        return (3 * self.n_layers + recompute_layers) * block + head


# --------------------------------------------------------------------------------- sources
def from_transformer_config(cfg: Any, name: str = "transformer") -> ModelStats:
    h, kv = cfg.dim, cfg.kv_heads * cfg.head_dim
    matmul = 2 * h * h + 2 * h * kv + (3 if cfg.mlp == "swiglu" else 2) * h * cfg.hidden_dim
    total = cfg.num_params(embeddings=False)
    norm_size = h if cfg.norm == "rmsnorm" else 2 * h
    block = (total - norm_size) // cfg.n_layers
    embed = cfg.vocab_size * h
    head = norm_size + cfg.vocab_size * h
    # q, k, v, o and the MLP's linears; GPT-style (gelu) linears carry a bias each; a layernorm
    # has weight and bias, an rmsnorm a weight.
    linears = 4 + (3 if cfg.mlp == "swiglu" else 2)
    norm_tensors = 2 if cfg.norm == "layernorm" else 1
    block_tensors = linears * (2 if cfg.mlp == "gelu" else 1) + 2 * norm_tensors
    tied = cfg.tie_embeddings
    head_tensors = norm_tensors + (0 if tied else 1)
    rows = config_rows(layers=cfg.n_layers, hidden=h, q=h, kv=kv, ffn=cfg.hidden_dim,
                       gated=cfg.mlp == "swiglu", vocab=cfg.vocab_size,
                       tied=tied, bias=cfg.mlp == "gelu",
                       norm_tensors=norm_tensors)
    # Tensor parallelism keeps the norms (and the row-parallel biases) whole on every rank:
    # data parallelism reduces them whole (``held``); under SP each norm tensor's gradient is
    # all-reduced over tp once per backward, a LayerNorm's weight and bias one call each. A
    # tied head is the embedding's weight under a second name: beside a pipeline the last
    # stage holds a copy whose gradient is summed with the first stage's every step.
    return ModelStats(name=name, n_layers=cfg.n_layers, hidden=h, n_heads=cfg.n_heads,
                      kv_heads=cfg.kv_heads, ffn=cfg.hidden_dim, vocab=cfg.vocab_size,
                      mlp=cfg.mlp, block_params=block, block_matmul_params=matmul,
                      embed_params=embed, head_params=head - (embed if tied else 0),
                      max_seq=cfg.max_seq_len, block_tensors=block_tensors, embed_tensors=1,
                      head_tensors=head_tensors, head_dim=cfg.head_dim, rows=rows,
                      held=rows_held(rows),
                      tp_block=reference_block(cfg),
                      tied_params=embed if tied else 0,
                      tied_shapes=((cfg.vocab_size, h),) if tied else (),
                      dropout=cfg.dropout > 0)


_HF_KEYS = {  # our name -> accepted config.json keys, first found wins
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "n_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "n_heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim"),
    "vocab": ("vocab_size",),
}


# Families whose configs may omit the activation because their transformers config class
# defaults to a non-gated GELU/ReLU MLP (GPT2Config: activation_function="gelu_new", OPT: "relu",
# GPT-NeoX / GPT-J / BLOOM / Falcon: "gelu"). Llama-style configs default to "silu" (SwiGLU).
_NON_GATED_TYPES = ("gpt2", "gpt_neox", "gptj", "gpt_neo", "opt", "bloom", "falcon",
                    "gpt_bigcode", "codegen")


def _model_type(data: Mapping[str, Any]) -> str:
    """``model_type``; a config without one that uses GPT-2's key names (``n_embd``,
    ``n_layer``, ``n_head``) is a GPT-2 config."""
    model_type = str(data.get("model_type") or "").lower()
    if not model_type and any(k in data for k in ("n_embd", "n_layer", "n_head")):
        return "gpt2"
    return model_type


def _default_activation(model_type: str) -> str:
    """The activation a config means when it names none: its family's transformers default."""
    if model_type in _NON_GATED_TYPES:
        return {"opt": "relu", "gpt2": "gelu_new"}.get(model_type, "gelu")
    return "silu"


def _named_act_saved(act: str) -> int | None:
    """:attr:`ModelStats.act_saved` of the activation transformers builds for the config name
    ``act`` (``ACT2FN``), measured as a built model's is; None where transformers is not
    installed or does not know the name."""
    try:
        from transformers.activations import ACT2FN
        module = ACT2FN[act]
    except Exception:  # noqa: BLE001 - no transformers, or a name it lacks: not measured
        return None
    return _saved_by(module)


def from_hf_config(data: Mapping[str, Any], name: str = "hf-model") -> ModelStats:
    """A decoder from a Hugging Face config dict (Llama/Mistral/Qwen/GPT-2/GPT-NeoX style)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{name}: config must be a JSON object")
    if "text_config" in data and "hidden_size" not in data:
        data = data["text_config"]
    got: dict[str, int] = {}
    for ours, keys in _HF_KEYS.items():
        for key in keys:
            if data.get(key) is not None:
                value = data[key]
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name}: field {key}={value!r} must be a positive integer")
                got[ours] = value
                break
    for ours in ("hidden", "n_layers", "n_heads", "vocab"):
        if ours not in got:
            raise ValueError(f"{name}: missing field {_HF_KEYS[ours][0]} "
                             f"(accepted: {', '.join(_HF_KEYS[ours])})")
    model_type = _model_type(data)
    h = got["hidden"]
    heads = got["n_heads"]
    kv_heads = got.get("kv_heads", heads)
    if h % heads:
        raise ValueError(f"{name}: hidden_size={h} is not divisible by num_attention_heads={heads}")
    act = str(data.get("hidden_act") or data.get("activation_function")
              or _default_activation(model_type)).lower()
    gated = "silu" in act or "swish" in act or "glu" in act
    # a ReLU saves only its output, the down projection's input (plait.planner.memory)
    mlp = "swiglu" if gated else ("relu" if act == "relu" else "gelu")
    ffn = got.get("ffn", 4 * h)
    head_dim = data.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    bias = bool(data.get("attention_bias", False)) or model_type in ("gpt2", "gpt_neox")
    matmul = h * q + 2 * h * kv + q * h + (3 if gated else 2) * h * ffn
    biases = (q + 2 * kv + h + (ffn + h)) if bias else 0
    # Qwen2's q, k and v projections carry a bias (its config says so as qkv_bias, or not at all)
    qkv_bias = not bias and bool(data.get("qkv_bias", model_type in ("qwen2", "qwen2_moe")))
    biases += (q + 2 * kv) if qkv_bias else 0
    norm = 2 * h if model_type in ("gpt2", "gpt_neox", "opt") else h
    tied = bool(data.get("tie_word_embeddings", model_type == "gpt2"))
    block_tensors = (4 + (3 if gated else 2)) * (2 if bias else 1) + 2 * (norm // h) + \
        (3 if qkv_bias else 0)
    block, active, experts = matmul + biases + 2 * norm, matmul, None
    count = k = expert = 0
    routed = _hf_experts(data, name, h, gated)
    if routed is not None:
        # every layer routed (Mixtral, Qwen-MoE): the MLP's weights become E experts, a router
        # and a shared expert; a token passes through k experts
        count, k, expert, shared = routed
        mlp_weights = (3 if gated else 2) * h * ffn
        attn = matmul - mlp_weights
        block = block - mlp_weights + count * expert + h * count + shared
        active = attn + k * expert + h * count + shared
        # the MLP's linears become two stacked tensors (transformers' fused experts) and a
        # router; a shared expert adds its linears and its gate
        block_tensors += 2 + 1 - (3 if gated else 2) + ((4 if gated else 3) if shared else 0)
        experts = (k, count)
    stats = ModelStats(name=name, n_layers=got["n_layers"], hidden=h, n_heads=heads,
                       kv_heads=kv_heads, ffn=ffn, vocab=got["vocab"], mlp=mlp,
                       block_params=block, block_matmul_params=active,
                       embed_params=got["vocab"] * h, head_params=norm + got["vocab"] * h,
                       tied=tied,
                       max_seq=data.get("max_position_embeddings") or data.get("n_positions"),
                       block_tensors=block_tensors, embed_tensors=1,
                       head_tensors=norm // h + (0 if tied else 1), experts=experts,
                       block_active_params=block - (count - k) * expert if experts else None,
                       head_dim=head_dim, dropout=config_dropout(data, model_type),
                       # the families without norm biases: transformers writes their RMSNorm
                       # as Python ops (its normalized input saved for the weight's multiply)
                       norm_copy=norm == h, act_saved=_named_act_saved(act))
    if model_type == "gpt2" and q == h and kv == h and not experts:
        return _gpt2(stats, data.get("n_positions") or data.get("max_position_embeddings"))
    # the families laid out tensor by tensor (plait.planner.hf_layout): the shapes FSDP2 pads,
    # what tp keeps whole and the block's tp collectives; the others are counted in elements
    expert_ffn = data.get("moe_intermediate_size") or ffn
    laid = layout(model_type, Dims(
        hidden=h, q=q, kv=kv, head_dim=head_dim, ffn=expert_ffn if experts else ffn,
        vocab=got["vocab"], tied=tied, experts=count,
        shared_ffn=data.get("shared_expert_intermediate_size") or 0 if experts else 0,
        attention_bias=bool(data.get("attention_bias", True))))
    return stats if laid is None else _laid_out(stats, laid, expert if experts else 0)


def _laid_out(stats: ModelStats, laid: Layout, expert: int) -> ModelStats:
    """``stats`` of a config whose family :mod:`plait.planner.hf_layout` lays out tensor by
    tensor: its counts, padded rows, what tp keeps whole and the block's tp collectives as
    the built model's; a tied head is the embedding's weight under a second name (beside a
    pipeline a copy on the last stage, whose gradient is summed with the first stage's)."""
    rows = ParamRows(stack=(laid.block,) * stats.n_layers, embed=laid.embed, rest=laid.rest)
    block = sum(prod(r.shape) for r in laid.block)
    shapes = tuple(r.shape for r in laid.embed) if stats.tied else ()
    routed = stats.experts
    return dataclasses.replace(
        stats, block_params=block, block_tensors=len(laid.block),
        head_params=sum(prod(r.shape) for r in laid.rest), head_tensors=len(laid.rest),
        tied=False, tied_params=sum(prod(s) for s in shapes), tied_shapes=shapes, rows=rows,
        held=rows_held(rows), tp_block=laid.tp_block,
        block_active_params=block - (routed[1] - routed[0]) * expert if routed else None)


def _gpt2(stats: ModelStats, positions: Any) -> ModelStats:
    """A GPT-2 config laid out as transformers builds it: fused q|k|v (``c_attn``) and the
    other linears as ``Conv1D`` (weights stored (in, out)), each with a bias; two LayerNorms per
    block and a final one; a position embedding of ``n_positions`` rows beside the token
    embedding, and a head tied to the latter (its copy is the one weight under two names, as
    :func:`from_module` reads it). The tensor-parallel dims are GPT-2's layer plan's: ``c_attn``
    and ``c_fc`` split by output columns (``c_fc``'s bias with them, ``c_attn``'s gathered
    whole), both ``c_proj`` by input rows, the token embedding by rows; so are its
    collectives over tp (the ones plait's layer plan for GPT-2 issues: the reference block's,
    the fused bias's gradient all-gathered, the LayerNorms' weight and bias summed under SP
    inside the block stack)."""
    h, ffn, vocab = stats.hidden, stats.ffn, stats.vocab
    positions = positions if isinstance(positions, int) and positions > 0 else 1024
    norm = (Rows((h,)), Rows((h,)))
    block = (Rows((h, 3 * h), 1), Rows((3 * h,)), Rows((h, h), 0), Rows((h,)),
             Rows((h, ffn), 1), Rows((ffn,), 0), Rows((ffn, h), 0), Rows((h,)), *norm, *norm)
    tied = stats.tied
    rows = ParamRows(stack=(block,) * stats.n_layers,
                     embed=(Rows((vocab, h), 0), Rows((positions, h))),
                     rest=norm if tied else (*norm, Rows((vocab, h), 0)))
    return dataclasses.replace(
        stats, embed_params=(vocab + positions) * h,
        head_params=2 * h + (0 if tied else vocab * h), tied=False, embed_tensors=2,
        block_tensors=len(block), head_tensors=2 + (0 if tied else 1),
        tied_params=vocab * h if tied else 0, tied_shapes=((vocab, h),) if tied else (),
        rows=rows, held=rows_held(rows),
        tp_block=TPBlock(forward=(h, h), backward=(h, h), bias_gathers=(3 * h,),
                         sp_norms=(h,) * 4, sp_in_blocks=True))


def _hf_experts(data: Mapping[str, Any], name: str, h: int, gated: bool
                ) -> tuple[int, int, int, int] | None:
    """(experts E, top-k, weights of one expert, weights of the shared expert and its gate) of
    a config whose every layer is a routed MoE (Mixtral's ``num_local_experts``, Qwen-MoE's
    ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``shared_expert_intermediate_size``); None for a dense config. A config that mixes dense
    and routed layers is refused: the planner prices one kind of block."""
    count = data.get("num_local_experts") or data.get("num_experts")
    if not count:
        return None
    k = data.get("num_experts_per_tok")
    for key, value in (("num_experts", count), ("num_experts_per_tok", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: field {key}={value!r} must be a positive integer")
    assert isinstance(k, int)
    if k > count:
        raise ValueError(f"{name}: num_experts_per_tok={k} is more than the {count} experts")
    step = data.get("decoder_sparse_step") or 1
    if step != 1 or data.get("mlp_only_layers"):
        raise ValueError(f"{name}: decoder_sparse_step={step}, mlp_only_layers="
                         f"{data.get('mlp_only_layers')!r} mix dense and routed layers, which "
                         "the planner does not price from a config; give --model a factory "
                         "'package.module:function' that builds the model")
    ffn = data.get("moe_intermediate_size") or data.get("intermediate_size") or 4 * h
    expert = (3 if gated else 2) * h * ffn
    shared_ffn = data.get("shared_expert_intermediate_size") or 0
    shared = (3 if gated else 2) * h * shared_ffn + h if shared_ffn else 0
    return count, k, expert, shared


class NoBlockStackError(ValueError):
    """The model has no stack of repeated blocks, or none with matmuls (a ConvNet's): nothing
    for tensor or pipeline parallelism to split, and nothing the planner's per-block cost
    model can price. ``plait plan``, ``plan_model`` and ``plan="auto"`` then rank its
    data-parallel layouts from measured facts instead (:mod:`plait.planner.whole_model`)."""


# What a user of ``plait plan`` does with a model the planner cannot price.
_BY_HAND = ("; pick the layout by hand: data parallelism needs no blocks (dp=N, or "
            "dp_shard=N,zero=3 to shard its state), and plait check --plan P --model ... "
            "proves it trains what one device trains")


def _first_batchnorm(model: Any) -> str:
    """The name of ``model``'s first BatchNorm layer, "" if it has none."""
    import torch.nn as nn

    kinds = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    return next((n or type(model).__name__ for n, m in model.named_modules()
                 if isinstance(m, kinds)), "")


def _with_batchnorm(model: Any) -> str:
    """The end of ``_BY_HAND`` for a model with BatchNorm: its statistics must be taken over
    the data axes (``sync_bn``) for data parallelism to train what one device trains."""
    first = _first_batchnorm(model)
    if not first:
        return ""
    return (f"; its BatchNorm layers ({first}, ...) need sync_bn under data parallelism "
            f"(dp=N,sync_bn) and one piece per step (no grad_accum, no pipeline)")


def from_module(model: Any, name: str = "module", device_type: str = "cpu",
                attention_dtypes: bool = False, example: Any = None) -> ModelStats:
    """Stats of an ``nn.Module`` (ideally on the meta device) with a stack of repeated blocks.
    ``device_type``: where it trains, whose autocast rules the traced forward pass follows
    (:mod:`plait.planner.tp_trace`). ``attention_dtypes``: also read the dtypes keys and values
    reach attention in under bf16 (``attention_keys``, two forward passes on fake tensors),
    what context parallelism gathers under mixed precision; the ledger and ``plait plan`` ask
    for them alike, so both price the same bytes. ``example``: the user's input
    (:class:`plait.parallel.tp_example.Example`) the forward passes run on, in place of token
    ids (a model of images or of several inputs)."""
    import torch.nn as nn

    if not isinstance(model, nn.Module):
        raise ValueError(f"{name}: expected an nn.Module, got {type(model).__name__}")
    best = None
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) and len(mod) >= 2:
            # a ModuleDict's blocks in their order, as a pipeline splits them
            run = _longest_run(list(mod.values()) if isinstance(mod, nn.ModuleDict)
                               else list(mod))
            if len(run) < 2:
                continue
            params = sum(p.numel() for b in run for p in b.parameters())
            if best is None or params > best[0]:
                best = (params, mod_name, run)
    by_hand = _BY_HAND + _with_batchnorm(model)
    if best is None:
        raise NoBlockStackError(f"{name}: found no nn.ModuleList/nn.Sequential/nn.ModuleDict of "
                                f"repeated blocks to split into layers; the planner needs a "
                                f"stack of blocks" + by_hand)
    _, stack_name, blocks = best
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    # Matmul weights a token passes through: a routed MoE layer's k of E experts (plait.planner
    # .moe); parameters (memory, traffic) keep all E.
    default_k = config_top_k(model)
    routed = [routed_layers(b, lambda m: _dims(m) is not None, default_k, name) for b in blocks]
    matmul = [sum(m.weight.numel() for m in b.modules() if _dims(m) is not None)
              + sum(r.extra_matmul - r.idle_fraction * r.expert_matmul for r in layers)
              for b, layers in zip(blocks, routed, strict=True)]
    active = [p - sum(r.idle_fraction * r.expert_params for r in layers)
              for p, layers in zip(block_params, routed, strict=True)]
    experts = summary(r for layers in routed for r in layers)
    ref = blocks[max(range(len(blocks)), key=lambda i: block_params[i])]
    linears = [d for d in map(_dims, ref.modules()) if d is not None]
    if not linears:
        where = stack_name or type(model).__name__
        raise NoBlockStackError(f"{name}: blocks in {where!r} have no nn.Linear layers, "
                                f"whose matmuls the planner prices (convolutions are not "
                                f"priced)" + by_hand)
    hidden = Counter(i for i, _ in linears).most_common(1)[0][0]
    ffn = max(max(o, i) for i, o in linears)
    heads, kv_heads, attention = 1, None, False
    for m in ref.modules():
        cls = type(m).__name__.lower()
        if isinstance(m, nn.MultiheadAttention):
            heads, attention = m.num_heads, True
        elif "attn" in cls or "attention" in cls:
            attention = True
        for attr in ("num_heads", "n_heads", "num_attention_heads", "n_head"):
            if isinstance(getattr(m, attr, None), int):
                heads = getattr(m, attr)
        for attr in ("num_key_value_heads", "n_kv_heads", "num_kv_heads"):
            if isinstance(getattr(m, attr, None), int):
                kv_heads = getattr(m, attr)
    from .tp_block import grad_flow, held_parts, plan_of, tp_block

    found = plan_of(model, example)  # the layer plan plait lays the blocks out with
    # the tensor-parallel collectives of a block that trains (its parameter gradients'): a
    # frozen one issues fewer (plait.comm.predict.tp_rank_traffic); the blocks share shapes
    tp_ref = next((b for b in blocks if any(p.requires_grad for p in b.parameters())), ref)
    ref_path = next(n for n, m in model.named_modules() if m is ref)
    tp_path = next(n for n, m in model.named_modules() if m is tp_ref)
    head_dim = None
    if attention:
        # transformers names it head_dim, GPT-NeoX head_size
        head_dim = getattr(ref, "head_dim", None) or next(
            (getattr(m, a) for m in ref.modules() for a in ("head_dim", "head_size")
             if isinstance(getattr(m, a, None), int)), None)
    if heads == 1 and head_dim:
        heads = max(1, hidden // head_dim)
    if heads == 1 and attention and found is not None:
        heads = _divided_heads(ref, ref_path, found[0]) or heads
    if kv_heads is None and attention:
        # transformers' attention modules keep the count in their config only (Llama, Qwen2)
        kv_heads = next((m.config.num_key_value_heads for m in ref.modules()
                         if isinstance(getattr(getattr(m, "config", None),
                                               "num_key_value_heads", None), int)), None)
    # the embeddings outside the stacks of blocks: a table inside a block (a relative
    # position bias) is one of the block's parameters
    from plait.parallel.pipeline_hf import other_block_stacks

    stacks = [model.get_submodule(p) for p in other_block_stacks(model, stack_name)]
    inside = {id(m) for b in [*blocks, *stacks] for m in b.modules()}
    embeds = [m for m in model.modules() if isinstance(m, nn.Embedding) and id(m) not in inside]
    vocab = max((m.num_embeddings for m in embeds), default=1)
    # a weight several embeddings share (T5's ``shared``, ``encoder.embed_tokens`` and
    # ``decoder.embed_tokens``) once
    embed_weights = list({id(p): p for m in embeds for p in m.parameters()}.values())
    embed_params = sum(p.numel() for p in embed_weights)
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # parameters(): shared (tied) weights once
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    stack_total = sum(block_params)
    head_params = max(total - stack_total - embed_params, 0)
    mean = sum(matmul) / len(matmul)
    weights = None
    if len(set(matmul)) > 1:
        weights = tuple(m / mean if mean else 1.0 for m in matmul)
    mlp = _mlp_kind(model, ref, hidden, ffn)
    tensors = round(sum(len(list(b.parameters())) for b in blocks) / len(blocks))
    outside = len(seen) - sum(len(list(b.parameters())) for b in blocks)
    embed_tensors = len(embed_weights)
    shared = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    both = [p for e in embeds for p in e.parameters() if shared[id(p)] > 1]
    tied = [p for p in both if p.requires_grad]
    tied_params = sum(p.numel() for p in tied)
    from plait.parallel.pipeline_split import held_on_path

    every = dict(model.named_parameters())
    on_path = [every[n] for n in held_on_path(model, stack_name) if n in every]
    block_tp = tp_block(model, tp_path, found, (_path(model, blocks[0]),
                                                _path(model, blocks[-1])), device_type,
                        example)
    # where gradients flow, where some parameter is frozen: into the stack, through each block
    flow = grad_flow(model, [_path(model, b) for b in blocks], found, block_tp, device_type,
                     example)
    rows = param_rows(model, blocks, found)
    if flow.input_grad is not None:
        rows = dataclasses.replace(rows, stack_input_grad=flow.input_grad)
    max_seq, max_seq_from = _max_seq(model), ""
    if max_seq is None:
        max_seq, max_seq_from = _position_rows(model)
    more = _more_stacks(model, stack_name, found, device_type)
    attentions = _attention_layers(model, ref_path, found) if attention else 1
    side, cross = _cross_reads(model, ref_path, found)
    stats = ModelStats(name=name, n_layers=len(blocks), hidden=hidden, n_heads=heads,
                       kv_heads=kv_heads or heads, ffn=ffn, vocab=vocab,
                       mlp=mlp or ("gelu" if attention else "other"),
                       attentions=attentions, side_matmul_params=side,
                       cross_attentions=min(cross, attentions) if attention else 0,
                       block_params=round(stack_total / len(blocks)),
                       block_matmul_params=round(mean), embed_params=embed_params,
                       head_params=head_params, attention=attention, layer_weights=weights,
                       block_tensors=tensors, embed_tensors=embed_tensors,
                       head_tensors=max(outside - embed_tensors, 0), max_seq=max_seq,
                       max_seq_from=max_seq_from,
                       tp_block=flow.block, tp_blocks=flow.blocks,
                       tied_params=tied_params,
                       tied_shapes=tuple(tuple(p.shape) for p in tied),
                       frozen_tied_shapes=tuple(tuple(p.shape) for p in both
                                                if not p.requires_grad),
                       shared_shapes=tuple(tuple(p.shape) for p in on_path if p.requires_grad),
                       frozen_shared_shapes=tuple(tuple(p.shape) for p in on_path
                                                  if not p.requires_grad),
                       held=held_parts(model, stack_name, found),
                       rows=rows, experts=experts,
                       block_active_params=round(sum(active) / len(blocks)) if experts else None,
                       head_dim=head_dim if isinstance(head_dim, int) else None,
                       attention_keys=_attention_keys(model, device_type, example)
                       if attention and attention_dtypes else None,
                       batchnorm=_first_batchnorm(model),
                       dropout=module_dropout(model, blocks),
                       stack_first=_path(model, blocks[0]), more_stacks=more,
                       norm_copy=_unfused_norms(ref, hidden),
                       act_saved=_saved_by(_activation(ref)))
    stats = _measured_saves(stats, ref, model)
    stats = dataclasses.replace(stats, more_stacks=tuple(
        _measured_stack(stats, m, model) for m in stats.more_stacks))
    flops_outside, logits = _outside_flops(model, blocks, more, hidden, vocab, example, found)
    stats = dataclasses.replace(stats, outside_flops=flops_outside, logits=logits)
    # a model of several stacks run on the user's input: the length each stack receives
    lengths = _stack_lengths(model, stats, example)
    if lengths:
        return dataclasses.replace(stats, data_seq=lengths[0][1], data_stack_seqs=lengths[1:])
    return stats


def _outside_flops(model: Any, blocks: list[Any], more: tuple[MoreStack, ...],
                   hidden: int, vocab: int, example: Any,
                   found: tuple[Any, bool] | None = None
                   ) -> tuple[Outside | None, Logits | None]:
    """Forward FLOPs outside the main stack's ``blocks`` and the further stacks' (``more``),
    counted on one forward on fake tensors of ``example`` or, without one, of the input
    :func:`plait.parallel.tp_example.example_call` guesses (:mod:`plait.planner
    .outside_flops`), those of the modules outside the blocks that the plan ``found`` splits
    apart (:func:`_split_outside`).

    A model whose outside is a language model's (embeddings, norms and one ``hidden`` x
    ``vocab`` head) is priced by the formula, 2 x hidden x vocab per token, without a forward
    (a forward of it imports ``torch._dynamo``: most of a second of a ``plait plan``), where
    its plan ships (plait's reference transformer, a transformers model: their heads read
    every token) or its code shows the head reading every token the last block hands on
    (:func:`plait.planner.lm_head.reads_every_token`; also where the model does not trace).
    Otherwise the same parameters may be a classifier on one pooled token (per row, not per
    token): counted. Either way the head's FLOPs are split by tp only where the plan splits it
    (a vocabulary-parallel head); a head it leaves whole (one beside a logits bias) runs whole
    on every rank.

    Second, the logits the loss reads (:class:`plait.planner.logits.Logits`): the language
    model's head's, ``vocab`` per token; else the counted forward's output, per token and per
    row; split over the tp ranks where the plan splits the module that makes them
    (:func:`_splits_logits`); None where nothing was counted."""
    from plait.parallel.tp_example import example_call

    from .lm_head import reads_every_token
    from .outside_flops import measure

    others = [b for m in more
              for b in model.get_submodule(m.first.rsplit(".", 1)[0]).children()]
    split = _split_outside(model, [*blocks, *others], found)
    head = _language_model_head(model, [*blocks, *others], hidden, vocab)
    per_token = head is not None and (
        (found is not None and found[1])
        or reads_every_token(model, blocks[-1], head, [*blocks, *others]) is not False)
    if not per_token:
        counted = measure(model, blocks, others, example, example_call, split)
        if counted is not None:
            outside, out = counted
            return outside, Logits(out.per_token, out.per_row, _splits_logits(
                model, [*blocks, *others], found, out.width))
        if head is None:
            return None, None
    flops = 2.0 * hidden * vocab
    on_split = any(head is m or head in set(m.modules()) for m in split)
    return (Outside(flops, 0.0, split_token=flops if on_split else 0.0),
            Logits(float(vocab), 0.0, _splits_logits(model, [*blocks, *others], found, vocab)))


def _splits_logits(model: Any, blocks: list[Any], found: tuple[Any, bool] | None,
                   width: int) -> bool:
    """Whether the tensor-parallel plan ``found`` splits the logits (``width`` wide) over its
    ranks: a matmul outside ``blocks`` that makes ``width`` outputs and that the plan lays out
    ``vocab_head`` (its logits stay sharded, the loss runs under ``loss_parallel()``) or
    ``colwise`` (each rank keeps its columns). A head it leaves whole (one beside a logits
    bias) or gathers (``colwise_gather``) hands every rank all of them."""
    return any((_dims(m) or (0, 0))[1] == width
               for m in _split_outside(model, blocks, found, ("vocab_head", "colwise")))


def _split_outside(model: Any, blocks: list[Any], found: tuple[Any, bool] | None,
                   styles: tuple[str, ...] | None = None) -> list[Any]:
    """The modules outside ``blocks`` whose weight the tensor-parallel plan ``found`` splits
    (a vocabulary-parallel head, a Linear a user's plan shards), outermost first: each tp
    rank computes 1/tp of their FLOPs. A stem, a projection or a classifier the plan does not
    name runs whole on every rank. Empty without a plan. ``styles``: only the modules laid
    out in these (default: every style that shards a Linear's weight)."""
    from plait.parallel.tp_plans import LINEAR_STYLES, glob_regex

    if found is None:
        return []
    inside = {id(m) for b in blocks for m in b.modules()}
    styles = styles or (*LINEAR_STYLES, "vocab_head")
    splits = [glob_regex(g) for g, style in found[0].styles.items() if style in styles]
    out: list[Any] = []
    for name, module in model.named_modules():
        if id(module) in inside or not name or not any(r.match(name) for r in splits):
            continue
        if not any(module in set(o.modules()) for o in out):  # not inside one already held
            out.append(module)
    return out


def _language_model_head(model: Any, blocks: list[Any], hidden: int, vocab: int) -> Any:
    """The head where every parameter outside ``blocks`` is an ``nn.Embedding``'s, a vector (a
    norm's weight or bias, a bias), or the weight of the one ``hidden`` -> ``vocab`` matmul
    layer (the head, :func:`_dims`): the outside whose FLOPs are the head's 2 x hidden x
    vocab per token. A stem, a projection, a classifier of another width, a matrix held
    outside any such layer (a projection written as ``x @ self.proj``) is not, nor an
    outside with no head (an encoder whose output is its hidden states): None then."""
    import torch.nn as nn

    inside = {id(p) for b in blocks for p in b.parameters()}
    heads = []
    for module in model.modules():
        owned = [p for p in module.parameters(recurse=False) if id(p) not in inside]
        if not owned or isinstance(module, nn.Embedding):
            continue
        head = _dims(module) == (hidden, vocab)
        if any(p.ndim > 1 and not (head and p is module.weight) for p in owned):
            return None
        if head:
            heads.append(module)
    return heads[0] if len(heads) == 1 else None


def _measured_saves(stats: ModelStats, block: Any, model: Any = None) -> ModelStats:
    """``stats`` with what ``block`` saves for backward measured (:func:`plait.planner.saved
    .measure`): its activation's tensors besides its output (ffn-wide tensors saved, less the
    feed-forward's others: the down projection's input, and a gated one's gate and up
    outputs), and the bytes per token the formula then still misses, in each compute dtype
    (:attr:`ModelStats.saved_extra`); ``block`` runs with the arguments ``model``'s forward
    hands it (a block whose cross-attention reads another stack's output, with that output,
    which :func:`plait.planner.memory.side_input_bytes` prices once for the stack). Unchanged
    for a block that does not run."""
    from .cost import Constants
    from .memory import activation_bytes_per_block
    from .saved import measure

    if stats.ffn <= stats.hidden:
        return stats
    got = measure(block, stats.hidden, stats.ffn, model, side=stats.cross_attentions > 0)
    if got is None:
        return stats
    act = got.ffn_wide - (3 if stats.mlp == "swiglu" else 1)
    if act >= 0:
        stats = dataclasses.replace(stats, act_saved=act)
    flash = Constants(flash_attention=True)  # the formula per token, scores aside
    if got.side is not None:  # told apart: per own token (no other stack), per its token
        own = [activation_bytes_per_block(stats, 1, 1, 1, False, size, flash, side_seq=0)
               for size in (4, 2)]
        side = tuple(measured - activation_bytes_per_block(stats, 1, 1, 1, False, size, flash,
                                                           side_seq=1) + mine
                     for measured, size, mine in zip(got.side, (4, 2), own, strict=True))
        extra = tuple(measured - mine for measured, mine in zip((got.fp32, got.bf16), own,
                                                                strict=True))
        return dataclasses.replace(stats, saved_extra=(extra[0], extra[1]),
                                   saved_side=(side[0], side[1]),
                                   saved_scores=got.scores if stats.attention else None,
                                   saved_cross_scores=got.cross_scores
                                   if stats.attention else None)
    extra = tuple(measured - activation_bytes_per_block(stats, 1, 1, 1, False, size, flash)
                  for measured, size in ((got.fp32, 4), (got.bf16, 2)))
    return dataclasses.replace(stats, saved_extra=(extra[0], extra[1]),
                               saved_scores=got.scores if stats.attention else None)


def _measured_stack(stats: ModelStats, more: MoreStack, model: Any) -> MoreStack:
    """``more`` with what one of its blocks (its largest) saves measured as the main stack's
    (:func:`_measured_saves`, on the further stack's own block shape): an encoder's block,
    without the decoder's cross-attention, is not priced by the decoder block's figures."""
    path = more.first.rsplit(".", 1)[0]
    blocks = list(model.get_submodule(path).children())
    block = max(blocks, key=lambda b: sum(p.numel() for p in b.parameters()))
    own = stats.stack_block(dataclasses.replace(more, saved_extra=(0.0, 0.0),
                                                saved_scores=None, saved_side=(0.0, 0.0),
                                                saved_cross_scores=None))
    from .cost import Constants
    from .memory import activation_bytes_per_block

    got = _measured_saves(own, block, model)
    # the stack is priced with the main stack's activation: what the formula then counts
    # differently from the measured block's own goes into its extra
    flash = Constants(flash_attention=True)
    extra = tuple(e + activation_bytes_per_block(got, 1, 1, 1, False, size, flash)
                  - activation_bytes_per_block(dataclasses.replace(got, act_saved=own.act_saved),
                                               1, 1, 1, False, size, flash)
                  for e, size in zip(got.saved_extra, (4, 2), strict=True))
    return dataclasses.replace(more, saved_extra=(extra[0], extra[1]),
                               saved_scores=got.saved_scores, saved_side=got.saved_side,
                               saved_cross_scores=got.saved_cross_scores)


def _activation(block: Any) -> Any:
    """The feed-forward's activation module in ``block`` (None where it is called as a
    function): the first leaf module without parameters outside the attention modules
    whose class is one of torch's activations or is named for one (transformers' ``act``,
    ``act_fn``: ``NewGELUActivation``, ``SiLUActivation``)."""
    import torch.nn as nn

    attention = [n for n, m in block.named_modules()
                 if n and ("attn" in type(m).__name__.lower()
                           or "attention" in type(m).__name__.lower())]
    words = ("act", "gelu", "relu", "silu", "swish", "tanh", "sigmoid")
    for name, m in block.named_modules():
        if not name or any(name.startswith(a + ".") for a in attention) or \
                next(m.children(), None) is not None or next(m.parameters(), None) is not None:
            continue
        kind = type(m)
        if "softmax" in kind.__name__.lower() or "softmin" in kind.__name__.lower():
            continue  # attention's, in torch's activations module too
        if kind.__module__ == nn.modules.activation.__name__ or any(
                w in kind.__name__.lower() for w in words):
            return m
    return None


def _saved_by(activation: Any) -> int | None:
    """Tensors ``activation`` saves for backward besides its output, counted (distinct
    storages) in one call on a small CPU tensor that needs a gradient (fixed values: the
    global random state is not drawn from); None for no module or one that does not run so
    (:attr:`ModelStats.act_saved`)."""
    import torch

    if activation is None:
        return None
    x = torch.linspace(-3.0, 3.0, 16).reshape(2, 8).requires_grad_()
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(t.untyped_storage().data_ptr())
        return t

    try:  # the user's random state untouched (an activation that draws, as RReLU)
        with torch.random.fork_rng(devices=[]), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = activation(x)
    except Exception:  # noqa: BLE001 - an activation that does not run here is not measured
        return None
    if not isinstance(y, torch.Tensor):
        return None
    saved.discard(y.untyped_storage().data_ptr())
    return len(saved)


def _unfused_norms(block: Any, hidden: int) -> bool:
    """Whether ``block`` holds a norm written as Python ops: a module whose class name says
    norm, with a weight of ``hidden`` elements, that is none of torch's fused norms."""
    import torch.nn as nn

    fused = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)
    for m in block.modules():
        weight = getattr(m, "weight", None)
        if "norm" in type(m).__name__.lower() and not isinstance(m, fused) \
                and isinstance(weight, nn.Parameter) and weight.shape == (hidden,):
            return True
    return False


def _mlp_kind(model: Any, block: Any, hidden: int, ffn: int) -> str:
    """The feed-forward's kind, which says what it saves for backward
    (:func:`plait.planner.memory.activation_bytes_per_block`): "swiglu" for any gated one (a
    module named for a gate, or more hidden -> ffn layers than ffn -> hidden ones outside the
    attention modules: T5 v1.1's ``wi_0`` and ``wi_1``), "relu" where the block holds an
    ``nn.ReLU`` or the model's config names relu its activation (T5's ``dense_act_fn``),
    whose output is the down projection's input; "" for neither (an activation called as a
    function is not seen)."""
    import torch.nn as nn

    attention = [n for n, m in block.named_modules()
                 if n and ("attn" in type(m).__name__.lower()
                           or "attention" in type(m).__name__.lower())]
    dims = [_dims(m) for n, m in block.named_modules()
            if not any(n.startswith(a + ".") for a in attention)]
    ups = sum(1 for d in dims if d == (hidden, ffn))
    downs = sum(1 for d in dims if d == (ffn, hidden))
    if any("gate" in n for n, _ in block.named_modules()) or (
            ffn != hidden and downs and ups > downs):
        return "swiglu"
    config = getattr(model, "config", None)
    named = [getattr(config, a, None) for a in ("dense_act_fn", "hidden_act",
                                                "activation_function")]
    if any(isinstance(m, nn.ReLU) for m in block.modules()) or "relu" in named:
        return "relu"
    return ""


def _attention_keys(model: Any, device_type: str, example: Any = None
                    ) -> tuple[tuple[int, int, int], ...] | None:
    from .tp_trace import attention_keys

    return attention_keys(model, device_type=device_type, example=example)


def _divided_heads(block: Any, path: str, plan: Any) -> int | None:
    """The head count of ``block``'s attention as its layer plan divides it over tp (an
    attention module whose count has a name of its own, ``self.heads``, that the planner does
    not read): the smallest count the plan divides there, kv head counts aside (the others are
    sizes, such as GPT-2's ``split_size``). None where the plan divides none."""
    from plait.parallel.tp_plans import glob_regex

    counts = []
    for name, module in block.named_modules():
        full = f"{path}.{name}".strip(".")
        for glob, attrs in plan.divide_attrs.items():
            if glob_regex(glob).match(full):
                counts += [v for v in (getattr(module, a, None) for a in attrs
                                       if "kv" not in a and "key_value" not in a)
                           if isinstance(v, int) and not isinstance(v, bool) and v > 1]
    return min(counts) if counts else None


def _more_stacks(model: Any, stack: str, found: tuple[Any, bool] | None,
                 device_type: str) -> tuple[MoreStack, ...]:
    """The stacks of blocks other than the one at ``stack`` whose layers the plan ``found``
    splits (:func:`plait.parallel.pipeline_hf.other_block_stacks`, as sequence parallelism
    finds them), each with one trained block's collectives; whether the vocabulary-parallel
    embedding makes a stack's input is read off one forward on fake tensors of a guessed input
    (the embedding called just before the stack's first block)."""
    from plait.parallel.pipeline_hf import other_block_stacks
    from plait.parallel.tp_plans import glob_regex

    from .tp_block import tp_block

    if found is None:
        return ()
    patterns = [glob_regex(g) for g in found[0].styles]
    paths = [p for p in other_block_stacks(model, stack)
             if any(n.startswith(p + ".") and any(r.match(n) for r in patterns)
                    for n, _ in model.named_modules())]
    if not paths:
        return ()
    embedded = _embedded_stacks(model, [f"{p}.{next(iter(model.get_submodule(p)._modules))}"
                                        for p in paths], found[0])
    out = []
    for path in paths:
        blocks = list(model.get_submodule(path).children())
        trained = next((b for b in blocks if any(p.requires_grad for p in b.parameters())),
                       blocks[0])
        first, last = _path(model, blocks[0]), _path(model, blocks[-1])
        matmul = sum(m.weight.numel() for b in blocks for m in b.modules()
                     if _dims(m) is not None)
        attentions = _attention_layers(model, _path(model, trained), found)
        side, cross = _cross_reads(model, _path(model, trained), found)
        out.append(MoreStack(first, len(blocks),
                             tp_block(model, _path(model, trained), found, (first, last),
                                      device_type), first in embedded,
                             matmul_params=round(matmul / len(blocks)),
                             attentions=attentions, side_matmul_params=side,
                             cross_attentions=min(cross, attentions)))
    return tuple(out)


def _cross_reads(model: Any, path: str, found: tuple[Any, bool] | None) -> tuple[int, int]:
    """(matmul weights, attention layers) of the block at ``path`` that read another stack's
    output: the layers the plan ``found`` names as side inputs (``TPPlan.side_inputs``: a
    decoder block's cross-attention keys and values), and the attention layers (modules whose
    head count the plan divides) holding one. (0, 0) where there is no plan or none reads."""
    from plait.parallel.tp_plans import glob_regex

    if found is None or not found[0].side_inputs:
        return 0, 0
    side = [glob_regex(g) for g in found[0].side_inputs]
    heads = [glob_regex(g) for g, attrs in found[0].divide_attrs.items()
             if any("head" in a for a in attrs)]
    reads = {f"{path}.{name}": m for name, m in model.get_submodule(path).named_modules()
             if name and _dims(m) is not None and any(r.match(f"{path}.{name}") for r in side)}
    weights = sum(m.weight.numel() for m in reads.values())
    layers = {f"{path}.{name}" for name, _ in model.get_submodule(path).named_modules()
              if name and any(r.match(f"{path}.{name}") for r in heads)}
    cross = sum(1 for layer in layers if any(n.startswith(layer + ".") for n in reads))
    return weights, cross


def _attention_layers(model: Any, path: str, found: tuple[Any, bool] | None) -> int:
    """The attention layers of the block at ``path``: the modules in it whose head count
    (an attribute named for heads) the layer plan ``found`` divides over tp (a decoder
    block's self- and cross-attention: 2); 1 where the plan divides none or there is no
    plan."""
    from plait.parallel.tp_plans import glob_regex

    if found is None:
        return 1
    patterns = [glob_regex(g) for g, attrs in found[0].divide_attrs.items()
                if any("head" in a for a in attrs)]
    count = sum(1 for name, _ in model.get_submodule(path).named_modules()
                if any(r.match(f"{path}.{name}".strip(".")) for r in patterns))
    return max(count, 1)


def _embedded_stacks(model: Any, firsts: list[str], plan: Any) -> set[str]:
    """Which of the blocks ``firsts`` the forward calls right after the vocabulary-parallel
    embedding (their stack's input is its output), in one forward on fake tensors of a guessed
    input; none where it does not run."""
    from plait.parallel.tp_example import example_call, run_on
    from plait.parallel.tp_plans import glob_regex
    from plait.parallel.tp_record import fake_forward

    embeds = [n for n, _ in model.named_modules() if n and any(
        glob_regex(g).match(n) for g, st in plan.styles.items() if st == "vocab_embedding")]
    example = example_call(model) if embeds else None
    if example is None:
        return set()
    calls: list[str] = []
    handles = [model.get_submodule(n).register_forward_pre_hook(
        lambda *_, n=n: calls.append(n)) for n in [*embeds, *firsts]]
    try:
        with fake_forward(model):
            run_on(model, example)
    except Exception:  # noqa: BLE001 - not runnable on the guess: none priced
        return set()
    finally:
        for h in handles:
            h.remove()
    return {b for i, b in enumerate(calls) if b in firsts and i and calls[i - 1] in embeds}


def _path(model: Any, module: Any) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def _max_seq(model: Any) -> int | None:
    """The longest sequence the model takes, when it says: a Hugging Face config's
    ``max_position_embeddings`` (``n_positions`` for GPT-2), or a ``max_seq_len`` setting, on
    the model or the first submodule that has one (a wrapper around a transformers model)."""
    for module in model.modules():
        for holder in (getattr(module, "config", None), getattr(module, "cfg", None), module):
            for attr in ("max_position_embeddings", "n_positions", "max_seq_len"):
                value = getattr(holder, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def _position_rows(model: Any) -> tuple[int | None, str]:
    """The longest sequence a learned absolute position table allows: the rows of the one
    ``nn.Embedding`` whose attribute name says positions (:func:`_names_positions`), with the
    words that say so. (None, "") when no
    embedding's name says positions or several do with different row counts: a count read off
    the wrong table would price the wrong sequence."""
    import torch.nn as nn

    found = {(name, m.num_embeddings) for name, m in model.named_modules()
             if isinstance(m, nn.Embedding)
             and _names_positions(name.rsplit(".", 1)[-1].lower())}
    if len({rows for _, rows in found}) != 1:
        return None, ""
    names = sorted(name for name, _ in found)
    rows = next(iter(found))[1]
    return rows, f"the {rows} rows of its position embedding {', '.join(names)}"


def _names_positions(attr: str) -> bool:
    """``pos``, ``pos_emb``, ``position_embeddings``, BART's ``embed_positions``, GPT-2's
    ``wpe``: an attribute name that says its table is indexed by position."""
    return attr.startswith("pos") or "position" in attr or attr == "wpe"


def _dims(module: Any) -> tuple[int, int] | None:
    """(in, out) features of a matrix-multiply layer: ``nn.Linear``, or Hugging Face's
    ``Conv1D`` (GPT-2's linears, weight stored (in, out)); None for anything else."""
    import torch.nn as nn

    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int) \
            and weight is not None and weight.ndim == 2:
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def _signature(module: Any) -> tuple:
    return (type(module).__name__,
            tuple((n, tuple(p.shape)) for n, p in module.named_parameters()))


def _extends(first: Any, other: Any) -> bool:
    """Whether block ``first`` is ``other`` with parameters of its own besides (a table the
    first block of a stack computes and hands on to the later ones, as T5's relative position
    bias): the same class, and every parameter of ``other`` at the same name and shape in
    ``first``, which holds more."""
    kind, mine = _signature(first)
    theirs = _signature(other)
    return kind == theirs[0] and set(theirs[1]) < set(mine)


def _longest_run(children: list) -> list:
    """The longest run of consecutive children with the same type and parameter shapes, with
    the child before it where that one is a block of the run plus parameters of its own
    (:func:`_extends`): a stack whose first block holds what the later blocks reuse is one
    stack of alike blocks and those extra parameters."""
    best: list = []
    start = 0
    for i in range(1, len(children) + 1):
        if i == len(children) or _signature(children[i]) != _signature(children[start]):
            lead = start - 1 if start and _extends(children[start - 1], children[start]) \
                else start
            if i - lead > len(best) and any(True for _ in children[start].parameters()):
                best = children[lead:i]
            start = i
    return best


def from_factory(spec: str, attention_dtypes: bool = False) -> ModelStats:
    """``"package.module:function"`` -> stats of ``function()`` built on the meta device, with
    the sequence length of its dataset's first sample when it returns one
    (``attention_dtypes``: as :func:`from_module`)."""
    from .whole_model import example_of

    built = _build(spec, "meta")
    model = _model_of(built, spec)
    # the forward passes run on the dataset's first sample, as run.parallelize(model,
    # example=batch) runs them on the user's batch: a dataset built on meta has no values,
    # so it is built again with only the parameters there
    example = example_of(built, model)
    if example is None and isinstance(built, (tuple, list)) and len(built) > 1:
        with contextlib.suppress(Exception):
            example = example_of(_build(spec, "meta", parameters_only=True), model)
    stats = from_module(model, name=spec, attention_dtypes=attention_dtypes, example=example)
    if stats.data_stack_seqs:  # each stack's length, read off the first sample's forward
        return stats
    if isinstance(built, (tuple, list)) and len(built) > 1:
        dataset = built[1]
        if not _indexable(dataset):
            # Its samples read tensor values (``int(lengths[i])`` in ``__getitem__``), which a
            # dataset built under torch.device("meta") lacks: built again with only the
            # parameters on meta, so that the sequence priced is the one training runs.
            with contextlib.suppress(ValueError, IndexError, TypeError):
                dataset = _build(spec, "meta", parameters_only=True)[1]
        return dataclasses.replace(stats, data_seq=_sample_seq(dataset))
    return stats


def _stack_lengths(model: Any, stats: ModelStats, example: Any
                   ) -> tuple[tuple[str, int], ...]:
    """(first block, sequence length) of the main stack, then of each further stack, as one
    forward on fake tensors of ``example`` (the dataset's first sample) hands them to each
    stack's first block: an encoder-decoder's source (``input_ids``) and target (its
    ``decoder_input_ids``, or the ``labels`` the model shifts into them). Empty for a model
    with one stack, without an example, or where the forward does not reach every stack."""
    import torch

    from plait.parallel.tp_example import run_on
    from plait.parallel.tp_record import fake_forward

    if not stats.more_stacks or example is None or not stats.stack_first:
        return ()
    firsts = [stats.stack_first, *(m.first for m in stats.more_stacks)]
    lengths: dict[str, int] = {}

    def note(name: str) -> Any:
        def hook(_: Any, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor) and x.ndim >= 2:
                lengths.setdefault(name, int(x.shape[1]))
        return hook

    handles = [model.get_submodule(f).register_forward_pre_hook(note(f), with_kwargs=True)
               for f in firsts]
    try:
        with fake_forward(model):
            run_on(model, example)
    except Exception:  # noqa: BLE001 - a forward that does not run says no lengths
        return ()
    finally:
        for h in handles:
            h.remove()
    if any(f not in lengths for f in firsts):
        return ()
    return tuple((f, lengths[f]) for f in firsts)


def _indexable(dataset: Any) -> bool:
    """Whether ``dataset[0]`` can be read (an empty or unsized dataset counts as readable)."""
    try:
        if len(dataset) == 0:
            return True
    except TypeError:
        pass
    try:
        dataset[0]
    except Exception:  # noqa: BLE001 - any failure: its values may be on the meta device
        return False
    return True


def _sample_seq(dataset: Any, look: int = 64) -> int | None:
    """Positions per sample of ``dataset``, the longest of its first ``look`` samples (rows of
    different lengths are padded to the longest of a batch): of a sample's input (a tuple's
    first item, a dict's ``input_ids`` or first value), the length of a 1-D token row or the
    first dim of a 2-D float (positions, features) row. None for anything else: an image, a
    dataset that cannot be indexed."""
    try:
        count = min(len(dataset), look)
    except TypeError:
        count = 1
    lengths = [_positions(dataset, i) for i in range(count)]
    return max((n for n in lengths if n), default=None)


def _positions(dataset: Any, i: int) -> int | None:
    import torch

    try:
        sample = dataset[i]
    except Exception:  # noqa: BLE001 - a dataset that cannot be indexed says no length
        return None
    if isinstance(sample, dict):
        x = sample.get("input_ids", next(iter(sample.values()), None))
    elif isinstance(sample, (tuple, list)):
        x = sample[0] if sample else None
    else:
        x = sample
    if not isinstance(x, torch.Tensor):
        return None
    tokens = x.dim() == 1 and not x.is_floating_point()
    positions = x.dim() == 2 and x.is_floating_point()
    return int(x.shape[0]) if tokens or positions else None


def sample_keys(spec: str) -> list[str] | None:
    """The keys of the first item of the dataset ``"package.module:function"`` returns, when
    that item is a dict (the batch the model is called with); None otherwise: a model that
    takes such a dict whole cannot be cut into pipeline stages."""
    with contextlib.suppress(Exception):  # a dataset that cannot be read says nothing
        built = _build(spec, "meta", parameters_only=True)
        if isinstance(built, (tuple, list)) and len(built) > 1:
            item = built[1][0]
            if isinstance(item, dict):
                return [str(k) for k in item]
    return None


def uneven_first_input(spec: str, items: int = 8) -> str | None:
    """Why a pipeline cannot take the batches of the factory ``"package.module:function"``,
    or None: where each of its dataset's first ``items`` items, collated alone by its
    ``collate_fn``, gives the input the stages chain (the forward's first argument) another
    row count, those rows are not examples (a graph's nodes, PyG-style), so a step's
    microbatches differ in shape, which torch's pipeline cannot send between stages (the
    step refuses them). Asked of factories with a collate_fn only: the default collate
    stacks items of one shape."""
    import torch

    from ..parallel.tp_example import from_batch

    with contextlib.suppress(Exception):  # a dataset or collate that fails says nothing here
        built = _build(spec, "meta", parameters_only=True)
        if not (isinstance(built, (tuple, list)) and len(built) == 4 and callable(built[3])):
            return None
        model, data, collate = _model_of(built, spec), built[1], built[3]
        signature = inspect.signature(model.forward)
        first = next(iter(signature.parameters), None)
        rows: list[int] = []
        for i in range(min(items, len(data))):
            example = from_batch(model, collate([data[i]]))
            x = example.args[0] if example.args else example.kwargs.get(first or "")
            if isinstance(x, torch.Tensor) and x.dim() > 0:
                rows.append(int(x.shape[0]))
        if len(set(rows)) > 1:
            shown = ", ".join(map(str, rows))
            return (f"one item of its dataset collates to {shown} rows in "
                    f"{type(model).__name__}.forward's first input {first!r} (rows that are "
                    f"not examples, as a graph's nodes), so a step's microbatches differ in "
                    f"shape, which a pipeline cannot send between stages")
    return None


def build_factory(spec: str, device: str) -> Any:
    """The ``nn.Module`` that ``"package.module:function"`` builds, on ``device`` (the first
    item of a ``(model, dataset, loss_fn)`` factory, as ``plait check`` takes)."""
    return _model_of(_build(spec, device), spec)


def _build(spec: str, device: str, *, parameters_only: bool = False) -> Any:
    """What ``"package.module:function"`` returns, built on ``device``.

    On ``"meta"`` the factory runs under ``torch.device("meta")``: nothing is allocated, so a
    70B model plans on a laptop. A factory that also builds its dataset there fails when the
    dataset reads a tensor's values (``int(lengths[i])``: a meta tensor has none); it is then
    built again with only the parameters on the meta device (:func:`_parameters_on_meta`), every
    other tensor real; ``parameters_only`` builds it that way at once.
    """
    import torch

    from ..user_factory import load_factory

    factory = load_factory(spec)
    try:
        with _parameters_on_meta() if parameters_only else torch.device(device), \
                _values_skipped() if device == "meta" else contextlib.nullcontext():
            built = factory()
    except Exception as exc:  # noqa: BLE001
        if device != "meta":
            raise ValueError(f"model factory {spec!r} failed to build on the {device} device: "
                             f"{type(exc).__name__}: {exc}") from None
        try:
            with _parameters_on_meta():
                built = factory()
        except Exception as again:  # noqa: BLE001
            raise ValueError(
                f"model factory {spec!r} failed to build under torch.device('meta') "
                f"({type(exc).__name__}: {exc}) and with only its parameters on the meta device "
                f"({type(again).__name__}: {again}); the planner needs the model's shapes, not "
                "its values: give --model a function that returns the model alone") from None
    return built


def _model_of(built: Any, spec: str) -> Any:
    """The ``nn.Module`` of what a factory returned: itself, or a tuple's first item."""
    import torch

    model = built
    if isinstance(built, (tuple, list)) and built:  # plait check's (model, dataset, loss_fn)
        model = built[0]
    if not isinstance(model, torch.nn.Module):
        got = (f"a {type(built).__name__} whose first item is a {type(model).__name__}"
               if model is not built else f"a {type(built).__name__}")
        raise ValueError(f"model factory {spec!r} returned {got}: return the nn.Module, or "
                         "(model, dataset, loss_fn) as plait check takes")
    return model


# In-place random fills whose meta-device form is torch's Python reference, which imports
# torch._dynamo (and with it DTensor, FSDP and torch.export) on first use: seconds of a `plait
# plan` whose model has an nn.Embedding (normal_ initialises it), for values a meta tensor does
# not hold anyway. A random draw given its own ``generator=`` (a seeded dataset's
# ``torch.randn(n, d, generator=g)``) takes the same path on the meta device.
_RANDOM_FILLS = ("normal_", "exponential_", "log_normal_", "cauchy_", "geometric_")


@contextlib.contextmanager
def _values_skipped() -> Iterator[None]:
    """Within it (the factory runs under ``torch.device("meta")``), those fills of a meta tensor
    return the tensor as it is, and a draw that lands on the meta device is made without its
    generator: the same shape and dtype, no values either way (a ``TorchFunctionMode``: torch's
    own hook for intercepting tensor methods)."""
    import torch
    from torch.overrides import TorchFunctionMode

    def on_meta(args: Any, kwargs: dict[str, Any]) -> bool:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if tensors:
            return all(t.is_meta for t in tensors)
        device = kwargs.get("device")  # none given: the meta device of the context
        return device is None or torch.device(device).type == "meta"

    class SkipFills(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            # by name: torch.nn.init.normal_ reaches here as itself, and its inner
            # Tensor.normal_ call does not (a mode does not see what its own call runs)
            kwargs = kwargs or {}
            target = args[0] if args else kwargs.get("tensor")  # nn.init passes keywords
            if getattr(func, "__name__", "") in _RANDOM_FILLS \
                    and getattr(target, "is_meta", False):
                return target
            if kwargs.get("generator") is not None and on_meta(args, kwargs):
                kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
            return func(*args, **kwargs)

    with SkipFills():
        yield


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Within it, each parameter moves to the meta device as its module registers it; every
    other tensor (a dataset's, a buffer) is real. The peak host memory is one parameter, not the
    model. Module-level patch of ``nn.Module.register_parameter``, undone on exit: torch has no
    device context that spares non-parameter tensors."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(self: torch.nn.Module, name: str, param: Any) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.detach().to("meta"),
                                       requires_grad=param.requires_grad)
        register(self, name, param)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def from_yaml(path: Path) -> ModelStats:
    import yaml

    from plait.models.config import PRESETS, TransformerConfig, preset

    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"model file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"model file {str(path)!r} must hold a mapping of fields")
    data = dict(data.get("model", data))
    if "preset" in data:
        name = data.pop("preset")
        if name not in PRESETS:
            raise ValueError(f"model file {str(path)!r}: unknown preset {name!r}; "
                             f"known: {', '.join(PRESETS)}")
        try:
            return from_transformer_config(preset(name, **data), name=f"{name} ({path.name})")
        except TypeError as exc:
            raise ValueError(f"model file {str(path)!r}: {exc}") from None
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    if set(data) & fields and not set(data) - fields:
        return from_transformer_config(TransformerConfig(**data), name=path.stem)
    if any(k in data for k in ("hidden_size", "n_embd", "d_model")):
        return from_hf_config(data, name=path.stem)
    raise ValueError(f"model file {str(path)!r}: unknown field(s) "
                     f"{', '.join(sorted(set(data) - fields))}; use TransformerConfig fields "
                     f"({', '.join(sorted(fields))}), 'preset:' or Hugging Face config keys")


def load_model(spec: Any, attention_dtypes: bool = False, example: Any = None) -> ModelStats:
    """A preset name, TransformerConfig, ModelStats, nn.Module, config.json/YAML path, or
    ``module:function`` factory -> ModelStats. ``attention_dtypes``: for a module or a factory,
    read the dtypes its keys and values reach attention in under bf16 (:func:`from_module`);
    ``example``: for a module, the user's input its forward passes run on."""
    from plait.models.config import PRESETS, TransformerConfig

    if isinstance(spec, ModelStats):
        return spec
    if isinstance(spec, TransformerConfig):
        return from_transformer_config(spec)
    if isinstance(spec, Mapping):
        return from_hf_config(spec)
    if not isinstance(spec, (str, Path)):  # a name or a path needs no torch
        import torch.nn as nn

        if isinstance(spec, nn.Module):
            return from_module(spec, name=type(spec).__name__,
                               attention_dtypes=attention_dtypes, example=example)
        raise ValueError(f"cannot plan for a model given as {type(spec).__name__}")
    text = str(spec)
    if text in PRESETS:
        return from_transformer_config(PRESETS[text], name=text)
    path = Path(text)
    if path.suffix == ".json" or (path.is_dir() and (path / "config.json").exists()):
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ValueError(f"model config {text!r} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"model config {text!r} is not valid JSON: {exc}") from None
        return from_hf_config(data, name=path.parent.name or path.stem)
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise ValueError(f"model file {text!r} does not exist")
        return from_yaml(path)
    if ":" in text:
        return from_factory(text, attention_dtypes=attention_dtypes)
    from ..factory_spec import file_path_hint

    raise ValueError(f"unknown model {text!r}: give a preset ({', '.join(PRESETS)}), a "
                     f"config.json, a model YAML, or a factory 'package.module:function'"
                     f"{file_path_hint(text, '')}")
