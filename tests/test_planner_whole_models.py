"""The planner prices models without a stack of repeated matmul blocks (ConvNets, RNNs): their
data-parallel layouts ranked from measured FLOPs, saved bytes and traffic, tensor and pipeline
parallelism left out with the model's own reasons, before any process starts."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from plait.plan import Plan

RESNET = "tests._any_models:resnet"
LSTM = "tests._any_models:lstm_lm"
UNET = "tests._any_models:unet"


# ------------------------------------------------------------- a model written for the test
class Signals(Dataset):
    """1-D signals of 4 channels x 20 steps and a class each."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, 20, generator=g), torch.randint(0, 3, (), generator=g)


class ConvGRU(nn.Module):
    """A strided 1-D convolution with BatchNorm, a GRU over its steps, a linear head."""

    def __init__(self, width: int = 6, hidden: int = 5):
        super().__init__()
        self.conv = nn.Conv1d(4, width, kernel_size=3, stride=2, padding=1)
        self.bn = nn.BatchNorm1d(width)
        self.rnn = nn.GRU(width, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x))).transpose(1, 2)
        out, _ = self.rnn(h)
        return self.head(out[:, -1])


def conv_gru() -> tuple[nn.Module, Dataset, object]:
    return ConvGRU(), Signals(), F.cross_entropy


class Wide(nn.Module):
    """A ConvNet of 8 x 1024-channel 3x3 convolutions (75.5M parameters): its fp32 state with
    AdamW (16 bytes a parameter, 1.2 GB) does not fit a small device unless ZeRO shards it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 1024, 3, padding=1)
        self.blocks = nn.Sequential(*(nn.Conv2d(1024, 1024, 3, padding=1) for _ in range(8)))
        self.head = nn.Linear(1024, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def wide() -> tuple[nn.Module, Dataset, object]:
    class Tiny(Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.zeros(3, 4, 4), torch.tensor(0)
    return Wide(), Tiny(), F.cross_entropy


def _plan_json(capsys, *argv: str) -> tuple[int, dict]:
    from plait.cli import main

    code = main(["plan", "--cluster", "cpu", "--format", "json", *argv])
    return code, json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------------------- measured
def test_flops_and_saved_bytes_are_measured_on_the_models_own_layers():
    """Forward FLOPs by FlopCounterMode (the convolution, the head) plus the GRU's gate
    matmuls, which torch's fused op hides from the counter; BatchNorm channels; saved bytes
    per sample from a forward at one and two samples."""
    from plait.planner.whole_model import from_factory

    whole, _ = from_factory("tests.test_planner_whole_models:conv_gru")
    steps = 10  # 20 steps, stride 2
    conv = 2 * 6 * 4 * 3 * steps
    gru = 2 * 3 * 5 * (6 + 5) * steps
    head = 2 * 5 * 3
    assert whole.flops_per_sample == conv + gru + head
    assert whole.batchnorm == (("bn", 6),)
    assert whole.kinds == ("convolutions", "recurrent layers")
    assert whole.params == sum(p.numel() for p in ConvGRU().parameters())
    # at least the conv's output, the BatchNorm's and the GRU's inputs: 6 x 10 fp32 each
    assert whole.saved_per_sample >= 3 * 6 * steps * 4


def test_the_lstm_counts_its_recurrent_matmuls():
    from plait.planner.whole_model import from_factory

    whole, _ = from_factory(LSTM)
    lstm = 2 * (2 * 4 * 16 * (16 + 16)) * 12  # 2 layers x 4 gates, 12 steps
    head = 2 * 16 * 32 * 12
    assert whole.flops_per_sample == lstm + head
    assert whole.sample_from == "dataset" and whole.positions == 12


# -------------------------------------------------------------------------------- ranking
def test_plait_plan_ranks_the_data_parallel_layouts_of_a_resnet(capsys):
    """Every data-parallel layout, each with sync_bn (its BatchNorm), ranked by predicted step
    time; the bytes are the ledger's formula: DDP all-reduces the fp32 gradients and
    broadcasts the buffers, sync_bn all-reduces 2 x (2C + 1) fp32 values per layer."""
    from tests._any_models import ResNet

    code, out = _plan_json(capsys, "--model", RESNET, "--devices", "4", "--global-batch", "32")
    assert code == 0, out
    plans = {p["plan"]: p for p in out["plans"]}
    assert set(plans) == {"dp_replicate=4,sync_bn=true", "dp_shard=4,zero=1,sync_bn=true",
                          "dp_shard=4,zero=2,sync_bn=true", "dp_shard=4,zero=3,sync_bn=true"}
    times = [p["step_time_s"] for p in out["plans"]]
    assert times == sorted(times)
    model = ResNet()
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    bns = [m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    ddp = {(t["what"], t["op"]): t for t in plans["dp_replicate=4,sync_bn=true"]["traffic"]}
    assert ddp["grads", "all_reduce"]["payload_bytes"] == 4 * params
    assert ddp["buffers (DDP)", "broadcast"]["payload_bytes"] == buffers
    sync = ddp["sync_bn statistics", "all_reduce"]
    assert sync["payload_bytes"] == 4 * sum(2 * (2 * c + 1) for c in bns)
    assert sync["calls"] == 4 * len(bns)
    assert plans["dp_replicate=4,sync_bn=true"]["time_breakdown"]["sync_bn"] > 0
    # memory: ZeRO-3 holds a quarter of the parameters, gradients and optimizer state
    z3 = plans["dp_shard=4,zero=3,sync_bn=true"]["memory_breakdown"]
    assert z3["optimizer"] == pytest.approx(8 * params / 4)
    assert out["measured"]["forward_flops_per_sample"] > 0
    assert "convolutions (stem.0" in out["excluded"]["tp"]
    assert "BatchNorm stem.1" in out["excluded"]["pp"]


def test_a_convnet_too_big_for_one_device_is_given_zero3(capsys):
    """75.5M parameters on 1 GB devices (0.54 GB of it reserved): DDP (16 bytes a parameter),
    ZeRO-1 (10) and ZeRO-2 (8: the whole fp32 model gathered) do not fit, ZeRO-3 over four
    ranks (4, and two 9.4M-parameter blocks gathered at a time) does."""
    code, out = _plan_json(capsys, "--model", "tests.test_planner_whole_models:wide",
                           "--devices", "4", "--global-batch", "8", "--memory-gb", "1.0")
    assert code == 0, out
    assert [p["plan"] for p in out["plans"]] == ["dp_shard=4,zero=3"]
    # DDP, ZeRO-1 and ZeRO-2, each without and with its blocks checkpointed, at grad_accum 1
    # and 2 (its 2 rows per rank): the parameters, not the activations, do not fit
    assert out["rejected"] == {"out of memory": 12}


def test_the_lstm_and_the_unet_name_why_tp_and_pp_are_left_out(capsys):
    code, out = _plan_json(capsys, "--model", LSTM, "--devices", "2", "--global-batch", "8")
    assert code == 0 and out["plans"], out
    assert "recurrent layers (rnn) are not split over tp" in out["excluded"]["tp"]
    assert "no nn.ModuleList, nn.Sequential or nn.ModuleDict" in out["excluded"]["pp"]
    code, out = _plan_json(capsys, "--model", UNET, "--devices", "2", "--global-batch", "8")
    assert code == 0 and out["plans"], out
    assert "a skip connection across the blocks of ups" in out["excluded"]["pp"]


def test_a_pipeline_over_a_unets_skips_is_refused_at_plan_time(capsys):
    """The U-Net's decoder blocks take the encoder's outputs: a later stage is never sent them.
    plait plan --plan pp=2, the layout check plan='auto' asks and plait check refuse it up
    front, naming the block, not at a stage's first step."""
    from plait.auto import layout_check
    from plait.check import CheckConfig, check
    from tests._any_models import UNet

    code, out = _plan_json(capsys, "--model", UNET, "--plan", "pp=2", "--global-batch", "8")
    assert code == 1 and "ups.0 takes a tensor the forward computed before it" in \
        out["message"], out
    assert "skip connection" in str(layout_check(UNet())(Plan(pp=2, microbatches=2)))
    with pytest.raises(ValueError, match="a skip connection across the blocks of ups"):
        check("pp=2", CheckConfig(model="unet", factory=UNET, batch_size=8))


def test_plan_auto_ranks_a_convnet_instead_of_taking_ddp_unpriced():
    from plait.auto import AutoRequest, choose
    from tests._any_models import ResNet

    plan, why = choose(ResNet(), AutoRequest(world_size=2, device_type="cpu"))
    assert plan.sync_bn and plan.dp == 2
    text = "\n".join(why)
    assert "measured on a guessed input (3," in text and "step" in text, text
    assert "not searched: pp: BatchNorm stem.1" in text, text


def _ready_on_real_tensors(model, x):
    """The order a real backward makes ``model``'s gradients ready in (indices into its
    parameters), read by a hook on each."""
    order = []
    params = list(model.parameters())
    handles = [p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i))
               for i, p in enumerate(params)]
    try:
        model(x).sum().backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return order


def test_ddp_and_zero1_calls_are_the_ledgers():
    """The planner's DDP all-reduces are the ledger's buckets (filled in the order the
    backward makes the gradients ready, each closed once it holds the cap), and ZeRO-1
    broadcasts each parameter tensor."""
    from plait.comm.volumes import ddp_bucket_calls
    from plait.planner.whole_model import from_module, held
    from tests._any_models import ResNet

    model = ResNet()
    whole = from_module(model)
    params = list(model.parameters())
    order = _ready_on_real_tensors(model, torch.randn(2, *whole.sample_shape))
    assert list(whole.grad_order) == order
    sizes = [("fp32", 4.0 * params[i].numel()) for i in order]
    cap = 4096.0
    assert 2 < ddp_bucket_calls(sizes, cap) < len(sizes)  # several buckets, not one per tensor
    assert held(whole, Plan(dp_replicate=2), cap).grad_calls == ddp_bucket_calls(sizes, cap)
    assert held(whole, Plan(dp_shard=2, zero=1)).update_tensors == len(sizes)


# ------------------------------------------------------------------- per-op host time
def _real_ops(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Aten ops a real forward of ``model`` on ``x`` dispatches, and its backward's."""
    from plait.planner.op_count import op_counter

    forward, backward = op_counter(), op_counter()
    with forward:
        out = model(x)
    with backward:
        out.sum().backward()
    return forward.ops, backward.ops


def test_the_ops_priced_are_the_ops_a_real_step_dispatches():
    """Forward and backward ops counted on fake tensors are those of the real model (the
    ConvGRU written here, whose GRU torch runs step by step on a CPU) on one sample, as
    measured, and the update's ops are what plait's apply_update runs over the model's
    parameter tensors."""
    from plait.plan import Plan
    from plait.planner.op_count import op_counter
    from plait.planner.whole_model import from_factory
    from plait.train import apply_update

    whole, _ = from_factory("tests.test_planner_whole_models:conv_gru")
    torch.manual_seed(0)
    model = ConvGRU()
    x = Signals()[0][0].unsqueeze(0)
    assert (whole.forward_ops, whole.backward_ops) == _real_ops(model, x)
    assert whole.forward_ops > 5 and whole.backward_ops > 5
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    totals = torch.tensor([1.0, 3.0])
    counter = op_counter()
    for step in range(2):
        _real_ops(model, x)
        with counter if step else contextlib.nullcontext():
            apply_update(opt, totals, plan=Plan())
    assert counter.ops == whole.update_ops_fixed + whole.update_ops_per_tensor * sum(
        1 for _ in model.parameters())


def test_each_op_costs_the_devices_latency_added_on_a_cpu_hidden_on_a_gpu():
    """On a CPU the host's time per op adds to the FLOPs' time, for the forward, the backward
    and the update, in every micro-step; a GPU's host launches ahead of it, so its step's
    compute is the longer of the two."""
    from plait.planner import constants_for, load_cluster
    from plait.planner.whole_model import estimate, from_factory

    whole, _ = from_factory(LSTM)
    cpu = load_cluster("cpu", devices=2)
    assert cpu.op_latency > 0 and cpu.ops_in_line
    plan = Plan(dp_replicate=2, grad_accum=2)
    c = dataclasses.replace(constants_for(cpu), overlap=False)  # nothing hides the gradients
    zero, slow = (estimate(whole, plan, dataclasses.replace(cpu, op_latency=lat), 16, c)
                  for lat in (0.0, 1e-3))
    ops = 2 * (whole.forward_ops + whole.backward_ops) + whole.update_ops_fixed + \
        whole.update_ops_per_tensor * whole.param_tensors
    assert slow.step_time_s - zero.step_time_s == pytest.approx(ops * 1e-3)
    assert slow.time_breakdown["dispatch"] == pytest.approx(
        2 * (whole.forward_ops + whole.backward_ops) * 1e-3)
    gpu = load_cluster("dgx-h100", devices=2)
    assert gpu.op_latency > 0 and not gpu.ops_in_line
    cg = constants_for(gpu)
    fast, launch_bound = (estimate(whole, plan, dataclasses.replace(gpu, op_latency=lat), 16, cg)
                          for lat in (0.0, 1e-3))
    assert launch_bound.time_breakdown["compute"] == pytest.approx(
        2 * (whole.forward_ops + whole.backward_ops) * 1e-3)
    assert fast.time_breakdown["compute"] < 1e-4  # the FLOPs alone: microseconds on an H100
    assert launch_bound.time_breakdown["optimizer"] == fast.time_breakdown["optimizer"]


def test_calibrate_measures_the_time_of_one_op_and_the_profile_keeps_it(tmp_path):
    from plait.planner.block_probe import measure_op_latency
    from plait.planner.hardware import load_cluster, save_cluster

    latency = measure_op_latency(depths=(2, 8), repeats=3)
    assert 1e-8 < latency < 1e-3
    cpu = load_cluster("cpu")
    path = save_cluster(dataclasses.replace(cpu, op_latency=latency), tmp_path / "c.yaml")
    assert load_cluster(path).op_latency == pytest.approx(latency)
    with pytest.raises(ValueError, match="op_latency"):
        dataclasses.replace(cpu, op_latency=-1.0)


# --------------------------------------------------------------------------- grad_accum
def test_grad_accum_is_priced_for_a_model_without_blocks():
    """grad_accum=2 on the ResNet: each micro-step runs half the rows (activations halve), the
    ops run twice, sync_bn's statistics are all-reduced in each micro-step, the gradients once
    a step; ZeRO-3 gathers every unit in each micro-step. The batch must split."""
    from plait.planner import constants_for, load_cluster
    from plait.planner.whole_model import estimate, from_factory

    whole, _ = from_factory(RESNET)
    cpu = load_cluster("cpu", devices=2)
    c = constants_for(cpu)
    for layout in ("dp_replicate=2,sync_bn=true", "dp_shard=2,zero=3,sync_bn=true"):
        one, two = (estimate(whole, Plan.from_string(f"{layout},grad_accum={a}"), cpu, 32, c)
                    for a in (1, 2))
        assert one.feasible and two.feasible, two.reason
        assert (one.microbatch_size, two.microbatch_size) == (16, 8)
        assert two.memory_breakdown["activations"] == one.memory_breakdown["activations"] / 2
        assert two.memory_bytes_per_device < one.memory_bytes_per_device
        assert two.time_breakdown["dispatch"] == 2 * one.time_breakdown["dispatch"]
        sent: dict[str, list[float]] = {}
        for i, est in enumerate((one, two)):
            for t in est.traffic:
                sent.setdefault(t.what, [0.0, 0.0])[i] += t.payload
        assert sent["sync_bn statistics"][1] == 2 * sent["sync_bn statistics"][0]
        assert sent["grads"][1] == sent["grads"][0]
        if "zero=3" in layout:
            assert sent["params"][1] == 2 * sent["params"][0]
        assert any("each micro-step's" in n for n in two.notes), two.notes
    odd = estimate(whole, Plan(dp_replicate=2, grad_accum=3), cpu, 32, c)
    assert not odd.feasible and "grad_accum=3" in odd.reason and "multiple of 6" in odd.reason


def test_grad_accum_bytes_are_what_the_ledger_measures():
    """The ResNet trained on 2 gloo ranks through plait's runtime at grad_accum=2, under DDP
    and under ZeRO-3 (sync_bn in both): per axis and collective, the bytes and calls the
    planner predicts are the ledger's measured ones."""
    from plait.planner import constants_for, load_cluster
    from plait.planner.whole_model import estimate, from_factory
    from plait.spawn import run_distributed
    from tests import _workers_planner as W

    layouts = ["dp_replicate=2,sync_bn=true,grad_accum=2",
               "dp_shard=2,zero=3,sync_bn=true,grad_accum=2"]
    whole, _ = from_factory(RESNET)
    cpu = load_cluster("cpu", devices=2)
    measured = run_distributed(W.factory_ledger, 2, RESNET, layouts, 8, timeout=300)[0]
    for layout in layouts:
        est = estimate(whole, Plan.from_string(layout), cpu, 16, constants_for(cpu))
        assert est.feasible, est.reason
        predicted: dict[tuple[str, str], list[float]] = {}
        for t in est.traffic:
            row = predicted.setdefault((t.axis, t.op), [0.0, 0])
            row[0] += t.payload
            row[1] += t.calls
        got = {(r["axis"], r["op"]): [r["payload_bytes"], r["count"]]
               for r in measured[layout]}
        assert got == predicted, (layout, got, predicted)


def test_the_search_accumulates_gradients_where_a_model_without_batchnorm_does_not_fit():
    """On devices too small for the LSTM's rows at once, each layout takes the smallest
    grad_accum whose micro-steps fit; a model with BatchNorm is never given grad_accum."""
    from plait.planner import constants_for, load_cluster
    from plait.planner.whole_model import estimate, from_factory, rank

    whole, _ = from_factory(LSTM)
    cpu = load_cluster("cpu", devices=2)
    c = constants_for(cpu)
    ddp = [estimate(whole, Plan(dp_replicate=2, grad_accum=a), cpu, 64, c).memory_bytes_per_device
           for a in (1, 2, 4)]
    assert ddp[0] > ddp[1] > ddp[2]
    small = cpu.with_memory((ddp[1] + ddp[2]) / 2)
    result = rank(whole, small, 64, dtype="fp32", c=c, top=0)
    picked = {(e.plan.dp_replicate, e.plan.zero): e.plan.grad_accum for e in result.ranked}
    assert picked[(2, 0)] == 4
    for est in result.ranked:
        assert est.memory_bytes_per_device <= small.memory_bytes
        if est.plan.grad_accum > 1:
            fewer = est.plan.replace(grad_accum=est.plan.grad_accum // 2)
            assert not estimate(whole, fewer, small, 64, c).feasible
    resnet, _ = from_factory(RESNET)
    tight = cpu.with_memory(estimate(resnet, Plan(dp_replicate=2, sync_bn=True), cpu, 64,
                                     c).memory_bytes_per_device * 0.999)
    assert all(e.plan.grad_accum == 1
               for e in rank(resnet, tight, 64, dtype="fp32", c=c, top=0).ranked)
def test_ready_order_on_real_tensors_where_fake_ones_cannot_run():
    """A GRU over packed sequences (lengths read off the values: no fake pass): the order is
    read on one real sample with copies of the parameters, as a real backward shows it, and
    the model's own parameters get no gradient."""
    from plait.planner.whole_model import ready_order
    from tests._any_models import gru_packed

    model, data, _ = gru_packed()
    tokens = data[0][0]
    order = ready_order(model, tokens)
    assert all(p.grad is None for p in model.parameters())
    assert order is not None and list(order) == _ready_on_real_tensors(model, tokens[None])


def test_ddp_calls_in_the_order_gradients_become_ready():
    """A model that registers its head before its body (``HeadFirst``): the planner reads the
    order its gradients become ready in from a backward on fake tensors, the order a real
    backward shows, and counts one DDP bucket at 25 MiB, as the ledger measures on two ranks
    (tests/test_ledger_calls.py); the parameters' reversed order would count two. Where the
    pass shows no order, the count is not claimed."""
    import dataclasses

    from plait.comm.volumes import DDP_BUCKET_BYTES, ddp_bucket_calls
    from plait.planner.whole_model import held, measure
    from tests._workers_ledger_calls import HeadFirst

    torch.manual_seed(0)
    model = HeadFirst()
    whole = measure(model, torch.randint(0, 16, (8,)), name="HeadFirst")
    tokens = torch.randint(0, 16, (2, 8))
    assert list(whole.grad_order) == _ready_on_real_tensors(model, tokens)
    assert held(whole, Plan(dp_replicate=2)).grad_calls == 1
    reversed_sizes = [("fp32", 4.0 * p.numel()) for p in reversed(list(model.parameters()))]
    assert ddp_bucket_calls(reversed_sizes, DDP_BUCKET_BYTES) == 2
    unknown = dataclasses.replace(whole, grad_order=None)
    assert held(unknown, Plan(dp_replicate=2)).grad_calls is None
    traffic = _grads_row(unknown)
    assert not traffic.calls_known, traffic


def _grads_row(whole):
    """The DDP gradients row the planner prices ``whole`` with at dp_replicate=2."""
    from plait.comm.held import held_traffic
    from plait.planner.whole_model import held

    plan = Plan(dp_replicate=2)
    return next(t for t in held_traffic(plan, held(whole, plan)) if t.op == "all_reduce")
