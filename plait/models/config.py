"""The reference transformer's shape (``TransformerConfig``) and its named presets.

Kept apart from ``plait.models.transformer`` because the planner prices a preset from these
numbers alone: ``plait plan --model llama-70b`` reads a config here without importing torch,
which only building the model (``plait.models.transformer.build``) needs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 256          # byte-level tokenizer by default: 256 symbols
    dim: int = 128                 # hidden size h
    n_layers: int = 4              # number of blocks
    n_heads: int = 4               # query heads
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention); None = n_heads
    ffn_dim: int | None = None     # MLP inner size; None = 4h (gelu) or ~8h/3 rounded (swiglu)
    max_seq_len: int = 128         # longest sequence the rotary table is built for
    mlp: str = "swiglu"            # "swiglu" (Llama) or "gelu" (GPT)
    norm: str = "rmsnorm"          # "rmsnorm" (Llama) or "layernorm" (GPT)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0           # residual dropout; 0 keeps runs bit-comparable
    tie_embeddings: bool = False   # share the embedding and head weights

    def __post_init__(self) -> None:
        errors = []
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                errors.append(f"{name}={getattr(self, name)} must be >= 1")
        if self.n_heads >= 1 and self.dim % self.n_heads:
            errors.append(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads >= 1 and self.n_heads % self.kv_heads:
            errors.append(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}")
        if self.mlp not in ("swiglu", "gelu"):
            errors.append(f"mlp={self.mlp!r} must be 'swiglu' or 'gelu'")
        if self.norm not in ("rmsnorm", "layernorm"):
            errors.append(f"norm={self.norm!r} must be 'rmsnorm' or 'layernorm'")
        if errors:
            raise ValueError("invalid TransformerConfig: " + "; ".join(errors))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        if self.mlp == "gelu":
            return 4 * self.dim
        # Llama: 2/3 of 4h, rounded up to a multiple of 64 so it splits evenly.
        return 64 * math.ceil(int(8 * self.dim / 3) / 64)

    def num_params(self, embeddings: bool = True) -> int:
        """Closed-form parameter count (matches ``sum(p.numel())`` of the built model)."""
        h, kv = self.dim, self.kv_heads * self.head_dim
        attn = h * h * 2 + h * kv * 2
        mlp = (3 if self.mlp == "swiglu" else 2) * h * self.hidden_dim
        norm_size = h if self.norm == "rmsnorm" else 2 * h
        if self.mlp == "gelu":  # GPT-style linears carry biases
            attn += 2 * h + 2 * kv
            mlp += self.hidden_dim + h
        block = attn + mlp + 2 * norm_size
        total = self.n_layers * block + norm_size
        if embeddings:
            total += self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return total

    def replace(self, **changes) -> TransformerConfig:
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, TransformerConfig] = {
    # Trains in seconds on one CPU core; the demo's model.
    "tiny": TransformerConfig(dim=128, n_layers=4, n_heads=4, max_seq_len=128),
    # Divisible by 2, 4 and 8 everywhere (heads, kv-heads, ffn, layers): the test model.
    "test": TransformerConfig(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=128,
                              max_seq_len=32),
    "small": TransformerConfig(dim=512, n_layers=8, n_heads=8, max_seq_len=256),
    "gpt2": TransformerConfig(vocab_size=50257, dim=768, n_layers=12, n_heads=12,
                              max_seq_len=1024, mlp="gelu", norm="layernorm",
                              tie_embeddings=True),
    "llama-1b": TransformerConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32,
                                  n_kv_heads=8, ffn_dim=8192, max_seq_len=4096),
    "llama-7b": TransformerConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32,
                                  ffn_dim=11008, max_seq_len=4096),
    "llama-8b": TransformerConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                                  n_kv_heads=8, ffn_dim=14336, max_seq_len=8192),
    "llama-13b": TransformerConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40,
                                   ffn_dim=13824, max_seq_len=4096),
    "llama-70b": TransformerConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64,
                                   n_kv_heads=8, ffn_dim=28672, max_seq_len=8192),
    # Narayanan et al. 2021 (Megatron-LM) GPT shapes: seq 2048, vocab 51,200; dropout 0.1, the
    # Megatron-LM defaults they trained with ("--hidden-dropout 0.1", "--attention-dropout
    # 0.1"; the paper prints no other), so the planner prices its masks.
    "gpt-145b": TransformerConfig(vocab_size=51200, dim=12288, n_layers=80, n_heads=96,
                                  max_seq_len=2048, mlp="gelu", norm="layernorm", dropout=0.1),
    "gpt-175b": TransformerConfig(vocab_size=51200, dim=12288, n_layers=96, n_heads=96,
                                  max_seq_len=2048, mlp="gelu", norm="layernorm", dropout=0.1),
}


def preset(name: str, **overrides) -> TransformerConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
