"""FSDP2's reduce-scatter and all-gather as gloo all-to-alls (plait.parallel.gloo_collectives).

On real gloo processes, against torch's own gloo collectives: every reduce op FSDP2 passes (SUM,
AVG, PREMUL_SUM) and the others, fp32 and bf16, chunk sizes that are odd, 1 and 0, on 2 ranks,
on 4 ranks and inside 2-rank subgroups of 4 (group rank != global rank). Then ZeRO-3 training
with them installed, on a model whose widths force FSDP2 to pad its shards, against one device.
"""

from __future__ import annotations

import pytest

from plait.check import CheckConfig, check
from plait.plan import Plan
from plait.spawn import run_distributed
from tests import _workers_gloo as W

CASES = [(k, "float32", op) for k in (1, 7, 1000) for op in W.OPS] + \
    [(0, "float32", "sum"), (513, "bfloat16", "sum"), (513, "bfloat16", "avg"),
     (513, "bfloat16", "premul_sum")]


def _assert_match(results: list[dict], world: int) -> None:
    for r in results:
        k, dtype, op = r["case"]
        assert r["rs_returned"] is None  # synchronous: FSDP2 ignores the result
        assert r["ag_equal"], r["case"]  # all-gather moves bits: exact
        # fp32 sums of 2 values are exact either way; more ranks or bf16 round in a different
        # order than gloo's own reduction (relative 1e-6 fp32, one bf16 ulp ~ 8e-3).
        if world == 2 and dtype == "float32" and op != "premul_sum":
            assert r["rs_diff"] == 0.0, r
        else:
            rel = 1e-6 if dtype == "float32" else 8e-3
            assert r["rs_diff"] <= rel * max(r["rs_scale"], 1.0), r


def test_match_torch_on_2_ranks():
    results = run_distributed(W.compare_with_torch, 2, CASES, timeout=120)
    for rank_results in results:
        _assert_match(rank_results, 2)


@pytest.mark.slow
def test_match_torch_on_4_ranks_and_in_subgroups():
    for subgroups, n in ((False, 4), (True, 2)):
        results = run_distributed(W.compare_with_torch, 4, CASES[:8], subgroups, timeout=180)
        for rank_results in results:
            _assert_match(rank_results, n)


def test_ledger_records_the_logical_collectives():
    k = 5
    entries = run_distributed(W.ledger_entries, 2, k, timeout=60)
    for mine in entries:
        assert mine == [
            {"axis": "world", "op": "all_gather", "group_size": 2, "count": 1,
             "payload_bytes": 2 * k * 4, "wire_bytes": k * 4.0, "recv_count": 0,
             "recv_bytes": 0, "via": "all_to_all"},
            {"axis": "world", "op": "reduce_scatter", "group_size": 2, "count": 1,
             "payload_bytes": 2 * k * 4, "wire_bytes": k * 4.0, "recv_count": 0,
             "recv_bytes": 0, "via": "all_to_all"}]


def test_bad_calls_are_refused():
    msgs = run_distributed(W.refused, 2, timeout=60)[0]
    assert "does not support reduce op" in msgs[0]
    assert "synchronously" in msgs[1]
    assert "expected 2 x 2" in msgs[2]
    assert "expected 2 x 2" in msgs[3]


def test_installed_on_gloo_unless_disabled():
    on = run_distributed(W.installed_comms, 2, Plan(dp_shard=2, zero=3), timeout=180)[0]
    assert on == ["GlooAllGather", "GlooReduceScatter"]
    off = run_distributed(W.installed_comms, 2, Plan(dp_shard=2, zero=3,
                                                     options={"gloo_all_to_all": False}),
                          timeout=180)[0]
    assert off == ["DefaultAllGather", "DefaultReduceScatter"]


def test_zero3_with_padded_shards_matches_single_device():
    cfg = CheckConfig(model_factory=W.odd_mlp, batch_factory=W.odd_batch)
    result = check("dp_shard=2,zero=3", cfg, tolerance=1e-5)
    assert result.ok, result.format()


# --------------------------------------------------------------------------- the buffer pool
def test_pool_reuses_a_buffer_only_once_nothing_views_it():
    import torch

    from plait.parallel.gloo_collectives import BufferPool

    pool = BufferPool(per_size=2, min_bytes=64)
    a = pool.allocate((32,), dtype=torch.float32, device=torch.device("cpu"))
    view = a[3:9]  # e.g. FSDP2's as_strided gradient views of a reduce-scatter output
    del a
    b = pool.allocate((32,), dtype=torch.float32, device=torch.device("cpu"))
    assert b.data_ptr() != view.data_ptr() - 3 * 4  # still viewed: not handed out again
    del view
    c = pool.allocate((4, 8), dtype=torch.float32, device=torch.device("cpu"))
    assert c.shape == (4, 8) and len(pool.buffers[(32, torch.float32, torch.device("cpu"))]) == 2
    first = pool.buffers[(32, torch.float32, torch.device("cpu"))][0]
    assert c.data_ptr() == first.data_ptr()  # the first buffer, free again, is reused
    d = pool.allocate((32,), dtype=torch.float32, device=torch.device("cpu"))
    assert d.data_ptr() not in (b.data_ptr(), c.data_ptr())  # both in use: a third, unkept
    assert len(pool.buffers[(32, torch.float32, torch.device("cpu"))]) == 2
    small = pool.allocate((8,), dtype=torch.float32, device=torch.device("cpu"))
    assert small.numel() == 8 and (8, torch.float32, torch.device("cpu")) not in pool.buffers
