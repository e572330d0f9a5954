"""Models that are not transformers, as a user brings them to ``plait check --model
tests._any_models:<factory>``: each factory returns (model, dataset, loss_fn), no downloads.

A ResNet-like CNN (BatchNorm, a strided residual downsample), an LSTM language model
(batch_first), an MLP-Mixer, a model taking a dict batch and returning a dict with its own
loss, a U-Net-like encoder/decoder whose skips cross blocks, and a model whose blocks sit in an
nn.ModuleDict. Small enough that a check of a few steps takes seconds on a CPU."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

CLASSES = 4


class Images(Dataset):
    """(3, 8, 8) images and a class each, drawn per index (the same rows for every layout)."""

    def __init__(self, n: int = 32, channels: int = 3, size: int = 8):
        self.n, self.channels, self.size = n, channels, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.channels, self.size, self.size, generator=g)
        return x, torch.randint(0, CLASSES, (), generator=g)


class Tokens(Dataset):
    """Token sequences of 12 over a vocabulary of 32; the target is the next token."""

    def __init__(self, n: int = 32, length: int = 12, vocab: int = 32):
        self.n, self.length, self.vocab = n, length, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        seq = torch.randint(0, self.vocab, (self.length + 1,), generator=g)
        return seq[:-1], seq[1:]


class DictRows(Dataset):
    """Dict items: features, a mask and labels; the model reads the dict and returns one."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        mask = torch.rand(6, generator=g) < 0.7
        labels = torch.randint(0, CLASSES, (6,), generator=g).masked_fill(~mask, -100)
        return {"features": torch.randn(6, 10, generator=g), "mask": mask.float(),
                "labels": labels}


def classify(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def next_token(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# ----------------------------------------------------------------------------------- ResNet
class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm; a strided 1x1 convolution (and its BatchNorm) on
    the shortcut when the block halves the image or changes the width."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                         nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        short = x if self.downsample is None else self.downsample(x)
        return F.relu(out + short)


class ResNet(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width),
                                    BasicBlock(width, 2 * width, stride=2),
                                    BasicBlock(2 * width, 2 * width))
        self.fc = nn.Linear(2 * width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(self.stem(x))
        return self.fc(h.mean(dim=(2, 3)))


def resnet() -> tuple[nn.Module, Dataset, object]:
    return ResNet(), Images(), classify


# --------------------------------------------------------------------------------- LSTM LM
class LSTMLM(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(tokens))
        return self.head(h)


def lstm_lm() -> tuple[nn.Module, Dataset, object]:
    return LSTMLM(), Tokens(), next_token


class GRULM(nn.Module):
    """A GRU over packed sequences of varying length (the padded tail of each row is left out)."""

    def __init__(self, vocab: int = 32, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        lengths = (tokens.shape[1] - (tokens[:, :1] % 4)).flatten().cpu()
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(tokens), lengths,
                                                   batch_first=True, enforce_sorted=False)
        h, _ = self.rnn(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True,
                                                total_length=tokens.shape[1])
        return self.head(h)


def gru_packed() -> tuple[nn.Module, Dataset, object]:
    return GRULM(), Tokens(), next_token


class RecurrentThenMLP(nn.Module):
    """An LSTM, then residual MLP blocks: tensor parallelism splits the blocks and leaves the
    LSTM whole on every rank; a pipeline cuts the blocks, the LSTM on the first stage."""

    def __init__(self, vocab: int = 32, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, batch_first=True)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width),
                                                  nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(4))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(tokens))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def lstm_mlp() -> tuple[nn.Module, Dataset, object]:
    return RecurrentThenMLP(), Tokens(), next_token


# ------------------------------------------------------------------------------- MLP-Mixer
class MixerBlock(nn.Module):
    """Token mixing (an MLP across patches) then channel mixing (an MLP across features)."""

    def __init__(self, patches: int, width: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.tokens = nn.Sequential(nn.Linear(patches, 2 * patches), nn.GELU(),
                                    nn.Linear(2 * patches, patches))
        self.channels = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                      nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, width: int = 16, patch: int = 2, size: int = 8, depth: int = 4):
        super().__init__()
        patches = (size // patch) ** 2
        self.patchify = nn.Conv2d(3, width, patch, patch)
        self.blocks = nn.Sequential(*(MixerBlock(patches, width) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patchify(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(h)).mean(dim=1))


def mixer() -> tuple[nn.Module, Dataset, object]:
    return Mixer(), Images(), classify


# ------------------------------------------------------------------------- dict in, dict out
class DictModel(nn.Module):
    """Reads ``features``, ``mask`` and ``labels`` from a dict batch and returns
    ``{"loss": ..., "logits": ...}``: the mean cross-entropy over the labels that are not
    -100 (the positions the mask drops), which plait averages over the global batch's count."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.inp = nn.Linear(10, width)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width),
                                                    nn.GELU()) for _ in range(2)))
        self.out = nn.Linear(width, CLASSES)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = self.inp(batch["features"] * batch["mask"].unsqueeze(-1))
        logits = self.out(self.blocks(h))
        loss = F.cross_entropy(logits.reshape(-1, CLASSES), batch["labels"].reshape(-1))
        return {"loss": loss, "logits": logits}


def dict_io() -> tuple[nn.Module, Dataset, object]:
    return DictModel(), DictRows(), None


# ------------------------------------------------------------------------------------ U-Net
class Down(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1), nn.GroupNorm(2, cout), nn.SiLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Up(nn.Module):
    def __init__(self, cin: int, skip: int, cout: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin, 2, 2)
        self.conv = nn.Sequential(nn.Conv2d(cin + skip, cout, 3, 1, 1), nn.GroupNorm(2, cout),
                                  nn.SiLU())

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    """Encoder blocks keep their outputs; decoder blocks concatenate them (skips that cross
    every block between them)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.downs = nn.ModuleList([Down(3, width), Down(width, 2 * width),
                                    Down(2 * width, 4 * width)])
        self.ups = nn.ModuleList([Up(4 * width, 2 * width, 2 * width),
                                  Up(2 * width, width, width)])
        self.head = nn.Conv2d(width, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, down in enumerate(self.downs):
            x = down(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        x = skips.pop()
        for up in self.ups:
            x = up(x, skips.pop())
        return self.head(x)


class Segments(Images):
    """Images with a class per pixel."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = super().__getitem__(i)
        return x, (x.sum(0) * 2).long().clamp(0, CLASSES - 1)


def unet() -> tuple[nn.Module, Dataset, object]:
    return UNet(), Segments(), F.cross_entropy


# ------------------------------------------------------------------------- ModuleDict blocks
class Routed(nn.Module):
    """Blocks kept in an nn.ModuleDict by name and applied in a fixed order."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.inp = nn.Linear(10, width)
        self.blocks = nn.ModuleDict({name: nn.Sequential(nn.LayerNorm(width),
                                                         nn.Linear(width, 2 * width), nn.GELU(),
                                                         nn.Linear(2 * width, width))
                                     for name in ("first", "second", "third", "fourth")})
        self.out = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks.values():
            h = h + block(h)
        return self.out(h).mean(dim=1)


class Rows(Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(6, 10, generator=g), torch.randint(0, CLASSES, (), generator=g)


def module_dict() -> tuple[nn.Module, Dataset, object]:
    return Routed(), Rows(), classify


FACTORIES = ("resnet", "lstm_lm", "gru_packed", "lstm_mlp", "mixer", "dict_io", "unet",
             "module_dict")
