"""The distributed loader for an iterable dataset (a stream: no ``len``, no ``dataset[i]``).

A stream has no index to draw a global batch from, but it has an order, and that is enough to
keep plait's promise (a layout trains what one device trains): the items of an epoch are
numbered by their position in the stream, step k's global batch is positions [k*B, (k+1)*B)
of the current epoch, and data replica r takes rows [r*b, (r+1)*b) of it, as for a map-style
dataset. Every reader (each replica, each loader worker) walks the stream from the start of the
epoch and keeps its own positions: no item is taken twice and none is skipped, tensor- and
pipeline-parallel peers take the same rows, and the position to resume at is the number of
global batches taken this epoch, whatever the number of replicas or workers.

Why walk the whole stream on every reader rather than split it: a stream can only be split by
reading it (``datasets``' ``split_dataset_by_node`` does the same, keeping one item in
``world_size``, when its files do not divide among the ranks), and a split by files gives each
replica other items than one device reads in its order, so neither the one-device batches nor a
resume under another data-parallel size would hold. The cost is that every reader produces
every item of the stream and drops the ones that are not its own, and that a resumed run reads
the epoch from its start up to where it stopped.

The seek protocol removes the second cost, and most of the first for loader workers: a dataset
that can start part-way (records of known size in a file, shards of known length, an index)
defines ``iter_from(position)``, returning an iterator whose first item is the one ``iter()``
yields at ``position`` (counted from 0 at the start of the epoch), and the same items after it.
plait calls it where a reader would otherwise read items only to drop them: when it starts
(the first batch after a resume, a loader worker's first batch, each epoch's start for a
replica other than the first) and when a loader worker's next batch is a global batch or more
ahead. Like ``iter()``, it runs with the global generators seeded from (seed, epoch), and each
item is stepped seeded from (seed, epoch, its position), so items that draw from them draw what
a reader that walked there draws. A position at or past the end returns an empty iterator.
Nothing else is asked of the dataset: plait's checkpoint holds the position, not the dataset's
state (torchdata's ``StatefulDataLoader`` and ``datasets``' ``IterableDataset.state_dict``
save the dataset's own state instead, which ties a checkpoint to one reader's place, where
plait's readers each hold another).

A dataset with ``set_epoch(epoch)`` (``datasets``' ``IterableDataset``, whose shuffle buffer
and shard order are drawn from its seed and epoch) is told the epoch before each reader
iterates it, so each epoch is shuffled anew on every reader alike, as ``DistributedSampler``'s
``set_epoch`` does for a map-style dataset; a loader running across epochs (``steps=N``)
leaves the script no place to call it.

An epoch ends when the stream does. Its last global batch is dropped if the stream ends inside
it (no padding with repeated items, which would count twice), and every replica ends the
epoch at the same step: each one sees the last position of each global batch, its own or not,
so none waits in a collective for a batch another replica does not have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler, default_collate

from .loader import (
    as_is,
    check_loader_args,
    is_stream,
    refuse_data_loader,
    seeded_collate,
    warn_left_padding,
)
from .rng import GeneratorWatch, seeded_stream


class EpochEnd:
    """What a reader returns for a global batch the stream ended inside (compared by type: it
    crosses from loader workers pickled)."""


class ReplicaStream:
    """One replica's batches of a stream: ``self[(epoch, k)]`` is its rows of global batch k of
    ``epoch``, collated, or an ``EpochEnd``. It keeps its place in the stream, so asking for
    batches in rising order (every batch, or every W-th in a loader worker) reads the stream
    once; an earlier batch or another epoch starts the stream again."""

    def __init__(self, dataset: Any, batch_size: int, local: int, dp_rank: int, seed: int,
                 collate_fn: Callable[[list[Any]], Any], micro_batches: int = 1):
        self.dataset, self.batch_size, self.local = dataset, batch_size, local
        self.dp_rank, self.seed, self.collate_fn = dp_rank, seed, collate_fn
        self.micro_batches = micro_batches
        self._epoch = -1
        self._items: Iterator[Any] | None = None
        self._next = 0  # the position the iterator yields next
        self._length: int | None = None  # the epoch's item count, once the stream ended
        self._seeks = callable(getattr(dataset, "iter_from", None))
        self._watch = GeneratorWatch()  # every batch looks for generators of the dataset's own

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self._watch(self.dataset, lambda: self._batch(key))

    def _batch(self, key: tuple[int, int]) -> Any:
        epoch, k = key
        first = k * self.batch_size
        last = first + self.batch_size - 1  # the global batch is whole once this one exists
        if epoch == self._epoch and self._length is not None and last >= self._length:
            return EpochEnd()
        lo = first + self.dp_rank * self.local
        if (epoch != self._epoch or first < self._next
                or (self._seeks and lo - self._next >= self.batch_size)):
            # A fresh reader starts at its first row: a dataset with ``iter_from`` jumps there,
            # any other is read from the start of the epoch (seeded_stream drops the rest).
            if epoch != self._epoch:
                self._length = None
            set_epoch = getattr(self.dataset, "set_epoch", None)
            if callable(set_epoch):  # a stream that shuffles anew each epoch (datasets')
                set_epoch(epoch)
            self._epoch, self._next = epoch, lo
            self._items = seeded_stream(self.dataset, self.seed, epoch, start=lo)
        rows = []
        end = object()
        assert self._items is not None
        while self._next <= last:
            item = next(self._items, end)
            if item is end:
                self._length = self._next
                return EpochEnd()
            if lo <= self._next < lo + self.local:
                rows.append(item)
            self._next += 1
        return seeded_collate(self.collate_fn, rows, self.seed, epoch, k, self.dp_rank,
                              self.micro_batches)


class StreamLoader:
    """Yields this replica's rows of each global batch of an iterable dataset.

    The arguments are ``DistributedLoader``'s (``batch_size`` is the global batch), without
    ``shuffle``: a stream keeps its own order (shuffle it in the stream: a shuffle buffer). An
    epoch is the stream from its start to its end, less the items that do not fill a last global
    batch; ``steps=None`` runs to the end of the epoch ``start_step`` is in, ``steps=N`` goes on
    into further epochs (the dataset iterated again) until step N. ``epoch`` and
    ``epoch_start`` (the step the epoch began at) say where ``start_step`` is; a checkpoint's
    ``state_dict`` holds them.

    ``num_workers`` > 0: worker w of W builds every W-th batch (torch's DataLoader hands the
    batches out in order), each worker reading the stream from the epoch's start, or jumping
    to its next batch where the dataset has ``iter_from`` (the seek protocol above).
    """

    def __init__(self, dataset: Any, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, steps: int | None = None, start_step: int = 0,
                 epoch: int = 0, epoch_start: int = 0,
                 collate_fn: Callable[[list[Any]], Any] | None = None,
                 num_workers: int = 0, persistent_workers: bool = False,
                 pin_memory: bool = False, micro_batches: int = 1):
        check_loader_args(batch_size, dp_size, num_workers, persistent_workers)
        refuse_data_loader(dataset)
        if not is_stream(dataset):
            raise ValueError(f"dataset {type(dataset).__name__} is map-style (len() and "
                             f"dataset[i]): load it with DistributedLoader (run.loader() "
                             f"picks the loader itself)")
        name = type(dataset).__name__
        if num_workers and type(dataset).__module__.split(".")[0] == "datasets":
            # Its __iter__ in a DataLoader worker reads only that worker's share of its files
            # (datasets' _iter_pytorch), where plait needs every worker to read the whole stream.
            raise ValueError(f"num_workers={num_workers} with datasets' {name}: in a loader "
                             f"worker it reads only that worker's share of its files, and "
                             f"plait splits the whole stream by position; use num_workers=0 "
                             f"(the stream is read as training goes), or load it without "
                             f"streaming=True (a map-style Dataset)")
        if epoch_start > start_step:
            raise ValueError(f"epoch_start={epoch_start} is after start_step={start_step}: "
                             f"the epoch a loader starts in began at or before its first step")
        self.dataset = dataset
        self.batch_size = batch_size
        self.local_batch_size = batch_size // dp_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed = seed
        self.collate_fn = collate_fn or default_collate
        self.micro_batches = micro_batches  # as DistributedLoader's
        self.steps = steps
        self.step, self.epoch, self.epoch_start = start_step, epoch, epoch_start
        self.num_workers, self.persistent_workers = num_workers, persistent_workers
        self.pin_memory = pin_memory
        self._reader = self._new_reader()
        self._workers: DataLoader | None = None
        self._warned_left_padding = False

    def _new_reader(self) -> ReplicaStream:
        return ReplicaStream(self.dataset, self.batch_size, self.local_batch_size, self.dp_rank,
                             self.seed, self.collate_fn, self.micro_batches)

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("a stream's length is known once it ends: give run.loader(..., "
                            "steps=N) for a loader with a length")
        return max(0, self.steps - self.step)

    def _checked(self, batch: Any) -> Any:
        if (self.collate_fn is not default_collate and self.dp_size > 1
                and not self._warned_left_padding):
            self._warned_left_padding = warn_left_padding(batch, self.dp_size)
        return batch

    def _key(self) -> tuple[int, int]:
        return self.epoch, self.step - self.epoch_start

    def _epoch_ended(self) -> bool:
        """The stream ended inside the current global batch: the next epoch starts at this step.
        Returns whether to go on into it."""
        if self.step == self.epoch_start:
            raise ValueError(
                f"dataset {type(self.dataset).__name__} yielded fewer than one global batch of "
                f"{self.batch_size} items in epoch {self.epoch}: give more data or a smaller "
                f"batch_size" + ("; a stream read again for each epoch must start over when "
                                 "iterated again (an IterableDataset whose __iter__ makes a new "
                                 "generator, not a generator object, which is read once)"
                                 if self.epoch else ""))
        self.epoch, self.epoch_start = self.epoch + 1, self.step
        return self.steps is not None

    def __iter__(self) -> Iterator[Any]:
        if self.num_workers == 0 and not self.pin_memory:
            while self.steps is None or self.step < self.steps:
                batch = self._reader[self._key()]
                if isinstance(batch, EpochEnd):
                    if self._epoch_ended():
                        continue
                    return
                self.step += 1
                yield self._checked(batch)
            return
        while True:
            for batch in self._loader():  # its sampler stops at ``steps``
                if isinstance(batch, EpochEnd):
                    break
                self.step += 1
                yield self._checked(batch)
            else:
                return
            if not self._epoch_ended():
                return

    def _loader(self) -> DataLoader:
        """torch's DataLoader for the workers and pinning, over the batches of this replica
        keyed (epoch, k): its sampler hands out the keys from the current step on, and torch
        gives worker w every W-th one and returns the batches in order."""
        if self._workers is None:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.dp_rank) % 2**63)
            self._workers = DataLoader(
                self._reader,  # type: ignore[arg-type]
                sampler=_Keys(self), batch_size=None, collate_fn=as_is,
                num_workers=self.num_workers, persistent_workers=self.persistent_workers,
                pin_memory=self.pin_memory, generator=gen)
        return self._workers

    def state_dict(self) -> dict[str, int]:
        """The position: the global batches handed out (``step``), and the epoch and the step
        it began at; the items of the epoch taken are ``(step - epoch_start) * batch_size``,
        whatever the number of replicas."""
        return {"step": self.step, "seed": self.seed, "epoch": self.epoch,
                "epoch_start": self.epoch_start}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.seed = int(state["step"]), int(state["seed"])
        self.epoch = int(state.get("epoch", 0))
        self.epoch_start = int(state.get("epoch_start", 0))
        self._reader, self._workers = self._new_reader(), None


class _Keys(Sampler[tuple[int, int]]):
    """(epoch, k) for the loader's batches from its step on, in its current epoch: up to
    ``steps``, or without end (the readers say where the stream ends)."""

    def __init__(self, loader: StreamLoader):
        self.loader = loader

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch, k = self.loader._key()
        stop = self.loader.steps
        while stop is None or self.loader.epoch_start + k < stop:
            yield epoch, k
            k += 1


__all__ = ["EpochEnd", "ReplicaStream", "StreamLoader"]
