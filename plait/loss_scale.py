"""Dynamic loss scaling for ``mixed_precision=fp16``.

fp16 keeps 10 bits of mantissa and, unlike bf16, only 5 of exponent: a gradient below 6e-8
flushes to zero in an fp16 op's backward. Scaling the loss by a large factor before backward
lifts the gradients into fp16's range; dividing them by the same factor before the optimizer
step gives the true gradients back (they are kept in fp32, as the parameters are). Too large a
factor overflows some gradient to inf: that step's update is skipped on every rank and the
factor halves; after ``growth_interval`` clean steps in a row it doubles. The numbers are
``torch.amp.GradScaler``'s defaults, and the sequence of scales is the one it follows.

Why not GradScaler itself: plait already computes, once per step, the one factor every gradient
is multiplied by (``dp / global count``, with clipping folded in) and the job-wide gradient
norm, and the step guard already makes every rank agree about a non-finite norm. The
unscaling is one more division in that factor, and an overflow is the guard's non-finite
gradient norm: no pass over the gradients and no collective of its own.

What backward runs on: ``loss sum * scale / reference`` (see :meth:`LossScaler.backward_factor`),
where ``reference`` is the previous step's global item count. plait's backward runs on a sum
(divided by the global count afterwards, ``plait.loss``), whose gradients are the mean's times
the count: scaling the sum by the scale alone overflowed where a mean scaled by it would not,
by a factor of the count (16k tokens: 14 halvings to find the scale a mean's loop finds). The
previous step's count is the same number on every rank without a collective (it came from the
step's all-reduce of (loss sum, count)), so every rank scales by one factor and the gradients
stay exact; the scale means what it means for GradScaler on a mean loss. The first step has no
previous count: it takes the job's throughput count (tokens or samples, counted on the host;
at least the loss's count, so its gradients are no larger than a mean's), agreed once by one
all-reduce of one number, the run's only collective for the scale (a resumed run has the
count from its checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# torch.amp.GradScaler's defaults.
INIT_SCALE = 2.0 ** 16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


@dataclass
class LossScaler:
    """The loss scale of an fp16 run, the same on every rank (every rank updates it from the
    same agreed verdict). ``skipped``: the steps whose update an overflow dropped."""

    scale: float = INIT_SCALE
    growth_factor: float = GROWTH_FACTOR
    backoff_factor: float = BACKOFF_FACTOR
    growth_interval: int = GROWTH_INTERVAL
    # Clean steps in a row since the scale last changed.
    growth_tracker: int = 0
    # The previous step's global item count (see the module docstring); None before any step.
    reference: float | None = None
    skipped: list[int] | None = None

    def __post_init__(self) -> None:
        if self.skipped is None:
            self.skipped = []
        if not (self.scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1
                and self.growth_interval >= 1):
            raise ValueError(f"loss scaler settings scale={self.scale}, growth_factor="
                             f"{self.growth_factor}, backoff_factor={self.backoff_factor}, "
                             f"growth_interval={self.growth_interval}: need scale > 0, "
                             f"growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")

    def backward_factor(self) -> float:
        """What each micro-batch's loss sum is multiplied by before backward."""
        if self.reference is None:
            raise RuntimeError("LossScaler.backward_factor() before its reference count is set")
        return self.scale / self.reference

    def update(self, step: int, *, overflow: bool, clean: bool, count: float) -> None:
        """After a step whose verdict every rank agreed on: halve on ``overflow`` (a non-finite
        gradient norm with a finite loss: the update was skipped), double after
        ``growth_interval`` ``clean`` steps in a row (a step that is neither, a non-finite
        loss that the guard's policy skipped, leaves the scale alone). ``count``: this step's
        global item count, the next step's reference."""
        if count > 0:
            self.reference = float(count)
        if overflow:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            assert self.skipped is not None
            self.skipped.append(step)
        elif clean:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers for a checkpoint's manifest."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "reference": self.reference, "skipped": list(self.skipped or [])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.reference = float(state["reference"]) if state.get("reference") else None
        self.skipped = [int(s) for s in state.get("skipped", [])]
