"""Published figures the planner is held to (Narayanan et al. 2021, Megatron-LM)."""



from plait.planner.cost import evaluate
from plait.planner.published import NARAYANAN_2021, megatron_flops, row_setup
from plait.planner.search import search


def test_megatron_145b_within_20_percent_and_planner_no_worse():
    row = next(r for r in NARAYANAN_2021 if r.params_b == 145.6)
    model, cluster, work, plan = row_setup(row)
    assert (plan.tp, plan.pp, plan.dp) == (8, 8, 24)
    e = evaluate(plan, model, cluster, work)
    assert e.feasible, e.reason
    flops = megatron_flops(row.batch, 2048, row.layers, row.hidden, 51200)
    tflops = flops / e.step_time_s / row.gpus / 1e12
    assert abs(tflops / 148 - 1) <= 0.20, tflops
    pick = search(model, cluster, work, top=1).best
    assert pick.step_time_s <= e.step_time_s
