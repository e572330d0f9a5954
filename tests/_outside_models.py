"""Models whose work outside the block stack is not a language model's head, for
tests/test_planner_outside_flops.py: a CNN stem in front of a transformer with a per-token
head, a classifier MLP on one pooled token, and a projection of float features before the
stack. Their blocks are tests/_planner_idioms.py's (attention as matmuls, priced exactly)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests._planner_idioms import WIDTH, Attention, Block, FunctionalMLP

LAYERS = 2


def _blocks() -> nn.ModuleList:
    return nn.ModuleList(Block(Attention(bias=True), FunctionalMLP(F.gelu))
                         for _ in range(LAYERS))


class CNNStemTransformer(nn.Module):
    """Two convolutions (3x3 at full resolution, then a 4x4 patchify), blocks on the patches,
    and a head on every token averaged over them."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(8, WIDTH, kernel_size=4, stride=4)
        self.blocks = _blocks()
        self.head = nn.Linear(WIDTH, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.conv2(F.relu(self.conv1(images))).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean(1)


class PooledHead(nn.Module):
    """A token embedding, blocks, and a two-layer classifier on the mean-pooled token: its
    FLOPs are per row, whatever the row's length."""

    def __init__(self, vocab: int = 64, classes: int = 10, wide: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)
        self.blocks = _blocks()
        self.fc1 = nn.Linear(WIDTH, wide)
        self.fc2 = nn.Linear(wide, classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.fc2(torch.tanh(self.fc1(x.mean(1))))


class Projected(nn.Module):
    """Float features (rows, positions, 24) projected to the width before the stack, a
    per-position regression head after it."""

    FEATURES = 24

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(self.FEATURES, WIDTH)
        self.blocks = _blocks()
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.proj(features)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class PooledVocabHead(nn.Module):
    """A token embedding, blocks, a final norm, and one classifier as wide as the vocabulary
    on the mean-pooled token (``cls``: on the first token): a language model's parameters
    (embeddings, norms, one hidden x vocab Linear), but its head runs once per row."""

    def __init__(self, vocab: int = 64, cls: bool = False) -> None:
        super().__init__()
        self.cls = cls
        self.embed = nn.Embedding(vocab, WIDTH)
        self.blocks = _blocks()
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return self.head(x[:, 0] if self.cls else x.mean(1))


def cls_vocab_head() -> PooledVocabHead:
    return PooledVocabHead(cls=True)
