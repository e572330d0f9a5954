"""The planner: formulas against hand-computed values, search invariants, CLI and bad input."""

import argparse
import json
import math
import random
import time

import pytest

from plait.comm.volumes import by_axis, ddp_traffic, tp_traffic, zero_traffic
from plait.models.transformer import PRESETS, TransformerConfig
from plait.plan import Plan
from plait.planner import auto_plan
from plait.planner.cli import add_plan_arguments, plan_command
from plait.planner.cost import (
    Constants,
    Workload,
    activation_bytes_per_block,
    balanced_partition,
    evaluate,
)
from plait.planner.hardware import load_cluster, presets
from plait.planner.model_stats import from_transformer_config, load_model
from plait.planner.published import NARAYANAN_2021, megatron_flops, row_setup
from plait.planner.search import search

GiB = 2**30


def run_cli(*argv):
    parser = add_plan_arguments(argparse.ArgumentParser())
    return plan_command(parser.parse_args(list(argv)))


# ------------------------------------------------------------------ inputs
def test_catalog_presets_load():
    names = presets()
    for name in ("dgx-a100-80gb", "dgx-h100", "h200", "mi300x", "tpu-v5p", "tpu-v5e", "gaudi2",
                 "cpu"):
        assert name in names
        c = load_cluster(name)
        assert c.memory_bytes > 0 and c.peak("bf16") > 0
    a100 = load_cluster("dgx-a100-80gb", devices=1536)
    assert (a100.nodes, a100.devices_per_node, a100.world_size) == (192, 8, 1536)
    assert a100.intra_bw == 300e9 and a100.inter_bw == 25e9


@pytest.mark.parametrize("name", ["test", "gpt2", "llama-8b", "gpt-145b"])
def test_model_stats_match_reference_param_count(name):
    assert load_model(name).num_params == PRESETS[name].num_params()


def test_hf_config_json(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 128256, "hidden_act": "silu", "tie_word_embeddings": False,
           "max_position_embeddings": 8192}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    stats = load_model(str(path))
    assert stats.num_params == PRESETS["llama-8b"].num_params()
    assert (stats.kv_heads, stats.mlp, stats.max_seq) == (8, "swiglu", 8192)


@pytest.mark.parametrize("model_type", [None, "gpt2"])
def test_gpt2_config_without_activation_is_not_swiglu(model_type):
    """GPT2Config's default activation is gelu_new: a config.json that omits
    ``activation_function`` is a plain 4h GELU MLP, not SwiGLU (which would read Megatron's
    145.6B model as 193.9B)."""
    cfg = {"n_embd": 12288, "n_layer": 80, "n_head": 96, "vocab_size": 51200,
           "n_positions": 2048}
    if model_type:
        cfg["model_type"] = model_type
    stats = load_model(cfg)
    assert stats.mlp == "gelu"
    assert stats.num_params == pytest.approx(145.6e9, rel=0.005)
    llama = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 100, "intermediate_size": 128}
    assert load_model(llama).mlp == "swiglu"  # Llama-style configs default to silu


def test_module_factory_on_meta():
    stats = load_model("tests._planner_factories:reference_test_model")
    ref = from_transformer_config(PRESETS["test"])
    assert stats.n_layers == ref.n_layers and stats.hidden == ref.hidden
    assert stats.block_params == ref.block_params
    assert stats.block_matmul_params == ref.block_matmul_params
    assert stats.num_params == PRESETS["test"].num_params()
    assert stats.n_heads == 8 and stats.attention
    mlp = load_model("tests._planner_factories:mlp_stack")
    assert mlp.n_layers == 6 and mlp.block_matmul_params == 2 * 32 * 64 and not mlp.attention


def test_yaml_model(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("preset: test\nn_layers: 8\n")
    assert load_model(str(path)).n_layers == 8
    path.write_text("dim: 64\nn_layers: 2\nn_heads: 4\n")
    assert load_model(str(path)).num_params == TransformerConfig(dim=64, n_layers=2,
                                                                 n_heads=4).num_params()


# ------------------------------------------------------------------ formulas
def test_activation_memory_matches_korthikanti():
    # GPT block (ffn 4h): 34sbh + 5as^2b bytes at 2 bytes/element, no TP.
    m = from_transformer_config(TransformerConfig(vocab_size=100, dim=64, n_layers=2, n_heads=4,
                                                  mlp="gelu", norm="layernorm"))
    s, b, h, a = 32, 2, 64, 4
    c = Constants(flash_attention=False)
    assert activation_bytes_per_block(m, b, s, 1, False, 2, c) == pytest.approx(
        s * b * h * (34 + 5 * a * s / h))
    t = 4  # TP without SP: sbh(10 + 24/t + 5as/(ht)); with SP: sbh/t (34 + 5as/h)
    assert activation_bytes_per_block(m, b, s, t, False, 2, c) == pytest.approx(
        s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert activation_bytes_per_block(m, b, s, t, True, 2, c) == pytest.approx(
        s * b * h / t * (34 + 5 * a * s / h))
    # flash attention stores no s^2 scores; fp32 doubles everything
    flash = Constants(flash_attention=True)
    assert activation_bytes_per_block(m, b, s, 1, False, 4, flash) == pytest.approx(
        2 * s * b * h * 34)


def _tiny():
    return load_model("test")


def test_memory_of_ddp_and_zero_by_hand():
    m, c = _tiny(), load_cluster("cpu", devices=2)
    work = Workload(4, 32)
    P = m.num_params
    ddp = evaluate(Plan(dp_replicate=2), m, c, work)
    bd = ddp.memory_breakdown
    assert (bd["params"], bd["grads"], bd["optimizer"]) == (4 * P, 4 * P, 8 * P)
    z1 = evaluate(Plan(dp_shard=2, zero=1), m, c, work).memory_breakdown
    assert (z1["params"], z1["grads"], z1["optimizer"]) == (4 * P, 4 * P, 4 * P)
    z2 = evaluate(Plan(dp_shard=2, zero=2), m, c, work).memory_breakdown
    assert (z2["params"], z2["grads"], z2["optimizer"]) == (2 * P, 2 * P, 4 * P)
    assert z2["compute_copy"] == 4 * P  # fp32: the whole model gathered from fwd to bwd
    z3 = evaluate(Plan(dp_shard=2, zero=3), m, c, work).memory_breakdown
    assert (z3["params"], z3["grads"], z3["optimizer"]) == (2 * P, 2 * P, 4 * P)


def test_zero2_memory_matches_the_zero_paper():
    """ZeRO-2 (P_os+g) for 7.5B parameters on 64 devices: docs/zero.md's 16 Psi / d + 2 Psi
    = 16.9 GB, the ZeRO paper's Table 1 16.6 GB (it keeps 16-bit gradients: 14 Psi / d)."""
    cfg = TransformerConfig(vocab_size=51200, dim=4096, n_layers=36, n_heads=32,
                            max_seq_len=2048, mlp="gelu", norm="layernorm")
    m = from_transformer_config(cfg)
    assert m.num_params == pytest.approx(7.5e9, rel=0.03)
    c = load_cluster("dgx-a100-80gb", devices=64)
    fields = dict(mixed_precision="bf16", activation_checkpointing="full")
    e = evaluate(Plan(dp_shard=64, zero=2, **fields), m, c, Workload(64, 2048))
    bd = e.memory_breakdown
    state = bd["params"] + bd["grads"] + bd["optimizer"] + bd["compute_copy"]
    psi = m.num_params
    assert state == pytest.approx(16 * psi / 64 + 2 * psi)
    assert state / 1e9 == pytest.approx(16.6 * psi / 7.5e9, rel=0.03)
    z1 = evaluate(Plan(dp_shard=64, zero=1, **fields), m, c, Workload(64, 2048))
    assert z1.memory_breakdown["params"] == 4 * psi  # plait's runtime: DDP + ZeRO optimizer
    assert any("every rank" in n for n in z1.notes)
    assert not e.notes


def test_estimate_bytes_come_from_the_volume_formulas():
    m, c = _tiny(), load_cluster("cpu", devices=4)
    work = Workload(8, 32)
    e = evaluate(Plan(dp_replicate=2, tp=2), m, c, work)
    P = m.num_params // 2  # every parameter is split over tp in the model of the cost
    expected = by_axis(ddp_traffic(P, 2) + tp_traffic(4, 32, m.hidden, m.n_layers, 2, "fp32"))
    dp_bytes = e.comm_bytes_per_step["dp_replicate"]
    assert dp_bytes == pytest.approx(expected["dp_replicate"], rel=1e-6)
    assert e.comm_bytes_per_step["tp"] == pytest.approx(expected["tp"])
    z = evaluate(Plan(dp_shard=4, zero=3), m, c, work)
    # FSDP2's root unit (embedding, final norm, head) is gathered once per micro-step
    expected = by_axis(zero_traffic(m.num_params, 4, 3, micro_steps=1,
                                    root_params=m.embed_params + m.head_params))
    assert z.comm_bytes_per_step["dp_shard"] == pytest.approx(expected["dp_shard"], rel=1e-6)


def test_pipeline_bubble_formula():
    # uniform stages, 1F1B: bubble = (p-1)/(m+p-1); interleaved v: (p-1)/(v m + p-1)
    m = load_model("test").__class__(**{**load_model("test").__dict__, "vocab": 1,
                                         "embed_params": 0, "head_params": 0})
    c = load_cluster("cpu", devices=4).with_memory(1e12)
    # a core per process (compute_units=None): the closed forms are for dedicated devices;
    # shared cores are priced by simulation (tests/test_planner_sharing.py)
    c = c.__class__(**{**c.__dict__, "intra_latency": 0.0, "inter_latency": 0.0,
                       "intra_bw": 1e30, "inter_bw": 1e30, "hbm_bw": 1e30,
                       "compute_units": None})
    work = Workload(8, 32)
    e = evaluate(Plan(pp=4, microbatches=8), m, c, work)
    assert e.feasible, e.reason
    assert e.bubble_fraction == pytest.approx(3 / 11, rel=1e-2)
    e = evaluate(Plan(pp=2, microbatches=8, pp_schedule="interleaved_1f1b", virtual_stages=2),
                 m, c.with_world(2), Workload(8, 32))
    assert e.feasible, e.reason
    assert e.bubble_fraction == pytest.approx(1 / 17, rel=1e-2)


def _brute_partition(costs, parts):
    best = None
    n = len(costs)

    def rec(start, k, sizes):
        nonlocal best
        if k == 1:
            sizes = sizes + [n - start]
            chunks, i = [], 0
            for s in sizes:
                chunks.append(sum(costs[i:i + s]))
                i += s
            if best is None or max(chunks) < best - 1e-12:
                best = max(chunks)
            return
        for size in range(1, n - start - k + 2):
            rec(start + size, k - 1, sizes + [size])

    rec(0, parts, [])
    return best


def test_balanced_partition_is_optimal_and_relieves_heavy_ends():
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(2, 9)
        k = rng.randint(1, n)
        costs = [rng.uniform(0.5, 3) for _ in range(n)]
        sizes = balanced_partition(costs, k)
        assert len(sizes) == k and sum(sizes) == n and min(sizes) >= 1
        i, worst = 0, 0.0
        for s in sizes:
            worst = max(worst, sum(costs[i:i + s]))
            i += s
        assert worst == pytest.approx(_brute_partition(costs, k))
    sizes = balanced_partition([3.0] + [1.0] * 14 + [3.0], 4)
    assert sizes[0] < sizes[1] and sizes[-1] < sizes[-2]


# ------------------------------------------------------------------ search invariants
def test_every_plan_validates_and_search_is_deterministic():
    m, c = load_model("llama-8b"), load_cluster("dgx-h100", devices=64)
    a = search(m, c, Workload(256, 4096), top=20)
    b = search(m, c, Workload(256, 4096), top=20)
    assert a.ranked and [e.plan for e in a.ranked] == [e.plan for e in b.ranked]
    assert [e.step_time_s for e in a.ranked] == [e.step_time_s for e in b.ranked]
    for e in a.ranked:
        assert e.plan.validate(64) is e.plan
        assert e.feasible and e.memory_bytes_per_device <= c.memory_bytes
        assert set(e.comm_bytes_per_step) <= {"dp_replicate", "dp_shard", "tp", "pp"}
    times = [e.step_time_s for e in a.ranked]
    assert times == sorted(times)


def test_more_memory_never_slower():
    m = load_model("llama-13b")
    base = load_cluster("dgx-a100-40gb", devices=32)
    previous = math.inf
    for gb in (40, 80, 160, 320):
        r = search(m, base.with_memory(gb * 1e9), Workload(128, 4096), top=1)
        assert r.best is not None
        assert r.best.step_time_s <= previous * (1 + 1e-9)
        previous = r.best.step_time_s


def test_model_that_fits_nowhere_is_explained(capsys):
    with pytest.raises(ValueError, match="no layout"):
        auto_plan("gpt-175b", 8, "dgx-a100-80gb", global_batch=8, seq=2048)
    code = run_cli("--model", "gpt-175b", "--cluster", "dgx-a100-80gb", "--devices", "8",
                   "--global-batch", "64", "--seq", "2048")
    out = capsys.readouterr().out
    assert code == 1
    assert "no layout" in out and "smallest cluster that fits" in out


def test_auto_plan_small_world():
    plan = auto_plan("test", 4, "cpu", global_batch=8, seq=32)
    assert isinstance(plan, Plan) and plan.world_size == 4


def test_search_1024_devices_within_bound():
    m, c = load_model("gpt-175b"), load_cluster("dgx-a100-80gb", devices=1024)
    start = time.perf_counter()
    r = search(m, c, Workload(1536, 2048), top=5)
    assert time.perf_counter() - start <= 5.0
    assert r.best is not None and r.best.plan.world_size == 1024


# ------------------------------------------------------------------ published figures
def test_megatron_145b_within_20_percent_and_planner_no_worse():
    row = next(r for r in NARAYANAN_2021 if r.params_b == 145.6)
    model, cluster, work, plan = row_setup(row)
    assert (plan.tp, plan.pp, plan.dp) == (8, 8, 24)
    e = evaluate(plan, model, cluster, work)
    assert e.feasible, e.reason
    flops = megatron_flops(row.batch, 2048, row.layers, row.hidden, 51200)
    tflops = flops / e.step_time_s / row.gpus / 1e12
    assert abs(tflops / 148 - 1) <= 0.20, tflops
    pick = search(model, cluster, work, top=1).best
    assert pick.step_time_s <= e.step_time_s


# ------------------------------------------------------------------ CLI and bad input
def test_cli_json_has_required_fields(capsys):
    code = run_cli("--model", "llama-8b", "--cluster", "dgx-h100", "--nodes", "2",
                   "--global-batch", "64", "--seq", "2048", "--top", "3", "--format", "json")
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and len(data["plans"]) == 3
    for p in data["plans"]:
        for key in ("layout", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu",
                    "memory_bytes_per_device", "comm_bytes_per_step", "bubble_fraction"):
            assert key in p
        Plan.from_dict(p["layout"]).validate(16)


def test_cli_evaluates_given_plan(capsys):
    code = run_cli("--model", "gpt-145b", "--cluster", "dgx-a100-80gb", "--global-batch", "2304",
                   "--plan", "dp=24,tp=8,pp=8,schedule=interleaved_1f1b,v=2,mb=96,ac=full,mp=bf16")
    out = capsys.readouterr().out
    assert code == 0 and "pp=8 x dp_replicate=24 x tp=8" in out


def test_cli_table_and_pareto(tmp_path, capsys):
    png = tmp_path / "pareto.png"
    code = run_cli("--model", "test", "--cluster", "cpu", "--devices", "4", "--global-batch",
                   "8", "--pareto", str(png))
    out = capsys.readouterr().out
    assert code == 0 and "best:" in out and "limited by" in out and png.stat().st_size > 0


@pytest.mark.parametrize("argv, field", [
    (["--model", "test", "--cluster", "nope", "--global-batch", "8"], "unknown cluster preset"),
    (["--model", "nope", "--cluster", "cpu", "--global-batch", "8"], "unknown model"),
    (["--model", "test", "--cluster", "cpu", "--global-batch", "-4"], "global-batch=-4"),
    (["--model", "test", "--cluster", "cpu", "--global-batch", "0"], "global-batch=0"),
    (["--model", "test", "--cluster", "cpu", "--devices", "0", "--global-batch", "8"], "devices=0"),
    (["--model", "test", "--cluster", "cpu", "--devices", "8", "--global-batch", "7"],
     "global-batch=7"),
    (["--model", "tests._planner_factories:broken", "--cluster", "cpu", "--global-batch", "8",
      "--seq", "16"], "failed to build"),
    (["--model", "tests._planner_factories:no_blocks", "--cluster", "cpu", "--global-batch", "8",
      "--seq", "16"], "repeated blocks"),
    (["--model", "no.such.module:f", "--cluster", "cpu", "--global-batch", "8"], "cannot import"),
])
def test_bad_input_names_the_field(argv, field, capsys):
    assert run_cli(*argv) == 2
    assert field in capsys.readouterr().err


def test_malformed_cluster_yaml(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("name: x\ndevices_per_node: [1\n")
    assert run_cli("--model", "test", "--cluster", str(bad), "--global-batch", "8") == 2
    assert "not valid YAML" in capsys.readouterr().err
    bad.write_text("name: x\ndevices_per_node: 8\nmemory_gb: -1\npeak_tflops: {bf16: 1}\n"
                   "intra_node_gbps: 1\ninter_node_gbps: 1\n")
    assert run_cli("--model", "test", "--cluster", str(bad), "--global-batch", "8") == 2
    assert "memory_gb" in capsys.readouterr().err
    bad.write_text("name: x\ndevices_per_node: 8\n")
    assert run_cli("--model", "test", "--cluster", str(bad), "--global-batch", "8") == 2
    assert "missing field" in capsys.readouterr().err


def test_malformed_model_files(tmp_path, capsys):
    bad = tmp_path / "m.yaml"
    bad.write_text("dim: 64\nwidth: 3\n")
    assert run_cli("--model", str(bad), "--cluster", "cpu", "--global-batch", "8") == 2
    assert "width" in capsys.readouterr().err
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10}))
    assert run_cli("--model", str(cfg), "--cluster", "cpu", "--global-batch", "8") == 2
    assert "num_hidden_layers" in capsys.readouterr().err
    cfg.write_text(json.dumps({"hidden_size": -64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "vocab_size": 10}))
    assert run_cli("--model", str(cfg), "--cluster", "cpu", "--global-batch", "8") == 2
    assert "hidden_size=-64" in capsys.readouterr().err


# ------------------------------------------------------------------ calibration fit (pure)
def test_fit_line_recovers_known_overhead_despite_inflated_points():
    from plait.planner.calibrate import fit_line

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
    from plait.planner.calibrate import fit_line

    xs = [1.0, 2.0, 4.0, 8.0]
    fit = fit_line(xs, [0.9, 2.0, 4.1, 7.9])     # slope ~1, intercept slightly below 0
    assert fit.intercept == 0.0 and fit.slope == pytest.approx(1.0, rel=0.05)
    noisy = fit_line(xs, [1.5, 2.0, 4.0, 8.0])
    assert noisy.residual >= 0.0
    with pytest.raises(ValueError, match="distinct x"):
        fit_line([2.0, 2.0], [1.0, 1.1])


# ------------------------------------------------------------------ calibrated terms
def test_collective_time_per_op_factor_and_call_cost():
    from plait.comm.volumes import Traffic
    from plait.planner.cost import collective_time
    from plait.planner.hardware import Cluster

    cl = Cluster(name="t", device="cpu", nodes=1, devices_per_node=2, memory_bytes=1e9,
                 peak_flops={"fp32": 1e9}, intra_bw=1e9, inter_bw=1e9, intra_latency=1e-4,
                 inter_latency=1e-4)
    c = Constants(link_efficiency=1.0, all_gather_factor=2.0, all_gather_call_s=1e-3,
                  broadcast_call_s=-5e-4)
    # 3 calls x (1 ring step x 0.1 ms + 1 ms) + 1 MB x 1/2 (bus factor) / 1 GB/s x 2 = 4.3 ms
    ag = Traffic("dp_shard", "all_gather", 1e6, 3, 2)
    assert collective_time(ag, cl, 1, c) == pytest.approx(3 * 1.1e-3 + 1e-3)
    # a call never costs less than nothing: 0.1 ms - 0.5 ms floors at 0, bytes remain
    bc = Traffic("dp_shard", "broadcast", 1e6, 4, 2)
    assert collective_time(bc, cl, 1, c) == pytest.approx(1e-3)
    # all-reduce: 2 ring steps, factor 1
    ar = Traffic("dp", "all_reduce", 1e6, 1, 2)
    assert collective_time(ar, cl, 1, c) == pytest.approx(2e-4 + 1e-3)


def test_tp_traffic_per_block_and_ends():
    from plait.planner.cost import tp_block_traffic, tp_end_traffic

    act = 2 * 8 * 16 * 4  # b s h fp32
    sp = {(t.op, t.what): (t.payload, t.calls) for t in tp_block_traffic(2, 8, 16, 2, "fp32", True)}
    assert sp[("all_gather", "activations")] == (4 * act, 4)
    assert sp[("reduce_scatter", "activations")] == (4 * act, 4)
    assert sp[("all_reduce", "norm weight grads")] == (2 * 16 * 4, 2)
    full = tp_block_traffic(2, 8, 16, 2, "fp32", False, recomputed=1.0)
    assert sum(t.calls for t in full) == 5 and sum(t.payload for t in full) == 5 * act
    ends = tp_end_traffic(2, 8, 16, 2, "fp32", True, embed=True, head=True)
    calls = {(t.op, t.what): t.calls for t in ends}
    assert calls[("all_gather", "")] == 2 and calls[("reduce_scatter", "")] == 2
    assert calls[("all_reduce", "loss_parallel")] == 3
    assert tp_block_traffic(2, 8, 16, 1, "fp32", True) == []


def test_tensor_counts_match_the_built_model():
    from plait.models.transformer import build

    for name in ("tiny", "gpt2"):
        m = load_model(name)
        model = build(PRESETS[name], device="meta")
        assert m.block_tensors == len(list(model.layers[0].parameters()))
        assert (m.n_layers * m.block_tensors + m.embed_tensors + m.head_tensors
                == len(list(model.parameters())))


def test_runtime_dp_traffic_zero1_broadcasts_zero2_regathers():
    m, c = load_model("tiny"), load_cluster("cpu", devices=2)
    work = Workload(16, 32)
    P = m.num_params
    z1 = evaluate(Plan(dp_shard=2, zero=1), m, c, work)
    bc = [t for t in z1.traffic if t.op == "broadcast"]
    assert len(bc) == 1 and bc[0].calls == 39 and bc[0].payload == 4 * P  # one per tensor
    ar = [t for t in z1.traffic if t.op == "all_reduce"]
    assert ar[0].payload == 4 * P and ar[0].group == 2
    z2 = evaluate(Plan(dp_shard=2, zero=2, grad_accum=4), m, c, work)
    ag = [t for t in z2.traffic if t.op == "all_gather"]
    # FSDP2 reshards after every backward: 5 units (4 blocks + root) gathered in each of 4
    # micro-steps; gradients reduce-scattered once
    assert ag[0].calls == 5 * 4 and ag[0].payload == 4 * 4 * P
    rs = [t for t in z2.traffic if t.op == "reduce_scatter"]
    assert rs[0].calls == 5 and rs[0].payload == 4 * P
    z3 = evaluate(Plan(dp_shard=2, zero=3, grad_accum=2), m, c, work)
    ag = [t for t in z3.traffic if t.op == "all_gather"][0]
    root = m.embed_params + m.head_params
    assert ag.calls == 4 * 2 * 2 + 2  # blocks: forward + backward per micro-step; root: once
    assert ag.payload == 4 * ((P - root) * 4 + root * 2)


def test_blocking_gradient_syncs_chain_through_the_pipeline_stages():
    # pp=2 x dp=2: each stage all-reduces its own gradients inside its last backward. Blocking
    # (overlap off: CPU + gloo), the last microbatch's backward waits for stage 1's sync before
    # stage 0 can run, then stage 0 syncs: both stages' syncs are exposed. With overlap (GPUs)
    # only the last stage to finish is charged, and only what its backward does not hide.
    from plait.comm.volumes import Traffic
    from plait.planner.cost import collective_time

    m = load_model("tiny")
    c = load_cluster("cpu", devices=4).with_memory(1e12)
    work = Workload(16, 128)
    plan = Plan(pp=2, dp_replicate=2, microbatches=2)
    blocking = Constants(overlap=False)
    e = evaluate(plan, m, c, work, blocking)
    assert e.feasible, e.reason
    params = [m.embed_params + 2 * m.block_params, 2 * m.block_params + m.head_params]
    # one bucket per stage (under 25 MiB); dp_replicate's rank stride is tp x dp_shard = 1
    syncs = [collective_time(Traffic("dp_replicate", "all_reduce", 4 * p, 1, 2, "grads"), c, 1,
                             blocking) for p in params]
    assert e.time_breakdown["dp_grad_exposed"] == pytest.approx(sum(syncs), rel=1e-6)
    # the busiest rank (stage 1: the head) is the one charged without the chain
    assert e.time_breakdown["dp_grad_total"] == pytest.approx(syncs[1], rel=1e-6)
    # a single stage has nothing to chain: its one sync, as before
    flat = evaluate(Plan(dp_replicate=4), m, c, work, blocking)
    assert flat.time_breakdown["dp_grad_exposed"] == flat.time_breakdown["dp_grad_total"]
    overlapped = evaluate(plan, m, c, work, Constants(overlap=True))
    assert overlapped.time_breakdown["dp_grad_exposed"] <= max(syncs)


def test_pipeline_clip_norm_all_reduce_is_priced_as_the_ledger_predicts_it():
    # With pp > 1 each stage holds only its gradients, so clipping all-reduces the squared norm
    # (one fp32) over pp every optimizer step (plait.train.clip_grad_norm): blocking, priced
    # once per step, and the same Traffic the comm ledger predicts (plait.comm.predict).
    from plait.comm.predict import predict
    from plait.comm.volumes import Traffic
    from plait.planner.cost import collective_time

    m = load_model("tiny")
    c = load_cluster("cpu", devices=4).with_memory(1e12)
    work, k = Workload(16, 128), Constants(overlap=False)
    plan = Plan(pp=2, dp_replicate=2, microbatches=2)
    e = evaluate(plan, m, c, work, k)
    # pp's rank stride in mesh order (pp, dp_replicate, dp_shard, cp, tp) is 2
    want = collective_time(Traffic("pp", "all_reduce", 4.0, 1, 2), c, 2, k)
    assert want > 0
    assert e.time_breakdown["clip_norm"] == pytest.approx(want)
    off = evaluate(plan.replace(grad_clip=None), m, c, work, k)
    assert off.time_breakdown["clip_norm"] == 0
    assert e.step_time_s - off.step_time_s == pytest.approx(want)
    ours = [t for t in e.traffic if t.what == "clip: squared norm"]
    ledger = [t for t in predict(plan, PRESETS["tiny"].replace(max_seq_len=128), 8, 128)
              if t.what == "clip: squared norm"]
    assert [(t.axis, t.op, t.payload, t.calls, t.group) for t in ours] == \
        [(t.axis, t.op, t.payload, t.calls, t.group) for t in ledger]
    # one stage: nothing to all-reduce across stages
    assert evaluate(Plan(dp_replicate=4), m, c, work, k).time_breakdown["clip_norm"] == 0


def test_per_tensor_and_per_unit_terms():
    m, c = load_model("tiny"), load_cluster("cpu", devices=2)
    work = Workload(16, 32)
    k = Constants(tensor_step_s=1e-3, dtensor_step_s=1e-2, fsdp_unit_s=0.1, overlap=False)
    base = Constants(overlap=False)
    ddp = evaluate(Plan(dp_replicate=2), m, c, work, k)
    assert ddp.time_breakdown["per_tensor"] == pytest.approx(39 * 1e-3)
    z2 = evaluate(Plan(dp_shard=2, zero=2, grad_accum=2), m, c, work, k)
    assert z2.time_breakdown["per_tensor"] == pytest.approx(39 * 1e-2)
    z2_base = evaluate(Plan(dp_shard=2, zero=2, grad_accum=2), m, c, work, base)
    # + 39 DTensors x 10 ms, + 5 FSDP units x 100 ms in each of 2 micro-steps
    assert z2.step_time_s - z2_base.step_time_s == pytest.approx(0.39 + 5 * 0.1 * 2)
    # FSDP2 units cost only where they shard: replicated DP over TP runs through FSDP2 with
    # shard groups of one rank (nothing to gather), and is charged like its twin without them
    c4 = load_cluster("cpu", devices=4)
    units = Constants(overlap=False, fsdp_unit_s=0.1)
    rep_tp = Plan(dp_replicate=2, tp=2)
    assert evaluate(rep_tp, m, c4, work, units).step_time_s == pytest.approx(
        evaluate(rep_tp, m, c4, work, base).step_time_s)
    hsdp = Plan(dp_replicate=2, dp_shard=2, zero=3)
    assert evaluate(hsdp, m, c4, work, units).step_time_s == pytest.approx(
        evaluate(hsdp, m, c4, work, base).step_time_s + 5 * 0.1)
    # FSDP2's post-backward per unit and gradient sync (once per optimizer step without a
    # pipeline: no sync while accumulating), ZeRO-3's backward re-gather per block and
    # micro-step; a pipeline syncs every stage in turn (no overlap) and re-gathers per microbatch
    fk = Constants(overlap=False, fsdp_reduce_s=0.1, fsdp_regather_s=0.01)
    for plan, world, extra in ((Plan(dp_shard=2, zero=2, grad_accum=2), 2, 5 * 0.1),
                               (Plan(dp_shard=2, zero=3, grad_accum=2), 2, 5 * 0.1 + 4 * 2 * 0.01),
                               (Plan(dp_shard=2, zero=1, grad_accum=2), 2, 0.0),
                               (Plan(pp=2, dp_shard=2, zero=3, microbatches=2), 4,
                                2 * 3 * 0.1 + 2 * 2 * 0.01)):
        cw = c if world == 2 else c4
        assert evaluate(plan, m, cw, work, fk).step_time_s == pytest.approx(
            evaluate(plan, m, cw, work, base).step_time_s + extra), plan.describe()
    micro = evaluate(Plan(dp_replicate=2, grad_accum=4), m, c, work,
                     Constants(overlap=False, micro_overhead_s=0.01))
    plain = evaluate(Plan(dp_replicate=2, grad_accum=4), m, c, work, base)
    assert micro.step_time_s - plain.step_time_s == pytest.approx(4 * 0.01)


def test_derive_constants_inverts_the_cost_model():
    """Timings synthesised from known constants come back as those constants."""
    from plait.comm.volumes import bus_factor
    from plait.planner.calibrate import (
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


def test_zero_bubble_split_costs_per_chunk_and_per_backward():
    m = load_model("tiny")
    c = load_cluster("cpu", devices=2).with_memory(1e12)
    c = c.__class__(**{**c.__dict__, "compute_units": None})  # a core each: the closed form
    work = Workload(16, 128)
    plan = Plan(pp=2, pp_schedule="zbv", virtual_stages=2, microbatches=4)
    base = Constants(overlap=False)
    split = Constants(overlap=False, zb_call_s=1e-3, zb_backward_factor=0.5)
    e0, e1 = evaluate(plan, m, c, work, base), evaluate(plan, m, c, work, split)
    # per rank and microbatch: its 2 chunks' calls + half its 2 blocks' backward FLOP time
    rate = c.peak("fp32") * base.compute_efficiency
    fwd_block = m.block_flops_per_token(128) * 4 * 128  # microbatch 4 x seq 128
    extra = 2 * 1e-3 + 2 * 0.5 * 2 * fwd_block / rate
    assert e1.time_breakdown["compute_per_microbatch"] - e0.time_breakdown[
        "compute_per_microbatch"] == pytest.approx(extra, rel=1e-6)
    # other schedules do not split the backward
    f1b = Plan(pp=2, microbatches=4)
    assert evaluate(f1b, m, c, work, split).step_time_s == evaluate(f1b, m, c, work,
                                                                    base).step_time_s


def test_zero_bubble_with_checkpointing_replays_per_parameter_tensor():
    m, c = load_model("tiny"), load_cluster("cpu", devices=2)
    work = Workload(16, 32)
    tokens = 16 * 32
    for schedule, replays in (("zbv", 1 + m.block_tensors), ("interleaved_1f1b", 1)):
        e = evaluate(Plan(pp=2, pp_schedule=schedule, virtual_stages=2, microbatches=2,
                          activation_checkpointing="full"), m, c, work)
        expected = (m.model_flops(tokens, 32, recompute_layers=replays * m.n_layers)
                    / m.model_flops(tokens, 32))
        assert e.tflops_per_device_hw / e.tflops_per_device == pytest.approx(expected)


def test_group_calibration_runs_on_real_processes():
    """The group micro-benchmarks behind ``plait plan --calibrate`` on 2 real gloo processes
    (one round): every timing is there and positive, and every derived constant the cost model
    reads is a finite number (the zero-bubble split among them)."""
    from plait.planner import CALIBRATED_KEYS
    from plait.planner.calibrate import derive_constants, measure_group, median_of
    from plait.spawn import run_distributed

    raw = median_of(run_distributed(measure_group, 2, 1, timeout=240))
    assert all(v > 0 for k, v in raw.items() if k != "world")
    assert {"zb_full@1", "zb_split@2", "probe_tp@2", "fsdp_nosync", "fsdp_sync",
            "fsdp_zero3"} <= set(raw)
    got = derive_constants(raw, alpha=2e-4, bw=1e9, rate=5e10)
    for key, kind in CALIBRATED_KEYS:
        if kind is float and key not in ("block_overhead_s", "link_efficiency"):
            assert key in got and math.isfinite(got[key]), key
