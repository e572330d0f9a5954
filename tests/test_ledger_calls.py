"""The ledger's expected calls: beside the bytes, how many collectives carry them, predicted
per row (one all-reduce per DDP bucket, one broadcast per parameter under ZeRO-1, FSDP2's
gathers per unit...) and measured equal on real 2-rank runs; ``-`` where the count depends on
what the prediction does not read. The runtime's layouts (DDP, ZeRO-1/2/3, tp, pp, cp) are
checked row by row in tests/test_comm_ledger.py and tests/test_ledger_any_model.py, whose
``_check`` compares every row's calls with its expected calls."""

from __future__ import annotations

import json

import pytest

from plait.comm.predict import calls_by_axis_op, expected_rows
from plait.comm.report import UNKNOWN_CALLS_NOTE, CommReport, Expected
from plait.comm.volumes import Traffic, ddp_bucket_calls, ddp_bucket_calls_any_order, ddp_traffic
from plait.spawn import run_distributed
from tests import _workers_ledger_any as A
from tests import _workers_ledger_calls as W

MB = 2**20
AR = ("dp_replicate", "all_reduce")


def test_ddp_bucket_count_follows_torchs_rule():
    """A bucket closes once it holds the cap or more, per dtype, in the order given."""
    fp32 = [("torch.float32", b) for b in (840_000, 560_000, 400_000, 600_000)]
    assert ddp_bucket_calls(fp32, 0.5 * MB) == 3   # 840k | 560k | 400k + 600k
    assert ddp_bucket_calls(fp32, 1 * MB) == 2     # 840k + 560k | 400k + 600k
    assert ddp_bucket_calls(fp32, 25 * MB) == 1
    assert ddp_bucket_calls(fp32[::-1], 1 * MB) == 2
    assert ddp_bucket_calls(fp32 + [("torch.bfloat16", 10)], 25 * MB) == 2  # a bucket per dtype
    # without the order: known where no order closes a bucket before the last tensor
    assert ddp_bucket_calls_any_order(fp32, 25 * MB) == 1
    assert ddp_bucket_calls_any_order(fp32 + [("torch.bfloat16", 10)], 25 * MB) == 2
    assert ddp_bucket_calls_any_order(fp32, 2 * MB) == 1  # under 2 MiB before any last one
    assert ddp_bucket_calls_any_order(fp32, 1.8 * MB) is None  # 1 or 2 by the order
    # bytes alone: one bucket is certain, more are not (their count needs the tensors)
    assert ddp_traffic(1e6, 2)[0].calls_known
    assert not ddp_traffic(60 * MB / 4, 2)[0].calls_known


@pytest.mark.parametrize("cap,buckets", [(0.5, 3), (1.0, 2), (25.0, 1)])
def test_ddp_buckets_measured_equal_expected(cap, buckets):
    """plait's DDP at several bucket caps on 2 gloo ranks: the ledger's all-reduce count is the
    expected calls, read off the laid-out model (not payload / cap: 5 and 3 buckets for the
    first two). Without the order the gradients became ready in, the count is known only
    where every order gives it (one bucket at 25 MiB)."""
    row, unordered = _ddp_rows()[cap]
    assert unordered == (1 if buckets == 1 else None)
    assert row["count"] == buckets, row
    assert row["expected_calls"] == buckets and row["calls_ratio"] == 1.0, row
    assert row["ratio"] == pytest.approx(1.0), row


@pytest.mark.parametrize("find_unused,buckets", [(False, 2), (True, 3)])
def test_ddp_buckets_without_a_rebuild(find_unused, buckets):
    """Under find_unused_parameters DDP never rebuilds its buckets: they stay filled in the
    parameters' order, which for these sizes makes 3 buckets of 1 MiB where the backward
    order makes 2, and it all-reduces which parameters each rank used (one int32 per tensor,
    one call) every step; the expected calls and bytes follow each."""
    report = run_distributed(W.ddp_buckets, 2, [1.0], (300, 500, 300, 700), find_unused,
                             timeout=240)[0][1.0]
    row = next(r for r in report["rows"] if (r["axis"], r["op"]) == AR)
    calls = buckets + find_unused
    assert row["count"] == calls and row["expected_calls"] == calls, row
    assert row["ratio"] == pytest.approx(1.0, abs=1e-12), (row["payload_bytes"],
                                                           row["expected_bytes"])


_CACHE: dict[float, tuple[dict, int | None]] = {}


def _ddp_rows() -> dict[float, tuple[dict, int | None]]:
    """The three caps measured once, in one 2-rank run: the all-reduce row, and the bucket
    count read without the gradients' order."""
    if not _CACHE:
        got = run_distributed(W.ddp_buckets, 2, [0.5, 1.0, 25.0], timeout=240)[0]
        for cap, report in got.items():
            _CACHE[cap] = (next(r for r in report["rows"] if (r["axis"], r["op"]) == AR),
                           report["unordered"])
    return _CACHE


def test_a_model_over_one_bucket_through_the_runtime():
    """33 MiB of gradients under plait's runtime (dp=2, DDP's 25 MiB buckets): two all-reduces
    a step, measured and expected; the report's JSON holds the calls beside the bytes."""
    comm = run_distributed(A.ledger_runs, 2, "dp=2", ["wide"], table={"wide": W.wide},
                           vocab=16, timeout=240)[0]["wide"]["comm"]
    parsed = json.loads(json.dumps(comm))
    row = next(r for r in parsed["rows"] if (r["axis"], r["op"]) == AR)
    assert row["count"] == 2 and row["expected_calls"] == 2 and row["calls_ratio"] == 1.0, row
    assert UNKNOWN_CALLS_NOTE not in parsed["notes"]


def test_a_model_run_in_another_order_than_registered():
    """A model that registers its head before its body (``HeadFirst``): DDP's buckets follow
    the order its gradients became ready in the first step, one bucket where the
    parameters' reversed order would fill two; the expected calls are read from the run, so
    they are the measured ones."""
    comm = run_distributed(A.ledger_runs, 2, "dp=2", ["head_first"],
                           table={"head_first": W.head_first}, vocab=16, timeout=240
                           )[0]["head_first"]["comm"]
    row = next(r for r in comm["rows"] if (r["axis"], r["op"]) == AR)
    assert row["count"] == 1, row  # measured: one bucket
    assert row["expected_calls"] == 1 and row["calls_ratio"] == 1.0, row
    assert UNKNOWN_CALLS_NOTE not in comm["notes"]


def test_report_shows_expected_calls_and_dash_where_unknown():
    """The table's ``exp calls`` column and the JSON's ``expected_calls`` / ``calls_ratio``;
    ``-`` and a note for a row whose count is not known."""
    traffic = [Traffic("tp", "all_reduce", 2048.0, 4, 2),
               Traffic("dp_replicate", "all_reduce", 100 * MB, 4, 2, calls_known=False)]
    expected = expected_rows(traffic)
    assert isinstance(expected, Expected) and dict(expected) == {
        ("tp", "all_reduce"): 2048.0, AR: 100 * MB}
    assert calls_by_axis_op(traffic) == {("tp", "all_reduce"): 4, AR: None}
    entries = [{"axis": "tp", "op": "all_reduce", "group_size": 2, "count": 6,
                "payload_bytes": 4096, "wire_bytes": 4096, "time_s": 0.01},
               {"axis": "dp_replicate", "op": "all_reduce", "group_size": 2, "count": 10,
                "payload_bytes": 200 * MB, "wire_bytes": 200 * MB, "time_s": 0.01}]
    rep = CommReport.from_ranks([entries, entries], steps=2, expected=expected)
    parsed = json.loads(rep.to_json())
    rows = {(r["axis"], r["op"]): r for r in parsed["rows"]}
    assert rows[("tp", "all_reduce")]["expected_calls"] == 4
    assert rows[("tp", "all_reduce")]["calls_ratio"] == 0.75
    assert rows[AR]["expected_calls"] is None and rows[AR]["calls_ratio"] is None
    assert UNKNOWN_CALLS_NOTE in parsed["notes"]
    assert any("different number of calls" in n for n in parsed["notes"])
    table = rep.table().splitlines()
    head = table[1].split()
    assert head[3:6] == ["calls", "exp", "calls"], head
    tp_line = next(line for line in table if line.startswith("tp "))
    assert tp_line.split()[3:5] == ["3", "4"], tp_line
    dp_line = next(line for line in table if line.startswith("dp_replicate "))
    assert dp_line.split()[3:5] == ["5", "-"], dp_line
    # bytes alone (a hand-written expectation): no calls, no note about them
    plain = CommReport.from_ranks([entries, entries], steps=2, expected={AR: 100 * MB})
    assert plain.row(*AR).expected_calls is None and UNKNOWN_CALLS_NOTE not in plain.notes


@pytest.mark.slow  # the calls columns are checked in process by the tests above
def test_plait_comm_json_carries_the_calls():
    """``plait comm --format json`` under ZeRO-1, parsed: every row's measured calls are its
    expected calls, ZeroRedundancyOptimizer's broadcasts one per parameter tensor."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from plait.models.transformer import build

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "plait.cli", "comm", "--plan",
                          "dp_shard=2,zero=1", "--steps", "1", "--model", "tiny",
                          "--global-batch", "4", "--format", "json"], capture_output=True,
                         text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    rows = {(r["axis"], r["op"]): r for r in json.loads(out.stdout)["rows"]}
    assert set(rows) == {("dp_shard", "all_reduce"), ("dp_shard", "broadcast")}, rows
    for key, r in rows.items():
        assert r["count"] == r["expected_calls"] and r["calls_ratio"] == 1.0, (key, r)
    tensors = len(list(build("tiny").parameters()))
    assert rows[("dp_shard", "broadcast")]["count"] == tensors > 1
