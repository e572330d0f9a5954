"""What ``plait plan`` says about its pick: the reasons must be true of the two estimates they
compare, and the advice for a cluster too small must grow it the way real clusters grow."""

import pytest

from plait.plan import Plan
from plait.planner.cli import _diff, explain_nothing_fits, explain_winner
from plait.planner.cost import Workload, evaluate
from plait.planner.hardware import load_cluster
from plait.planner.model_stats import load_model
from plait.planner.search import search


def _pair(first: Plan, second: Plan, devices: int = 16):
    m, c = load_model("llama-8b"), load_cluster("dgx-h100", devices=devices)
    work = Workload(64, 4096)
    return [evaluate(p, m, c, work) for p in (first, second)], c


def test_no_tensor_parallel_claim_when_both_send_the_same_tp_bytes():
    base = dict(tp=8, sp=True, mixed_precision="bf16", activation_checkpointing="full")
    (a, b), _ = _pair(Plan(dp_shard=2, zero=3, **base), Plan(dp_shard=2, zero=2, **base))
    assert a.comm_bytes_per_step["tp"] == b.comm_bytes_per_step["tp"]
    assert "tensor-parallel" not in _diff(a, b) and "tensor-parallel" not in _diff(b, a)


def test_less_tp_traffic_claimed_only_with_figures_when_it_is_less():
    base = dict(mixed_precision="bf16", activation_checkpointing="full", grad_accum=2)
    (a, b), _ = _pair(Plan(dp_shard=8, tp=2, sp=True, zero=3, **base),
                      Plan(dp_shard=2, tp=8, sp=True, zero=3, **base))
    assert a.comm_bytes_per_step["tp"] < b.comm_bytes_per_step["tp"]
    text = _diff(a, b)
    assert "less tensor-parallel traffic" in text and "GB per rank" in text
    assert "less tensor-parallel traffic" not in _diff(b, a)  # the winner sending more


def test_every_claim_in_a_search_holds_for_the_pair_it_names():
    m, c = load_model("llama-8b"), load_cluster("dgx-h100", devices=32)
    ranked = search(m, c, Workload(128, 4096), top=40).ranked
    for other in ranked[1:]:
        text = _diff(ranked[0], other)
        if "less tensor-parallel traffic" in text:
            assert ranked[0].comm_bytes_per_step.get("tp", 0) < other.comm_bytes_per_step["tp"]
        if "bubble" in text:
            assert ranked[0].bubble_fraction < other.bubble_fraction


def test_tp_limit_states_the_collectives_and_their_size():
    (a, _), c = _pair(Plan(dp_shard=2, tp=8, sp=True, zero=3, mixed_precision="bf16",
                           activation_checkpointing="full"), Plan(dp_replicate=16))
    text = "\n".join(explain_winner([a], c))
    assert "all-gathers of" in text and "reduce-scatters of" in text and "MiB" in text
    assert "% of the step" in text
    (d, _), c = _pair(Plan(dp_replicate=2, tp=8, mixed_precision="bf16",
                           activation_checkpointing="full"), Plan(dp_replicate=16))
    assert "all-reduces of" in "\n".join(explain_winner([d], c))
    assert "tensor-parallel" not in "\n".join(explain_winner(
        [_pair(Plan(dp_shard=16, zero=3, mixed_precision="bf16",
                    activation_checkpointing="full"), Plan(dp_replicate=16))[0][0]], c))


def test_zero3_says_it_assumes_overlap():
    (z3, z2), _ = _pair(Plan(dp_shard=16, zero=3, mixed_precision="bf16"),
                        Plan(dp_shard=16, zero=2, mixed_precision="bf16"))
    assert any("overlap" in n for n in z3.notes)
    assert not any("overlap" in n for n in z2.notes)
    assert "overlap" in " ".join(z3.to_dict()["notes"])


def test_part_of_a_node_grows_in_whole_nodes():
    one = load_cluster("dgx-h100", devices=1)
    assert (one.nodes, one.devices_per_node) == (1, 1)
    assert (one.with_world(4).nodes, one.with_world(4).devices_per_node) == (1, 4)
    grown = one.with_world(16)
    assert (grown.nodes, grown.devices_per_node, grown.full_node) == (2, 8, None)
    with pytest.raises(ValueError, match="multiple of 8"):
        one.with_world(12)


def test_nothing_fits_on_one_gpu_names_the_smallest_cluster():
    """A 70B model on one H100: 16 GPUs (two nodes of 8) hold it, not N nodes of one GPU."""
    m, c = load_model("llama-70b"), load_cluster("dgx-h100", devices=1)
    work = Workload(16, 4096)
    result = search(m, c, work, top=1)
    assert result.best is None
    text = explain_nothing_fits(result, m, c, work)
    assert "smallest cluster that fits (x2 steps): 16 devices" in text
    assert "nothing fits" not in text


def test_no_layout_to_spread_over_the_devices_says_how_many_a_layout_takes():
    """A small batch on the 64-device cpu preset: no layout exists (dp divides the batch 2, pp
    at most 2 stages with 2 sequences, tp at most 8 heads, and a sequence of 10 tokens is too
    short for the search to split over cp), which no memory changes. Said as such, with the
    device count that plans (was: 'no layout fits ... reduce the sequence length, or use
    devices with more memory')."""
    m, c = load_model("test"), load_cluster("cpu")
    work = Workload(2, 10)
    result = search(m, c, work, dtype="fp32", top=1)
    assert result.best is None and result.evaluated == 0
    text = explain_nothing_fits(result, m, c, work, "fp32")
    assert "no layout of test spreads over 64 x cpu" in text, text
    assert "at most 16 devices take part. Plan for --devices 16" in text, text  # 2 x tp 8
    assert "at least 1,024 tokens" in text, text
    assert "memory" not in text and "bf16" not in text, text
    assert search(m, load_cluster("cpu", devices=16), work, dtype="fp32", top=1).best is not None


def test_blocks_without_attention_take_tensor_parallelism():
    """An MLP stack has no heads to divide: tp=2 is priced (the model itself, asked by plait
    plan, refuses what its layers cannot take); was 'tp=2 does not divide attention heads=1'
    for a layout plait check passes."""
    mlp = load_model("tests._planner_factories:mlp_stack")
    assert not mlp.attention and mlp.tp_refuses(2) == ""
    est = evaluate(Plan(tp=2), mlp, load_cluster("cpu", devices=2), Workload(8, 16))
    assert est.feasible, est.reason
    assert load_model("test").tp_refuses(3) == "tp=3 does not divide attention heads=8"
