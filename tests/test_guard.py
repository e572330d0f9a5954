"""NaN/inf found on the step it appears, on every rank: stop naming the step and rank, or skip
the update everywhere. Real process groups (gloo)."""

import math

import pytest
import torch

from plait.guard import StepGuard, check_policy
from plait.spawn import WorkerError, run_distributed
from tests import _workers_faults as w


def test_policy_is_checked():
    with pytest.raises(ValueError, match="nonfinite='ignore'"):
        check_policy("ignore")


def test_one_process_guard_needs_no_group():
    guard = StepGuard("skip", rank=0, world_size=1)
    assert guard(torch.tensor(1.0), torch.tensor(2.0))
    assert not guard(torch.tensor(float("inf")), torch.tensor(2.0))
    assert guard.last.bad_loss_rank == 0 and guard.last.bad_grad_rank is None


def test_nan_stops_the_job_naming_step_and_rank():
    with pytest.raises(WorkerError) as err:
        run_distributed(w.nan_on_step, 2, "dp=2", "stop", 1, 3, timeout=120)
    assert "NonFiniteError: step 3: non-finite loss on rank 1" in err.value.traceback


@pytest.mark.parametrize("plan", ["dp=2", "zero=3,dp_shard=2"])
def test_nan_step_is_skipped_on_every_rank(plan):
    """The NaN enters one rank's loss only; with ZeRO-3 the other rank's gradient shard can
    stay finite, so only an agreement keeps the ranks' parameters alike."""
    out = run_distributed(w.nan_on_step, 2, plan, "skip", 1, 3, timeout=150)
    for r in out:
        assert r["skipped"] == [3]
        before, after = r["history"][1], r["history"][2]
        for name in before:  # the skipped step changed nothing
            assert torch.equal(before[name], after[name]), name
        assert all(math.isfinite(v) for v in r["losses"][3:])
        for name, value in r["history"][-1].items():
            assert torch.isfinite(value).all(), name
    for name, value in out[0]["history"][-1].items():
        assert torch.equal(value, out[1]["history"][-1][name]), name


def test_rank_sleeping_past_the_timeout_is_named(tmp_path):
    """Every rank ends within the watchdog's timeout plus a few seconds (not torch's 30 min),
    and the report names the sleeping rank, the mesh axis and the step."""
    import time

    stamp = tmp_path / "slept_at"
    with pytest.raises(WorkerError) as err:
        run_distributed(w.sleeps_in_step, 2, 3.0, str(stamp), timeout=120)
    detected = time.time() - float(stamp.read_text())
    report = err.value.traceback
    print(f"watchdog timeout 3 s: every rank ended {detected:.1f} s after the stall")
    assert "exited with code 124" in report
    assert "step 3: rank(s) [1] did not reach the collective on mesh axis dp" in report, report
    assert detected < 3.0 + 15


def test_desync_is_named_from_step_start_counts():
    """A rank that skipped a collective starts the next step with a lower count on that axis;
    rank 0's watchdog names it (the comparison, on the heartbeats as ranks publish them)."""
    import json

    import torch.distributed as dist

    from plait.diagnostics.watchdog import Watchdog

    store = dist.HashStore()
    dog = Watchdog(store, rank=0, world_size=2, groups={}, prefix="w")
    dog._members = {"dp": [0, 1], "pp": [0, 1]}
    dog._marks.extend([(3, {"dp": 10, "pp": 4}), (4, {"dp": 14, "pp": 6})])
    peer = {"marks": [[3, {"dp": 10, "pp": 5}], [4, {"dp": 13, "pp": 9}]]}
    store.set("w/1", json.dumps(peer))
    report = dog._desync()
    assert report is not None and "desync before step 4: rank 1 had issued 13 collectives on " \
        "mesh axis dp, rank 0 14" in report, report
    peer["marks"][1][1]["dp"] = 14  # equal counts; pipeline sends may differ legitimately
    store.set("w/1", json.dumps(peer))
    assert dog._desync() is None
