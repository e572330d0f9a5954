"""What seeding each item's randomness costs the loader, per item, side by side.

``run.loader`` calls ``dataset[i]`` with the global generators seeded from (seed, epoch, i)
and torch's state put back after it (``plait.data.rng``), so that random augmentation is the
item's own under every layout, worker count and resume. This times ``dataset[i]`` alone and
through that seeding, on the bundled corpus's windows (an item that costs almost nothing, so
the difference is the seeding), interleaved rounds, best of each.

    python bench/data_item_seeding.py [--items 20000] [--rounds 5] [--format json]
"""

from __future__ import annotations

import argparse
import json
import time

from plait.data import TextDataset
from plait.data.rng import seeded_item


def _per_item(fn, items: int) -> float:
    start = time.perf_counter()
    for i in range(items):
        fn(i)
    return (time.perf_counter() - start) / items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--format", choices=["table", "json"], default="table")
    args = parser.parse_args()
    data = TextDataset(seq_len=128)
    n = min(args.items, len(data))
    plain, seeded = [], []
    for _ in range(args.rounds):
        plain.append(_per_item(lambda i: data[i], n))
        seeded.append(_per_item(lambda i: seeded_item(data, 0, 0, i), n))
    out = {"items": n, "plain_us": min(plain) * 1e6, "seeded_us": min(seeded) * 1e6,
           "added_us": (min(seeded) - min(plain)) * 1e6}
    if args.format == "json":
        print(json.dumps(out))
        return
    print(f"{'per item':<22}{'us':>8}")
    print(f"{'dataset[i]':<22}{out['plain_us']:>8.1f}")
    print(f"{'seeded dataset[i]':<22}{out['seeded_us']:>8.1f}")
    print(f"{'added by seeding':<22}{out['added_us']:>8.1f}")


if __name__ == "__main__":
    main()
