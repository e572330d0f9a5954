"""The ledger measures exactly the closed-form bytes (ratio 1.000 per axis and op).

Each plan trains the reference "test" model through plait's own runtime (``plait comm``'s
worker: ``plait.init(plan, ledger=True)``, ``run.parallelize``, ``run.step`` on the bundled
corpus, gradient clipping on) for WARMUP steps outside the ledger and STEPS inside it, on gloo
CPU ranks; the prediction is ``plait.comm.predict`` (volumes.py composed with what each rank
holds), computed by the runtime itself in ``run.summary()``.
"""

from __future__ import annotations

import pytest
import torch

from plait._torch_compat import dispatch_has_kernel
from plait.comm.cli import comm_worker
from plait.comm.ledger import Ledger, axis_names_by_ranks
from plait.comm.predict import by_axis_op, predict
from plait.comm.report import CommReport, normalise_expected
from plait.models.transformer import preset
from plait.plan import Plan
from plait.spawn import run_distributed
from tests import _workers_comm as W

CFG = preset(W.MODEL)


def _measure(plan_text: str) -> dict:
    plan = Plan.from_string(plan_text)
    return run_distributed(comm_worker, plan.world_size, plan_text, W.MODEL, W.STEPS, W.WARMUP,
                           W.BATCH, W.SEQ, timeout=300 if plan.world_size <= 4 else 600)[0]


def _check(result: dict, want: set[tuple[str, str]]) -> dict[tuple[str, str], dict]:
    """Every measured row has a prediction and ratio 1.000; the rows are exactly ``want``."""
    rows = {(r["axis"], r["op"]): r for r in result["rows"]}
    assert result["steps"] == W.STEPS
    assert set(rows) == want, sorted(rows)
    for key, r in rows.items():
        assert r["ranks"] == result["world_size"], (key, r)  # measured on every rank
        assert r["expected_bytes"], (key, r)
        assert r["time_s"] > 0, (key, r)  # every (group, op)'s first calls are timed
        assert r["ratio"] == pytest.approx(1.0, abs=1e-9), (key, r["payload_bytes"],
                                                              r["expected_bytes"])
        # and as many calls as predicted (one per DDP bucket, FSDP2 unit, TP collective...)
        assert r["expected_calls"] is not None, (key, r)
        assert r["count"] == r["expected_calls"], (key, r["count"], r["expected_calls"])
        assert r["calls_ratio"] == 1.0, (key, r)
    return rows


# (plan, the (axis, op) rows it must produce). Gradient clipping is on (Plan's default), so
# every layout with DTensor parameters all-reduces per-tensor norms, pipelines a squared norm.
CASES = [
    ("dp_replicate=2", {("dp_replicate", "all_reduce")}),
    ("dp_shard=2,zero=1", {("dp_shard", "all_reduce"), ("dp_shard", "broadcast")}),
    ("dp_shard=2,zero=2", {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"),
                           ("dp_shard", "all_reduce")}),
    ("dp_shard=2,zero=3", {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"),
                           ("dp_shard", "all_reduce")}),
    ("tp=2", {("tp", "all_reduce")}),
    ("tp=2,sp=1", {("tp", "all_gather"), ("tp", "reduce_scatter"), ("tp", "all_reduce")}),
    # a zero-bubble schedule's data ranks average after the schedule: one all-reduce of the
    # used flags, then the gradients in one bucket
    ("pp=2,dp_replicate=2,microbatches=2,pp_schedule=zbv,virtual_stages=2",
     {("dp_replicate", "all_reduce"), ("pp", "send_recv"), ("pp", "all_reduce")}),
    ("pp=2,microbatches=2", {("pp", "send_recv"), ("pp", "all_reduce")}),
    # the clip norms partial over dp_shard and tp: one all-reduce over the flattened view
    ("dp_shard=2,zero=3,tp=2", {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"),
                                ("dp_shard_tp", "all_reduce"), ("tp", "all_reduce")}),
    # K/V all-gathers and their gradients' reduce-scatters on cp; DDP over dp x cp, which at
    # dp=1 is the cp group
    ("cp=2", {("cp", "all_gather"), ("cp", "reduce_scatter"), ("cp", "all_reduce")}),
]
SLOW_CASES = [
    ("dp_replicate=2,grad_accum=2", {("dp_replicate", "all_reduce")}),
    ("dp_shard=2,zero=2,grad_accum=2", {("dp_shard", "all_gather"),
                                        ("dp_shard", "reduce_scatter"),
                                        ("dp_shard", "all_reduce")}),
    ("dp_shard=2,zero=3,mixed_precision=bf16", {("dp_shard", "all_gather"),
                                                ("dp_shard", "reduce_scatter"),
                                                ("dp_shard", "all_reduce")}),
    # fp16 casts the gathered parameters as bf16 does (FSDP2's param_dtype): 2 bytes each
    ("dp_shard=2,zero=3,mixed_precision=fp16", {("dp_shard", "all_gather"),
                                                ("dp_shard", "reduce_scatter"),
                                                ("dp_shard", "all_reduce")}),
    ("dp_replicate=2,dp_shard=2,zero=3", {("dp_replicate", "all_reduce"),
                                          ("dp_shard", "all_gather"),
                                          ("dp_shard", "reduce_scatter"),
                                          ("dp_shard", "all_reduce")}),
    ("dp_replicate=2,dp_shard=2,zero=1", {("dp", "all_reduce"), ("dp_shard", "broadcast")}),
    ("dp_replicate=2,tp=2", {("dp_replicate", "all_reduce"), ("tp", "all_reduce")}),
    ("tp=2,sp=1,grad_accum=2", {("tp", "all_gather"), ("tp", "reduce_scatter"),
                                ("tp", "all_reduce")}),
    ("tp=2,activation_checkpointing=full", {("tp", "all_reduce")}),
    ("tp=2,sp=1,activation_checkpointing=selective", {("tp", "all_gather"),
                                                      ("tp", "reduce_scatter"),
                                                      ("tp", "all_reduce")}),
    ("pp=2,microbatches=2,pp_schedule=gpipe,grad_accum=2", {("pp", "send_recv"),
                                                            ("pp", "all_reduce")}),
    ("pp=2,microbatches=4,pp_schedule=interleaved_1f1b,virtual_stages=2",
     {("pp", "send_recv"), ("pp", "all_reduce")}),
    ("pp=2,microbatches=2,pp_schedule=zbv,virtual_stages=2", {("pp", "send_recv"),
                                                              ("pp", "all_reduce")}),
    ("pp=2,dp_replicate=2,microbatches=2", {("dp_replicate", "all_reduce"), ("pp", "send_recv"),
                                            ("pp", "all_reduce")}),
    # zero-bubble with cp ranks, and with ZeRO-1 and accumulation: averaged once a step, after
    # the schedule, then ZeroRedundancyOptimizer's broadcasts
    ("cp=2,pp=2,microbatches=2,pp_schedule=zbv,virtual_stages=2",
     {("cp", "all_gather"), ("cp", "reduce_scatter"), ("cp", "all_reduce"), ("pp", "send_recv"),
      ("pp", "all_reduce")}),
    ("dp_shard=2,zero=1,pp=2,microbatches=2,grad_accum=2,pp_schedule=interleaved_zb,"
     "virtual_stages=2", {("dp_shard", "all_reduce"), ("dp_shard", "broadcast"),
                          ("pp", "send_recv"), ("pp", "all_reduce")}),
    # ZeRO-2 under zero-bubble: FSDP2 gathers each unit once per schedule and reduce-scatters
    # once, at torch's REDUCE_GRAD step after the stage's last weight step
    ("dp_shard=2,zero=2,pp=2,microbatches=2,pp_schedule=zbv,virtual_stages=2",
     {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"), ("dp_shard", "all_reduce"),
      ("pp", "send_recv"), ("pp", "all_reduce")}),
    # ZeRO-3: a block gathered again by each step of its stage after one of its forwards,
    # counted from the runtime's order
    ("dp_shard=2,zero=3,pp=2,microbatches=4,pp_schedule=zbv,virtual_stages=2",
     {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"), ("dp_shard", "all_reduce"),
      ("pp", "send_recv"), ("pp", "all_reduce")}),
    ("dp_shard=2,zero=3,pp=2,microbatches=2,grad_accum=2,pp_schedule=interleaved_zb,"
     "virtual_stages=2", {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"),
                          ("dp_shard", "all_reduce"), ("pp", "send_recv"),
                          ("pp", "all_reduce")}),
    ("dp_replicate=2,tp=2,pp=2,microbatches=2,pp_schedule=zbv,virtual_stages=2",
     {("dp_replicate", "all_reduce"), ("tp", "all_reduce"), ("pp", "send_recv"),
      ("pp", "all_reduce")}),
    # FSDP2 over dp_shard x cp: its gathers, reduce-scatters and clip norms on dp_shard_cp
    ("dp_shard=2,zero=3,cp=2", {("dp_shard_cp", "all_gather"),
                                ("dp_shard_cp", "reduce_scatter"),
                                ("dp_shard_cp", "all_reduce"), ("cp", "all_gather"),
                                ("cp", "reduce_scatter")}),
    ("dp=2,cp=2", {("dp_cp", "all_reduce"), ("cp", "all_gather"), ("cp", "reduce_scatter")}),
    # HSDP with cp: the dp_shard_cp shard of the gradients all-reduced over dp_replicate
    ("dp_replicate=2,dp_shard=2,zero=3,cp=2", {("dp_replicate", "all_reduce"),
                                               ("dp_shard_cp", "all_gather"),
                                               ("dp_shard_cp", "reduce_scatter"),
                                               ("dp_shard_cp", "all_reduce"),
                                               ("cp", "all_gather"), ("cp", "reduce_scatter")}),
    # tp shards the heads: cp gathers the local heads' K/V; tp's collectives move the cp slice;
    # the TP shards' gradients all-reduced over dp x cp once per unit (FSDP2's replicate)
    ("cp=2,tp=2", {("cp", "all_gather"), ("cp", "reduce_scatter"), ("cp", "all_reduce"),
                   ("tp", "all_reduce")}),
    ("cp=2,tp=2,sp=1", {("cp", "all_gather"), ("cp", "reduce_scatter"), ("cp", "all_reduce"),
                        ("tp", "all_gather"), ("tp", "reduce_scatter"), ("tp", "all_reduce")}),
    # FSDP2 over dp_shard x cp beside tp: the clip norms, partial over dp_shard_cp and tp, in
    # one all-reduce over the flattened view; at dp_shard=1 FSDP2's collectives run on cp
    ("cp=2,tp=2,zero=3", {("cp", "all_gather"), ("cp", "reduce_scatter"), ("tp", "all_reduce"),
                          ("dp_shard_cp_tp", "all_reduce")}),
    ("dp_shard=2,cp=2,tp=2,zero=3", {("dp_shard_cp", "all_gather"),
                                     ("dp_shard_cp", "reduce_scatter"), ("cp", "all_gather"),
                                     ("cp", "reduce_scatter"), ("tp", "all_reduce"),
                                     ("dp_shard_cp_tp", "all_reduce")}),
    # ZeRO-1: DDP over dp x cp, ZeroRedundancyOptimizer's broadcasts over dp_shard x cp
    ("cp=2,zero=1", {("cp", "all_gather"), ("cp", "reduce_scatter"), ("cp", "all_reduce"),
                     ("cp", "broadcast")}),
    ("dp_shard=2,cp=2,zero=1", {("dp_shard_cp", "all_reduce"), ("dp_shard_cp", "broadcast"),
                                ("cp", "all_gather"), ("cp", "reduce_scatter")}),
    ("dp_replicate=2,cp=2,zero=1", {("dp_cp", "all_reduce"), ("cp", "broadcast"),
                                    ("cp", "all_gather"), ("cp", "reduce_scatter")}),
    # cp inside each pipeline stage: K/V of the stage's blocks per microbatch, the stages
    # send the slice of each sequence; gradients over dp x cp as without pp
    ("cp=2,pp=2,microbatches=2", {("cp", "all_gather"), ("cp", "reduce_scatter"),
                                  ("cp", "all_reduce"), ("pp", "send_recv"),
                                  ("pp", "all_reduce")}),
    ("cp=2,pp=2,microbatches=2,grad_accum=2", {("cp", "all_gather"), ("cp", "reduce_scatter"),
                                               ("cp", "all_reduce"), ("pp", "send_recv"),
                                               ("pp", "all_reduce")}),
    ("dp_shard=2,cp=2,pp=2,zero=3,microbatches=2", {("dp_shard_cp", "all_gather"),
                                                    ("dp_shard_cp", "reduce_scatter"),
                                                    ("dp_shard_cp", "all_reduce"),
                                                    ("cp", "all_gather"),
                                                    ("cp", "reduce_scatter"),
                                                    ("pp", "send_recv"), ("pp", "all_reduce")}),
    # recomputed attention gathers K and V again; two micro-steps gather and scatter twice
    ("cp=2,activation_checkpointing=full,grad_accum=2",
     {("cp", "all_gather"), ("cp", "reduce_scatter"), ("cp", "all_reduce")}),
    ("pp=2,dp_shard=2,zero=3,microbatches=2", {("dp_shard", "all_gather"),
                                               ("dp_shard", "reduce_scatter"),
                                               ("dp_shard", "all_reduce"), ("pp", "send_recv"),
                                               ("pp", "all_reduce")}),
]


L = CFG.n_layers
# Calls per step, not only bytes: Megatron's 4 all-reduces per block + embedding + head,
# 3 for loss_parallel, 1 clip norm; SP's gathers/scatters and norm-gradient reduces.
COUNTS = {
    "tp=2": {("tp", "all_reduce"): 4 * L + 2 + 3 + 1},
    "tp=2,sp=1": {("tp", "all_gather"): 4 * L + 2, ("tp", "reduce_scatter"): 4 * L + 2,
                  ("tp", "all_reduce"): (2 * L + 1) + 3 + 1},
    "dp_shard=2,zero=3": {("dp_shard", "all_gather"): 2 * L + 1,  # root gathered once
                          ("dp_shard", "reduce_scatter"): L + 1},
    # K and V per layer; DDP's gradients in one bucket
    "cp=2": {("cp", "all_gather"): 2 * L, ("cp", "reduce_scatter"): 2 * L,
             ("cp", "all_reduce"): 1},
    "dp_shard=2,zero=3,cp=2": {("dp_shard_cp", "all_gather"): 2 * L + 1,
                               ("dp_shard_cp", "reduce_scatter"): L + 1,
                               ("dp_shard_cp", "all_reduce"): 1,
                               ("cp", "all_gather"): 2 * L, ("cp", "reduce_scatter"): 2 * L},
    "dp_shard=2,cp=2,tp=2,zero=3": {("dp_shard_cp", "all_gather"): 2 * L + 1,
                                    ("dp_shard_cp", "reduce_scatter"): L + 1,
                                    ("dp_shard_cp_tp", "all_reduce"): 1,
                                    ("cp", "all_gather"): 2 * L, ("cp", "reduce_scatter"): 2 * L},
    # each stage's 2 blocks x K, V x 2 microbatches (x 2 accumulation steps); DDP once per
    # schedule
    "pp=2,dp_replicate=2,microbatches=2,pp_schedule=zbv,virtual_stages=2": {
        ("dp_replicate", "all_reduce"): 2},
    "dp_shard=2,zero=1,pp=2,microbatches=2,grad_accum=2,pp_schedule=interleaved_zb,"
    "virtual_stages=2": {("dp_shard", "all_reduce"): 2},
    "cp=2,pp=2,microbatches=2": {("cp", "all_gather"): L // 2 * 2 * 2,
                                 ("pp", "send_recv"): 2},
    "cp=2,pp=2,microbatches=2,grad_accum=2": {("cp", "all_gather"): L // 2 * 2 * 2 * 2,
                                              ("cp", "all_reduce"): 2},
    "cp=2,activation_checkpointing=full,grad_accum=2": {("cp", "all_gather"): 2 * 2 * 2 * L,
                                                        ("cp", "reduce_scatter"): 2 * 2 * L},
}


@pytest.mark.parametrize("plan,rows", CASES + [pytest.param(p, r, marks=pytest.mark.slow)
                                               for p, r in SLOW_CASES],
                         ids=[p for p, _ in CASES + SLOW_CASES])
def test_runtime_bytes_match_closed_form(plan, rows):
    res = _measure(plan)
    measured = _check(res, rows)
    for key, calls in COUNTS.get(plan, {}).items():
        assert measured[key]["count"] == calls, (key, measured[key]["count"], calls)
    p = Plan.from_string(plan)
    for key, r in measured.items():
        if key[0] == "cp" and p.zero >= 2 and p.dp_shard == 1:
            continue  # FSDP2's (all-to-alls) and the K/V's collectives share the cp row
        # On gloo, FSDP2's reduce-scatter/all-gather run as all-to-alls (gloo_collectives) and
        # are recorded as the logical op; TP's (DTensor) keep gloo's own.
        fsdp = key[0] in ("dp_shard", "dp_shard_cp") and key[1] in ("all_gather",
                                                                    "reduce_scatter")
        assert r["via"] == ("all_to_all" if fsdp else ""), (key, r["via"])
    if plan.startswith("pp=2,microbatches=2") and "grad_accum" not in plan:
        # Each stage sends its own share (stage 0 activations, stage 1 gradients), and
        # receives what the other sent; the per-stage closed form matches each rank.
        row = measured[("pp", "send_recv")]
        for stage in range(2):
            exp = by_axis_op(predict(p, CFG, W.BATCH, W.SEQ, stage=stage))
            assert row["per_rank_payload"][stage] == exp[("pp", "send_recv")]
        assert row["recv_bytes"] == row["payload_bytes"]


# ZeRO-2/3 under the multi-stage schedules, (plan, blocks): torch's runtime gathers each stage
# at its UNSHARD step, a ZeRO-3 block again at its stage's next step after each forward; a rank
# holding more than three stages has them evicted (RESHARD) and gathered again mid-schedule,
# roots included; ZB-V's rank 0 holds two roots (the embedding's and the head's)
ZERO_SCHEDULES = [
    ("dp_shard=2,zero=3,pp=2,microbatches=2,pp_schedule=interleaved_1f1b,virtual_stages=2", 4),
    ("dp_shard=2,zero=3,pp=2,microbatches=4,pp_schedule=interleaved_1f1b,virtual_stages=3", 6),
    ("dp_shard=2,zero=3,pp=2,microbatches=4,pp_schedule=interleaved_1f1b,virtual_stages=4", 8),
    ("dp_shard=2,zero=3,pp=2,microbatches=4,pp_schedule=interleaved_zb,virtual_stages=4", 8),
    ("dp_shard=2,zero=2,pp=2,microbatches=4,pp_schedule=interleaved_zb,virtual_stages=4", 8),
    ("dp_shard=2,zero=3,pp=2,microbatches=4,pp_schedule=looped_bfs,virtual_stages=4", 8),
    ("dp_shard=2,zero=3,pp=2,microbatches=4,pp_schedule=zbv,virtual_stages=2", 4),
]


@pytest.mark.slow
@pytest.mark.parametrize("plan_text,layers", ZERO_SCHEDULES, ids=[p for p, _ in ZERO_SCHEDULES])
def test_fsdp_gathers_under_every_schedule_are_predicted(plan_text, layers):
    """FSDP2's all-gathers and reduce-scatters measured on every rank: each pipeline rank's
    bytes are its own prediction, and the ledger's row (the busiest rank's) makes as many calls
    as predicted for that rank."""
    plan = Plan.from_string(plan_text)
    res = run_distributed(comm_worker, plan.world_size, plan_text, W.MODEL, W.STEPS, W.WARMUP,
                          W.BATCH, W.SEQ, True, {"n_layers": layers}, timeout=300)[0]
    rows = _check(res, {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"),
                        ("dp_shard", "all_reduce"), ("pp", "send_recv"), ("pp", "all_reduce")})
    cfg = preset(W.MODEL, n_layers=layers)
    per_stage = [[t for t in predict(plan, cfg, W.BATCH, W.SEQ, stage=r)
                  if t.axis == "dp_shard"] for r in range(plan.pp)]
    for op in ("all_gather", "reduce_scatter"):
        mine = [next(t for t in traffic if t.op == op) for traffic in per_stage]
        row = rows[("dp_shard", op)]
        # ranks (pp, dp_shard) in mesh order: each pp rank's two data ranks alike
        assert row["per_rank_payload"] == [t.payload for t in mine for _ in range(2)], op
        busiest = max(mine, key=lambda t: t.payload)
        assert row["count"] == busiest.calls, (op, row["count"], busiest.calls)


def test_replicated_kv_heads_gradients_are_predicted():
    """One kv head at tp=2: k and v stay whole on every rank and their gradients are
    all-reduced over tp, two calls per block on top of Megatron's four; predicted exactly."""
    res = run_distributed(comm_worker, 2, "tp=2", W.MODEL, W.STEPS, W.WARMUP, W.BATCH, W.SEQ,
                          True, {"n_kv_heads": 1}, timeout=300)[0]
    row = _check(res, {("tp", "all_reduce")})[("tp", "all_reduce")]
    assert row["count"] == 6 * L + 2 + 3 + 1, row["count"]
    cfg = preset(W.MODEL, n_kv_heads=1)
    tp2 = Plan.from_string("tp=2")
    kv = by_axis_op(predict(tp2, cfg, W.BATCH, W.SEQ))[("tp", "all_reduce")]
    plain = by_axis_op(predict(tp2, CFG, W.BATCH, W.SEQ))[("tp", "all_reduce")]
    assert kv - plain == 2 * CFG.dim * CFG.head_dim * L * 4  # fp32 k and v weight gradients


@pytest.mark.parametrize("plan_text", [
    "dp_shard=2,zero=3",
    pytest.param("dp_shard=2,zero=3,tp=2", marks=pytest.mark.slow),
    pytest.param("dp_replicate=2,tp=2", marks=pytest.mark.slow)])
def test_uneven_rows_are_predicted(plan_text):
    """A vocabulary of 257: FSDP2 cuts dim 0 with torch.chunk and pads every shard to the
    first, so at dp_shard=2 the embedding and the output head are gathered and reduce-scattered
    as 258 rows; tensor parallelism cuts them as torch.chunk does too, 129 rows on the first tp
    rank and 128 on the second, and data parallelism reduces each rank's own piece (padded
    to 130 at dp_shard=2). Predicted exactly."""
    plan = Plan.from_string(plan_text)
    res = run_distributed(comm_worker, plan.world_size, plan_text, W.MODEL, W.STEPS, W.WARMUP,
                          W.BATCH, W.SEQ, True, {"vocab_size": 257}, timeout=300)[0]
    rows = {(r["axis"], r["op"]): r for r in res["rows"]}
    _check(res, set(rows))
    assert {("dp_shard", "reduce_scatter"), ("dp_replicate", "all_reduce")} & set(rows)
    if plan_text == "dp_shard=2,zero=3":
        cfg = preset(W.MODEL, vocab_size=257)
        assert not cfg.tie_embeddings
        elements = by_axis_op(predict(plan, cfg, W.BATCH, W.SEQ))
        extra = rows[("dp_shard", "reduce_scatter")]["payload_bytes"] - \
            elements[("dp_shard", "reduce_scatter")]
        assert extra == 2 * cfg.dim * 4  # one fp32 row of the embedding and one of the head


# --------------------------------------------------------------------------- pure pieces
def test_stage_gathers_are_read_off_torchs_lowered_order():
    """torch's runtime gathers a stage at each UNSHARD of its lowered order: once per schedule
    where a rank holds at most three stages (what the shortcut assumes, checked against the
    order itself), more where it holds four and stages are evicted and come back."""
    from types import SimpleNamespace

    from plait.parallel.schedules import local_stages, schedule_class, stage_gathers

    def torchs(schedule: str, pp: int, m: int, v: int) -> dict[int, tuple[int, int]]:
        """Per stage: UNSHARDs in torch's order, and forwards its next action on the stage
        after which is a RESHARD."""
        stages = [SimpleNamespace(group_size=pp, group_rank=0, num_stages=pp * v,
                                  stage_index=s, submod=None, is_first=s == 0,
                                  is_last=s == pp * v - 1, stage_index_to_group_rank=None)
                  for s in local_stages(schedule, pp, v, 0)]
        order = schedule_class(schedule)(stages, m).pipeline_order_with_comms
        unshards, evicted = dict.fromkeys(range(pp * v), 0), dict.fromkeys(range(pp * v), 0)
        for actions in order.values():
            last: dict[int, str] = {}
            for a in actions:
                kind, s = a.computation_type.value, a.stage_index
                unshards[s] += kind == "UNSHARD"
                evicted[s] += kind == "RESHARD" and last.get(s) == "F"
                if kind in ("F", "B", "I", "W", "RESHARD"):
                    last[s] = kind
        return {s: (unshards[s], evicted[s]) for s in unshards}

    # interleaved 1F1B's order is built by plait (the planner prices many), the others by torch
    for args in [("interleaved_1f1b", 2, 4, 3), ("interleaved_zb", 2, 4, 3),
                 ("looped_bfs", 2, 2, 2), ("zbv", 2, 4, 2), ("interleaved_1f1b", 2, 4, 4),
                 ("interleaved_1f1b", 2, 2, 4), ("interleaved_1f1b", 3, 6, 4),
                 ("interleaved_1f1b", 4, 8, 5), ("interleaved_1f1b", 2, 6, 4),
                 ("interleaved_zb", 2, 4, 4), ("looped_bfs", 2, 4, 4)]:
        got = {s: (g.unshards, g.reshard_after_forward) for s, g in stage_gathers(*args).items()}
        assert got == torchs(*args), args
    evicted = stage_gathers("interleaved_1f1b", 2, 4, 4)
    assert max(g.unshards for g in evicted.values()) > 1
    # ZeRO-3: a block once per UNSHARD and after each forward not followed by an eviction
    g = evicted[0]
    assert g.block(4, 3) == g.unshards + 4 - g.reshard_after_forward > 4 + 1
    assert g.block(4, 2) == g.root == g.unshards


def test_every_stage_root_is_gathered_and_reduced():
    """ZB-V's rank 0 holds stage 0 (the embedding) and the last stage (the final norm and
    head): two root units, each gathered once per schedule and reduce-scattered once; interleaved
    1F1B's ZeRO-3 gathers are predicted (m + 1 per block where no stage is evicted)."""
    m, blocks = 4, 2  # two stages of one block each
    zbv = Plan.from_string(f"dp_shard=2,zero=3,pp=2,microbatches={m},pp_schedule=zbv,"
                           "virtual_stages=2")
    rank0 = {t.op: t for t in predict(zbv, CFG, W.BATCH, W.SEQ, stage=0)
             if t.axis == "dp_shard"}
    assert rank0["all_gather"].calls == blocks * (m + 1) + 2
    assert rank0["reduce_scatter"].calls == blocks + 2
    rank1 = {t.op: t for t in predict(zbv, CFG, W.BATCH, W.SEQ, stage=1)
             if t.axis == "dp_shard"}
    assert rank1["all_gather"].calls == blocks * (m + 1)  # the middle stages hold no root
    assert rank1["reduce_scatter"].calls == blocks
    interleaved = Plan.from_string(f"dp_shard=2,zero=3,pp=2,microbatches={m},"
                                   "pp_schedule=interleaved_1f1b,virtual_stages=2")
    gathers = by_axis_op(predict(interleaved, CFG, W.BATCH, W.SEQ, stage=0))
    assert gathers[("dp_shard", "all_gather")] > 0


def test_axis_names_cover_single_flat_and_joined_axes():
    # A fake 2x2x2 world seen from rank 5 = coordinate (1, 0, 1) on (pp, dp_shard, tp).
    class Root:
        mesh = torch.arange(8).reshape(2, 2, 2)
        mesh_dim_names = ("pp", "dp_shard", "tp")
        ndim = 3

        def get_coordinate(self):
            return [1, 0, 1]

    class M:
        root = Root()
        flat: dict = {}

    names = axis_names_by_ranks(M())
    assert names[frozenset({4, 5})] == "tp"
    assert names[frozenset({5, 7})] == "dp_shard"
    assert names[frozenset({1, 5})] == "pp"
    assert names[frozenset({4, 5, 6, 7})] == "dp_shard+tp"
    assert names[frozenset(range(8))] == "pp+dp_shard+tp"


def test_report_table_json_and_expected_shapes(tmp_path):
    entries = [{"axis": "tp", "op": "all_reduce", "group_size": 2, "count": 4,
                "payload_bytes": 4096, "wire_bytes": 4096.0, "time_s": 0.002,
                "recv_count": 0, "recv_bytes": 0}]
    rep = CommReport.from_ranks([entries, entries], steps=2, expected={"tp": {"all_reduce": 2048}},
                                backend="gloo")
    row = rep.row("tp", "all_reduce")
    assert row.payload_bytes == 2048 and row.count == 2 and row.ratio == 1.0
    assert row.busbw_gbps == pytest.approx(2048 / 0.001 / 1e9)
    assert "tp" in rep.table() and "1.000" in rep.table()
    assert '"rows"' in rep.to_json()
    assert normalise_expected({"tp/all_reduce": 1}) == {("tp", "all_reduce"): 1.0}
    with pytest.raises(ValueError, match="expected key"):
        normalise_expected({3: 1})
    png = rep.plot(str(tmp_path / "comm.png"))
    if png is not None:
        assert (tmp_path / "comm.png").stat().st_size > 0


def test_a_ledger_under_plan_auto_is_told_to_run_the_chosen_plan_with_the_ledger():
    """The fix is the user's own script under the chosen plan: `plait comm` measures the
    reference model only, not theirs."""
    import plait

    with pytest.raises(ValueError, match=r"not plan='auto'; run the script with the plan auto "
                                         r"chose \(it prints it: --plan P\) and ledger=True$"):
        plait.init("auto", ledger=True, seed=0)


def test_ledger_off_installs_nothing_and_records_nothing():
    def hooked() -> bool:
        return dispatch_has_kernel("c10d::allreduce_", "BackendSelect")
    ledger = Ledger()
    assert not hooked()
    with ledger:
        assert ledger.active and hooked()
        torch.ones(3) + 1  # no collective
    assert not ledger.active and not hooked()
    assert ledger.local_entries() == []
    with pytest.raises(RuntimeError, match="already active"):
        with ledger:
            ledger.__enter__()
    assert not hooked()


def test_collectives_outside_the_block_are_not_counted():
    res = run_distributed(W.outside_block, 2, timeout=120)
    assert res[0] == [{"axis": "world", "op": "all_reduce", "group_size": 2, "count": 1,
                       "payload_bytes": 16, "wire_bytes": 16.0, "recv_count": 0,
                       "recv_bytes": 0}]


def test_futureless_ops_are_timed_to_their_wait():
    # gloo's send/recv and reduce-scatter Works have no completion future. Timed at issue only,
    # a 16 MiB transfer looked free; timed to the wait it costs what a stopwatch around the
    # same call sees. The ledger's interval is the raw one (issue to wait); timed at issue it
    # would be about 1% of it. The bound is a fifth, not the whole: on a loaded machine one
    # preemption inside a stopwatch'd call inflates the raw sum of four calls several-fold.
    # 64 MiB outlasts 1 KiB by orders of magnitude, and outlasts a preemption of the small
    # calls on a machine loaded five-fold (16 MiB did not: 0.09 s against 0.12 s).
    small, big = 1 << 10, 64 << 20
    res = run_distributed(W.futureless_times, 2, [small, big], 4, timeout=180)
    for r in res:
        for op in ("send_recv", "reduce_scatter"):
            lo, hi = r[small][op], r[big][op]
            assert lo["time_s"] > 0 and hi["time_s"] > lo["time_s"], (op, lo, hi)
            assert hi["time_s"] >= 0.2 * hi["raw_s"], (op, hi)
        assert r[big]["send_recv"]["count"] == r[big]["send_recv"]["recv_count"] == 4
        assert r[big]["send_recv"]["payload_bytes"] == 4 * big
        assert r[big]["reduce_scatter"]["count"] == 4
        assert r[big]["reduce_scatter"]["payload_bytes"] == 4 * big


def test_sampled_timing_keeps_counts_and_bytes_exact():
    for rank_entries in run_distributed(W.sampled_counts, 2, 300, 16, timeout=120):
        (e,) = rank_entries
        assert (e["op"], e["count"], e["payload_bytes"], e["wire_bytes"]) == \
            ("all_reduce", 300, 300 * 16, 300 * 16.0)
        assert e["time_s"] > 0
    with pytest.raises(ValueError, match="time_every"):
        Ledger(time_every=0)


def test_a_gate_runs_once_before_the_next_collective():
    """The watchdog waits for its step-start check through a gate: called before the first
    collective after it is armed (a barrier too), not before later ones, and not at all once
    the collective kernels are released."""
    for events in run_distributed(W.gate_order, 2, timeout=120):
        assert events == ["armed", "gate", "all_reduce", "all_reduce", "gate", "barrier",
                          "all_reduce"]


def test_a_run_shorter_than_the_ledger_warm_up_says_nothing_was_measured():
    """The ledger counts the steps after its warm-up; a run that ends before (an example run
    with --steps 2) printed a table of zeros at ratio 0.000 beside the expected bytes."""
    text = run_distributed(W.ledger_summary, 2, 2, timeout=180)[0]
    assert "no step measured" in text and "train more than 2 steps" in text, text
    assert "0.000" not in text, text
    text = run_distributed(W.ledger_summary, 2, 3, timeout=180)[0]
    assert "per rank per step, 1 step measured" in text and "1.000" in text, text

