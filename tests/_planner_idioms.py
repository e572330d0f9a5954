"""Small models written the way users write them, for tests/test_planner_idioms.py and
bench/planner_idioms.py: what the planner prices of a block (forward FLOPs, bytes saved for
backward) against what torch counts when the block runs.

Every model is a token embedding (or a convolution stem), a ``ModuleList`` of blocks, a final
norm and a head. Their idioms: activations called as functions (``F.gelu``, ``F.silu``,
``torch.tanh``, ``x * torch.sigmoid(x)``), a SwiGLU ``F.silu(self.w1(x)) * self.w3(x)``, a
Python RMSNorm (its statistics in fp32 under autocast), rotary embeddings applied in the
forward, an ALiBi bias added to the scores, a ViT's patchify ``Conv2d``, a head tied to the
embedding, dropout on the attention probabilities, a gated MLP with biases, and layers whose
forward takes the rotary tables and the float causal mask their model makes. Attention is
written as matmuls and a softmax, so its scores are saved and counted as the planner prices
them without flash attention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, HEADS, FFN, LAYERS = 64, 32, 4, 96, 3


class RMSNorm(nn.Module):
    """Llama's RMSNorm as users copy it: statistics in fp32, the weight's multiply in the
    input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Causal multi-head attention as matmuls and a softmax; ``rotary``: rotary embeddings
    applied to q and k in the forward; ``alibi``: ALiBi's per-head linear bias added to the
    scores; ``dropout``: dropout on the attention probabilities; ``sdpa``: torch's
    ``F.scaled_dot_product_attention`` in place of the matmuls (flash on a CPU: no scores
    saved)."""

    def __init__(self, rotary: bool = False, alibi: bool = False, dropout: float = 0.0,
                 bias: bool = False, sdpa: bool = False) -> None:
        super().__init__()
        self.sdpa = sdpa
        self.n_heads, self.head_dim = HEADS, WIDTH // HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH, bias=bias) for _ in range(4))
        self.rotary, self.alibi = rotary, alibi
        self.drop = nn.Dropout(dropout)
        if rotary:
            inv = 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
            self.register_buffer("inv_freq", inv, persistent=False)
        if alibi:
            slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / HEADS) for i in range(HEADS)])
            self.register_buffer("slopes", slopes, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        if self.rotary:
            t = torch.arange(s, device=x.device, dtype=self.inv_freq.dtype)
            freqs = torch.outer(t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(out.transpose(1, 2).reshape(b, s, WIDTH))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        pos = torch.arange(s, device=x.device)
        if self.alibi:
            distance = (pos[None, :] - pos[:, None]).to(scores.dtype)
            scores = scores + self.slopes[:, None, None] * distance
        causal = pos[None, :] > pos[:, None]
        scores = scores.masked_fill(causal, float("-inf"))
        probs = self.drop(torch.softmax(scores, dim=-1))
        out = (probs @ v).transpose(1, 2).reshape(b, s, WIDTH)
        return self.o(out)


class FunctionalMLP(nn.Module):
    """fc2(act(fc1(x))) with the activation called as a function."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor], bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, FFN, bias=bias)
        self.fc2 = nn.Linear(FFN, WIDTH, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SwiGLU(nn.Module):
    """Llama's feed-forward: w2(F.silu(w1(x)) * w3(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(WIDTH, FFN, bias=False)
        self.w2 = nn.Linear(FFN, WIDTH, bias=False)
        self.w3 = nn.Linear(WIDTH, FFN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GatedBiasMLP(nn.Module):
    """A GEGLU with biases, no experts: down(F.gelu(gate(x)) * up(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, FFN)
        self.up = nn.Linear(WIDTH, FFN)
        self.down = nn.Linear(FFN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, attn: nn.Module, mlp: nn.Module,
                 norm: Callable[[], nn.Module] = lambda: nn.LayerNorm(WIDTH)) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = norm(), attn, norm(), mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    """Token embedding, blocks, final norm, head (``tied``: the embedding's weight)."""

    def __init__(self, make: Callable[[], Block], tied: bool = False,
                 norm: Callable[[], nn.Module] = lambda: nn.LayerNorm(WIDTH)) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(make() for _ in range(LAYERS))
        self.norm = norm()
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class ViT(nn.Module):
    """A ViT: a patchify Conv2d stem, a learned position table, blocks, mean pooling and a
    classifier."""

    def __init__(self, image: int = 16, patch: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, WIDTH, kernel_size=patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, 4 * (image // patch) ** 2, WIDTH))
        self.blocks = nn.ModuleList(
            Block(Attention(bias=True), FunctionalMLP(F.gelu)) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images).flatten(2).transpose(1, 2)
        x = x + self.pos[:, :x.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


class ArgsAttention(nn.Module):
    """Matmul attention given the rotary ``(cos, sin)`` tables and an additive float causal
    mask by its caller."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))

    def forward(self, h: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor) -> torch.Tensor:
        cos, sin = position_embeddings
        b, s, _ = h.shape
        q, k, v = (f(h).view(b, s, HEADS, WIDTH // HEADS).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        scores = q @ k.transpose(-1, -2) / math.sqrt(WIDTH // HEADS) + attention_mask
        out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, WIDTH)
        return self.o(out)


class ArgsBlock(nn.Module):
    """A decoder layer written as transformers writes one: its forward takes the rotary
    tables and the additive float causal mask the model makes once for every layer (the mask
    in the residual's dtype, fp32 under autocast: the softmax runs in fp32); Python RMSNorms,
    a SwiGLU."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = RMSNorm(WIDTH), ArgsAttention()
        self.norm2, self.mlp = RMSNorm(WIDTH), SwiGLU()

    def forward(self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), position_embeddings, attention_mask)
        return x + self.mlp(self.norm2(x))


class ArgsLM(nn.Module):
    """Token embedding, :class:`ArgsBlock` layers given the tables and mask the model makes
    from the sequence length, final norm, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(ArgsBlock() for _ in range(LAYERS))
        self.norm = RMSNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        dim = WIDTH // HEADS
        inv = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        s = input_ids.shape[1]
        freqs = torch.outer(torch.arange(s, dtype=self.inv_freq.dtype), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        tables = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        mask = torch.full((s, s), float("-inf"), dtype=x.dtype).triu(1)
        for block in self.blocks:
            x = block(x, tables, mask)
        return self.head(self.norm(x))


class CrossAttention(nn.Module):
    """Matmul attention of this stack's queries over another stack's ``memory`` (an
    encoder's output): keys and values projected from it, no mask."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.head_dim = HEADS, WIDTH // HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        b, t, s = x.shape[0], x.shape[1], memory.shape[1]
        q = self.q(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k(memory).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v(memory).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, -1)
        return self.o(out)


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention, cross-attention over the encoder's output handed to
    every block, and a GELU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.norm_c, self.cross = nn.LayerNorm(WIDTH), CrossAttention()
        self.norm2, self.mlp = nn.LayerNorm(WIDTH), FunctionalMLP(F.gelu)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        x = x + self.cross(self.norm_c(x), memory)
        return x + self.mlp(self.norm2(x))


class EncDec(nn.Module):
    """An encoder-decoder written by hand: a shared token embedding, an encoder stack of
    :class:`Block` (causal, as the module is), its final norm, a decoder stack of
    :class:`DecoderBlock` reading the encoder's output, a final norm and a head; its forward
    takes the source and the target ids."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.encoder = nn.ModuleList(Block(Attention(), FunctionalMLP(F.gelu))
                                     for _ in range(LAYERS))
        self.enc_norm = nn.LayerNorm(WIDTH)
        self.blocks = nn.ModuleList(DecoderBlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor
                ) -> torch.Tensor:
        memory = self.embed(input_ids)
        for block in self.encoder:
            memory = block(memory)
        memory = self.enc_norm(memory)
        x = self.embed(decoder_input_ids)
        for layer in self.blocks:
            x = layer(x, memory)
        return self.head(self.norm(x))


def _swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def gelu_mlp() -> nn.Module:
    return LM(lambda: Block(Attention(), FunctionalMLP(F.gelu)))


def silu_mlp() -> nn.Module:
    return LM(lambda: Block(Attention(), FunctionalMLP(F.silu)))


def tanh_mlp() -> nn.Module:
    return LM(lambda: Block(Attention(), FunctionalMLP(torch.tanh)))


def swiglu() -> nn.Module:
    return LM(lambda: Block(Attention(), SwiGLU(), norm=lambda: nn.RMSNorm(WIDTH)),
              norm=lambda: nn.RMSNorm(WIDTH))


def python_rmsnorm() -> nn.Module:
    """Llama written by hand: Python RMSNorm, rotary embeddings, SwiGLU."""
    return LM(lambda: Block(Attention(rotary=True), SwiGLU(), norm=lambda: RMSNorm(WIDTH)),
              norm=lambda: RMSNorm(WIDTH))


def rotary() -> nn.Module:
    return LM(lambda: Block(Attention(rotary=True), FunctionalMLP(F.gelu)))


def alibi() -> nn.Module:
    return LM(lambda: Block(Attention(alibi=True), FunctionalMLP(F.gelu)))


def vit() -> nn.Module:
    return ViT()


def tied_swish() -> nn.Module:
    """A head tied to the embedding; the MLP's activation a Python swish."""
    return LM(lambda: Block(Attention(), FunctionalMLP(_swish)), tied=True)


def prob_dropout() -> nn.Module:
    """Dropout (p=0.1) on the attention probabilities only."""
    return LM(lambda: Block(Attention(dropout=0.1), FunctionalMLP(F.gelu)))


def gated_bias() -> nn.Module:
    return LM(lambda: Block(Attention(bias=True), GatedBiasMLP()))


def sdpa() -> nn.Module:
    """A Llama-style block (torch's RMSNorm, SwiGLU) whose attention is
    ``F.scaled_dot_product_attention``."""
    return LM(lambda: Block(Attention(sdpa=True), SwiGLU(), norm=lambda: nn.RMSNorm(WIDTH)),
              norm=lambda: nn.RMSNorm(WIDTH))


def model_args() -> nn.Module:
    """Layers that take the rotary tables and the mask their model makes."""
    return ArgsLM()


def enc_dec() -> nn.Module:
    """An encoder-decoder whose decoder blocks read the encoder's output."""
    return EncDec()


# name -> (factory, whether the model reads images rather than token ids)
MODELS: dict[str, tuple[Callable[[], nn.Module], bool]] = {
    "gelu_mlp": (gelu_mlp, False),
    "silu_mlp": (silu_mlp, False),
    "tanh_mlp": (tanh_mlp, False),
    "swiglu": (swiglu, False),
    "python_rmsnorm": (python_rmsnorm, False),
    "rotary": (rotary, False),
    "alibi": (alibi, False),
    "vit": (vit, True),
    "tied_swish": (tied_swish, False),
    "prob_dropout": (prob_dropout, False),
    "gated_bias": (gated_bias, False),
    "sdpa": (sdpa, False),
    "model_args": (model_args, False),
    "enc_dec": (enc_dec, False),
}


def batch(name: str, rows: int, seq: int, seed: int = 0) -> Any:
    """An input of ``rows`` samples for model ``name``: token ids of ``seq`` tokens (an
    encoder-decoder's: a tuple of source and target ids, ``seq`` tokens each), or images of
    ``seq`` patches (a square of 4x4 patches per ``seq`` of 16)."""
    g = torch.Generator().manual_seed(seed)
    if MODELS[name][1]:
        side = int(math.isqrt(seq)) * 4
        return torch.randn(rows, 3, side, side, generator=g)
    if name == "enc_dec":
        return (torch.randint(0, VOCAB, (rows, seq), generator=g),
                torch.randint(0, VOCAB, (rows, seq), generator=g))
    return torch.randint(0, VOCAB, (rows, seq), generator=g)


def run(model: nn.Module, x: Any) -> Any:
    """``model``'s forward on an input of :func:`batch` (a tuple: its arguments)."""
    return model(*x) if isinstance(x, tuple) else model(x)


def flop_counter() -> object:
    """``FlopCounterMode`` counting CPU's flash attention too (torch counts the CUDA kernels'
    only), by torch's own formula for scaled dot-product attention (the full seq x seq
    square, as the planner counts it)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def cpu_flash(query: torch.Size, key: torch.Size, value: torch.Size, *_: object,
                  **__: object) -> int:
        return int(sdpa_flop_count(query, key, value))

    return FlopCounterMode(display=False, custom_mapping={
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash})


def measured_block(model: nn.Module, x: Any, block: str, bf16: bool = False,
                   side: bool = False) -> tuple[int, int]:
    """(forward FLOPs :func:`flop_counter` counts in ``block``, bytes of the distinct storages
    that are not parameters which ``saved_tensors_hooks`` sees ``block``'s forward save), in
    one training-mode forward of ``model`` on ``x`` (under CPU bf16 autocast with ``bf16``).
    With ``side`` (a block whose cross-attention reads another stack's output), the storage of
    a tensor the block is handed besides its first that is as wide as it (that output, which
    every block of the stack reads: one tensor, priced once beside the blocks) is left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    inside: list[bool] = []
    counter: Any = flop_counter()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if inside and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def enter(_m: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if side and tensors:
            params.update(t.untyped_storage().data_ptr() for t in tensors[1:]
                          if t.dim() >= 2 and t.shape[-1] == tensors[0].shape[-1])
        inside.append(True)
        counter.__enter__()

    def leave(*_: object) -> None:
        counter.__exit__(None, None, None)
        inside.pop()

    target = model.get_submodule(block)
    handles = [target.register_forward_pre_hook(enter, with_kwargs=True),
               target.register_forward_hook(leave)]
    model.train()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(model, x)
    finally:
        for h in handles:
            h.remove()
    return counter.get_total_flops(), sum(saved.values())
