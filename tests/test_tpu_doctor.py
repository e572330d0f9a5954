"""TPU stacks where there is no TPU: detection, refusals, plan checks and `plait doctor`.

What needs torch_xla runs in tests/xla (``make test-xla``); these run everywhere.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from plait.accelerators import get_accelerator
from plait.accelerators.base import module_present
from plait.accelerators.chips import lookup_memory_bytes, lookup_peak_flops
from plait.accelerators.versions import release, satisfies, stack_mismatch
from plait.cli import main
from plait.diagnostics import doctor
from plait.launch import LaunchConfig, validate
from plait.parallel.xla_spmd import plan_problems
from plait.plan import Plan

from ._one_line import refused

NO_XLA = not module_present("torch_xla")
NO_TPU = not module_present("torch_tpu")


def test_version_rules():
    assert release("2.9.0+cu128") == (2, 9, 0) and release("2.13.0") == (2, 13, 0)
    assert satisfies("2.9.0+cu128", "==2.9.*") and not satisfies("2.13.0", "==2.9.*")
    assert satisfies("2.13.0", ">=2.11.0,<=2.15.0") and not satisfies("2.10.1", ">=2.11.0")
    assert satisfies("2.15.0", "<=2.15.0") and not satisfies("2.15.1", "<=2.15.0")
    assert satisfies("2.9.1", "~=2.9.0") and not satisfies("2.10.0", "~=2.9.0")
    if NO_XLA:
        assert stack_mismatch("torch_xla", torch_version="1.0") is None  # absent: nothing to say


@pytest.mark.parametrize("name, tflops, gib", [
    ("TPU v5 lite", 197, 16), ("TPU v5", 459, 95), ("TPU v6 lite", 918, 32), ("TPU7x", 2307, 192),
    ("TPU v4", 275, 32)])
def test_tpu_device_kinds_in_the_chip_table(name, tflops, gib):
    assert lookup_peak_flops(name, "bf16") == pytest.approx(tflops * 1e12)
    assert lookup_memory_bytes(name) == gib * 2**30


@pytest.mark.skipif(not (NO_XLA and NO_TPU), reason="a TPU stack is installed here")
@pytest.mark.parametrize("name, expected", [
    ("xla", "torch_xla is not installed"), ("tpu", "torch_tpu (TorchTPU) is not installed")])
def test_absent_stack_is_one_line_with_the_fix(name, expected):
    with pytest.raises(ValueError) as err:
        get_accelerator(name)
    message = str(err.value)
    assert expected in message and "pip install" in message and "plait doctor" in message
    assert "\n" not in message


def test_plan_axes_xla_cannot_express_are_refused_with_the_reason():
    assert plan_problems(Plan(dp_replicate=2, tp=2)) == []
    assert plan_problems(Plan(dp_shard=4, zero=3)) == []
    problems = plan_problems(Plan(pp=2, dp_shard=2, zero=1, microbatches=2))
    assert [p.split(":")[0] for p in problems] == ["pp=2", "zero=1"]
    assert "no pipeline schedule" in problems[0] and "use zero=3" in problems[1]
    assert plan_problems(Plan(dp_shard=4, zero=3, mixed_precision="bf16")) == []
    fp16 = plan_problems(Plan(dp_shard=4, zero=3, mixed_precision="fp16"))
    assert len(fp16) == 1 and "use mixed_precision=bf16" in fp16[0], fp16


@pytest.mark.skipif(not (NO_XLA and NO_TPU), reason="a TPU stack is installed here")
def test_plait_run_refuses_a_missing_accelerator_before_starting(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    for name in ("xla", "tpu"):
        cfg = LaunchConfig(script=str(script), nproc=1, script_args=("--accelerator", name))
        with pytest.raises(ValueError, match=f"accelerator '{name}' is not available"):
            validate(cfg)


@pytest.mark.skipif(not NO_XLA, reason="torch_xla is installed here")
@pytest.mark.timeout(300)
def test_script_with_accelerator_xla_ends_with_one_line_no_traceback(tmp_path):
    line = refused(tmp_path, ["--accelerator", "xla"])
    assert line.startswith("plait: error: accelerator 'xla' is not available: torch_xla")
    assert "plait doctor" in line


# ------------------------------------------------------------------------------ doctor
def _by_name(checks):
    return {c.name: c for c in checks}


def test_doctor_world_size_variables():
    checks = _by_name(doctor.run_checks({"WORLD_SIZE": "4", "RANK": "5", "LOCAL_WORLD_SIZE": "3",
                                         "LOCAL_RANK": "0"}))
    ws = checks["world-size variables"]
    assert ws.status == "fail" and "RANK=5 >= WORLD_SIZE=4" in ws.detail
    assert "not a multiple of LOCAL_WORLD_SIZE=3" in ws.detail and ws.fix
    ok = doctor.check_world_size({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                  "LOCAL_RANK": "1"})
    assert ok.status == "pass"
    assert doctor.check_world_size({}).status == "skip"


def test_doctor_master_port_in_use_and_bad_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        busy = doctor.check_master({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert busy.status == "fail" and "already in use" in busy.detail
    free = doctor.check_master({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert free.status == "pass"
    assert doctor.check_master({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "x"}).status == "fail"
    bad = doctor.check_master({"MASTER_ADDR": "no such host!", "MASTER_PORT": "29500"})
    assert bad.status == "fail" and "does not resolve" in bad.detail


def test_doctor_infiniband_only_matters_across_nodes(tmp_path):
    assert doctor.check_infiniband({}).status == "skip"
    none = doctor.check_infiniband({"NNODES": "2"}, sys_dir=str(tmp_path / "absent"))
    assert none.status == "warn" and "TCP" in none.detail
    (tmp_path / "mlx5_0").mkdir()
    assert doctor.check_infiniband({"NNODES": "2"}, sys_dir=str(tmp_path)).status == "pass"


@pytest.mark.timeout(60)
def test_doctor_finds_the_process_holding_a_device_file(tmp_path):
    device = tmp_path / "accel0"  # stands in for /dev/accel0: the scan over /proc is the same
    device.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nf = open(sys.argv[1])\n"
                               "print('open', flush=True)\ntime.sleep(60)", str(device)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        found = doctor.holders([str(device)])
        assert holder.pid in found and "time.sleep" in found[holder.pid]
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    assert holder.pid not in doctor.holders([str(device)])


@pytest.mark.skipif(not NO_XLA, reason="torch_xla is installed here")
def test_doctor_skips_absent_stacks_and_reports_json(capsys):
    checks = _by_name(doctor.run_checks({"PJRT_DEVICE": "GPU"}))
    assert checks["PJRT_DEVICE"].status == "skip"  # only checked where torch_xla is installed
    assert main(["doctor", "--format", "json"]) in (0, 1)
    out = json.loads(capsys.readouterr().out)
    names = [c["name"] for c in out["checks"]]
    assert len(names) == len(doctor.CHECKS) and set(out["summary"]) == set(doctor.STATUSES)
    assert all(c["status"] in doctor.STATUSES for c in out["checks"])
