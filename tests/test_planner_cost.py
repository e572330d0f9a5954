"""The step time's measured terms (per parameter tensor, per FSDP2 unit) added where the
runtime pays them."""

import pytest

from plait.plan import Plan
from plait.planner.cost import Constants, Workload, evaluate
from plait.planner.hardware import load_cluster
from plait.planner.model_stats import load_model


def test_per_tensor_and_per_unit_terms():
    m, c = load_model("tiny"), load_cluster("cpu", devices=2)
    work = Workload(16, 32)
    k = Constants(tensor_step_s=1e-3, dtensor_step_s=1e-2, fsdp_unit_s=0.1, overlap=False)
    base = Constants(overlap=False)
    ddp = evaluate(Plan(dp_replicate=2), m, c, work, k)
    assert ddp.time_breakdown["per_tensor"] == pytest.approx(39 * 1e-3)
    z2 = evaluate(Plan(dp_shard=2, zero=2, grad_accum=2), m, c, work, k)
    assert z2.time_breakdown["per_tensor"] == pytest.approx(39 * 1e-2)
    z2_base = evaluate(Plan(dp_shard=2, zero=2, grad_accum=2), m, c, work, base)
    # + 39 DTensors x 10 ms, + 5 FSDP units x 100 ms in each of 2 micro-steps
    assert z2.step_time_s - z2_base.step_time_s == pytest.approx(0.39 + 5 * 0.1 * 2)
    # FSDP2 units cost only where they shard: replicated DP over TP runs through FSDP2 with
    # shard groups of one rank (nothing to gather), and is charged like its twin without them
    c4 = load_cluster("cpu", devices=4)
    units = Constants(overlap=False, fsdp_unit_s=0.1)
    rep_tp = Plan(dp_replicate=2, tp=2)
    assert evaluate(rep_tp, m, c4, work, units).step_time_s == pytest.approx(
        evaluate(rep_tp, m, c4, work, base).step_time_s)
    hsdp = Plan(dp_replicate=2, dp_shard=2, zero=3)
    assert evaluate(hsdp, m, c4, work, units).step_time_s == pytest.approx(
        evaluate(hsdp, m, c4, work, base).step_time_s + 5 * 0.1)
    # FSDP2's post-backward per unit and gradient sync (once per optimizer step without a
    # pipeline: no sync while accumulating), ZeRO-3's backward re-gather per block and
    # micro-step; a pipeline syncs every stage in turn (no overlap) and re-gathers per microbatch
    fk = Constants(overlap=False, fsdp_reduce_s=0.1, fsdp_regather_s=0.01)
    for plan, world, extra in ((Plan(dp_shard=2, zero=2, grad_accum=2), 2, 5 * 0.1),
                               (Plan(dp_shard=2, zero=3, grad_accum=2), 2, 5 * 0.1 + 4 * 2 * 0.01),
                               (Plan(dp_shard=2, zero=1, grad_accum=2), 2, 0.0),
                               (Plan(pp=2, dp_shard=2, zero=3, microbatches=2), 4,
                                2 * 3 * 0.1 + 2 * 2 * 0.01)):
        cw = c if world == 2 else c4
        assert evaluate(plan, m, cw, work, fk).step_time_s == pytest.approx(
            evaluate(plan, m, cw, work, base).step_time_s + extra), plan.describe()
    micro = evaluate(Plan(dp_replicate=2, grad_accum=4), m, c, work,
                     Constants(overlap=False, micro_overhead_s=0.01))
    plain = evaluate(Plan(dp_replicate=2, grad_accum=4), m, c, work, base)
    assert micro.step_time_s - plain.step_time_s == pytest.approx(4 * 0.01)
