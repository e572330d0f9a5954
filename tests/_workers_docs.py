"""A documentation page's code block run as the body of a rank that plait.spawn started (a
process forked from a server that imported torch once): the block's own code, in a folder of
its own, as a script's ``__main__``."""

import contextlib
import io
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_block(rank, world_size, source, where, folder):
    """Execute ``source`` (named ``where`` in tracebacks) in ``folder``; return its stdout."""
    os.chdir(folder)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    sys.argv = [where]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, where, "exec"), {"__name__": "__main__"})
    return out.getvalue()
