"""``plait comm --model pkg.module:function``: the user's own model, trained under the plan
with the communication ledger on, reported as ``run.finish()`` reports it (measured bytes per
mesh axis and collective beside the closed form); a bad factory, dataset or plan is one line,
exit 2. The models are written for the tests (tests/_comm_factories.py,
tests/_newcomer_models.py), not plait's reference transformer."""

from __future__ import annotations

import json

import pytest

from plait.cli import main
from plait.spawn import run_distributed
from tests._comm_factories import finish_comm

MLP = "tests._comm_factories:mlp_lm"
# the columns that do not depend on timing
SAME = ("axis", "op", "group_size", "count", "expected_calls", "payload_bytes", "wire_bytes",
        "expected_bytes", "ratio", "via")


def _comm(capsys, *argv: str) -> dict:
    code = main(["comm", *argv, "--steps", "1", "--warmup", "2", "--timeout", "180",
                 "--format", "json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def _exact(data: dict) -> None:
    """Every row measured, and the closed form the ledger gives for the layout met exactly."""
    assert data["rows"], data
    for row in data["rows"]:
        assert row["ratio"] == pytest.approx(1.0, abs=1e-12), row
        assert row["calls_ratio"] == pytest.approx(1.0, abs=1e-12), row


def test_comm_measures_a_factory_model_as_run_finish_does(capsys, tmp_path) -> None:
    """tp=2 on a stack of MLP blocks: the inferred layer plan's all-reduces, each row the
    numbers the same loop prints at run.finish(), and the JSON names the factory."""
    plot = tmp_path / "comm.png"
    data = _comm(capsys, "--plan", "tp=2", "--model", MLP, "--plot", str(plot))
    assert (data["plan"], data["model"], data["seq"]) == ("tp=2", MLP, None)
    assert (data["global_batch"], data["replica_batch"]) == (4, 4)
    assert {(r["axis"], r["op"]) for r in data["rows"]} == {("tp", "all_reduce")}
    _exact(data)
    finished = run_distributed(finish_comm, 2, "tp=2", MLP, 4, 2, 1, timeout=180)[0]
    assert [{k: r[k] for k in SAME} for r in data["rows"]] == \
        [{k: r[k] for k in SAME} for r in finished["rows"]]
    assert data["notes"] == finished["notes"]
    pytest.importorskip("matplotlib")
    assert plot.stat().st_size > 0


@pytest.mark.parametrize("plan, rows", [
    ("dp_shard=2,zero=3", {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"),
                           ("dp_shard", "all_reduce")}),
    ("pp=2,microbatches=2", {("pp", "send_recv"), ("pp", "all_reduce")}),
])
def test_comm_measures_a_factory_model_under_zero3_and_a_pipeline(capsys, plan, rows) -> None:
    data = _comm(capsys, "--plan", plan, "--model", MLP)
    assert {(r["axis"], r["op"]) for r in data["rows"]} == rows
    _exact(data)


def test_comm_without_a_closed_form_says_why(capsys, tmp_path) -> None:
    """A layer plan given by hand: measured rows, no expected column, and the table's note
    naming why, as run.finish() prints it."""
    plan = tmp_path / "hand.json"
    plan.write_text(json.dumps({"tp": 2, "options": {"tp_plan": {
        "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}}}))
    assert main(["comm", "--plan", str(plan), "--model", MLP, "--steps", "1",
                 "--timeout", "180"]) == 0
    out = capsys.readouterr().out
    assert f"model {MLP}, global batch 4 (4 per replica)\n" in out, out
    assert "x seq" not in out, out
    rows = [line.split() for line in out.splitlines() if line.startswith("tp ")]
    assert rows and all(r[4] == "-" and r[-5] == "-" for r in rows), out  # exp calls, ratio
    assert "note: no 'expected' column: options.tp_plan is given by hand" in out, out


@pytest.mark.parametrize("factory, plan, fragment", [
    ("tests._comm_factories:few_rows", "dp=2",
     "--model 'tests._comm_factories:few_rows': the dataset has 3 items, fewer than one global "
     "batch of 8; use --global-batch 2 or less, a multiple of 2"),
    ("tests._comm_factories:missing_data", "dp=2",
     "--model 'tests._comm_factories:missing_data' raised FileNotFoundError: [Errno 2] No such "
     "file or directory: '/nonexistent/plait-comm-rows.pt' ("),
    ("tests._comm_factories:lstm_lm", "tp=2",
     "cannot infer a tensor-parallel plan for LSTMLM"),
    ("tests._newcomer_models:denoiser", "pp=2",  # refused before any rank starts
     "--model tests._newcomer_models:denoiser cannot run pp=2,microbatches=2: pp=2 would cut "
     "UNet at temb"),
])
def test_comm_refuses_a_bad_factory_in_one_line(capsys, factory, plan, fragment) -> None:
    code = main(["comm", "--plan", plan, "--model", factory, "--steps", "1", "--timeout",
                 "180"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert fragment in err and len(err.strip().splitlines()) == 1, err
