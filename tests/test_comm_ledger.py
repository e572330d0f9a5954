"""The ledger measures exactly the closed-form bytes (ratio 1.000 per axis and op).

Each layout runs WARMUP steps outside the ledger and STEPS inside it on the reference "test"
model at world 2 (gloo, CPU); the prediction comes from plait.comm.volumes via
plait.comm.predict. Layouts are built from torch's pieces in tests/_workers_comm.py (plait's
parallelize is not there yet; switch the workers to it when it lands).
"""

from __future__ import annotations

import pytest
import torch

import _workers_comm as W
from plait.comm.ledger import Ledger, axis_names_by_ranks
from plait.comm.predict import by_axis_op, predict
from plait.comm.report import CommReport, normalise_expected
from plait.models.transformer import preset
from plait.plan import Plan
from plait.spawn import run_distributed

CFG = preset(W.MODEL)
ROOT_PARAMS = 2 * CFG.vocab_size * CFG.dim + CFG.dim  # embeddings + head + final norm


def _check(result: dict, expected: dict[tuple[str, str], float], ops_seen: set[str]) -> None:
    rows = {(r["axis"], r["op"]): r for r in result["rows"]}
    assert result["steps"] == W.STEPS
    assert {op for _, op in rows} == ops_seen, rows.keys()
    for key, want in expected.items():
        assert key in rows, f"{key} not measured; rows: {sorted(rows)}"
        for got in rows[key]["per_rank_payload"]:
            assert got / want == pytest.approx(1.0, abs=0), (key, got, want)
        assert rows[key]["ratio"] == pytest.approx(1.0, abs=0)
    assert set(rows) == set(expected), (sorted(rows), sorted(expected))


def test_ddp_bytes_match_closed_form():
    plan = Plan(dp_replicate=2)
    exp = by_axis_op(predict(plan, CFG, W.BATCH, W.SEQ))
    res = run_distributed(W.ddp, 2, exp, timeout=240)[0]
    _check(res, exp, {"all_reduce"})


def test_zero3_bytes_match_closed_form():
    plan = Plan(dp_shard=2, zero=3)
    exp = by_axis_op(predict(plan, CFG, W.BATCH, W.SEQ, root_params=ROOT_PARAMS))
    res = run_distributed(W.fsdp, 2, exp, timeout=240)[0]
    _check(res, exp, {"all_gather", "reduce_scatter"})
    assert "gloo has no native reduce-scatter" in " ".join(res["notes"])


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tp_bytes_match_closed_form(sp):
    plan = Plan(tp=2, sp=sp)
    exp = by_axis_op(predict(plan, CFG, W.BATCH, W.SEQ))
    res = run_distributed(W.tp, 2, sp, exp, timeout=240)[0]
    _check(res, exp, {"all_gather", "reduce_scatter", "all_reduce"} if sp else
           {"all_reduce", "all_gather"})
    # Megatron's count: 4 per block + embedding + head (+ logits gather), per microbatch.
    counts = {r["op"]: r["count"] for r in res["rows"]}
    L = CFG.n_layers
    if sp:
        assert counts == {"all_gather": 4 * L + 3, "reduce_scatter": 4 * L + 2,
                          "all_reduce": 2 * L + 1}
    else:
        assert counts == {"all_reduce": 4 * L + 2, "all_gather": 1}


def test_pp_send_recv_bytes_match_closed_form():
    plan = Plan(pp=2, microbatches=2, pp_schedule="gpipe")
    res = run_distributed(W.pp, 2, timeout=240)
    for stage, r in enumerate(res):
        exp = by_axis_op(predict(plan, CFG, W.BATCH, W.SEQ, stage=stage))
        row = next(x for x in r["rows"] if x["op"] == "send_recv")
        assert row["axis"] == "pp"
        assert row["per_rank_payload"][stage] == exp[("pp", "send_recv")]
        assert row["recv_bytes"] == exp[("pp", "send_recv")]  # each rank receives as much


# --------------------------------------------------------------------------- pure pieces
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


def test_ledger_off_installs_nothing_and_records_nothing():
    def hooked() -> bool:
        return torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_",
                                                               "BackendSelect")
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
