"""`plait COMMAND --help` teaches: a one-line summary, what the command does, examples that
parse, and the unit of every number a flag takes; every report answers in JSON."""

import argparse
import json
import re
import shlex

import pytest

from plait.cli import build_parser, main

# A number's unit, as the flags' help says it.
UNITS = re.compile(r"\b(seconds|steps|sequences|tokens|processes|ranks|nodes|devices|bytes|GB|"
                   r"fraction|calls|microbatches|stages|plans|times|index|learning rate|"
                   r"absolute bound)\b")
# Commands that print no report of their own: `bench` only groups benchmarks. (`run` and
# `demo` train: their --format json is the run's events, tests/test_cli_json.py.)
NO_REPORT = {"bench"}


def _commands() -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, the one-line summary `--help` lists) for every command and subcommand."""
    found = []
    todo = [build_parser()]
    while todo:
        parser = todo.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                summaries = {a.dest: a.help for a in action._choices_actions}
                for name, child in action.choices.items():
                    found.append((child.prog.removeprefix("plait "), child, summaries[name]))
                    todo.append(child)
    return sorted(found, key=lambda c: c[0])


COMMANDS = _commands()


def test_every_command_is_covered():
    assert {name for name, _, _ in COMMANDS} == {
        "env", "run", "check", "demo", "plan", "schedule", "comm", "bench", "bench comm",
        "export", "doctor"}


@pytest.mark.parametrize("name, parser, summary", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_help_opens_with_one_line_and_ends_with_examples_that_parse(name, parser, summary):
    text = parser.format_help()
    after_usage = text.split("\n\n")[1]
    assert after_usage == f"{summary[0].upper()}{summary[1:]}.", text
    assert "\n" not in after_usage and len(after_usage) <= 80, after_usage
    assert re.search(r"\n\nexamples?:\n", text), text
    examples = [line.strip() for line in parser.epilog.splitlines()[1:]
                if not line.strip().startswith("#")]
    assert examples and all(e.startswith(f"plait {name.split()[0]}") for e in examples), examples
    for example in examples:  # each one is a command plait takes, as written
        build_parser().parse_args(shlex.split(example)[1:])


@pytest.mark.parametrize("name, parser, summary", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_flag_says_what_it_takes_and_in_which_unit(name, parser, summary):
    for action in parser._actions:
        if action.nargs == 0 or isinstance(action, argparse._SubParsersAction):
            continue  # switches (--help, --all) and the subcommand list
        assert action.help, (name, action.option_strings or action.dest)
        if action.type in (int, float):
            flag = action.option_strings[0]
            assert UNITS.search(action.help), f"plait {name} {flag}: {action.help}"
            assert action.metavar, f"plait {name} {flag} shows {action.dest.upper()}"
        if action.dest == "format":
            assert "json" in action.choices and "json for programs" in action.help


@pytest.mark.parametrize("name, parser, summary", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_report_has_format_json(name, parser, summary):
    has = any(a.dest == "format" for a in parser._actions)
    assert has == (name not in NO_REPORT), name


def test_schedule_answers_in_json(capsys):
    """`plait schedule --format json`: the grid the text draws, as data (GPipe, 2 ranks, 2
    microbatches: each rank idle for p - 1 = 1 of 3 forward and 3 backward slots)."""
    assert main(["schedule", "--schedule", "gpipe", "--pp", "2", "-m", "2", "--format",
                 "json"]) == 0
    [data] = json.loads(capsys.readouterr().out)
    assert data["grid"] == [["F0", "F1", ".", ".", "B0", "B1"],
                            [".", "F0", "F1", "B0", "B1", "."]]
    assert data["bubble"] == pytest.approx(1 / 3)
