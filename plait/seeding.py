"""Two models that start from the same weights because ``run.parallelize`` seeded the RNG
between them.

``run.parallelize`` starts the RNG from the run's seed before it lays a model out, so that
training draws (dropout) begin at the seed whatever building the model drew. A second model
built after that call (``q2 = run.parallelize(Critic())`` after ``q1 = run.parallelize(
Critic())``) then draws the very numbers the first one drew after ``plait.init`` seeded the
RNG: two critics, ensemble members or towers of one class start equal, which one device,
building both from one stream of draws, never does. The models are told apart from a
deliberate copy (an EMA model, a frozen reference for a KL penalty, ``copy.deepcopy`` of the
model) by the RNG: a copy draws nothing, a model built anew does.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .warn import user_stacklevel


def fingerprint(model: nn.Module) -> tuple[object, ...]:
    """A few of the model's initial values with every parameter's shape: equal for two
    models of one architecture built from the same draws (or copied), unequal otherwise."""
    shapes = tuple(tuple(p.shape) for p in model.parameters())
    # not a DTensor: a model laid out already holds shards, no fresh draws
    drawn = [p for p in model.parameters() if p.is_floating_point() and not p.is_meta
             and p.numel() > 1 and not hasattr(p, "placements")][:3]
    # a copy of 12 numbers to the host, once per run.parallelize
    values = tuple(tuple(p.detach().flatten()[:4].float().cpu().tolist()) for p in drawn)
    return shapes, values


@dataclass
class TwinCheck:
    """What the run's earlier ``run.parallelize`` calls saw: each model's fingerprint and
    class name, and the CPU RNG state the last call left."""

    seen: list[tuple[tuple[object, ...], str]] = field(default_factory=list)
    rng_after: torch.Tensor | None = None

    def before(self, model: nn.Module, seed: int) -> None:
        """Warn when ``model`` was built after an earlier ``run.parallelize`` (the RNG drew
        since) and starts from that earlier model's weights."""
        if self.rng_after is None or not self.seen:
            return
        if torch.equal(torch.get_rng_state(), self.rng_after):
            return  # nothing drawn since: a copy, or built before the earlier call
        mine = fingerprint(model)
        twin = next((name for seen, name in self.seen if seen == mine and mine[1]), None)
        if twin is None:
            return
        name = type(model).__name__
        warnings.warn(
            f"plait: {name} starts from the same weights as {twin}, laid out before it: "
            f"run.parallelize started the RNG from the seed (plait.init(seed={seed})), and "
            f"{name} was built after that call, so it drew what {twin} drew. Build every "
            f"model before the first run.parallelize call, or seed each yourself "
            f"(torch.manual_seed(k) before building it); a deliberate copy "
            f"(copy.deepcopy) is not warned about", stacklevel=user_stacklevel())

    def after(self, name: str, seen: tuple[object, ...]) -> None:
        """Record a model laid out (its class name and :func:`fingerprint` from before the
        layout, which shards or splits it in place) and the RNG state the call leaves."""
        self.seen.append((seen, name))
        self.rng_after = torch.get_rng_state()
