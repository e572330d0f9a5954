"""NaN/inf found on the step it appears, on every rank: stop naming the step and rank, or skip
the update everywhere; the hang watchdog: a rank that sleeps, skips or adds a collective is
named, and every rank exits. Real process groups (gloo)."""

import math

import pytest
import torch

from plait.diagnostics.watchdog import EXIT_HANG, desync_report
from plait.guard import StepGuard, check_policy
from plait.spawn import WorkerError, run_distributed
from tests import _workers_faults as w
from tests._ranks import run_ranks


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


def test_pipeline_nan_step_is_skipped_and_clean_steps_need_no_agreement():
    """The NaN enters the first stage's input and reaches the loss on the last stage only. The
    guard's flags travel in the pipeline's (loss sum, count) all-reduce: a clean step takes no
    agreement of its own, the bad one takes it (to name the rank) on every rank alike."""
    out = run_distributed(w.nan_on_step, 2, "pp=2", "skip", 0, 3, timeout=150)
    for r in out:
        assert r["skipped"] == [3]
        before, after = r["history"][1], r["history"][2]
        for name in before:
            assert torch.equal(before[name], after[name]), name
        assert all(math.isfinite(v) for v in r["losses"][3:])
        clean = r["issued"][1]
        assert r["issued"][3] == r["issued"][4] == clean, r["issued"]  # the first sets up
        assert r["issued"][2] == clean + 1, r["issued"]  # the full agreement, on step 3 only
        for name, value in r["history"][-1].items():  # this rank's stage
            assert torch.isfinite(value).all(), name
    with pytest.raises(WorkerError) as err:
        run_distributed(w.nan_on_step, 2, "pp=2", "stop", 0, 3, timeout=150)
    assert "NonFiniteError: step 3: non-finite loss on rank 1" in err.value.traceback


HANGS = """
import sys, time, torch, torch.nn as nn, torch.distributed as dist
from pathlib import Path
import plait
case, timeout, stamp = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
run = plait.init("dp=2", quiet=True, timeout=timeout)
torch.manual_seed(0)
model = run.parallelize(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
step = 0
def loss_fn(out, y):
    if case == "sleep" and run.rank == 1 and step == 3:
        stamp.write_text(str(time.time()))
        time.sleep(300)
    return nn.functional.mse_loss(out, y)
for step in range(1, 8):
    loss = run.step(model, (torch.randn(4, 8), torch.randn(4, 8)), loss_fn, opt)
    if case == "skip" and run.rank == 1 and step == 3:   # a metric all-reduce rank 1 skips
        stamp.write_text(str(time.time()))
    elif case == "extra" and run.rank == 0 and step == 3:  # one rank only, never waited for
        stamp.write_text(str(time.time()))
        dist.all_reduce(loss.clone(), async_op=True)
    elif case == "evaluate" and run.rank == 0 and step == 3:  # collective, called on one rank
        stamp.write_text(str(time.time()))
        run.evaluate(model, (torch.randn(4, 8), torch.randn(4, 8)), nn.functional.mse_loss)
    elif case == "skip":
        dist.all_reduce(loss.clone())
    elif case == "early" and run.rank == 1 and step == 3:  # a stop on a rank-local metric
        stamp.write_text(str(time.time()))
        break
if case == "finish" and run.rank == 0:  # a metric all-reduce after the loop, on rank 0 only
    stamp.write_text(str(time.time()))
    dist.all_reduce(torch.ones(1))
run.finish()
"""


def _hang_job(tmp_path, case, timeout=3.0):
    """How each rank ended (its stderr holds the report), and when, in seconds after the fault."""
    script, stamp = tmp_path / "hangs.py", tmp_path / "fault_at"
    script.write_text(HANGS)
    ended = run_ranks(script, case, str(timeout), str(stamp), timeout=120)
    assert stamp.exists(), ended[0].stderr[-2000:]
    fault = float(stamp.read_text())
    for e in ended:
        print(f"{case}: rank {e.rank} ended {e.at - fault:.1f} s after the fault, code {e.code}")
    return ended, [e.at - fault for e in ended]


def test_rank_sleeping_past_the_timeout_is_named(tmp_path):
    """Every rank ends by itself with the watchdog's exit code within its timeout plus a few
    seconds (not torch's 30 min), and every rank's report names the sleeping rank, the mesh
    axis and the step."""
    ended, after = _hang_job(tmp_path, "sleep")
    for e in ended:
        assert e.code == EXIT_HANG, e.stderr[-3000:]
        assert "step 3: rank(s) [1] did not reach the collective on mesh axis dp" in e.stderr, \
            e.stderr[-3000:]
    assert max(after) < 3.0 + 15


def test_rank_that_skips_a_collective_is_named(tmp_path):
    """Rank 1 skips one all-reduce between steps 3 and 4: rank 0 waits in it, rank 1 in the
    step-start check of step 4 (not in a collective that gloo would pair with rank 0's, which
    aborts a process when the sizes differ and mixes data when they match). Every rank exits
    with the watchdog's code, and the report names the rank, the collective, axis and step."""
    ended, after = _hang_job(tmp_path, "skip")
    line = HANGS.splitlines().index("        dist.all_reduce(loss.clone())") + 1
    for e in ended:
        assert e.code == EXIT_HANG, e.stderr[-3000:]
        assert "desync after step 3: rank(s) [1] issued fewer collectives on mesh axis " \
            f"dp_replicate than rank(s) [0], which wait in all_reduce (at hangs.py:{line})" \
            in e.stderr, e.stderr[-3000:]
    assert max(after) < 3.0 + 15


@pytest.mark.slow  # the step-start check of a skipped collective runs by default
def test_a_rank_waiting_in_finish_is_said_to_be_there(tmp_path):
    """Rank 0 issues a collective after the last step that rank 1 skips: rank 1 waits in
    finish()'s check, and the report says finish(), not a step 8 that does not exist."""
    ended, after = _hang_job(tmp_path, "finish")
    for e in ended:
        assert e.code == EXIT_HANG, e.stderr[-3000:]
        assert "desync after step 7: rank(s) [1] issued fewer collectives" in e.stderr, \
            e.stderr[-3000:]
        assert "in the check in finish() (after step 7)" in e.stderr, e.stderr[-3000:]
        assert "rank 1: finish() after step 7" in e.stderr and "step 8" not in e.stderr, \
            e.stderr[-3000:]
    assert max(after) < 3.0 + 15


@pytest.mark.slow  # its heartbeat reading runs by default (the test after it)
def test_a_loop_stopped_early_on_one_rank_is_named(tmp_path):
    """Rank 1 breaks out of the loop after step 3 (early stopping on a metric of its own
    rows) and calls finish() while rank 0 trains step 4: the report says so and how to
    decide alike on every rank, instead of the job hanging in rank 0's backward."""
    ended, after = _hang_job(tmp_path, "early")
    for e in ended:
        assert e.code == EXIT_HANG, e.stderr[-3000:]
        assert "rank(s) [1] left the training loop (finish() after step 3) while rank(s) [0] " \
            "train step 4" in e.stderr, e.stderr[-3000:]
        assert "run.all_reduce" in e.stderr, e.stderr[-3000:]
    assert max(after) < 3.0 + 15


def test_a_loop_left_on_some_ranks_only_is_named_from_the_heartbeats():
    # finish() reports as the step after the last (finishing): a rank at that step or later
    # that is not finishing is still training, so the loop ended on some ranks only.
    from plait.diagnostics.watchdog import _left_early

    beats = {0: {"step": 4, "finishing": False}, 1: {"step": 4, "finishing": True}}
    said = _left_early(beats)
    assert said is not None and said.startswith(
        "plait watchdog: rank(s) [1] left the training loop (finish() after step 3) while "
        "rank(s) [0] train step 4"), said
    # every rank in a step, every rank in finish(), or a rank's own collective after the same
    # last step (the desync report's case): not this
    assert _left_early({0: {"step": 4}, 1: {"step": 4}}) is None
    assert _left_early({0: {"step": 8, "finishing": True},
                        1: {"step": 8, "finishing": True}}) is None
    assert _left_early({0: {"step": 7}, 1: {"step": 8, "finishing": True}}) is None


@pytest.mark.slow  # a rank waiting in a collective its peer skipped runs by default
def test_evaluate_called_on_one_rank_is_reported_not_a_silent_hang(tmp_path):
    """run.evaluate is collective; called on rank 0 only, rank 0 waits in its all-reduce and
    the watchdog names rank 1 and rank 0's line instead of the job hanging for good."""
    ended, after = _hang_job(tmp_path, "evaluate")
    line = HANGS.splitlines().index("        run.evaluate(model, (torch.randn(4, 8), "
                                    "torch.randn(4, 8)), nn.functional.mse_loss)") + 1
    for e in ended:
        assert e.code == EXIT_HANG, e.stderr[-3000:]
        assert "rank(s) [1]" in e.stderr and f"hangs.py:{line}" in e.stderr, e.stderr[-3000:]
    assert max(after) < 3.0 + 15


def test_rank_that_adds_a_collective_is_named_at_the_next_step(tmp_path):
    """Rank 0 issues one all-reduce it never waits for: nothing hangs, and the step-start check
    of step 4 finds the counts apart at once."""
    ended, after = _hang_job(tmp_path, "extra", timeout=60.0)
    for e in ended:
        assert e.code == EXIT_HANG, e.stderr[-3000:]
        assert "desync before step 4: rank(s) [1] issued fewer collectives on mesh axis " \
            "dp_replicate than rank(s) [0] (rank 0: " in e.stderr, e.stderr[-3000:]
    assert max(after) < 15  # well before the 60 s timeout


def test_desync_report_names_ranks_axis_and_step():
    """The comparison behind the step-start check, on every rank's counts; pipeline axes, whose
    sends and receives differ legitimately from stage to stage, are left out."""
    members = {"dp": [0, 1], "pp": [0, 1]}
    counts = {0: {"dp": 14, "pp": 6}, 1: {"dp": 13, "pp": 9}}
    assert "desync before finish(): rank(s) [1]" in desync_report(4, counts, members,
                                                                   finishing=True)
    report = desync_report(4, counts, members)
    assert report is not None and report.startswith(
        "plait watchdog: desync before step 4: rank(s) [1] issued fewer collectives on mesh "
        "axis dp than rank(s) [0] (rank 0: 14, rank 1: 13) in step 3 or after it"), report
    counts[1]["dp"] = 14
    assert desync_report(4, counts, members) is None
    # a rank outside this rank's group is not compared with it
    assert desync_report(4, {**counts, 2: {"dp": 2}}, members) is None


def test_inf_gradient_with_a_finite_loss_is_skipped_on_every_rank():
    """Only rank 1's gradient turns inf; the loss stays finite on both ranks. Under ZeRO-3 the
    inf may reach only some gradient shards, yet the clipped norm is the job-wide one."""
    plan = "zero=3,dp_shard=2"
    out = run_distributed(w.inf_grad_on_step, 2, plan, "skip", 1, 3, timeout=150)
    for r in out:
        assert r["skipped"] == [3]
        before, after = r["history"][1], r["history"][2]
        for name in before:
            assert torch.equal(before[name], after[name]), name
        for name, value in r["history"][-1].items():
            assert torch.isfinite(value).all(), name
    with pytest.raises(WorkerError) as err:
        run_distributed(w.inf_grad_on_step, 2, plan, "stop", 1, 3, timeout=150)
    # the clipped norm is the job's, the same on every rank: no rank to name for it
    assert "NonFiniteError: step 3: non-finite gradient norm: stopped" in err.value.traceback


def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """The stop request of one rank reaches the others in the step's own all-reduce."""
    out = run_distributed(w.stop_on_one_rank, 2, "dp=2", str(tmp_path / "ckpt"), 3,
                          timeout=150)
    assert [r["code"] for r in out] == [143, 143]
    assert [r["steps"] for r in out] == [3, 3]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-00000003"]


def test_sigterm_on_one_host_stops_every_host_where_only_the_stop_is_agreed():
    """PyTorch/XLA's hosts agree on the stop request alone after each step, on the host."""
    out = run_distributed(w.agree_stop_between_hosts, 2, timeout=120)
    assert out == [[False, True, True], [False, True, True]]


def test_clean_ddp_step_adds_one_collective_to_raw_ddps():
    """A clean plait DDP step issues raw DDP's collectives plus one: the all-reduce of (loss
    sum, item count), which also carries the step guard's flags (no agreement of its own)."""
    out = run_distributed(w.collectives_per_step, 2, timeout=120)
    for r in out:
        assert r["raw"] >= 1
        assert r["plait"] == r["raw"] + 1, r


def test_desync_check_can_be_turned_off():
    """``desync_check=False`` keeps the hang watchdog but drops its per-step all-gather."""
    on = run_distributed(w.desync_check_switch, 2, True, timeout=120)
    off = run_distributed(w.desync_check_switch, 2, False, timeout=120)
    assert all(r["watchdog"] and r["check"] for r in on)
    assert all(r["watchdog"] and not r["check"] for r in off)
    assert [r["losses"] for r in on] == [r["losses"] for r in off]


def test_a_script_ending_on_an_error_leaves_no_process_group_behind():
    """A run that ends on an exception before finish() (a NonFiniteError under "stop") is
    closed at exit without a barrier: its group's threads left to static destruction
    sometimes ended the rank with SIGABRT after its traceback. Checked from an exit handler
    registered before plait.init (exit handlers run last-registered first)."""
    import subprocess
    import sys

    script = ("import atexit, torch.distributed as dist, plait\n"
              "atexit.register(lambda: print('group at exit:', dist.is_initialized()))\n"
              "run = plait.init('single', quiet=True)\n"
              "raise RuntimeError('the script fails')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "the script fails" in out.stderr, out.stderr[-2000:]
    assert "group at exit: False" in out.stdout, out.stdout + out.stderr[-2000:]
