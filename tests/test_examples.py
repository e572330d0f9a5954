"""Every example runs as its docstring says (one short run each): examples must not rot."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def plait_run(nproc, script, *args):
    return _run([sys.executable, "-m", "plait.cli", "run", "--nproc", str(nproc),
                 f"examples/{script}", *args])


@pytest.mark.parametrize("nproc, script, args, expect", [
    (2, "data_parallel.py", [], "max |param diff| vs one device"),
    (2, "pipeline.py", ["--plan", "pp=2,schedule=1f1b,mb=4"], "run summary"),
    (2, "tensor_parallel.py", ["--plan", "tp=2,sp=true"], "run summary"),
    (2, "zero.py", ["--plan", "dp_shard=2,zero=3"], "memory per rank"),
])
def test_example_runs(nproc, script, args, expect):
    out = plait_run(nproc, script, *args)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert expect in out.stdout


def test_collectives_example():
    out = _run([sys.executable, "examples/collectives.py"])
    assert out.returncode == 0, out.stderr[-3000:]
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"):
        assert op in out.stdout
