"""The parameter tensors and tensor-parallel collectives of a transformers decoder, from its
``config.json`` alone, for the families whose layout is known here tensor by tensor.

``plait plan --model config.json`` prices a model it never builds: what FSDP2 pads (each
tensor's rows), what tensor parallelism splits and what every rank keeps whole (norms,
row-parallel biases, a mixture-of-experts block's router and experts, which plait's layer
plans for these families leave whole), and which collectives one block issues under tp and
SP. Those follow from how transformers builds each family and how plait's layer plan for it
lays the block out; :func:`plait.planner.model_stats.from_module` reads the same off the
built model, and the two agree tensor by tensor (tests/test_planner_inputs.py).

* Llama, Mistral, Qwen2: separate q, k, v and o projections (Qwen2: q, k, v with a bias),
  a gated MLP, two RMSNorm weights.
* Qwen3: Llama's block plus an RMSNorm over each head's queries and keys (``head_dim``
  elements each), kept whole under tp and their gradients summed over it in every backward.
* GPT-NeoX: LayerNorms (weight and bias) before attention and before the MLP, one fused
  q|k|v projection (split by output rows, heads interleaved) and a dense output, both with a
  bias unless ``attention_bias`` is false, and a plain two-layer MLP with biases; a final
  LayerNorm and an untied head (``embed_out``) unless the config ties it.
* Mixtral, Qwen2-MoE, Qwen3-MoE: their attention (Qwen2's biases, Qwen3's q/k norms) and a
  routed MLP: a router (E x hidden), the E experts fused into two 3-D tensors (gate|up and
  down), and Qwen2-MoE's shared expert and its one-output gate; tp splits the attention only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.predict import TPBlock
from .fsdp_rows import Rows

# The families this module lays out, dense and routed.
DENSE = ("llama", "mistral", "qwen2", "qwen3", "gpt_neox")
ROUTED = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class Layout:
    """One block's parameter tensors, the embedding's, the rest's (final norm, an untied
    head), and the block's tensor-parallel collectives."""

    block: tuple[Rows, ...]
    embed: tuple[Rows, ...]
    rest: tuple[Rows, ...]
    tp_block: TPBlock


@dataclass(frozen=True)
class Dims:
    """What a config says of one block (its attention's widths, the MLP's or each expert's
    features) and of the ends."""

    hidden: int
    q: int            # query features: heads x head_dim
    kv: int           # key (and value) features: kv heads x head_dim
    head_dim: int
    ffn: int          # the dense MLP's features, or one routed expert's
    vocab: int
    tied: bool
    experts: int = 0  # routed experts per block (0: dense)
    shared_ffn: int = 0  # Qwen2-MoE's shared expert's features (0: none)
    attention_bias: bool = True  # GPT-NeoX's q|k|v and dense carry a bias (its default)


def _linear(d_out: int, d_in: int, split: int | None, bias: bool) -> tuple[Rows, ...]:
    """An ``nn.Linear``'s weight (out, in) and bias; a column-parallel layer (split 0) splits
    its bias with its rows, a row-parallel one (split 1) keeps it whole."""
    weight = Rows((d_out, d_in), split)
    return (weight, Rows((d_out,), 0 if split == 0 else None)) if bias else (weight,)


def layout(model_type: str, d: Dims) -> Layout | None:
    """The layout of ``model_type`` with dims ``d``, or None for a family not known here."""
    h = d.hidden
    rms = (Rows((h,)),)
    head = () if d.tied else (Rows((d.vocab, h), 0),)
    embed = (Rows((d.vocab, h), 0),)
    if model_type == "gpt_neox":
        ln = (Rows((h,)), Rows((h,)))
        bias = d.attention_bias
        block = (*ln, *ln, *_linear(3 * d.q, h, 0, bias), *_linear(h, d.q, 1, bias),
                 *_linear(d.ffn, h, 0, True), *_linear(h, d.ffn, 1, True))
        # plait's layer plan for GPT-NeoX splits q|k|v by whole heads (colwise: its bias with
        # it) and runs no norm on sequence shards
        return Layout(block, embed, (*ln, *head), TPBlock(forward=(h, h), backward=(h, h)))
    if model_type not in DENSE + ROUTED:
        return None
    qkv_bias = model_type in ("qwen2", "qwen2_moe")
    qk_norms = model_type in ("qwen3", "qwen3_moe")
    attention = (*_linear(d.q, h, 0, qkv_bias), *_linear(d.kv, h, 0, qkv_bias),
                 *_linear(d.kv, h, 0, qkv_bias), *_linear(h, d.q, 1, False),
                 *((Rows((d.head_dim,)), Rows((d.head_dim,))) if qk_norms else ()))
    summed = (d.head_dim, d.head_dim) if qk_norms else ()
    if model_type in DENSE:
        mlp = (*_linear(d.ffn, h, 0, False), *_linear(d.ffn, h, 0, False),
               *_linear(h, d.ffn, 1, False))
        # under SP the plans for Llama, Mistral and Qwen2 split the sequence at the first
        # block and gather it after the last; Qwen3's plan has no sequence-parallel layout
        # (plait refuses sp for it, as for GPT-NeoX and the routed families)
        tp = TPBlock(forward=(h, h), backward=(h, h), sp_norms=(h, h), summed=summed,
                     sp_in_blocks=model_type != "qwen3")
        return Layout((*attention, *mlp, *rms, *rms), embed, (*rms, *head), tp)
    e = d.experts
    experts = (Rows((e, 2 * d.ffn, h)), Rows((e, h, d.ffn)))
    router = (Rows((e, h)),)
    # Qwen3-MoE registers its experts before its router, the others after
    routed = (*experts, *router) if model_type == "qwen3_moe" else (*router, *experts)
    shared = (Rows((d.shared_ffn, h)), Rows((d.shared_ffn, h)), Rows((h, d.shared_ffn)),
              Rows((1, h))) if d.shared_ffn else ()
    # experts, router and shared expert whole on every tp rank: only attention's two
    # all-reduces per block
    tp = TPBlock(forward=(h,), backward=(h,), sp_norms=(h, h), summed=summed)
    return Layout((*attention, *routed, *shared, *rms, *rms), embed, (*rms, *head), tp)
