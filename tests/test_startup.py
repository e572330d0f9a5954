"""`plait run`'s launcher starts without importing torch: its workers import torch themselves,
and a launcher that imports it too pays seconds of CPU per job (on a 2-core machine, per test
that launches a job) before any worker starts."""

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


def test_the_full_parser_still_has_every_command():
    parser = __import__("plait.cli", fromlist=["build_parser"]).build_parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse keeps them only here
    assert set(commands) == {"env", "run", "check", "demo", "plan", "schedule", "comm", "bench",
                             "export", "doctor"}
    # with only="run": every command is listed (for --help and "invalid choice" errors), but
    # only run's arguments are built (the others' modules import torch)
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
