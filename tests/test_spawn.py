"""The multi-process helper itself: results, errors and hangs."""

import time

import pytest

from plait.spawn import WorkerError, run_distributed, user_errors
from tests import workers


def test_results_come_back_per_rank():
    out = run_distributed(workers.all_reduce_rank, 2)
    assert [t.tolist() for t in out] == [[1.0, 1.0], [1.0, 1.0]]


def test_failing_rank_is_reported():
    with pytest.raises(WorkerError) as err:
        run_distributed(workers.fail_on_rank, 2, 1)
    assert err.value.rank == 1 and "boom on rank 1" in err.value.traceback


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
