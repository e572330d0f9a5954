"""``plait plan --dtype fp16``: GPUs whose fp16 peak equals their bf16 peak get the plans and
prices bf16 gets, as ``mixed_precision=fp16`` (its loss scale is host-side numbers: no device
bytes); chips without fp16 (TPUs, the CPU preset) are refused with the chip and the fix."""

import argparse
import json

import pytest

from plait.accelerators.chips import lookup_peak_flops
from plait.plan import Plan
from plait.planner import plan_model
from plait.planner.cli import add_plan_arguments, plan_command
from plait.planner.cost import Workload, evaluate
from plait.planner.hardware import load_cluster
from plait.planner.model_stats import load_model


def run_cli(*argv):
    parser = add_plan_arguments(argparse.ArgumentParser())
    return plan_command(parser.parse_args(list(argv)))


@pytest.mark.parametrize("chip", ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3",
                                  "NVIDIA H200", "AMD Instinct MI300X"])
def test_gpu_fp16_peak_is_the_bf16_peak(chip):
    assert lookup_peak_flops(chip, "fp16") == lookup_peak_flops(chip, "bf16") > 0


@pytest.mark.parametrize("chip", ["TPU v5p", "TPU v5 lite", "TPU v6 lite"])
def test_tpus_have_no_fp16_peak(chip):
    assert lookup_peak_flops(chip, "fp16") is None


def test_plan_dtype_fp16_prints_mixed_precision_fp16(capsys):
    code = run_cli("--model", "llama-8b", "--cluster", "dgx-h100", "--devices", "16",
                   "--global-batch", "64", "--seq", "4096", "--dtype", "fp16", "--top", "3",
                   "--format", "json")
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and len(data["plans"]) == 3
    for p in data["plans"]:
        assert p["layout"]["mixed_precision"] == "fp16"
        assert "mixed_precision=fp16" in p["plan"]
    assert run_cli("--model", "llama-8b", "--cluster", "dgx-h100", "--devices", "16",
                   "--global-batch", "64", "--seq", "4096", "--dtype", "fp16", "--top", "1") == 0
    assert ", fp16:" in capsys.readouterr().out


@pytest.mark.parametrize("layout", ["dp_shard=16,zero=3,ac=full",
                                    "dp_shard=8,tp=2,sp=true,zero=3,ac=full",
                                    # 16 rows of 4,096 tokens at once hold 34 GB of logits
                                    # on each tp rank: two micro-batches
                                    "dp_replicate=4,tp=4,ac=full,grad_accum=2",
                                    "pp=2,dp_shard=8,zero=2,mb=8,ac=full"])
def test_fp16_is_priced_as_bf16(layout):
    """Same peak on an H100, the same 2-byte activations, compute copies and collectives, and
    fp32 master state: every figure of an fp16 layout is its bf16 twin's."""
    model = load_model("llama-8b")
    cluster = load_cluster("dgx-h100", devices=16)
    work = Workload(64, 4096)
    bf16, fp16 = (evaluate(Plan.from_string(f"{layout},mp={d}"), model, cluster, work)
                  for d in ("bf16", "fp16"))
    assert bf16.feasible and fp16.feasible, (bf16.reason, fp16.reason)
    assert fp16.memory_breakdown == bf16.memory_breakdown
    assert fp16.comm_bytes_per_step == bf16.comm_bytes_per_step
    assert fp16.step_time_s == bf16.step_time_s
    fp32 = evaluate(Plan.from_string(f"{layout},mp=fp32"), model, cluster, work)
    assert fp32.comm_bytes_per_step != fp16.comm_bytes_per_step  # the comparison can fail


@pytest.mark.parametrize("preset, chip", [("tpu-v5p", "TPU v5p"), ("tpu-v5e", "TPU v5 lite")])
def test_fp16_on_a_tpu_is_refused_naming_the_chip(preset, chip, capsys):
    assert run_cli("--model", "llama-8b", "--cluster", preset, "--devices", "64",
                   "--global-batch", "64", "--seq", "4096", "--dtype", "fp16") == 2
    err = capsys.readouterr().err
    assert chip in err and "--dtype bf16" in err and "fp16" in err
    with pytest.raises(ValueError, match=f"{chip}.*--dtype bf16"):
        plan_model("llama-8b", preset, world_size=64, global_batch=64, seq=4096, dtype="fp16")
