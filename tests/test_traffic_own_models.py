"""The planner's tensor/sequence/pipeline-parallel traffic for models written for the test
(tests/_traffic_models.py: MLP-only and attention-only blocks, grouped-query and multi-query
attention, a tied head, LoRA layers, tiny GPT-2 and Llama) against what the comm ledger measures
when plait's runtime trains them: per (axis, op), the same bytes and calls per step.

The planner reads the model as ``plait plan --model pkg.mod:factory`` does (on the meta device)
and prices each block from the layer plan plait lays it out with, not from plait's reference
block (attention + MLP, 4 all-reduces). The ledger's expected column under these layouts is
the same prediction, taken on the model ``run.parallelize`` was given."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from plait.comm.predict import TPBlock, tp_block_traffic
from plait.plan import Plan
from plait.planner.model_stats import from_module, load_model
from plait.spawn import run_distributed
from tests import _traffic_models as T


def _same(name: str, plan: str, comm: dict, global_batch: int) -> None:
    """The planner's rows equal the ledger's, and so does the ledger's own expected column
    (taken from the same planner on the model before layout)."""
    for row in comm["rows"]:
        assert row["ratio"] == pytest.approx(1.0, abs=1e-12), (name, row)
    assert not any("no 'expected' column" in n for n in comm["notes"]), comm["notes"]
    measured = T.measured_rows(comm)
    predicted = T.planner_rows(name, plan, global_batch)
    assert set(measured) == set(predicted), (name, sorted(measured), sorted(predicted))
    for key, (nbytes, calls) in measured.items():
        assert predicted[key][0] == pytest.approx(nbytes, rel=1e-9), (name, key, measured,
                                                                      predicted)
        assert predicted[key][1] == pytest.approx(calls, rel=1e-9), (name, key, measured,
                                                                     predicted)


# The default cases: an MLP-only block (2 all-reduces, no attention), LoRA layers (their rank's
# collectives, a frozen embedding, frozen bases), GPT-2 (fused q|k|v bias, LayerNorms), under SP;
# LoRA under bf16 and checkpointing: its row-parallel outputs travel in bf16, its base's input
# gradient in fp32 (a norm's output) and its B's in bf16 (A's output), and a replay issues
# both row-parallel all-reduces again (B saves A's all-reduced output), not all but the last.
# FSDP2's padded rows beside a pipeline: a vocabulary of 51, a 7-row weight, a bias and a 1-D
# gain of 7 are gathered and reduce-scattered as 52 and 8 rows (the ledger's column here is
# the planner's; the slow cases below add ZeRO without a pipeline, ZeRO-3 and dp_shard=4).
# Frozen parameters beside a pipeline: FSDP2 gathers them but reduce-scatters only the
# gradients that exist (none for a frozen block, nor for a stage whose embedding and blocks
# are all frozen), and clipping takes one norm per gradient (the slow cases add ZeRO-1/3,
# DDP, ZeRO-2 alone and a frozen tied embedding).
# Leading frozen blocks after a frozen embedding: the backward pass never reaches them, so
# they issue no backward collective over tp, and under ZeRO-3 FSDP2 gathers again only the
# last of them (the next block's pre-backward hook prefetches it), not the others.
# Blocks that differ in what trains, each priced as itself: frozen norms in a middle layer
# (no norm gradient summed there under SP), a frozen attention behind frozen layers (the
# backward pass enters the MLP only), a trainable gain on a frozen embedding's output (every
# block reached, the stack's input gradient gathered under SP, every block gathered again for
# backward under ZeRO-3). A parameter of the root
# module beside a pipeline: every stage holds it and sums its gradient (its dp_shard piece
# under ZeRO-2) over pp.
CASES = [("tp=2,sp=1", ["mlp", "lora", "gpt2", "llama_frozen_attention", "gain_lead"]),
         # context parallelism: each block's K and V (2 kv heads of 4 query heads: half of
         # q's width) all-gathered over cp in forward, their gradients reduce-scattered in
         # backward; DDP over cp (at dp=1, the cp group) reduces the gradients
         ("cp=2", ["gqa"]),
         ("dp_shard=2,zero=3", ["frozen_lead", "gain_lead"]), ("tp=2", ["frozen_lead"]),
         ("tp=2,mixed_precision=bf16,activation_checkpointing=full", ["lora"]),
         ("dp_shard=2,zero=2,pp=2,microbatches=2", ["gpt2_51", "frozen_stage"])]
SLOW_CASES = [
    ("tp=2", ["mlp", "attention", "gqa", "mqa", "tied", "lora", "gpt2", "llama",
              "frozen_stage", "llama_frozen", "llama_mid_norms", "llama_frozen_attention"]),
    ("tp=2,sp=1", ["attention", "gqa", "mqa", "tied", "llama", "frozen_lead", "frozen_stage",
                   "llama_frozen", "llama_mid_norms"]),
    ("pp=2,microbatches=2", ["mlp", "tied", "gpt2", "llama", "scaled"]),
    ("pp=2,pp_schedule=interleaved_1f1b,virtual_stages=2,microbatches=2", ["tied", "lora",
                                                                            "scaled"]),
    # GPT-2 with 51 tokens: each rank reduces its own vocabulary rows, 26 on the first tp rank
    ("dp=2,tp=2", ["mlp", "attention", "lora", "gpt2", "llama", "gpt2_51"]),
    ("pp=2,tp=2,microbatches=2", ["mlp", "tied", "lora", "gpt2", "mqa", "frozen_lead",
                                  "scaled"]),
    # SP beside a pipeline: each stage sends its rank's sequence shard, and gathers the
    # sequence only at the stack's ends (stage 0's first block, stage 1's last)
    ("pp=2,tp=2,sp=1,microbatches=2", ["mlp", "tied", "lora", "gpt2", "llama"]),
    # FSDP2's root unit: norms whole; FSDP2 pads the largest tp-local piece (GPT-2 with 51
    # tokens: 26 vocabulary rows on the first tp rank, 25 on the second)
    ("dp_shard=2,zero=3,tp=2", ["mlp", "lora", "gpt2", "gpt2_51", "frozen_lead",
                                "frozen_stage", "llama_frozen", "llama_frozen_attention",
                                "gain_lead"]),
    ("pp=2,pp_schedule=zbv,virtual_stages=2,microbatches=2", ["mlp", "llama"]),
    # ZB-V beside tp: the V puts the first and last chunks (embedding and head) on rank 0
    ("pp=2,tp=2,pp_schedule=zbv,virtual_stages=2,microbatches=2", ["mlp", "llama"]),
    ("pp=2,tp=2,sp=1,pp_schedule=zbv,virtual_stages=2,microbatches=2", ["mlp", "llama"]),
    # bf16: autocast over fp32 parameters; FSDP2's bf16 parameters (dp over tp, ZeRO-3 x tp)
    ("tp=2,sp=1,mixed_precision=bf16,grad_accum=2", ["mlp", "lora", "gpt2", "llama",
                                                     "llama_frozen_attention"]),
    ("dp=2,tp=2,mixed_precision=bf16", ["mlp", "mqa", "tied", "gpt2"]),
    ("dp_shard=2,zero=3,tp=2,mixed_precision=bf16", ["lora", "llama"]),
    ("pp=2,tp=2,microbatches=2,mixed_precision=bf16", ["tied", "lora", "gpt2"]),
    # checkpointing: GPT-2's dropout after a row-parallel projection replays its all-reduce
    ("tp=2,activation_checkpointing=full", ["mlp", "gpt2", "llama", "frozen_lead",
                                            "llama_frozen_attention"]),
    ("tp=2,sp=1,mixed_precision=bf16,activation_checkpointing=full", ["lora", "gpt2"]),
    ("dp=2,tp=2,activation_checkpointing=selective", ["lora", "gpt2"]),
    ("pp=2,microbatches=2,mixed_precision=bf16,activation_checkpointing=full",
     ["mlp", "gpt2"]),
    # data parallelism beside a pipeline: DDP, ZeRO-1's broadcasts (the last stage's copy of a
    # tied weight one more), FSDP2 (a tied weight's gradient summed across stages as its
    # dp_shard shard); a row's busiest rank is the first stage's under GPT-2 (its embeddings)
    ("dp=2,pp=2,microbatches=2", ["mlp", "tied", "gpt2", "lora_block", "frozen_stage",
                                  "frozen_tied"]),
    ("dp_shard=2,zero=1,pp=2,microbatches=2", ["tied", "gpt2", "lora", "lora_block",
                                               "frozen_stage", "frozen_tied"]),
    ("dp_shard=2,zero=2,pp=2,microbatches=2", ["mlp", "tied", "gpt2", "lora", "frozen_tied",
                                               "odd", "lora_block", "scaled"]),
    ("dp_shard=2,zero=3,pp=2,microbatches=2", ["tied", "gpt2", "llama", "odd", "gpt2_51",
                                               "lora", "lora_block", "frozen_stage",
                                               "frozen_tied", "scaled"]),
    # sizes FSDP2 pads (dim 0 rounded up to a multiple of dp_shard) without a pipeline, and
    # ZeRO-1, whose broadcasts move the parameters unpadded
    ("dp_shard=2,zero=1", ["odd", "gpt2_51"]),
    ("dp_shard=2,zero=2", ["odd", "gpt2_51", "lora_block", "frozen_stage"]),
    ("dp_shard=2,zero=3,mixed_precision=bf16", ["odd", "gpt2_51"]),
    ("dp_shard=4,zero=3", ["odd", "gpt2_51"]),
    # context parallelism: multi-query attention (one kv head), checkpointing (each replayed
    # block gathers K and V again), FSDP2 over dp_shard x cp, DDP over dp x cp
    ("cp=2,activation_checkpointing=full,grad_accum=2", ["gqa", "mqa", "attention"]),
    ("dp_shard=2,zero=3,cp=2", ["gqa", "llama", "mqa"]),
    ("dp=2,cp=2", ["gqa", "attention"]),
    # context parallelism beside tensor parallelism: tp's all-reduces (or SP's gathers and
    # reduce-scatters) on each rank's seq / cp tokens, K and V of the rank's share of the kv
    # heads gathered over cp, the gradients all-reduced over cp
    ("cp=2,tp=2", ["llama", "gqa"]),
    ("cp=2,tp=2,sp=1", ["llama"]),
    # leading frozen blocks (tp, SP, ZeRO-3 x tp and checkpointing with the cases above)
    ("dp_shard=2,zero=3", ["frozen_stage", "llama_frozen"]),
    ("dp_replicate=2,dp_shard=2,zero=3,grad_accum=2", ["frozen_lead"]),
]


@pytest.mark.parametrize("plan,models", CASES + [
    pytest.param(*case, marks=pytest.mark.slow) for case in SLOW_CASES],
    ids=[c[0] for c in CASES] + [f"{c[0]}-slow" for c in SLOW_CASES])
def test_planner_prices_what_the_ledger_measures(plan, models):
    world = Plan.from_string(plan).world_size
    runs = run_distributed(T.ledger_rows, world, plan, models, timeout=300)[0]
    for name in models:
        _same(name, plan, runs[name]["comm"], runs[name]["global_batch"])


def test_cp_gathers_the_kv_heads_of_a_transformers_llama():
    """A tiny Hugging Face Llama (4 query heads sharing 2 kv heads) under cp=2: the planner's
    K/V all-gathers and their gradients' reduce-scatters equal what the ledger measures,
    bytes and calls: 2 per block each way of batch x seq x (2 kv heads x head_dim 4) fp32,
    half of what gathering the query heads' width would move. Every row of the ledger's own
    expected column (DDP's gradients and the rotary buffers it broadcasts, over cp) is exact."""
    runs = run_distributed(T.ledger_rows, 2, "cp=2", ["llama"], timeout=300)[0]
    comm = runs["llama"]["comm"]
    for row in comm["rows"]:
        assert row["ratio"] == pytest.approx(1.0, abs=1e-12), row
    assert not any("no 'expected' column" in n for n in comm["notes"]), comm["notes"]
    measured = T.measured_rows(comm)
    predicted = T.planner_rows("llama", "cp=2", runs["llama"]["global_batch"])
    layers, rows = 4, T.BATCH  # hf_llama: 4 blocks; BATCH rows of SEQ tokens per rank
    kv = 2 * (T.WIDTH // 4)
    for op in ("all_gather", "reduce_scatter"):
        assert measured[("cp", op)] == predicted[("cp", op)] == (
            2 * layers * rows * T.SEQ * kv * 4, 2 * layers), (op, measured, predicted)


def test_cp_under_bf16_gathers_keys_in_the_dtype_the_model_hands_attention():
    """Under bf16 (autocast over fp32 parameters) the tiny Llama's rotary embedding, computed
    in fp32, promotes its keys to fp32 and leaves its values bf16, while the test model's are
    both bf16: read off a forward pass on fake tensors before layout, the ledger's expected
    column is exact for both (every row, ratio 1), the Llama's K/V rows at 4 + 2 bytes a
    key-value pair of elements, the other's at 2 + 2. ``plait plan`` of the Llama's factory
    prices the same K/V bytes and calls as the ledger measures."""
    plan = "cp=2,mixed_precision=bf16"
    runs = run_distributed(T.ledger_rows, 2, plan, ["llama", "gqa"], timeout=300)[0]
    for name, e in (("llama", 3), ("gqa", 2)):
        comm = runs[name]["comm"]
        assert not any("no 'expected' column" in n for n in comm["notes"]), comm["notes"]
        for row in comm["rows"]:
            assert row["ratio"] == pytest.approx(1.0, abs=1e-12), (name, row)
        measured = T.measured_rows(comm)
        kv, layers = 2 * (T.WIDTH // 4), 4
        assert measured[("cp", "all_gather")] == (2 * layers * T.BATCH * T.SEQ * kv * e,
                                                  2 * layers), (name, measured)
    # plait plan prices the factory's K/V in the same dtypes (read off its forward pass)
    planned = _plan_cli_rows("tests._traffic_models:hf_llama", plan,
                             runs["llama"]["global_batch"])
    measured = T.measured_rows(runs["llama"]["comm"])
    for op in ("all_gather", "reduce_scatter"):
        assert planned[("cp", op)] == measured[("cp", op)], (op, planned, measured)


def _plan_cli_rows(factory: str, plan: str, global_batch: int
                   ) -> dict[tuple[str, str], tuple[float, float]]:
    """``plait plan --model <factory> --plan <plan> --format json``'s traffic as the ledger's
    rows show it: {(axis, op): (bytes, calls)} per step."""
    import contextlib
    import io
    import json

    from plait.planner.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--model", factory, "--cluster", "cpu", "--plan", plan, "--seq", str(T.SEQ),
              "--global-batch", str(global_batch), "--format", "json"])
    rows: dict[tuple[str, str], tuple[float, float]] = {}
    for t in json.loads(out.getvalue())["plans"][0]["traffic"]:
        b, c = rows.get((t["axis"], t["op"]), (0.0, 0.0))
        rows[(t["axis"], t["op"])] = (b + t["payload_bytes"], c + t["calls"])
    return rows


def test_cp_beside_tp_is_predicted_for_any_model_in_fp32():
    """The ledger's expected column under cp x tp for a model other than plait's transformer
    (the world-4 measurements are the slow cases ``cp=2,tp=2`` above): there in fp32, with
    the reason in its place under bf16 and beside a pipeline."""
    from plait.comm.predict import why_no_cp_expected

    with torch.device("meta"):
        stats = load_model(T.MODELS["llama"]())
    shape = (T.BATCH, T.SEQ)
    for plan in ("cp=2,tp=2", "cp=2,tp=2,sp=1", "dp=2,cp=2,tp=2"):
        assert why_no_cp_expected(Plan.from_string(plan), stats, shape) is None, plan
    bf16 = why_no_cp_expected(Plan.from_string("cp=2,tp=2,mixed_precision=bf16"), stats, shape)
    assert bf16 is not None and "mixed_precision=bf16" in bf16 and "tp=2" in bf16
    pp = why_no_cp_expected(Plan.from_string("cp=2,pp=2,microbatches=2"), stats, shape)
    assert pp is not None and "pp=2" in pp


def test_tied_weight_beside_data_parallelism_and_a_pipeline():
    """The two stages holding a tied weight sum its gradient's local piece each step: the
    whole copy under DDP and ZeRO-1, FSDP2's shard of it under ZeRO-2/3 (dim 0 cut as
    torch.chunk cuts it, the first piece the largest: 33 rows in 2 are 17 and 16). The copy is
    one more parameter tensor on the last stage (ZeRO-1 broadcasts it, the optimizer steps it)
    but not in the clip norm (counted on the first stage)."""
    import dataclasses

    from plait.comm.predict import pp_rank_traffic
    from plait.planner.pipeline import stage_sizes
    from plait.planner.traffic import rank_shares

    with torch.device("meta"):
        model = T.MODELS["tied"]()
    stats = load_model(model)
    weight = model.embed.weight
    last_stage = [*model.blocks[len(model.blocks) // 2:], model.norm, model.head]
    last_tensors = sum(len(list(m.parameters())) for m in last_stage)  # head.weight: the copy
    for plan_text, piece in [("dp=2,pp=2,microbatches=2", weight.numel()),
                             ("dp_shard=2,zero=1,pp=2,microbatches=2", weight.numel()),
                             ("dp_shard=2,zero=2,pp=2,microbatches=2",
                              torch.chunk(weight, 2)[0].numel()),
                             ("dp_shard=2,zero=3,pp=2,microbatches=2",
                              torch.chunk(weight, 2)[0].numel()),
                             ("dp_shard=2,zero=2,pp=2,tp=2,microbatches=2",
                              torch.chunk(torch.chunk(weight, 2)[0], 2)[0].numel())]:
        plan = Plan.from_string(plan_text)
        sizes = stage_sizes(plan, stats, None, balance=False)
        first, last = rank_shares(plan, stats, sizes, [range(0, 1), range(1, 2)])
        assert first.tied == last.tied == piece, plan_text
        tied = [t for t in pp_rank_traffic(plan, last, 1, T.SEQ, T.WIDTH)
                if t.what == "tied weight grads"]
        assert [(t.payload, t.calls) for t in tied] == [(piece * 4, 1)], plan_text
        assert last.tensors == last_tensors and last.clip_tensors == last_tensors - 1
    odd = dataclasses.replace(stats, tied_params=33 * T.WIDTH, tied_shapes=((33, T.WIDTH),))
    plan = Plan.from_string("dp_shard=2,zero=2,pp=2,microbatches=2")
    shares = rank_shares(plan, odd, [2, 2], [range(0, 1), range(1, 2)])
    assert shares[1].tied == torch.chunk(torch.empty(33, T.WIDTH, device="meta"), 2)[0].numel()


def test_busiest_rank_of_each_row_beside_a_pipeline():
    """A ledger row shows its busiest rank, which need not be the one the planner times as
    busiest: under DDP beside a pipeline GPT-2's first stage (the token and position
    embeddings) all-reduces more gradient bytes than its last (the final norm and the tied
    head's copy). The comparison takes each row's largest pipeline rank, as the ledger does."""
    from plait.planner import constants_for
    from plait.planner.cost import Workload, evaluate, rank_traffic
    from plait.planner.hardware import load_cluster

    text = "dp=2,pp=2,microbatches=2"
    plan = Plan.from_string(text)
    stats = _stats("gpt2")
    batch = 2 * T.BATCH
    cluster = load_cluster("cpu", devices=plan.world_size)
    est = evaluate(plan, stats, cluster, Workload(batch, T.SEQ), constants_for(cluster))
    grads = [sum(t.payload for t in traffic if t.axis == "dp_replicate")
             for traffic in rank_traffic(plan, stats, batch, T.SEQ)]
    assert grads[0] > grads[1] and est.busiest_rank == 1
    assert T.busiest_rows(stats, text, batch)[("dp_replicate", "all_reduce")] == (grads[0], 1)


def _stats(name: str):
    with torch.device("meta"):
        return load_model(T.MODELS[name]())


def test_block_collectives_follow_the_layer_plan():
    """An MLP-only block: one region, 2 all-reduces (not the reference block's 4); LoRA layers
    add their rank's all-reduces; GPT-2's fused q|k|v bias its gradient's all-gather."""
    one = (T.WIDTH,)
    for name in ("mlp", "attention"):  # LayerNorm weight and bias: summed under SP
        assert _stats(name).tp_block == TPBlock(forward=one, backward=one, sp_norms=one * 2,
                                                sp_in_blocks=True)
    lora = _stats("lora").tp_block  # frozen embedding: the stack's input needs no gradient
    assert lora is not None and (lora.forward, lora.backward) == ((T.WIDTH, 2), (T.WIDTH, 2))
    assert not lora.input_grad
    gpt2 = _stats("gpt2").tp_block
    assert gpt2 is not None and gpt2.bias_gathers == (3 * T.WIDTH,)
    assert gpt2.sp_norms == (T.WIDTH,) * 4  # two LayerNorms: weight and bias, one call each
    traffic = {t.op: (t.payload, t.calls)
               for t in tp_block_traffic(2, 8, 16, 2, "fp32", False,
                                         block=_stats("mlp").tp_block)}
    assert traffic == {"all_reduce": (2 * 2 * 8 * 16 * 4, 2)}


def _grad_flow_by_hand(model: torch.nn.Module, regions: list[str], rows: list[str]
                       ) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """One real forward (CPU, the model's own tensors): whether each region's input and each
    row-parallel layer's output requires grad, as autograd will see them."""
    seen: dict[str, bool] = {}

    def into(name: str) -> Any:
        def hook(_m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            seen.setdefault(name, any(t.requires_grad for t in tensors))
        return hook

    def out_of(name: str) -> Any:
        def hook(_m: torch.nn.Module, _args: tuple, out: torch.Tensor) -> None:
            seen.setdefault(name, out.requires_grad)
        return hook

    hooks = [model.get_submodule(n).register_forward_pre_hook(into(n), with_kwargs=True)
             for n in regions]
    hooks += [model.get_submodule(n).register_forward_hook(out_of(n)) for n in rows]
    model(torch.zeros((1, T.SEQ), dtype=torch.long))
    for h in hooks:
        h.remove()
    return tuple(seen[n] for n in regions), tuple(seen[n] for n in rows)


def test_each_block_prices_its_own_gradients():
    """Blocks that differ in what trains, each priced as itself rather than as the first block
    that trains: a layer whose two RMSNorms are frozen sums no norm gradient over tp under SP
    (the others two each); in a layer whose attention and the norm before it are frozen,
    behind a frozen embedding and a frozen first layer, the backward pass enters the MLP only
    (no gradient of attention's input reduced, none of its output gathered). What a block
    issues is checked against the model's own parameters and a real forward's
    ``requires_grad``; the ledger measures the same (``test_planner_prices_what_the_ledger
    _measures``)."""
    from plait.comm.predict import tp_rank_traffic
    from plait.planner.traffic import rank_shares

    plan = Plan.from_string("tp=2,sp=1")
    for name in ("llama_mid_norms", "llama_frozen_attention"):
        model = T.MODELS[name]()
        layers = model.hf.model.layers
        stats = _stats(name)
        assert stats.tp_blocks is not None and len(stats.tp_blocks) == len(layers)
        paths = [f"hf.model.layers.{i}" for i in range(len(layers))]
        calls = 0
        for path, layer, block in zip(paths, layers, stats.tp_blocks, strict=True):
            norms = tuple(p.numel() for m in (layer.input_layernorm,
                                              layer.post_attention_layernorm)
                          for p in m.parameters() if p.requires_grad)
            assert block.sp_norms == norms, (name, path)
            calls += len(norms)
            into, out = _grad_flow_by_hand(model, [f"{path}.self_attn", f"{path}.mlp"],
                                           [f"{path}.self_attn.o_proj", f"{path}.mlp.down_proj"])
            assert (block.bwd_grad, block.fwd_grad) == (into, out), (name, path)
        (share,) = rank_shares(plan, stats, [len(layers)], [range(1)])
        traffic = tp_rank_traffic(plan, share, 1, T.SEQ, T.WIDTH, block=stats.tp_block)
        norm_calls = sum(t.calls for t in traffic if t.what == "norm weight grads")
        assert norm_calls == calls, name
    # the frozen attention: one region's input and one row-parallel output without a gradient
    flow = _stats("llama_frozen_attention").tp_blocks
    assert flow is not None and (flow[1].bwd_grad, flow[1].fwd_grad) == ((False, True),) * 2
    # blocks that all train whole are priced as one
    assert _stats("llama").tp_blocks is None


def test_root_parameter_is_summed_over_the_stages():
    """A parameter of the root module (``ScaledLM.scale``): every pipeline stage holds it, each
    sums its gradient with the others' (one flag and one gradient all-reduce over pp, like a
    tied weight), the ranks without the last stage hold it beside their blocks, and the clip
    norm counts it once, on the first stage. Under ZeRO-2 each rank sums its dp_shard piece."""
    from plait.comm.predict import pp_rank_traffic
    from plait.planner.traffic import rank_shares

    model = T.MODELS["scaled"]()
    stats = _stats("scaled")
    assert stats.shared_shapes == (tuple(model.scale.shape),)
    width = model.scale.numel()
    for plan, piece in (("pp=2,microbatches=2", width),
                        ("dp_shard=2,zero=2,pp=2,microbatches=2", width // 2)):
        p = Plan.from_string(plan)
        first, last = rank_shares(p, stats, [2, 2], [range(0, 1), range(1, 2)])
        for share in (first, last):
            assert (share.tied, share.tied_tensors) == (piece, 1), plan
            sums = {t.what: (t.payload, t.calls) for t in pp_rank_traffic(p, share, 1, T.SEQ,
                                                                          T.WIDTH)}
            assert sums["tied weight grads"] == (piece * 4, 1), plan
            assert sums["tied weight used flags"] == (4, 1), plan
        # held on both ranks: the first holds its embedding, blocks and the scale
        own = sum(p.numel() for p in (*model.embed.parameters(),
                                      *(q for b in model.blocks[:2] for q in b.parameters()),
                                      model.scale))
        if p.zero < 2:
            assert first.params == own and first.grads == own
            assert first.clip_tensors == len(list(model.embed.parameters())) + 1 + sum(
                len(list(b.parameters())) for b in model.blocks[:2])
            assert last.clip_tensors == last.tensors - 1


def test_tied_weight_and_frozen_parameters():
    """A head tied to the embedding: under pipelines its copy on the last stage is held there
    and its gradient summed with the first stage's. LoRA: data parallelism reduces only the
    trainable parameters (the low-rank paths, norms, head), and tensor parallelism keeps the
    norms, row-parallel biases and the whole halves of the low-rank paths whole."""
    assert _stats("tied").tied_params == T.VOCAB * T.WIDTH
    assert _stats("lora").tied_params == 0
    block, embed, _ = _stats("lora").held
    assert embed.grads(2) == 0 and embed.local(2) == T.VOCAB * T.WIDTH / 2
    rank = 2
    assert block.grads(2) == (2 * rank * 4 * T.WIDTH) / 2 + 2 * T.WIDTH + 2 * rank * T.WIDTH


def test_no_attention_no_replicated_kv():
    """A block without attention reports one head and one kv head (nothing to count): at tp=2
    that must not price k/v weights kept whole on every rank."""
    stats = _stats("mlp")
    assert not stats.attention and stats.kv_whole(2) == 0
    assert _stats("mqa").kv_whole(2) > 0  # one kv head of 4 query heads: whole at tp=2


def test_kv_heads_from_a_transformers_config():
    """transformers' Llama attention keeps its kv-head count in its config only: 2 kv heads
    of 4 (whole on every rank at tp=4), not 4."""
    stats = _stats("llama")
    assert (stats.n_heads, stats.kv_heads) == (4, 2)
    assert stats.kv_whole(4) > 0 and stats.kv_whole(2) == 0



def test_traced_forward_reads_dtypes_and_replays():
    """The traced forward pass (fake tensors, no compute): under bf16 autocast a row-parallel
    layer's output is bf16 and a column-parallel layer's input keeps the dtype the model's code
    leaves it in (a LayerNorm's output on the fp32 residual stream: fp32; a LoRA B reading A's
    output: bf16); with FSDP2's bf16 parameters everything is bf16. A checkpoint replay issues a
    forward collective again only where the block saves a tensor after it: not the MLP block's
    last projection, both of LoRA's (B saves A's output), GPT-2's (a dropout mask after each)."""
    mlp, lora, gpt2 = (_stats(n).tp_block.trace for n in ("mlp", "lora", "gpt2"))
    assert (mlp.bf16.forward, mlp.bf16.backward, mlp.bf16.stack_out) == ((2,), (4,), 4)
    assert (lora.bf16.forward, lora.bf16.backward, lora.bf16.grads) == ((2, 2), (4, 2), 4)
    assert (lora.bf16_params.backward, lora.bf16_params.grads) == ((2, 2), 2)
    assert (mlp.replayed, lora.replayed, gpt2.replayed) == ((False,), (True, True),
                                                            (True, True))
    with torch.device("meta"):  # autocast rules torch cannot run here: no trace
        assert from_module(T.MODELS["mlp"](), device_type="xla").tp_block.trace is None
    # what tp_block_traffic makes of it: bf16 all-reduces 2 bytes forward, 4/2 backward
    block = _stats("lora").tp_block
    got = {t.what: (t.payload, t.calls) for t in tp_block_traffic(
        1, 8, T.WIDTH, 2, "bf16", False, recomputed=1.0, block=block)}
    tokens = 8
    assert got["activations"] == (tokens * (T.WIDTH * 2 + 2 * 2 + T.WIDTH * 4 + 2 * 2), 4)
    assert got["checkpoint replay"] == (tokens * (T.WIDTH * 2 + 2 * 2), 2)


def test_no_expected_column_says_why():
    """Where the ledger shows no expected column for a model of the user's, its note names the
    reason: no stack of blocks, an input that is neither token ids nor feature vectors fed
    through plain layers, a layer plan given by hand, op-level checkpointing under tp, or
    bf16 / checkpointing on a model the traced forward cannot run (this one takes feature
    vectors, not token ids)."""
    from plait.comm.predict import why_no_expected
    from tests._workers_semantics import pre_norm_net

    plan = Plan.from_string
    mlp = _stats("mlp")
    assert why_no_expected(plan("tp=2"), mlp, (4, 8)) is None
    assert why_no_expected(plan("tp=2,mixed_precision=bf16,activation_checkpointing=full"),
                           mlp, (4, 8)) is None
    assert "stack of repeated blocks" in why_no_expected(plan("tp=2"), None, (4, 8))
    assert "(4, 8, 3)" in why_no_expected(plan("tp=2"), mlp, (4, 8, 3), tokens=False)
    assert "(4,)" in why_no_expected(plan("tp=2"), mlp, (4,))
    by_hand = Plan.from_string("tp=2").replace(options=Plan.from_string("tp=2").options.replace(
        tp_plan={"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}))
    assert "options.tp_plan" in why_no_expected(by_hand, mlp, (4, 8))
    assert "selective-checkpoint policy" in why_no_expected(
        plan("tp=2,activation_checkpointing=op"), mlp, (4, 8))
    with torch.device("meta"):
        features = load_model(pre_norm_net())
    assert features.tp_block is not None and features.tp_block.trace is None
    # feature vectors through plain layers (no vocabulary ends): a token per row, not under SP
    assert features.tp_block.vocab_ends == (False, False)
    assert why_no_expected(plan("tp=2"), features, (4, 8), tokens=False) is None
    assert "sequence parallelism" in why_no_expected(plan("tp=2,sp=1"), features, (4, 8),
                                                     tokens=False)
    assert "mixed_precision=bf16" in why_no_expected(plan("tp=2,mixed_precision=bf16"),
                                                     features, (4, 8))
    assert "activation_checkpointing=full" in why_no_expected(
        plan("tp=2,activation_checkpointing=full"), features, (4, 8))
    assert why_no_expected(plan("pp=2,activation_checkpointing=full"), features, (4, 8)) is None


def test_frozen_parameters_are_gathered_never_reduced():
    """Each pipeline rank's share, counted off the model by hand: FSDP2 gathers every
    parameter of a unit (frozen ones too) but reduce-scatters only those that train, and a unit
    with none (a frozen block, a root holding only a frozen embedding) not at all; clipping
    takes one norm per trainable tensor. The blocks need not train alike (LoRA with a frozen
    first block, a frozen first stage), so nothing is a mean over the blocks."""
    from plait.planner.pipeline import stage_sizes
    from plait.planner.traffic import rank_shares

    for name in ("lora_block", "frozen_stage", "lora"):
        with torch.device("meta"):
            model = T.MODELS[name]()
        stats = load_model(model)
        stack = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
        inside = {id(p) for p in stack.parameters()}
        outside = [p for p in model.parameters() if id(p) not in inside]
        embeds = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding)
                  for p in m.parameters()}
        for zero in (2, 3):
            plan = Plan.from_string(f"dp_shard=2,zero={zero},pp=2,microbatches=2")
            sizes = stage_sizes(plan, stats, None, balance=False)
            shares = rank_shares(plan, stats, sizes, [range(0, 1), range(1, 2)])
            for stage, share in enumerate(shares):
                blocks = list(stack)[sum(sizes[:stage]):sum(sizes[:stage + 1])]
                root = [p for p in outside if (id(p) in embeds) == (stage == 0)]
                units = [list(b.parameters()) for b in blocks] + [root]
                held = [p for unit in units for p in unit]

                def padded(ps):
                    return sum(torch.chunk(p, 2)[0].numel() * 2 for p in ps)

                assert share.params == padded(held), (name, zero, stage)
                assert share.grads == padded(p for p in held if p.requires_grad), (name, stage)
                assert share.clip_tensors == sum(p.requires_grad for p in held), (name, stage)
                assert share.reducing_units == sum(any(p.requires_grad for p in u)
                                                   for u in units), (name, stage)
    frozen = rank_shares(Plan.from_string("dp_shard=2,zero=2,pp=2,microbatches=2"),
                         _stats("frozen_stage"), [2, 2], [range(0, 1), range(1, 2)])[0]
    assert frozen.grads == frozen.reducing_units == frozen.clip_tensors == 0


def test_a_frozen_tied_embedding_beside_a_pipeline():
    """A head tied to a frozen embedding: the last stage holds a copy, gathered (and broadcast
    by ZeRO-1, whose optimizer holds it) but never reduced, summed across stages or clipped."""
    from plait.comm.predict import pp_rank_traffic
    from plait.planner.traffic import rank_shares

    stats = _stats("frozen_tied")
    weight = T.VOCAB * T.WIDTH
    assert stats.tied_params == 0 and stats.frozen_tied_shapes == ((T.VOCAB, T.WIDTH),)
    trained = _stats("tied")
    for text in ("dp=2,pp=2,microbatches=2", "dp_shard=2,zero=2,pp=2,microbatches=2"):
        plan = Plan.from_string(text)
        frozen_last = rank_shares(plan, stats, [2, 2], [range(0, 1), range(1, 2)])[1]
        trained_last = rank_shares(plan, trained, [2, 2], [range(0, 1), range(1, 2)])[1]
        assert frozen_last.params == trained_last.params  # the copy is held either way
        assert frozen_last.tensors == trained_last.tensors
        assert frozen_last.grads == trained_last.grads - weight
        assert frozen_last.clip_tensors == trained_last.clip_tensors
        assert frozen_last.tied == 0
        assert not any(t.what == "tied weight grads"
                       for t in pp_rank_traffic(plan, frozen_last, 1, T.SEQ, T.WIDTH))


def test_zero_prices_the_rows_fsdp2_pads():
    """FSDP2 cuts each parameter's dim 0 with torch.chunk and pads every shard to the first:
    under ZeRO-2/3 the planner's gathers, reduce-scatters and memory per rank count
    ``torch.chunk(p, dp_shard)[0]`` times dp_shard for every parameter (51 rows as 52, 7 as 8),
    under ZeRO-1 (ZeroRedundancyOptimizer's broadcasts of whole parameters) the elements."""
    from plait.comm.volumes import fsdp_padded_numel
    from plait.planner.traffic import rank_shares

    with torch.device("meta"):
        model = T.MODELS["odd"]()
    stats = load_model(model)
    elements = sum(p.numel() for p in model.parameters())
    for shards in (2, 3, 4, 8):
        padded = sum(torch.chunk(p, shards)[0].numel() * shards for p in model.parameters())
        assert padded == sum(fsdp_padded_numel(tuple(p.shape), shards)
                             for p in model.parameters())
        assert padded > elements, shards
        for zero in (2, 3):
            plan = Plan.from_string(f"dp_shard={shards},zero={zero}")
            (share,) = rank_shares(plan, stats, [len(model.blocks)], [range(1)])
            assert share.params == share.grads == padded, (shards, zero)
            outside = [model.embed, model.norm, model.head]
            assert share.root_params == sum(torch.chunk(p, shards)[0].numel() * shards
                                            for m in outside for p in m.parameters())
        plan = Plan.from_string(f"dp_shard={shards},zero=1")
        (share,) = rank_shares(plan, stats, [len(model.blocks)], [range(1)])
        assert share.params == elements


def test_zero_memory_holds_fsdp2s_padded_shard():
    """The planner's parameters, gradients and optimizer state per rank under ZeRO-3 are
    FSDP2's padded shard (the first chunk, the largest, on rank 0), not elements / dp_shard,
    and the blocks it gathers are at their padded rows."""
    from plait.planner import constants_for
    from plait.planner.cost import Workload, evaluate
    from plait.planner.hardware import load_cluster

    with torch.device("meta"):
        model = T.MODELS["odd"]()
    stats = load_model(model)
    plan = Plan.from_string("dp_shard=4,zero=3")
    cluster = load_cluster("cpu", devices=4)
    est = evaluate(plan, stats, cluster, Workload(8, T.SEQ), constants_for(cluster))
    shard = sum(torch.chunk(p, 4)[0].numel() for p in model.parameters())
    assert est.memory_breakdown["params"] == 4 * shard
    assert est.memory_breakdown["grads"] == 4 * shard
    assert est.memory_breakdown["optimizer"] == 8 * shard
    # ZeRO-3's two gathered blocks (fp32 parameters and their gradients), at the padded rows
    block = sum(torch.chunk(p, 4)[0].numel() * 4 for p in model.blocks[0].parameters())
    assert est.memory_breakdown["compute_copy"] == 2 * 2 * block * 4



def _grad_flow_into(model: torch.nn.Module, block: torch.nn.Module) -> bool:
    """Whether ``block``'s input requires grad in one real forward of ``model``."""
    seen: list[bool] = []

    def hook(_m: torch.nn.Module, args: tuple) -> None:
        seen.append(args[0].requires_grad)

    handle = block.register_forward_pre_hook(hook)
    model(torch.zeros((1, T.SEQ), dtype=torch.long))
    handle.remove()
    return seen[0]


def test_backward_reaches_the_blocks_after_the_first_that_trains():
    """The blocks a gradient flows through, counted off each model by hand: from the first
    block that trains on, or all of them where something before the first block trains (the
    embedding, a gain on its output); under ZeRO-3 FSDP2
    gathers again each block whose own pre-backward hook or the next unit's fires (the root's
    always), so of k leading frozen blocks k - 1 are gathered in forward alone."""
    from plait.comm.predict import LocalModel, dp_traffic
    from plait.comm.reach import reached, regathered
    from plait.planner.traffic import rank_shares

    assert reached(False, [False, False, True, False]) == (False, False, True, True)
    assert reached(True, [False, False]) == (True, True)
    assert regathered((False, False, False, True)) == (False, False, True, True)
    for name, frozen in (("frozen_lead", 3), ("frozen_stage", 2), ("llama_frozen", 2),
                         ("lora_block", 1), ("mlp", 0), ("lora", 0), ("gain_lead", 0)):
        with torch.device("meta"):
            model = T.MODELS[name]()
        stats = load_model(model)
        stack = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
        n = len(stack)
        # whether the first block's input needs a gradient: one real forward shows it
        real = T.MODELS[name]()
        first = next(m for m in real.modules() if isinstance(m, torch.nn.ModuleList))[0]
        into = _grad_flow_into(real, first)
        by_hand = 0 if into else sum(not any(p.requires_grad for b in list(stack)[:i + 1]
                                               for p in b.parameters()) for i in range(n))
        assert by_hand == frozen, name
        assert stats.rows.reached == (False,) * frozen + (True,) * (n - frozen), name
        plan = Plan.from_string("dp_shard=2,zero=3")
        (share,) = rank_shares(plan, stats, [n], [range(1)])
        assert share.layers_reached == n - frozen
        assert share.layers_regathered == n - max(frozen - 1, 0)
        gathers = next(t for t in dp_traffic(plan, share) if t.op == "all_gather")
        everything = dataclasses.replace(share, regathered_layers=None)
        every = next(t for t in dp_traffic(plan, everything) if t.op == "all_gather")
        block = (share.params - share.root_params) / n
        assert every.calls - gathers.calls == max(frozen - 1, 0)
        assert every.payload - gathers.payload == pytest.approx(
            max(frozen - 1, 0) * block * 4, abs=1e-6)
    # the closed form for plait's reference transformer reads no frozen blocks: all reached
    assert LocalModel(params=1.0, root_params=0.0, tensors=1, layers=3).layers_regathered == 3


def _priced_from_config(name: str, plan: str, comm: dict, global_batch: int) -> None:
    """The planner's rows for a model priced from its config alone (a transformers config.json,
    a preset) equal the ledger's for the model built from it, bytes and calls."""
    for row in comm["rows"]:
        assert row["ratio"] == pytest.approx(1.0, abs=1e-12), (name, row)
    measured = T.measured_rows(comm)
    predicted = T.config_rows(name, plan, global_batch)
    assert set(measured) == set(predicted), (name, sorted(measured), sorted(predicted))
    for key, (nbytes, calls) in measured.items():
        assert predicted[key] == (pytest.approx(nbytes, rel=1e-9), pytest.approx(calls)), \
            (name, key, measured, predicted)


# Models priced from their config: a default case (Qwen3's q/k norms summed over tp in every
# backward, Mixtral's router and experts whole on each tp rank: only attention's all-reduces);
# the slow ones add what ZeRO x tp reduces whole (NeoX's LayerNorm biases, q/k norms, experts),
# FSDP2's padded rows, and a tied head beside a pipeline (its gradient summed across stages).
CONFIG_CASES = [("tp=2", ["hf_qwen3", "hf_mixtral"])]
SLOW_CONFIG_CASES = [
    ("tp=2", ["hf_neox", "hf_qwen2_moe", "preset_ln_tied"]),
    ("dp_shard=2,zero=3,tp=2", ["hf_neox", "hf_qwen3", "hf_mixtral", "hf_qwen2_moe"]),
    ("dp_shard=2,zero=2", ["hf_neox", "hf_qwen3", "hf_qwen2_moe"]),
    ("tp=2,sp=1", ["preset_ln_tied", "hf_llama_tied"]),
    ("pp=2,microbatches=2", ["hf_llama_tied", "preset_tied", "preset_ln_tied"]),
    ("dp_shard=2,zero=1,pp=2,microbatches=2", ["hf_llama_tied", "preset_tied"]),
    ("pp=2,tp=2,microbatches=2", ["hf_llama_tied", "hf_qwen3"]),
]


@pytest.mark.parametrize("plan,models", CONFIG_CASES + [
    pytest.param(*case, marks=pytest.mark.slow) for case in SLOW_CONFIG_CASES],
    ids=[c[0] for c in CONFIG_CASES] + [f"{c[0]}-slow" for c in SLOW_CONFIG_CASES])
def test_a_config_priced_model_matches_what_the_ledger_measures(plan, models):
    world = Plan.from_string(plan).world_size
    runs = run_distributed(T.ledger_rows, world, plan, models, timeout=300)[0]
    for name in models:
        _priced_from_config(name, plan, runs[name]["comm"], runs[name]["global_batch"])
