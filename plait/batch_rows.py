"""Whether every tensor of a batch has one row per example, before plait splits it by rows.

Gradient accumulation and pipeline microbatches cut a batch along dim 0 into equal parts. That
is right for tensors with one row per example, and wrong for one that is not: the flat index
list of an ``nn.EmbeddingBag`` with ``offsets`` (a recommender's variable-length sparse
feature) has as many entries as all the bags together, and its offsets point into the whole
list. Cut by rows, such a pair fails deep inside the model (``offsets[0] has to be 0``) or,
where the sizes happen to divide, trains on other bags than one device does. This module finds
such an entry and refuses it by name, before any part is computed, unless the batch comes as
:class:`MicroBatches`: parts collated one by one from their own items (``run.loader`` builds
them so under ``grad_accum``), which plait takes as they are instead of cutting."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch


def row_counts(batch: Any, path: str = "") -> list[tuple[str, int]]:
    """(where, dim-0 size) of every tensor of at least one dimension in ``batch`` (a tensor, or
    dicts, tuples and lists of them), ``where`` written as a user indexes it (``'ids'``,
    ``[0]['ids']``)."""
    if isinstance(batch, torch.Tensor):
        return [(path or "the batch", batch.shape[0])] if batch.ndim else []
    if isinstance(batch, dict):
        return [c for k, v in batch.items() for c in row_counts(v, f"{path}[{k!r}]")]
    if per_example(batch, path):
        return [(path, len(batch))]
    if isinstance(batch, (tuple, list)):
        return [c for i, v in enumerate(batch) for c in row_counts(v, f"{path}[{i}]")]
    return []


def per_example(value: Any, path: str) -> bool:
    """Whether ``value`` is a list (or tuple) of one dict per example, below the batch's top
    level: a detector's targets (``[{"boxes": (n_i, 4), "labels": (n_i,)}, ...]``, one per
    image, each with its own number of boxes). Its rows are its items, cut by position; a
    tensor inside one dict is that example's, never cut. At the top level a pair of dicts is
    ``(inputs, targets)``, not two examples (``path`` is empty there)."""
    return (bool(path) and isinstance(value, (tuple, list)) and bool(value)
            and all(isinstance(v, dict) for v in value))


@dataclass(frozen=True)
class MicroBatches:
    """One step's batch as its micro-batches, each collated from its own items: what a collate
    that builds tensors across rows (a flat index list with offsets) needs, since such a batch
    collated whole cannot be cut by rows. ``run.step`` and ``run.evaluate`` run ``parts[i]``
    as micro-batch i (their number must be ``grad_accum``, times ``microbatches`` under a
    pipeline, which runs part ``a * microbatches + j`` as microbatch j of accumulation step
    a); ``run.loader`` hands one where a collated batch is not one row per example and the
    plan cuts it. Not a batch itself: read an entry in ``parts[i]``."""

    parts: tuple[Any, ...]

    def __getitem__(self, key: Any) -> Any:
        raise TypeError(f"this batch is {len(self.parts)} micro-batches collated one by one "
                        f"(plait.MicroBatches: run.loader collates each on its own when the "
                        f"collate_fn's batch is not one row per example and the plan "
                        f"cuts it), not one batch: read batch.parts[i][{key!r}]")


def ragged_entries(batch: Any, rows: int | None = None) -> tuple[int, list[tuple[str, int]]]:
    """(the batch's row count, the (where, dim-0 size) of every tensor whose dim 0 is not it).
    ``rows``: the row count where the caller knows it, else the size most tensors share."""
    counts = row_counts(batch)
    if not counts:
        return rows or 0, []
    if rows is None:
        rows = Counter(n for _, n in counts).most_common(1)[0][0]
    return rows, [(where, n) for where, n in counts if n != rows]


def refuse_ragged(batch: Any, parts: str, without: str, rows: int | None = None,
                  fix: str = "") -> None:
    """ValueError naming the tensors of ``batch`` whose dim 0 is not the batch's rows, when it
    is to be cut into ``parts`` (``"grad_accum=2 micro-batches"``); ``without`` is the plan that
    does not cut it (``"grad_accum=1"``), ``fix`` a further way out said first. ``rows`` is the
    row count where the caller knows it (a pipeline's first input), else the size most tensors
    share."""
    rows, odd = ragged_entries(batch, rows)
    if not odd:
        return
    counts = row_counts(batch)
    where, n = odd[0]
    same = [_shown(w) for w, m in counts if m == rows]
    shown = ", ".join(same[:3]) + (", ..." if len(same) > 3 else "")
    more = f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
    raise ValueError(
        f"batch entry {_shown(where)} has {n} rows where the "
        f"batch has {rows} ({shown}){more}: it is not one row per example (a flat index list "
        f"with offsets?), so plait cannot cut it into {parts}. Give every example its own row "
        f"(for nn.EmbeddingBag: pad each bag to one length and pass a 2-D input with "
        f"padding_idx, no offsets), {fix}or run with {without}")


def _shown(where: str) -> str:
    """``'ids'`` for a top-level key (``['ids']``), the path as it is for a nested one."""
    inner = where[1:-1]
    return inner if where.startswith("[") and "[" not in inner else where
