"""The cost model against stored measurements of whole layouts on a CPU machine.

Each set in tests/data/planner_cpu/ holds 16 layouts of the ``tiny`` model at world 2 and 16 at
world 4 (DDP, ZeRO-1/2/3, TP+SP, pipelines and their compositions), every layout timed through
plait's runtime in fresh processes, in interleaved rounds beside calibration jobs, with every
calibration stored (``bench/planner_accuracy.py --calibrate --json``; trimmed: the step times,
calibrations, layouts and profile). Repricing them with the current cost model must keep the
accuracy targets: a change that predicts these real measurements worse fails here, in seconds.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from plait.plan import Plan
from plait.planner.cpu.measured import report_world

DATA = Path(__file__).resolve().parent / "data" / "planner_cpu"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "planner.md"

# The stored sets, and the targets not asserted on one of their worlds, with why. "barriers"
# timed each step between two barriers; the others ran steps back to back, as a user's loop
# does. "fsdp-probes" also carries the FSDP2 reduce / re-gather probes (the others price those
# terms at 0).
SETS: dict[str, dict[str, set[str]]] = {
    "barriers": {},
    "loop-a": {},
    # World 2's rank correlation is 0.75: that set's 1-KiB all-reduce probe measured 0.4-5.2 ms
    # from round to round, and its median prices every pipeline send and the clip all-reduce
    # about 5x dearer than the other sets, so two of its three pipelines come out 9-12% over
    # their measured time and swap ranks with the ZeRO layouts.
    "loop-b": {"2": {"spearman"}},
    "loop-c": {},
    "fsdp-probes": {},
}
TARGETS = {"median_abs_error": lambda v: v <= 0.15,
           "spearman": lambda v: v >= 0.8 - 1e-9,   # loop-c, world 2: exactly 0.8
           "pick_vs_best": lambda v: v <= 0.10}


def _raw(name: str, world: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())[world]


def _documented(name: str, world: str) -> list[str]:
    """docs/planner.md's "Current figures" row for a set and world: median |error|, Spearman,
    the pick's measured rank and the noise floor, as printed (bold marks dropped)."""
    for line in DOCS.read_text().splitlines():
        cells = [c.strip().replace("**", "") for c in line.strip().strip("|").split("|")]
        if cells[:2] == [name, world]:
            return [cells[2], cells[3], cells[4], cells[5]]
    raise AssertionError(f"docs/planner.md has no row for {name}, world {world}")


@pytest.mark.parametrize("name,world", [(n, w) for n in SETS for w in ("2", "4")])
def test_stored_sets_meet_the_targets(name, world, capsys):
    got = report_world(int(world), _raw(name, world), 0.0)
    assert len(got["rows"]) == 16
    for key, holds in TARGETS.items():
        if key not in SETS[name].get(world, set()):
            assert holds(got[key]), f"{name}, world {world}: {key} = {got[key]:.3f}"
    assert "median |error|" in capsys.readouterr().out
    # The page quotes these figures as what the current cost model gives: a cost-model change
    # that moves them must update the page.
    error, rho, rank, noise = _documented(name, world)
    assert error == f"{got['median_abs_error']:.1%}", (name, world, error)
    assert rho == f"{got['spearman']:.2f}", (name, world, rho)
    assert re.match(rf"\w+: {got['pick_rank']}(st|nd|rd|th) of 16", rank), (name, world, rank)
    assert noise == f"{got['noise_floor']:.1%}", (name, world, noise)


def test_fsdp_layouts_priced_with_their_reduce_and_regather(capsys):
    """The ZeRO-2/3 layouts (FSDP2) of the set with the reduce / re-gather probes: with the
    measured per-unit terms their median |error| is within 10% at both worlds (priced without
    them they come out 10-19% under their measured steps)."""
    for world in ("2", "4"):
        rows = report_world(int(world), _raw("fsdp-probes", world), 0.0)["rows"]
        errs = [abs(pred / meas - 1) for plan, pred, meas, *_ in rows
                if Plan.from_string(plan).zero >= 2]
        assert len(errs) >= 4
        assert statistics.median(errs) <= 0.10, (world, errs)
    capsys.readouterr()
