"""PyTorch/XLA on the XLA CPU device (``PJRT_DEVICE=CPU``): plans and diagnostics.

Runs in ``.venv-xla`` (torch 2.9 + torch-xla 2.9) through ``make test-xla``; skipped where
torch_xla is absent. Each case runs in its own process (see ``workers.py``): one XLA device for
training against eager CPU and for each diagnostic, four (``CPU_NUM_DEVICES=4``) for the SPMD
layouts. Multi-process XLA collectives hang on the CPU device (torch_xla issue 9089), so nothing
here starts more than one XLA process at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.accelerators.base import module_present

from .._one_line import refused

pytestmark = pytest.mark.skipif(
    not module_present("torch_xla"),
    reason="torch_xla is not installed here; `make test-xla` runs these in .venv-xla")

ROOT = Path(__file__).resolve().parents[2]
CASE_TIMEOUT = 1500  # seconds; compiling on a loaded 2-core machine is slow, a hang still fails


def run_case(case: str, devices: int, *args: str) -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.xla.workers", case, *args], cwd=ROOT,
                          env=env,
                          capture_output=True, text=True, timeout=CASE_TIMEOUT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def single() -> dict:
    return run_case("single", 1)


@pytest.fixture(scope="module")
def diagnostics() -> dict:
    return run_case("diagnostics", 1)


@pytest.fixture(scope="module")
def spmd() -> dict:
    return run_case("spmd", 4)


def _matches(result: dict, rtol: float = 1e-4, atol: float = 2e-4, param_atol: float = 5e-4
             ) -> None:
    assert result["missing"] == [] and result["params"] > 0
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=rtol, abs=atol)
    assert result["max_param_diff"] < param_atol  # Adam at lr 1e-2 magnifies rounding


# ------------------------------------------------------------------------- one device
@pytest.mark.timeout(CASE_TIMEOUT)
def test_single_device_trains_what_eager_cpu_trains(single):
    _matches(single["transformer"])
    _matches(single["mlp"])


@pytest.mark.timeout(CASE_TIMEOUT)
def test_a_clean_run_reports_nothing(single):
    assert single["transformer"]["findings"] == []
    report = single["mlp"]["report"]
    assert report["findings"] == [] and report["compilations_after_warmup"] == 0
    assert report["executions_per_step"] == 1  # the step boundary's graph, nothing else
    assert report["compile_ms_per_step"] == 0 and report["execute_ms_per_step"] > 0


# ------------------------------------------------------------------------- diagnostics
def _kinds(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in report["findings"]:
        out.setdefault(f["kind"], []).append(f)
    return out


@pytest.mark.timeout(CASE_TIMEOUT)
def test_partial_last_batch_is_named_with_the_fix(diagnostics):
    kinds = _kinds(diagnostics["partial"])
    assert list(kinds) == ["partial_batch"], diagnostics["partial"]["findings"]
    finding = kinds["partial_batch"][0]
    assert "4 rows instead of 8" in finding["what"] and "drop_last=True" in finding["fix"]
    assert finding["steps"] == [3]  # the second short batch (step 6) reuses the compilation


@pytest.mark.timeout(CASE_TIMEOUT)
def test_recompilation_fires_on_a_new_shape_and_stays_quiet_on_a_steady_one(diagnostics):
    kinds = _kinds(diagnostics["shape"])
    assert list(kinds) == ["recompilation"], diagnostics["shape"]["findings"]
    assert "(4, 6, 8), (4, 6, 4) to (4, 8, 8), (4, 8, 4)" in kinds["recompilation"][0]["what"]
    assert kinds["recompilation"][0]["steps"] == [4]
    assert diagnostics["steady"]["findings"] == []
    assert diagnostics["steady"]["compilations_after_warmup"] == 0


@pytest.mark.timeout(CASE_TIMEOUT)
def test_cpu_fallback_is_named_with_its_count(diagnostics):
    kinds = _kinds(diagnostics["fallback"])
    ops = {f["what"].split()[0]: f["count"] for f in kinds["fallback"]}
    assert ops.get("aten::digamma", 0) >= 4, ops  # once per step, 4 steps
    assert "host_sync" not in kinds or all("digamma" in f["what"] for f in kinds["host_sync"])


@pytest.mark.timeout(CASE_TIMEOUT)
def test_host_sync_names_the_item_call_and_its_line(diagnostics):
    syncs = _kinds(diagnostics["host_sync"])["host_sync"]
    named = [f for f in syncs if f["what"].startswith("Tensor.item at ")]
    assert named, syncs
    assert "workers.py:" in named[0]["what"]
    # Unnamed on the first step it appears, named from the next one on (the watch starts then).
    assert diagnostics["host_sync"]["unexplained_syncs_at_steps"] == [1]
    assert named[0]["steps"] == [2, 3, 4]


@pytest.mark.timeout(CASE_TIMEOUT)
def test_strict_mode_raises_at_the_first_step_with_what_to_change(diagnostics):
    strict = diagnostics["strict"]
    assert strict["steps_run"] == 0
    assert "step 1: Tensor.item at" in strict["error"] and "keep the value on the device" in \
        strict["error"]


# ------------------------------------------------------------------------- SPMD, 4 devices
@pytest.mark.timeout(CASE_TIMEOUT)
def test_spmd_layouts_train_what_one_cpu_trains(spmd):
    for plan, result in spmd.items():
        try:
            _matches(result)
        except AssertionError as exc:
            raise AssertionError(f"{plan}: {exc}") from exc
    # run.evaluate under SPMD (dp_replicate=2, tp=2): the held-out loss one CPU computes
    mlp = spmd["mlp dp_replicate=2,tp=2"]
    assert mlp["evaluated"] == pytest.approx(mlp["ref_evaluated"], rel=1e-4, abs=2e-4)


@pytest.mark.timeout(CASE_TIMEOUT)
def test_run_all_reduce_is_refused_under_spmd_with_the_reason():
    # One process holds every device's share of the batch: there is nothing to sum across
    # ranks, with or without sliced (context parallelism's keyword).
    said = run_case("all_reduce", 4)
    for sliced, message in said.items():
        assert message.startswith("run.all_reduce is not available on XLA (SPMD)"), (sliced,
                                                                                       message)


# ------------------------------------------------------------------------- example=
@pytest.mark.timeout(CASE_TIMEOUT)
def test_an_example_of_a_two_input_forward_is_what_tp_is_inferred_and_checked_on():
    # The SPMD layout inferred the tensor-parallel plan and checked it on a guessed input,
    # example= left unread: a plan that does not fit the forward it was given (an embedding
    # of width 32 added to a column-parallel output) was laid out where other devices refuse
    # it. And the batch's 1-D class tensor failed its transfer to the devices (IndexError:
    # too many indices for tensor of dimension 1).
    result = run_case("example", 4)
    _user_matches("forward(x, t) under dp_replicate=2,tp=2", result["trained"])
    misfit = result["misfit"]
    assert misfit is not None, "a plan that does not fit the example was laid out"
    assert misfit.startswith("the tensor-parallel plan inferred for Misfit does not fit its "
                             "dataflow at tp=2"), misfit
    assert "Attempting to broadcast a dimension of length 32" in misfit, misfit


# ------------------------------------------------------------------------- users' models
@pytest.fixture(scope="module")
def users() -> dict:
    return run_case("users", 4)


def _user_matches(name: str, result: dict) -> None:
    try:
        # full_state_dict: the one-device model's state_dict names (FSDPv2's wrappers gone),
        # a tied weight under each of its names, the buffers too
        assert result["names"] == result["ref_names"]
        assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-4, abs=2e-4)
        if result["ref_evaluated"] is not None:
            assert result["evaluated"] == pytest.approx(result["ref_evaluated"], rel=1e-4)
        worst = max(result["diffs"], key=result["diffs"].get)
        assert result["diffs"][worst] < 5e-4, (worst, result["diffs"][worst])
        assert result["findings"] == []  # no host sync, recompilation or fallback added
    except AssertionError as exc:
        raise AssertionError(f"{name}: {exc}") from exc


@pytest.mark.timeout(CASE_TIMEOUT)
def test_users_models_train_what_one_cpu_trains(users):
    """A tied embedding (one parameter, not two), dict batches padded by a collate_fn with a
    masked loss that shifts the labels under grad_accum, frozen base weights, BatchNorm's
    running statistics and an EMA buffer."""
    for name, result in users.items():
        if name != "units":
            _user_matches(name, result)
    assert users["lora, frozen base"]["diffs"]["layers.0.base.weight"] == 0.0


@pytest.mark.timeout(CASE_TIMEOUT)
def test_a_loss_of_two_terms_on_one_xla_device_trains_what_one_cpu_trains():
    """Each term over its own count (a dict of (sum, count) pairs), with and without
    grad_accum (whose later micro-batches are counted by a forward without autograd): losses,
    the evaluated loss and the state of one eager CPU, with no host sync or recompilation."""
    for name, result in run_case("terms_single", 1).items():
        _user_matches(name, result)


@pytest.mark.timeout(CASE_TIMEOUT)
def test_fsdpv2_wraps_the_units_shard_patterns_name(users):
    units = users["units"]
    assert units["default"] == ["layers.0", "layers.1"]
    assert units["layers.0"] == ["layers.0"]
    assert "shard_patterns ['nothing.*'] match no module of LoRA" in units["nothing.*"]


@pytest.mark.slow
@pytest.mark.timeout(CASE_TIMEOUT)
def test_users_models_with_accumulation_and_clipping():
    for name, result in run_case("users_slow", 4).items():
        _user_matches(name, result)


# ------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def cpu_checkpoint(tmp_path_factory) -> Path:
    """A folder holding ``cpu/``: one CPU's checkpoint at step 2, for the XLA runs to load."""
    folder = tmp_path_factory.mktemp("checkpoints")
    run_case("checkpoint_cpu", 1, str(folder))
    return folder


def _resumes(name: str, result: dict, start: int = 2) -> None:
    """A run loaded from a checkpoint into a model that differs in every value goes on as the
    uninterrupted run: the same losses from the step saved, and at the end every parameter
    and buffer (a tied weight under each name, BatchNorm's statistics, a buffer of its own)."""
    try:
        assert result["start"] == start
        assert len(result["losses"]) == 4 - start
        assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5, abs=1e-5)
        assert result["names"] == result["ref_names"]
        assert result["max_diff"] < 1e-5
    except AssertionError as exc:
        raise AssertionError(f"{name}: {exc}") from exc


@pytest.mark.timeout(CASE_TIMEOUT)
def test_checkpoints_on_one_xla_device_resume_exactly_and_load_on_cpu(cpu_checkpoint):
    result = run_case("checkpoint_single", 1, str(cpu_checkpoint))
    for name in ("one device", "cpu -> xla", "xla -> cpu"):
        _resumes(name, result[name])
    # init(checkpoint=, every=2): the first run saved at step 2 and as it finished at step 3,
    # the resumed one at step 4
    every = result["init(checkpoint=)"]
    assert every["saved"] == ["step-00000002", "step-00000003", "step-00000004"]
    _resumes("init(checkpoint=)", every, start=3)


@pytest.mark.timeout(CASE_TIMEOUT)
def test_checkpoints_under_fsdpv2_and_tp_resume_exactly_and_load_on_cpu(cpu_checkpoint):
    """``dp_shard=2,zero=3,tp=2``: weights split on both axes, biases split on one and
    replicated on the other (each value written once), the optimizer state as its parameter."""
    for name, result in run_case("checkpoint_spmd", 4, str(cpu_checkpoint)).items():
        _resumes(name, result)


@pytest.mark.slow
@pytest.mark.timeout(CASE_TIMEOUT)
def test_checkpoints_under_each_spmd_layout(cpu_checkpoint):
    for name, result in run_case("checkpoint_spmd_slow", 4, str(cpu_checkpoint)).items():
        _resumes(name, result)


# ------------------------------------------------------------------------- bad input
@pytest.mark.timeout(600)
@pytest.mark.parametrize("args, expected", [
    (["--accelerator", "xla", "--plan", "pp=2,dp_replicate=2,mb=2"],
     "pp=2: pipeline parallelism is not built on XLA"),
    (["--accelerator", "xla", "--plan", "dp_replicate=2"], "!= 4 XLA devices"),
])
def test_a_plan_xla_cannot_express_is_one_line(tmp_path, args, expected):
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    assert expected in refused(tmp_path, args, env=env, timeout=600)

def test_the_stack_versions_and_doctor_where_torch_xla_is_installed():
    from plait.accelerators.versions import stack_mismatch
    from plait.diagnostics import doctor

    assert stack_mismatch("torch_xla") is None  # this environment's pair matches
    line = stack_mismatch("torch_xla", torch_version="2.13.0")
    assert line.startswith("torch-xla 2.9.0 needs torch==2.9.*, but torch 2.13.0 is installed")
    assert "pip install torch==2.9.0 torch-xla==2.9.0" in line
    assert doctor.check_versions("torch_xla").status == "pass"
    assert doctor.check_pjrt_device({"PJRT_DEVICE": "CPU"}).status == "pass"
    assert doctor.check_pjrt_device({}).status == "warn"
    wrong = doctor.check_pjrt_device({"PJRT_DEVICE": "GPU"})
    assert wrong.status == "fail" and wrong.fix == "export PJRT_DEVICE=CPU"
    if not doctor.tpu_device_files():
        assert doctor.check_pjrt_device({"PJRT_DEVICE": "TPU"}).status == "fail"


def test_tpu_example_on_the_xla_cpu_device():
    """examples/tpu.py as its docstring runs it without a TPU: four XLA CPU devices, one
    process, an FSDPv2 x TP layout."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "examples/tpu.py", "--accelerator", "xla", "--plan",
                           "dp_shard=2,zero=3,tp=2", "--steps", "3", "--batch-size", "8",
                           "--seq-len", "32"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=CASE_TIMEOUT)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "FINAL" in proc.stdout
