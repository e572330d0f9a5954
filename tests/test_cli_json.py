"""`plait run --format json` and `plait demo --format json`: JSON Lines on stdout, one event
per line (plan, progress, ledger, summary; the script's own prints as output events; an error
event last when the run fails), and nothing else there."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.argv import format_from_argv
from plait.launch import LaunchConfig, output_format, script_argv
from plait.outputs import as_event, json_event
from plait.progress import Progress
from plait.runtime import StepStats

ROOT = Path(__file__).resolve().parents[1]

# A model written for the test (not plait.models), trained for 3 steps on 2 ranks with the
# ledger on: the script prints a line of its own and warns, as user scripts do.
SCRIPT = """
import warnings
import torch
import plait

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))

run = plait.init(seed=1, log_every=1, ledger=True)
torch.manual_seed(0)
data = [(torch.randn(6), torch.randint(0, 3, ()).item()) for _ in range(48)]
model = run.parallelize(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
print("my own line", run.rank)
warnings.warn("a warning of the script's own")
for batch in run.loader(data, batch_size=8, steps=STEPS):
    run.step(model, batch, torch.nn.functional.cross_entropy, opt)
run.finish()
"""


def plait(*args, timeout=240, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "plait.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=env)


def events(stdout: str) -> list[dict]:
    """Every line of stdout as a JSON object with an "event" (the test fails otherwise)."""
    out = []
    for line in stdout.splitlines():
        data = json.loads(line)  # strict JSON: json.loads takes NaN, so check it too
        assert isinstance(data, dict) and "event" in data, line
        assert "NaN" not in line and "Infinity" not in line, line
        out.append(data)
    return out


@pytest.mark.parametrize("where", ["own", pytest.param("script", marks=pytest.mark.slow)])
def test_run_json_is_one_event_per_line(tmp_path, where):
    """A real run (2 ranks, 3 steps): plan first, a progress event per step, the ledger's
    rows, the summary last; the script's print is an output event, its warning on stderr.
    ``--format json`` works as plait run's flag and as the script's (read like --plan)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("STEPS", "3"))
    args = (["run", "--nproc", "2", "--format", "json", str(script)] if where == "own"
            else ["run", "--nproc", "2", str(script), "--format", "json"])
    out = plait(*args)
    assert out.returncode == 0, out.stderr
    got = events(out.stdout)
    kinds = [e["event"] for e in got]
    assert kinds[0] == "plan" and kinds[-1] == "summary", kinds
    assert got[0]["plan"] == "dp_replicate=2" and got[0]["world_size"] == 2, got[0]
    progress = [e for e in got if e["event"] == "progress"]
    assert [e["step"] for e in progress] == [1, 2, 3], progress
    # feature rows, not token ids: samples/s
    assert all(e["total"] == 3 and e["step_time_ms"] > 0 and e["samples_per_s"] > 0
               for e in progress), progress
    summary = got[-1]
    assert summary["steps"] == 3 and summary["world_size"] == 2
    assert math.isclose(summary["final_loss"], progress[-1]["loss"]), (summary, progress)
    ledger = [e for e in got if e["event"] == "ledger"]
    # DDP's gradient all-reduce over the data axis, as many bytes as the parameters hold
    params = 4 * (6 * 16 + 16 + 16 * 3 + 3)
    row = next(e for e in ledger if e["op"] == "all_reduce")
    assert row["axis"] == "dp_replicate" and row["payload_bytes"] == params, ledger
    assert "comm_table" not in summary and "rows" not in summary["comm"], summary
    assert {"event": "output", "text": "my own line 0"} in got, got
    assert "a warning of the script's own" in out.stderr, out.stderr
    assert "a warning" not in out.stdout


def test_a_failed_run_ends_with_an_error_event(tmp_path):
    """A rank raising: stdout stays JSON Lines and ends with an error event naming the rank,
    with the run's non-zero exit code; the traceback is on stderr."""
    script = tmp_path / "bad.py"
    script.write_text("import plait\nrun = plait.init()\nrun.print('started')\n"
                      "if run.rank == 1:\n    raise RuntimeError('rank one exploded')\n"
                      "import torch.distributed as dist\ndist.barrier()\n")
    out = plait("run", "--nproc", "2", "--format", "json", str(script))
    assert out.returncode != 0
    got = events(out.stdout)
    assert got[0]["event"] == "plan" and {"event": "message", "text": "started"} in got, got
    error = got[-1]
    assert error["event"] == "error" and error["command"] == "run", error
    assert error["exit_code"] == out.returncode and error["rank"] == 1, error
    assert "rank 1 (RuntimeError" in error["error"], error
    assert error["traceback"].endswith("RuntimeError: rank one exploded"), error
    assert "RuntimeError: rank one exploded" in out.stderr


def test_a_script_that_refuses_its_arguments_says_why_in_the_error_event(tmp_path):
    """A strict argparse that does not declare --format refuses the --format json plait run
    hands it: each rank exits 2 without a traceback, and the error event carries the line
    that says why (it was only on stderr)."""
    script = tmp_path / "strict.py"
    script.write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    out = plait("run", "--nproc", "2", "--format", "json", str(script))
    assert out.returncode != 0
    [error] = events(out.stdout)
    assert error["event"] == "error" and error["exit_code"] == out.returncode, error
    assert error["traceback"].endswith("error: unrecognized arguments: --format json"), error


def test_bad_input_to_run_json_is_an_error_event(tmp_path):
    """Refused before anything starts (a plan that does not fit): one error event, exit 2."""
    script = tmp_path / "ok.py"
    script.write_text("print('should not run')\n")
    out = plait("run", "--nproc", "2", "--format", "json", str(script), "--plan", "dp=3")
    assert out.returncode == 2
    [error] = events(out.stdout)
    assert error["event"] == "error" and "!= world size 2" in error["error"], error
    assert error["exit_code"] == 2 and error["command"] == "run"


@pytest.mark.slow
def test_demo_json_is_one_event_per_line():
    out = plait("demo", "--steps", "3", "--format", "json")
    assert out.returncode == 0, out.stderr
    got = events(out.stdout)
    kinds = [e["event"] for e in got]
    assert kinds[:3] == ["plan", "model", "layout"], kinds
    assert kinds[-2:] == ["summary", "result"] and "ledger" in kinds, kinds
    assert got[-1]["final_loss"] == got[-2]["final_loss"], got[-2:]


def test_demo_json_bad_input_is_an_error_event():
    out = plait("demo", "--plan", "dp=3", "--format", "json")
    assert out.returncode == 2
    [error] = events(out.stdout)
    assert error["command"] == "demo" and "!= world size 2" in error["error"], error


# ---------------------------------------------------------------- the pieces, no processes

def test_a_scripts_own_line_becomes_an_output_event():
    assert json.loads(as_event("hello {not json}\n")) == {"event": "output",
                                                          "text": "hello {not json}"}
    assert json.loads(as_event('{"a": 1}\n')) == {"event": "output", "text": '{"a": 1}'}
    event = json_event("progress", step=1)
    assert as_event(event + "\n") == event


def test_events_are_strict_json():
    """A diverged loss (NaN) or a rate over no time (inf) is null, not Python's NaN."""
    line = json_event("progress", loss=float("nan"), rate=[float("inf"), 1.5],
                      nested={"x": float("-inf")})
    assert json.loads(line) == {"event": "progress", "loss": None, "rate": [None, 1.5],
                                "nested": {"x": None}}
    assert "NaN" not in line and "Infinity" not in line


def test_the_format_reaches_the_script_as_an_argument():
    """plait run's --format json is handed to the script on its command line (plait.init
    reads it there, as --plan), once; either place asks the launcher for JSON."""
    cfg = LaunchConfig(script="t.py", script_args=("--plan", "dp=2"), format="json")
    assert script_argv(cfg) == ["--plan", "dp=2", "--format", "json"]
    said = LaunchConfig(script="t.py", script_args=("--format=json",), format="json")
    assert script_argv(said) == ["--format=json"]
    assert script_argv(LaunchConfig(script="t.py", script_args=("--x",))) == ["--x"]
    assert output_format(None, ["--format", "json"]) == "json"
    assert output_format("text", ["--format", "json"]) == "text"
    assert output_format(None, ["--format", "parquet"]) == "text"


def test_a_scripts_other_format_flag_is_left_to_it():
    """``--format parquet`` is the script's own flag for something else: not plait's."""
    assert format_from_argv(["--format", "json"]) == "json"
    assert format_from_argv(["--format", "parquet"]) is None
    assert format_from_argv(["--format"]) is None
    assert format_from_argv([]) is None


def test_progress_events_at_the_logging_steps(capsys):
    stats = StepStats(step_times=[0.5, 0.25, 0.25], tokens=[100, 100, 100],
                      step_ends=[1.0, 1.25, 1.5])
    progress = Progress(enabled=True, log_every=2, total=3, events=True)
    for step in (1, 2, 3):
        progress.update(step, 2.0 / step, stats)
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["step"] for e in got] == [1, 2, 3]
    assert got[-1] == {"event": "progress", "step": 3, "total": 3, "loss": 2.0 / 3,
                       "tokens_per_s": 400.0, "step_time_ms": 250.0, "eta_s": 0.0}
