"""plait bench comm and plait comm: a tiny sweep runs and reports; bad input is refused clearly."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.comm import bench
from plait.comm.cli import (
    add_bench_comm_arguments,
    add_comm_arguments,
    batch_warning,
    bench_comm_command,
    comm_command,
    replica_batch,
)
from plait.plan import Plan

ROOT = Path(__file__).resolve().parents[1]


def _args(add, *argv):
    p = argparse.ArgumentParser()
    add(p)
    return p.parse_args(list(argv))


def test_size_sweep_and_parsing():
    assert bench.size_sweep(1024, 8192) == [1024, 2048, 4096, 8192]
    assert len(bench.size_sweep(bench.DEFAULT_MIN_BYTES, bench.DEFAULT_MAX_BYTES)) == 19
    assert bench.parse_size("256M") == 256 << 20 and bench.parse_size("4096") == 4096
    assert bench.parse_ops("allreduce, send-recv") == ("all_reduce", "send_recv")
    assert bench.elements_for("all_gather", 1000, 4, 4) == 248  # splits evenly over 4 ranks


@pytest.mark.parametrize("call, match", [
    (lambda: bench.size_sweep(4096, 1024), "larger than --max-bytes"),
    (lambda: bench.parse_ops("all_reduce,allreduz"), "unknown collective 'allreduz'"),
    (lambda: bench.bench_comm("all_reduce", nproc=1), "at least 2 ranks"),
    (lambda: bench.parse_size("12 parsecs"), "cannot read size"),
])
def test_bad_input_is_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_cli_bad_input_exits_2(capsys):
    for argv in (["--min-bytes", "8K", "--max-bytes", "1K"], ["--ops", "gossip"],
                 ["--nproc", "1"]):
        assert bench_comm_command(_args(add_bench_comm_arguments, *argv)) == 2
        assert "error" in capsys.readouterr().err
    assert comm_command(_args(add_comm_arguments, "--plan", "dp_replicate=1")) == 2
    assert "nothing is communicated" in capsys.readouterr().err


def test_bench_comm_tiny_sweep_reports_every_op(capsys):
    code = bench_comm_command(_args(add_bench_comm_arguments, "--min-bytes", "1K",
                                    "--max-bytes", "2K", "--iters", "2", "--warmup", "1",
                                    "--format", "json"))
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    got = {(r["op"], r["size_bytes"]) for r in out["results"]}
    assert got == {(op, s) for op in bench.BENCH_OPS for s in (1024, 2048)}
    for r in out["results"]:
        assert r["time_us"] > 0 and r["algbw_gbps"] > 0
        # n=2: all-reduce's bus factor 2(n-1)/n = 1, all-gather's (n-1)/n = 1/2.
        factor = {"all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5}.get(r["op"], 1.0)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)


def test_busbw_bench_script_runs_both_sides():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "comm_busbw.py"), "--max-bytes",
                          "2K", "--iters", "2", "--warmup", "1", "--rounds", "3"], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "plait/raw" in lines[1] and len(lines) == 4  # title + header + 1K + 2K
    for line, size in zip(lines[2:], (1024, 2048), strict=True):
        cells = line.split()
        assert int(cells[0]) == size and int(cells[1]) == 2  # size, iters
        ours, raw, ratio, q1, q3, best = map(float, cells[2:])
        assert ours > 0 and raw > 0 and best > 0 and 0 < q1 <= ratio <= q3


def test_plait_comm_reports_measured_beside_expected(capsys):
    code = comm_command(_args(add_comm_arguments, "--plan", "tp=2", "--steps", "1",
                              "--warmup", "1", "--format", "json"))
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["plan"], data["model"]) == ("tp=2", "test")
    assert (data["global_batch"], data["replica_batch"]) == (4, 4)  # one replica, 4 per replica
    rows = {(r["axis"], r["op"]): r for r in data["rows"]}
    # plait's TP keeps the logits vocabulary-sharded (loss_parallel): no logits all-gather.
    assert set(rows) == {("tp", "all_reduce")}
    assert all(r["ratio"] == 1.0 for r in rows.values())


@pytest.mark.parametrize("argv, plan, replica, warned", [
    # --global-batch, as on every command, and its two other spellings: over all replicas
    (["--global-batch", "8"], "dp=2", 4, False),
    (["--batch-size", "8"], "dp=2", 4, False),
    (["--batch", "8"], "dp=2", 4, True),  # meant 8 per replica before: said once, on stderr
    (["--batch", "8"], "tp=2", 8, False),  # one replica: both meanings are 8 per replica
    (["--global-batch", "8"], "dp_shard=2,zero=3,tp=2", 4, False),
    (["--replica-batch", "8"], "dp=2", 8, False),
    ([], "dp=2", 4, False),  # default: 4 per replica
    ([], "pp=2,microbatches=8", 8, False),  # the default split into the plan's micro-batches
])
def test_comm_batch_spellings(argv, plan, replica, warned):
    args = _args(add_comm_arguments, "--plan", plan, *argv)
    parsed = Plan.from_string(plan)
    assert replica_batch(args, parsed) == replica
    warning = batch_warning(args, parsed)
    assert (warning is not None) == warned, warning
    if warned:
        assert warning == ("--batch 8 is the global batch, as on every plait command: 4 "
                           "sequences per replica over 2 replicas (plait comm read it per "
                           "replica before; for that, --replica-batch 8)")


def test_comm_batch_is_the_global_batch_end_to_end(capsys):
    """`plait comm --plan dp=2 --batch 4`: 2 sequences per replica, the warning one line on
    stderr ahead of the report, the JSON report on stdout untouched."""
    from plait.cli import main

    assert main(["comm", "--plan", "dp=2", "--batch", "4", "--steps", "1", "--warmup", "0",
                 "--timeout", "120", "--format", "json"]) == 0
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert (data["global_batch"], data["replica_batch"]) == (4, 2), data
    assert out.err.strip().splitlines() == [
        "plait comm: warning: --batch 4 is the global batch, as on every plait command: 2 "
        "sequences per replica over 2 replicas (plait comm read it per replica before; for "
        "that, --replica-batch 4)"], out.err
