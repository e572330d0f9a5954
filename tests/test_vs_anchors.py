"""bench/vs_anchors.py: the line counts (pure), and its --smoke run in the anchors' environment.

The smoke run needs Accelerate and Lightning, which live in ``.venv-bench`` (``make bench-env``)
and never in plait's dependencies; without that environment it skips and says how to make it.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
BENCH_STAMP = ROOT / ".venv-bench" / ".installed"  # written last by `make bench-env`


def _module():
    spec = importlib.util.spec_from_file_location("vs_anchors", ROOT / "bench" / "vs_anchors.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vs_anchors"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_lines_changed_counts_a_rewritten_line_once():
    va = _module()
    a = ["import torch", "x = 1", "y = 2", "print(x)"]
    b = ["import torch", "import plait", "x = 10", "y = 2", "print(x)", "done()"]
    assert va.lines_changed(a, b) == 3  # one added, one rewritten, one appended
    assert va.lines_changed(a, a) == 0


def test_code_lines_skip_docstring_comments_and_blanks(tmp_path):
    va = _module()
    f = tmp_path / "s.py"
    f.write_text('"""Doc\nstring."""\nimport os\n\n# a comment\nx = 1  # trailing\n')
    assert va.code_lines(f) == ["import os", "x = 1"]


def test_lines_table_covers_every_library_and_layout():
    va = _module()
    table = va.lines_table()
    assert set(table) == {"raw PyTorch", "Accelerate", "Fabric", "plait"}
    for row in table.values():
        assert set(row) == {"DDP", "FSDP", "pipeline"}
    # plait runs one file under every plan: the same count for the three layouts.
    assert table["plait"]["DDP"] == table["plait"]["FSDP"] == table["plait"]["pipeline"]
    assert table["Fabric"]["pipeline"].startswith("not possible")
    assert all(isinstance(v, int) and v > 0 for v in table["raw PyTorch"].values())


def test_only_names_a_contestant_or_refuses_in_one_line(capsys):
    va = _module()
    assert va.main(["--only", "plait DP", "--python", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--only plait DP: no such contestant" in err[0]
    assert "plait DDP" in err[0]  # the names it knows
    # a known name passes the check; without the environment the run then skips
    assert va.main(["--only", "plait DDP", "--python", "/nonexistent"]) == 0
    assert "skipped" in capsys.readouterr().out


# Contestants that draw the same batches (DistributedSampler's order, which plait's loader
# follows) from the same initial weights: their losses after the smoke run's steps must agree.
# Accelerate shards its own loader and the raw pipeline shuffles one device's loader: another
# order, so another (finite) loss.
SAME_DATA = ("torch DDP", "Fabric DDP", "plait DDP", "torch FSDP2", "Fabric FSDP",
             "plait ZeRO-3", "plait pipeline")


@pytest.mark.timeout(300)
@pytest.mark.skipif(not BENCH_STAMP.exists(),
                    reason="no .venv-bench: run `make bench-env` to install Accelerate and "
                           "Lightning beside plait for bench/vs_anchors.py --smoke")
def test_vs_anchors_smoke():
    """Every anchor script trains (one repetition, tiny model), and those that see the same
    data reach the same loss."""
    # --timeout: the script kills its launcher and every rank itself, before this test's limit.
    out = subprocess.run([str(BENCH_PYTHON), "bench/vs_anchors.py", "--smoke", "--format",
                          "json", "--timeout", "240"], cwd=ROOT, capture_output=True, text=True,
                         timeout=280,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout)
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"torch DDP", "Accelerate DDP", "Fabric DDP", "plait DDP", "torch FSDP2",
                         "Accelerate FSDP", "Fabric FSDP", "plait ZeRO-3", "torch pipeline",
                         "plait pipeline"}
    for name, row in rows.items():
        assert row["reps"] == 1 and row["step_s"] > 0, name
        assert row["final_loss"] is not None and math.isfinite(row["final_loss"]), name
    reference = rows["torch DDP"]["final_loss"]
    for name in SAME_DATA:
        assert rows[name]["final_loss"] == pytest.approx(reference, rel=1e-4), name
    assert result["lines_changed"]["plait"]["DDP"] > 0
