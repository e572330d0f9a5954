"""Preemption on PyTorch/XLA (the XLA CPU device): a real SIGTERM to a training process ends in
a final checkpoint at the next step boundary, and the run resumed from it trains what the
uninterrupted run trains. Each job is its own process (see ``workers.py``): the one the signal
stops, then one that resumes it and trains the uninterrupted reference."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from plait.accelerators.base import module_present

from .test_xla import CASE_TIMEOUT, ROOT, run_case

pytestmark = pytest.mark.skipif(
    not module_present("torch_xla"),
    reason="torch_xla is not installed here; `make test-xla` runs these in .venv-xla")

READY_TIMEOUT = 600.0  # seconds to the third step: starting torch_xla and compiling, loaded
STOP_TIMEOUT = 120.0   # from SIGTERM to exit: the step in flight and one save


def _preempt(folder: Path, plan: str, devices: int, mode: str) -> tuple[int, str]:
    """Start ``case_preempted``, send it SIGTERM once it has trained three steps, and return
    its exit code and output."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.xla.workers", "preempted",
                             str(folder), plan, mode], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "ready":
                ready.set()
        ready.set()  # ended without it: the check below says so at once

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        ready.wait(READY_TIMEOUT)
        assert "ready\n" in lines, f"exit code {proc.poll()}:\n{''.join(lines)[-3000:]}"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=STOP_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    return proc.returncode, "".join(lines)


def _check_preempted(folder: Path, plan: str, devices: int, mode: str) -> dict:
    """SIGTERM stops the job after a whole step with a final checkpoint of that step (exit
    143, as SIGTERM's default would report), and the resumed run matches the uninterrupted
    one: the same losses from there and every parameter and buffer at the end. Under
    ``async_save`` the saves every 2 steps are written in the background: the step-2 one holds
    the chunks a blocking save writes (each device's shard, not whole tensors), and resumes
    exactly although steps 3.. changed the weights while it was written."""
    code, out = _preempt(folder, plan, devices, mode)
    assert code == 143, f"exit code {code}, expected 143 (a final save, then exit):\n{out[-3000:]}"
    stopped = re.search(r"step (\d+): stopping on SIGTERM, saving a final checkpoint", out)
    assert stopped, out[-3000:]
    final = int(stopped.group(1))
    assert final >= 3
    saved = sorted(p.name for p in folder.iterdir())
    assert saved[-1] == f"step-{final:08d}", (saved, out[-3000:])
    result = run_case("preempt_resumed", devices, str(folder), plan, mode)
    assert result["newest"] == final and result["start"] == final
    _matches(result["resumed"], 2)
    if mode == "async":
        assert result["chunks"] == result["blocking_chunks"]
        assert result["early_start"] == 2
        _matches(result["early"], final)
    return result


def _matches(got: dict, steps: int) -> None:
    assert len(got["losses"]) == steps and got["names"]
    assert got["losses"] == pytest.approx(got["ref_losses"], rel=1e-6, abs=1e-6)
    assert got["max_diff"] <= 1e-6


@pytest.mark.timeout(CASE_TIMEOUT)
def test_sigterm_under_spmd_with_async_saves_resumes_exactly(tmp_path):
    """``dp_shard=2,zero=3,tp=2`` on 4 devices, ``async_save=True``."""
    result = _check_preempted(tmp_path / "ckpt", "dp_shard=2,zero=3,tp=2", 4, "async")
    assert len(result["chunks"]["model.blocks.0.fc1.weight"]) == 4  # split on fsdp and tp


@pytest.mark.slow
@pytest.mark.timeout(CASE_TIMEOUT)
@pytest.mark.parametrize("plan, mode", [("one device", "blocking"),
                                        ("dp_shard=4,zero=3", "blocking"),
                                        ("one device", "async")])
def test_sigterm_under_other_layouts(tmp_path, plan, mode):
    """One device is the same code path as SPMD (a mesh of one device), with blocking saves."""
    _check_preempted(tmp_path / "ckpt", plan, 1 if plan == "one device" else 4, mode)
