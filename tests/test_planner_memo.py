"""The search's shortcuts price exactly what a fresh evaluation prices: one memo shared by
every layout of a search (plait.planner.memo), a layout that does not fit priced for its
memory alone, and a rank's gradient reduction without its parameter gathers."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from plait.comm.predict import dp_traffic
from plait.comm.volumes import by_axis
from plait.plan import Plan, PlanOptions
from plait.planner.cost import Workload, evaluate, rank_traffic
from plait.planner.hardware import load_cluster
from plait.planner.memo import Memo
from plait.planner.model_stats import from_hf_config
from plait.planner.pipeline import chunk_placement
from plait.planner.search import candidate_plans, search
from plait.planner.traffic import rank_shares

# Written for these tests: grouped-query attention (kv heads fewer than some tp), tied
# embeddings, an odd vocabulary and more blocks than any pipeline here has stages.
CONFIG = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
          "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 2,
          "vocab_size": 32003, "tie_word_embeddings": True,
          "max_position_embeddings": 8192}


def _setting(memory_gib: float = 80.0):
    model = from_hf_config(CONFIG, "memo-test")
    cluster = dataclasses.replace(load_cluster("dgx-h100", devices=16),
                                  memory_bytes=memory_gib * 2**30, reserve_bytes=2**30)
    return model, cluster, Workload(8, 4096)


def test_one_memo_prices_every_layout_as_a_fresh_evaluation():
    """Every layout the search tries (pipelines with their schedules, ZeRO stages, HSDP,
    context and sequence parallelism, each checkpointing mode), priced in the search's order
    with one memo, equals its evaluation without one, whole record and all (a layout that
    does not fit: its memory and reason, as the search prices it)."""
    model, cluster, work = _setting(memory_gib=2.5)  # some layouts fit, some do not
    memo = Memo()
    seen = {"fit": 0, "unfit": 0, "pp": set(), "zero": set(), "cp": set()}
    for group in candidate_plans(model, cluster, work, dtype="bf16", plain_tp=True):
        if group is None or isinstance(group, str):
            continue
        for fields in group:
            try:
                plan = Plan(**fields)
            except ValueError:
                break
            kept = evaluate(plan, model, cluster, work, balance=True, memo=memo,
                            time_unfit=False)
            fresh = evaluate(plan, model, cluster, work, balance=True, time_unfit=False)
            assert kept.to_dict() == fresh.to_dict(), plan.to_string()
            seen["fit" if kept.feasible else "unfit"] += 1
            seen["pp"].add((plan.pp, plan.pp_schedule))
            seen["zero"].add((plan.zero, plan.dp_replicate > 1))
            seen["cp"].add(plan.cp)
            if kept.feasible:
                break  # the search's order: checkpointing only where it is needed
    assert seen["fit"] > 50 and seen["unfit"] > 50
    assert {s for p, s in seen["pp"] if p > 1} >= {"1f1b", "interleaved_1f1b", "zbv"}
    assert {z for z, _ in seen["zero"]} == {0, 1, 2, 3} and (3, True) in seen["zero"]
    assert max(seen["cp"]) > 1


def test_a_layout_that_does_not_fit_is_priced_for_its_memory_alone():
    """``time_unfit=False``: the memory, its breakdown and the reason are the full
    evaluation's; the step time is left unpriced."""
    model, cluster, work = _setting(memory_gib=2.0)
    plan = Plan(dp_replicate=8, tp=2, mixed_precision="bf16")
    full = evaluate(plan, model, cluster, work)
    short = evaluate(plan, model, cluster, work, time_unfit=False)
    assert not full.feasible and "GiB" in full.reason and full.step_time_s < float("inf")
    assert (short.feasible, short.reason, short.memory_bytes_per_device,
            short.memory_breakdown) == (False, full.reason, full.memory_bytes_per_device,
                                        full.memory_breakdown)
    assert short.step_time_s == float("inf") and not short.traffic


def test_the_nearest_misses_come_back_priced_in_full():
    """A search where nothing fits names the layout that came nearest, with its time, as
    evaluating that plan alone prices it."""
    model, cluster, work = _setting(memory_gib=1.2)
    result = search(model, cluster, work, top=0)
    assert not result.ranked and result.closest is not None
    for near in (result.closest, result.closest_without_cp):
        assert near is not None and near.step_time_s < float("inf")
        alone = evaluate(near.plan, model, cluster, work, balance=True)
        assert near.to_dict() == alone.to_dict()


def test_traffic_priced_where_first_read_is_the_eager_traffic():
    """Each result's traffic (its collectives, their bytes per axis), priced where first read,
    after the whole search (later layouts priced with the same memo, the plan given its stage
    split), equals the busiest rank's traffic built afresh (:func:`rank_traffic`, no memo, no
    laziness) and the whole record equals evaluating its plan alone; for every layout that
    fits and the nearest misses. A pickled estimate takes its traffic with it."""
    model = from_hf_config(CONFIG, "memo-test")
    cluster = dataclasses.replace(load_cluster("dgx-h100", devices=8), memory_bytes=2.5 * 2**30,
                                  reserve_bytes=2**30)
    work = Workload(8, 4096)
    result = search(model, cluster, work, top=0)
    shown = [*result.ranked, result.closest, result.closest_without_cp]
    copied = pickle.loads(pickle.dumps(shown[0]))  # before its traffic is read
    seen = set()
    for est in shown:
        assert est is not None
        plan = est.plan
        if plan.pp > 1 and plan.options.pp_stage_layers is None:  # a miss: the split priced
            plan = plan.with_options(PlanOptions(pp_stage_layers=est.stage_layers))
        eager = rank_traffic(plan, model, work.global_batch, work.seq)
        assert eager is not None
        assert est.traffic == eager[est.busiest_rank], plan.to_string()
        assert est.comm_bytes_per_step == by_axis(eager[est.busiest_rank]), plan.to_string()
        alone = evaluate(est.plan, model, cluster, work, balance=True)
        assert est.to_dict() == alone.to_dict(), plan.to_string()
        seen.add((est.feasible, plan.pp_schedule if plan.pp > 1 else "", plan.cp > 1,
                  plan.activation_checkpointing))
    assert copied == shown[0] and copied.traffic == shown[0].traffic
    assert {s for _, s, _, _ in seen} >= {"", "1f1b", "interleaved_1f1b", "zbv"}
    assert {(f, cp) for f, _, cp, _ in seen} >= {(True, True), (True, False), (False, False)}
    assert {ac for _, _, _, ac in seen} == {"none", "selective", "full"}


@pytest.mark.parametrize("layout", ["dp_shard=4,zero=3,pp=4,microbatches=8",
                                    "dp_replicate=2,dp_shard=2,zero=2,pp=2,microbatches=4,"
                                    "pp_schedule=zbv,virtual_stages=2",
                                    "dp_shard=2,zero=3,cp=2,tp=4",
                                    "dp_shard=16,zero=1", "dp_replicate=4,tp=4"])
def test_gradient_reduction_alone_is_the_full_traffic_without_its_gathers(layout):
    """``gathers=False`` leaves out FSDP2's parameter all-gathers and nothing else."""
    model, _, _ = _setting()
    plan = Plan.from_string(layout + ",mixed_precision=bf16")
    chunks = plan.pp * plan.virtual_stages
    sizes = [model.n_layers // chunks] * chunks
    for share in rank_shares(plan, model, sizes, chunk_placement(plan, chunks)):
        full = dp_traffic(plan, share)
        alone = dp_traffic(plan, share, gathers=False)
        assert alone == [t for t in full if not (t.op == "all_gather" and t.what == "params")]
        assert any(t.what == "grads" for t in alone)
