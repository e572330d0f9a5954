"""Model factories for the planner tests ('tests._planner_factories:name')."""

import torch.nn as nn

from plait.models.transformer import PRESETS, Transformer


def reference_test_model():
    return Transformer(PRESETS["test"])


def mlp_stack():
    """A plain stack of repeated MLP blocks (no attention)."""
    return nn.Sequential(nn.Embedding(100, 32),
                         *[nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
                           for _ in range(6)],
                         nn.Linear(32, 100))


def broken():
    raise RuntimeError("this model does not build")


def no_blocks():
    return nn.Linear(4, 4)


def tiny_gpt2():
    """A two-layer GPT-2 from a config (Conv1D linears, n_positions 32)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=32))


def block_mixing_positions():
    """A model whose blocks mix positions outside tensor-parallel regions: it refuses
    sequence parallelism, which the cost model alone would propose."""
    from tests._workers_semantics import shifted_lm

    return shifted_lm()


class _LengthsDataset:
    """A dataset that reads its tensors' values when built (row lengths): that fails on the
    meta device, where tensors have no values."""

    def __init__(self):
        import torch

        lengths = torch.randint(4, 9, (16,), generator=torch.Generator().manual_seed(0))
        self.rows = [torch.zeros(int(n), dtype=torch.long) for n in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i], self.rows[i]


def model_with_eager_dataset():
    """plait check's (model, dataset, loss_fn) form, the dataset built eagerly."""
    import torch.nn.functional as F

    return mlp_stack(), _LengthsDataset(), F.cross_entropy


def dataset_first():
    return _LengthsDataset(), mlp_stack(), None


class _LazyLengthsDataset:
    """Token rows of 8 whose length is read from a tensor when a row is asked for: built on
    the meta device, the dataset builds but its rows cannot be read."""

    def __init__(self):
        import torch

        self.lengths = torch.full((16,), 8)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        import torch

        row = torch.zeros(int(self.lengths[i]), dtype=torch.long)
        return row, row


def gpt2_with_lazy_dataset():
    """A model whose maximum sequence (32) is not what its dataset holds (8)."""
    import torch.nn.functional as F

    return tiny_gpt2(), _LazyLengthsDataset(), F.cross_entropy


def mlp_with_images():
    """A factory whose dataset holds images: no sequence to read, and the model states none."""
    import torch
    import torch.nn.functional as F

    return mlp_stack(), [(torch.zeros(3, 8, 8), 0)] * 4, F.cross_entropy


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.mlp(x)


class LearnedPositions(nn.Module):
    """GPT-style: token and learned absolute position tables, nothing that names the maximum
    sequence (no config, no max_seq_len) but the position table's rows."""

    def __init__(self, max_len: int = 48, d: int = 16, extra_positions: int | None = None):
        super().__init__()
        self.tok = nn.Embedding(64, d)
        self.pos = nn.Embedding(max_len, d)
        if extra_positions is not None:  # a second table of another size: ambiguous
            self.pos_2d = nn.Embedding(extra_positions, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(2))
        self.head = nn.Linear(d, 64)

    def forward(self, idx):
        import torch

        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def learned_positions():
    return LearnedPositions()


def two_position_tables():
    return LearnedPositions(extra_positions=12)



class _SeededData:
    """Tokens and their next-token targets, drawn from the dataset's own generator."""

    def __init__(self):
        import torch

        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 64, (32, 17), generator=g)
        self.scale = torch.randn(32, generator=g)  # a float draw too (randn's own meta path)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i, :-1], self.tokens[i, 1:]


def with_seeded_data():
    """plait check's (model, dataset, loss_fn), the dataset drawn from its own generator (whose
    meta-device form imports torch._dynamo)."""
    import torch.nn.functional as F

    return LearnedPositions(), _SeededData(), F.cross_entropy
