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
from tests import _workers_logits as L


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
    "pooled_vocab_head": (O.PooledVocabHead, _ids, (8, 48), None),
    "cls_vocab_head": (O.cls_vocab_head, _ids, (8, 48), None),
    "projected": (O.Projected, _features, (8, 40), Example((_features(12),))),
    "lm_untied": (I.gelu_mlp, _ids, (8, 40), None),
    "lm_tied": (I.tied_swish, _ids, (8, 40), None),
    # blocks fx cannot trace (a shape unpacked off the input): the head told per row anyway
    "pooled_vocab_untraced": (L.PooledVocab, lambda s: torch.randint(
        0, L.VOCAB, (2, s), generator=torch.Generator().manual_seed(0)), (8, 40), None),
}


# the factories `plait plan --model` names, built on the meta device
SPECS = {"vit": "tests._planner_idioms:vit",
         "cnn_stem": "tests._outside_models:CNNStemTransformer",
         "pooled_head": "tests._outside_models:PooledHead",
         "pooled_vocab_head": "tests._outside_models:PooledVocabHead"}


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


def test_a_stem_is_priced_on_a_pipelines_first_chunk_and_the_head_on_its_last() -> None:
    """The FLOPs before the blocks (two convolutions) are those torch counts before the first
    block; a pipeline prices them on its first chunk, the head on its last, and one chunk
    holds both (the step as before)."""
    from plait.plan import Plan
    from plait.planner.compute import microbatch_times
    from plait.planner.cost import Constants
    from plait.planner.hardware import load_cluster

    torch.manual_seed(0)
    model = O.CNNStemTransformer()
    stats = from_module(O.CNNStemTransformer(), name="cnn_stem")
    x, seq = _images(4 * 6), 36
    counter: Any = I.flop_counter()
    seen: list[float] = []
    hook = model.blocks[0].register_forward_pre_hook(
        lambda *_: seen.append(float(counter.get_total_flops())))
    with counter:
        model(x)
    hook.remove()
    tokens = x.shape[0] * seq
    assert stats.stem_flops_per_token() * tokens == pytest.approx(seen[0], rel=1e-9)
    cluster, c = load_cluster("dgx-h100", devices=2), Constants()
    one = microbatch_times(Plan.from_string("dp=2"), stats, cluster, 2, seq, c)
    two = microbatch_times(Plan.from_string("pp=2"), stats, cluster, 2, seq, c)
    stem = 3 * seen[0] / one.rate
    assert two.embed == pytest.approx(stem, rel=1e-9)
    outside = 3 * stats.head_flops_per_token(seq) * tokens / one.rate
    assert two.head - c.micro_overhead_s == pytest.approx(outside - stem, rel=1e-9)
    assert one.embed + one.head == pytest.approx(outside + c.micro_overhead_s, rel=1e-9)
