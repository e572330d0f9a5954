"""The planner under context parallelism (cp): what it prices (the K/V collectives of the kv
heads, each rank's s/cp tokens, activations and model state per rank), where it searches
(every layout ``Plan.validate`` accepts with cp) and what ``plait plan`` says when cp wins.

Figures are Llama-3-8B's (32 blocks, hidden 4096, 8 kv heads of 128 of 32 query heads) on
H100 nodes of 8 x 80 GB; the traffic is checked against the closed form of
docs/context_parallel.md, which the comm ledger measures exactly (tests/test_comm_ledger.py,
tests/test_traffic_own_models.py)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from plait.plan import Plan
from plait.planner import constants_for
from plait.planner.compute import microbatch_times
from plait.planner.cost import Workload, evaluate
from plait.planner.hardware import load_cluster
from plait.planner.model_stats import load_model
from plait.planner.search import search

MiB = 2**20


def _setup(devices: int):
    model, cluster = load_model("llama-8b"), load_cluster("dgx-h100", devices=devices)
    return model, cluster, constants_for(cluster)


def _rows(est) -> dict[tuple[str, str], tuple[float, int]]:
    out: dict[tuple[str, str], tuple[float, int]] = {}
    for t in est.traffic:
        b, c = out.get((t.axis, t.op), (0.0, 0))
        out[(t.axis, t.op)] = (b + t.payload, c + t.calls)
    return out


def test_cp_gathers_the_kv_heads_not_the_query_heads():
    """docs/context_parallel.md's worked example: one 32,768-token sequence, cp=8, bf16: per
    block K and V gathered (64 MiB each: 1 x 32,768 x 8 kv heads x 128 x 2 B, a quarter of
    the hidden size), 64 calls in forward, 4 GiB of payload of which a rank sends 7/8; the
    same again reduce-scattered in backward. Under tp=4 each rank gathers its 2 kv heads."""
    model, cluster, c = _setup(8)
    assert model.kv_dim() == 1024 == model.hidden // 4
    est = evaluate(Plan(cp=8, mixed_precision="bf16"), model, cluster, Workload(1, 32768), c)
    rows = _rows(est)
    for op in ("all_gather", "reduce_scatter"):
        assert rows[("cp", op)] == (64 * 64 * MiB, 64), (op, rows)
    wire = sum(t.wire for t in est.traffic if t.axis == "cp" and t.op == "all_gather")
    assert wire == pytest.approx(3.5 * 2**30)
    # the gradients of the replicated model are all-reduced over the cp group (DDP at dp=1)
    assert rows[("cp", "all_reduce")][0] == pytest.approx(4 * model.num_params, rel=1e-6)
    tp = evaluate(Plan(cp=2, tp=4, mixed_precision="bf16"), model, load_cluster(
        "dgx-h100", devices=8), Workload(1, 32768), c)
    assert _rows(tp)[("cp", "all_gather")] == (64 * 32768 * 2 * 128 * 2, 64)


def test_cp_replays_the_gathers_of_checkpointed_blocks():
    """Full checkpointing gathers K and V again in each replayed forward: 4 calls per block,
    per micro-step (grad_accum=2), the reduce-scatters unchanged."""
    model, cluster, c = _setup(8)
    plan = Plan(cp=4, dp_shard=2, zero=3, activation_checkpointing="full", grad_accum=2,
                mixed_precision="bf16")
    rows = _rows(evaluate(plan, model, cluster, Workload(4, 8192), c))
    per_call = 1 * 8192 * 1024 * 2
    assert rows[("cp", "all_gather")] == (4 * 32 * 2 * per_call, 4 * 32 * 2)
    assert rows[("cp", "reduce_scatter")] == (2 * 32 * 2 * per_call, 2 * 32 * 2)
    # FSDP2 over dp_shard x cp: its gathers and reduce-scatters on the flattened axis
    assert ("dp_shard_cp", "all_gather") in rows and ("dp_shard_cp", "reduce_scatter") in rows


def test_each_rank_computes_its_share_of_every_block():
    """The head-tail split balances causal attention, so each cp rank computes exactly 1/cp
    of a block (its s/cp queries against all s keys, its s/cp tokens' matmuls): the block's
    time beside the K/V collectives halves at cp=2."""
    model, cluster, c = _setup(8)
    for seq in (8192, 131072):
        one = microbatch_times(Plan(mixed_precision="bf16"), model, cluster, 1, seq, c)
        two = microbatch_times(Plan(cp=2, mixed_precision="bf16"), model, cluster, 1, seq, c)
        assert one.cp_comm == 0 < two.cp_comm
        assert two.block - two.cp_comm == pytest.approx(one.block / 2, rel=1e-12)
        assert two.head == pytest.approx(one.head / 2, rel=1e-12)


def test_memory_per_rank_under_cp():
    """Activations of s/cp tokens per rank, plus per kept block the gathered K and V attention
    saves (2 x s x kv x 2 B) and one (s/cp) x s mask; parameters, gradients and AdamW sharded
    as FSDP2 shards them, over dp_shard x cp."""
    model, cluster, c = _setup(8)
    s = 32768
    cp = evaluate(Plan(dp_shard=2, zero=3, cp=4, mixed_precision="bf16"), model, cluster,
                  Workload(2, s), c).memory_breakdown
    flat = evaluate(Plan(dp_shard=8, zero=3, mixed_precision="bf16"), model, cluster,
                    Workload(8, s // 4), c).memory_breakdown
    for key in ("params", "grads", "optimizer"):
        assert cp[key] == pytest.approx(flat[key], rel=1e-12), key
    extra = 32 * 2 * s * 1024 * 2 + (s // 4) * s
    assert cp["activations"] == pytest.approx(flat["activations"] + extra, rel=1e-12)
    assert cp["activations"] < flat["activations"] * 4 / 2  # far below one rank holding s


@pytest.mark.parametrize("plan_text", ["cp=2,zero=1", "cp=2,zero=3"])
def test_zero_shards_the_state_over_the_cp_ranks_as_the_runtime_does(plan_text):
    """ZeRO shards over dp_shard x cp, ZeroRedundancyOptimizer's AdamW state (zero=1) as
    FSDP2's (zero=2/3): at dp_shard=1 the cp ranks alone split it. The planner's optimizer
    bytes per rank are what plait's runtime holds after a step, on real processes (the
    ranks' mean: ZeroRedundancyOptimizer partitions whole tensors)."""
    from plait.spawn import run_distributed
    from tests import _workers_planner as W

    plan = Plan.from_string(plan_text + ",mp=fp32")
    est = evaluate(plan, load_model("tiny"), load_cluster("cpu", devices=2), Workload(2, 128))
    got = run_distributed(W.model_state, 2, plan.to_string(), "tiny", timeout=240)
    mean = sum(r["optimizer"] for r in got) / len(got)
    assert est.memory_breakdown["optimizer"] == pytest.approx(mean, rel=1e-3)


def test_the_search_proposes_cp_for_long_sequences():
    """Llama-3-8B on 8 x 80 GB: at 128k tokens (8 sequences) cp wins, ahead of the best
    layout without it (tp=4, whose per-block collectives move the whole hidden state);
    at 512k tokens on 32 GPUs nothing without cp fits, and the search still finds a layout;
    at 8k tokens it does not propose cp."""
    model, cluster, c = _setup(8)
    long = search(model, cluster, Workload(8, 131072), top=5, constants=c)
    assert long.best is not None and long.best.plan.cp > 1, long.best
    assert long.best_without_cp is not None and long.best_without_cp.plan.cp == 1
    assert long.best.step_time_s < long.best_without_cp.step_time_s
    huge = search(model, load_cluster("dgx-h100", devices=32), Workload(4, 524288), top=1,
                  constants=c)
    assert huge.best is not None and huge.best.plan.cp > 1, huge.rejected
    assert huge.best_without_cp is None and huge.closest_without_cp is not None
    assert "GiB" in huge.closest_without_cp.reason
    short = search(model, cluster, Workload(8, 8192), top=1, constants=c)
    assert short.best is not None and short.best.plan.cp == 1, short.best.plan


def test_the_search_follows_the_plans_rule_for_cp(monkeypatch):
    """What cp composes with is Plan.validate's to say: with every cp refusal lifted the
    search tries cp beside zero=1 and pipelines (nothing is rejected as not composable);
    with cp refused outright it proposes none."""
    model, cluster, c = _setup(8)
    work = Workload(8, 131072)
    as_is = search(model, cluster, work, top=0, constants=c)
    refusals = sum(n for k, n in as_is.rejected.items() if k.startswith("plan does not"))
    monkeypatch.setattr(Plan, "_cp_errors", lambda self: [])
    lifted = search(model, cluster, work, top=0, constants=c)
    assert not any(k.startswith("plan does not compose") for k in lifted.rejected), lifted
    # the layouts the rule refused (cp with pp, with zero=1 ... today) are priced
    assert lifted.evaluated > as_is.evaluated if refusals else lifted.evaluated == as_is.evaluated
    monkeypatch.setattr(Plan, "_cp_errors", lambda self: [f"cp={self.cp} is refused here"])
    refused = search(model, cluster, work, top=0, constants=c)
    assert refused.ranked and all(e.plan.cp == 1 for e in refused.ranked)
    assert refused.rejected.get("plan does not compose: cp is refused here", 0) > 0


def _plan_text(*args: str) -> str:
    from plait.cli import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        main(["plan", "--model", "llama-8b", "--cluster", "dgx-h100", *args])
    return buffer.getvalue()


def test_plait_plan_says_why_cp_wins():
    """The explanation under the table names what cp was chosen over and what its own
    collectives cost; where nothing fits without cp, it says so and why."""
    text = _plan_text("--devices", "8", "--global-batch", "8", "--seq", "131072", "--top", "3")
    assert "why cp=" in text and "faster than the best layout without it" in text, text
    assert "cp's K/V collectives" in text and "all-gathers of 256 MiB" in text, text
    out = json.loads(_plan_text("--devices", "32", "--global-batch", "4", "--seq", "524288",
                                "--top", "1", "--format", "json"))
    why = " ".join(out["explain"])
    assert out["plans"][0]["layout"]["cp"] > 1, out["plans"][0]
    assert "no layout without context parallelism fits" in why and "GiB" in why, why


def test_plan_auto_asks_the_model_before_proposing_cp():
    """The planner prices sizes; whether the model can be told its slice's positions is the
    model's to say (``plait.auto.layout_check``): a forward without ``position_ids`` is
    refused before plan='auto' picks cp for it, naming the fix."""
    import torch.nn as nn

    from plait.auto import layout_check
    from tests import _traffic_models as T

    class NoPositions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, tokens):  # no position_ids
            return tokens

    why = layout_check(NoPositions())(Plan(cp=2))
    assert why is not None and "position_ids" in why and "NoPositions.forward" in why, why
    assert layout_check(NoPositions())(Plan(dp_replicate=2)) is None
    assert layout_check(T.gqa_lm())(Plan(cp=2)) is None


def test_a_sequence_cp_cannot_split_is_refused_naming_the_fix():
    model, cluster, c = _setup(8)
    est = evaluate(Plan(cp=4, dp_replicate=2), model, cluster, Workload(2, 100), c)
    assert not est.feasible
    assert "seq=100" in est.reason and "multiple of 8" in est.reason, est.reason
