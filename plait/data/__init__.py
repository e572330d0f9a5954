"""Bundled data and the byte-level tokenizer.

plait ships one small public-domain corpus (Tiny Shakespeare, ~1.1 MB) so that every example,
the demo and the tests train on real text with no download. Tokens are raw bytes (vocabulary
256): no tokenizer files, and losses are comparable across runs and machines.
"""

from __future__ import annotations

import math
from collections import Counter
from importlib import resources

import torch
from torch.utils.data import Dataset

from .loader import DistributedLoader
from .stream import StreamLoader

CORPUS = "tinyshakespeare.txt"
VOCAB_SIZE = 256


def load_corpus(name: str = CORPUS) -> bytes:
    """The bundled corpus as bytes."""
    return resources.files(__package__).joinpath(name).read_bytes()


def encode(text: str | bytes) -> torch.Tensor:
    """Bytes -> int64 token ids in [0, 256)."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def unigram_entropy(data: bytes) -> float:
    """Entropy of the byte distribution in nats/token: the loss of the best model that ignores
    context. A language model that learned anything beats it."""
    counts = Counter(data)
    total = len(data)
    return -sum(c / total * math.log(c / total) for c in counts.values())


class TextDataset(Dataset):
    """Fixed-length windows of a token stream: item i is (tokens[i*s : i*s+s], next tokens).

    ``split`` takes the first 90% ("train") or the last 10% ("val") of the corpus, a fixed split
    so validation losses are comparable across runs.
    """

    def __init__(self, tokens: torch.Tensor | None = None, seq_len: int = 128,
                 split: str = "train"):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if split not in ("train", "val", "all"):
            raise ValueError(f"split={split!r} must be 'train', 'val' or 'all'")
        if tokens is None:
            tokens = encode(load_corpus())
        cut = int(len(tokens) * 0.9)
        self.tokens = {"train": tokens[:cut], "val": tokens[cut:], "all": tokens}[split]
        self.seq_len = seq_len
        if len(self.tokens) <= seq_len:
            raise ValueError(f"corpus of {len(self.tokens)} tokens is too short for "
                             f"seq_len={seq_len}")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = self.tokens[start:start + self.seq_len + 1]
        return window[:-1], window[1:]


__all__ = ["CORPUS", "VOCAB_SIZE", "DistributedLoader", "TextDataset", "decode", "encode",
           "StreamLoader", "load_corpus", "unigram_entropy"]
