"""A data scientist's loop around ``run.step``, checked against the same loop on one device:
``ReduceLROnPlateau`` fed with the loss ``run.step`` returns, early stopping on
``run.evaluate``'s held-out loss, an EMA kept by ``AveragedModel`` and one by hand, a confusion
matrix counted on each rank's rows and summed with ``run.all_reduce``, ``OneCycleLR`` given to
``run.step`` under gradient accumulation, the learning rate read back, and a copy of a
laid-out model refused with the way that works (tests/_workers_loopkit.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.spawn import run_distributed

from . import _workers_loopkit as W

REL, ATOL = 1e-6, 1e-6


def _close(want: list[float], got: list[float]) -> None:
    assert len(got) == len(want), (want, got)
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert abs(a - b) <= REL * abs(a), (step, want, got)


def _same_state(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), (sorted(want), sorted(got))
    for name, value in want.items():
        torch.testing.assert_close(got[name].to(value.dtype), value, rtol=0, atol=ATOL, msg=name)


def _plateau_as_one_device(plans: list[str], folder: Any) -> None:
    want = W.plateau_reference()
    # the held-out loss stops improving before the last step: the loop breaks
    assert len(want["losses"]) < W.MAX_STEPS, want["val"]
    assert len(set(want["lrs"])) > 2, want["lrs"]  # the plateau lowered the rate twice or more
    for got in run_distributed(W.plateau_loop, 2, plans, str(folder), timeout=180):
        for plan, out in got.items():
            _close(want["losses"], out["losses"])
            assert out["lrs"] == want["lrs"], plan  # the rank stopped and stepped alike
            _close(want["val"], out["val"])
            for counted in (out["confusion"], out["outputs_confusion"] or out["confusion"]):
                assert len(counted) == len(want["confusion"]), plan
                for a, b in zip(want["confusion"], counted, strict=True):
                    assert torch.equal(a, b.cpu()), (plan, a, b)  # one device's counts
            _close([want["ema_val"]], [out["ema_val"]])
            _same_state(want["model"], out["model"])
            _same_state(want["ema"], out["ema"])
            if "pp" not in plan:  # a pipeline refuses AveragedModel: the EMA by hand there
                _close([want["swa_val"]], [out["swa_val"]])
                _same_state(want["swa"], out["swa"])
                _same_state(want["swa"], out["swa_loaded"])  # run.save, then run.load


def test_a_loop_with_plateau_ema_early_stopping_and_counts_trains_as_one_device(tmp_path
                                                                               ) -> None:
    # tp: the model's outputs on every rank are of the same rows, so a sum over all ranks
    # counts each row twice; pp: the outputs exist on the last stage alone.
    _plateau_as_one_device(["tp=2", "pp=2,mb=2"], tmp_path)


@pytest.mark.slow
def test_the_loop_trains_as_one_device_under_data_parallel_and_zero3(tmp_path) -> None:
    _plateau_as_one_device(["dp=2", "fsdp=2"], tmp_path)


def _onecycle_as_one_device(plans: list[str]) -> None:
    want = W.onecycle_reference()
    for got in run_distributed(W.onecycle_loop, 2, plans, timeout=180):
        for plan, out in got.items():
            _close(want["losses"], out["losses"])
            # one scheduler step per run.step, however many micro-batches it accumulates
            assert out["lrs"] == want["lrs"] == want["last_lrs"] == out["last_lrs"], plan
            # the step consumed the gradients: the user's clip after it finds none
            assert out["norms"] == [0.0] * len(want["losses"]), plan
            _same_state(want["model"], out["model"])


def test_onecycle_steps_once_per_step_under_gradient_accumulation() -> None:
    _onecycle_as_one_device(["dp=2,grad_accum=2", "pp=2,mb=2,grad_accum=2"])


@pytest.mark.slow
def test_onecycle_under_tensor_parallel_and_zero3_with_accumulation() -> None:
    _onecycle_as_one_device(["tp=2,grad_accum=2", "fsdp=2,grad_accum=2"])


def test_a_copy_of_a_laid_out_model_is_refused_with_the_way_that_works() -> None:
    got: dict[str, Any] = run_distributed(
        W.copies_refused, 2, ["dp=2", "fsdp=2", "tp=2", "pp=2,mb=2", "cp=2"], timeout=120)[0]
    # DDP's copy works: one device's AveragedModel, its names (module.*) and values
    assert got["dp=2"] == "built"
    assert got["dp=2 plateau"].startswith(  # refused before the step: the reference's 2 steps
        "run.step(..., scheduler) calls scheduler.step() with no metric"), got["dp=2 plateau"]
    _same_state(W.copy_reference(), got["dp=2 state"])
    for plan in ("fsdp=2", "tp=2"):
        assert got[plan].startswith("a laid-out model cannot be copied"), got[plan]
        assert "swa = AveragedModel(raw).requires_grad_(False), then model = " \
               "run.parallelize(raw)" in got[plan], got[plan]
    for said in (got["pp=2,mb=2"], got["pp=2,mb=2 before"]):
        assert "ema = copy.deepcopy(raw).requires_grad_(False) before model = " \
               "run.parallelize(raw)" in said, said
        assert "\n" not in said
    # under cp the right sum depends on where the count was taken: without sliced, refused,
    # naming both (tests/test_context_parallel.py sums with each)
    assert got["cp=2"].startswith("run.all_reduce under cp=2 needs sliced=True or sliced=False"
                                  ), got["cp=2"]
    assert "run.evaluate" in got["cp=2"] and "model(x)" in got["cp=2"], got["cp=2"]
    assert got["pp=2,mb=2 before"].startswith(
        "torch.optim.swa_utils.AveragedModel cannot be split into pp=2 pipeline stages")
