"""bench/cp_long_seq.py --smoke: one device, cp=2 and dp=2 train the same model to the same
losses, and the activations cp=2 and dp=2 save per rank are about half one device's (the
timings it prints are not checked: speed is measured by the bench, not by tests)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_one_cp_dp_train_the_same_and_halve_saved_activations():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cp_long_seq.py"), "--smoke",
                           "--format", "json"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["layout"]: r for r in json.loads(proc.stdout)["rows"]}
    assert set(rows) == {"one", "cp=2", "dp=2"}
    one = rows["one"]["losses"]
    assert len(one) == 3 and all(0 < x < 50 for x in one), one
    for name in ("cp=2", "dp=2"):
        assert rows[name]["losses"] == pytest.approx(one, rel=1e-5), name
        # half the tokens per rank; cp=2 adds the gathered K/V and the mask on top
        assert 0.4 < rows[name]["saved_vs_one"] < 0.6, rows[name]
    # beyond dp=2: every block's fp32 copy of the mask and K/V of all sequences (1% slack)
    cp = rows["cp=2"]
    assert cp["saved_beyond_dp"] == pytest.approx(cp["saved_beyond_dp_closed_form"], rel=0.01)
