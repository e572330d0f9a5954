"""Workers for tests/test_context_parallel.py (spawned processes import them from here)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.parallel.context import ContextGroup, cp_attention, shard_sequence


def _qkv(seq: int, heads: int, kv_heads: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, seq, 8, generator=g)
    k = torch.randn(2, kv_heads, seq, 8, generator=g)
    v = torch.randn(2, kv_heads, seq, 8, generator=g)
    return [q, k, v]


def attention_matches(rank: int, world_size: int, seq: int) -> list[dict[str, Any]]:
    """For each case: the largest difference between this rank's attention output and
    gradients (q, k, v) under cp and its slice of one-device SDPA's on the same q/k/v."""
    cp = ContextGroup(dist.group.WORLD, rank, world_size)
    pos = cp.positions(seq)
    out = []
    cases = [("causal", 4, 4, dict(is_causal=True)),
             ("full", 4, 4, {}),
             ("gqa_causal", 4, 2, dict(is_causal=True, enable_gqa=True)),
             ("causal_scaled", 4, 4, dict(is_causal=True, scale=0.3))]
    for i, (name, heads, kv_heads, kwargs) in enumerate(cases):
        full = [t.requires_grad_() for t in _qkv(seq, heads, kv_heads, i)]
        weight = torch.randn(2, heads, seq, 8, generator=torch.Generator().manual_seed(99))
        ref = F.scaled_dot_product_attention(*full, **kwargs)
        (ref * weight).sum().backward()
        local = [shard_sequence(t.detach(), pos, dim=2).requires_grad_() for t in full]
        with cp_attention(cp, seq):
            got = F.scaled_dot_product_attention(*local, **kwargs)
            (got * shard_sequence(weight, pos, dim=2)).sum().backward()
        diffs = {"out": (got - shard_sequence(ref.detach(), pos, dim=2)).abs().max().item()}
        for label, a, b in zip("qkv", local, full, strict=True):
            diffs[label] = (a.grad - shard_sequence(b.grad, pos, dim=2)).abs().max().item()
        out.append({"case": name, **diffs,
                    "scale": ref.abs().max().item(), "restored":
                    F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention})
    return out


def attention_refusals(rank: int, world_size: int) -> list[str]:
    """The messages the cp attention raises for what it cannot compute."""
    cp = ContextGroup(dist.group.WORLD, rank, world_size)
    seq = 8
    q, k, v = (shard_sequence(t, cp.positions(seq), dim=2) for t in _qkv(seq, 2, 2, 0))
    messages = []
    for kwargs in (dict(attn_mask=torch.ones(4, 4, dtype=torch.bool)), dict(dropout_p=0.1)):
        try:
            with cp_attention(cp, seq):
                F.scaled_dot_product_attention(q, k, v, **kwargs)
        except ValueError as exc:
            messages.append(str(exc))
    try:
        cp.positions(6)
    except ValueError as exc:
        messages.append(str(exc))
    return messages
