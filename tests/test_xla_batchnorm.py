"""The BatchNorm hooks plait adds on XLA (``plait.parallel.xla_batchnorm``), run on the CPU:
eager torch already keeps the unbiased running variance there, so the hooked module must end
with exactly what the plain one has, for every input rank and momentum."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from plait.parallel.xla_batchnorm import _after, _before, updates_biased_variance


@pytest.mark.parametrize("make, shape", [
    (lambda m: nn.BatchNorm1d(3, momentum=m), (8, 3)),
    (lambda m: nn.BatchNorm1d(3, momentum=m), (4, 3, 5)),
    (lambda m: nn.BatchNorm2d(3, momentum=m), (2, 3, 4, 4)),
])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_hooked_running_variance_is_eager_torchs(make, shape, momentum):
    plain, hooked = make(momentum), make(momentum)
    hooked.register_forward_pre_hook(_before)
    hooked.register_forward_hook(_after)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(*shape, generator=g) * 3 + 1
        plain(x), hooked(x)
    hooked.eval()
    hooked(torch.randn(*shape, generator=g))  # eval mode: the hooks leave the statistics alone
    torch.testing.assert_close(hooked.running_var, plain.running_var, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hooked.running_mean, plain.running_mean)


def test_the_cpu_is_not_taken_for_a_biased_device():
    assert updates_biased_variance(torch.device("cpu")) is False
