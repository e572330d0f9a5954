"""DDP (and gradient accumulation) trains exactly what one device trains."""

import pytest

from plait.check import CheckConfig, check


@pytest.mark.parametrize("plan", ["dp=2", "dp=4", "dp=2,grad_accum=2", "dp=4,grad_accum=2"])
def test_ddp_matches_single_device(plan):
    result = check(plan, CheckConfig(steps=5))
    assert result.ok, result.format()
    assert result.max_loss_diff < 1e-5 and result.max_param_diff < 1e-5
    assert len(result.losses_parallel) == 5


def test_ddp_sgd_is_tighter():
    result = check("dp=2,grad_accum=2", CheckConfig(steps=5, optimizer="sgd", lr=0.5),
                   tolerance=1e-6)
    assert result.ok, result.format()


def test_check_detects_a_wrong_layout():
    # Different clipping changes the training: the harness must notice (it can fail).
    from plait.check import compare, train_and_collect
    from plait.plan import Plan
    from plait.spawn import run_distributed

    cfg = CheckConfig(steps=3, lr=0.05)
    ref = run_distributed(train_and_collect, 1, Plan(grad_clip=None), cfg)[0]
    other = run_distributed(train_and_collect, 2, Plan(dp_replicate=2, grad_clip=1e-3), cfg)[0]
    result = compare(Plan(dp_replicate=2), ref, other, 3, 1e-5)
    assert not result.ok
    assert result.max_param_diff > 1e-4


def test_bf16_autocast_stays_close():
    result = check("dp=2,mp=bf16", CheckConfig(steps=3), tolerance=5e-2)
    assert result.ok, result.format()


@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("adamw", marks=pytest.mark.slow)])
def test_mixed_precision_bounds_pass_its_rounding_and_fail_a_wrong_update(optimizer):
    """Under bf16 the split batch rounds different partial sums (AdamW's parameters 1.3e-2 of
    their displacement apart at dp=2, above the fp32 bound of 1e-3): the default bounds are
    bf16's. A wrong update (twice the step, as a gradient summed and not averaged gives SGD)
    still fails them."""
    from plait.check import compare, tolerances, train_and_collect
    from plait.plan import Plan
    from plait.spawn import run_distributed

    cfg = CheckConfig(steps=3, optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 1e-3)
    result = check("dp=2,mp=bf16", cfg)
    assert result.ok and result.limits == tolerances(optimizer, "bf16"), result.format()
    assert f"{optimizer}, bf16: loss within" in result.format()
    plan = Plan(dp_replicate=2, mixed_precision="bf16")
    ref = run_distributed(train_and_collect, 1, Plan(mixed_precision="bf16"), cfg)[0]
    doubled = CheckConfig(steps=3, optimizer=optimizer, lr=2 * cfg.lr)
    wrong = run_distributed(train_and_collect, 2, plan, doubled)[0]
    result = compare(plan, ref, wrong, 3, None, optimizer)
    assert not result.ok and result.max_param_rel > 5 * result.limits["param"], result.format()


def test_check_report_when_every_parameter_is_bitwise_equal():
    """No parameter is 'the worst' when none differs: the report says so instead of '()'."""
    from plait.check import CheckResult

    text = CheckResult(plan="dp=2", world_size=2, steps=1, losses_reference=[1.0],
                       losses_parallel=[1.0], max_loss_diff=0.0, max_param_diff=0.0,
                       worst_param="").format()
    assert "()" not in text and "0.000e+00 (every parameter bitwise equal)" in text, text
