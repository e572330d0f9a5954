"""Pipeline timing (plait.planner.pipeline): the bubble, the stage partition, gradient syncs
through the stages and the zero-bubble split."""

import random

import pytest

from plait.partition import balanced_partition
from plait.plan import Plan
from plait.planner.cost import Constants, Workload, evaluate
from plait.planner.hardware import load_cluster
from plait.planner.model_stats import load_model


def test_pipeline_bubble_formula():
    # uniform stages, 1F1B: bubble = (p-1)/(m+p-1); interleaved v: (p-1)/(v m + p-1)
    m = load_model("test").__class__(**{**load_model("test").__dict__, "vocab": 1,
                                         "embed_params": 0, "head_params": 0})
    c = load_cluster("cpu", devices=4).with_memory(1e12)
    # a core per process (compute_units=None): the closed forms are for dedicated devices;
    # shared cores are priced by simulation (tests/test_planner_sharing.py)
    c = c.__class__(**{**c.__dict__, "intra_latency": 0.0, "inter_latency": 0.0,
                       "intra_bw": 1e30, "inter_bw": 1e30, "hbm_bw": 1e30,
                       "compute_units": None})
    work = Workload(8, 32)
    e = evaluate(Plan(pp=4, microbatches=8), m, c, work)
    assert e.feasible, e.reason
    assert e.bubble_fraction == pytest.approx(3 / 11, rel=1e-2)
    e = evaluate(Plan(pp=2, microbatches=8, pp_schedule="interleaved_1f1b", virtual_stages=2),
                 m, c.with_world(2), Workload(8, 32))
    assert e.feasible, e.reason
    assert e.bubble_fraction == pytest.approx(1 / 17, rel=1e-2)


def _brute_partition(costs, parts):
    best = None
    n = len(costs)

    def rec(start, k, sizes):
        nonlocal best
        if k == 1:
            sizes = sizes + [n - start]
            chunks, i = [], 0
            for s in sizes:
                chunks.append(sum(costs[i:i + s]))
                i += s
            if best is None or max(chunks) < best - 1e-12:
                best = max(chunks)
            return
        for size in range(1, n - start - k + 2):
            rec(start + size, k - 1, sizes + [size])

    rec(0, parts, [])
    return best


def test_balanced_partition_is_optimal_and_relieves_heavy_ends():
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(2, 9)
        k = rng.randint(1, n)
        costs = [rng.uniform(0.5, 3) for _ in range(n)]
        sizes = balanced_partition(costs, k)
        assert len(sizes) == k and sum(sizes) == n and min(sizes) >= 1
        i, worst = 0, 0.0
        for s in sizes:
            worst = max(worst, sum(costs[i:i + s]))
            i += s
        assert worst == pytest.approx(_brute_partition(costs, k))
    sizes = balanced_partition([3.0] + [1.0] * 14 + [3.0], 4)
    assert sizes[0] < sizes[1] and sizes[-1] < sizes[-2]


def test_blocking_gradient_syncs_chain_through_the_pipeline_stages():
    # pp=2 x dp=2: each stage all-reduces its own gradients inside its last backward. Blocking
    # (overlap off: CPU + gloo), the last microbatch's backward waits for stage 1's sync before
    # stage 0 can run, then stage 0 syncs: both stages' syncs are exposed. With overlap (GPUs)
    # only the last stage to finish is charged, and only what its backward does not hide.
    from plait.comm.volumes import Traffic
    from plait.planner.traffic import collective_time

    m = load_model("tiny")
    c = load_cluster("cpu", devices=4).with_memory(1e12)
    work = Workload(16, 128)
    plan = Plan(pp=2, dp_replicate=2, microbatches=2)
    blocking = Constants(overlap=False)
    e = evaluate(plan, m, c, work, blocking)
    assert e.feasible, e.reason
    params = [m.embed_params + 2 * m.block_params, 2 * m.block_params + m.head_params]
    # one bucket per stage (under 25 MiB); dp_replicate's rank stride is tp x dp_shard = 1
    syncs = [collective_time(Traffic("dp_replicate", "all_reduce", 4 * p, 1, 2, "grads"), c, 1,
                             blocking) for p in params]
    assert e.time_breakdown["dp_grad_exposed"] == pytest.approx(sum(syncs), rel=1e-6)
    # the busiest rank (stage 1: the head) is the one charged without the chain
    assert e.time_breakdown["dp_grad_total"] == pytest.approx(syncs[1], rel=1e-6)
    # a single stage has nothing to chain: its one sync, as before
    flat = evaluate(Plan(dp_replicate=4), m, c, work, blocking)
    assert flat.time_breakdown["dp_grad_exposed"] == flat.time_breakdown["dp_grad_total"]
    overlapped = evaluate(plan, m, c, work, Constants(overlap=True))
    assert overlapped.time_breakdown["dp_grad_exposed"] <= max(syncs)


def test_zero_bubble_split_costs_per_chunk_and_per_backward():
    m = load_model("tiny")
    c = load_cluster("cpu", devices=2).with_memory(1e12)
    c = c.__class__(**{**c.__dict__, "compute_units": None})  # a core each: the closed form
    work = Workload(16, 128)
    plan = Plan(pp=2, pp_schedule="zbv", virtual_stages=2, microbatches=4)
    base = Constants(overlap=False)
    split = Constants(overlap=False, zb_call_s=1e-3, zb_backward_factor=0.5)
    e0, e1 = evaluate(plan, m, c, work, base), evaluate(plan, m, c, work, split)
    # per rank and microbatch: its 2 chunks' calls + half its 2 blocks' backward FLOP time
    rate = c.peak("fp32") * base.compute_efficiency
    fwd_block = m.block_flops_per_token(128) * 4 * 128  # microbatch 4 x seq 128
    extra = 2 * 1e-3 + 2 * 0.5 * 2 * fwd_block / rate
    assert e1.time_breakdown["compute_per_microbatch"] - e0.time_breakdown[
        "compute_per_microbatch"] == pytest.approx(extra, rel=1e-6)
    # other schedules do not split the backward
    f1b = Plan(pp=2, microbatches=4)
    assert evaluate(f1b, m, c, work, split).step_time_s == evaluate(f1b, m, c, work,
                                                                    base).step_time_s


def test_zero_bubble_with_checkpointing_replays_per_parameter_tensor():
    m, c = load_model("tiny"), load_cluster("cpu", devices=2)
    work = Workload(16, 32)
    tokens = 16 * 32
    for schedule, replays in (("zbv", 1 + m.block_tensors), ("interleaved_1f1b", 1)):
        e = evaluate(Plan(pp=2, pp_schedule=schedule, virtual_stages=2, microbatches=2,
                          activation_checkpointing="full"), m, c, work)
        expected = (m.model_flops(tokens, 32, recompute_layers=replays * m.n_layers)
                    / m.model_flops(tokens, 32))
        assert e.tflops_per_device_hw / e.tflops_per_device == pytest.approx(expected)


# ---------------------------------------------- zero-bubble schedules with data replicas
def _zb_and_1f1b(**layout):
    m, c, w = load_model("llama-8b"), load_cluster("dgx-h100", devices=16), Workload(64, 4096)
    base = dict(layout, pp=4, microbatches=16, mixed_precision="bf16")
    return (evaluate(Plan(**base, pp_schedule="zbv", virtual_stages=2), m, c, w),
            evaluate(Plan(**base), m, c, w))


@pytest.mark.parametrize("layout", [dict(dp_replicate=4), dict(dp_shard=4, zero=1),
                                    dict(dp_replicate=2, cp=2)])
def test_zero_bubble_waits_for_the_gradient_average_after_the_schedule(layout):
    """Under ZB-V at zero=0/1 the data (and cp) ranks average the gradients once per step
    after the schedule (PipelineRunner.sync_data_gradients): no backward hides it, and each pp
    rank averages its own stages' at once, so the step waits for the slowest rank's whole
    average. 1F1B's DDP buckets run under the last backward instead."""
    zb, one = _zb_and_1f1b(**layout)
    assert zb.feasible and one.feasible, (zb.reason, one.reason)
    assert zb.time_breakdown["dp_grad_exposed"] >= zb.time_breakdown["dp_grad_total"] > 0
    assert one.time_breakdown["dp_grad_exposed"] < one.time_breakdown["dp_grad_total"]
    assert any("after the schedule" in n for n in zb.notes), zb.notes


def test_zero_bubble_under_zero2_waits_for_the_reduce_scatter():
    """Under ZeRO-2 FSDP2 reduce-scatters each stage's gradients after its last weight pass,
    and those passes end a zero-bubble schedule: charged in full, where 1F1B's hides under
    the last backward."""
    zb, one = _zb_and_1f1b(dp_shard=4, zero=2)
    assert zb.feasible and one.feasible, (zb.reason, one.reason)
    assert zb.time_breakdown["dp_grad_exposed"] >= zb.time_breakdown["dp_grad_total"] > 0
    assert one.time_breakdown["dp_grad_exposed"] < one.time_breakdown["dp_grad_total"]
    assert any("last weight-gradient pass" in n for n in zb.notes), zb.notes


def test_zero_bubble_ranks_hold_the_v_placement():
    """ZB-V's rank 0 holds the first and the last stage (the embedding and the head), as the
    runtime places them (plait.parallel.schedules.stage_to_rank); the planner's shares,
    memory and traffic follow that placement, not the round-robin one."""
    from plait.planner.pipeline import chunk_placement

    plan = Plan(pp=4, microbatches=8, pp_schedule="zbv", virtual_stages=2)
    assert [tuple(c) for c in chunk_placement(plan, 8)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    looped = Plan(pp=4, microbatches=8, pp_schedule="interleaved_zb", virtual_stages=2)
    assert [tuple(c) for c in chunk_placement(looped, 8)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
