"""Models and batches for the pipeline tests (module level: spawned workers import them)."""

import torch
import torch.nn as nn

from plait.models.transformer import build, preset


def transformer8():
    """The reference "test" transformer with 8 blocks (pp=4 x 2 virtual stages needs 8)."""
    return build(preset("test", n_layers=8), seed=0)


def deep_mlp():
    """A plain Sequential MLP: 8 Linear+Tanh blocks between an input and an output layer."""
    torch.manual_seed(0)
    layers = [nn.Linear(12, 32)]
    for _ in range(8):
        layers += [nn.Sequential(nn.Linear(32, 32), nn.Tanh())]
    layers.append(nn.Linear(32, 3))
    return nn.Sequential(*layers)


def mlp_batch(step, seed):
    g = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randn(16, 12, generator=g), torch.randn(16, 3, generator=g)
