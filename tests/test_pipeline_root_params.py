"""Parameters held by the model's own module (a scale, a shift) under a pipeline: every stage
keeps them, each stage's gradient is the share of its own uses, and the copies' gradients
are summed over the stages, as a tied weight's. Checked against one device (loss and every
parameter, SGD: its update is linear in the gradient, so a missing share shows)."""

import pytest

from plait.check import CheckConfig, check
from tests._pipeline_models import head_gain_mlp, mlp_batch, scaled_mlp, spare_mlp

CFG = CheckConfig(model_factory=scaled_mlp, batch_factory=mlp_batch, optimizer="sgd", lr=0.1,
                  steps=3)


def _ok(plan: str) -> None:
    result = check(plan, CFG, timeout=200)
    assert result.ok, result.format()
    assert not result.missing


@pytest.mark.parametrize("plan", [
    "pp=2",
    # Two stages on one rank share one parameter object: its gradient is summed once.
    "pp=2,pp_schedule=interleaved_1f1b,virtual_stages=2",
])
def test_root_parameters_train_as_on_one_device(plan):
    _ok(plan)


@pytest.mark.slow
@pytest.mark.parametrize("plan", [
    "pp=4",
    "dp=2,pp=2",
    "dp_shard=2,zero=3,pp=2",
    "pp=2,pp_schedule=interleaved_1f1b,virtual_stages=2,grad_clip=0.05",
])
def test_root_parameters_under_other_layouts(plan):
    _ok(plan)


@pytest.mark.parametrize("plan", ["dp=2,pp=2", pytest.param("dp_shard=2,zero=1,pp=2",
                                                             marks=pytest.mark.slow)])
def test_a_root_parameter_only_the_last_stage_uses_trains_under_ddp(plan):
    """The first stage holds the output's gain and never uses it: DDP's reducer waited for
    that copy's gradient and failed the second step ("Expected to have finished reduction in
    the prior iteration"); the stages let DDP reduce a zero for it."""
    cfg = CheckConfig(model_factory=head_gain_mlp, batch_factory=mlp_batch, optimizer="adamw",
                      lr=1e-2, steps=3)
    result = check(plan, cfg, timeout=200)
    assert result.ok, result.format()
    assert not result.missing


# AdamW: its update is not linear in the gradient, but a missing or doubled share still moves
# ``shift`` and ``scale`` off one device's by far more than the tolerance.
ADAMW = CheckConfig(model_factory=scaled_mlp, batch_factory=mlp_batch, optimizer="adamw",
                    lr=1e-2, steps=3)


def test_zero_bubble_schedules_train_them():
    """ZB-V splits each stage's backward into an input and a weight step; ``shift``, read after
    every block, meets the stage's graph at several depths, and its weight step walks through
    the blocks between them (it ran a second backward through their freed graph)."""
    result = check("pp=2,pp_schedule=zbv,virtual_stages=2", ADAMW, timeout=200)
    assert result.ok, result.format()
    assert not result.missing


@pytest.mark.slow
def test_interleaved_zero_bubble_trains_them():
    result = check("pp=2,pp_schedule=interleaved_zb,virtual_stages=2,microbatches=4", ADAMW,
                   timeout=200)
    assert result.ok, result.format()
    assert not result.missing


def test_a_tied_weight_no_stage_used_keeps_no_gradient():
    """Every stage holds ``spare`` (tied), none reads it: its gradient stays None, as on one
    device, so AdamW's weight decay does not move it (a zero gradient from the tied sum did:
    1e-4 of it per step at lr 1e-2)."""
    cfg = CheckConfig(model_factory=spare_mlp, batch_factory=mlp_batch, optimizer="adamw",
                      lr=1e-2, steps=3)
    result = check("pp=2", cfg, timeout=200)
    assert result.ok, result.format()
