"""The processor-sharing pipeline simulation (plait.planner.cpu.sharing) and its use by the cost
model when processes outnumber cores."""

from __future__ import annotations

import dataclasses

import pytest

from plait.plan import Plan
from plait.planner.cost import Constants, Workload, evaluate
from plait.planner.cpu.sharing import shared_pipeline_time, stage_order
from plait.planner.hardware import load_cluster
from plait.planner.model_stats import load_model


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (2, 4), (4, 4), (4, 8), (3, 5)])
def test_no_sharing_gives_the_closed_form(schedule, p, m):
    """A core per process: balanced stages take (m + p - 1) x (forward + backward)."""
    f, b = 1.0, 2.0
    got = shared_pipeline_time([f] * p, [b] * p, m, replicas=1, cores=p, schedule=schedule)
    assert got == pytest.approx((m + p - 1) * (f + b))


def test_one_core_runs_the_work_back_to_back():
    """Two stages on one core, one microbatch: F0, F1, B1, B0 in sequence, nothing overlaps
    and nothing is lost: 1 + 1 + 2 + 2 seconds (at half a core each the closed form says 12)."""
    assert shared_pipeline_time([1.0, 1.0], [2.0, 2.0], 1, replicas=1, cores=1) == \
        pytest.approx(6.0)


@pytest.mark.parametrize("p,replicas,m", [(2, 2, 2), (2, 2, 8), (4, 1, 4), (4, 1, 16)])
def test_shared_time_lies_between_the_bounds(p, replicas, m):
    """With half a core per process: no faster than the total work over the cores or the
    critical path on whole cores; no slower than the closed form at half speed."""
    cores = p * replicas / 2
    f, b = 1.0, 2.0
    got = shared_pipeline_time([f] * p, [b] * p, m, replicas=replicas, cores=cores)
    work = p * replicas * m * (f + b) / cores
    critical = (m + p - 1) * (f + b)
    assert max(work, critical) - 1e-9 <= got <= 2 * critical + 1e-9


def test_stage_orders():
    assert stage_order("1f1b", 0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1),
                                             ("B", 2)]
    assert stage_order("1f1b", 1, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                                             ("B", 2)]
    assert stage_order("gpipe", 0, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_cost_model_frees_the_bubble_only_when_cores_are_shared():
    """pp=2 x dp=2 on 4 devices: with a core each the 1F1B closed form holds; on 2 cores the
    idle stages' cores go to the busy ones, so the pipeline is faster than the closed form at
    half speed (twice the whole-core time) and no faster than its work over the cores."""
    model, work = load_model("tiny"), Workload(16, 128)
    k = Constants(overlap=False)
    plan = Plan(pp=2, dp_replicate=2, microbatches=2)
    base = load_cluster("cpu", devices=4).with_world(4)
    own = dataclasses.replace(base, compute_units=4)
    shared = dataclasses.replace(base, compute_units=2)
    t_own = evaluate(plan, model, own, work, k).time_breakdown
    t_shared = evaluate(plan, model, shared, work, k).time_breakdown
    m = 2
    # half a core per process: the per-microbatch compute doubles (the p2p sends do not) ...
    assert t_shared["compute_per_microbatch"] == pytest.approx(
        2 * t_own["compute_per_microbatch"], rel=0.05)
    # ... but the pipeline does not: the bubble's cores are used
    assert t_shared["pipeline"] < 2 * t_own["pipeline"] * 0.95
    assert t_shared["pipeline"] >= 0.8 * m * t_shared["compute_per_microbatch"]
    # no pipeline, no change: all processes are busy all the time
    dp = Plan(dp_replicate=4)
    assert evaluate(dp, model, shared, work, k).time_breakdown["pipeline"] == pytest.approx(
        2 * evaluate(dp, model, own, work, k).time_breakdown["pipeline"])


@pytest.mark.parametrize("p,replicas,cores", [(2, 2, 2), (4, 1, 2), (3, 2, 3)])
def test_long_runs_are_extrapolated_from_the_steady_state(p, replicas, cores):
    """Past 3p + 2 microbatches the time is extrapolated; it matches the full simulation."""
    from plait.planner.cpu.sharing import _simulate

    f, b = [1.0 + 0.1 * r for r in range(p)], [2.0 + 0.3 * r for r in range(p)]
    for m in (3 * p + 3, 40):
        exact = _simulate(f, b, m, replicas, cores, "1f1b")
        assert shared_pipeline_time(f, b, m, replicas=replicas, cores=cores) == pytest.approx(
            exact, rel=0.01)


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (2, 3, 6),
                                   (4, 2, 6)])
def test_interleaved_order_is_torchs(p, v, m):
    """rank_ops follows torch.distributed.pipelining's ScheduleInterleaved1F1B action for action
    (its order table, built without stages: the private method needs only four attributes)."""
    from torch.distributed.pipelining import schedules

    from plait.planner.cpu.sharing import rank_ops

    sched = object.__new__(schedules.ScheduleInterleaved1F1B)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
    sched.microbatches_per_round = m // max(1, m // p)
    for rank in range(p):
        theirs = [("F" if a.computation_type == schedules._ComputationType.FORWARD else "B",
                   a.stage_index, a.microbatch_index)
                  for a in sched._calculate_single_rank_operations(rank) if a is not None]
        assert rank_ops("interleaved", rank, p, v, m) == theirs


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (2, 3, 6)])
def test_interleaved_with_a_core_per_rank_gives_megatrons_closed_form(p, v, m):
    """Balanced chunks (f, b per chunk), a core per rank: (m v + p - 1)(f + b),
    the interleaved schedule's bubble being (p - 1) chunk times (Narayanan et al. 2021)."""
    f, b = 1.0, 2.0
    got = shared_pipeline_time([f] * (p * v), [b] * (p * v), m, replicas=1, cores=p,
                               schedule="interleaved", ranks=p)
    assert got == pytest.approx((m * v + p - 1) * (f + b))


def test_looped_bfs_runs_every_microbatch_through_a_chunk_first():
    from plait.planner.cpu.sharing import rank_ops

    assert rank_ops("looped_bfs", 1, 2, 2, 2) == [
        ("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("F", 3, 1),
        ("B", 3, 0), ("B", 3, 1), ("B", 1, 0), ("B", 1, 1)]


def test_chunk_times_must_split_over_the_ranks():
    with pytest.raises(ValueError, match="split evenly over 2 ranks"):
        shared_pipeline_time([1.0] * 3, [2.0] * 3, 2, replicas=1, cores=1, ranks=2)
