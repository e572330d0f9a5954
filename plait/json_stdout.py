"""``format="json"`` without ``plait run``: every line the process writes on stdout is one event.

Under ``plait run --format json`` the launcher reads each line rank 0 writes and turns the
script's own prints into ``output`` events (plait.launch._pump), and ends a failed run with an
``error`` event. A script run as ``python train.py --format json`` or under ``torchrun`` has no
such reader between it and the pipe (``| jq``), so the same rewrite happens in the process:
``sys.stdout`` becomes an :class:`EventLines` that writes each line as
:func:`plait.outputs.as_event` does, and an uncaught exception ends stdout with the ``error``
event (its traceback stays on stderr, written by the hook that was there before).

Replacing ``sys.stdout`` and ``sys.excepthook`` is a process-wide side effect that a library
must not take on its own; ``format="json"`` (in code or as the script's ``--format json``) is
the user's request for a stream a program parses line by line, which only this makes true (the
script's prints, and those of every library it imports, go to ``sys.stdout``). So plait.init
installs it only then, and ``run.finish()`` (``Run.close``) puts back both as it found them:
what the script prints after ``finish()`` is plain text again. Output that does not go through
``sys.stdout`` (a subprocess handed the file descriptor, ``os.write(1, ...)``) is not seen.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NoReturn, TextIO

from .outputs import as_event, json_error


class EventLines(io.TextIOBase):
    """A text stream over ``stream`` that writes each complete line as one event line: a
    plait event as it is, anything else as ``{"event": "output", "text": ...}``. A line is
    written when its newline arrives (a ``print(..., end="")`` waits for the rest of its
    line, unless an event is written before it ends), or by :meth:`end_line`."""

    def __init__(self, stream: TextIO):
        super().__init__()
        self.stream = stream
        self._partial = ""
        self._lock = threading.Lock()  # print() from several threads: whole lines, in order

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            if self._partial and text.startswith("{") and as_event(text) == text:
                # an event written whole (plait's progress after a script's print(end=""))
                # starts a line of its own rather than ending the script's
                self.stream.write(as_event(self._partial) + "\n")
                self._partial = ""
            *lines, self._partial = (self._partial + text).split("\n")
            for line in lines:
                self.stream.write(as_event(line) + "\n")
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self.stream.flush()

    def end_line(self) -> None:
        """Write a line left without its newline, as an event."""
        with self._lock:
            if self._partial:
                self.stream.write(as_event(self._partial) + "\n")
                self._partial = ""
            self.stream.flush()

    def isatty(self) -> bool:
        return False  # a program reads it: no progress bar, no colour

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8") or "utf-8"


@dataclass
class JsonStdout:
    """What :func:`install` replaced, to put back; ``events`` is the stream it installed."""

    stdout: TextIO
    excepthook: Any
    events: EventLines
    hook: Any = None


def install(command: str, rank: int) -> JsonStdout:
    """Make ``sys.stdout`` an :class:`EventLines` and chain an ``error`` event after the
    current ``sys.excepthook``; ``command`` (the script's name) and ``rank`` go in the event."""
    found = JsonStdout(stdout=sys.stdout, excepthook=sys.excepthook,
                       events=EventLines(sys.stdout))

    def failed(kind: type[BaseException], value: BaseException,
               tb: TracebackType | None) -> None:
        found.excepthook(kind, value, tb)  # the traceback on stderr, as without JSON
        found.events.end_line()
        _say_error(found.stdout, command, rank, kind, value, tb)

    found.hook = failed
    sys.stdout = found.events
    sys.excepthook = failed
    return found


# Set on an exception every rank raises alike (a plan or model plait refuses before any rank
# could differ): its error event is written once, by rank 0, not once per rank.
EVERY_RANK = "_plait_every_rank"
_SAID = "_plait_error_said"  # its error event is written: a second hook does not repeat it


def mark_every_rank(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised alike on every rank (:data:`EVERY_RANK`); returns it."""
    setattr(exc, EVERY_RANK, True)
    return exc


def _say_error(stream: TextIO, command: str, rank: int, kind: type[BaseException],
               value: BaseException, tb: TracebackType | None) -> None:
    """Write the ``error`` event of an uncaught exception on ``stream``: every rank's own, or
    rank 0's alone for one every rank raises alike; once per exception."""
    alike = getattr(value, EVERY_RANK, False)
    if getattr(value, _SAID, False) or (alike and rank != 0):
        return
    with contextlib.suppress(AttributeError, TypeError):
        setattr(value, _SAID, True)
    said = str(value).strip().splitlines()
    code = 130 if issubclass(kind, KeyboardInterrupt) else 1
    text = "".join(traceback.format_exception(kind, value, tb)).rstrip()
    what = kind.__name__ + (f": {said[0]}" if said else "")
    if alike:  # no rank to name: "ValueError: invalid plan: ..."
        message, fields = what, {}
    else:
        message, fields = f"rank {rank} ({what})", {"rank": rank}
    stream.write(json_error(command, message, code, **fields, traceback=text) + "\n")
    stream.flush()


def say_if_uncaught(command: str, exc: BaseException, rank: int) -> None:
    """``format="json"`` asked for, but refused before :func:`install` ran (a bad plan given
    to plait.init in code, raised alike on every rank): if ``exc`` ends the process uncaught,
    stdout ends with its ``error`` event, rank 0's alone, after the traceback on stderr. A
    script that catches it sees nothing written. Chained after the current ``sys.excepthook``,
    for this exception only."""
    mark_every_rank(exc)
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException,
             tb: TracebackType | None) -> None:
        previous(kind, value, tb)
        if value is exc:
            end_line = getattr(sys.stdout, "end_line", None)
            if callable(end_line):  # plait's JSON stdout: a partial line ended first
                end_line()
            _say_error(getattr(sys.stdout, "stream", sys.stdout), command, rank, kind,
                       value, tb)

    sys.excepthook = hook


def restore(found: JsonStdout) -> None:
    """Put back what :func:`install` replaced (each only where it is still the one installed:
    something that replaced it since keeps its place)."""
    found.events.end_line()
    if sys.stdout is found.events:
        sys.stdout = found.stdout
    if sys.excepthook is found.hook:
        sys.excepthook = found.excepthook


def refuse(command: str, message: str, *, json: bool, rank: int, code: int = 2) -> NoReturn:
    """The script's command line was refused in plait.init: ``plait: error: MESSAGE`` on
    stderr (every rank, as argparse says it), and with ``json`` the ``error`` event on stdout
    (rank 0 only: every rank refuses the same command line); then the process exits with
    ``code``."""
    print(f"plait: error: {message}", file=sys.stderr, flush=True)
    if json and rank == 0:
        print(json_error(command, message, code), flush=True)
    raise SystemExit(code)
