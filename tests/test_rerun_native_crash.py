"""The suite runs a multi-process test once more when a rank crashed in native code (a signal,
no Python error), and fails it when the crash comes back; both are said at the end."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

INNER = textwrap.dedent('''
    import os
    from pathlib import Path

    import pytest

    from plait.spawn import WorkerError, run_distributed


    def abort_if(rank, world, flag):
        if flag is None or not Path(flag).exists():
            if flag is not None:
                Path(flag).touch()
            os.abort()
        return rank


    def raise_error(rank, world):
        raise RuntimeError("a Python error")


    def test_crashes_once(tmp_path_factory):
        flag = tmp_path_factory.getbasetemp() / "crashed-once"
        assert run_distributed(abort_if, 1, str(flag), timeout=60) == [0]


    def test_crashes_every_time():
        run_distributed(abort_if, 1, None, timeout=60)


    def test_python_error_is_not_rerun():
        with pytest.raises(WorkerError, match="a Python error"):
            run_distributed(raise_error, 1, timeout=60)
        raise AssertionError("fails once, is not run again")
''')


@pytest.mark.slow
def test_a_native_crash_is_rerun_once_and_a_repeated_one_fails(tmp_path):
    here = Path(__file__).parent
    shutil.copy(here / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), str(here.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-rA", str(tmp_path / "test_inner.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert "PASSED test_inner.py::test_crashes_once" in text, text
    assert "FAILED test_inner.py::test_crashes_every_time" in text, text
    assert "FAILED test_inner.py::test_python_error_is_not_rerun" in text, text
    reruns = [line for line in text.splitlines() if line.startswith("RERUN")]
    assert len(reruns) == 2, text
    assert "test_crashes_once" in reruns[0] and "SIGABRT" in reruns[0], reruns
    assert "test_crashes_every_time" in reruns[1], reruns
    # The Python stack the rank died in is printed (faulthandler in each rank).
    assert "Fatal Python error: Aborted" in text, text
    assert "1 passed" in text and "2 failed" in text, text
