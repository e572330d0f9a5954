import multiprocessing.util
import os
import shutil
import tempfile

import pytest
from _pytest.runner import runtestprotocol

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


# A rank that died of a signal with no Python error (glibc's heap checks abort with SIGABRT,
# a segfault): a crash in torch's or gloo's native code, which a run on a loaded machine can
# meet once in many hundred multi-process runs. Such a test runs once more; a crash that comes
# back (a collective mismatch aborts every time) fails it, and every rerun is listed at the end
# of the session, with the first attempt's error.
_NATIVE_CRASH = ("without a Python error (SIGABRT", "without a Python error (SIGSEGV",
                 "without a Python error (SIGBUS")
_RERUN: list[tuple[str, str]] = []


def _native_crash(reports) -> str | None:
    for report in reports:
        if report.failed and report.when == "call":
            # the error the test ended on (not text elsewhere in the report, such as a
            # test's own assertion that names these messages)
            crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "")
            if crash.startswith("plait.spawn.WorkerError") and \
                    any(s in crash for s in _NATIVE_CRASH):
                said = next(line for line in crash.splitlines()
                            if any(s in line for s in _NATIVE_CRASH))
                return said.split(";")[0].split(":")[0] + ")"
    return None


def pytest_runtest_protocol(item, nextitem):
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    crash = _native_crash(reports)
    if crash is not None:
        _RERUN.append((item.nodeid, crash))
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 0:
        shutil.rmtree(_SCRATCH, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus):
    for nodeid, crash in _RERUN:
        terminalreporter.write_line(f"RERUN after a rank crashed in native code: {nodeid}: "
                                    f"{crash}", yellow=True)
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
