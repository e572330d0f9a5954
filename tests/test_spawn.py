"""The multi-process helper itself: results, errors and hangs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait.lifecycle import descendants
from plait.lifecycle import running as alive
from plait.spawn import WorkerError, run_distributed, user_errors
from tests import workers

ROOT = Path(__file__).resolve().parents[1]


def test_results_come_back_per_rank():
    out = run_distributed(workers.all_reduce_rank, 2)
    assert [t.tolist() for t in out] == [[1.0, 1.0], [1.0, 1.0]]


def test_failing_rank_is_reported():
    with pytest.raises(WorkerError) as err:
        run_distributed(workers.fail_on_rank, 2, 1)
    assert err.value.rank == 1 and "boom on rank 1" in err.value.traceback


def test_a_rank_that_crashes_in_native_code_is_named_with_its_signal():
    """A rank killed by a signal says which: a segfault is a crash, not the collective
    mismatch an abort in gloo usually is. Each rank has faulthandler on, so the Python stack it
    died in goes to its stderr (the fork server's, which a test cannot capture)."""
    with pytest.raises(WorkerError) as err:
        run_distributed(workers.crash_on_rank, 2, 1, timeout=120)
    assert err.value.rank == 1, str(err.value)
    assert "exited with code -11 without a Python error (SIGSEGV: a crash in native code" \
        in str(err.value), str(err.value)
    assert "find_unused" not in str(err.value)
    assert run_distributed(workers.faulthandler_on, 2) == [True, True]


def test_the_error_type_and_message_come_from_the_worker_itself():
    """The rank sends its exception's type and message beside the traceback: a message that
    spans lines or reads like a traceback's last line comes back whole, and ``user_errors``
    turns a worker's ValueError into a one-line ValueError here, naming the rank."""
    with pytest.raises(WorkerError) as err:
        run_distributed(workers.bad_value_on_rank, 2, 1)
    assert err.value.final() == ("ValueError",
                                 "bad plan\nKeyError: 'wq' reads like a traceback's last line")
    with pytest.raises(ValueError, match=r"(?s)^bad plan\nKeyError: .* last line \(rank 1\)$"):
        with user_errors():
            run_distributed(workers.bad_value_on_rank, 2, 1)
    with pytest.raises(WorkerError):  # any other error keeps its traceback
        with user_errors():
            run_distributed(workers.fail_on_rank, 2, 1)


def test_hang_becomes_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="still running"):
        run_distributed(workers.hang, 2, timeout=4)
    assert time.monotonic() - start < 30


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_workers_see_the_callers_environment_and_die_with_it(tmp_path, monkeypatch):
    """Workers start from a fork server that outlives one call: each still gets the caller's
    environment as it is at the call, and SIGKILL of the caller leaves no worker (nor the
    server) behind."""
    first = tmp_path / "first"
    first.mkdir()
    monkeypatch.setenv("PLAIT_TEST_MARKER", "early")
    script = (f"import os, sys; sys.path.insert(0, {str(ROOT)!r})\n"
              "from plait.spawn import run_distributed\n"
              "from tests import workers\n"
              "if __name__ == '__main__':\n"
              "    run_distributed(workers.all_reduce_rank, 2)\n"
              "    os.environ['PLAIT_TEST_MARKER'] = 'late'\n"
              f"    run_distributed(workers.report_pid_then_sleep, 2, {str(first)!r}, "
              "timeout=100)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while len(list(first.glob("*.json"))) < 2 and proc.poll() is None:
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.1)
    assert proc.poll() is None, proc.stderr.read()
    facts = [json.loads(f.read_text()) for f in sorted(first.glob("*.json"))]
    assert [f["marker"] for f in facts] == ["late", "late"]
    job = descendants(proc.pid)
    assert {f["pid"] for f in facts} <= set(job), job
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    sent = time.monotonic()
    while alive(job) and time.monotonic() - sent < 30:
        time.sleep(0.05)
    assert not alive(job), f"orphans: {alive(job)}"


@pytest.mark.slow
def test_a_rank_leaves_no_semaphore_for_the_callers_tracker():
    """A rank leaves with os._exit, which skips its exit finalizers: a named semaphore it held
    (torch.compile creates one in every rank that compiled) would stay registered with the
    resource tracker it shares with the caller, which then warns of leaked semaphores at the
    caller's exit. The caller here is its own process, so its exit's stderr can be read."""
    script = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
              "from plait.spawn import run_distributed\n"
              "from tests import workers\n"
              "if __name__ == '__main__':\n"
              "    print(run_distributed(workers.hold_a_process_lock, 2))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0, 1]"
    assert "leaked semaphore" not in done.stderr, done.stderr
