"""The forward pass on fake tensors behind a module's tensor-parallel prices
(plait/planner/tp_trace.py) runs only where its answer can differ from fp32 without
checkpointing: a 16-bit dtype, or checkpointing under tensor parallelism; then once. The pass
itself runs here (counted, not replaced), and the prices are those of a trace made up front."""

from __future__ import annotations

import pytest
import torch

import plait.planner.tp_trace as tp_trace
from plait.comm.predict import why_no_expected
from plait.plan import Plan
from plait.planner.cost import Workload, evaluate
from plait.planner.hardware import load_cluster
from plait.planner.model_stats import load_model
from tests import _traffic_models as T

FP32_PLANS = ["tp=2", "tp=2,sp=true", "pp=2,mb=2", "tp=2,pp=2,mb=2", "dp_shard=4,zero=3"]
TRACED_PLANS = ["tp=2,sp=true,mp=fp16", "tp=2,ac=selective", "pp=2,mb=2,mp=bf16"]


@pytest.fixture
def passes(monkeypatch):
    """How many forward passes tp_trace runs (each one the real pass)."""
    calls: list[str] = []
    real = tp_trace._pass

    def counted(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(tp_trace, "_pass", counted)
    return calls


def _stats(name: str):
    with torch.device("meta"):
        return load_model(T.MODELS[name]())


def _price(stats, layout: str):
    plan = Plan.from_string(layout + ("" if "mp=" in layout else ",mp=fp32"))
    cluster = load_cluster("dgx-h100", devices=plan.world_size)
    est = evaluate(plan, stats, cluster, Workload(8, 16))
    assert est.feasible, est.reason
    return est.comm_bytes_per_step, est.step_time_s


@pytest.mark.parametrize("name", ["llama", "lora"])
def test_fp32_without_checkpointing_runs_no_pass(name, passes):
    stats = _stats(name)
    assert passes == []  # reading the model runs none
    lazy = [_price(stats, p) for p in FP32_PLANS]
    for p in FP32_PLANS:
        assert why_no_expected(Plan.from_string(p), stats, (2, 16)) is None
    assert passes == []
    eager = _stats(name)
    assert eager.tp_block is not None and eager.tp_block.trace is not None
    assert passes == ["fp32", "autocast", "params"]
    assert [_price(eager, p) for p in FP32_PLANS] == lazy


@pytest.mark.parametrize("layout", TRACED_PLANS)
def test_16_bit_or_checkpointing_under_tp_runs_it_once(layout, passes):
    stats = _stats("lora")
    first = _price(stats, layout)
    assert passes == ["fp32", "autocast", "params"]
    assert _price(stats, layout) == first
    _price(stats, "tp=2,mp=bf16")
    assert len(passes) == 3  # kept: not run again


def test_the_ledger_traces_before_layout_only_where_the_plan_reads_it(passes):
    """The runtime takes the planner's stats of the model before laying it out: the pass runs
    then (on the model as built) for a plan that reads it, and never for one that does not
    (no trace of a model already laid out)."""
    from plait.comm.predict import planner_stats, reads_trace

    model = T.MODELS["lora"]()
    fp32 = Plan.from_string("tp=2")
    assert not reads_trace(fp32)
    stats = planner_stats(model, "cpu", fp32)
    assert passes == [] and stats.tp_block.trace is None and passes == []
    bf16 = Plan.from_string("tp=2,mp=bf16")
    assert reads_trace(bf16) and reads_trace(Plan.from_string("tp=2,ac=full"))
    stats = planner_stats(model, "cpu", bf16)
    assert passes == ["fp32", "autocast", "params"]
    assert stats.tp_block.trace is not None and why_no_expected(bf16, stats, (2, 16)) is None
