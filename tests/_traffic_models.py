"""Models written for the traffic tests (tests/test_traffic_own_models.py and
bench/traffic_own_models.py): each has blocks of a different make, so the tensor-parallel
collectives a block issues differ from plait's reference block (attention + MLP), and a worker
that trains one under a plan with the ledger on (module-level so spawned ranks import it).

* ``mlp_lm``: residual pre-norm MLP blocks, no attention (one TP region per block);
* ``attention_lm``: attention-only blocks, separate q/k/v/o projections (one region per block);
* ``gqa_lm``: attention (4 query heads, 2 kv heads: k and v a half the size of q) + MLP;
* ``mqa_lm``: the same with one kv head (at tp=2 the k/v projections stay whole on each rank);
* ``tied_lm``: MLP blocks, the head tied to the embedding (under pp on different stages);
* ``lora_lm``: MLP blocks whose linears are LoRA layers (frozen base, trainable low-rank side
  path), embedding frozen;
* ``odd_lm``: sizes FSDP2 pads under ZeRO-2/3 (dim 0 cut by ``torch.chunk`` and every shard
  padded to the first): a vocabulary of 51, blocks whose Linear has 7 outputs (a 7-row weight,
  a bias of 7) and a 1-D gain of 7;
* ``hf_gpt2``, ``hf_llama`` (2 kv heads of 4) of tests/_workers_ledger_any.py, and
  ``hf_gpt2_51``: tiny GPT-2 with a vocabulary of 51 (FSDP2 pads its tied embedding);
* frozen parameters beside a pipeline: ``lora_block``, tests/_workers_ledger_any.py's LoRA-like
  model (no layer plan: its blocks' outputs come from two linears; the embedding and the first
  block frozen, odd-sized linears), ``FrozenStageLM`` (the embedding and the first two of four
  blocks frozen: the whole first stage at pp=2) and ``FrozenTiedLM`` (the head tied to a frozen
  embedding);
* leading frozen blocks without a pipeline: ``FrozenLeadLM`` (the embedding and the first
  three of four attention + MLP blocks frozen), ``FrozenStageLM`` and ``hf_llama_frozen``
  (tiny Llama, its token embedding and first two layers frozen): the backward pass never
  reaches those blocks;
* blocks that differ in what trains: ``hf_llama_mid_norms`` (the second layer's norms frozen)
  and ``hf_llama_frozen_attention`` (the backward pass enters the second layer's MLP, never
  its attention); ``GainLeadLM``: a trainable gain on a frozen embedding's output, so the
  backward pass reaches the frozen blocks after it; ``ScaledLM``: a parameter of the root
  module, which every pipeline stage holds.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import _workers_ledger_any as any_model
from tests._workers_semantics import seeded

VOCAB, WIDTH, SEQ, BATCH = 32, 16, 8, 4
# the ledger's default warmup (plait.runtime): DDP rebuilds its buckets in step 2 and
# broadcasts the new order, a one-off the ledger leaves out
WARMUP, STEPS = 2, 2


class MLPBlock(nn.Module):
    """x + down(gelu(up(norm(x)))), biases on."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Attention(nn.Module):
    """Causal self-attention with ``n_kv_heads`` key/value heads shared by ``n_heads`` query
    heads (grouped-query attention where fewer)."""

    def __init__(self, width: int = WIDTH, n_heads: int = 4, n_kv_heads: int = 4) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        head_dim = width // n_heads
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, n_kv_heads * head_dim, bias=False)
        self.v = nn.Linear(width, n_kv_heads * head_dim, bias=False)
        self.o = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.n_heads, -1).transpose(1, 2)
        k = self.k(x).view(b, s, self.n_kv_heads, -1).transpose(1, 2)
        v = self.v(x).view(b, s, self.n_kv_heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class AttentionBlock(nn.Module):
    """x + attn(norm(x)), and where ``mlp`` an MLP block after it."""

    def __init__(self, width: int = WIDTH, n_kv_heads: int = 4, mlp: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = Attention(width, n_kv_heads=n_kv_heads)
        self.mlp = MLPBlock(width) if mlp else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x + self.attn(self.norm(x)))


class StackLM(nn.Module):
    """Embedding, ``depth`` blocks from ``block``, final norm, an untied head."""

    def __init__(self, block: Callable[[], nn.Module], depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(block() for _ in range(depth))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        # position_ids: taken (context parallelism gives each rank's slice its global
        # positions) and unused: the blocks have no positional encoding
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class LoraLinear(nn.Module):
    """base(x) + b(a(x)): a frozen linear and a trainable rank-``rank`` side path."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.a = nn.Linear(d_in, rank, bias=False)
        self.b = nn.Linear(rank, d_out, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


class LoraMLPBlock(MLPBlock):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__(width)
        self.up = LoraLinear(width, 4 * width)
        self.down = LoraLinear(4 * width, width)


class TiedLM(StackLM):
    def __init__(self) -> None:
        super().__init__(MLPBlock)
        self.head.weight = self.embed.weight


class LoraLM(StackLM):
    def __init__(self) -> None:
        super().__init__(LoraMLPBlock)
        self.embed.requires_grad_(False)


class FrozenStageLM(StackLM):
    """MLP blocks, the embedding and the first two of four blocks frozen: under pp=2 the whole
    first stage has nothing to train."""

    def __init__(self) -> None:
        super().__init__(MLPBlock)
        self.embed.requires_grad_(False)
        for block in self.blocks[:2]:
            block.requires_grad_(False)


class FrozenLeadLM(StackLM):
    """Attention + MLP blocks (2 kv heads of 4), the embedding and the first three of four
    blocks frozen: the backward pass reaches the last block only, so the first three issue no
    backward collective over tp, and under ZeRO-3 FSDP2 gathers only the third of them again
    (the fourth's pre-backward hook prefetches it)."""

    def __init__(self) -> None:
        super().__init__(partial(AttentionBlock, n_kv_heads=2, mlp=True))
        self.embed.requires_grad_(False)
        for block in self.blocks[:3]:
            block.requires_grad_(False)


class FrozenTiedLM(TiedLM):
    """The head tied to a frozen embedding: under pp the last stage holds a frozen copy."""

    def __init__(self) -> None:
        super().__init__()
        self.embed.requires_grad_(False)


ODD_VOCAB = 51  # FSDP2 pads it to 52 rows at dp_shard 2 and 4


class OddBlock(nn.Module):
    """x + back(gain * gelu(odd(norm(x)))): ``odd`` has 7 outputs (a 7-row weight and a bias
    of 7), ``gain`` is a 1-D parameter of 7; none of them divides dp_shard 2 or 4."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.odd = nn.Linear(width, 7)
        self.gain = nn.Parameter(torch.ones(7))
        self.back = nn.Linear(7, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.back(self.gain * F.gelu(self.odd(self.norm(x))))


class OddLM(nn.Module):
    """Embedding and untied head over a vocabulary of 51, four ``OddBlock``s."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(ODD_VOCAB, WIDTH)
        self.blocks = nn.ModuleList(OddBlock() for _ in range(4))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, ODD_VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def hf_llama() -> nn.Module:
    """Tiny Llama, 4 query heads sharing 2 kv heads, built locally."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=32,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0)
    return any_model._Logits(LlamaForCausalLM(cfg))


def hf_llama_frozen() -> nn.Module:
    """``hf_llama`` fine-tuned from its third layer on: the token embedding and the first two
    of four decoder layers frozen (the head, final norm and last two layers train)."""
    model = hf_llama()
    inner = model.hf.model
    inner.embed_tokens.requires_grad_(False)
    for layer in inner.layers[:2]:
        layer.requires_grad_(False)
    return model


def hf_llama_mid_norms() -> nn.Module:
    """``hf_llama`` with both RMSNorms of its second decoder layer frozen (everything else
    trains): under SP each layer sums its own trainable norms' gradients over tp, two in the
    others, none in that one."""
    model = hf_llama()
    layer = model.hf.model.layers[1]
    layer.input_layernorm.requires_grad_(False)
    layer.post_attention_layernorm.requires_grad_(False)
    return model


def hf_llama_frozen_attention() -> nn.Module:
    """``hf_llama`` with its token embedding and first decoder layer frozen, and in the second
    layer the attention and the norm before it: the backward pass enters that layer's MLP but
    never its attention, whose input (a frozen norm of a frozen stream) needs no gradient."""
    model = hf_llama()
    inner = model.hf.model
    inner.embed_tokens.requires_grad_(False)
    inner.layers[0].requires_grad_(False)
    inner.layers[1].input_layernorm.requires_grad_(False)
    inner.layers[1].self_attn.requires_grad_(False)
    return model


class GainLeadLM(StackLM):
    """Attention + MLP blocks (2 kv heads of 4), the embedding and the first two blocks frozen,
    and a trainable gain on the embedding's output: the first block's input needs a gradient
    although no embedding trains, so the backward pass reaches every block."""

    def __init__(self) -> None:
        super().__init__(partial(AttentionBlock, n_kv_heads=2, mlp=True))
        self.embed.requires_grad_(False)
        for block in self.blocks[:2]:
            block.requires_grad_(False)
        self.gain = nn.Parameter(torch.ones(WIDTH))

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        h = self.embed(tokens) * self.gain
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class ScaledLM(StackLM):
    """MLP blocks and a parameter on the root module, a gain on the final norm's output:
    every pipeline stage keeps it, and its gradient is summed over the stages like a tied
    weight's."""

    def __init__(self) -> None:
        super().__init__(MLPBlock)
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h) * self.scale)


def hf_gpt2() -> nn.Module:
    """Tiny GPT-2 (tied wte / lm_head, Conv1D linears with biases), built locally."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=WIDTH, n_layer=4, n_head=2, n_positions=SEQ,
                     bos_token_id=0, eos_token_id=0)
    return any_model._Logits(GPT2LMHeadModel(cfg))


def hf_gpt2_51() -> nn.Module:
    """Tiny GPT-2 as ``hf_gpt2`` with a vocabulary of 51 (tied wte / lm_head: 51 rows)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=ODD_VOCAB, n_embd=WIDTH, n_layer=4, n_head=2, n_positions=SEQ,
                     bos_token_id=0, eos_token_id=0)
    return any_model._Logits(GPT2LMHeadModel(cfg))


# Tiny transformers decoders of the families ``plait plan --model config.json`` lays out tensor
# by tensor (plait.planner.hf_layout), as (config class, model class, sizes): the planner
# prices them from their config.json alone, the ledger measures the built model.
HF_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # parallel attention, LayerNorms with biases, fused q|k|v with a bias, untied embed_out
    "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        tie_word_embeddings=False)),
    # an RMSNorm over each head's queries and keys (4 features each)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=WIDTH, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, tie_word_embeddings=False)),
    # 4 experts, 2 per token: router and fused experts, kept whole under tp
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=WIDTH, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False)),
    # a shared expert and its gate beside 4 routed ones; q, k, v with biases
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        hidden_size=WIDTH, intermediate_size=32, moe_intermediate_size=8,
        shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False)),
    # Llama with its head tied to the embedding (beside a pipeline: on the first and last stage)
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=WIDTH, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True)),
}


def hf_config(name: str) -> Any:
    """The transformers config of ``HF_CONFIGS[name]``."""
    import transformers

    config_cls, _, sizes = HF_CONFIGS[name]
    return getattr(transformers, config_cls)(vocab_size=VOCAB, max_position_embeddings=SEQ,
                                             bos_token_id=0, eos_token_id=0, **sizes)


def hf_from_config(name: str) -> nn.Module:
    """The model ``HF_CONFIGS[name]`` describes, built locally."""
    import transformers

    torch.manual_seed(0)
    return any_model._Logits(getattr(transformers, HF_CONFIGS[name][1])(hf_config(name)))


# plait's reference transformer from a preset: a tied head (beside a pipeline on the first and
# last stage), and GPT-style LayerNorms (weight and bias) with biased linears
PRESET_OVERRIDES: dict[str, dict[str, Any]] = {
    "tied": dict(tie_embeddings=True),
    "ln_tied": dict(mlp="gelu", norm="layernorm", tie_embeddings=True)}


def preset_config(name: str) -> Any:
    """The ``TransformerConfig`` of ``PRESET_OVERRIDES[name]`` at this module's sizes."""
    from plait.models.transformer import preset

    return preset("test", vocab_size=VOCAB, dim=WIDTH, n_heads=4, n_kv_heads=2, ffn_dim=32,
                  max_seq_len=SEQ, **PRESET_OVERRIDES[name])


def preset_model(name: str) -> nn.Module:
    from plait.models.transformer import Transformer

    torch.manual_seed(0)
    return Transformer(preset_config(name))


def config_rows(name: str, plan: str, global_batch: int
                ) -> dict[tuple[str, str], tuple[float, float]]:
    """:func:`planner_rows` for a model of ``HF_CONFIGS`` (``hf_<name>``) or
    ``PRESET_OVERRIDES`` (``preset_<name>``), priced from its config alone, as ``plait plan
    --model config.json`` (or a preset) prices it: the model is never built."""
    import json

    from plait.planner.model_stats import from_hf_config, from_transformer_config

    kind, _, which = name.partition("_")
    if kind == "hf":
        stats = from_hf_config(json.loads(hf_config(which).to_json_string()), name=name)
    else:
        stats = from_transformer_config(preset_config(which), name=name)
    return busiest_rows(stats, plan, global_batch)


mlp_lm = partial(seeded, partial(StackLM, MLPBlock))
attention_lm = partial(seeded, partial(StackLM, AttentionBlock))
gqa_lm = partial(seeded, partial(StackLM, partial(AttentionBlock, n_kv_heads=2, mlp=True)))
mqa_lm = partial(seeded, partial(StackLM, partial(AttentionBlock, n_kv_heads=1, mlp=True)))

MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": mlp_lm, "attention": attention_lm, "gqa": gqa_lm, "mqa": mqa_lm,
    "tied": partial(seeded, TiedLM), "lora": partial(seeded, LoraLM), "gpt2": hf_gpt2,
    "llama": hf_llama, "odd": partial(seeded, OddLM), "gpt2_51": hf_gpt2_51,
    "lora_block": any_model.lora_lm, "frozen_stage": partial(seeded, FrozenStageLM),
    "frozen_tied": partial(seeded, FrozenTiedLM), "frozen_lead": partial(seeded, FrozenLeadLM),
    "llama_frozen": hf_llama_frozen, "llama_mid_norms": hf_llama_mid_norms,
    "llama_frozen_attention": hf_llama_frozen_attention, "scaled": partial(seeded, ScaledLM),
    "gain_lead": partial(seeded, GainLeadLM),
    **{f"hf_{name}": partial(hf_from_config, name) for name in HF_CONFIGS},
    **{f"preset_{name}": partial(preset_model, name) for name in PRESET_OVERRIDES}}


def ledger_rows(rank: int, world_size: int, plan: str, models: list[str]) -> dict[str, Any]:
    """Train each named model of this module WARMUP + STEPS steps under ``plan`` with the ledger
    on; per model the ledger's rows (``run.summary()["comm"]``) and the global batch each step
    took (tests/_workers_ledger_any.py's loop, with this module's models and sizes)."""
    return any_model.ledger_runs(rank, world_size, plan, models, table=MODELS, vocab=VOCAB,
                                 seq=SEQ, batch=BATCH, warmup=WARMUP, steps=STEPS)


def measured_rows(comm: dict[str, Any]) -> dict[tuple[str, str], tuple[float, float]]:
    """The ledger's rows as {(axis, op): (bytes, calls)} per step of the busiest rank."""
    return {(r["axis"], r["op"]): (r["payload_bytes"], r["count"])
            for r in comm["rows"] if r["ranks"]}


def planner_rows(name: str, plan: str, global_batch: int
                 ) -> dict[tuple[str, str], tuple[float, float]]:
    """The planner's traffic for model ``name`` under ``plan`` as the ledger's rows show it:
    {(axis, op): (bytes, calls)} per optimizer step of the busiest rank of each row. The
    model's stats are read as ``plait plan --model pkg.mod:factory --plan <plan>`` reads them,
    ``evaluate`` prices them, and its ``traffic`` (the busiest rank by time, what ``plait
    plan`` shows) must be one pipeline rank's of ``rank_traffic``; ranks hold different stages,
    so a row's busiest rank can be another one (the first stage's data-parallel gradients
    where its embeddings outweigh the last stage's head)."""
    from plait.planner.model_stats import load_model

    with torch.device("meta"):  # as plait plan builds a factory's model
        stats = load_model(MODELS[name]())
    return busiest_rows(stats, plan, global_batch)


def busiest_rows(stats: Any, plan: str, global_batch: int
                 ) -> dict[tuple[str, str], tuple[float, float]]:
    """:func:`planner_rows` for the model ``stats`` describes (``load_model``)."""
    from plait.plan import Plan
    from plait.planner import constants_for
    from plait.planner.cost import Workload, evaluate, rank_traffic
    from plait.planner.hardware import load_cluster

    p, name = Plan.from_string(plan), stats.name
    cluster = load_cluster("cpu", devices=p.world_size)
    est = evaluate(p, stats, cluster, Workload(global_batch, SEQ), constants_for(cluster))
    per_rank = rank_traffic(p, stats, global_batch, SEQ)
    if not est.traffic or not per_rank:
        raise ValueError(f"the planner prices no traffic for {name} under {plan}: {est.reason}")
    rows = [_rows(traffic) for traffic in per_rank]
    if _rows(est.traffic) != rows[est.busiest_rank]:
        raise AssertionError(f"evaluate's traffic for {name} under {plan} is not its busiest "
                             f"rank's ({est.busiest_rank}) of rank_traffic")
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for mine in rows:
        for key, value in mine.items():
            out[key] = max(out.get(key, value), value)
    return out


def _rows(traffic: list[Any]) -> dict[tuple[str, str], tuple[float, float]]:
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for t in traffic:
        b, c = out.get((t.axis, t.op), (0.0, 0.0))
        out[(t.axis, t.op)] = (b + t.payload, c + t.calls)
    return out
