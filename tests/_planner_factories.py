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
