"""ZeRO-1/2/3 and HSDP against one device, the memory they really hold, and bad input.

Every layout trains 5 steps (AdamW) under the plan and on one process through
``plait.check.check`` and must match: fp32 loss and parameters within 1e-5. bf16 (FSDP2
MixedPrecisionPolicy: bf16 gathered parameters/compute, fp32 reduction and master) is compared
against one device running bf16 autocast over fp32 weights: the two round differently (bf16
weights vs bf16 casts inside autocast), so the tolerance is BF16_TOLERANCE below.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from plait.check import CheckConfig, check, compare
from plait.checkpoint.export import model_tensors
from plait.memory import closed_form, model_state_ratio
from plait.parallel.units import repeated_blocks, select_units
from plait.plan import Plan
from plait.spawn import run_distributed
from tests._workers_zero import (
    DeepMLP,
    ddp_by_hand,
    mlp_batch,
    mlp_factory,
    parallelize_error,
    replicate_run,
    state_read_by_forward,
    strided_replica_numel,
    train_memory,
    train_memory_many,
)

FP32 = 1e-5
# bf16 has 8 mantissa bits (relative step 2^-8 ~ 4e-3); 5 AdamW steps at lr 1e-3 move weights
# by ~5e-3, so parameter differences stay well under one lr-step and losses within a few 1e-3.
BF16_TOLERANCE = 5e-3


def _ok(result) -> None:
    assert result.ok, result.format()


# ------------------------------------------------------------------ correctness vs one device
def test_buffers_the_forward_writes_and_reads_are_rank_0s_at_each_step_as_under_ddp(tmp_path):
    """An EMA the forward updates from its rows and then reads (and a step count): DDP gives
    every rank rank 0's buffers before each step, so every rank's gradients are computed from
    rank 0's EMA. ZeRO-2/3 did not: each rank read its own, and after 3 AdamW steps the loss was
    2e-2 and the parameters 2e-2 off DDP's. Against DDP's semantics written out on one device
    (and DDP itself): losses, every parameter and buffer of every rank's
    ``run.full_state_dict`` within 1e-6, and each rank's own copy after the last step is its
    own update, as under DDP; a checkpoint saved then holds rank 0's."""
    ref = ddp_by_hand(2)
    plans = ["dp=2", "dp_shard=2,zero=2", "dp_shard=2,zero=3"]
    ranks = run_distributed(state_read_by_forward, 2, plans, str(tmp_path), timeout=240)
    for plan in plans:
        for rank, out in enumerate(ranks):
            got = out[plan]
            assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in
                       zip(got["losses"], ref["losses"], strict=True)), (plan, got["losses"])
            worst = {k: (got["state"][k].float() - v.float()).abs().max().item()
                     for k, v in ref["state"].items()}
            assert max(worst.values()) < 1e-6, (plan, rank, worst)
            assert torch.allclose(got["own"], ranks[rank]["dp=2"]["own"], rtol=0, atol=1e-6), (
                plan, rank)
        saved = model_tensors(ranks[0][plan]["saved"])[0]
        assert torch.allclose(saved["ema"], ref["state"]["ema"], rtol=0, atol=1e-6), plan
    assert int(ref["state"]["seen"]) == 3


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_world2_matches_single_device(zero):
    _ok(check(f"dp_shard=2,zero={zero}", tolerance=FP32))


def test_hsdp_2x2_matches_single_device():
    _ok(check("dp_replicate=2,dp_shard=2,zero=3", tolerance=FP32))


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_world4_matches_single_device(zero):
    _ok(check(f"dp_shard=4,zero={zero}", tolerance=FP32))


@pytest.mark.slow
def test_hsdp_zero2_and_zero1_2x2():
    _ok(check("dp_replicate=2,dp_shard=2,zero=2", tolerance=FP32))
    _ok(check("dp_replicate=2,dp_shard=2,zero=1", tolerance=FP32))


def test_zero3_bf16_within_documented_tolerance():
    result = check("dp_shard=2,zero=3,mp=bf16", tolerance=BF16_TOLERANCE)
    _ok(result)
    assert result.max_param_diff > 0  # bf16 really ran (fp32 would match to ~1e-6)


@pytest.mark.slow
def test_zero3_cpu_offload_matches_single_device():
    _ok(check("dp_shard=2,zero=3,offload", tolerance=FP32))


def test_zero3_non_transformer_model():
    cfg = CheckConfig(model_factory=mlp_factory, batch_factory=mlp_batch)
    _ok(check("dp_shard=2,zero=3", cfg, tolerance=FP32))


@pytest.mark.slow
def test_zero3_with_checkpointing_and_shard_patterns():
    plan = Plan(dp_shard=2, zero=3, activation_checkpointing="selective",
                options={"shard_patterns": ["layers.*", "tok_embeddings"]})
    _ok(check(plan, tolerance=FP32))


def test_apply_replicate_matches_single_device():
    """Replicated DP through FSDP2 (the path used for TP models) on plain parameters."""
    from plait.check import train_and_collect

    plan, cfg = Plan(dp_replicate=2), CheckConfig()
    ref = run_distributed(train_and_collect, 1, Plan(), cfg, timeout=120)[0]
    got = run_distributed(replicate_run, 2, plan, cfg, timeout=120)[0]
    _ok(compare(plan, ref, got, cfg.steps, FP32))


# ------------------------------------------------------------------ memory: measured vs formula
MEMORY_PLANS = ["dp=2", "dp_shard=2,zero=1", "dp_shard=2,zero=2", "dp_shard=2,zero=3",
                "dp_shard=2,zero=3,offload"]


def test_memory_report_matches_closed_form():
    """Measured local tensor bytes per rank within 10% of the closed form, for every stage."""
    plans = [Plan.from_string(p) for p in MEMORY_PLANS]
    reports = run_distributed(train_memory_many, 2, plans, CheckConfig(steps=2), timeout=180)[0]
    for plan, report in zip(plans, reports, strict=True):
        _check_memory(plan, report)
    states = {p.to_string(): r["ranks"][0]["measured"]["model_state"]
              for p, r in zip(plans, reports, strict=True)}
    ddp, z1, z2, z3 = (states[Plan.from_string(p).to_string()] for p in MEMORY_PLANS[:4])
    assert ddp > z1 > z2 == z3  # ZeRO-2 and -3 hold the same at rest; they differ in `gathered`


def _check_memory(plan: Plan, report: dict) -> None:
    psi = report["psi"]
    assert psi == 180_800  # the "test" preset's parameter count, sharding undone
    for ratio in model_state_ratio(report):
        assert 0.9 <= ratio <= 1.1, (plan, ratio)
    form = report["closed_form"]
    for rank in report["ranks"]:
        measured = rank["measured"]
        for key in ("params", "grads", "optimizer"):
            assert abs(measured[key] - form[key]) <= 0.1 * form[key], (plan, key, measured)
        if plan.zero == 2:  # every block stays gathered between forward and backward
            assert abs(measured["gathered"] - form["gathered"]) <= 0.1 * form["gathered"]
        if plan.zero == 3:  # only the root's own parameters (embeddings, norm, head)
            assert 0 < measured["gathered"] < 0.25 * 4 * psi
            assert measured["gathered"] == form["gathered"], (plan, measured, form)
        if plan.zero < 2:
            assert measured["gathered"] == 0


def test_memory_under_tensor_parallelism_is_the_closed_form():
    """tp=2: parameters and gradients per rank are exactly half the model's (the embedding's
    gradient, replicated by DTensor's embedding backward, is cut to the rank's rows in
    backward); a fused q|k|v weight split per third counts as split."""
    report = run_distributed(train_memory, 2, Plan(tp=2), CheckConfig(steps=2), timeout=180)[0]
    form = report["closed_form"]
    for rank in report["ranks"]:
        assert rank["measured"]["params"] == form["params"]
        assert rank["measured"]["grads"] == form["grads"]
    assert run_distributed(strided_replica_numel, 2, timeout=60) == [24, 24]


def test_memory_under_a_pipeline_is_each_stages_closed_form():
    """pp=2: the stages hold different parameters (the embedding on one, the head on the
    other), so each rank is held to the closed form of its own Ψ, and the table shows one
    closed form per rank."""
    from plait.memory import format_memory_report

    report = run_distributed(train_memory, 2, Plan(pp=2, microbatches=2), CheckConfig(steps=2),
                             timeout=180)[0]
    psis = [rank["psi"] for rank in report["ranks"]]
    assert psis[0] != psis[1] and sum(psis) == 180_800
    for rank in report["ranks"]:
        assert rank["measured"]["params"] == rank["closed_form"]["params"] == 4 * rank["psi"]
    assert all(0.9 <= r <= 1.1 for r in model_state_ratio(report))
    table = format_memory_report(report)
    assert f"(Ψ = {psis[0]:,} on rank 0, {psis[1]:,} on rank 1: each rank's parameters" in table
    assert table.count("\n closed form ") == 5, table


@pytest.mark.slow
def test_memory_hsdp_shards_over_dp_shard_only():
    plan = Plan.from_string("dp_replicate=2,dp_shard=2,zero=3")
    report = run_distributed(train_memory, 4, plan, CheckConfig(steps=2), timeout=180)[0]
    assert all(0.9 <= r <= 1.1 for r in model_state_ratio(report))
    assert report["closed_form"]["model_state"] == 16 * report["psi"] / 2


def test_closed_form_is_the_zero_paper_table():
    psi = 1000
    plan = Plan(dp_shard=4, zero=3)
    assert closed_form(plan, psi, 8).model_state == 16 * psi / 4
    assert closed_form(Plan(dp_shard=4, zero=2), psi, 8).model_state == 16 * psi / 4
    assert closed_form(Plan(dp_shard=4, zero=2), psi, 8).gathered == 4 * psi
    assert closed_form(Plan(dp_shard=4, zero=2, mixed_precision="bf16"), psi, 8).gathered \
        == 2 * psi
    assert closed_form(Plan(dp_shard=4, zero=1), psi, 8).model_state == 8 * psi + 8 * psi / 4
    assert closed_form(Plan(dp_replicate=4), psi, 8).model_state == 16 * psi


# ------------------------------------------------------------------ units
def test_units_default_to_the_largest_container():
    names = [n for n, _ in repeated_blocks(DeepMLP(depth=3))]
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert [n for n, _ in repeated_blocks(seq)] == ["0", "2"]  # the ReLU has nothing to shard


def test_shard_patterns_select_units_bottom_up():
    units = [n for n, _ in select_units(DeepMLP(depth=2), ["blocks.*", "blocks.*.fc1"])]
    assert units[:2] == ["blocks.0.fc1", "blocks.1.fc1"]  # deeper first
    assert set(units[2:]) == {"blocks.0", "blocks.1"}


# ------------------------------------------------------------------ bad input
def test_bad_zero_stage_and_offload_are_refused_by_the_plan():
    with pytest.raises(ValueError, match=r"zero=4 must be 0, 1, 2 or 3"):
        Plan(dp_shard=2, zero=4)
    with pytest.raises(ValueError, match=r"offload=True needs zero=3 \(got zero=2\)"):
        Plan(dp_shard=2, zero=2, offload=True)
    with pytest.raises(ValueError, match=r"zero=3 needs dp_shard > 1"):
        Plan(zero=3)


def test_world_size_that_does_not_factor_is_refused():
    with pytest.raises(ValueError, match=r"dp_shard\(3\).* = 3 != world size 4"):
        Plan(dp_shard=3, zero=3).validate(world_size=4)
    with pytest.raises(ValueError, match=r"= 4 != world size 2; make the degrees multiply to 2"):
        Plan(dp_replicate=2, dp_shard=2, zero=3).validate(world_size=2)


def test_pattern_matching_nothing_names_it():
    with pytest.raises(ValueError, match=r"shard_patterns \['decoder\.\*'\] match no module"):
        select_units(DeepMLP(), ["blocks.*", "decoder.*"])


def test_pattern_matching_nothing_fails_before_training():
    plan = Plan(dp_shard=2, zero=3, options={"shard_patterns": ["decoder.layers.*"]})
    messages = run_distributed(parallelize_error, 2, plan, timeout=60)
    assert all("decoder.layers.*" in m and "layers.0" in m for m in messages), messages


def test_check_tolerance_floor_for_barely_moving_tensors():
    """A tensor the reference moved by almost nothing is held to fp32 rounding of its own
    norm, not to a ratio over a near-zero displacement; a real mismatch still fails."""
    w0 = torch.full((64, 64), 0.02)
    ref = w0 + 1e-9                       # moved by ~6e-8 in norm: pure rounding
    rounding = ref.clone()
    rounding[0, 0] += 2e-9                # one fp32 step at this magnitude
    wrong = ref * 1.001                   # off by 0.1%: a wrong layout
    reference = {"state": {"w": ref}, "initial": {"w": w0}, "losses": [1.0]}
    plan = Plan.from_string("dp=2")
    ok = compare(plan, reference, {"state": {"w": rounding}, "losses": [1.0]}, 1, None, "sgd")
    bad = compare(plan, reference, {"state": {"w": wrong}, "losses": [1.0]}, 1, None, "sgd")
    assert ok.ok, ok.format()
    assert not bad.ok and bad.worst_param_rel == "w"


def test_check_tolerance_floor_for_zero_gradient_tensors():
    """A zero-initialised bias whose exact gradient is zero (an attention key bias) moves by
    rounding noise only; it is held to rounding of what the model moved, and the hint for Adam
    names SGD."""
    w0, b0 = torch.full((64, 64), 0.02), torch.zeros(64)
    ref = {"w": w0 - 1e-3, "b": b0 + 1e-10}
    noisy = {"w": ref["w"].clone(), "b": b0 - 1e-10}
    wrong = {"w": ref["w"].clone(), "b": b0 + 1e-4}
    reference = {"state": ref, "initial": {"w": w0, "b": b0}, "losses": [1.0]}
    plan = Plan.from_string("dp=2")
    ok = compare(plan, reference, {"state": noisy, "losses": [1.0]}, 1, None, "sgd")
    bad = compare(plan, reference, {"state": wrong, "losses": [1.0]}, 1, None, "sgd")
    assert ok.ok, ok.format()
    assert not bad.ok and bad.worst_param_rel == "b"
    adam = compare(plan, reference, {"state": wrong, "losses": [1.0]}, 1, None, "adamw")
    assert not adam.ok and "rerun with --optimizer sgd" in adam.format()
    assert "rerun with --optimizer sgd" in adam.to_dict()["hint"] and not bad.to_dict()["hint"]


@pytest.mark.parametrize("plan", ["dp_shard=2,zero=3", "dp_shard=2,zero=2"])
def test_a_unit_that_returns_a_view_trains_without_torchs_warning(plan):
    """A block ending in nn.Linear (bias, 3-D input) returns a view; FSDP2 warns of in-place
    writes to such outputs on every rank whether or not any happens; plait silences that
    warning alone (pytorch/pytorch#181832)."""
    from tests._workers_zero import warnings_of_a_step

    for seen in run_distributed(warnings_of_a_step, 2, plan, timeout=120):
        assert not [m for m in seen if "returned a view tensor" in m], seen


def test_the_memory_report_counts_gradients_and_state_of_trainable_parameters_only():
    """A LoRA-style model (a frozen base, small adapters) on one process: the closed form's
    gradients and AdamW state are those of the adapters, as measured (they were 4Ψ and 8Ψ,
    five to six times what the run holds)."""
    from plait.memory import MemoryTracker, memory_report
    from tests import _traffic_models as T

    model = T.MODELS["lora"]()
    opt = torch.optim.AdamW(model.parameters())
    tracker = MemoryTracker(model, opt)
    for _ in range(2):
        model(torch.randint(0, 8, (2, 8))).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    report = memory_report(tracker, Plan(), gather=False)
    measured, form = report["ranks"][0]["measured"], report["closed_form"]
    assert measured["grads"] < measured["params"] / 4  # mostly frozen
    for key in ("params", "grads"):
        assert measured[key] == form[key], (key, measured, form)
    steps = 4 * sum(p.requires_grad for p in model.parameters())  # AdamW's fp32 step counters
    assert measured["optimizer"] == form["optimizer"] + steps, (measured, form)
