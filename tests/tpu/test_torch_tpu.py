"""TorchTPU (``torch_tpu``) installed on a machine without a TPU: what can run here.

Runs in ``.venv-tpu`` (torch 2.13 CPU + torch-tpu) through ``make test-tpu``; skipped where
torch_tpu is absent. With no TPU only detection, the doctor's checks and the refusal can run:
no device is faked. Everything that needs a chip is listed in docs/tpu.md as not yet run.
"""

from __future__ import annotations

import pytest

from plait.accelerators.base import module_present

from .._one_line import refused

pytestmark = pytest.mark.skipif(
    not module_present("torch_tpu"),
    reason="torch_tpu is not installed here; `make test-tpu` runs these in .venv-tpu")


def test_torch_tpu_registers_itself_and_finds_no_tpu_here():
    import torch

    from plait.accelerators import get_accelerator
    from plait.accelerators.tpu import TPUAccelerator

    assert hasattr(torch, "tpu")  # loaded through the torch.backends entry point
    assert not TPUAccelerator.is_available()
    assert get_accelerator().name == "cpu"  # auto-detection does not pick an absent TPU
    reason = TPUAccelerator().unavailable_reason()
    assert reason.startswith("torch_tpu ") and "finds no device, not a TPU" in reason
    assert TPUAccelerator().describe()["count"] == 0


def test_doctor_on_a_torch_tpu_machine_without_a_tpu():
    from plait.diagnostics import doctor

    checks = {c.name: c for c in doctor.run_checks({})}
    assert checks["torch vs torch-tpu"].status == "pass"
    assert checks["libtpu"].status == "pass"  # torch-tpu pulls libtpu
    assert checks["TPU not held by another process"].status == "skip"  # no /dev/accel*, vfio


@pytest.mark.timeout(300)
def test_script_with_accelerator_tpu_ends_with_one_line(tmp_path):
    line = refused(tmp_path, ["--accelerator", "tpu"])
    assert "accelerator 'tpu' is not available" in line and "plait doctor" in line
