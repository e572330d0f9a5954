"""A distributed loader that shards over the data axes only.

Why our own rather than ``DistributedSampler``: plait's promise is that a layout trains the same
model as one device on the same data. So the loader thinks in *global* batches: step k's global
batch is a pure function of (seed, k), and data replica r takes rows [r*b, (r+1)*b) of it. Ranks
that hold the same replica (tensor- and pipeline-parallel peers) get identical batches, one
device gets the whole global batch, and resuming at step k needs nothing but k.
"""

from __future__ import annotations

import multiprocessing
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate

from ..batch_rows import MicroBatches, ragged_entries
from ..warn import user_stacklevel
from .rng import GeneratorWatch, batch_seed, run_seeded, seeded_item


class DistributedLoader:
    """Yields this replica's slice of each global batch, ``steps`` times (cycling epochs).

    ``batch_size`` is the global batch (all data replicas together) and must divide by
    ``dp_size``. ``start_step`` resumes exactly where a previous run stopped. ``steps=None``
    runs to the end of the epoch that ``start_step`` is in. Each epoch is ``len(dataset) //
    batch_size`` whole global batches: the items left over are not drawn that epoch (the next
    epoch's shuffle draws from all of them again; without shuffling they are never drawn, which
    is warned about). No item is drawn twice in an epoch. ``collate_fn`` turns this replica's
    list of items into its batch (default: ``default_collate``, which stacks equal shapes).
    ``micro_batches`` (the plan's ``grad_accum``): where a collated batch is not one row per
    example (a flat index list with offsets), it is collated again as that many micro-batches,
    each from its own consecutive items, and handed out as a :class:`~plait.MicroBatches`
    (a batch like that cannot be cut by rows; see :func:`collate_each`).

    ``num_workers`` > 0 loads and collates the batches in that many worker processes (a torch
    ``DataLoader`` over this replica's rows of each step, so the batches are the same as with
    none); ``persistent_workers`` keeps them alive from one pass over the loader to the next,
    ``pin_memory`` puts the batches in page-locked memory for a faster copy to a GPU. The
    position (``state_dict``) counts the batches handed out, not those the workers fetched
    ahead.

    ``dataset[i]`` runs with the global random generators (torch, ``random``, NumPy) seeded from
    (seed, epoch, i) and the loading process's own states put back after it: randomness drawn
    there (random crops, masking) is a function of the item, the same on every rank of a
    replica, with or without workers, and after a resume (``plait.data.rng``). ``collate_fn``
    draws from (seed, epoch, batch, data rank): the same on the peers of a replica, with or
    without workers and after a resume at the same number of replicas.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, steps: int | None = None, start_step: int = 0,
                 shuffle: bool = True, collate_fn: Callable[[list[Any]], Any] | None = None,
                 num_workers: int = 0, persistent_workers: bool = False,
                 pin_memory: bool = False, micro_batches: int = 1):
        _check_map_style(dataset)
        check_loader_args(batch_size, dp_size, num_workers, persistent_workers)
        n = len(dataset)  # type: ignore[arg-type]
        if n == 0:
            raise ValueError(f"dataset {type(dataset).__name__} is empty (len() is 0); "
                             f"pass one with at least {batch_size} items (one global batch)")
        if n < batch_size:
            fits = n // dp_size * dp_size  # the largest global batch the replicas split evenly
            fix = (f"use batch_size={fits} or less (a multiple of the {dp_size} data-parallel "
                   f"replicas), or more data" if fits else
                   f"the {dp_size} data-parallel replicas need at least {dp_size} items")
            raise ValueError(f"dataset has {n} items, fewer than one global batch of "
                             f"{batch_size}; {fix}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.local_batch_size = batch_size // dp_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.collate_fn = collate_fn or default_collate
        self.micro_batches = micro_batches
        self.steps = steps
        self.step = start_step
        self.batches_per_epoch = len(dataset) // batch_size  # type: ignore[arg-type]
        self._cached: tuple[tuple[int, int], torch.Tensor] | None = None  # (seed, epoch), order
        self._warned_left_padding = False
        self.num_workers, self.persistent_workers = num_workers, persistent_workers
        self.pin_memory = pin_memory
        self._workers: DataLoader | None = None  # made at the first pass that needs it
        self._build: ReplicaBatch | None = None
        left = n % batch_size
        if left and not shuffle:
            warnings.warn(f"plait: shuffle=False and {n} items make {n // batch_size} global "
                          f"batches of {batch_size}: the last {left} items (indices {n - left} "
                          f"to {n - 1}) are never drawn, in any epoch (a shuffled loader "
                          f"draws them in other epochs). Use a batch_size that divides {n}, "
                          f"or shuffle=True", UserWarning, stacklevel=user_stacklevel())

    def _end(self) -> int:
        """The step after the last one this loader yields."""
        if self.steps is not None:
            return self.steps
        # The end of the current epoch, so that an epoch loop (a new loader each epoch, or this
        # one iterated again) resumed mid-epoch finishes that epoch, then starts the next at
        # its first batch, as the uninterrupted run does.
        return (self.step // self.batches_per_epoch + 1) * self.batches_per_epoch

    def __len__(self) -> int:
        return max(0, self._end() - self.step)

    def _order(self, epoch: int) -> torch.Tensor:
        """The epoch's permutation of the dataset, drawn once per epoch (not once per step)."""
        key = (self.seed, epoch)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            order = torch.arange(n)
        else:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            order = torch.randperm(n, generator=gen)
        self._cached = (key, order)
        return order

    def global_indices(self, step: int) -> torch.Tensor:
        """Dataset indices of the whole global batch of ``step`` (all replicas)."""
        epoch, k = divmod(step, self.batches_per_epoch)
        order = self._order(epoch)
        return order[k * self.batch_size:(k + 1) * self.batch_size]

    def rows(self, step: int) -> list[int]:
        """Dataset indices of this replica's rows at ``step``."""
        idx = self.global_indices(step)
        lo = self.dp_rank * self.local_batch_size
        return [int(i) for i in idx[lo:lo + self.local_batch_size]]

    def keys(self, step: int) -> list[tuple[int, int]]:
        """(epoch, dataset index) of this replica's rows at ``step``: what an item's random
        draws are seeded from."""
        epoch = step // self.batches_per_epoch
        return [(epoch, i) for i in self.rows(step)]

    def _key(self, step: int) -> tuple[int, int, list[tuple[int, int]]]:
        epoch, k = divmod(step, self.batches_per_epoch)
        return epoch, k, self.keys(step)

    def _builder(self) -> ReplicaBatch:
        if self._build is None or self._build.seed != self.seed:
            self._build = ReplicaBatch(self.dataset, self.seed, self.dp_rank, self.collate_fn,
                                       self.micro_batches)
        return self._build

    def batch(self, step: int) -> Any:
        """This replica's batch at ``step``."""
        return self._checked(self._builder()[self._key(step)])

    def _checked(self, batch: Any) -> Any:
        if (self.collate_fn is not default_collate and self.dp_size > 1
                and not self._warned_left_padding):
            self._warned_left_padding = warn_left_padding(batch, self.dp_size)
        return batch

    def __iter__(self) -> Iterator[Any]:
        if self.num_workers == 0 and not self.pin_memory:
            end = self._end()
            while self.step < end:
                batch = self.batch(self.step)
                self.step += 1
                yield batch
            return
        for batch in self._loader():  # its sampler stops at ``end``
            self.step += 1
            yield self._checked(batch)

    def _loader(self) -> DataLoader:
        """torch's DataLoader for the workers and pinning: its sampler hands out this replica's
        batches (their keys) from the current step to the end of the pass, and each worker
        builds whole batches with ``ReplicaBatch``, as the in-process path does, so the items
        and the collate draw what they would there. The generator that seeds the workers
        themselves is (seed, data rank)'s, the same on every rank of a replica."""
        if self._workers is None:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.dp_rank) % 2**63)
            self._workers = DataLoader(
                self._builder(),  # type: ignore[arg-type]
                sampler=_ReplicaSteps(self), batch_size=None, collate_fn=as_is,
                num_workers=self.num_workers, persistent_workers=self.persistent_workers,
                pin_memory=self.pin_memory, generator=gen)
        return self._workers

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["seed"]) != self.seed:
            self._workers = None  # its workers hold the items of the old seed
        self.step, self.seed = int(state["step"]), int(state["seed"])


def check_loader_args(batch_size: int, dp_size: int, num_workers: int,
                      persistent_workers: bool) -> None:
    """Refuse a global batch the replicas cannot split and worker settings that cannot work
    (any loader, map-style or stream)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be >= 0 (0 loads in this process)")
    if num_workers and multiprocessing.current_process().daemon:
        raise ValueError(f"num_workers={num_workers} starts loader worker processes, which "
                         f"this process may not: it is daemonic (plait.spawn."
                         f"run_distributed starts its ranks so, to end them with the "
                         f"caller). Use num_workers=0 here, or start the ranks with "
                         f"plait run or torchrun")
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers=True keeps worker processes alive, and "
                         "num_workers=0 starts none: give num_workers > 0 or drop "
                         "persistent_workers")
    if batch_size % dp_size:
        raise ValueError(f"global batch_size={batch_size} is not divisible by the "
                         f"{dp_size} data-parallel replicas; use a multiple of {dp_size}")


class ReplicaBatch:
    """Builds one replica's batch from its key (epoch, k, [(epoch, index), ...]): each item
    drawing its randomness from (seed, epoch, index), the collate from (seed, epoch, k, data
    rank), so that what it draws is the same with or without workers and after a resume (a
    class at module level: loader workers receive it pickled)."""

    def __init__(self, dataset: Any, seed: int, dp_rank: int,
                 collate_fn: Callable[[list[Any]], Any], micro_batches: int = 1):
        self.dataset, self.seed, self.dp_rank = dataset, seed, dp_rank
        self.collate_fn, self.micro_batches = collate_fn, micro_batches
        self.watch = GeneratorWatch()  # every batch looks for generators of the dataset's own

    def __getitem__(self, key: tuple[int, int, list[tuple[int, int]]]) -> Any:
        return self.watch(self.dataset, lambda: self._build(key))

    def _build(self, key: tuple[int, int, list[tuple[int, int]]]) -> Any:
        epoch, k, items = key
        rows = [seeded_item(self.dataset, self.seed, e, i) for e, i in items]
        return seeded_collate(self.collate_fn, rows, self.seed, epoch, k, self.dp_rank,
                              self.micro_batches)


def seeded_collate(collate_fn: Callable[[list[Any]], Any], rows: list[Any], seed: int,
                   epoch: int, k: int, dp_rank: int, micro_batches: int = 1) -> Any:
    """``collate_fn(rows)`` for batch k of ``epoch`` of data replica ``dp_rank``, drawing from
    (seed, epoch, k, dp_rank): random masking in a collate (a masked-LM collator) is the same
    on every peer of a replica, with or without workers, and after a resume. With
    ``micro_batches`` > 1, as :func:`collate_each`."""
    return run_seeded(lambda: collate_each(collate_fn, rows, micro_batches),
                      batch_seed(seed, epoch, k, dp_rank))


def collate_each(collate_fn: Callable[[list[Any]], Any], rows: list[Any], parts: int) -> Any:
    """``collate_fn(rows)``, or, where that batch is not one row per example and ``parts`` > 1,
    :class:`~plait.MicroBatches` of ``collate_fn`` over each of ``parts`` equal runs of
    consecutive rows. Why: gradient accumulation cuts a batch by rows, and a tensor built across
    rows (an ``nn.EmbeddingBag``'s flat index list, whose offsets point into all of it) cut so
    feeds other bags than one device does; each micro-batch collated from its own items is
    exactly what one device's forward computes for those rows, as a data replica's batch is.
    A batch of one row per example is handed out whole, as without accumulation (the train
    step cuts it, and a script that reads it sees one batch).

    One row per example is told by the parts too, not by the whole's shapes alone: a flat
    list of boxes (one row per box, each box's image index in another tensor) that happens to
    hold as many boxes as the batch has images looks like one row per example, and cut by
    rows pairs boxes with other images (or indexes past a micro-batch's images). A custom
    collate's batch is handed whole only where cutting it gives what collating each part
    alone gives (:func:`_cuts_as_collated`)."""
    whole = _collate(collate_fn, rows)
    if parts == 1 or len(rows) % parts:
        return whole
    n = len(rows) // parts
    if collate_fn is default_collate and not ragged_entries(whole)[1]:
        return whole  # stacks each item's tensors: one row per example by construction
    each = tuple(_collate(collate_fn, rows[i * n:(i + 1) * n]) for i in range(parts))
    if not ragged_entries(whole)[1] and _cuts_as_collated(whole, each, collate_fn, rows):
        return whole
    return MicroBatches(each)


def _cuts_as_collated(whole: Any, each: tuple[Any, ...],
                      collate_fn: Callable[[list[Any]], Any], rows: list[Any]) -> bool:
    """Whether ``whole`` cut by rows into ``len(each)`` parts gives ``each`` (the parts
    collated alone): equal values, or, for a collate that draws random numbers (a masked-LM
    collator; told by collating ``rows`` once more), equal shapes."""
    from ..train import split_microbatches  # the train step's own cut

    try:
        cut = split_microbatches(whole, len(each))
    except ValueError:  # a batch the step could not cut either: the parts, then
        return False
    if all(_same(a, b, values=True) for a, b in zip(cut, each, strict=True)):
        return True
    if not _same(whole, _collate(collate_fn, rows), values=True):  # random: shapes only
        return all(_same(a, b, values=False) for a, b in zip(cut, each, strict=True))
    return False


def _same(a: Any, b: Any, *, values: bool) -> bool:
    """``a`` and ``b`` alike in structure and rows, and with ``values`` in the values of each
    tensor of one shape in both. Tensors of as many rows and other lengths (padded to the
    longest of the part, not of the whole) are alike: their rows are still one per example."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.ndim != b.ndim:
            return False
        if a.shape != b.shape:
            return a.shape[0] == b.shape[0]
        return not values or bool(torch.equal(a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and list(a) == list(b)
                and all(_same(a[k], b[k], values=values) for k in a))
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list))
                and len(a) == len(b)
                and all(_same(x, y, values=values) for x, y in zip(a, b, strict=True)))
    return not values or bool(a == b)


class _ReplicaSteps(Sampler[tuple[int, int, list[tuple[int, int]]]]):
    """The keys of a DistributedLoader's batches, from its step at the start of each pass to
    the end of that pass (torch's samplers split the dataset per rank; this one follows the
    loader's global batches)."""

    def __init__(self, loader: DistributedLoader):
        self.loader = loader

    def __iter__(self) -> Iterator[tuple[int, int, list[tuple[int, int]]]]:
        for step in range(self.loader.step, self.loader._end()):
            yield self.loader._key(step)

    def __len__(self) -> int:
        return len(self.loader)


def as_is(batch: Any) -> Any:
    """The DataLoader's collate when the batch is built whole already."""
    return batch


def _collate(collate_fn: Callable[[list[Any]], Any], items: list[Any]) -> Any:
    """``collate_fn(items)``; items of different shapes under the default collate are refused
    with the fix (a module-level function: loader workers receive it pickled)."""
    if collate_fn is not default_collate:
        return collate_fn(items)
    try:
        return default_collate(items)
    except RuntimeError as exc:
        if "equal size" not in str(exc):
            raise
        raise ValueError(f"dataset items of different shapes do not stack into a batch "
                         f"({str(exc).rstrip('.')}); pass run.loader(..., collate_fn=...) "
                         f"that pads them to one length") from exc


def warn_left_padding(batch: Any, dp_size: int) -> bool:
    """Warn (and return True) when ``batch`` is left-padded to its own longest row and gives
    no ``position_ids``: each data replica pads its rows to its own longest, so a row's tokens
    sit further right than in one device's batch (padded to the global batch's longest). A
    model that numbers positions from the start of the row (GPT-2's and BERT's learned
    positions) then sees other positions and trains something else; relative positions (RoPE)
    do not notice, and ``position_ids`` from the mask make every model agree."""
    inputs = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if not isinstance(inputs, dict) or "position_ids" in inputs:
        return False
    mask = inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.shape[1] < 2:
        return False
    first, last = mask[:, 0] != 0, mask[:, -1] != 0
    # Left padding (every row ends with a token), to this batch's longest row (one row fills
    # it; a batch padded to a fixed length leaves every row padding, whatever the replica).
    if not (bool(last.all()) and bool(first.any()) and not bool(first.all())):
        return False
    warnings.warn(f"plait: the batches are left-padded without 'position_ids': each of the "
                  f"{dp_size} data replicas pads its rows to its own longest, so a row's "
                  f"tokens sit at other positions than in one device's batch, and a model "
                  f"with absolute positions (GPT-2, BERT) trains something else. Give "
                  f"position_ids from the collate_fn (attention_mask.cumsum(-1) - 1, "
                  f"clamped at 0), pad on the right, or pad to a fixed length",
                  stacklevel=user_stacklevel())
    return True


def refuse_data_loader(dataset: Any) -> None:
    """A DataLoader is not a dataset: plait draws and shards the batches itself."""
    if isinstance(dataset, DataLoader):
        raise ValueError(f"run.loader() takes the dataset, not a DataLoader "
                         f"({type(dataset).__name__}): pass its .dataset and the global "
                         f"batch_size, and its collate_fn, num_workers and pin_memory as those "
                         f"arguments; plait draws and shards the batches itself")


def is_stream(dataset: Any) -> bool:
    """An iterable dataset (``IterableDataset``, a ``datasets`` streaming dataset, any object
    with ``__iter__`` but not both ``len`` and ``dataset[i]``): read in order, by
    ``plait.data.stream.StreamLoader``."""
    if isinstance(dataset, IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not (hasattr(dataset, "__len__")
                                                 and hasattr(dataset, "__getitem__"))


def _check_map_style(dataset: Any) -> None:
    """Refuse what this loader cannot index by position: it draws each global batch's indices
    from (seed, step) and hands each data replica its own rows, which needs ``len`` and
    ``dataset[i]``. An iterable dataset goes to ``StreamLoader``, which ``run.loader`` picks."""
    refuse_data_loader(dataset)
    name = type(dataset).__name__
    if is_stream(dataset) or not (hasattr(dataset, "__len__")
                                  and hasattr(dataset, "__getitem__")):
        raise ValueError(f"dataset {name} has no len() and dataset[i] (an iterable dataset): "
                         f"DistributedLoader indexes a map-style dataset; load a stream with "
                         f"plait.data.StreamLoader, or run.loader(), which picks it")
