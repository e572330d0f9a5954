"""Warnings attributed to the user's line, not plait's.

``warnings.warn(..., stacklevel=N)`` counts frames from the call, so a warning raised at
different depths inside plait (``run.parallelize`` straight into the layout, or through the
pipeline, which calls back into it per stage) points at a line of plait for all but one of
them, and Python shows that line of plait's source under the message. Python 3.12's
``skip_file_prefixes`` does this; plait supports 3.10, so the frames are counted here.
"""

from __future__ import annotations

import inspect
from pathlib import Path

_PLAIT = str(Path(__file__).resolve().parent)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the caller point at the first frame
    outside the plait package (the user's script or test)."""
    here = inspect.currentframe()
    frame = here.f_back if here is not None else None
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PLAIT):
        if frame.f_back is None:  # plait all the way up (its own workers): its outermost line
            break
        level += 1
        frame = frame.f_back
    return level

