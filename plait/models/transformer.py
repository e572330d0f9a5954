"""A decoder-only reference transformer (Llama-style by default, GPT-style by option).

Why this shape: every parallelism in plait has to be shown on one model that is small enough to
train in seconds on a CPU and regular enough to be split any way. So:

* blocks live in ``model.layers`` (an ``nn.ModuleList``) and keep their names (``layers.3``) under
  every layout, so checkpoints, TP plans and pipeline stages address the same names everywhere;
* attention uses separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` linears and the MLP
  ``gate_proj``/``up_proj``/``down_proj``, so a TP plan is a short table of globs;
* attention reshapes with ``-1`` heads, so the same code runs on a TP shard holding ``heads/tp``;
* the embedding, final norm and head may be ``None`` (on pipeline stages that do not own them),
  and ``forward`` skips what is missing.

Presets go from ``tiny`` (trains on a laptop CPU) to 70B/175B shapes for planning, which are
built on the meta device (``build(cfg, device="meta")``) and never allocated.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import PRESETS, TransformerConfig, preset

__all__ = ["PRESETS", "Attention", "Block", "MLP", "Transformer", "TransformerConfig", "build",
           "lm_loss", "preset", "rotary"]


# ---------------------------------------------------------------------------------------------
def _norm(cfg: TransformerConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)


def rotary(x: torch.Tensor, theta: float, positions: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Rotary position embedding on ``x`` of shape (batch, seq, heads, head_dim).

    Computed on the fly rather than from a buffer: buffers complicate meta-device init, FSDP and
    pipeline splitting, and the table is cheap next to attention. ``positions`` ((batch, seq)
    or (seq,)): each token's position, 0..seq-1 when None; context parallelism gives a rank's
    slice of the sequence its global positions here.
    """
    seq, half = x.shape[1], x.shape[-1] // 2
    freqs = 1.0 / (theta ** (torch.arange(0, half, device=x.device, dtype=torch.float32) / half))
    if positions is None:
        positions = torch.arange(seq, device=x.device)
    angles = positions.to(x.device, torch.float32)[..., None] * freqs  # (..., seq, half)
    if angles.ndim == 2:
        angles = angles[None]
    cos = angles.cos()[:, :, None, :].to(x.dtype)
    sin = angles.sin()[:, :, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        bias = cfg.mlp == "gelu"
        kv_dim = cfg.kv_heads * cfg.head_dim
        # Stored for tensor parallelism, which reads them to split heads (or, with fewer kv
        # heads than tp, to keep k/v whole); the forward itself reshapes with -1 heads.
        self.head_dim, self.n_kv_heads = cfg.head_dim, cfg.kv_heads
        self.rope_theta = cfg.rope_theta if cfg.mlp == "swiglu" else None
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=bias)
        self.k_proj = nn.Linear(cfg.dim, kv_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.dim, kv_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=bias)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism this rank holds heads/tp of them.
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        if self.rope_theta is not None:
            q = rotary(q, self.rope_theta, position_ids)
            k = rotary(k, self.rope_theta, position_ids)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        bias = not self.swiglu
        if self.swiglu:
            self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=bias)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attention_norm = _norm(cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = _norm(cfg)
        self.feed_forward = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.attention_norm(x)
        h = self.attention(h) if position_ids is None else self.attention(h, position_ids)
        x = x + self.dropout(h)
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class Transformer(nn.Module):
    """tokens (batch, seq) int64 -> logits (batch, seq, vocab)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm: nn.Module | None = _norm(cfg)
        self.output: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    def init_weights(self, seed: int | None = None) -> None:
        """GPT-2 style init: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
        gen = None
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
        std_out = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            with torch.no_grad():
                if p.dim() == 1:
                    if name.endswith("bias"):
                        p.zero_()
                    else:
                        p.fill_(1.0)
                else:
                    std = std_out if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``position_ids`` (batch, seq): each token's position (0..seq-1 when None), which
        context parallelism sets to a slice's global positions."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers:
            h = layer(h) if position_ids is None else layer(h, position_ids)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def build(cfg: TransformerConfig | str, device: str | torch.device = "cpu",
          seed: int = 0) -> Transformer:
    """Build the reference model with deterministic weights (same seed, same model, any rank).

    ``device="meta"`` builds the shape only (for planning 70B models on a laptop).
    """
    if isinstance(cfg, str):
        cfg = preset(cfg)
    if str(device) == "meta":
        with torch.device("meta"):
            return Transformer(cfg)
    with torch.device("cpu"):
        model = Transformer(cfg)
    model.init_weights(seed)
    return model.to(device)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position (nats/token)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
