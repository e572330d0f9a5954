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
