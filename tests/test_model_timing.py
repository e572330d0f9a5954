"""The planner times a model without blocks on this machine where the cluster is this machine.

The model written for these tests spends its forward in a Python loop: its FLOPs and aten ops
say nothing of its time, so only a timing prices it. Local timings are used only for a profile
calibrated here (its host record is this machine's), never for a preset or another machine's.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import pytest
import torch
import torch.nn as nn
from torch.utils.data import Dataset

from plait.plan import Plan
from plait.planner import constants_for, load_cluster
from plait.planner.hardware import save_cluster
from plait.planner.model_timing import factory_timer, is_this_machine, this_host
from plait.planner.whole_model import estimate, from_factory

SLOW = "tests.test_model_timing:slow_loop"
SPINS = 150_000  # Python iterations per forward: some milliseconds, whatever the batch


class SlowLoop(nn.Module):
    """A Linear layer after a pure-Python loop: tens of FLOPs, a few aten ops, milliseconds."""

    def __init__(self, spins: int = SPINS):
        super().__init__()
        self.spins = spins
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = 0
        for i in range(self.spins):
            acc = (acc * 31 + i) % 1_000_003
        return self.lin(x) * (1.0 + acc * 0.0)


class Rows(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(4, generator=g)


def slow_loop() -> tuple[nn.Module, Dataset, object]:
    return SlowLoop(), Rows(), nn.functional.mse_loss


def _here(tmp_path, host: dict | None = None) -> str:
    """The cpu preset as a profile calibrated on this machine (or on ``host``), as a YAML."""
    cpu = load_cluster("cpu")
    extra = {**cpu.extra, "host": host or this_host()}
    where = tmp_path / ("here.yaml" if host is None else f"{host['name']}.yaml")
    return str(save_cluster(dataclasses.replace(cpu, extra=extra), where))


def _measured(rows: int, repeats: int = 5) -> float:
    """Median seconds of one forward + loss + backward of SlowLoop on ``rows`` rows."""
    model, data, loss_fn = slow_loop()
    x = torch.stack([data[i][0] for i in range(rows)])
    y = torch.stack([data[i][1] for i in range(rows)])
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        loss_fn(model(x), y).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def test_a_model_its_flops_misprice_is_priced_from_its_own_time(tmp_path):
    """On a profile calibrated here the compute of a layout is the model's forward + backward
    timed at the layout's per-rank batch: within a band of the time measured here; from FLOPs
    and ops it is a small fraction of it."""
    cluster = load_cluster(_here(tmp_path), devices=2)
    c = constants_for(cluster)
    whole, _ = from_factory(SLOW)
    plan = Plan(dp_replicate=2)
    timer = factory_timer(SLOW, whole.saved_per_sample, cluster)
    timed = estimate(whole, plan, cluster, 16, c, timer)
    flops = estimate(whole, plan, cluster, 16, c)
    measured = _measured(8)
    assert timed.microbatch_size == 8 and list(timer.times) == [8]
    # a band wide enough for a machine shared with other jobs; FLOPs and ops miss it by 100x
    assert 1 / 3 < timed.time_breakdown["compute"] / measured < 3.0
    assert flops.time_breakdown["compute"] < 0.1 * measured
    assert timed.compute_from.startswith("measured on this machine at batch 8")
    assert flops.compute_from.startswith("FLOPs at efficiency")
    # the traffic is priced as before (the update: below)
    for key in ("dp_grad_total", "param_gather", "sync_bn"):
        assert timed.time_breakdown[key] == flops.time_breakdown[key]


def test_ddps_update_is_timed_and_zeros_sharded_ones_are_priced_as_before(tmp_path):
    """DDP's update is plait's plain one over every tensor: timed with the model (and left
    out of the timing: the model's parameters are as built); ZeRO's are priced per tensor."""
    cluster = load_cluster(_here(tmp_path), devices=2)
    c = constants_for(cluster)
    whole, _ = from_factory(SLOW)
    timer = factory_timer(SLOW, whole.saved_per_sample, cluster)
    before = [p.detach().clone() for p in timer.model.parameters()]
    ddp = estimate(whole, Plan(dp_replicate=2), cluster, 16, c, timer)
    assert ddp.time_breakdown["optimizer"] == pytest.approx(timer.update())
    assert 0 < timer.update() < 1.0
    assert any(n.startswith("update (clip, AdamW over 2 tensors): measured") for n in ddp.notes)
    assert all(torch.equal(a, b) for a, b in zip(before, timer.model.parameters(), strict=True))
    zero1 = Plan(dp_shard=2, zero=1)
    assert estimate(whole, zero1, cluster, 16, c, timer).time_breakdown["optimizer"] == \
        estimate(whole, zero1, cluster, 16, c).time_breakdown["optimizer"]


def test_a_timing_on_a_busy_machine_says_so():
    from plait.planner.model_timing import Timed

    quiet = Timed(rows=8, seconds=0.010, forward_s=0.004, iterations=5, threads=1,
                  fastest_s=0.009, slowest_s=0.011)
    busy = dataclasses.replace(quiet, slowest_s=0.030)
    assert quiet.says() == "measured on this machine at batch 8 (1 thread, median of 5)"
    assert busy.says().endswith("its passes took 9-30 ms: the machine is busy, time again "
                                "when it is quiet")


def test_grad_accum_times_the_micro_step_and_runs_it_accum_times(tmp_path):
    cluster = load_cluster(_here(tmp_path), devices=2)
    c = constants_for(cluster)
    whole, _ = from_factory(SLOW)
    timer = factory_timer(SLOW, whole.saved_per_sample, cluster)
    est = estimate(whole, Plan(dp_replicate=2, grad_accum=2), cluster, 16, c, timer)
    assert list(timer.times) == [4]
    assert est.time_breakdown["compute"] == pytest.approx(2 * timer.times[4].seconds)


def test_plait_plan_says_where_each_layouts_compute_came_from(tmp_path, capsys):
    from plait.cli import main

    here = _here(tmp_path)
    argv = ["plan", "--model", SLOW, "--devices", "2", "--batch", "16", "--format", "json"]
    assert main([*argv, "--cluster", here]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compute_timed"] is True
    assert "timed on this machine" in report["compute_timing"]
    assert all(p["compute_from"].startswith("measured on this machine at batch 8")
               for p in report["plans"])
    assert main([*argv, "--cluster", here, "--time-model", "off"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compute_timed"] is False
    assert all(p["compute_from"].startswith("FLOPs at efficiency") for p in report["plans"])
    assert main([*argv[:-2], "--cluster", here]) == 0
    text = capsys.readouterr().out
    assert "compute: the model's forward + backward timed on this machine" in text
    assert "compute at batch 8: measured on this machine at batch 8" in text


def test_local_timings_never_price_a_preset_or_another_machine(tmp_path, capsys):
    """A preset, or a profile calibrated on another host, is priced from FLOPs; asking for
    timings there is an error that says why and how to get them."""
    from plait.cli import main

    other = _here(tmp_path, host={**this_host(), "name": "elsewhere"})
    assert is_this_machine(load_cluster("cpu"))[0] is False
    assert is_this_machine(load_cluster(other))[0] is False
    assert is_this_machine(load_cluster(_here(tmp_path)))[0] is True
    argv = ["plan", "--model", SLOW, "--devices", "2", "--batch", "16", "--format", "json"]
    for cluster in ("cpu", other):
        assert main([*argv, "--cluster", cluster]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["compute_timed"] is False
        assert all(p["compute_from"].startswith("FLOPs") for p in report["plans"])
    assert main([*argv, "--cluster", "cpu", "--time-model", "on"]) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert "--time-model on" in err and "plait plan --calibrate" in err
    assert main([*argv, "--cluster", other, "--time-model", "on"]) == 2
    assert "calibrated on elsewhere" in json.loads(capsys.readouterr().out)["error"]


def test_a_model_too_slow_or_too_big_to_time_is_priced_from_flops_and_says_so(
        tmp_path, monkeypatch):
    from plait.planner import model_timing

    cluster = load_cluster(_here(tmp_path), devices=2)
    c = constants_for(cluster)
    whole, _ = from_factory(SLOW)
    monkeypatch.setattr(model_timing, "SLOW_S", 0.0)
    timer = factory_timer(SLOW, whole.saved_per_sample, cluster)
    est = estimate(whole, Plan(dp_replicate=2), cluster, 16, c, timer)
    assert est.compute_from.startswith("FLOPs")
    assert any(n.startswith("not timed at batch 8: one forward + backward took")
               for n in est.notes)
    monkeypatch.undo()
    timer = factory_timer(SLOW, whole.saved_per_sample, cluster)
    timer.free_bytes = 1.0
    est = estimate(whole, Plan(dp_replicate=2), cluster, 16, c, timer)
    assert est.compute_from.startswith("FLOPs")
    assert any("GiB free on this machine" in n for n in est.notes)


def test_a_slow_timing_says_so_first(tmp_path, monkeypatch):
    """A timing expected to take over PROGRESS_S says so before it runs (the CLI sends the
    line to stderr); here every timing is 'slow'."""
    from plait.planner import model_timing

    monkeypatch.setattr(model_timing, "PROGRESS_S", 0.0)
    cluster = load_cluster(_here(tmp_path), devices=2)
    whole, _ = from_factory(SLOW)
    lines: list[str] = []
    timer = factory_timer(SLOW, whole.saved_per_sample, cluster, progress=lines.append)
    timer(2)
    assert lines and lines[0].startswith(f"timing {SLOW} forward + backward at batch 2")
