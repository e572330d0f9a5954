"""What resuming a stream deep into an epoch costs, with and without the seek protocol.

A resumed ``StreamLoader`` must start at the position its checkpoint holds. A stream without
``iter_from`` is read from the start of the epoch and the items before that position dropped
(each still stepped with its own seed, so its draws are the walk's); one with ``iter_from``
starts there. The stream here is a file of fixed-size token records (the bundled corpus cut
into windows of ``seq_len`` + 1 bytes, written to a temporary file), read one record at a time:
its ``iter_from`` is a file seek. This times the first batch after a resume at ``--position``
(dp=1, the loader's own reader, no workers) both ways, interleaved rounds, best of each, and
checks that both hand out the same batch.

``--datasets`` (needs Hugging Face ``datasets``) times the same for a ``datasets`` stream
(``Dataset.to_iterable_dataset`` of the records, torch format, 8 shards, not shuffled),
walked, and through an ``iter_from`` that is its ``skip(position)`` (right for a stream that is
not shuffled only: a shuffled one's ``skip`` forgets the epoch's shuffle), one round each.

    python bench/stream_resume_seek.py [--position 100000] [--batch 32] [--rounds 3]
                                       [--datasets] [--format json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from plait.data import StreamLoader, encode, load_corpus


class Records(IterableDataset):
    """Fixed-size records of a file, in order, the whole file each ``iter``. Each item is
    (inputs, next tokens)."""

    def __init__(self, path: str, seq_len: int):
        self.path, self.size = path, seq_len + 1

    def _read(self, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        with open(self.path, "rb") as f:
            f.seek(start * self.size)
            while len(raw := f.read(self.size)) == self.size:
                window = encode(raw)
                yield window[:-1], window[1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self._read(0)


class SeekableRecords(Records):
    def iter_from(self, position: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self._read(position)


class Skipping(IterableDataset):
    """A ``datasets`` stream whose ``iter_from`` is its ``skip``."""

    def __init__(self, stream: Any):
        self.stream = stream

    def __iter__(self) -> Iterator[Any]:
        return iter(self.stream)

    def iter_from(self, position: int) -> Iterator[Any]:
        return iter(self.stream.skip(position))


def _hf_streams(path: str, seq_len: int) -> tuple[Any, Any]:
    import datasets

    windows = [window.tolist() for window, _ in Records(path, seq_len)]
    stream = datasets.Dataset.from_dict({"input_ids": windows}).with_format(
        "torch").to_iterable_dataset(num_shards=8)
    return stream, Skipping(stream)


def _write(path: str, items: int, seq_len: int) -> None:
    corpus = load_corpus()
    want = items * (seq_len + 1)
    with open(path, "wb") as f:
        written = 0
        while written < want:
            chunk = corpus[:want - written]
            f.write(chunk)
            written += len(chunk)


def _first_batch(data: Any, position: int, batch: int) -> tuple[float, torch.Tensor]:
    loader = StreamLoader(data, batch, steps=position // batch + 1)
    loader.load_state_dict({"step": position // batch, "seed": 0, "epoch": 0,
                            "epoch_start": 0})
    start = time.perf_counter()
    got = next(iter(loader))
    inputs = got["input_ids"] if isinstance(got, dict) else got[0]
    return time.perf_counter() - start, inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--position", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--datasets", action="store_true")
    parser.add_argument("--format", choices=["table", "json"], default="table")
    args = parser.parse_args()
    position = args.position // args.batch * args.batch
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "records.bin")
        _write(path, position + 2 * args.batch, args.seq_len)
        walk, seek = [], []
        for _ in range(args.rounds):
            t_walk, a = _first_batch(Records(path, args.seq_len), position, args.batch)
            t_seek, b = _first_batch(SeekableRecords(path, args.seq_len), position, args.batch)
            if not torch.equal(a, b):
                raise SystemExit("the seeking reader handed out another batch than the walk")
            walk.append(t_walk)
            seek.append(t_seek)
        hf = {}
        if args.datasets:
            walked, skipping = _hf_streams(path, args.seq_len)
            t_walk, a = _first_batch(walked, position, args.batch)
            t_seek, b = _first_batch(skipping, position, args.batch)
            if not torch.equal(a, b):
                raise SystemExit("datasets' skip handed out another batch than the walk")
            hf = {"datasets_walk_s": t_walk, "datasets_skip_s": t_seek,
                  "datasets_ratio": t_walk / t_seek}
    out = {"position": position, "batch": args.batch, "walk_s": min(walk),
           "seek_s": min(seek), "ratio": min(walk) / min(seek), **hf}
    if args.format == "json":
        print(json.dumps(out))
        return
    print(f"first batch after a resume at item {position:,} (batches of {args.batch})")
    print(f"{'read from the start':<24}{out['walk_s']:>10.4f} s")
    print(f"{'iter_from (file seek)':<24}{out['seek_s']:>10.4f} s")
    print(f"{'ratio':<24}{out['ratio']:>10.0f} x")
    if hf:
        print(f"{'datasets, read':<24}{hf['datasets_walk_s']:>10.4f} s")
        print(f"{'datasets, skip':<24}{hf['datasets_skip_s']:>10.4f} s")
        print(f"{'ratio':<24}{hf['datasets_ratio']:>10.0f} x")


if __name__ == "__main__":
    main()
