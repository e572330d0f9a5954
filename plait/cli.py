"""The `plait` command: thin — it parses arguments and calls the library.

Every command that prints a report also takes ``--format json``. Errors in what the user typed
(a bad plan, a missing script, a zero count) are one line on stderr and exit code 2; nothing is
started.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import signal
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

from .outputs import add_format

EPILOG = """examples:
  plait env                                   what this machine has
  plait demo                                  train the tiny model on 2 CPU processes
  plait run --nproc 4 train.py --plan dp=2,tp=2
  plait check --plan dp=2,tp=2                same training as one device? (loss, parameters)
  plait plan --model llama-7b --cluster dgx-h100 --global-batch 512 --seq 4096
  plait comm --plan dp=2                      bytes per mesh axis: measured vs closed form
  plait export ckpt/ --to model.safetensors   a checkpoint as one plain file
  plait bench comm --ops all_reduce --max-bytes 16M
  plait doctor                                what usually breaks a start, with fixes
"""


def _env(args: argparse.Namespace) -> int:
    from . import env

    info = env.collect()
    print(json.dumps(info, indent=2) if args.format == "json" else env.format_text(info))
    return 0


def _run(args: argparse.Namespace) -> int:
    from . import launch

    return launch.command(args)


def _check(args: argparse.Namespace) -> int:
    from . import check

    return check.command(args)


def _demo(args: argparse.Namespace) -> int:
    from . import launch

    if args.steps < 1:  # the demo's learning-rate schedule needs a step to schedule
        raise ValueError(f"--steps {args.steps} must be >= 1, e.g. --steps 300")
    script_args = ["--steps", str(args.steps)]
    if args.plan:
        script_args += ["--plan", args.plan]
    cfg = launch.LaunchConfig(script="plait.demo", module=True, nproc=args.nproc,
                              script_args=tuple(script_args), format=args.format)
    return launch.launch(cfg)


def _export(args: argparse.Namespace) -> int:
    from .checkpoint import export

    return export.command(args)


def _comm(args: argparse.Namespace) -> int:
    from .comm import cli as comm_cli

    return comm_cli.comm_command(args)


def _bench(args: argparse.Namespace) -> int:
    from .comm import cli as comm_cli

    return comm_cli.bench_comm_command(args)


def _plan(args: argparse.Namespace) -> int:
    from .planner import cli as planner_cli

    return planner_cli.plan_command(args)


def _schedule(args: argparse.Namespace) -> int:
    from .parallel import schedules

    return schedules.schedule_command(args)


def _doctor(args: argparse.Namespace) -> int:
    from .diagnostics import doctor

    return doctor.command(args)


class _CanonicalFirst(argparse.HelpFormatter):
    """Help that shows a flag by its one canonical spelling (the first long one, with any
    short form): the others, kept so that commands typed from older docs still run, are named
    in the flag's help text instead of crowding the listing."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if len(longs) < 2:
            return super()._format_action_invocation(action)
        shown = [longs[0], *(o for o in action.option_strings if not o.startswith("--"))]
        if action.nargs == 0:
            return ", ".join(shown)
        metavar = self._format_args(action, self._get_default_metavar_for_optional(action))
        return ", ".join(f"{o} {metavar}" for o in shown)


class _Paragraphs(argparse.HelpFormatter):
    """Prose filled to the terminal's width, paragraph by paragraph (a blank line between
    them); a block of lines written one per line (examples, commands to copy) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(block if "\n" in block.strip("\n")
                           else "\n".join(self._split_lines(block, width - len(indent), indent))
                           for block in text.split("\n\n"))

    def _split_lines(self, text: str, width: int, indent: str = "") -> list[str]:
        # Never inside a flag or a name (--rdzv-endpoint, all_gather): they are copied.
        text = " ".join(text.split())
        return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False, break_long_words=False)


class Parser(argparse.ArgumentParser):
    """argparse, whose own errors (a value of the wrong type, a choice not offered, an unknown
    flag) are one plait line that names the bad value and the fix, not a usage block above a
    terse "argument --x/--y: invalid int value"; exit code 2 as before, and, under
    ``--format json``, the same message as JSON (:func:`_parse`)."""

    def __init__(self, *args: object, **kwargs: object):
        base = kwargs.get("formatter_class", _Paragraphs)
        assert isinstance(base, type)
        kwargs["formatter_class"] = type("Formatter", (_CanonicalFirst, base), {})
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    # Set on `plait run`'s parser, to a command that shows where a script's own flags go: what
    # follows its script is the script's, and a flag typed before the script that plait run
    # does not take is most often the script's own (--plan).
    script_flags_after: str | None = None
    _given: list[str] | None = None  # the words this parser was given (parse_known_args)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {self.explain(message)}\n")

    def _unknown(self) -> list[str]:
        """The flags among the words given that this parser does not take (argparse reports a
        missing command or script first and would never name them)."""
        longs = [o for a in self._actions for o in a.option_strings]
        takes_value = {o for a in self._actions if a.nargs != 0 for o in a.option_strings}
        out: list[str] = []
        words = iter(self._given or [])
        for word in words:
            if word == "--":
                break
            if not word.startswith("-") or word == "-":
                if self.script_flags_after is not None:
                    break  # plait run's script: the rest is the script's
                continue
            name = word.split("=", 1)[0]
            known = [o for o in longs if o == name or (name.startswith("--") and
                                                       self.allow_abbrev and o.startswith(name))]
            if not known:
                out.append(word)
            elif "=" not in word and known[0] in takes_value:
                next(words, None)  # its value
        return out

    def _unknown_said(self, unknown: str) -> str:
        where = ""
        if self.script_flags_after is not None:
            where = (f" (not flags of {self.prog}; the script's own flags go after the script: "
                     f"`{self.script_flags_after}`)")
        return f"unknown argument(s) {unknown}{where}"

    def explain(self, message: str) -> str:
        """argparse's ``message`` as a sentence with the fix (unchanged when not known)."""
        said = re.fullmatch(r"argument (\S+): (.*)", message, re.S)
        if said is None:
            unknown = re.fullmatch(r"unrecognized arguments: (.*)", message)
            if unknown:
                return (f"{self._unknown_said(unknown.group(1))}; `{self.prog} --help` lists "
                        f"the flags")
            required = re.fullmatch(r"the following arguments are required: (.*)", message)
            if required:
                stray = self._unknown()
                missing = self._required(required.group(1).split(", "))
                return f"{self._unknown_said(' '.join(stray))}; {missing}" if stray else missing
            return message
        names, what = said.group(1).split("/"), said.group(2)
        action = next((a for a in self._actions if names[0] in a.option_strings), None)
        flag = names[0]
        both = re.fullmatch(r"not allowed with argument (\S+)", what)
        if both:
            other = both.group(1).split("/")[0]
            return (f"{flag} and {other} set the same thing two ways; give one of them "
                    f"(`{self.prog} --help` says what each means)")
        example = self._example(action)
        bad = re.fullmatch(r"invalid (int|float) value: (.*)", what)
        if bad:
            kind = "a whole number" if bad.group(1) == "int" else "a number"
            return f"{flag} {bad.group(2)} is not {kind}; pass one, e.g. {flag} {example}"
        choice = re.fullmatch(r"invalid choice: (\S+) \(choose from (.*)\)", what)
        if choice and not flag.startswith("-"):  # a command: `plait foo`, `plait bench foo`
            options = choice.group(2).replace("'", "")
            stray = self._unknown()
            given = self._given or []
            word = choice.group(1).strip("'")
            at = given.index(word) if word in given else 0
            if at and given[at - 1] in stray:
                # `plait bench --format json`: the value of a flag that belongs to the command
                # (`plait bench comm --format json`) was read as the command
                return (f"{self._unknown_said(' '.join(stray))}; the command comes first, one "
                        f"of {options}, then its flags: `{self.prog} COMMAND --help` lists "
                        f"them")
            import difflib

            near = difflib.get_close_matches(word, options.split(", "), n=1)
            meant = f"did you mean '{near[0]}'? " if near else ""
            return (f"{choice.group(1)} is not a command of {self.prog} ({options}); "
                    f"{meant}`{self.prog} --help` says what each does")
        if choice:
            options = choice.group(2).replace("'", "")
            return f"{flag} {choice.group(1)} is not one of {options}; e.g. {flag} {example}"
        if what.startswith("expected one argument"):
            return f"{flag} needs a value, e.g. {flag} {example}"
        return f"{flag}: {what}"

    def _required(self, names: list[str]) -> str:
        """What is missing, by name: a command (``plait bench`` with none), else the arguments
        (not the script's own arguments after ``plait run``'s script, which may be none)."""
        def action(name: str) -> argparse.Action | None:
            return next((a for a in self._actions if name in (a.metavar, a.dest)
                         or name == "/".join(a.option_strings)), None)

        for name in names:
            found = action(name)
            if isinstance(found, argparse._SubParsersAction):
                return (f"a command is required, one of {', '.join(found.choices)}; "
                        f"`{self.prog} --help` says what each does")
        names = [n for n in names if (a := action(n)) is None or a.nargs != argparse.REMAINDER]
        verb = "is" if len(names) == 1 else "are"
        return f"{', '.join(names)} {verb} required; `{self.prog} --help` says what it takes"

    @staticmethod
    def _example(action: argparse.Action | None) -> str:
        """A value the flag takes: its default, else its first choice, else the one its help
        gives ("e.g. dp=2,tp=2"), else a typical one."""
        if action is None:
            return "VALUE"
        if action.default not in (None, argparse.SUPPRESS) and not isinstance(action.default,
                                                                              bool):
            return f"{action.default:g}" if isinstance(action.default, float) \
                else str(action.default)
        if action.choices:
            return str(next(iter(action.choices)))
        given = re.search(r"\be\.g\. '?([^\s';)]+)", action.help or "")
        if given:
            return given.group(1).rstrip(",.")
        return {int: "8", float: "1.0"}.get(action.type, action.metavar or "VALUE")  # type: ignore[call-overload]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``only``, one whose other commands have no arguments.

    Each command's arguments live in the module that runs it. None of those modules imports
    torch when loaded (each imports it in the functions that need it), but together they cost
    tenths of a second (the planner's and the pipeline schedules' tables): ``main`` builds only
    the arguments of the command it was given."""
    from . import __version__

    def wanted(name: str) -> bool:
        return only is None or only == name

    parser = Parser(
        prog="plait", description="Scale PyTorch training from one device to many: data, "
        "sharded, tensor and pipeline parallelism, planned and measured.", epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"plait {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands: dict[str, Callable[[argparse.Namespace], int]] = {}

    p = _command(sub, "env", "accelerators, backends and versions on this machine",
                 "List accelerators (with memory and peak FLOP/s where known), process-group "
                 "backends and package versions.",
                 ["plait env", "plait env --format json"])
    add_format(p)
    commands["env"] = _env

    p = _command(
        sub, "run", "launch a training script on N processes (torchrun underneath)",
        "Launch SCRIPT on N processes per node. Standalone on 127.0.0.1 with a free port unless "
        "--rdzv-endpoint is given; SLURM's variables are honoured. plait run's flags go before "
        "SCRIPT; everything after it is the script's own (--plan, --accelerator, your flags). "
        "The script's --plan is checked against the world size before anything starts. Rank "
        "0's output is shown live; a failing rank's traceback is shown once.\n\n"
        "--format json: JSON Lines on stdout, one event per line (plan, progress, ledger, "
        "summary; the script's own prints as output events; error last when the run fails); "
        "tracebacks and warnings stay on stderr.",
        ["plait run --nproc 4 train.py --plan dp=2,tp=2",
         "plait run --nproc 2 --format json train.py --plan dp=2",
         "plait run --nproc 2 -m mypkg.train --plan dp=2",
         "# two machines, 8 processes each, the same command on both but --node-rank:",
         "plait run --nproc 8 --nnodes 2 --node-rank 0 --rdzv-endpoint gpu01:29400 train.py",
         "# (torchrun picks the node that holds rank 0, by host name; the other node prints",
         "# where rank 0's progress is)"])
    if wanted("run"):
        from . import launch

        launch.add_arguments(p)
    assert isinstance(p, Parser)
    p.script_flags_after = "plait run --nproc 2 train.py --plan dp=2"
    commands["run"] = _run

    p = _command(
        sub, "check", "prove a layout trains the same model as one device",
        "Train --model (your pkg.module:function returning (model, dataset, loss_fn), a "
        "collate_fn fourth where items need one, or a reference-model preset) for a few "
        "steps under --plan and on one device (same seed, "
        "same batches); compare the loss of every step and every parameter. Exit 1 when they "
        "differ.",
        ["plait check --plan dp=2,tp=2",
         "plait check --plan dp=2,sync_bn --model examples.your_own_model:factory",
         "plait check --plan pp=2,microbatches=4 --steps 3 --format json"])
    if wanted("check"):
        from . import check_args  # no torch, as launch

        check_args.add_arguments(p)
    commands["check"] = _check

    p = _command(sub, "demo", "the main job: tiny transformer on Shakespeare, 2 processes",
                 "Train the tiny reference transformer on the bundled corpus with N processes "
                 "on CPU; prints the plan, progress, final loss vs the corpus's unigram entropy, "
                 "throughput, the run summary and the communication ledger (with --format "
                 "json: as JSON Lines, one event per line, as plait run does).",
                 ["plait demo", "plait demo --nproc 4 --plan dp=2,tp=2 --steps 100",
                  "plait demo --steps 20 --format json"])
    p.add_argument("--nproc", type=int, default=2, metavar="N",
                   help="processes to start (default: 2)")
    p.add_argument("--steps", type=int, default=300, metavar="N",
                   help="optimizer steps (default: 300)")
    p.add_argument("--plan", default=None, help="layout, e.g. dp=2,tp=2 (default: data "
                   "parallel over all processes)")
    add_format(p)
    commands["demo"] = _demo

    p = _command(
        sub, "plan", "rank layouts for a model on a cluster before buying hardware",
        "Search data, ZeRO, tensor, sequence and pipeline layouts for --model on --cluster; "
        "print a ranked table (step time, tokens/s, TFLOP/s and MFU per device, memory per "
        "device, bytes per mesh axis, bubble) and why the winner wins. --plan evaluates one "
        "given layout. Exit 1 when nothing fits.",
        ["plait plan --model llama-7b --cluster dgx-h100 --nodes 2 --global-batch 512 "
         "--seq 4096",
         "plait plan --model llama-7b --cluster dgx-h100 --global-batch 64 --seq 2048 "
         "--plan dp_shard=8,zero=3,mp=bf16,accum=2",
         "plait plan --model examples.your_own_model:factory --cluster cpu --devices 4 "
         "--global-batch 32"])
    if wanted("plan"):
        from .planner import cli as planner_cli

        planner_cli.add_plan_arguments(p)
    commands["plan"] = _plan

    p = _command(
        sub, "schedule", "print a pipeline schedule as a step x rank grid, without running it",
        "Print a pipeline schedule (gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zb, "
        "zbv) as a step x rank grid: F<mb> forward, B<mb> backward (I/W: the input- and "
        "weight-gradient halves of zero-bubble schedules), @<stage> when a rank holds several "
        "stages, '.' idle; with the theoretical bubble and microbatches in flight.",
        ["plait schedule --schedule interleaved_1f1b --pp 4 -m 8 -v 2",
         "plait schedule --all --pp 2 -m 4 --format json"])
    if wanted("schedule"):
        from .parallel import schedules

        schedules.add_schedule_arguments(p)
    commands["schedule"] = _schedule

    p = _command(
        sub, "comm", "measure the bytes a plan sends per mesh axis, beside the closed form",
        "Train --model (a reference-model preset, or your pkg.module:function returning "
        "(model, dataset, loss_fn), a collate_fn fourth where items need one, as plait check "
        "takes) for a few steps under --plan with the communication ledger on; print per mesh "
        "axis and collective the measured bytes per rank per step, the closed-form prediction "
        "(data, ZeRO, tensor, sequence and pipeline parallelism; a note says why where there "
        "is none), their ratio, counts, time and bandwidth: the table run.finish() prints.",
        ["plait comm --plan tp=2,sp=true --steps 1",
         "plait comm --plan dp_shard=2,zero=3 --model tiny --global-batch 8 --format json",
         "plait comm --plan tp=2 --model examples.your_own_model:factory --global-batch 8",
         "plait comm --plan dp=2 --plot comm.png"])
    if wanted("comm"):
        from .comm import cli as comm_cli

        comm_cli.add_comm_arguments(p)
    commands["comm"] = _comm

    p = _command(sub, "bench", "benchmarks that print measured figures",
                 "One benchmark so far, `plait bench comm`: collective bandwidth over a size "
                 "sweep. Its flags go after its name; `plait bench comm --help` lists them.",
                 ["plait bench comm --ops all_reduce --max-bytes 16M"])
    bench_sub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    q = _command(
        bench_sub, "comm", "collective bandwidth over a size sweep (algbw, busbw as nccl-tests)",
        "Broadcast, reduce, all-reduce, all-gather, reduce-scatter, all-to-all and send/recv "
        "over a size sweep on --nproc local ranks; algbw = size/time, busbw = algbw x bus "
        "factor (nccl-tests' definitions). --format json feeds the planner's calibration.",
        ["plait bench comm --ops all_reduce,all_gather --max-bytes 16M --nproc 4",
         "plait bench comm --backend nccl --nproc 8 --format json"])
    if wanted("bench"):
        from .comm import cli as comm_cli

        comm_cli.add_bench_comm_arguments(q)
    commands["bench"] = _bench

    p = _command(
        sub, "export", "a checkpoint's model as one safetensors file (or a Hugging Face folder)",
        "Read the model tensors of CHECKPOINT (saved under any plan and world size) at full "
        "size and write them, under the model's own parameter names, to one .safetensors file "
        "usable without plait or torch.distributed; for a Hugging Face model, --to DIR writes "
        "DIR/model.safetensors and DIR/config.json.",
        ["plait export ckpt/ --to model.safetensors",
         "plait export ckpt/step-00000300 --to model.safetensors --format json"])
    if wanted("export"):
        from .checkpoint import export

        export.add_arguments(p)
    commands["export"] = _export

    p = _command(
        sub, "doctor", "check this machine for what usually breaks a start (TPU, GPU, network)",
        "Pass/warn/fail checks, each with its fix: torch vs torch-xla / torch-tpu versions, "
        "PJRT_DEVICE, a TPU held by another process, libtpu, NCCL peer-to-peer between GPUs, "
        "InfiniBand for multi-node jobs, the master address and port, the gloo interface on one "
        "node, the world-size variables. Exit 1 when a check fails.",
        ["plait doctor", "plait doctor --format json"])
    add_format(p)
    commands["doctor"] = _doctor

    parser.set_defaults(_commands=commands, _parsers=sub.choices)
    return parser


def _command(sub: argparse._SubParsersAction, name: str, summary: str, details: str,
             examples: list[str]) -> argparse.ArgumentParser:
    """A command's parser whose help opens with the one line `plait --help` lists for it,
    then what it does, and ends with commands to copy (``# `` lines are comments)."""
    lines = "\n".join(f"  {e}" for e in examples)
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=summary, description=f"{summary[0].upper()}{summary[1:]}.\n\n{details}",
        epilog=f"example{'s' if len(examples) > 1 else ''}:\n{lines}")
    return parser


def main(argv: list[str] | None = None) -> int:
    from .spawn import WorkerError

    argv = sys.argv[1:] if argv is None else list(argv)
    # No command (`plait --help`, `plait --version`): the top-level help lists the commands,
    # none of their arguments, so none is built.
    parser = build_parser(only=next((a for a in argv if not a.startswith("-")), ""))
    args = _parse(parser, argv)
    if not args.command:
        parser.print_help()
        return 2
    # "bench comm", as the failure line names it (`plait bench comm: failed: ...`)
    args._named = command_parsers(parser, args)[-1].prog.removeprefix(f"{parser.prog} ")
    try:
        with _signals_interrupt():
            code: int = args._commands[args.command](args)
            sys.stdout.flush()  # here, where a reader that has gone is caught below
            return code
    except BrokenPipeError:  # the reader stopped early (`plait plan --format json | head`)
        # Python's exit would flush into the closed pipe again and print a second error:
        # point stdout at /dev/null and end as a process stopped by SIGPIPE does.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + int(getattr(signal, "SIGPIPE", 13))
    except ValueError as exc:  # a problem with what the user asked for: one line, exit 2
        return _failed(args, f"error: {exc}", 2)
    except WorkerError as exc:  # a rank crashed (check, comm, bench): its traceback, once
        # Not the parent's frames around it, which say only that a worker failed, nor the
        # worker's traceback twice (in this process's and in the exception's message); then
        # one line, also as JSON when asked, so a program reading the report gets an answer.
        sys.stderr.write(exc.traceback.rstrip() + "\n")
        final = exc.final()
        # The message's first line: torch's run to paragraphs, which the traceback holds.
        said = (f"{final[0]}: {final[1].strip().splitlines()[0] if final[1].strip() else ''}"
                if final else "no Python error")
        return _failed(args, f"failed: rank {exc.rank} ({said}); its traceback is above", 1)
    except TimeoutError as exc:  # workers that did not finish in time (already stopped)
        limit = getattr(args, "timeout", None)
        hint = (f"; if they were only slow, raise --timeout (now {limit:g}s)"
                if isinstance(limit, (int, float)) else "")
        return _failed(args, f"{exc}{hint}", 1)
    except Interrupted as exc:  # the workers were stopped on the way out (finally blocks)
        return _failed(args, f"stopped by {signal.Signals(exc.signum).name}", 128 + exc.signum)
    except KeyboardInterrupt:
        return _failed(args, "stopped by SIGINT", 130)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``; with ``--format json`` in ``argv``, an error in the
    arguments themselves (an unknown flag, a bad choice) is also the JSON object
    ``{"event": "error", "error", "command", "exit_code"}`` on stdout, as errors after parsing
    are. argparse prints its usage and exits (2) on such errors, before ``args.format``
    exists: the request is read off ``argv`` (after ``plait run``'s script, the script's own
    ``--format``, which asks plait run for JSON too)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    own = _before_script(parser, argv) if command == "run" else argv
    asked = any(a == "--format=json" or (a == "--format" and b == "json")
                for a, b in zip(own, [*own[1:], ""], strict=True))
    if command == "run" and not asked:  # the script's --format json asks plait run too
        from .argv import format_from_argv

        asked = format_from_argv(argv[len(own) + 1:]) == "json"
    if not asked:
        return _parse_all(parser, argv, command)
    from .outputs import json_error

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return _parse_all(parser, argv, command)
    except SystemExit as exc:
        sys.stderr.write(said.getvalue())
        if exc.code not in (0, None):
            lines = said.getvalue().strip().splitlines() or ["invalid arguments"]
            # "plait bench comm: error: ...": the parser that refused names the command
            prog, _, message = lines[-1].rpartition(": error: ")
            named = prog.removeprefix(f"{parser.prog} ") \
                if prog.startswith(f"{parser.prog} ") else command or ""
            print(json_error(named, message or lines[-1], int(exc.code)))
        raise


def _before_script(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``plait run``'s own arguments: those before the script (the first word that is neither
    a flag nor a flag's value); the rest are the script's."""
    run = command_parsers(parser, argparse.Namespace(command="run"))[-1]
    takes_value = {o for a in run._actions if a.nargs != 0 for o in a.option_strings}
    start = argv.index("run") + 1
    i = start
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] in takes_value else 1
    return argv[:i]


def _parse_all(parser: argparse.ArgumentParser, argv: list[str],
               command: str | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, an unknown flag refused by the command's own parser (whose
    name and --help the message gives), not by the top-level one."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command_parsers(parser, args)[-1].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def command_parsers(parser: argparse.ArgumentParser,
                    args: argparse.Namespace) -> list[argparse.ArgumentParser]:
    """The parsers ``args`` went through: ``plait``, ``plait bench``, ``plait bench comm``.
    The last one's ``prog`` is the full command, which its errors and help name."""
    chain = [parser]
    while True:
        sub = next((a for a in chain[-1]._actions
                    if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, sub.dest, None) if sub is not None else None
        if sub is None or name not in sub.choices:
            return chain
        chain.append(sub.choices[name])


def _failed(args: argparse.Namespace, message: str, code: int) -> int:
    from .outputs import command_failed

    return command_failed(getattr(args, "_named", args.command), message, code,
                          getattr(args, "format", None))


class Interrupted(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread like KeyboardInterrupt is for SIGINT, so
    that the commands that start workers (check, comm, bench) stop them on the way out instead
    of leaving them orphaned (the default action of both signals ends the process at once)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    def raise_interrupted(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            previous[sig] = signal.signal(sig, raise_interrupted)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
