"""What a command writes: files (plots, logs), checked before any work is done, and the
failure line.

A report that takes minutes to compute must not fail at the end because its output folder is
missing or read-only, and an output named after a folder goes into that folder, under the name
the file would have had (matplotlib would otherwise write ``/tmp`` as ``/tmp.png``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def plot_path(value: str, flag: str, default_name: str) -> str:
    """Where ``flag VALUE`` writes its PNG: VALUE itself, VALUE + ``.png`` without a suffix,
    or VALUE/``default_name`` for a folder. Raises ValueError (one line) when the folder is
    missing or not writable, or matplotlib is not installed."""
    path = Path(value).expanduser()
    if value.endswith(os.sep) or path.is_dir():
        path = path / default_name
    elif not path.suffix:
        path = path.with_suffix(".png")
    writable_folder(path.parent, f"{flag} {value}")
    if path.is_dir():
        raise ValueError(f"{flag} {value}: {path} is a folder; give a file name")
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"{flag} needs matplotlib: pip install 'plait[plot]'")
    return str(path)


def writable_folder(folder: Path, what: str, *, create: bool = False) -> None:
    """Raise ValueError unless ``folder`` is (or, with ``create``, can become) a writable
    folder."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{what}: {folder} is a file, not a folder")
    if not folder.exists():
        parent = next((p for p in folder.parents if p.exists()), None)
        if not create or parent is None:
            raise ValueError(f"{what}: folder {folder} does not exist; create it first")
        folder = parent
        if not folder.is_dir():
            raise ValueError(f"{what}: {folder} is a file, not a folder")
    try:  # a real write: permission bits say nothing for root or on a read-only mount
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ValueError(f"{what}: folder {folder} is not writable ({exc.strerror})") from None


# Every report's --format: "text" and "table" are the same human output (commands that print
# tables said "table", the others "text"; each accepts both, so neither spelling fails).
FORMATS = ("text", "table", "json")


def add_format(parser: argparse.ArgumentParser, default: str = "text") -> None:
    """Every report's ``--format``, said alike in every command's help."""
    parser.add_argument("--format", choices=FORMATS, default=default,
                        help=f"text (or table) for people, json for programs (default: "
                        f"{default})")


def command_failed(command: str, message: str, code: int, fmt: str | None = None) -> int:
    """Say why ``plait COMMAND`` failed, one line on stderr, and return ``code``. With
    ``--format json`` (``fmt="json"``) the same also goes to stdout as a JSON object,
    ``{"error", "command", "exit_code"}``, so that a program reading the report gets an answer
    it can parse instead of an empty stream."""
    print(f"plait {command}: {message}", file=sys.stderr)
    if fmt == "json":
        print(json_error(command, message, code))
    return code


def json_error(command: str, message: str, code: int, **fields: Any) -> str:
    """The JSON object a failed ``plait COMMAND --format json`` prints on stdout: an event
    like those of ``plait run`` and ``plait demo`` (:func:`json_event`), so that one reader
    handles every command's failure."""
    return json_event("error", error=message.removeprefix("error: "), command=command,
                      exit_code=code, **fields)


# ``plait run --format json`` and ``plait demo --format json`` write JSON Lines: one object per
# event, each with an "event" key naming its kind (docs/getting_started.md lists them).
def json_event(event: str, **fields: Any) -> str:
    """One event as one line of strict JSON: NaN and infinities (a diverged loss, a rate over
    no time) are null, which every JSON reader takes, where Python's ``NaN`` is not JSON."""
    return json.dumps(_finite({"event": event, **fields}), default=str, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def as_event(line: str) -> str:
    """A line of a training script's standard output as an event line: a plait event (a JSON
    object with an "event" key) as it is, anything else (the script's own print) as
    ``{"event": "output", "text": ...}``, so that the stream stays one JSON object per line."""
    text = line.rstrip("\n")
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if isinstance(data, dict) and "event" in data:
            return text
    return json_event("output", text=text)
