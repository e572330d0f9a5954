"""Random states that belong to the data, not to the process that loads it.

Randomness drawn while loading (a random crop in ``dataset[i]``, masking in a generator of
token blocks) comes from the process's global generators: torch's CPU generator, Python's
``random`` and NumPy's. Which process that is, and what it drew before, depends on the
layout, the number of loader workers and whether the run was resumed, so the same item would
get other draws in each. plait gives the data its own states instead:

* ``dataset[i]`` runs with the global generators seeded from (seed, epoch, i), so an item's
  draws are a function of the item alone, whichever worker or rank loads it, and whenever;
* an iterable dataset's iterator is stepped to its item at position p with them seeded from
  (seed, epoch, p), so every reader of the stream (each replica, each worker, a resumed run
  reading from the start of the epoch or jumping to its position) sees the same draws.

A dataset that keeps a generator object of its own (``self.g = torch.Generator()`` drawn from
in ``__getitem__``) is outside this: plait cannot know that object, so its draws depend on what
that copy of the dataset loaded before, which differs between one device, the replicas, the
loader workers and a resumed run (the loader warns when it sees one change while any batch
loads, once: ``GeneratorWatch``). Draw from the global generators (``torch.rand(...)`` with no
``generator=``), or make the generator for the item from the seed plait gives it:
``torch.Generator().manual_seed(torch.initial_seed())`` inside ``__getitem__``.

torch's CPU state is put back after each item: dropout and initialisation in the training
process draw what they would without loading (torch's ``fork_rng`` would do that too, but it
forks the accelerators' states as well, which loading never touches, at a cost per item).
"""

from __future__ import annotations

import pickle
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from ..warn import user_stacklevel

T = TypeVar("T")

_MIX = 1_000_003  # a prime, so (seed, epoch, i) triples map to distinct seeds in practice


def item_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of item ``index`` in ``epoch``: the same on every rank, worker and resume."""
    return ((seed * _MIX + epoch) * _MIX + index) % (2**63)


def batch_seed(seed: int, epoch: int, k: int, dp_rank: int) -> int:
    """The seed of data replica ``dp_rank``'s collate of batch ``k`` in ``epoch``."""
    return item_seed(seed, epoch, k) ^ (dp_rank + 1) * 0x9E3779B97F4A7C15 % (2**63)


def stream_seed(seed: int, epoch: int) -> int:
    """The seed of an iterable dataset's iterator in ``epoch``."""
    return (seed * _MIX + epoch) * _MIX % (2**63) ^ 0x5DEECE66D


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # NumPy is optional: without it there is no generator of its to seed
        return None
    return numpy


def run_seeded(fn: Callable[[], T], seed: int) -> T:
    """``fn()`` with the global generators seeded from ``seed``; torch's CPU state is put back
    after it. Python's and NumPy's stay where ``fn`` left them: saving and restoring them costs
    30 and 160-200 us an item (NumPy's state is a 624-word array copied both ways), against 8 us
    for torch's, and what they are left at is still a function of the data (the last item's
    seed and draws), so a resumed run sees the same."""
    saved = torch.get_rng_state()
    torch.default_generator.manual_seed(seed)  # the CPU generator only: CUDA's is training's
    random.seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed % 2**32)
    try:
        return fn()
    finally:
        torch.set_rng_state(saved)


def _generator_state(obj: Any) -> bytes | None:
    """The state of a random generator object (torch's, Python's ``random.Random``, NumPy's
    ``RandomState`` or ``Generator``) as bytes; None for anything else."""
    if isinstance(obj, torch.Generator):
        return bytes(obj.get_state().numpy().tobytes())
    if isinstance(obj, random.Random):
        return pickle.dumps(obj.getstate())
    np = _numpy()
    if np is not None and isinstance(obj, np.random.RandomState):
        return pickle.dumps(obj.get_state())
    if np is not None and isinstance(obj, np.random.Generator):
        return pickle.dumps(obj.bit_generator.state)
    return None


def _generators(dataset: Any) -> dict[str, tuple[Any, bytes]]:
    """The generator objects ``dataset`` holds as attributes, by name, with their states."""
    states = {}
    for name, value in getattr(dataset, "__dict__", {}).items():
        state = _generator_state(value)
        if state is not None:
            states[name] = (value, state)
    return states


def watch_own_generators(dataset: Any, load: Callable[[], T]) -> tuple[T, bool]:
    """``load()``, warning when a generator object the dataset holds (``self.g =
    torch.Generator()``) changed state while it ran: plait seeds the global generators for
    each item, not objects of the dataset's own, whose draws then depend on what this copy of
    the dataset loaded before (other on one device, each replica, each loader worker and after
    a resume). A generator that only drew in ``__init__`` (a fixed split), or one made again
    while loading (from the item's seed), is left alone: only the same object drawn from is
    named. Returns the result and whether it warned."""
    before = _generators(dataset)
    result = load()
    if not before:
        return result, False
    after = _generators(dataset)
    drawn = sorted(name for name, (held, state) in before.items()
                   if name in after and after[name][0] is held and after[name][1] != state)
    if drawn:
        name = type(dataset).__name__
        held = ", ".join(f"self.{a} ({type(getattr(dataset, a)).__name__})" for a in drawn)
        warnings.warn(
            f"plait: dataset {name} drew from a generator of its own while loading ({held}): "
            f"plait seeds the global generators for each item, not one a dataset holds, so "
            f"its draws depend on what this copy of the dataset loaded before and differ "
            f"between one device, the data replicas, loader workers and a resumed run. Draw "
            f"from the global generators (torch.rand(...) without generator=, random, "
            f"np.random), or make the generator while loading from the seed plait gives the "
            f"item: torch.Generator().manual_seed(torch.initial_seed())",
            UserWarning, stacklevel=user_stacklevel())
    return result, bool(drawn)


class GeneratorWatch:
    """Watches every batch a copy of the dataset loads for a generator of its own drawn from,
    until it has warned once: a dataset may draw only on some items or from its second epoch
    on, so the first batch alone would miss it. Scanning the dataset's attributes before and
    after a batch costs a few us for a dataset that holds no generator and about 20 us for
    one that holds a torch.Generator (its 5 KB state is copied twice), per batch, not per
    item: under 1% of ``run.step`` on a tiny MLP (``bench/data_generator_watch.py``)."""

    def __init__(self) -> None:
        self.warned = False

    def __call__(self, dataset: Any, load: Callable[[], T]) -> T:
        if self.warned:
            return load()
        result, self.warned = watch_own_generators(dataset, load)
        return result


def seeded_item(dataset: Any, seed: int, epoch: int, index: int) -> Any:
    """``dataset[index]`` drawing from (seed, epoch, index)."""
    return run_seeded(lambda: dataset[index], item_seed(seed, epoch, index))


def seeded_stream(iterable: Any, seed: int, epoch: int, start: int = 0) -> Iterator[Any]:
    """The items of ``iterable`` from position ``start`` of ``epoch`` on, the step that yields
    the item at position p drawing from (seed, epoch, p), so every reader of the stream sees
    the same draws.

    A dataset with ``iter_from(position)`` (``plait.data.stream``'s seek protocol) is asked
    for an iterator that starts at ``start``; any other is iterated from the start of the
    epoch and the items before ``start`` are dropped, each still stepped with its own seed."""
    jump = start > 0 and callable(getattr(iterable, "iter_from", None))
    if jump:
        it = run_seeded(lambda: iter(iterable.iter_from(start)), stream_seed(seed, epoch))
    else:
        it = run_seeded(lambda: iter(iterable), stream_seed(seed, epoch))
    end = object()
    position = start if jump else 0
    while True:
        item = run_seeded(lambda: next(it, end), item_seed(seed, epoch, position))
        if item is end:
            return
        if position >= start:
            yield item
        position += 1
