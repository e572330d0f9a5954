"""Contiguous splits of a block sequence over pipeline stages.

One home for the pipeline runtime (:mod:`plait.parallel.pipeline_split`) and the planner
(:mod:`plait.planner.pipeline`), so the stages the planner prices are the stages the runtime
builds. Pure Python: the planner imports it without torch.
"""

from __future__ import annotations

import functools
import math


def even_split(n: int, parts: int) -> list[int]:
    """``n`` blocks over ``parts`` chunks, the first ``n % parts`` one larger."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def balanced_partition(costs: list[float] | tuple[float, ...], parts: int, *,
                       first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Blocks per chunk splitting ``costs`` into ``parts`` contiguous non-empty chunks, the
    largest chunk's sum smallest. ``first_extra`` / ``last_extra`` weigh the first / last
    chunk (the embedding before the blocks, the head after them): the first chunk always holds
    block 0 and the last block n-1, so they add to those blocks' costs."""
    costs = [float(c) for c in costs]
    if costs:
        costs[0] += first_extra
        costs[-1] += last_extra
    return list(_balanced_partition(tuple(costs), parts))


def bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` block ranges of consecutive chunks of ``sizes`` blocks."""
    edges = [0]
    for n in sizes:
        edges.append(edges[-1] + n)
    return list(zip(edges[:-1], edges[1:], strict=True))


@functools.lru_cache(maxsize=4096)
def _balanced_partition(costs: tuple[float, ...], parts: int) -> tuple[int, ...]:
    """Dynamic programming over (chunks, prefix): best[k][j] = min_i max(best[k-1][i],
    S[j]-S[i]). best[k-1][.] grows with i while S[j]-S[i] shrinks, so the optimal i is where
    they cross, and that crossing only moves right as j grows: one pointer swept once per k
    instead of a scan (O(parts * n)). Ties go to the earliest split, so the result is
    deterministic."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} blocks into {parts} pipeline chunks")
    prefix = [0.0]
    for x in costs:
        prefix.append(prefix[-1] + x)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    arg = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        prev, cur, cur_arg = best[k - 1], best[k], arg[k]
        lo = k - 1
        for j in range(k, n - (parts - k) + 1):
            # first i in [k-1, j-1] where prev[i] >= S[j]-S[i] (j-1 if none): the predicate
            # only gets harder as S[j] grows, so the pointer never moves back
            top, sj = j - 1, prefix[j]
            while lo < top and prev[lo] < sj - prefix[lo]:
                lo += 1
            value, i = inf, lo
            for c in (lo - 1, lo):
                if k - 1 <= c <= top and prev[c] < inf:
                    v = max(prev[c], sj - prefix[c])
                    if v < value:  # strict: the earlier split wins a tie
                        value, i = v, c
            cur[j], cur_arg[j] = value, i
    sizes, j = [], n
    for k in range(parts, 0, -1):
        i = arg[k][j]
        sizes.append(j - i)
        j = i
    return tuple(sizes[::-1])
