"""The planner's training FLOPs of a whole model (what MFU and step time divide by) against
torch's ``FlopCounterMode`` on a real forward, for models whose work outside the blocks is a
stem, a pooled-token classifier or a projection, and for language models (tied head and
untied), at sequence lengths other than the one the planner counted on."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.parallel.tp_example import Example
from plait.planner.model_stats import from_module, load_model
from tests import _outside_models as O
from tests import _planner_idioms as I


def _images(side: int) -> torch.Tensor:
    return torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(0))


def _ids(seq: int) -> torch.Tensor:
    return torch.randint(0, I.VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))


def _features(seq: int) -> torch.Tensor:
    return torch.randn(2, seq, O.Projected.FEATURES, generator=torch.Generator().manual_seed(0))


# name -> (factory, input of a sequence length, lengths priced, example read on (None: the
# planner's own guess))
CASES: dict[str, tuple[Any, Any, tuple[int, ...], Any]] = {
    "vit": (I.vit, lambda s: _images(4 * int(s ** 0.5)), (16, 64), None),
    "cnn_stem": (O.CNNStemTransformer, lambda s: _images(4 * int(s ** 0.5)), (4, 36), None),
    "pooled_head": (O.PooledHead, _ids, (8, 48), None),
    "projected": (O.Projected, _features, (8, 40), Example((_features(12),))),
    "lm_untied": (I.gelu_mlp, _ids, (8, 40), None),
    "lm_tied": (I.tied_swish, _ids, (8, 40), None),
}


# the factories `plait plan --model` names, built on the meta device
SPECS = {"vit": "tests._planner_idioms:vit",
         "cnn_stem": "tests._outside_models:CNNStemTransformer",
         "pooled_head": "tests._outside_models:PooledHead"}


@pytest.mark.parametrize("name,spec", [*((n, "") for n in sorted(CASES)), *SPECS.items()])
def test_whole_model_flops_equal_torchs_count(name: str, spec: str) -> None:
    factory, make, seqs, example = CASES[name]
    torch.manual_seed(0)
    model = factory()
    stats = load_model(spec) if spec else from_module(factory(), name=name, example=example)
    for seq in seqs:
        x = make(seq)
        counter: Any = I.flop_counter()
        with counter:
            model(x)
        tokens = x.shape[0] * seq
        assert stats.model_flops(tokens, seq) == pytest.approx(
            3 * counter.get_total_flops(), rel=1e-9), (name, seq)
