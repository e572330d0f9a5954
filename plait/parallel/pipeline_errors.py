"""The user's own error out of a pipeline stage's forward or backward.

torch's stage catches whatever a stage's forward or backward raises and raises a
``RuntimeError`` of its own instead (``"failed to run forward"``, ``"Failed to run stage
backward"``), the user's error only its ``__cause__``, with a message of shapes. A launcher
that records the last exception of a failed rank (torchrun's error file, which ``plait run``
prints) then shows torch's message and torch's frames: neither the user's error (a
``UserError: boom`` in a custom autograd Function's backward, an assert in a block) nor the
line that raised it. The same error raised on one device or under data parallelism reaches the
user as itself, so here it does too: the cause is raised again, with torch's summary of the
stage's inputs as a note. A ValueError or TypeError stays one (``plait check`` and the CLI
print those as one line).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# How torch's pipelining words the RuntimeErrors it raises in place of a stage's error
# (torch.distributed.pipelining.stage and ._backward).
_TORCH_WRAPPERS = ("failed to run forward", "Failed to run stage backward")


def users_error(exc: BaseException) -> BaseException | None:
    """The error ``exc`` wraps when torch's stage raised it in place of the user's, else
    None."""
    cause = exc.__cause__
    if (not isinstance(exc, RuntimeError) or cause is None
            or not any(w in str(exc) for w in _TORCH_WRAPPERS)):
        return None
    return cause


def unwrapped(what: str, stage: int, chunk: int, call: Callable[..., T], *args: Any,
              **kwargs: Any) -> T:
    """``call(*args, **kwargs)``, raising the user's own error where torch wrapped it; ``what``
    ("forward", "backward"), ``stage`` and ``chunk`` (the microbatch) go in its note."""
    try:
        return call(*args, **kwargs)
    except RuntimeError as exc:
        cause = users_error(exc)
        if cause is None:
            raise
        torch_said = " ".join(str(exc).split())
        if hasattr(cause, "add_note"):  # Python 3.11+
            cause.add_note(f"plait: raised in the {what} of pipeline stage {stage}, "
                           f"microbatch {chunk} (torch: {torch_said})")
        error = cause
    raise error  # outside the handler: not chained to torch's wrapper a second time
