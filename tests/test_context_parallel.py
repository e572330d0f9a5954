"""Context parallelism (``cp``): each rank holds a slice of every sequence; attention, the loss
and the gradients equal one device's.

Tolerance: 1e-5 absolute on attention outputs and gradients of unit-scale random q/k/v (fp32
sums taken in another order, nothing more; a wrong mask or a missing gradient term is off by
0.1 or more).
"""

from __future__ import annotations

import functools

import pytest
import torch

from plait.comm.volumes import cp_traffic
from plait.parallel.context import head_tail_positions
from plait.spawn import run_distributed
from tests import _workers_cp as W

TOL = 1e-5


def test_head_tail_positions_cover_the_sequence_once_and_balance_causal_work():
    seq, cp = 16, 4
    parts = [head_tail_positions(seq, cp, r) for r in range(cp)]
    assert parts[0].tolist() == [0, 1, 14, 15]
    assert parts[3].tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    # causal work: keys at or before each query, summed per rank: the same on every rank
    work = {int((p + 1).sum()) for p in parts}
    assert len(work) == 1


def test_attention_matches_one_device_at_cp2():
    """Causal, unmasked, GQA (enable_gqa) and a given scale: outputs and the gradients of q, k
    and v on each rank equal its slice of one-device SDPA's, and the patch is undone."""
    got = run_distributed(W.attention_matches, 2, 16, timeout=120)
    for rank in got:
        for case in rank:
            assert case["restored"], case
            for key in ("out", "q", "k", "v"):
                assert case[key] <= TOL, case


def test_attention_refuses_what_it_cannot_compute():
    messages = run_distributed(W.attention_refusals, 2, timeout=120)[0]
    assert len(messages) == 3, messages
    assert "attn_mask" in messages[0] and "is_causal=True" in messages[0]
    assert "dropout_p=0.1" in messages[1] and "0" in messages[1]
    assert "6 tokens" in messages[2] and "multiple of 4" in messages[2]


def test_positions_refuse_a_length_that_does_not_split():
    with pytest.raises(ValueError, match="multiple of 4"):
        head_tail_positions(10, 2, 0)


# ------------------------------------------------------------------------------ training
REL = 1e-5  # loss and parameters after the last step (as tests/test_semantics.py, fp32 sums
FLOOR = 1e-2  # in another order; a wrong position or a miscounted token is off by >1e-3)


def _assert_matches(ref: dict, got: dict) -> None:
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True)):
        assert abs(a - b) <= REL * abs(a), (got["plan"], step, a, b)
    state = {k.removeprefix("module."): v for k, v in got["state"].items()}
    assert set(state) >= set(ref["state"]), (got["plan"], sorted(state))
    for name, want in ref["state"].items():
        diff = (state[name] - want).abs().max().item()
        assert diff <= REL * max(want.abs().max().item(), FLOOR), (got["plan"], name, diff)


@pytest.fixture(scope="module")
def lm_data():
    batches = [W.lm_batch(s) for s in range(W.STEPS)]
    return batches, {name: W.reference(f, batches, W.lm_loss)
                     for name, f in (("causal", W.causal_lm), ("reference", W.reference_lm))}


def test_the_cp_ranks_count_different_numbers_of_tokens(lm_data):
    """The data makes a mean of the two slices' means visibly wrong."""
    from plait.parallel.context import head_tail_positions

    batches, _ = lm_data
    _, labels = batches[0]
    counts = [int((labels[:, head_tail_positions(W.SEQ, 2, r)] != -100).sum()) for r in (0, 1)]
    assert counts[0] != counts[1], counts


def test_training_at_cp2_matches_one_device(lm_data):
    """cp=2 (with grad_accum=2, with full activation checkpointing, whose recomputed attention
    runs in backward) trains what one device trains: every step's loss and the parameters after
    three SGD steps, on a model written for the test (learned positions from position_ids, GQA
    through enable_gqa) and on plait's reference transformer (rotary); run.evaluate's loss is
    one device's too."""
    batches, ref = lm_data
    jobs = [("cp=2", W.causal_lm, batches, W.lm_loss),
            ("cp=2,grad_accum=2", W.causal_lm, batches, W.lm_loss),
            ("cp=2", W.reference_lm, batches, W.lm_loss),
            ("cp=2,ac=full", W.reference_lm, batches, W.lm_loss)]
    got = run_distributed(W.train, 2, jobs, timeout=240)[0]
    for result, which in zip(got, ("causal", "causal", "reference", "reference"), strict=True):
        _assert_matches(ref[which], result)
    inputs, labels = batches[0]
    with torch.no_grad():
        want = float(W.lm_loss(W.causal_lm()(inputs), labels))
    got_eval = run_distributed(W.evaluate, 2, batches, timeout=120)
    assert got_eval[0] == got_eval[1] == pytest.approx(want, rel=REL)


def test_cp_refuses_what_it_would_train_wrongly(lm_data):
    """A model without position_ids, a loss that shifts the labels itself, a sequence that does
    not split into 2*cp chunks, per-row targets, attention written out instead of
    F.scaled_dot_product_attention (each rank's would attend over its slice only): each
    refused with the fix."""
    batches, _ = lm_data
    got = run_distributed(W.refusals, 2, batches, timeout=240)[0]
    assert "MaskedLM.forward must be told" in got[0] and "position_ids" in got[0], got[0]
    assert "shift the labels in the data" in got[1], got[1]
    assert "6 tokens" in got[2] and "multiple of 4" in got[2], got[2]
    assert "shape (4,)" in got[3] and "per-token labels" in got[3], got[3]
    assert "but the model's forward never called it" in got[4], got[4]


def test_cp_refuses_a_hugging_face_model_whose_attention_is_not_sdpa():
    """Llama built with attn_implementation="eager" computes attention without
    F.scaled_dot_product_attention, which cp replaces: refused before any sharding, naming
    the fix; its SDPA form is not."""
    from plait.parallel.context import cp_refusal

    assert cp_refusal(W.hf_llama("eager"), 2) == (
        "context parallelism (cp=2) makes F.scaled_dot_product_attention attend over the "
        "whole sequence, and LlamaForCausalLM computes attention with "
        "attn_implementation='eager', which would attend over each rank's slice only: build "
        "it with attn_implementation='sdpa', or train with cp=1")
    assert cp_refusal(W.hf_llama(), 2) is None


def test_the_ledger_shows_the_all_gathers_on_the_cp_axis(lm_data):
    """Forward all-gathers K and V per layer (2 layers x 2), backward reduce-scatters their
    gradients; payload: the full gathered buffer, batch x kv_heads x seq x head_dim fp32."""
    batches, _ = lm_data
    got = run_distributed(W.ledger_axes, 2, batches, timeout=240)[0]
    gather = got["cp/all_gather"]
    kv_bytes = W.BATCH * 2 * W.SEQ * 4 * 4  # 2 kv heads of 4 dims, fp32
    assert (gather["count"], gather["payload_bytes"]) == (4, 4 * kv_bytes), gather
    scatter = got["cp/reduce_scatter"]
    assert (scatter["count"], scatter["payload_bytes"]) == (4, 4 * kv_bytes), scatter
    # the closed form says the same
    closed = {t.op: t for t in cp_traffic(W.BATCH, W.SEQ, kv_dim=8, layers=2, cp=2)}
    for op, measured in (("all_gather", gather), ("reduce_scatter", scatter)):
        assert (closed[op].calls, closed[op].payload) == (measured["count"],
                                                         measured["payload_bytes"])
        assert closed[op].wire == measured["wire_bytes"]


def test_cp_traffic_closed_form():
    """Recomputed layers gather again; cp=1 moves nothing; bf16 halves the bytes."""
    base = {t.op: t for t in cp_traffic(2, 1024, 256, 4, 4)}
    assert base["all_gather"].payload == 2 * 4 * 2 * 1024 * 256 * 4
    assert base["all_gather"].wire == base["all_gather"].payload * 3 / 4
    again = {t.op: t for t in cp_traffic(2, 1024, 256, 4, 4, recomputed_layers=4)}
    assert again["all_gather"].calls == 2 * base["all_gather"].calls
    assert again["reduce_scatter"] == base["reduce_scatter"]
    assert cp_traffic(2, 1024, 256, 4, 1) == []
    half = {t.op: t for t in cp_traffic(2, 1024, 256, 4, 4, "bf16")}
    assert half["all_gather"].payload == base["all_gather"].payload / 2


def test_a_cp_rank_that_counts_no_token_adds_nothing():
    """Prompt masked, response counted: one cp rank holds no counted token (its mean is 0/0);
    its share is 0 and training still equals one device. The same for a data rank whose rows
    are all ignored (dp=2, the second half of each batch)."""
    batches = [W.response_batch(s) for s in range(W.STEPS)]
    ref = W.reference(W.causal_lm, batches, W.lm_loss)
    unlabelled = [(x, torch.cat([y[:2], torch.full_like(y[2:], -100)])) for x, y in batches]
    ref_dp = W.reference(W.causal_lm, unlabelled, W.lm_loss)
    got = run_distributed(W.train, 2, [("cp=2", W.causal_lm, batches, W.lm_loss),
                                       ("dp=2", W.causal_lm, unlabelled, W.lm_loss)],
                          timeout=240)[0]
    _assert_matches(ref, got[0])
    _assert_matches(ref_dp, got[1])


@pytest.mark.slow
def test_training_at_dp2_x_cp2_matches_one_device(lm_data):
    """World 4: FSDP (ZeRO-3) over dp_shard x cp, and DDP over dp_replicate x cp."""
    batches, ref = lm_data
    jobs = [("dp_shard=2,zero=3,cp=2", W.causal_lm, batches, W.lm_loss),
            ("dp=2,cp=2", W.causal_lm, batches, W.lm_loss),
            ("dp_shard=2,zero=2,cp=2", W.reference_lm, batches, W.lm_loss)]
    got = run_distributed(W.train, 4, jobs, timeout=480)[0]
    for result, which in zip(got, ("causal", "causal", "reference"), strict=True):
        _assert_matches(ref[which], result)


def test_hf_llama_at_cp2_matches_one_device(lm_data):
    """A tiny Hugging Face Llama (SDPA attention, rotary from position_ids): cp=2 trains what
    one device trains, with labels shifted in the data and a loss on output.logits."""
    batches, _ = lm_data
    ref = W.reference(W.hf_llama, batches, W.logits_loss)
    got = run_distributed(W.train, 2, [("cp=2", W.hf_llama, batches, W.logits_loss)],
                          timeout=240)[0]
    _assert_matches(ref, got[0])


def test_the_ledger_report_says_why_a_model_under_cp_has_no_expected_column():
    """Under cp the widths of keys and values are read off the model's stack of blocks: a
    model whose attention lies outside the stack plait finds (the causal LM here keeps its
    attention projections and its MLPs in two lists), or whose input is not token ids, gets a
    note saying so instead of a column that would leave the K/V gathers out."""
    from plait.comm.predict import expected_for_models, no_expected_note, planner_stats
    from plait.plan import Plan

    plan = Plan(cp=2)
    model = W.causal_lm()
    stats = planner_stats(model, "cpu", plan)
    assert stats is not None and not stats.attention
    assert expected_for_models([model], plan, (4, 16), stats=stats) is None
    note = no_expected_note([model], plan, stats, (4, 16))
    assert "attention" in note and "no 'expected' column" in note, note
    llama = _llama_stats()
    assert llama is not None and llama.attention
    assert "not token ids" in no_expected_note([model], plan, llama, (4, 16, 8), tokens=False)
    bf16 = Plan(cp=2, mixed_precision="bf16")
    assert "mixed_precision=bf16" in no_expected_note([model], bf16, llama, (4, 16))


def _llama_stats():
    from plait.comm.predict import planner_stats

    return planner_stats(W.hf_llama(), "cpu", None)


def test_the_planner_proposes_and_prices_cp():
    """`plait plan` ranks layouts with cp beside the others (here the tiny model on 4 CPU
    processes at a sequence of 4,096) and prices --plan with cp>1: the K/V all-gathers on the
    cp axis, 2 per block each way, and every rank's s/cp tokens. At 128 tokens the search
    leaves cp out (fewer than 1,024 tokens per rank) and --plan cp=4 is still priced."""
    import contextlib
    import io
    import json

    from plait.cli import main

    def ranked_cp(seq: str) -> set[int]:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            code = main(["plan", "--model", "tiny", "--cluster", "cpu", "--devices", "4",
                         "--global-batch", "8", "--seq", seq, "--top", "1000",
                         "--format", "json"])
        ranked = json.loads(buffer.getvalue())
        assert code == 0 and len(ranked["plans"]) == ranked["fit"] > 1, ranked
        return {p["layout"]["cp"] for p in ranked["plans"]}

    assert ranked_cp("4096") == {1, 2, 4}
    assert ranked_cp("128") == {1}
    args = ["plan", "--model", "tiny", "--cluster", "cpu", "--devices", "4",
            "--global-batch", "8", "--seq", "128"]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main([*args, "--plan", "cp=4", "--format", "json"])
    (priced,) = json.loads(buffer.getvalue())["plans"]
    assert code == 0 and priced["feasible"], priced
    assert priced["comm_bytes_per_step"]["cp"] > 0, priced


@pytest.mark.slow
def test_training_under_hsdp_x_cp2_matches_one_device(lm_data):
    """World 8: FSDP2's HSDP with cp, sharded over dp_shard x cp and replicated over
    dp_replicate."""
    batches, ref = lm_data
    jobs = [("dp_replicate=2,dp_shard=2,zero=3,cp=2", W.causal_lm, batches, W.lm_loss)]
    got = run_distributed(W.train, 8, jobs, timeout=480)[0]
    _assert_matches(ref["causal"], got[0])


def _check_checkpoints(out: dict, reference: list[float]) -> None:
    from tests.test_checkpoint import RESHARD_RTOL

    uninterrupted, resumed = out.pop("resume")
    assert len(resumed) == 6 and resumed == uninterrupted, (resumed, uninterrupted)
    for name, losses in out.items():
        want = reference[:3] if "(saved)" in name else reference[3:]
        assert len(losses) == len(want), (name, losses)
        for got, expected in zip(losses, want, strict=True):
            assert abs(got - expected) <= RESHARD_RTOL * abs(expected), (name, losses, want)


def test_checkpoints_resume_exactly_and_move_in_and_out_of_cp(tmp_path, no_group):
    """A cp=2 run stopped at step 6 and resumed gives bitwise the uninterrupted run's losses;
    a cp=2 checkpoint continues with one device's losses in one process and under ZeRO-3 over
    2, and ZeRO-3's and one process's continue so under cp=2 (within the checkpoint tests'
    resharding tolerance: only summation order differs)."""
    from tests import _workers_checkpoint as ck

    reference = ck.train("single", steps=6)
    ck.save_under(0, 1, "single", str(tmp_path / "single"))
    out = run_distributed(W.checkpoints, 2, str(tmp_path), timeout=420)[0]
    out["cp=2 -> one process"] = ck.continue_under(0, 1, "single", str(tmp_path / "cp2"))
    _check_checkpoints(out, reference)


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["cp=2,tp=2", "cp=2,tp=2,zero=3", "cp=2,pp=2,microbatches=2"])
def test_checkpoints_under_cp2_at_world4(tmp_path, no_group, plan):
    """World 4: cp=2 x tp=2, replicated over cp or sharded over it by ZeRO-3, and cp=2 x
    pp=2 resume bitwise, and their checkpoints move to and from one process with one
    device's losses."""
    from tests import _workers_checkpoint as ck

    reference = ck.train("single", steps=6)
    ck.save_under(0, 1, "single", str(tmp_path / "single"))
    out = run_distributed(W.checkpoints_tp, 4, str(tmp_path), plan, timeout=480)[0]
    out[f"{plan} -> one process"] = ck.continue_under(0, 1, "single", str(tmp_path / "cptp"))
    _check_checkpoints(out, reference)


@pytest.mark.slow
def test_checkpoints_under_cp2_with_zero1(tmp_path, no_group):
    """World 2: cp=2 with ZeRO-1 resumes bitwise (each rank's partition of the optimizer
    state saved and loaded); its checkpoint continues in one process and under ZeRO-3 over 2,
    and one process's under it, with one device's losses."""
    from tests import _workers_checkpoint as ck

    reference = ck.train("single", steps=6)
    ck.save_under(0, 1, "single", str(tmp_path / "single"))
    out = run_distributed(W.checkpoints_zero1, 2, str(tmp_path), timeout=420)[0]
    out["cp=2,zero=1 -> one process"] = ck.continue_under(0, 1, "single",
                                                          str(tmp_path / "cpz1"))
    _check_checkpoints(out, reference)


def test_the_predicted_rows_sit_on_the_axes_the_ledger_names():
    """The closed form behind the ledger's expected column under cp (no process group): K/V on
    cp as cp_traffic gives them, gradients on the data x cp group under the name the ledger
    gives its ranks (cp itself at dp=1, dp_cp, dp_shard_cp), HSDP's shard all-reduce on
    dp_replicate at 1/(dp_shard*cp) of the gradients."""
    from plait.comm.predict import by_axis_op, predict
    from plait.models.transformer import preset
    from plait.plan import Plan

    cfg = preset("test")
    kv = {(t.axis, t.op): t.payload for t in cp_traffic(4, 32, cfg.kv_heads * cfg.head_dim,
                                                          cfg.n_layers, 2)}
    cases = {"cp=2": {("cp", "all_reduce")},
             "dp=2,cp=2": {("dp_cp", "all_reduce")},
             "dp_shard=2,zero=3,cp=2": {("dp_shard_cp", op)
                                        for op in ("all_gather", "reduce_scatter", "all_reduce")},
             "dp_replicate=2,dp_shard=2,zero=3,cp=2": {
                 ("dp_replicate", "all_reduce"),
                 *{("dp_shard_cp", op) for op in ("all_gather", "reduce_scatter", "all_reduce")}},
             # ZeRO-1: DDP's all-reduce over dp x cp, the optimizer's broadcasts over
             # dp_shard x cp (the same ranks here)
             "cp=2,zero=1": {("cp", "all_reduce"), ("cp", "broadcast")},
             "dp_shard=2,cp=2,zero=1": {("dp_shard_cp", "all_reduce"),
                                        ("dp_shard_cp", "broadcast")},
             "dp_replicate=2,cp=2,zero=1": {("dp_cp", "all_reduce"), ("cp", "broadcast")}}
    for text, grads in cases.items():
        rows = by_axis_op(predict(Plan.from_string(text), cfg, 4, 32))
        assert set(rows) == grads | set(kv), (text, sorted(rows))
        assert all(rows[key] == kv[key] for key in kv), text
    hsdp = by_axis_op(predict(Plan.from_string("dp_replicate=2,dp_shard=2,zero=3,cp=2"), cfg,
                              4, 32))
    assert hsdp[("dp_replicate", "all_reduce")] == hsdp[("dp_shard_cp", "reduce_scatter")] / 4


def test_the_clip_norms_under_fsdp_x_cp_x_tp_are_one_all_reduce():
    """FSDP2 over dp_shard x cp beside tp: the gradient norms are partial over dp_shard_cp
    and tp, and plait's mesh flattens the two, so the prediction is one all-reduce over all
    dp_shard x cp x tp ranks (none on dp_shard_tp, which holds other ranks)."""
    from plait.comm.predict import predict
    from plait.models.transformer import preset
    from plait.plan import Plan

    for text, ranks in (("dp_shard=2,cp=2,tp=2,zero=3", 8), ("cp=2,tp=2,zero=2", 4)):
        clip = [t for t in predict(Plan.from_string(text), preset("test"), 4, 32)
                if t.what.startswith("clip")]
        assert [(t.axis, t.op, t.calls, t.group) for t in clip] == [
            ("dp_shard_cp_tp", "all_reduce", 1, ranks)], (text, clip)


@pytest.mark.slow
def test_training_at_cp2_x_tp2_matches_one_device(lm_data):
    """World 4: tp shards the heads, cp all-gathers each rank's local heads' keys and values
    over the cp group; the TP shards are replicated over cp by FSDP2's replicate (DDP cannot
    take DTensors). plait's transformer with and without sequence parallelism and a tiny
    Hugging Face Llama (tp plan inferred) train what one device trains."""
    batches, ref = lm_data
    hf = W.reference(W.hf_llama, batches, W.logits_loss)
    jobs = [("cp=2,tp=2", W.reference_lm, batches, W.lm_loss),
            ("cp=2,tp=2,sp", W.reference_lm, batches, W.lm_loss),
            ("cp=2,tp=2", W.hf_llama, batches, W.logits_loss)]
    got = run_distributed(W.train, 4, jobs, timeout=480)[0]
    for result, want in zip(got, (ref["reference"], ref["reference"], hf), strict=True):
        _assert_matches(want, result)


@pytest.mark.slow
def test_training_at_dp2_x_cp2_x_tp2_matches_one_device(lm_data):
    """World 8: the TP shards replicated over dp x cp."""
    batches, ref = lm_data
    got = run_distributed(W.train, 8, [("dp=2,cp=2,tp=2", W.reference_lm, batches, W.lm_loss)],
                          timeout=480)[0]
    _assert_matches(ref["reference"], got[0])


# ------------------------------------------------------------------ cp with tp and ZeRO
@pytest.fixture(scope="module")
def adamw_ref(lm_data):
    """One device under AdamW (tests/_workers_cp.py reference_adamw), by model, computed on
    first use."""
    batches, _ = lm_data
    models = {"block": (W.block_lm, W.lm_loss), "reference": (W.reference_lm, W.lm_loss),
              "hf": (W.hf_llama, W.logits_loss)}

    @functools.cache
    def one_device(which: str) -> dict:
        factory, loss_fn = models[which]
        return W.reference_adamw(factory, batches, loss_fn)
    return one_device


def test_cp_under_zero3_with_tp_and_under_zero1_matches_one_device(lm_data, adamw_ref):
    """World 4, AdamW: FSDP2 over the cp ranks beside tp (cp=2,tp=2,zero=3: tp's DTensors
    sharded over dp_shard x cp, a fused q|k|v layer on another dim), and ZeRO-1 with cp (DDP
    over dp x cp, the optimizer state partitioned over dp_shard x cp) train what one device
    trains: every step's loss and every parameter after the last, on a model written for the
    test."""
    batches, _ = lm_data
    jobs = [("cp=2,tp=2,zero=3", W.block_lm, batches, W.lm_loss),
            ("dp_shard=2,cp=2,zero=1", W.block_lm, batches, W.lm_loss)]
    got = run_distributed(W.train_adamw, 4, jobs, timeout=300)[0]
    for result in got:
        _assert_matches(adamw_ref("block"), result)


@pytest.mark.slow
def test_cp_x_tp_under_zero2_and_zero3_matches_one_device(lm_data, adamw_ref):
    """World 4, AdamW: plait's transformer under ZeRO-3 and ZeRO-2 with sequence parallelism
    beside cp=2,tp=2; a tiny Hugging Face Llama (tp plan inferred) under ZeRO-3; ZeRO-1
    sharding the optimizer over the cp ranks only, replicated over dp_replicate."""
    batches, _ = lm_data
    jobs = [("cp=2,tp=2,zero=3", W.reference_lm, batches, W.lm_loss),
            ("cp=2,tp=2,zero=2,sp", W.reference_lm, batches, W.lm_loss),
            ("cp=2,tp=2,zero=3", W.hf_llama, batches, W.logits_loss),
            ("dp_replicate=2,cp=2,zero=1", W.block_lm, batches, W.lm_loss)]
    got = run_distributed(W.train_adamw, 4, jobs, timeout=480)[0]
    for result, which in zip(got, ("reference", "reference", "hf", "block"), strict=True):
        _assert_matches(adamw_ref(which), result)


@pytest.mark.slow
def test_fsdp_over_dp_shard_x_cp_with_tp_at_world8_matches_one_device(lm_data, adamw_ref):
    """World 8, AdamW: dp_shard=2,cp=2,tp=2 under ZeRO-3 (FSDP2 over the 4 dp_shard x cp
    ranks of each tp rank) on both models, and HSDP over dp_replicate x cp beside tp."""
    batches, _ = lm_data
    jobs = [("dp_shard=2,cp=2,tp=2,zero=3", W.block_lm, batches, W.lm_loss),
            ("dp_shard=2,cp=2,tp=2,zero=3", W.reference_lm, batches, W.lm_loss),
            ("dp_replicate=2,cp=2,tp=2,zero=3", W.block_lm, batches, W.lm_loss)]
    got = run_distributed(W.train_adamw, 8, jobs, timeout=600)[0]
    for result, which in zip(got, ("block", "reference", "block"), strict=True):
        _assert_matches(adamw_ref(which), result)


# ------------------------------------------------------------------------ cp with pp
@pytest.fixture(scope="module")
def block_ref(lm_data):
    """One device (SGD, as tests/_workers_semantics.py's reference) on the block models."""
    batches, _ = lm_data
    return {f.__name__: W.reference(f, batches, W.lm_loss)
            for f in (W.block_lm, W.deep_block_lm)}


def test_cp_with_pp_matches_one_device_and_refuses_on_every_stage(lm_data, block_ref):
    """World 4, cp=2 x pp=2 (1F1B): each stage runs on its rank's slice of every sequence
    (the stages send slices), its attention over the whole sequence with the cp ranks of its
    stage; the loss of every step and every parameter after three SGD steps (which, unlike
    AdamW's, show a wrong gradient scale) match one device, on a model written for the test
    and on a tiny Hugging Face Llama. What cp refuses is refused on every rank, the loss that
    shifts labels too, which only the last stage computes."""
    batches, _ = lm_data
    plan = "cp=2,pp=2,microbatches=2"
    zbv = "cp=2,pp=2,microbatches=2,pp_schedule=zbv,virtual_stages=2"
    got = run_distributed(W.train, 4, [(plan, W.block_lm, batches, W.lm_loss),
                                       (plan, W.hf_llama, batches, W.logits_loss),
                                       (zbv, W.deep_block_lm, batches, W.lm_loss)],
                          timeout=300)[0]
    _assert_matches(block_ref["block_lm"], got[0])
    # a Hugging Face model: its stages are told the slice's positions are no packed sequences
    _assert_matches(W.reference(W.hf_llama, batches, W.logits_loss), got[1])
    # ZB-V: the weight gradients come after the last input-gradient step, then the cp sum
    _assert_matches(block_ref["deep_block_lm"], got[2])
    # the stages run on slices: K and V gathered per block and microbatch (one block per
    # stage, two microbatches), the activations sent are half the sequence's
    ledger = run_distributed(W.ledger_axes, 4, batches, plan, W.block_lm, timeout=300)[0]
    assert ledger["cp/all_gather"]["count"] == 2 * 2, ledger["cp/all_gather"]
    sent = 2 * (W.BATCH // 2) * (W.SEQ // 2) * W.WIDTH * 4  # 2 microbatches of the slice
    assert ledger["pp/send_recv"]["payload_bytes"] == sent, ledger["pp/send_recv"]
    refused = run_distributed(W.refusals, 4, batches, plan, W.block_lm, timeout=300)
    for messages in refused:  # every rank
        assert "MaskedLM.forward must be told" in messages[0], messages[0]
        assert "shift the labels in the data" in messages[1], messages[1]
        assert "multiple of 4" in messages[2] and "per-token labels" in messages[3], messages


@pytest.mark.slow
def test_cp_with_pp_schedules_and_accumulation_match_one_device(lm_data, block_ref):
    """World 4: GPipe on plait's transformer (rotary positions on every stage), interleaved
    1F1B with two stages per rank, 1F1B with grad_accum=2 and interleaved zero-bubble with
    grad_accum=2 under cp=2 x pp=2 train what one device trains; run.evaluate's loss is one
    device's."""
    batches, ref = lm_data
    jobs = [("cp=2,pp=2,microbatches=2,pp_schedule=gpipe", W.reference_lm, batches, W.lm_loss),
            ("cp=2,pp=2,microbatches=4,pp_schedule=interleaved_1f1b,virtual_stages=2",
             W.deep_block_lm, batches, W.lm_loss),
            ("cp=2,pp=2,microbatches=2,grad_accum=2", W.block_lm, batches, W.lm_loss),
            ("cp=2,pp=2,microbatches=2,pp_schedule=interleaved_zb,virtual_stages=2,"
             "grad_accum=2", W.deep_block_lm, batches, W.lm_loss)]
    got = run_distributed(W.train, 4, jobs, timeout=480)[0]
    for result, want in zip(got, (ref["reference"], block_ref["deep_block_lm"],
                                  block_ref["block_lm"], block_ref["deep_block_lm"]),
                            strict=True):
        _assert_matches(want, result)
    inputs, labels = batches[0]
    with torch.no_grad():
        want_eval = float(W.lm_loss(W.block_lm()(inputs), labels))
    evals = run_distributed(W.evaluate, 4, batches, "cp=2,pp=2,microbatches=2", W.block_lm,
                            timeout=240)
    assert all(e == pytest.approx(want_eval, rel=REL) for e in evals), (evals, want_eval)


@pytest.mark.slow
def test_cp_with_pp_and_data_or_tensor_parallelism_at_world8(lm_data, block_ref):
    """World 8: FSDP2 (ZeRO-3) over dp_shard x cp in each stage, DDP over dp x cp, and tp
    inside cp x pp."""
    batches, ref = lm_data
    jobs = [("dp_shard=2,cp=2,pp=2,zero=3,microbatches=2", W.block_lm, batches, W.lm_loss),
            ("dp_replicate=2,cp=2,pp=2,microbatches=2", W.block_lm, batches, W.lm_loss),
            ("cp=2,tp=2,pp=2,microbatches=2", W.reference_lm, batches, W.lm_loss)]
    got = run_distributed(W.train, 8, jobs, timeout=600)[0]
    for result, want in zip(got, (block_ref["block_lm"], block_ref["block_lm"],
                                  ref["reference"]), strict=True):
        _assert_matches(want, result)


# ------------------------------------------- zero-bubble schedules: gradients after the schedule
@pytest.fixture(scope="module")
def gated_data():
    """Batches whose gated branches run on some steps, slices and microbatches only, and one
    device's AdamW (weight decay 0.1) on them."""
    batches = [W.gated_batch(s) for s in range(W.STEPS)]
    return batches, W.reference_adamw(W.gated_lm, batches, W.lm_loss)


def _max_diff(ref: dict, got: dict) -> float:
    """The largest gap between any parameter after the last step and one device's: 1e-6 here
    (fp32 sums in another order, through AdamW's eps of 1e-6); a zero gradient where one
    device has none moves a branch's weights by 8e-4 over these steps."""
    state = {k.removeprefix("module."): v for k, v in got["state"].items()}
    return max((state[n] - w).abs().max().item() for n, w in ref["state"].items())


def test_zero_bubble_with_cp_or_data_ranks_keeps_no_gradient_where_no_rank_used_it(gated_data):
    """World 4, AdamW with weight decay, a model written for the test whose branches run on
    some tokens only: ZB-V under cp=2 (the gated tokens of a step in one cp rank's slice),
    interleaved zero-bubble under cp=2 with ZeRO-1, and ZB-V over two data replicas without
    cp. Their stages reduce the deferred weight gradients over the data and cp ranks after
    the schedule: a branch no rank used keeps no gradient, so AdamW leaves it as one device
    does (a zero gradient would move it by weight decay and momentum); one some ranks used
    gets their sum. Every step's loss and every parameter match one device."""
    batches, ref = gated_data
    jobs = [("cp=2,pp=2,microbatches=2,pp_schedule=zbv,virtual_stages=2", W.gated_lm,
             batches, W.lm_loss),
            ("cp=2,zero=1,pp=2,microbatches=2,pp_schedule=interleaved_zb,virtual_stages=2",
             W.gated_lm, batches, W.lm_loss),
            ("dp_replicate=2,pp=2,microbatches=2,pp_schedule=zbv,virtual_stages=2",
             W.gated_lm, batches, W.lm_loss)]
    got = run_distributed(W.train_adamw, 4, jobs, timeout=300)[0]
    for result in got:
        _assert_matches(ref, result)
        assert _max_diff(ref, result) <= 2e-6, (result["plan"], _max_diff(ref, result))


@pytest.mark.slow
def test_zero_bubble_with_cp_and_data_or_tensor_parallelism_at_world8(gated_data, lm_data,
                                                                      block_ref):
    """World 8: ZB-V over dp x cp (two data replicas of two cp ranks each), interleaved
    zero-bubble under ZeRO-1 over dp_shard x cp, and tp inside cp x pp, and inside dp x pp
    without cp, under ZB-V (each tp shard's gradient averaged over the ranks holding it)."""
    batches, ref = gated_data
    jobs = [("dp_replicate=2,cp=2,pp=2,microbatches=2,pp_schedule=zbv,virtual_stages=2",
             W.gated_lm, batches, W.lm_loss),
            ("dp_shard=2,zero=1,cp=2,pp=2,microbatches=2,pp_schedule=interleaved_zb,"
             "virtual_stages=2", W.gated_lm, batches, W.lm_loss)]
    got = run_distributed(W.train_adamw, 8, jobs, timeout=600)[0]
    for result in got:
        _assert_matches(ref, result)
        assert _max_diff(ref, result) <= 2e-6, (result["plan"], _max_diff(ref, result))
    lm_batches, _ = lm_data
    zbv = "pp=2,microbatches=2,pp_schedule=zbv,virtual_stages=2"
    tp = run_distributed(W.train, 8, [(f"cp=2,tp=2,{zbv}", W.deep_block_lm, lm_batches,
                                       W.lm_loss),
                                      (f"dp_replicate=2,tp=2,{zbv}", W.deep_block_lm,
                                       lm_batches, W.lm_loss)], timeout=600)[0]
    for result in tp:
        _assert_matches(block_ref["deep_block_lm"], result)


def test_held_out_counts_under_cp_are_one_devices():
    """A one-device metric loop ported as it is under cp=4, dp=2,cp=2, fsdp=2,cp=2 and
    cp=2,pp=2: token accuracy counted in the loss function given to run.evaluate (each cp
    rank's slice; the last stage's under a pipeline) and summed with
    run.all_reduce(sliced=True), rows counted there and the same token counts from model(x)
    (the whole sequence on every cp rank) summed with sliced=False, all one device's counts
    exactly; without sliced, refused naming both."""
    jobs = [("cp=4", "causal"), ("dp=2,cp=2", "causal"), ("fsdp=2,cp=2", "causal"),
            ("cp=2,pp=2,microbatches=2", "block")]
    got = run_distributed(W.held_counts, 4, jobs, timeout=180)
    for plan, name in jobs:
        want = W.held_counts_reference(name)
        assert 0 < want["tokens"][0] < want["tokens"][1], want  # hits, but not every token
        for rank in got:
            result = rank[plan]
            assert result["val"] == pytest.approx(want["val"], rel=1e-5), (plan, result)
            assert torch.equal(result["tokens"], want["tokens"]), (plan, result, want)
            assert result["rows"] == want["rows"], (plan, result)
            if "pp" not in plan:
                assert torch.equal(result["outputs"], want["tokens"]), (plan, result, want)
            said = result["refused"]
            assert said.startswith("run.all_reduce under cp=") and "sliced=True" in said, said
            assert "sliced=False" in said and "model(x)" in said, said


def test_held_out_counts_under_cp_with_tp_are_one_devices():
    """tp=2 with cp=2, and with dp=2 or ZeRO-2 over dp_shard=2 beside it, on a model whose inferred
    tp plan makes the head vocabulary-parallel (the loss function and model(x) get logits split
    over tp on the vocabulary, a DTensor): run.evaluate's loss is one device's; token accuracy
    counted from the logits made whole (.full_tensor()) in the loss function and summed with
    run.all_reduce(sliced=True), and from model(x) with sliced=False, is one device's count
    exactly (the tp ranks hold the same rows and slices: summed over the data and cp ranks
    only); a count taken on the split DTensor itself (the positive logits: partial over tp) goes
    through run.all_reduce whole and comes back a plain tensor; counting on the split logits as
    on plain ones fails, naming .full_tensor(). A loss that shifts the labels is refused under
    cp and one device's without it. An optimizer built after run.evaluate (FSDP2 holds the tp
    shards, replicated or under ZeRO-2, which leave the parameters gathered after a forward)
    steps the model as one device's SGD does."""
    _check_held_counts_tp(["tp=2,cp=2", "tp=2,dp=2", "dp_shard=2,zero=2,tp=2"], 4)


@pytest.mark.slow
def test_held_out_counts_under_dp_x_cp_x_tp_at_world8_are_one_devices():
    """World 8, dp=2,cp=2,tp=2: the counts of the test above, summed over the 4 data x cp
    ranks of each tp rank, are one device's."""
    _check_held_counts_tp(["dp=2,cp=2,tp=2"], 8)


def _check_held_counts_tp(plans: list[str], world: int) -> None:
    got = run_distributed(W.held_counts_tp, world, plans, timeout=300)
    want = W.held_counts_tp_reference()
    assert 0 < want["tokens"][0] < want["tokens"][1], want  # hits, but not every token
    for plan in plans:
        for rank in got:
            result = rank[plan]
            assert result["sharded"], (plan, result)  # the head is vocabulary-parallel
            assert result["val"] == pytest.approx(want["val"], rel=1e-5), (plan, result)
            assert torch.equal(result["tokens"], want["tokens"]), (plan, result, want)
            assert torch.equal(result["outputs"], want["tokens"]), (plan, result, want)
            assert result["positive"] == result["outputs_positive"] == want["positive"], (
                plan, result, want)
            assert result["positive_type"] == "Tensor", (plan, result)
            said = result["split_refused"]  # the metric code failed on the DTensor: the fix
            assert "split over the vocabulary" in said and "logits.full_tensor()" in said, said
            if "cp" in plan:
                assert "shift the labels in the data" in result["shifted"], result["shifted"]
            else:
                assert result["shifted"] == pytest.approx(want["shifted"], rel=1e-5), result
            assert result["stepped"] == pytest.approx(want["val"], rel=1e-5), (plan, result)
            assert result["after"] == pytest.approx(want["after"], rel=1e-5), (plan, result)
