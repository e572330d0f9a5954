"""Mixture-of-experts models written for the layout tests: a Mixtral-like LM (a stack of
pre-norm blocks, each with causal attention and a routed top-2 MoE whose tokens are dispatched
by index and summed back with ``index_add_``), the same model adding a load-balancing loss to
its output, and a tiny Hugging Face MoE built from a config. Spawned ranks import this module."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests._workers_ledger_any import _Logits

VOCAB, WIDTH, SEQ, BATCH, EXPERTS, TOP_K, DEPTH = 24, 16, 8, 8, 4, 2, 4
AUX_WEIGHT = 0.1  # large enough that the balance loss moves the routers visibly


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v, o projections."""

    def __init__(self, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).flatten(2))


class Expert(nn.Module):
    """A SwiGLU MLP, as Mixtral's experts are."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(WIDTH, 2 * WIDTH)
        self.w2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RoutedMoE(nn.Module):
    """Top-k routing over a ModuleList of experts: each token goes to the k experts its router
    scores highest, weighted by their renormalised softmax; an expert's tokens are gathered by
    index and its outputs summed back with ``index_add_``. Keeps the step's balance loss
    (Switch Transformer's: experts times the sum over experts of the fraction of tokens routed
    there times the mean router probability) in ``self.balance``."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = TOP_K
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.balance: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(-1)
        weight, pick = probs.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(pick == e)
            out = out.index_add(0, token, weight[token, slot, None] * expert(flat[token]))
        routed = F.one_hot(pick, EXPERTS).sum(1).float().mean(0) / self.top_k
        self.balance = EXPERTS * (routed * probs.mean(0)).sum()
        return out.reshape(x.shape)


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.moe = RoutedMoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MixtralLike(nn.Module):
    """Embedding, a stack of attention + routed MoE blocks, final norm, head. With
    ``aux=True`` the forward returns ``(logits, balance)``, the balance loss summed over every
    block, which :func:`aux_loss` adds to the cross-entropy (as Mixtral's training adds its
    router loss)."""

    def __init__(self, aux: bool = False) -> None:
        super().__init__()
        self.aux = aux
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> Any:
        h = self.tok(input_ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        if not self.aux:
            return logits
        return logits, sum(block.moe.balance for block in self.blocks)


class GuardedBalance(MixtralLike):
    """The balance loss gathered as many training scripts do: skipping a block with none
    (``if ... is not None``), or walking ``self.modules()``. Under a pipeline neither fails on
    the stand-ins of other stages' blocks; each would sum the last stage's blocks only."""

    def __init__(self, walk: bool) -> None:
        super().__init__(aux=True)
        self.walk = walk

    def forward(self, input_ids: torch.Tensor) -> Any:
        h = self.tok(input_ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        if self.walk:
            return logits, sum(m.balance for m in self.modules() if isinstance(m, RoutedMoE))
        return logits, sum(b.moe.balance for b in self.blocks if b.moe.balance is not None)


def guarded_balance(walk: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return GuardedBalance(walk)


def _seeded(aux: bool) -> nn.Module:
    torch.manual_seed(0)
    return MixtralLike(aux)


mixtral_like = partial(_seeded, False)
mixtral_like_aux = partial(_seeded, True)
guarded_balance_walk = partial(guarded_balance, True)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def aux_loss(out: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    logits, balance = out
    return lm_loss(logits, labels) + AUX_WEIGHT * balance


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def hf_qwen2_moe() -> nn.Module:
    """Qwen2-MoE: routed top-2 experts plus a gated shared expert in every layer."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=32, shared_expert_intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
                         decoder_sparse_step=1, mlp_only_layers=[])
    return _Logits(Qwen2MoeForCausalLM(cfg))


def hf_mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16)
    return _Logits(MixtralForCausalLM(cfg))


def hf_mixtral_router_loss() -> nn.Module:
    """Mixtral returning its own loss with the router's balance loss added
    (``output_router_logits``), over the router logits of every layer."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
                        output_router_logits=True, router_aux_loss_coef=0.5)
    return MixtralForCausalLM(cfg)


def dict_batch(step: int) -> dict[str, torch.Tensor]:
    tokens, _ = batch(step)
    return {"input_ids": tokens, "labels": tokens.clone()}


def planner_factory() -> tuple[nn.Module, list, Any]:
    """(model, dataset, loss_fn) for ``plait plan --model tests._moe_models:planner_factory``."""
    rows = [batch(s) for s in range(4)]
    data = [(x[i], y[i]) for x, y in rows for i in range(BATCH)]
    return mixtral_like(), data, lm_loss


def planner_factory_aux() -> tuple[nn.Module, list, Any]:
    model, data, _ = planner_factory()
    return mixtral_like_aux(), data, aux_loss


def last_stage_forward(rank: int, world_size: int) -> None:
    """The last pipeline stage of the Mixtral-like LM with its balance loss, run on hidden
    states: the forward's sum over every block's balance loss fails after the stage's blocks
    (the earlier stages end their forward at the next stage's first block)."""
    from plait.parallel.pipeline_split import build_stage_module, plan_stages
    from plait.plan import Plan

    model = mixtral_like_aux()
    path, specs = plan_stages(model, Plan(pp=2, microbatches=2))
    build_stage_module(model, path, specs[-1])(torch.randn(BATCH, SEQ, WIDTH))
