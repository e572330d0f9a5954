import multiprocessing.util
import os
import shutil
import tempfile

import pytest

# Multi-process tests spawn processes on a 2-core machine: one thread each keeps them honest.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Every temporary file of the session, this process's and its children's (the log folder a
# failing `plait run` keeps for its user, checkpoints, stores), goes under one folder: removed
# when the session passes, kept and named when it fails.
# multiprocessing's own folder (the fork server's socket) stays outside it: multiprocessing
# removes that folder itself at exit, after the session has removed its scratch folder.
multiprocessing.util.get_temp_dir()
_SCRATCH = tempfile.mkdtemp(prefix="plait-tests-")
os.environ["TMPDIR"] = _SCRATCH
tempfile.tempdir = _SCRATCH


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 0:
        shutil.rmtree(_SCRATCH, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus):
    if exitstatus != 0 and os.path.isdir(_SCRATCH):
        terminalreporter.write_line(f"temporary files of this session kept in {_SCRATCH}")


@pytest.fixture
def no_group():
    """In-process single-rank runs: never leave a process group behind for the next test."""
    import torch.distributed as dist

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        assert var not in os.environ
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
