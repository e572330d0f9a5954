"""Workers for tests/test_ledger_any_model.py: models that are not plait's reference
transformer, trained through plait's runtime with the ledger on (module-level so spawn can
import them).

Each model exercises one thing the ledger's closed form for any model must read off the laid-out
model rather than assume: a weight under two names, frozen parameters, sizes FSDP2 pads,
buffers DDP broadcasts, blocks in a container not called ``layers``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests._workers_semantics import seeded

VOCAB, WIDTH, SEQ, BATCH = 51, 16, 8, 4  # 51: FSDP2 pads the embedding's rows at dp_shard 2, 4
WARMUP, STEPS = 2, 2


class Block(nn.Module):
    """A residual block with a LoRA-like low-rank branch beside ``base``, a Linear with 7
    output features (FSDP2 pads it to 8 rows at dp_shard=2 or 4) and a buffer."""

    def __init__(self, width: int = WIDTH, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.lora_a = nn.Linear(width, rank, bias=False)
        self.lora_b = nn.Linear(rank, width, bias=False)
        self.odd = nn.Linear(width, 7)
        self.back = nn.Linear(7, width)
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.base(x) + self.lora_b(self.lora_a(x))
        return x + self.back(torch.tanh(self.odd(x))) * self.scale


class TiedLM(nn.Module):
    """Embedding and head one parameter under two names; the blocks in ``blocks``."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class LoraLM(nn.Module):
    """LoRA-like fine-tuning: the embedding, the first block and every block's ``base`` frozen,
    the other low-rank branches, odd-sized Linears and the (untied) head train; the blocks in
    ``stack``. The first block is an FSDP2 unit with nothing to reduce."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.stack = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.embed.requires_grad_(False)
        self.stack[0].requires_grad_(False)
        for block in self.stack:
            block.base.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.stack:
            h = block(h)
        return self.head(h)


tied_lm = partial(seeded, TiedLM)
lora_lm = partial(seeded, LoraLM)


def hf_gpt2() -> nn.Module:
    """Tiny GPT-2 (tied wte / lm_head, blocks in ``transformer.h``), built locally."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=WIDTH, n_layer=2, n_head=2, n_positions=SEQ,
                     bos_token_id=0, eos_token_id=0)
    return _Logits(GPT2LMHeadModel(cfg))


def hf_llama() -> nn.Module:
    """Tiny Llama (rotary ``inv_freq`` buffers, grouped kv heads), built locally."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=24,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0)
    return _Logits(LlamaForCausalLM(cfg))


class _Logits(nn.Module):
    """A transformers causal LM -> plain logits."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        # position_ids: the global positions of a rank's slice under context parallelism
        return self.hf(input_ids=tokens, position_ids=position_ids).logits


MODELS: dict[str, Callable[[], nn.Module]] = {
    "tied": tied_lm, "lora": lora_lm, "gpt2": hf_gpt2, "llama": hf_llama}


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def ledger_runs(rank: int, world_size: int, plan: str, models: list[str], *,
                table: dict[str, Callable[[], nn.Module]] | None = None, vocab: int = VOCAB,
                seq: int = SEQ, batch: int = BATCH, warmup: int = WARMUP, steps: int = STEPS
                ) -> dict[str, Any]:
    """Train each named model of ``table`` (default: this module's) for ``warmup + steps``
    steps of ``batch`` rows of ``seq`` token ids per micro-batch under ``plan`` with the ledger
    on (one ``plait.init`` each, in this process); per model ``run.summary()["comm"]`` and the
    global batch each step took. The optimizer is given every parameter, frozen ones included
    (as ``model.parameters()`` usually is): ZeRO-1 then broadcasts the frozen ones too."""
    from plait.runtime import init

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in models:
        run = init(plan, quiet=True, ledger=True, seed=0)
        run.ledger_warmup = warmup
        try:
            model = run.parallelize((table or MODELS)[name]())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(1000 + run.dp_rank)
            rows = batch * run.plan.grad_accum
            for _ in range(warmup + steps):
                tokens = torch.randint(0, vocab, (rows, seq), generator=g)
                run.step(model, (tokens, tokens.roll(-1, 1)), lm_loss, opt)
            out[name] = {"comm": run.summary()["comm"],
                         "global_batch": rows * run.plan.dp_replicate * run.plan.dp_shard}
            del model, opt
        finally:
            run.close()
    return out
