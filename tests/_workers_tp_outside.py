"""Models and a worker for tests/test_planner_tp_outside.py: what each tensor-parallel rank
runs outside the blocks, counted while it runs, beside what the planner prices per rank.

``PatchViT``: a patchify ``Conv2d`` stem and a learned position table, blocks, a mean-pooled
classifier (nothing outside the blocks is split by tp). ``ProjectedLM``: a token embedding, a
``Linear`` projection of it before the blocks (not split), blocks, a final norm and a head
over the vocabulary tied by shape to the embedding (split by tp: ``vocab_head``).
``BiasedLM``: a language model whose head the plan leaves whole (a logits bias beside it)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, HEADS, FFN, VOCAB, LAYERS, PATCH, CLASSES = 32, 4, 64, 64, 2, 4, 10


class Attention(nn.Module):
    """Causal multi-head attention as matmuls, its heads' count held on the module (tp divides
    it) and its widths read as -1."""

    def __init__(self, width: int = WIDTH, heads: int = HEADS) -> None:
        super().__init__()
        self.n_heads, self.head_dim = heads, width // heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        return self.o((probs @ v).transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    """Pre-norm attention and a GELU MLP."""

    def __init__(self, width: int = WIDTH, heads: int = HEADS, ffn: int = FFN) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, ffn), nn.Linear(ffn, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PatchViT(nn.Module):
    """A ViT: its images cut into ``patch`` x ``patch`` patches by a ``Conv2d``, a learned
    position table, blocks, a classifier on the mean-pooled token."""

    def __init__(self, image: int = 16, patch: int = PATCH, width: int = WIDTH,
                 heads: int = HEADS, ffn: int = FFN, layers: int = LAYERS,
                 classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, kernel_size=patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2, width))
        self.blocks = nn.ModuleList(Block(width, heads, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


class ProjectedLM(nn.Module):
    """A language model whose embedding is projected before the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.embed(input_ids))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class BiasedLM(nn.Module):
    """A language model whose logits get a bias the model holds itself (BART's
    ``final_logits_bias``): logits split over the vocabulary could not take it, so the plan
    leaves the head whole, and every tp rank runs all of its FLOPs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.register_buffer("final_logits_bias", torch.zeros(1, VOCAB))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) + self.final_logits_bias


def inputs(name: str, rows: int = 2) -> torch.Tensor:
    """A batch for model ``name``: 16 tokens (patches) per row."""
    g = torch.Generator().manual_seed(0)
    if name == "vit":
        return torch.randn(rows, 3, 16, 16, generator=g)
    return torch.randint(0, VOCAB, (rows, 16), generator=g)


MODELS = {"vit": PatchViT, "projected_lm": ProjectedLM, "biased_lm": BiasedLM}


class _LocalFlops:
    """Forward FLOPs each op runs on this rank: torch's own formulas
    (``torch.utils.flop_counter.flop_registry``) on the op's local tensors, a DTensor's shard
    on this rank in place of the DTensor (``FlopCounterMode`` reads a DTensor's global
    shape)."""

    def __init__(self) -> None:
        from plait._torch_compat import torch_dispatch_mode

        TorchDispatchMode = torch_dispatch_mode()
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                return outer._run(func, args, kwargs or {})

        self.total = 0
        self.mode = Mode()

    def _run(self, func: Any, args: Any, kwargs: Any) -> Any:
        from torch.distributed.tensor import DTensor
        from torch.utils.flop_counter import flop_registry

        from plait._torch_compat import pytree

        flatten, unflatten = pytree()

        def tree_map(fn: Any, tree: Any) -> Any:
            leaves, spec = flatten(tree)
            return unflatten([fn(x) for x in leaves], spec)

        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            def local(t: Any) -> Any:
                return t.to_local() if isinstance(t, DTensor) else t

            self.total += int(count(*tree_map(local, args), **tree_map(local, kwargs),
                                    out_val=tree_map(local, out)))
        return out


def _mark(marks: dict[str, int], key: str, counter: _LocalFlops) -> Any:
    """A hook that notes ``counter``'s total under ``key`` the first time it runs."""
    def hook(*_: Any) -> None:
        marks.setdefault(key, counter.total)
    return hook


def outside_flops(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    """Each model of :data:`MODELS` laid out with ``tp=world_size`` (plait's inferred plan),
    one forward on :func:`inputs`: the forward FLOPs this rank runs before its first block,
    inside its blocks, and after its last (:class:`_LocalFlops`)."""
    from plait.runtime import init

    torch.manual_seed(0)
    run = init(f"tp={world_size}", seed=0, quiet=True)
    out: dict[str, dict[str, int]] = {}
    for name, factory in MODELS.items():
        model = run.parallelize(factory())
        counter = _LocalFlops()
        marks: dict[str, int] = {}
        blocks = list(model.blocks)
        blocks[0].register_forward_pre_hook(_mark(marks, "first", counter))
        blocks[-1].register_forward_hook(_mark(marks, "last", counter))
        with counter.mode, torch.no_grad():
            model(inputs(name))
        out[name] = {"before": marks["first"], "blocks": marks["last"] - marks["first"],
                     "after": counter.total - marks["last"]}
    run.close()
    return out
