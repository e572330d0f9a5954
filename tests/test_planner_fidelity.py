"""The cost model against stored measurements of this project's CPU machine.

``bench/planner_accuracy.py --calibrate --json`` stores every step time and calibration it
took; ``--reprice`` prices them again with the current cost model. Here the stored runs 9 and
14-17 (16 layouts at world 2 and 16 at world 4 each, every layout timed in fresh processes,
docs/planner.md) are repriced, and the issue's fidelity targets must still hold: a change to
the cost model that makes it predict these real measurements worse fails here, in seconds,
without timing anything.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import planner_accuracy
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return planner_accuracy


# The stored runs (bench/planner_accuracy_cpu_run<N>.json) and the targets not asserted on one
# of their worlds, with why. Runs 9-13 timed each step between two barriers, runs 14-17 back to
# back (as a user's loop runs); run 17 was measured with this cost model, and is the first with
# the FSDP2 reduce / re-gather probe (the terms are 0 for the others).
RUNS: dict[int, dict[str, set[str]]] = {
    9: {},
    14: {},
    # World 2's rank correlation is 0.75: that run's 1-KiB all-reduce measured 0.4-5.2 ms from
    # round to round (0.5-1.8 ms in runs 13-14), and its median prices every pipeline send and
    # the clip all-reduce 5x dearer than in other runs, so two of its three pipelines come out
    # 9-12% over their measured time and swap ranks with the ZeRO layouts (docs/planner.md,
    # "What is still off"; since run 16 the probe runs in every job).
    15: {"2": {"spearman"}},
    16: {},
    17: {},
}
TARGETS = {"median_abs_error": lambda v: v <= 0.15,
           "spearman": lambda v: v >= 0.8 - 1e-9,   # run 16, world 2: exactly 0.8
           "pick_vs_best": lambda v: v <= 0.10}


@pytest.mark.parametrize("run,world", [(r, w) for r in RUNS for w in ("2", "4")])
def test_stored_runs_meet_the_targets(bench, run, world, capsys):
    path = ROOT / "bench" / f"planner_accuracy_cpu_run{run}.json"
    raw = json.loads(path.read_text())["measured"][world]["raw"]
    got = bench.report_world(int(world), raw, 0.0)
    assert len(got["rows"]) == 16
    for key, holds in TARGETS.items():
        if key not in RUNS[run].get(world, set()):
            assert holds(got[key]), f"run {run}, world {world}: {key} = {got[key]:.3f}"
    assert "median |error|" in capsys.readouterr().out


def test_fsdp_layouts_priced_with_their_reduce_and_regather(bench, capsys):
    """Run 17's ZeRO-2/3 layouts (FSDP2): with the measured per-unit reduce and re-gather
    terms their median |error| is within 10% at both worlds; priced without them (as before
    run 17) they came out 10-19% under their measured steps (median 13-14%)."""
    import statistics

    from plait.plan import Plan

    path = ROOT / "bench" / "planner_accuracy_cpu_run17.json"
    for world in ("2", "4"):
        raw = json.loads(path.read_text())["measured"][world]["raw"]
        rows = bench.report_world(int(world), raw, 0.0)["rows"]
        errs = [abs(pred / meas - 1) for plan, pred, meas, *_ in rows
                if Plan.from_string(plan).zero >= 2]
        assert len(errs) >= 4
        assert statistics.median(errs) <= 0.10, (world, errs)
    capsys.readouterr()
