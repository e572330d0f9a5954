"""Tensor-parallel layer plans, as data.

A plan maps module-name globs to a *style* name (``fnmatch`` globs, ``*`` matches one or more name
parts, e.g. ``layers.*.attention.q_proj``). Styles are strings so plans serialise to YAML/JSON and
can be printed, diffed and passed as ``plan.options.tp_plan``. What each style does
(``plait.parallel.tensor`` turns them into DTensor ``ParallelStyle`` objects):

==================  ==========================================================================
colwise             Linear / HF Conv1D split on its output features (Megatron's column-parallel
                    layer, the start of a TP region). Output stays sharded (heads split).
colwise_qkv         colwise for a *fused* q|k|v layer (GPT-2's ``c_attn``): each third is split
                    separately so rank r holds [q_r, k_r, v_r], not a slice across q and k.
rowwise             Linear / Conv1D split on its input features (row-parallel, the end of a TP
                    region): partial outputs are all-reduced (reduce-scattered onto the sequence
                    dimension under SP).
colwise_gather      colwise whose output is all-gathered: every rank gets all features back. For
                    a fused layer whose output the forward slices or chunks by position (Phi-3's
                    ``qkv_proj`` with fewer k/v heads than q heads, a fused gate|up); the
                    attention or activation after it then runs whole on every rank.
rowwise_split       rowwise that reads a whole input and keeps its rank's share of the features
                    (no communication): what follows a ``colwise_gather``.
replicated_kv       a k or v projection with fewer heads than tp (multi-query or grouped-query
                    attention): its weights stay whole on every rank, each rank computes the one
                    kv head its query heads read, and the gradients are summed over tp in
                    backward (``plait.parallel.tp_kv``). plait picks it by itself where a
                    ``colwise`` k/v layer has fewer heads than tp.
grad_allreduce      a module applied to each rank's share of a TP region (a per-head q/k norm
                    after q_proj and k_proj split the heads): its weights stay whole on every
                    rank, but each rank's gradient covers its heads only, so the gradients are
                    summed over the tp ranks in backward. Left replicated, the ranks' copies
                    would drift apart.
region              a block (attention, MLP) whose input is shared by several colwise layers: its
                    input becomes one replicated DTensor, so q/k/v (or gate/up) share *one*
                    backward all-reduce (Megatron's f operator) instead of one each; under SP this
                    is where the sequence shards are all-gathered.
vocab_embedding     nn.Embedding split over the vocabulary (rows); lookups outside a rank's rows
                    are masked and the partial embeddings all-reduced (reduce-scattered under SP).
vocab_head          LM head split over the vocabulary; logits stay sharded (a DTensor,
                    ``Shard(-1)``) and the loss runs under torch's ``loss_parallel()``, so
                    full-vocabulary logits never exist on one rank.
sequence_parallel   norms (and dropout) that run on sequence shards under SP; without SP they are
                    replicated like every other unsplit module.
==================  ==========================================================================

A plan may also name integer attributes to divide by ``tp`` after sharding (``divide_attrs``):
modules that reshape with a stored head count or split size (GPT-2's ``split_size``, BERT's
``all_head_size``) need their local value, not the global one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch.nn as nn

if TYPE_CHECKING:
    from ..models.config import TransformerConfig

# Styles that start a region: their input is the replicated value a ``region`` shares.
COLWISE = ("colwise", "colwise_qkv", "colwise_gather")
# Styles that split a Linear (or HF Conv1D) by its weight.
LINEAR_STYLES = (*COLWISE, "rowwise", "rowwise_split")
STYLES = ("colwise", "colwise_qkv", "rowwise", "colwise_gather", "rowwise_split",
          "replicated_kv", "grad_allreduce", "region", "vocab_embedding", "vocab_head",
          "sequence_parallel")


@dataclass(frozen=True)
class TPPlan:
    """A layer plan: ``styles`` {glob: style}, attributes to divide, and where it came from."""

    styles: dict[str, str]
    divide_attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    source: str = "user"
    # Named sizes that must divide by tp (heads, kv-heads, hidden, ffn), for validation messages.
    sizes: dict[str, int] = field(default_factory=dict)
    # Whether the plan knows how to keep activations sequence-sharded between TP regions.
    supports_sp: bool = False
    # Under SP, the glob of the block stack the sequence shards live in (Hugging Face models):
    # the first block's input is split along the sequence and the last block's output gathered,
    # so everything around the stack (embeddings with their positions and masks, the final
    # norm, the head) sees the whole sequence; pipeline stages send each other the shards.
    # Empty: the sequence is split from the embedding to the head (plait's reference
    # transformer).
    sp_blocks: str = ""
    # Further stacks the sequence is split in the same way, each at its own ends (an
    # encoder-decoder's decoder, a two-tower model's second tower): each stack runs its own
    # sequence, and what one stack reads of another (cross-attention's keys and values) is
    # that stack's whole output.
    sp_more_blocks: tuple[str, ...] = ()
    # An inferred plan's SP: the parameters of modules in ``sp_blocks`` that no entry names run
    # on sequence shards and get their gradients summed over tp; or why SP is refused for it.
    sp_summed: bool = False
    sp_refused: str = ""
    # Column-parallel layers inside a ``region`` that read another input than the region's
    # (cross-attention's keys and values, of the encoder's output): each all-reduces its own
    # input's gradient in backward, where the region's entries share one all-reduce. Read by
    # the planner, which counts the collectives off the plan.
    side_inputs: tuple[str, ...] = ()
    # Attention blocks whose output tuple holds, at these positions, a map per head (eager
    # attention's weights, the softmax of the scores): under tp a rank computes its own
    # heads' maps only, so they are dropped from the block's output (None, as torch's fused
    # attention returns them) rather than handed on as if they were all the heads.
    head_outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def with_prefix(self, prefix: str) -> TPPlan:
        if not prefix:
            return self
        return TPPlan(styles={f"{prefix}.{k}": v for k, v in self.styles.items()},
                      divide_attrs={f"{prefix}.{k}": v for k, v in self.divide_attrs.items()},
                      source=self.source, sizes=self.sizes, supports_sp=self.supports_sp,
                      sp_blocks=f"{prefix}.{self.sp_blocks}" if self.sp_blocks else "",
                      sp_more_blocks=tuple(f"{prefix}.{b}" for b in self.sp_more_blocks),
                      sp_summed=self.sp_summed, sp_refused=self.sp_refused,
                      side_inputs=tuple(f"{prefix}.{g}" for g in self.side_inputs),
                      head_outputs={f"{prefix}.{k}": v for k, v in self.head_outputs.items()})

    @property
    def sp_stacks(self) -> tuple[str, ...]:
        """The globs of every block stack the sequence is split in (none: from the embedding
        to the head, or no SP)."""
        return (self.sp_blocks, *self.sp_more_blocks) if self.sp_blocks else ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"styles": dict(self.styles)}
        if self.divide_attrs:
            out["divide_attrs"] = {k: list(v) for k, v in self.divide_attrs.items()}
        if self.side_inputs:
            out["side_inputs"] = list(self.side_inputs)
        if self.head_outputs:
            out["head_outputs"] = {k: list(v) for k, v in self.head_outputs.items()}
        return out

    @staticmethod
    def from_option(value: Mapping[str, Any]) -> TPPlan:
        """A user plan from ``plan.options.tp_plan``: {glob: style} or {"styles": ..., ...}."""
        if not isinstance(value, Mapping):
            raise ValueError(f"options.tp_plan must be a mapping of module-name glob to style, "
                             f"got {type(value).__name__}")
        if "styles" in value:
            styles, divide_in = value["styles"], value.get("divide_attrs", {})
            if not isinstance(styles, Mapping) or not isinstance(divide_in, Mapping) or not all(
                    isinstance(v, (list, tuple)) for v in divide_in.values()):
                raise ValueError(f"options.tp_plan={dict(value)!r}: 'styles' must map module "
                                 f"globs to styles and 'divide_attrs' module globs to lists of "
                                 f"attribute names")
            side = value.get("side_inputs", [])
            if not isinstance(side, (list, tuple)) or not all(isinstance(g, str) for g in side):
                raise ValueError(f"options.tp_plan side_inputs={side!r}: give a list of module "
                                 f"globs (the column-parallel layers inside a region that "
                                 f"read another input, such as cross-attention's k and v)")
            heads_in = value.get("head_outputs", {})
            if not isinstance(heads_in, Mapping) or not all(
                    isinstance(v, (list, tuple)) and all(isinstance(i, int) and i > 0 for i in v)
                    for v in heads_in.values()):
                raise ValueError(f"options.tp_plan head_outputs={heads_in!r}: give a mapping of "
                                 f"module glob to a list of positions (> 0) in its output tuple "
                                 f"that hold a map per head, such as [2] for eager attention's "
                                 f"weights")
            styles = dict(styles)
            divide = {k: tuple(v) for k, v in divide_in.items()}
            heads = {k: tuple(v) for k, v in heads_in.items()}
        else:
            styles, divide, side, heads = dict(value), {}, [], {}
        bad = {k: v for k, v in styles.items() if v not in STYLES}
        if bad:
            raise ValueError(f"unknown tensor-parallel style(s) {bad} in options.tp_plan; "
                             f"styles are {', '.join(STYLES)}")
        return TPPlan(styles=styles, divide_attrs=divide, source="options.tp_plan",
                      supports_sp=any(v == "sequence_parallel" for v in styles.values()),
                      side_inputs=tuple(side), head_outputs=heads)


# --------------------------------------------------------------------------- reference model
REFERENCE_STYLES: dict[str, str] = {
    "tok_embeddings": "vocab_embedding",
    "layers.*.attention_norm": "sequence_parallel",
    "layers.*.attention": "region",
    "layers.*.attention.q_proj": "colwise",
    "layers.*.attention.k_proj": "colwise",
    "layers.*.attention.v_proj": "colwise",
    "layers.*.attention.o_proj": "rowwise",
    "layers.*.ffn_norm": "sequence_parallel",
    "layers.*.feed_forward": "region",
    "layers.*.feed_forward.gate_proj": "colwise",
    "layers.*.feed_forward.up_proj": "colwise",
    "layers.*.feed_forward.down_proj": "rowwise",
    "norm": "sequence_parallel",
    "output": "vocab_head",
}


def reference_plan(model: nn.Module) -> TPPlan:
    """The plan for ``plait.models.transformer.Transformer`` (any preset, any pipeline stage)."""
    cfg = cast("TransformerConfig", model.config)
    sizes = {"n_heads": cfg.n_heads, "n_kv_heads": cfg.kv_heads, "dim": cfg.dim,
             "ffn_dim": cfg.hidden_dim}
    styles = dict(REFERENCE_STYLES)
    if cfg.mlp == "gelu":
        styles.pop("layers.*.feed_forward.gate_proj")
    # Pipeline stages may lack the embedding, final norm or head.
    for name in ("tok_embeddings", "norm", "output"):
        if getattr(model, name, None) is None:
            styles.pop(name)
    return TPPlan(styles=styles, source="plait reference transformer", sizes=sizes,
                  supports_sp=True)


# --------------------------------------------------------------------------- Hugging Face
# transformers' own style names (config.base_model_tp_plan, model._tp_plan) -> ours; None: a
# module left replicated, as every module no entry names is. Their "colwise_gather_output" head
# gathers full logits on every rank; ours keeps them vocab-sharded (see hf_plan).
HF_STYLE_NAMES: dict[str, str | None] = {
    "colwise": "colwise", "rowwise": "rowwise", "colwise_gather_output": "colwise_gather",
    "colwise_rep": "colwise_gather", "rowwise_split_input": "rowwise_split",
    "rowwise_rep": "rowwise_split", "replicated_with_grad_allreduce": "grad_allreduce",
    "embedding_rowwise": "vocab_embedding", "sequence_parallel": "sequence_parallel",
    "replicate": None}

# GPT-2 declares no tp_plan in transformers; its linears are Conv1D (weight stored (in, out)) and
# q|k|v are fused in c_attn.
GPT2_STYLES = {
    "wte": "vocab_embedding",
    "h.*.ln_1": "sequence_parallel",
    "h.*.attn": "region",
    "h.*.attn.c_attn": "colwise_qkv",
    "h.*.attn.c_proj": "rowwise",
    "h.*.ln_2": "sequence_parallel",
    "h.*.mlp": "region",
    "h.*.mlp.c_fc": "colwise",
    "h.*.mlp.c_proj": "rowwise",
}
GPT2_DIVIDE = {"h.*.attn": ("split_size", "num_heads")}

# Llama / Mistral / Qwen2 blocks beyond what transformers' base_model_tp_plan lists: the
# embedding, the shared-input regions and the norms.
LLAMA_EXTRA = {
    "embed_tokens": "vocab_embedding",
    "layers.*.input_layernorm": "sequence_parallel",
    "layers.*.self_attn": "region",
    "layers.*.post_attention_layernorm": "sequence_parallel",
    "layers.*.mlp": "region",
}
LLAMA_FALLBACK = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}

BERT_STYLES = {
    "embeddings.word_embeddings": "vocab_embedding",
    "encoder.layer.*.attention.self": "region",
    "encoder.layer.*.attention.self.query": "colwise",
    "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise",
    "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.attention.output.LayerNorm": "sequence_parallel",
    "encoder.layer.*.intermediate": "region",
    "encoder.layer.*.intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise",
    "encoder.layer.*.output.LayerNorm": "sequence_parallel",
}
BERT_DIVIDE = {"encoder.layer.*.attention.self": ("num_attention_heads", "all_head_size")}

HF_HEAD_NAMES = ("lm_head",)


def _translate_hf(tp_plan: Mapping[str, str], where: str) -> dict[str, str]:
    out = {}
    for glob, style in tp_plan.items():
        if style not in HF_STYLE_NAMES:
            raise ValueError(f"transformers' {where} uses style {style!r} for {glob!r}, which "
                             f"plait does not translate (known: {', '.join(HF_STYLE_NAMES)}); "
                             f"pass your own plan as options.tp_plan")
        ours = HF_STYLE_NAMES[style]
        if ours is not None:
            out[glob] = ours
    return out


def _hf_sizes(config: Any) -> dict[str, int]:
    names = {"num_attention_heads": "num_attention_heads", "n_head": "num_attention_heads",
             "num_key_value_heads": "num_key_value_heads", "hidden_size": "hidden_size",
             "n_embd": "hidden_size", "intermediate_size": "intermediate_size",
             "n_inner": "intermediate_size"}
    sizes = {}
    for attr, label in names.items():
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0 and label not in sizes:
            sizes[label] = value
    if "intermediate_size" not in sizes and getattr(config, "model_type", "") == "gpt2":
        sizes["intermediate_size"] = 4 * sizes["hidden_size"]
    return sizes


def glob_regex(glob: str) -> re.Pattern:
    """``*`` matches exactly one dotted name part (``layers.*.mlp`` matches ``layers.3.mlp``)."""
    return re.compile("^" + ".".join("[^.]+" if part == "*" else re.escape(part).replace(
        r"\*", "[^.]*") for part in glob.split(".")) + "$")


def under(name: str, glob: str) -> bool:
    """Whether module ``name`` is one ``glob`` matches or lies inside one (``blocks.0.norm``
    under ``blocks.*``)."""
    regex, parts = glob_regex(glob), name.split(".")
    return any(regex.match(".".join(parts[:k])) for k in range(1, len(parts) + 1))


def _has_modules(model: nn.Module, styles: Mapping[str, str]) -> bool:
    """Whether every glob of ``styles`` names a module of ``model``."""
    names = [n for n, _ in model.named_modules() if n]
    return all(any(glob_regex(g).match(n) for n in names) for g in styles)


def hf_plan(model: nn.Module) -> TPPlan:
    """The plan for a transformers ``PreTrainedModel`` (names relative to ``model``)."""
    config = model.config
    kind = getattr(config, "model_type", "")
    prefix = getattr(model, "base_model_prefix", "")
    # The base model is either ``model`` itself or its ``base_model_prefix`` child.
    base_prefix = prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    divide: dict[str, tuple[str, ...]] = {}
    blocks = "layers.*"
    base_model = getattr(model, base_prefix) if base_prefix else model
    # RoBERTa, XLM-R, ELECTRA, CamemBERT, ... declare no plan and keep BERT's module layout.
    bert_like = kind == "bert" or (not getattr(config, "base_model_tp_plan", None)
                                   and _has_modules(base_model, BERT_STYLES))
    if kind == "gpt2":
        base, divide, source = dict(GPT2_STYLES), dict(GPT2_DIVIDE), "plait plan for HF gpt2"
        blocks = "h.*"
    elif bert_like:
        base, divide = dict(BERT_STYLES), dict(BERT_DIVIDE)
        source = f"plait plan for HF {kind}" + ("" if kind == "bert" else " (BERT's layout)")
        blocks = "encoder.layer.*"
    else:
        declared = getattr(config, "base_model_tp_plan", None)
        if declared:
            base = _translate_hf(declared, f"{type(config).__name__}.base_model_tp_plan")
            # transformers' plan covers every variant of its config: Qwen2-MoE's names the
            # dense MLP of layers that `mlp_only_layers` or `decoder_sparse_step` leave
            # without experts, which a model whose every layer routes does not have.
            base = {g: s for g, s in base.items() if _has_modules(base_model, {g: s})}
            source = f"transformers' base_model_tp_plan for {kind}"
        elif kind in ("llama", "mistral", "qwen2"):
            base, source = dict(LLAMA_FALLBACK), f"plait plan for HF {kind}"
        else:
            raise LookupError(f"no tensor-parallel plan ships for transformers model_type "
                              f"{kind!r}")
        if kind in ("llama", "mistral", "qwen2") or all(
                k.startswith("layers.") for k in base):
            # A region only where column-parallel layers read its input (a mixture-of-experts
            # MLP that the plan leaves replicated is not one).
            extra = {k: v for k, v in LLAMA_EXTRA.items() if k not in base and (
                v != "region" or any(g.startswith(k + ".") and s in COLWISE
                                     for g, s in base.items()))}
            base = {**extra, **base}
    # Sequence parallelism inside the block stack, for the families whose blocks plait knows
    # (their norms are sequence_parallel and every linear that reads the residual stream sits
    # in a region); transformers' own plans for other families say nothing about it.
    sp = bert_like or kind in ("gpt2", "llama", "mistral", "qwen2")
    plan = TPPlan(styles=base, divide_attrs=divide, source=source, sizes=_hf_sizes(config),
                  supports_sp=sp, sp_blocks=blocks if sp else "",
                  head_outputs=_eager_weights(base_model, base, config))
    plan = plan.with_prefix(base_prefix)
    styles = dict(plan.styles)
    # The instance's _tp_plan merges the base plan under its prefix; only the head is new here.
    declared_head = {k: v for k, v in (getattr(model, "_tp_plan", None) or {}).items()
                     if k in HF_HEAD_NAMES}
    head_plan = _translate_hf(declared_head, f"{type(model).__name__}._tp_plan")
    for name in HF_HEAD_NAMES:
        if isinstance(getattr(model, name, None), nn.Linear):
            declared_style = head_plan.get(name, "vocab_head")
            style = "vocab_head" if declared_style in ("colwise", "colwise_gather") \
                else declared_style
            # A model that adds its routers' balance loss to its own loss (Mixtral's
            # output_router_logits) adds a plain tensor to the loss over vocabulary-split
            # logits, which DTensor refuses in the backward: its logits are gathered whole.
            if style == "vocab_head" and getattr(config, "output_router_logits", False):
                style = "colwise_gather"
            styles[name] = style
    return TPPlan(styles=styles, divide_attrs=plan.divide_attrs, source=plan.source,
                  sizes=plan.sizes, supports_sp=plan.supports_sp, sp_blocks=plan.sp_blocks,
                  head_outputs=plan.head_outputs)


def _eager_weights(base_model: nn.Module, styles: Mapping[str, str], config: Any
                   ) -> dict[str, tuple[int, ...]]:
    """The attention modules of a transformers model built with ``attn_implementation=
    "eager"`` (the parents of the plan's column-parallel layers whose class is an attention),
    each returning ``(output, weights)``: the weights come from q and k alone, one map per
    head, so under tp each rank computes its own heads' only, which would pass for all of
    them in ``output_attentions``. The plan's ``head_outputs`` makes them None there, as the
    model's SDPA form returns (and as an inferred plan does)."""
    if getattr(config, "_attn_implementation", None) != "eager":
        return {}
    modules = [(n, m) for n, m in base_model.named_modules() if n]
    found: dict[str, tuple[int, ...]] = {}
    for glob, style in styles.items():
        parent = glob.rpartition(".")[0]
        if style in COLWISE and parent and parent not in found and any(
                glob_regex(parent).match(n) and "Attention" in type(m).__name__
                for n, m in modules):
            found[parent] = (1,)
    return found


def shipped_plan(module: nn.Module) -> TPPlan | None:
    """plait's plan for its reference transformer, or the plan of a transformers model (its
    own, translated, or plait's for its family); None: the plan is to be inferred. Here, not
    in :mod:`plait.parallel.tensor`, because the planner asks it of every model it prices, and
    that module imports DTensor and FSDP (a CPU second) to lay models out."""
    from ..models.transformer import Transformer

    if isinstance(module, Transformer):
        return reference_plan(module)
    hf = _find_hf_model(module)
    if hf is not None:
        prefix, model = hf
        try:
            return hf_plan(model).with_prefix(prefix)
        except LookupError:
            pass  # an HF architecture without a plan: infer one
    return None


def _find_hf_model(module: nn.Module) -> tuple[str, nn.Module] | None:
    from .hf import transformers_class

    pretrained = transformers_class("", "PreTrainedModel")
    if pretrained is None:
        return None
    for name, sub in module.named_modules():
        if isinstance(sub, pretrained):  # a bare ``type``: mypy narrows ``sub`` to object
            return name, cast(nn.Module, sub)
    return None
