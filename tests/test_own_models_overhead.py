"""bench/own_models_overhead.py --smoke: raw torch and plait train the same models to the same
loss (the timings it prints are not checked: speed is measured by the bench, not by tests).

The default suite runs the tied masked LM (DDP, ZeRO-3, tensor parallel) and the LoRA-like
model (pipeline); the slow case runs every model and layout.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _smoke(*args: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "own_models_overhead.py"),
                           "--smoke", "--json", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _assert_same_training(rows: list[dict], cases: set[tuple[str, str]]) -> None:
    assert {(r["model"], r["layout"]) for r in rows} == cases
    for r in rows:
        raw, ours = r["losses"]["raw"], r["losses"]["plait"]
        assert raw == raw and 0 < raw < 50, r  # a finite cross-entropy, not a placeholder
        assert ours == pytest.approx(raw, rel=1e-6), (r["model"], r["layout"], raw, ours)


def test_smoke_raw_and_plait_train_the_same():
    rows = _smoke("--models", "tied_lm", "--layouts", "ddp,zero3,tp")
    _assert_same_training(rows, {("tied_lm", "ddp"), ("tied_lm", "zero3"), ("tied_lm", "tp")})


@pytest.mark.slow
def test_smoke_every_model_and_layout():
    rows = _smoke()
    _assert_same_training(rows, {("tied_lm", "ddp"), ("tied_lm", "zero3"), ("tied_lm", "tp"),
                                 ("lora", "ddp"), ("lora", "zero3"), ("lora", "pp"),
                                 ("convnet", "ddp"), ("convnet", "zero3"), ("gpt2", "ddp"),
                                 ("gpt2", "zero3")})
