"""Imbalanced classes and weighted losses, taken through what a newcomer tries
(``tests/_newcomer6_models.py``): what plait can count trains as one device running the same
AdamW steps with torch alone; a scalar that is not a mean over what plait counts (a
class-weighted mean divides by the labels' summed weight) is warned about, with the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.mean_probe import _loss_reaches_beyond, mean_over_counted, weighted_module_count
from plait.spawn import run_distributed
from tests import _newcomer6_models as N
from tests.test_newcomer_models import _assert_trains_as_one_device

# The default test's plan: each replica and each micro-batch holds other classes. FSDP2 for
# two of the cases; every case under every layout in the slow test.
PLAN, SHARDED = "dp=2,grad_accum=2", "fsdp=2"
EXACT = ("smoothed_ce_pair", "token_ce_pair", "hf_weighted", "bce_pos_weight", "focal")
WARNED = ("token_ce", "hf_weighted_in_forward")


def _batch(name: str) -> tuple[Any, Any, Any, Any]:
    """(model, output, targets, loss_fn) of case ``name`` on the first global batch."""
    model, data, loss_fn, collate = N._factory(name)
    batch = collate([data[i] for i in range(N.BATCH)])
    inputs, targets = N._inputs(batch)
    return model, model(**inputs), targets if targets is not None else batch["labels"], loss_fn


@pytest.mark.parametrize("name, mean", [("weighted_ce", False), ("smoothed_ce", False),
                                        ("weighted_nll", False), ("token_ce", False),
                                        ("focal", True), ("bce_pos_weight", True)])
def test_the_probe_tells_a_weighted_mean_from_a_mean_over_the_counted_items(name, mean) -> None:
    _, out, targets, loss_fn = _batch(name)
    assert mean_over_counted(loss_fn(out, targets), out, targets, loss_fn) is mean
    # The same labels unweighted: a mean over the labels that are not -100.
    if not mean and name != "weighted_nll":
        def plain(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(o.reshape(-1, N.CLASSES), t.reshape(-1), ignore_index=-100,
                                   label_smoothing=0.1)
        assert mean_over_counted(plain(out, targets), out, targets, plain) is True


def test_the_probe_cuts_an_output_object_by_its_fields() -> None:
    # A loss reading out.logits from a model's output object (a dataclass, or a Hugging Face
    # ModelOutput, a dict read by attribute) gets halves of the same kind.
    _, logits, y, _ = _batch("weighted_ce")
    out = N.Output(loss=None, logits=logits)
    for loss_fn, mean in ((lambda o, t: N.weighted_ce(o.logits, t), False),
                          (lambda o, t: F.cross_entropy(o.logits, t), True)):
        assert mean_over_counted(loss_fn(out, y), out, y, loss_fn) is mean


def test_the_probe_cannot_tell_without_rows_to_cut() -> None:
    _, out, targets, loss_fn = _batch("weighted_ce")
    value = loss_fn(out, targets)
    assert mean_over_counted(value, out[:1], targets[:1], loss_fn) is None
    assert mean_over_counted(value.detach(), out, targets, loss_fn) is None  # no graph
    # Every row's loss the same (a head of zeros): the halves agree whatever the weights.
    zeros = torch.zeros_like(out, requires_grad=True)
    assert mean_over_counted(loss_fn(zeros, targets), zeros, targets, loss_fn) is None


def test_a_loss_running_a_model_of_its_own_is_not_asked_again() -> None:
    # A GAN's generator loss runs the discriminator: asking it on halves would run that
    # model again (its BatchNorm statistics updated), so the probe leaves it alone.
    critic = nn.Sequential(nn.Linear(N.CLASSES, 1), nn.Flatten(0))
    _, out, targets, _ = _batch("bce_pos_weight")
    value = F.binary_cross_entropy_with_logits(critic(out), targets[:, 0])
    assert _loss_reaches_beyond(value, out)
    assert not _loss_reaches_beyond(N.bce_pos_weight(out, targets), out)


def test_a_models_own_weighted_loss_module_is_counted_by_its_weights() -> None:
    model, out, labels, _ = _batch("hf_weighted")
    count = weighted_module_count(model, out["loss"], out, labels, {})
    assert count is not None
    torch.testing.assert_close(count, N.class_weights()[labels].sum())
    inline, out, labels, _ = _batch("hf_weighted_in_forward")
    assert weighted_module_count(inline, out.loss, out, labels, {}) is None


@pytest.mark.parametrize("pair, scalar", [("weighted_ce_pair", "weighted_ce"),
                                          ("smoothed_ce_pair", "smoothed_ce"),
                                          ("weighted_nll_pair", "weighted_nll"),
                                          ("token_ce_pair", "token_ce")])
def test_each_recipe_is_the_weighted_mean_one_device_computes(pair, scalar) -> None:
    _, out, targets, _ = _batch(pair)
    total, count = N.LOSSES[pair](out, targets)
    torch.testing.assert_close(total / count, N.LOSSES[scalar](out, targets))


def test_weighted_losses_train_as_one_device_or_are_warned_about() -> None:
    # A class-weighted mean (F.cross_entropy or F.nll_loss with weight=, per token too, or a
    # model's own loss made in forward) was weighted by each part's count of labels: up to
    # 3.7% off one device's loss at a step and 19% off in a parameter under
    # dp=2,grad_accum=2, with nothing said. The (sum, weighted count) recipes, a loss
    # module the model holds, pos_weight and a focal loss's mean over rows train exactly.
    jobs = ([(name, PLAN) for name in EXACT + WARNED]
            + [(name, SHARDED) for name in ("smoothed_ce_pair", "hf_weighted")])
    got = run_distributed(N.train, 2, jobs, timeout=180)[0]
    wants = {name: N.reference(name) for name in EXACT + WARNED}
    for result in got:
        want = wants[result["case"]]
        if result["case"] in EXACT:
            assert result["warnings"] == [], result["warnings"]
            _assert_trains_as_one_device(result, want)
            continue
        said = result["warnings"]
        assert len(said) == 1, said
        assert "is not the mean" in said[0] and "(sum, count)" in said[0], said
        assert "w[y[y != -100]].sum()" in said[0], said
        # What it warns about: the steps after the first part from one device's.
        assert abs(result["losses"][1] - want["losses"][1]) > 1e-3 * want["losses"][1]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(N.LOSSES) + ["hf_weighted", "hf_weighted_in_forward"])
def test_each_case_under_every_data_parallel_layout(name) -> None:
    want = N.reference(name)
    plans = ("dp=2", "dp=2,grad_accum=2", "dp_shard=2,zero=1", "fsdp=2",
             "fsdp=2,grad_accum=2")
    results = (run_distributed(N.train, 1, [(name, "grad_accum=2")], timeout=120)[0]
               + run_distributed(N.train, 2, [(name, p) for p in plans], timeout=300)[0])
    for result in results:
        if name in ("weighted_ce", "smoothed_ce", "weighted_nll") + WARNED:  # not a mean
            assert len(result["warnings"]) == 1, (result["plan"], result["warnings"])
            continue
        assert result["warnings"] == [], (result["plan"], result["warnings"])
        _assert_trains_as_one_device(result, want)


@pytest.mark.slow
def test_a_pipeline_warns_on_rank_0_and_trains_the_recipe_as_one_device() -> None:
    # The last stage alone computes the loss: its finding travels with the step's totals, so
    # rank 0 (whose output plait run shows) warns too.
    jobs = [(name, "pp=2,microbatches=2") for name in ("weighted_ce", "weighted_ce_pair",
                                                      "focal")]
    ranks = run_distributed(N.train, 2, jobs, timeout=300)
    for rank in ranks:
        said = rank[0]["warnings"]
        assert len(said) == 1 and "is not the mean over the items plait counts" in said[0], said
        assert rank[1]["warnings"] == rank[2]["warnings"] == [], rank
    for result in ranks[0][1:]:
        _assert_trains_as_one_device(result, N.reference(result["case"]))
