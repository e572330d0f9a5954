"""Accelerator detection and the launcher's pure parts (no processes)."""

import pytest
import torch

from plait.accelerators import accelerator_for, all_accelerators, get_accelerator
from plait.accelerators.chips import lookup_peak_flops
from plait.accelerators.cuda import CUDAAccelerator
from plait.launch import LaunchConfig, _first_slurm_host, slurm_defaults, torchrun_args, validate


def test_cpu_is_always_there_and_default_here():
    acc = get_accelerator()
    assert acc.name == "cpu" and acc.backend == "gloo"
    assert acc.device() == torch.device("cpu")
    names = [a.name for a in all_accelerators()]
    assert names == ["cuda", "tpu", "xla", "hpu", "mps", "cpu"]
    for a in all_accelerators():
        info = a.describe()  # must not raise, even for absent kinds
        assert info["name"] == a.name


def test_device_hooks_cpu_and_cuda():
    """The runtime reaches device-specific calls only through these three methods."""
    cpu = get_accelerator("cpu")
    cpu.synchronize(torch.device("cpu"))  # nothing queued on a CPU: returns at once
    assert cpu.peak_memory_bytes() is None and cpu.process_group_kwargs(cpu.device()) == {}
    gpu = torch.device("cuda", 1)
    assert CUDAAccelerator().process_group_kwargs(gpu) == {"device_id": gpu}
    if not torch.cuda.is_available():
        assert CUDAAccelerator().peak_memory_bytes() is None
    assert accelerator_for(torch.device("cpu")).name == "cpu"
    assert accelerator_for(gpu).name == "cuda"


def test_device_specific_calls_live_in_the_accelerators():
    """No ``torch.cuda`` call in the device-agnostic runtime: a new device kind is a new
    accelerator class, not an edit of the runtime."""
    import pathlib

    import plait

    root = pathlib.Path(plait.__file__).parent
    agnostic = [root / "runtime.py", root / "memory.py", root / "report.py",
                root / "comm" / "bench.py", *sorted((root / "data").glob("*.py"))]
    offenders = [p.name for p in agnostic if "torch.cuda" in p.read_text()]
    assert offenders == []


def test_unknown_or_absent_accelerator():
    with pytest.raises(ValueError, match="unknown accelerator 'npu'"):
        get_accelerator("npu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not available"):
            get_accelerator("cuda")


@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312), ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989),
    ("AMD Instinct MI300X", torch.bfloat16, 1307), ("TPU v5p", "bf16", 459),
    ("TPU v6e", "bf16", 918), ("Gaudi3", "bf16", 1835), ("NVIDIA A100", torch.float32, 19.5),
])
def test_chip_table(name, dtype, tflops):
    assert lookup_peak_flops(name, dtype) == pytest.approx(tflops * 1e12)


def test_unknown_chip_is_none():
    assert lookup_peak_flops("Some Laptop iGPU") is None


def test_slurm_variables():
    env = {"SLURM_JOB_ID": "1", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "gpu[03-05,07]"}
    assert slurm_defaults(env) == {"nnodes": 4, "node_rank": 2, "rdzv_endpoint": "gpu03:29500"}
    assert slurm_defaults({}) == {}
    assert _first_slurm_host("node7,node8") == "node7"


def test_torchrun_args_standalone_uses_a_free_local_port(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    cfg = LaunchConfig(script=str(script), nproc=2, script_args=("--plan", "dp=2"))
    validate(cfg)
    args = torchrun_args(cfg, str(tmp_path))
    endpoint = next(a for a in args if a.startswith("--rdzv-endpoint="))
    assert endpoint.startswith("--rdzv-endpoint=127.0.0.1:") and not endpoint.endswith(":29500")
    assert args[-3:] == [str(script), "--plan", "dp=2"]


def test_the_scripts_flags_are_never_read_as_torchruns(tmp_path):
    """A script flag that abbreviates two of torchrun's (--nproc: --nproc-per-node and
    --nproc_per_node; --max, --log) reaches the script; torchrun refused it as ambiguous."""
    from torch.distributed.run import parse_args

    script = tmp_path / "t.py"
    script.write_text("")
    own = ("--nproc", "2", "--max", "3", "--log", "x", "--plan", "dp=2")
    cfg = LaunchConfig(script=str(script), nproc=2, script_args=own)
    validate(cfg)
    parsed = parse_args(torchrun_args(cfg, str(tmp_path)))
    assert parsed.training_script == str(script)
    assert parsed.training_script_args == list(own)
    assert parsed.nproc_per_node == "2"


def test_multi_node_needs_endpoint(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(ValueError, match="needs --rdzv-endpoint"):
        validate(LaunchConfig(script=str(script), nnodes=2))
    with pytest.raises(ValueError, match="--node-rank 3"):
        validate(LaunchConfig(script=str(script), nnodes=2, node_rank=3,
                              rdzv_endpoint="h:1234"))
