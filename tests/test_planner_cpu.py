"""CPU calibration (plait.planner.cpu): the robust line fit, the arithmetic turning probe timings
into constants, and the probes on real processes."""

import math

import pytest


def test_fit_line_recovers_known_overhead_despite_inflated_points():
    from plait.planner.cpu.derive import fit_line

    overhead, per_token = 2e-3, 5e-6
    xs = [64 * b for b in (1, 2, 4, 8)] * 2
    ys = [overhead + per_token * x for x in xs]
    ys[1] *= 3.0      # two timings inflated by a neighbour's burst of load
    ys[6] *= 1.8
    fit = fit_line(xs, ys)
    assert fit.intercept == pytest.approx(overhead, rel=1e-6)
    assert fit.slope == pytest.approx(per_token, rel=1e-6)
    assert fit.points == 8 and fit.residual == pytest.approx(0.0, abs=1e-9)
    # a two-point fit from the same data (the old method) is thrown far off by one bad point
    slope2 = (ys[3] - ys[1]) / (xs[3] - xs[1])
    assert abs(ys[1] - slope2 * xs[1] - overhead) > overhead


def test_fit_line_clamps_negative_intercept_and_reports_residual():
    from plait.planner.cpu.derive import fit_line

    xs = [1.0, 2.0, 4.0, 8.0]
    fit = fit_line(xs, [0.9, 2.0, 4.1, 7.9])     # slope ~1, intercept slightly below 0
    assert fit.intercept == 0.0 and fit.slope == pytest.approx(1.0, rel=0.05)
    noisy = fit_line(xs, [1.5, 2.0, 4.0, 8.0])
    assert noisy.residual >= 0.0
    with pytest.raises(ValueError, match="distinct x"):
        fit_line([2.0, 2.0], [1.0, 1.1])


def test_derive_constants_inverts_the_cost_model():
    """Timings synthesised from known constants come back as those constants."""
    from plait.comm.volumes import bus_factor
    from plait.planner.cpu.derive import (
        FSDP_UNITS,
        LARGE_BYTES,
        PROBE,
        SMALL_BYTES,
        TENSOR_COUNTS,
        derive_constants,
    )

    world, alpha, bw, rate = 2, 1e-4, 1e9, 1e10
    truth = {"all_gather": (2.0, 3e-4), "reduce_scatter": (3.0, 2e-4), "broadcast": (0.5, 0.0)}
    raw = {"world": world}
    for op, (factor, call) in list(truth.items()) + [("all_reduce", (1.0, 0.0))]:
        steps = 2 * (world - 1) if op == "all_reduce" else world - 1
        for size in (SMALL_BYTES, LARGE_BYTES):
            raw[f"{op}@{size}"] = alpha * steps + call + size * bus_factor(op, world) / bw * factor
    raw["broadcast_async@1024"] = raw[f"broadcast@{SMALL_BYTES}"] - 5e-5  # overlapping calls
    n1, n2 = TENSOR_COUNTS
    for kind, per in (("plain", 2e-5), ("dtensor", 4e-4)):
        raw[f"{kind}@{n1}"], raw[f"{kind}@{n2}"] = 1e-3 + n1 * per, 1e-3 + n2 * per
    unit_bytes = 4096
    gather = alpha + 3e-4 + unit_bytes * 0.5 / bw * 2.0
    scatter = alpha + 2e-4 + unit_bytes * 0.5 / bw * 3.0
    nosync = 1e-3 + FSDP_UNITS * (gather + 1.5e-3)
    sync = nosync + FSDP_UNITS * (scatter + 0.7e-3)
    raw.update(fsdp_plain=1e-3, fsdp_nosync=nosync, fsdp_sync=sync,
               fsdp_zero3=sync + FSDP_UNITS * (gather + 2.5e-3), fsdp_unit_bytes=unit_bytes)
    tokens = PROBE["batch"] * PROBE["seq"]
    head = 6 * PROBE["dim"] * PROBE["vocab"] * tokens / rate
    block, outside = 0.01, head + 0.002
    raw["probe_plain@1"], raw["probe_plain@2"] = outside + block, outside + 2 * block
    # zero-bubble split: 0.9 ms per call, +25% of each block's backward (2/3 of 6 ms)
    full = {1: 0.5e-3 + 6e-3, 2: 0.5e-3 + 12e-3}
    for n in (1, 2):
        raw[f"zb_full@{n}"], raw[f"zb_split@{n}"] = full[n], full[n] + 0.9e-3 + n * 0.25 * 4e-3
    got = derive_constants(raw, alpha=alpha, bw=bw, rate=rate)
    assert got["all_gather_factor"] == pytest.approx(2.0)
    assert got["all_gather_call_s"] == pytest.approx(3e-4)
    assert got["reduce_scatter_factor"] == pytest.approx(3.0)
    assert got["reduce_scatter_call_s"] == pytest.approx(2e-4)
    assert got["broadcast_factor"] == pytest.approx(0.5)
    assert got["broadcast_call_s"] == pytest.approx(-5e-5)
    assert got["all_reduce_call_s"] == pytest.approx(0.0, abs=1e-12)
    assert got["tensor_step_s"] == pytest.approx(2e-5)
    assert got["dtensor_step_s"] == pytest.approx(4e-4)
    assert got["fsdp_unit_s"] == pytest.approx(1.5e-3)
    assert got["fsdp_reduce_s"] == pytest.approx(0.7e-3)
    assert got["fsdp_regather_s"] == pytest.approx(2.5e-3)
    assert got["micro_overhead_s"] == pytest.approx(0.002)
    assert "tp_block_overhead_s" not in got  # no TP probe timed
    assert got["zb_call_s"] == pytest.approx(0.9e-3)
    assert got["zb_backward_factor"] == pytest.approx(0.25)


def test_group_calibration_runs_on_real_processes():
    """The group micro-benchmarks behind ``plait plan --calibrate`` on 2 real gloo processes
    (one round): every timing is there and positive, and every derived constant the cost model
    reads is a finite number (the zero-bubble split among them)."""
    from plait.planner import CALIBRATED_KEYS
    from plait.planner.cpu.derive import derive_constants, median_of
    from plait.planner.cpu.probes import measure_group
    from plait.spawn import run_distributed

    raw = median_of(run_distributed(measure_group, 2, 1, timeout=240))
    assert all(v > 0 for k, v in raw.items() if k != "world")
    assert {"zb_full@1", "zb_split@2", "probe_tp@2", "fsdp_nosync", "fsdp_sync",
            "fsdp_zero3"} <= set(raw)
    got = derive_constants(raw, alpha=2e-4, bw=1e9, rate=5e10)
    for key, kind in CALIBRATED_KEYS:
        if kind is float and key not in ("block_overhead_s", "link_efficiency"):
            assert key in got and math.isfinite(got[key]), key


def test_block_probe_calibrates_a_preset_on_the_local_device():
    """The accelerator path of ``plait plan --calibrate`` (run here on the CPU, small block):
    the preset keeps its hardware and gets a measured efficiency, source and no range."""
    from plait.planner.block_probe import calibrate_accelerator
    from plait.planner.hardware import load_cluster
    from plait.planner.uncertainty import efficiency_range

    base = load_cluster("dgx-h100")
    got = calibrate_accelerator(base, "cpu", dim=256, seq=128, n_heads=4)
    assert 0 < got.extra["compute_efficiency"] < 1e-2  # a CPU against an H100's peak
    assert got.extra["compute_efficiency_source"].startswith("calibrated on cpu")
    assert "compute_efficiency_range" not in got.extra and got.source == "calibrated"
    assert (got.peak_flops, got.inter_bw) == (base.peak_flops, base.inter_bw)
    # and the time of one op on it, in place of the preset's launch figure
    assert 0 < got.op_latency < 1e-3 and got.op_latency != base.op_latency
    assert got.extra["op_latency_source"].startswith("calibrated on cpu")
    from plait.planner import constants_for
    assert efficiency_range(got, constants_for(got)) is None
    assert constants_for(got).compute_efficiency == got.extra["compute_efficiency"]
