"""bench/mfu.py's code path on the CPU (``--dry-run``: the test model, 3 steps, no compile), so
that the script bench/gpu.sh runs on a GPU is known to work before a GPU is lent."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mfu_dry_run_reports_its_arithmetic():
    out = subprocess.run([sys.executable, "bench/mfu.py", "--dry-run", "--format", "json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert (r["model"], r["steps_timed"], r["compile"], r["dtype"]) == ("test", 3, False, "fp32")
    tokens = r["batch"] * r["seq"]
    assert r["tokens_per_s"] * r["step_s"] == pytest.approx(tokens)
    assert r["achieved_tflops"] * 1e12 * r["step_s"] == pytest.approx(r["model_flops_per_step"])
    # about 6 FLOPs per parameter per token (2 forward, 4 backward; the embedding lookup is not
    # counted, attention's square is): a missed backward or a double count falls outside
    assert 4 < r["model_flops_per_step"] / (r["params"] * tokens) < 8
