"""Bytes and collective times (plait.planner.traffic): the planner's traffic is the comm ledger's
prediction of what plait's runtime sends (plait.comm.predict), priced per op."""

import pytest

from plait.models.transformer import PRESETS
from plait.plan import Plan
from plait.planner.cost import Constants, Workload, evaluate
from plait.planner.hardware import load_cluster
from plait.planner.model_stats import load_model


def _tiny():
    return load_model("test")


LAYOUTS = [
    dict(dp_replicate=4),
    dict(dp_shard=4, zero=1),
    dict(dp_shard=2, zero=2, grad_accum=2),
    dict(dp_replicate=2, dp_shard=2, zero=3),
    dict(dp_replicate=2, tp=2),
    dict(dp_shard=2, tp=2, sp=True, zero=3, activation_checkpointing="full"),
    dict(pp=2, dp_shard=2, zero=3, microbatches=4, pp_stage_layers=[2, 2]),
    dict(pp=2, tp=2, sp=True, pp_schedule="interleaved_1f1b", virtual_stages=2,
         microbatches=4, pp_stage_layers=[1, 1, 1, 1]),
    dict(pp=2, dp_replicate=2, microbatches=2, grad_accum=2, pp_stage_layers=[2, 2]),
    # context parallelism (grouped-query attention: 2 kv heads of 4): K/V on cp, gradients
    # over dp x cp, tp's collectives on each rank's s/cp tokens
    dict(cp=2),
    dict(dp_replicate=2, cp=2),
    dict(dp_shard=2, zero=3, cp=2),
    dict(dp_replicate=2, dp_shard=2, zero=3, cp=2),
    dict(cp=2, activation_checkpointing="full", grad_accum=2),
    dict(cp=2, tp=2),
    dict(cp=2, tp=2, sp=True),
    # cp with a pipeline (each stage gathers K/V per microbatch, sends s/cp tokens), with tp
    # under ZeRO-2/3 (FSDP2 over dp_shard x cp, the clip norm over dp_shard x cp x tp) and
    # with ZeRO-1 (DDP over dp x cp, the optimizer state over dp_shard x cp)
    dict(cp=2, pp=2, microbatches=2, pp_stage_layers=[2, 2]),
    dict(cp=2, pp=2, microbatches=2, grad_accum=2, pp_stage_layers=[2, 2]),
    dict(dp_shard=2, zero=3, cp=2, pp=2, microbatches=4, pp_stage_layers=[2, 2]),
    dict(dp_replicate=2, cp=2, pp=2, tp=2, sp=True, microbatches=2, pp_stage_layers=[2, 2]),
    dict(cp=2, pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2, microbatches=4,
         pp_stage_layers=[1, 1, 1, 1]),
    dict(cp=2, pp=2, pp_schedule="gpipe", microbatches=2, activation_checkpointing="full",
         pp_stage_layers=[2, 2]),
    dict(cp=2, tp=2, zero=3),
    dict(dp_shard=2, cp=2, tp=2, zero=3),
    dict(dp_shard=2, cp=2, tp=2, sp=True, zero=2, grad_accum=2),
    dict(dp_replicate=2, dp_shard=2, cp=2, tp=2, zero=3),
    dict(cp=2, zero=1),
    dict(dp_shard=2, cp=2, zero=1),
    dict(dp_replicate=2, cp=2, zero=1),
    dict(dp_shard=2, cp=2, zero=1, grad_accum=2),
    dict(dp_shard=2, cp=2, pp=2, zero=1, microbatches=2, pp_stage_layers=[2, 2]),
    # zero-bubble with data replicas: at zero=0/1 the used flags and the gradients averaged
    # once per step after the schedule (whatever grad_accum), ZeRO-1's broadcasts; at ZeRO-2
    # FSDP2's gathers and reduce-scatters once per schedule
    dict(dp_replicate=2, pp=2, pp_schedule="zbv", virtual_stages=2, microbatches=2,
         pp_stage_layers=[1, 1, 1, 1]),
    dict(dp_shard=2, zero=1, pp=2, pp_schedule="zbv", virtual_stages=2, microbatches=4,
         grad_accum=2, pp_stage_layers=[1, 1, 1, 1]),
    dict(dp_replicate=2, cp=2, pp=2, pp_schedule="interleaved_zb", virtual_stages=2,
         microbatches=2, pp_stage_layers=[1, 1, 1, 1]),
    dict(dp_shard=2, zero=2, pp=2, pp_schedule="zbv", virtual_stages=2, microbatches=2,
         grad_accum=2, pp_stage_layers=[1, 1, 1, 1]),
    dict(dp_shard=2, zero=3, pp=2, pp_schedule="zbv", virtual_stages=2, microbatches=4,
         pp_stage_layers=[1, 1, 1, 1]),
    # ZeRO-3 under interleaved 1F1B, and with four stages per rank (torch's runtime evicts
    # stages and gathers them again): the ledger's per-stage counts
    dict(dp_shard=2, zero=3, pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2,
         microbatches=4, pp_stage_layers=[1, 1, 1, 1]),
    dict(dp_shard=2, zero=3, pp=2, pp_schedule="interleaved_zb", virtual_stages=4,
         microbatches=4, n_layers=8),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in
                                                                  d.items()))
def test_planner_prices_the_bytes_the_ledger_predicts(layout):
    """The planner's traffic for its busiest rank is the comm ledger's prediction for that rank
    (plait.comm.predict, which tests/test_comm_ledger.py holds to the measured bytes): one set of
    rules for DP, TP, PP and clipping, per (axis, op)."""
    from plait.comm.predict import by_axis_op, predict
    from plait.models.transformer import TransformerConfig
    from plait.planner.model_stats import from_transformer_config

    layers = layout.pop("pp_stage_layers", None)
    n_layers = layout.pop("n_layers", 4)
    plan = Plan(**layout, **({"options": {"pp_stage_layers": layers}} if layers else {}))
    cfg = TransformerConfig(vocab_size=256, dim=32, n_layers=n_layers, n_heads=4,
                            max_seq_len=16,
                            n_kv_heads=2 if plan.cp > 1 else None)
    B, s = 8 * plan.dp * plan.grad_accum, 16
    est = evaluate(plan, from_transformer_config(cfg), load_cluster("cpu", devices=
                   plan.world_size).with_memory(1e12), Workload(B, s))
    assert est.feasible, est.reason
    want = predict(plan, cfg, B // plan.dp // plan.grad_accum, s, stage=est.busiest_rank)
    # the config-only prediction does not count parameter tensors (a model's does): the
    # per-tensor clip norms (and a zero-bubble schedule's used flags, one per tensor) are the
    # same call with a zero payload there
    per_tensor = ("clip: per-tensor norms", "gradient used flags")
    got = by_axis_op([t for t in est.traffic if t.what not in per_tensor])
    want = by_axis_op([t for t in want if t.what not in per_tensor])
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key


@pytest.mark.parametrize("plan_text", ["pp=2,microbatches=2", "dp_shard=2,zero=3"])
def test_planner_rank_shares_are_what_the_runtime_lays_out(plan_text):
    """The planner's share of each pipeline rank (parameters, root, blocks, tensors, clip
    axes, embedding / head) is what plait's runtime holds on that rank once it parallelized the
    reference model (read as the ledger reads it), on real processes."""
    from plait.planner.pipeline import stage_sizes
    from plait.planner.traffic import rank_shares
    from plait.spawn import run_distributed
    from tests import _workers_planner as W

    plan = Plan.from_string(plan_text)
    m = load_model("tiny")
    sizes = stage_sizes(plan, m, None, balance=False)  # the runtime's default split
    chunks = [range(r, len(sizes), plan.pp) for r in range(plan.pp)]
    ours = rank_shares(plan, m, sizes, chunks)
    for got in run_distributed(W.local_share, plan.world_size, plan_text, "tiny", timeout=240):
        want = ours[got["pp_rank"]]
        assert got["params"] == pytest.approx(want.params, rel=1e-9)
        assert got["root_params"] == pytest.approx(want.root_params, rel=1e-9)
        assert (got["layers"], got["tensors"], got["embed"], got["head"]) == \
            (want.layers, want.tensors, want.embed, want.head)
        assert tuple(got["clip_axes"]) == want.clip_axes


def test_collective_time_per_op_factor_and_call_cost():
    from plait.comm.volumes import Traffic
    from plait.planner.hardware import Cluster
    from plait.planner.traffic import collective_time

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
    from plait.comm.predict import tp_block_traffic, tp_end_traffic

    act = 2 * 8 * 16 * 4  # b s h fp32
    sp = {(t.op, t.what): (t.payload, t.calls) for t in tp_block_traffic(2, 8, 16, 2, "fp32", True)}
    assert sp[("all_gather", "activations")] == (4 * act, 4)
    assert sp[("reduce_scatter", "activations")] == (4 * act, 4)
    assert sp[("all_reduce", "norm weight grads")] == (2 * 16 * 4, 2)
    full = tp_block_traffic(2, 8, 16, 2, "fp32", False, recomputed=1.0)
    assert sum(t.calls for t in full) == 5 and sum(t.payload for t in full) == 5 * act
    ends = tp_end_traffic(2, 8, 16, 2, "fp32", True, embed=True, head=True)
    calls = {(t.op, t.what): t.calls for t in ends}
    ends_what = "embedding output + head input grad"
    assert calls[("all_gather", ends_what)] == 2 and calls[("reduce_scatter", ends_what)] == 2
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


def test_pipeline_clip_norm_all_reduce_is_priced_as_the_ledger_predicts_it():
    # With pp > 1 each stage holds only its gradients, so clipping all-reduces the squared norm
    # (one fp32) over pp every optimizer step (plait.train.clip_grad_norm): blocking, priced
    # once per step, and the same Traffic the comm ledger predicts (plait.comm.predict).
    from plait.comm.predict import predict
    from plait.comm.volumes import Traffic
    from plait.planner.traffic import collective_time

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


def test_a_group_across_nodes_moves_its_bytes_over_every_nic_it_holds_in_a_node():
    """DGX A100: 8 GPUs per node, one 25 GB/s NIC each, NVLink 300 GB/s. A group of several
    ranks per node crosses each node boundary over as many NICs (NCCL spreads its ring channels
    over the node's NICs); one rank per node keeps one NIC; inside a node, NVLink."""
    from plait.planner.traffic import tier

    a100 = load_cluster("dgx-a100-80gb", devices=64)
    assert tier(a100, 8, 1)[0] == a100.intra_bw                  # one node
    assert tier(a100, 64, 1)[0] == 8 * a100.inter_bw             # FSDP over 8 whole nodes
    assert tier(a100, 32, 2)[0] == 4 * a100.inter_bw             # dp outside tp=2
    assert tier(a100, 8, 8)[0] == a100.inter_bw                  # dp outside tp=8
    assert tier(a100, 2, 32)[0] == a100.inter_bw                 # a pipeline send
    # capped by the in-node link: 8 x 50 GB/s NICs on DGX H100 stay under NVLink's 450 GB/s
    h100 = load_cluster("dgx-h100", devices=64)
    assert tier(h100, 64, 1)[0] == min(h100.intra_bw, 8 * h100.inter_bw) == 400e9
    # the latency of a group across nodes is the inter-node one
    assert tier(a100, 64, 1)[1] == a100.inter_latency
