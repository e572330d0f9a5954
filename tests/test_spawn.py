"""The multi-process helper itself: results, errors and hangs."""

import time

import pytest

from plait.spawn import WorkerError, run_distributed
from tests import workers


def test_results_come_back_per_rank():
    out = run_distributed(workers.all_reduce_rank, 2)
    assert [t.tolist() for t in out] == [[1.0, 1.0], [1.0, 1.0]]


def test_failing_rank_is_reported():
    with pytest.raises(WorkerError) as err:
        run_distributed(workers.fail_on_rank, 2, 1)
    assert err.value.rank == 1 and "boom on rank 1" in err.value.traceback


def test_hang_becomes_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="still running"):
        run_distributed(workers.hang, 2, timeout=4)
    assert time.monotonic() - start < 30
