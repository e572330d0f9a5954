"""`plait run`'s launcher starts without importing torch: its workers import torch themselves,
and a launcher that imports it too pays seconds of CPU per job (on a 2-core machine, per test
that launches a job) before any worker starts."""

import json
import subprocess
import sys
from pathlib import Path

import plait

ROOT = Path(__file__).resolve().parents[1]


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(*sys.modules)"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_the_launcher_and_its_parser_import_no_torch():
    loaded = _modules_after("import plait.cli, plait.launch, plait.spawn\n"
                            "plait.cli.build_parser(only='run')")
    assert "plait.launch" in loaded
    assert not {m for m in loaded if m == "torch" or m.startswith("torch.")}
    # every command's arguments, export's (the checkpoint package's) included
    loaded = _modules_after("import plait.cli\nplait.cli.build_parser()")
    assert "plait.checkpoint.export" in loaded
    assert not {m for m in loaded if m == "torch" or m.startswith("torch.")}


def test_the_full_parser_still_has_every_command():
    parser = __import__("plait.cli", fromlist=["build_parser"]).build_parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse keeps them only here
    assert set(commands) == {"env", "run", "check", "demo", "plan", "schedule", "comm", "bench",
                             "export", "doctor"}
    # with only="run": every command is listed (for --help and "invalid choice" errors), but
    # only run's arguments are built (importing every command's module costs tenths of a
    # second)
    run_only = __import__("plait.cli", fromlist=["build_parser"]).build_parser(only="run")
    listed = run_only._subparsers._group_actions[0].choices
    assert set(listed) == set(commands)
    assert "--nproc" in listed["run"]._option_string_actions
    assert "--model" not in listed["plan"]._option_string_actions


def test_the_package_names_resolve_on_first_use():
    from plait.parallel.layout import Layout, layout_of
    from plait.plan import Plan, PlanOptions
    from plait.runtime import Run, init

    assert (plait.Layout, plait.layout_of, plait.Plan, plait.PlanOptions, plait.Run,
            plait.init) == (Layout, layout_of, Plan, PlanOptions, Run, init)
    assert set(plait.__all__) <= set(dir(plait))
    namespace: dict[str, object] = {}
    exec("from plait import *", namespace)
    assert namespace["init"] is init and namespace["__version__"] == plait.__version__
    try:
        plait.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("plait.no_such_name resolved")


# Every command's help page (its arguments are built for it alone): `plait export --help` is
# parsed by the module that reads checkpoints, which must not import torch.distributed.checkpoint
# to say what it takes.
_HELP = (["--help"], *([name, "--help"] for name in (
    "env", "run", "check", "demo", "plan", "schedule", "comm", "bench", "export", "doctor")),
    ["bench", "comm", "--help"])

# Commands that price or draw from numbers alone; each is run in turn in one fresh interpreter.
_TORCHLESS = (
    *_HELP,
    ["schedule", "--schedule", "1f1b", "--pp", "4", "-m", "8"],
    ["plan", "--model", "llama-8b", "--cluster", "dgx-h100", "--nodes", "2",
     "--global-batch", "256", "--seq", "4096", "--format", "json"],
    ["plan", "--model", "llama-8b", "--cluster", "dgx-h100", "--global-batch", "64",
     "--seq", "2048", "--plan", "dp_shard=8,zero=3,mp=bf16,accum=2"],
    ["plan", "--model", "llama-70b", "--cluster", "dgx-h100", "--devices", "1",
     "--global-batch", "8", "--seq", "4096"],
)


def test_plan_on_a_preset_schedule_and_help_import_no_torch():
    """Pricing a preset model is arithmetic on its config: `plait plan --model llama-8b`
    (a search, a given --plan, a model that fits nowhere), `plait schedule` of a schedule plait
    orders itself, every help page and `plait export` refusing a checkpoint that is not there
    run without importing torch (seconds of CPU each time)."""
    refused = ["export", "MISSING", "--to", "m.safetensors"]
    code = ("import contextlib, io, json, sys\n"
            "import plait.cli\n"
            "seen = []\n"
            f"for argv in {[*_TORCHLESS, refused]!r}:\n"
            "    out, err = io.StringIO(), io.StringIO()\n"
            "    try:\n"
            "        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
            "            code = plait.cli.main(argv)\n"
            "    except SystemExit as exc:\n"
            "        code = exc.code\n"
            "    seen.append([argv, code, len(out.getvalue()), err.getvalue(),\n"
            "                 'torch' in sys.modules])\n"
            "print(json.dumps(seen))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    # each command ran to its usual end (the last plan fits nowhere: exit 1) and printed its
    # answer; the export, its one-line refusal
    assert [(argv, code) for argv, code, *_ in seen] == [
        *((argv, 0) for argv in _TORCHLESS[:-1]), (_TORCHLESS[-1], 1), (refused, 2)]
    assert all(printed > 200 for _, _, printed, _, _ in seen[:-1]), seen
    assert "checkpoint MISSING does not exist" in seen[-1][3], seen[-1]
    # the first command that imported torch (it stays imported for the ones after it)
    assert next((" ".join(argv) for argv, *_, torch in seen if torch), None) is None, seen
