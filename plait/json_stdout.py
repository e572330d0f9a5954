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
        said = str(value).strip().splitlines()
        code = 130 if issubclass(kind, KeyboardInterrupt) else 1
        text = "".join(traceback.format_exception(kind, value, tb)).rstrip()
        found.stdout.write(json_error(command, f"rank {rank} ({kind.__name__}"
                                      + (f": {said[0]})" if said else ")"), code,
                                      rank=rank, traceback=text) + "\n")
        found.stdout.flush()

    found.hook = failed
    sys.stdout = found.events
    sys.excepthook = failed
    return found


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
