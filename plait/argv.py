"""A script's own ``--plan`` and ``--accelerator``, read from its command line.

Its own module, free of torch, because ``plait run``'s launcher reads them before any worker
starts and stays a light process that imports no torch (plait.launch).
"""

from __future__ import annotations

import argparse
import sys

_ARGV_EXAMPLES = {"--plan": "--plan dp=2", "--accelerator": "--accelerator cpu",
                  "--format": "--format json"}


def _from_argv(flag: str, argv: list[str] | None) -> str | None:
    """``flag``'s value among the script's arguments; ValueError (one line, the fix) for a flag
    given without one, where argparse would print a usage line for a parser the script never
    declared."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument(flag, default=None)
    try:
        known, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    except argparse.ArgumentError as exc:
        raise ValueError(f"the script's {flag} needs a value, e.g. {_ARGV_EXAMPLES[flag]} "
                         f"({exc.message})") from None
    return getattr(known, flag.lstrip("-").replace("-", "_"))


def plan_from_argv(argv: list[str] | None = None) -> str | None:
    """The value of ``--plan`` on the script's own command line, if any.

    This is how ``plait run --nproc 8 train.py --plan dp=2,tp=4`` reaches ``plait.init()``
    without the script declaring the flag: it is the script's argument, read explicitly.
    """
    return _from_argv("--plan", argv)


def accelerator_from_argv(argv: list[str] | None = None) -> str | None:
    """The value of ``--accelerator`` on the script's own command line (read like ``--plan``)."""
    return _from_argv("--accelerator", argv)


# The outputs plait.init and plait run make of a run (plait.outputs.FORMATS, repeated here to
# keep this module free of imports): "table" is "text".
_FORMATS = ("text", "table", "json")


def format_from_argv(argv: list[str] | None = None) -> str | None:
    """The value of ``--format`` on the script's own command line when it is one of plait's
    (text, table, json); None without one. Another value is the script's own flag for
    something else (``--format parquet``), which plait leaves to the script."""
    try:
        value = _from_argv("--format", argv)
    except ValueError:  # `--format` without a value: the script's own argparse says so
        return None
    return value if value in _FORMATS else None
