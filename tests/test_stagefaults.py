"""A user's error raised on one rank only ends the whole job promptly, as that error: its type,
its message and the user's line, naming the rank, under every layout, through
``plait.spawn.run_distributed`` and ``plait run``. Real processes; each with a timeout, so that
a hang fails the test instead of stalling it."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait.spawn import WorkerError, run_distributed
from tests import _workers_stagefaults as w

ROOT = Path(__file__).resolve().parents[1]
PP = "pp=2,microbatches=2"
LAYOUTS = ("dp=2", "dp_shard=2,zero=3", "tp=2", PP, f"{PP},pp_schedule=gpipe", "cp=2")


def _fails_as_the_users_error(plan: str, where: str, bad: int) -> float:
    """Seconds until the job ended with ``bad``'s own error."""
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        run_distributed(w.fault_on_one_rank, 2, plan, where, bad, timeout=60)
    took = time.monotonic() - start
    err = caught.value
    case = (plan, where, bad, err.kind, err.traceback[-1500:])
    assert err.rank == bad and err.kind == "UserBugError", case
    assert f"boom in {'the loss' if where == 'loss' else where}" in err.message or \
        where in ("getitem", "loop"), case
    assert "_workers_stagefaults.py" in err.traceback, case
    return took


def test_an_error_in_a_pipeline_stage_is_the_users_own() -> None:
    # torch's pipeline stage raises a RuntimeError of its own in place of an error a stage's
    # forward or backward raises ("failed to run forward", "Failed to run stage backward"),
    # the user's only its __cause__: the job failed as "RuntimeError:" (WorkerError.kind
    # 'RuntimeError'), and `plait run` showed neither the user's error nor their line.
    for plan, where, bad in ((PP, "forward", 1), (f"{PP},pp_schedule=gpipe", "backward", 0)):
        _fails_as_the_users_error(plan, where, bad)


@pytest.mark.slow
def test_an_error_on_one_rank_ends_every_layout_promptly() -> None:
    for plan in LAYOUTS:
        run_distributed(w.fault_on_one_rank, 2, plan, "", 0, timeout=60)  # runs without one
        for where in w.PLACES:
            for bad in (0, 1):
                if plan.startswith("pp") and where == "loss" and bad == 0:
                    continue  # the first stage computes no loss
                took = _fails_as_the_users_error(plan, where, bad)
                assert took < 30, (plan, where, bad, took)


SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
from tests import _workers_stagefaults as w
w.fault_on_one_rank(int(os.environ["RANK"]), 2, sys.argv[1], sys.argv[2], int(sys.argv[3]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("plan,where,bad", [(PP, "forward", 0), (PP, "forward", 1),
                                            (PP, "loss", 1), (f"{PP},pp_schedule=gpipe",
                                                              "backward", 1),
                                            ("dp=2", "getitem", 1)])
def test_plait_run_shows_the_failing_ranks_own_error(tmp_path, plan, where, bad) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(root=str(ROOT)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "plait.cli", "run", "--nproc", "2",
                           str(script), plan, where, str(bad)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said[-3000:]
    assert f"failed: rank {bad} (UserBugError" in said, said[-3000:]
    assert said.count("UserBugError: boom") >= 1 and "_workers_stagefaults.py" in said, \
        said[-3000:]
