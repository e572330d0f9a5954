"""Closed-form communication volumes against hand-computed values for small cases."""

import pytest

from plait.comm.volumes import (
    Traffic,
    bus_factor,
    by_axis,
    ddp_traffic,
    dtype_bytes,
    pp_traffic,
    tp_traffic,
    wire_bytes,
    zero_traffic,
)


def test_bus_factors():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert bus_factor("all_reduce", 1) == 0.0
    assert wire_bytes("send_recv", 100, 2) == 100
    assert dtype_bytes("bf16") == 2


def test_ddp_once_per_step_in_reduce_dtype():
    # 1,000 params, fp32 grads, 4 ranks: payload 4,000 B, wire 2*3/4*4,000 = 6,000 B.
    (t,) = ddp_traffic(1000, 4, "fp32")
    assert (t.op, t.axis, t.payload, t.group) == ("all_reduce", "dp_replicate", 4000, 4)
    assert t.wire == pytest.approx(6000)
    (t,) = ddp_traffic(1000, 4, "bf16")
    assert t.payload == 2000
    assert ddp_traffic(1000, 1) == []


def test_zero12_reduce_scatter_grads_all_gather_params():
    for stage in (1, 2):
        rs, ag = zero_traffic(1000, 4, stage, param_dtype="bf16", grad_dtype="fp32")
        assert (rs.op, rs.payload) == ("reduce_scatter", 4000)
        assert (ag.op, ag.payload) == ("all_gather", 2000)
        assert rs.wire + ag.wire == pytest.approx(0.75 * 6000)


def test_zero3_gathers_twice_per_micro_step():
    rs, ag = zero_traffic(1000, 4, 3, param_dtype="fp32", micro_steps=3, units=5)
    assert rs.payload == 4000 and rs.calls == 5
    assert ag.payload == 4000 * 2 * 3 and ag.calls == 5 * 2 * 3
    # ZeRO-3 moves 1.5x the bytes of DDP for one micro-step (the textbook ratio).
    rs1, ag1 = zero_traffic(1000, 4, 3)
    (ar,) = ddp_traffic(1000, 4)
    assert (rs1.wire + ag1.wire) / ar.wire == pytest.approx(1.5)


def test_tp_four_all_reduces_per_layer_and_sp_same_bytes():
    # b=2, s=8, h=16, fp32 -> 1,024 B per all-reduce; 3 layers, 2 microbatches -> 24 calls.
    (t,) = tp_traffic(2, 8, 16, 3, 2, "fp32", microbatches=2)
    assert t.calls == 24 and t.payload == 24 * 1024
    assert t.wire == pytest.approx(24 * 1024 * 2 * 1 / 2)
    ag, rs = tp_traffic(2, 8, 16, 3, 2, "fp32", microbatches=2, sp=True)
    assert ag.op == "all_gather" and rs.op == "reduce_scatter"
    assert ag.wire + rs.wire == pytest.approx(t.wire)
    # full recomputation repeats the 2 forward all-reduces
    (r,) = tp_traffic(2, 8, 16, 3, 2, "fp32", microbatches=2, recomputed_layers=3)
    assert r.calls == 36
    assert tp_traffic(2, 8, 16, 3, 1) == []


def test_pp_boundaries_per_rank():
    # b=1, s=4, h=8, fp32 -> 128 B per message; pp=4, m=4.
    fwd, bwd = pp_traffic(1, 4, 8, 4, microbatches=4)  # busiest (interior) rank
    assert fwd.payload == bwd.payload == 4 * 128
    (first,) = pp_traffic(1, 4, 8, 4, microbatches=4, stage=0)
    assert first.what == "activations" and first.payload == 4 * 128
    (last,) = pp_traffic(1, 4, 8, 4, microbatches=4, stage=3)
    assert last.what == "activation grads"
    # interleaved, v=2: rank 0 sends forward from both chunks, backward from its second.
    f0, b0 = pp_traffic(1, 4, 8, 4, microbatches=4, virtual_stages=2, stage=0)
    assert f0.calls == 8 and b0.calls == 4
    # total over all ranks = 2 * m * (pp*v - 1) messages
    total = sum(t.calls for s in range(4)
                for t in pp_traffic(1, 4, 8, 4, microbatches=4, virtual_stages=2, stage=s))
    assert total == 2 * 4 * (4 * 2 - 1)


def test_by_axis_and_bad_input():
    traffic = ddp_traffic(1000, 2) + tp_traffic(1, 4, 8, 1, 2)
    axes = by_axis(traffic)
    assert set(axes) == {"dp_replicate", "tp"}
    assert axes["dp_replicate"] == pytest.approx(4000)
    with pytest.raises(ValueError, match="dp=0"):
        ddp_traffic(10, 0)
    with pytest.raises(ValueError, match="stage"):
        zero_traffic(10, 2, 4)
    with pytest.raises(ValueError, match="collective"):
        Traffic("dp", "gossip", 1, 1, 2)
