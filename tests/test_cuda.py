"""What only a GPU can show: device placement, bf16 autocast, torch.compile of the reference
model and the plan's ``compile`` under bf16, FSDP2 and DTensor TP on a one-rank CUDA mesh, the
ledger on NCCL.

Marked ``cuda``; every test skips without a CUDA device, so CI never needs one.
``bench/gpu.sh`` runs them (``pytest -m cuda``) with bench/mfu.py.
"""

import pytest
import torch

from plait.spawn import run_distributed
from tests import _cuda_checks as C

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def _run(fn):
    return run_distributed(fn, 1, "cuda", backend="nccl", timeout=300)[0]


def test_device_placement():
    out = _run(C.placement)
    assert out["device"] == "cuda:0"
    assert out["param_devices"] == ["cuda"] and out["state_devices"] == ["cuda"]
    assert out["losses"] == pytest.approx(out["reference"], rel=1e-4)


def test_bf16_autocast():
    out = _run(C.bf16_autocast)
    assert out["matmul_dtypes"] == ["torch.bfloat16"]
    assert out["param_dtypes"] == ["torch.float32"]  # fp32 master weights
    assert out["losses"] == pytest.approx(out["reference"], rel=2e-2)


def test_compile_matches_eager():
    out = _run(C.compiled)
    assert out["logit_diff"] < 1e-3
    assert out["grad_diff"] < 1e-3


def test_plan_compile_with_bf16():
    out = _run(C.plan_compile_bf16)
    assert out["graphs"] > 0
    assert out["losses"] == pytest.approx(out["reference"], rel=1e-2)


def test_fsdp2_on_a_one_rank_cuda_mesh():
    out = _run(C.fsdp2_one_rank)
    assert out["param_types"] == ["DTensor"]
    assert out["losses"] == pytest.approx(out["reference"], rel=1e-4)


def test_tensor_parallel_on_a_one_rank_cuda_mesh():
    out = _run(C.tp_one_rank)
    assert out["param_types"] == ["DTensor"]
    assert out["losses"] == pytest.approx(out["reference"], rel=1e-4)


def test_ledger_on_nccl():
    out = _run(C.ledger_backend)
    assert out["backend"] == "nccl"
    rows = {(r["axis"], r["op"]): r for r in out["rows"]}
    row = next(r for (axis, op), r in rows.items() if op == "all_reduce")
    assert row["count"] == 2
    assert row["payload_bytes"] == 2 * 4096
