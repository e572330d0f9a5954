"""A distributed loader that shards over the data axes only.

Why our own rather than ``DistributedSampler``: plait's promise is that a layout trains the same
model as one device on the same data. So the loader thinks in *global* batches: step k's global
batch is a pure function of (seed, k), and data replica r takes rows [r*b, (r+1)*b) of it. Ranks
that hold the same replica (tensor- and pipeline-parallel peers) get identical batches, one
device gets the whole global batch, and resuming at step k needs nothing but k.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate


class DistributedLoader:
    """Yields this replica's slice of each global batch, ``steps`` times (cycling epochs).

    ``batch_size`` is the global batch (all data replicas together) and must divide by
    ``dp_size``. ``start_step`` resumes exactly where a previous run stopped.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, steps: int | None = None, start_step: int = 0,
                 shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if batch_size % dp_size:
            raise ValueError(f"global batch_size={batch_size} is not divisible by the "
                             f"{dp_size} data-parallel replicas; use a multiple of {dp_size}")
        n = len(dataset)  # type: ignore[arg-type]
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
        self.steps = steps
        self.step = start_step
        self.batches_per_epoch = len(dataset) // batch_size  # type: ignore[arg-type]
        self._cached: tuple[tuple[int, int], torch.Tensor] | None = None  # (seed, epoch), order

    def __len__(self) -> int:
        if self.steps is None:
            return self.batches_per_epoch
        return max(0, self.steps - self.step)

    def _order(self, epoch: int) -> torch.Tensor:
        """The epoch's permutation of the dataset, drawn once per epoch (not once per step)."""
        key = (self.seed, epoch)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            order = torch.arange(n)
        else:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(n, generator=gen)
        self._cached = (key, order)
        return order

    def global_indices(self, step: int) -> torch.Tensor:
        """Dataset indices of the whole global batch of ``step`` (all replicas)."""
        epoch, k = divmod(step, self.batches_per_epoch)
        order = self._order(epoch)
        return order[k * self.batch_size:(k + 1) * self.batch_size]

    def batch(self, step: int) -> Any:
        """This replica's batch at ``step``."""
        idx = self.global_indices(step)
        mine = idx[self.dp_rank * self.local_batch_size:(self.dp_rank + 1) * self.local_batch_size]
        return default_collate([self.dataset[int(i)] for i in mine])

    def __iter__(self) -> Iterator[Any]:
        end = self.steps if self.steps is not None else self.step + self.batches_per_epoch
        while self.step < end:
            batch = self.batch(self.step)
            self.step += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.seed = int(state["step"]), int(state["seed"])
