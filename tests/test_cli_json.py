"""`plait run --format json` and `plait demo --format json`: JSON Lines on stdout, one event
per line (plan, progress, ledger, summary; the script's own prints as output events; an error
event last when the run fails), and nothing else there."""

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.argv import format_from_argv
from plait.json_stdout import install, restore
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
    # rank 0's own error event (its peer left) is not the run's: the launcher's alone is
    assert [e["event"] for e in got].count("error") == 1, got
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


# ------------------------------------------- --format json without plait run: python, torchrun

def script_run(script, *args, ranks=1, timeout=240):
    """``python SCRIPT ARGS`` (one process), or under torchrun with ``ranks`` processes on a
    free port (``--standalone``): what a user pipes to ``jq`` without ``plait run``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launcher = ([] if ranks == 1 else
                ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)])
    return subprocess.run([sys.executable, *launcher, str(script), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=script.parent, env=env)


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_script_run_without_plait_run_writes_json_lines(tmp_path, ranks):
    """``python train.py --format json`` and ``torchrun --nproc-per-node 2 train.py --format
    json``: every stdout line is an event, the script's own prints (every rank's, and one
    left without its newline) included as output events, the warning on stderr; plait's
    events once (rank 0's)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("STEPS", "2").replace(
        'print("my own line", run.rank)',
        'print("my own line", run.rank)\nprint("no newline", end="")'))
    out = script_run(script, "--format", "json", ranks=ranks)
    assert out.returncode == 0, out.stderr
    got = events(out.stdout)
    kinds = [e["event"] for e in got]
    assert kinds[0] == "plan" and kinds.count("plan") == 1, kinds
    assert kinds.count("summary") == 1 and kinds[-1] in ("summary", "output"), kinds
    assert [e["step"] for e in got if e["event"] == "progress"] == [1, 2], got
    assert got[0]["world_size"] == ranks, got[0]
    said = [e["text"] for e in got if e["event"] == "output"]
    assert sorted(said) == sorted([f"my own line {r}" for r in range(ranks)]
                                  + ["no newline"] * ranks), said
    assert "a warning of the script's own" in out.stderr, out.stderr


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_bad_plan_without_plait_run_is_an_error_event(tmp_path, ranks):
    """A plan that does not fit, or --plan without a value: stdout is one error event (rank
    0's: every rank refuses the same command line), the line also on stderr, a non-zero exit
    (2 from the script; torchrun's own for a failed worker)."""
    script = tmp_path / "train.py"
    script.write_text("import plait\nrun = plait.init()\nprint('should not run')\n")
    for args, said in ((["--plan", "dp=3"], f"!= world size {ranks}"),
                       (["--plan"], "the script's --plan needs a value")):
        out = script_run(script, *args, "--format", "json", ranks=ranks)
        assert out.returncode == (2 if ranks == 1 else 1), (out.returncode, out.stderr)
        got = events(out.stdout)
        assert [e["event"] for e in got] == ["error"], got
        error = got[-1]
        assert said in error["error"] and error["exit_code"] == 2, error
        assert error["command"] == "train.py", error
        assert f"plait: error: {error['error']}" in out.stderr, out.stderr
        if ranks == 2:  # one of the two costs the check: torchrun's start is the slow part
            break


def test_an_inferred_tp_plan_is_a_message_event(tmp_path):
    """Under ``--format json`` the tensor-parallel plan plait infers for a model (the lines a
    user copies into ``options.tp_plan``) is a ``message`` event on stdout, said once (rank
    0's), not text on stderr where a program reading the events never sees it."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("STEPS", "1"))
    out = script_run(script, "--plan", "tp=2", "--format", "json", ranks=2)
    assert out.returncode == 0, out.stderr
    said = [e["text"] for e in events(out.stdout) if e["event"] == "message"]
    plans = [t for t in said if '"a": "colwise"' in t and '"b": "rowwise"' in t]
    assert len(plans) == 1, said
    assert "colwise" not in out.stderr, out.stderr


# A plan given in code under format="json": refused by plait.init (PLAN), or by
# run.parallelize for this model (a Linear alone, no blocks to split or checkpoint).
IN_CODE = """
import sys
import torch
import plait

run = plait.init(plan=PLAN, format="json")
model = run.parallelize(torch.nn.Linear(6, 3))
print("should not run")
"""


@pytest.mark.parametrize("ranks,plan,before,said", [
    (1, '"dp=3"', [], "= 3 != world size 1; make the degrees multiply to 1"),
    (1, '"activation_checkpointing=full"', ["plan"],
     "activation_checkpointing='full' needs repeated blocks"),
    pytest.param(1, '{"tp": 0}', [], "tp=0 must be a positive integer, e.g. tp=2",
                 marks=pytest.mark.slow),
    pytest.param(2, '"dp=3"', [], "= 3 != world size 2; make the degrees multiply to 2",
                 marks=pytest.mark.slow),
    pytest.param(2, '"tp=2"', ["plan"], "cannot infer a tensor-parallel plan for Linear",
                 marks=pytest.mark.slow)])
def test_a_bad_plan_in_code_is_one_error_event(tmp_path, ranks, plan, before, said):
    """A plan plait.init refuses (degrees that do not multiply to the world size, a degree
    of 0) or one run.parallelize refuses for the model, given in code under format="json":
    stdout is one error event (rank 0's: every rank refuses the same plan) naming the bad
    value and the fix, the traceback on stderr, exit 1 (torchrun's 1 too)."""
    script = tmp_path / "train.py"
    script.write_text(IN_CODE.replace("PLAN", plan))
    out = script_run(script, ranks=ranks)
    assert out.returncode == 1, (out.returncode, out.stderr)
    got = events(out.stdout)
    assert [e["event"] for e in got] == [*before, "error"], got
    error = got[-1]
    assert error["error"].startswith("ValueError: ") and said in error["error"], error
    assert error["exit_code"] == 1 and error["command"] == "train.py", error
    assert "rank" not in error, error
    assert error["traceback"].endswith(error["error"].split(": ", 1)[1]), error
    assert said in out.stderr and "Traceback" in out.stderr, out.stderr


def test_a_bad_plan_in_code_caught_by_the_script_writes_nothing(capsys):
    """plait.init's refusal under format="json" writes its error event only if it ends the
    process: a script that catches it sees nothing on stdout, and the hook left behind says
    nothing of any other exception."""
    import plait

    hook = sys.excepthook
    try:
        with pytest.raises(ValueError, match="!= world size 1") as caught:
            plait.init(plan="dp=3", format="json", seed=0)
        assert capsys.readouterr().out == ""
        other = RuntimeError("not the plan's")
        sys.excepthook(RuntimeError, other, None)
        assert capsys.readouterr().out == ""
        sys.excepthook(ValueError, caught.value, caught.value.__traceback__)
        [error] = events(capsys.readouterr().out)
        assert error["error"].startswith("ValueError: invalid plan: "), error
    finally:
        sys.excepthook = hook


def test_an_uncaught_exception_without_plait_run_ends_with_an_error_event(tmp_path):
    """The script raises after init: its traceback on stderr as always, and stdout's last
    line the error event naming the rank, with the traceback and exit code 1."""
    script = tmp_path / "boom.py"
    script.write_text("import plait\nrun = plait.init()\nprint('started', end='')\n"
                      "raise RuntimeError('it exploded')\n")
    out = script_run(script, "--format", "json")
    assert out.returncode == 1
    got = events(out.stdout)
    assert [e["event"] for e in got] == ["plan", "output", "error"], got
    assert got[1]["text"] == "started", got
    error = got[-1]
    assert error["error"] == "rank 0 (RuntimeError: it exploded)" and error["rank"] == 0, error
    assert error["exit_code"] == 1 and error["command"] == "boom.py", error
    assert error["traceback"].endswith("RuntimeError: it exploded"), error
    assert "RuntimeError: it exploded" in out.stderr


def test_json_stdout_wraps_lines_until_restored(capsys):
    """The stream plait.init installs under format="json": each line an event (an event as it
    is, a partial line ended by an event written whole or at restore); restore puts back the
    stdout and excepthook it found, so what prints after finish() is plain again."""
    hook = sys.excepthook
    found = install("t.py", 0)
    try:
        assert sys.stdout is found.events and sys.excepthook is not hook
        print("a", "b")
        print("half", end="")
        print(json_event("progress", step=1))
        print("tail", end="")
    finally:
        restore(found)
    assert sys.excepthook is hook
    print("plain")
    assert capsys.readouterr().out.splitlines() == [
        '{"event": "output", "text": "a b"}', '{"event": "output", "text": "half"}',
        '{"event": "progress", "step": 1}', '{"event": "output", "text": "tail"}', "plain"]


# ------------------------------------------------ every report command's --format json, parsed

# A model factory of the user's that prints (at import, when built: in the parent and in every
# worker), as user code does: none of it may reach a JSON report's stdout.
PRINTING_FACTORY = """
from examples.your_own_model import factory as base

print("importing my model")


def factory():
    print("building my model")
    return base()
"""

CHECKPOINT_SCRIPT = """
import sys
import torch
import plait

run = plait.init("single", checkpoint=sys.argv[1], quiet=True)
model = run.parallelize(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batch = (torch.randn(4, 4), torch.randint(0, 2, (4,)))
run.step(model, batch, torch.nn.functional.cross_entropy, opt)
run.finish()
"""

# (command, its arguments before --format json, whether the report is JSON Lines); {tmp} is
# the test's folder. Cheap ones run by default; those that start processes are slow.
REPORTS = [
    pytest.param("env", ["env"], False, id="env"),
    pytest.param("doctor", ["doctor"], False, id="doctor"),
    pytest.param("schedule", ["schedule", "--all", "--pp", "2", "-m", "4"], False,
                 id="schedule"),
    pytest.param("plan", ["plan", "--model", "printing:factory", "--cluster", "cpu",
                          "--devices", "2", "--global-batch", "8"], False, id="plan"),
    pytest.param("plan", ["plan", "--calibrate", "--profile-out", "{tmp}/cpu.yaml"], False,
                 id="plan-calibrate", marks=pytest.mark.slow),
    pytest.param("check", ["check", "--plan", "dp=2,sync_bn", "--steps", "1", "--model",
                           "printing:factory"], False, id="check", marks=pytest.mark.slow),
    pytest.param("comm", ["comm", "--plan", "dp=2", "--steps", "1", "--model", "tiny",
                          "--global-batch", "4"], False, id="comm", marks=pytest.mark.slow),
    pytest.param("bench", ["bench", "comm", "--ops", "all_reduce", "--max-bytes", "1K",
                           "--nproc", "2", "--iters", "1", "--warmup", "0"], False,
                 id="bench-comm", marks=pytest.mark.slow),
    pytest.param("export", ["export", "{tmp}/ckpt", "--to", "{tmp}/m.safetensors"], False,
                 id="export", marks=pytest.mark.slow),
    pytest.param("run", ["run", "--nproc", "2", "{tmp}/train.py"], True, id="run",
                 marks=pytest.mark.slow),
    pytest.param("demo", ["demo", "--steps", "2"], True, id="demo", marks=pytest.mark.slow),
]


def test_the_table_holds_every_command():
    """Each command `plait --help` lists has a row below: a new one must say its JSON."""
    from plait.cli import build_parser

    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    assert {p.values[0] for p in REPORTS} == set(sub.choices), sorted(sub.choices)


@pytest.mark.parametrize("command, args, lines", REPORTS)
def test_every_report_in_json_is_json_alone_on_stdout(tmp_path, command, args, lines):
    """``--format json`` of every command, run once for real: stdout parses as one JSON
    document (JSON Lines for run and demo, every line an event), with nothing else on it; the
    script's own prints are events (run), a model factory's are on stderr (plan, check)."""
    (tmp_path / "printing.py").write_text(PRINTING_FACTORY)
    (tmp_path / "train.py").write_text(SCRIPT.replace("STEPS", "2"))
    if command == "export":
        (tmp_path / "save.py").write_text(CHECKPOINT_SCRIPT)
        made = subprocess.run([sys.executable, "save.py", str(tmp_path / "ckpt")], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                              text=True, timeout=240)
        assert made.returncode == 0, made.stderr
    out = plait(*[a.format(tmp=tmp_path) for a in args], "--format", "json", cwd=tmp_path,
                timeout=500)
    assert out.returncode in ((0, 1) if command == "doctor" else (0,)), out.stderr
    if lines:
        got = events(out.stdout)
        assert got[-1]["event"] in ("summary", "result"), got[-1]
    else:
        assert isinstance(json.loads(out.stdout), (dict, list)), out.stdout[:500]
    if "printing:factory" in args:  # the factory's prints are on stderr, not lost
        assert "importing my model" in out.stderr and "building my model" in out.stderr
