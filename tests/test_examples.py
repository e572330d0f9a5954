"""Every example runs as its docstring says (one short run each): examples must not rot."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def plait_run(nproc, script, *args):
    return _run([sys.executable, "-m", "plait.cli", "run", "--nproc", str(nproc),
                 f"examples/{script}", *args])


def plait_cli(capsys, monkeypatch, *argv):
    """``plait ARGV`` run from the repository's root in this process (plait.cli.main, which the
    ``plait`` command calls): its workers come from this session's fork server instead of a
    new interpreter that imports torch and starts a fork server of its own. -> (exit code,
    stdout, stderr)."""
    from plait.cli import main

    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


EXAMPLES = [
    (2, "ddp.py", [], "max |param diff| vs one device"),
    (2, "pipeline.py", ["--plan", "pp=2,schedule=1f1b,mb=4", "--steps", "4"], "run summary"),
    (2, "tensor_parallel.py", ["--plan", "tp=2,sp=true", "--steps", "4"], "run summary"),
    (2, "zero.py", ["--plan", "dp_shard=2,zero=3", "--steps", "4"], "memory per rank"),
    (2, "context_parallel.py", ["--plan", "cp=2", "--steps", "3"], "each rank holds 128"),
    (4, "nd_parallel.py", ["--steps", "3", "--accelerator", "cpu"], "communication ledger"),
    (2, "auto_plan.py", ["--steps", "3", "--accelerator", "cpu"], "training under the winner"),
    (2, "hf_model.py", ["--plan", "tp=2,sp", "--steps", "4", "--accelerator", "cpu"],
     "mean over the real tokens"),
]
# ddp.py runs under `plait run` in the default suite (the command its docstring gives); the
# others run there too under -m slow, and by default as the body of plait.spawn's ranks.
LAUNCHED = "ddp.py"


@pytest.mark.parametrize("nproc, script, args, expect", [
    case if case[1] == LAUNCHED else pytest.param(*case, marks=pytest.mark.slow)
    for case in EXAMPLES])
def test_example_runs(nproc, script, args, expect):
    out = plait_run(nproc, script, *args)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert expect in out.stdout


@pytest.mark.parametrize("nproc, script, args, expect",
                         [case for case in EXAMPLES if case[1] != LAUNCHED])
def test_example_runs_on_spawned_ranks(nproc, script, args, expect):
    """The same script, arguments and expected output as under `plait run`, rank 0's stdout,
    on ranks forked from a server that has imported torch, without the launcher, torchrun's
    agent and a fresh interpreter per rank (seconds of CPU each on a 2-core machine)."""
    from plait.spawn import run_distributed

    from ._workers_examples import run_example

    printed = run_distributed(run_example, nproc, script, args, timeout=240)
    assert expect in printed[0], printed[0][-2000:]


def test_examples_take_the_accelerator_flag_plait_init_reads():
    """--accelerator and --format are read by plait.init() from the script's command line, like
    --plan: an example whose own parser is strict (parse_args) must declare them, or the
    documented `--accelerator cuda` (or `plait run --format json`, which passes --format json
    to the script) stops it with "unrecognized arguments"."""
    strict = [p for p in sorted((ROOT / "examples").glob("*.py"))
              if "plait.init(" in p.read_text() and "parse_args()" in p.read_text()]
    assert len(strict) >= 5
    for path in strict:
        for flag in ("--accelerator", "--format"):
            assert f'"{flag}"' in path.read_text(), f"{path.name} does not declare {flag}"


def test_collectives_example():
    out = _run([sys.executable, "examples/collectives.py"])
    assert out.returncode == 0, out.stderr[-3000:]
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"):
        assert op in out.stdout


def test_checkpoint_resume_example(tmp_path):
    common = ["--steps", "8", "--every", "2", "--checkpoint", str(tmp_path / "ckpt"),
              "--batch-size", "8", "--seq-len", "32"]
    first = plait_run(2, "checkpoint_resume.py", "--plan", "dp=2", "--stop-at", "4", *common)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert "FINAL step 4" in first.stdout
    # Resumed by one process: the dp=2 checkpoint loads under another world size.
    second = _run([sys.executable, "examples/checkpoint_resume.py", *common])
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "resuming from" in second.stdout and "step 4" in second.stdout
    assert "FINAL step 8" in second.stdout


def test_your_own_model_checked_then_trained(capsys, monkeypatch):
    """The README's first step on a new model: `plait check --model pkg.module:factory`."""
    import json

    code, printed, said = plait_cli(capsys, monkeypatch, "check", "--plan", "dp=2,sync_bn",
                                    "--model", "examples.your_own_model:factory", "--steps", "2",
                                    "--format", "json")
    assert code == 0, printed[-2000:] + said[-3000:]
    result = json.loads(printed)
    assert result["ok"] and result["limits"] == {"loss": 1e-5, "param": 1e-3}
    out = plait_run(2, "your_own_model.py", "--plan", "dp=2,sync_bn", "--steps", "3")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "final loss" in out.stdout and "blocks.0.norm.weight" not in out.stderr


def test_hf_model_factory_is_checked(capsys, monkeypatch):
    """README names examples/hf_model.py as the Hugging Face form of `--model pkg.mod:factory`."""
    import json

    pytest.importorskip("transformers")
    code, printed, said = plait_cli(capsys, monkeypatch, "check", "--plan", "dp=2", "--model",
                                    "examples.hf_model:factory", "--optimizer", "sgd",
                                    "--steps", "2", "--format", "json")
    assert code == 0, printed[-2000:] + said[-3000:]
    assert json.loads(printed)["ok"]


def test_check_model_spec_that_does_not_import(capsys, monkeypatch):
    code, _, said = plait_cli(capsys, monkeypatch, "check", "--plan", "dp=2", "--model",
                              "no_such_module:factory")
    assert code == 2
    lines = said.strip().splitlines()
    assert len(lines) == 1 and "cannot import 'no_such_module'" in lines[0], said


def test_tpu_example_without_an_accelerator_trains_on_the_cpu():
    """examples/tpu.py is train.py with the XLA diagnostics' flags; without --accelerator it
    runs where it is (the XLA CPU device runs it in tests/xla)."""
    out = _run([sys.executable, "examples/tpu.py", "--steps", "3", "--batch-size", "4",
                "--seq-len", "32"])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "FINAL" in out.stdout and "on cpu" in out.stdout
