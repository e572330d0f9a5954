"""Hugging Face ``datasets`` through ``run.loader``, against one device: a ``datasets.Dataset``
(map-style, torch format) and its ``IterableDataset`` (``to_iterable_dataset``) under dp=2,
with a resume. Skipped where ``datasets`` is not installed (it is not a plait dependency)."""

from __future__ import annotations

import shutil
from functools import partial

import pytest
import torch

from plait.spawn import run_distributed
from tests import _workers_data as D

pytest.importorskip("datasets")

REL = 1e-6


def _assert_trains(rank: dict, losses: list[float], state: dict) -> None:
    assert all(abs(a - b) <= REL * abs(a)
               for a, b in zip(losses, rank["losses"], strict=True)), (losses, rank["losses"])
    for name, want in state.items():
        assert (rank["state"][name] - want).abs().max() <= 1e-6, name


def _global(ranks: list[dict]) -> list[list[int]]:
    return [a + b for a, b in zip(ranks[0]["ids"], ranks[1]["ids"], strict=True)]


@pytest.mark.slow
def test_a_datasets_dataset_trains_one_devices_batches_under_dp2_and_resumes(tmp_path):
    """A ``datasets.Dataset`` of ``Numbered``'s items: dp=2 splits the global batches one
    device draws (the loader's order over 22 items) and ends with one device's losses and
    parameters; saved at step 3 and resumed, it trains the last 2 steps to the same end."""
    from plait.data import DistributedLoader

    order = DistributedLoader(D.Numbered(), D.BATCH)
    want = [order.rows(step) for step in range(5)]
    losses, state = D.one_device_run(want, D.hf_numbered())
    assert losses == D.one_device_losses(want)  # its items are Numbered's
    ranks = run_distributed(D.trace, 2, "dp=2", 5, data="hf", timeout=180)
    assert _global(ranks) == want
    for r in ranks:
        _assert_trains(r, losses, state)
    folder = tmp_path / "ckpt"
    run_distributed(D.trace, 2, "dp=2", 5, data="hf", checkpoint=str(folder), stop_after=3,
                    timeout=180)
    resumed = run_distributed(D.trace, 2, "dp=2", 5, data="hf", checkpoint=str(folder),
                              timeout=180)
    assert _global(resumed) == want[3:]
    for r in resumed:
        _assert_trains(r, losses[3:], state)


@pytest.mark.slow
def test_a_datasets_stream_trains_one_devices_batches_under_dp2_and_resumes(tmp_path):
    """``to_iterable_dataset`` of it (2 shards, in order): the stream's first 16 items each
    epoch, run across epochs; saved at step 3 (the second epoch) under dp=2 and resumed under
    tp=2 and under dp=2, one device's losses and parameters."""
    want = [list(range(8)), list(range(8, 16))] * 2 + [list(range(8))]
    losses, state = D.one_device_run(want)
    folder = tmp_path / "ckpt"
    first = run_distributed(D.trace, 2, "dp=2", 5, data="hf_stream", checkpoint=str(folder),
                            stop_after=3, timeout=180)
    assert _global(first) == want[:3]
    shutil.copytree(folder, tmp_path / "same")
    for plan, where in (("dp=2", tmp_path / "same"), ("tp=2", folder)):
        resumed = run_distributed(D.trace, 2, plan, 5, data="hf_stream",
                                  checkpoint=str(where), timeout=180)
        got = _global(resumed) if plan == "dp=2" else resumed[0]["ids"]
        assert got == want[3:], plan
        for r in resumed:
            _assert_trains(r, losses[3:], state)


def test_a_shuffled_datasets_stream_is_shuffled_anew_each_epoch_on_every_reader():
    """``.shuffle(seed, buffer_size)`` draws from its seed and epoch: a loader running across
    epochs tells it each epoch (a new order each), dp=2 splits one device's batches, a
    resume in the second epoch continues them, and loader workers are refused by name (in a
    worker ``datasets`` reads only that worker's share of the shards)."""
    from plait.data import StreamLoader

    stream = D.hf_stream().shuffle(seed=3, buffer_size=8)

    def ids(dp_rank: int = 0, dp_size: int = 1, state: dict | None = None) -> list[list[int]]:
        loader = StreamLoader(stream, D.BATCH, dp_rank=dp_rank, dp_size=dp_size, steps=4,
                              collate_fn=partial(D.pad, length=D.SEQ))
        if state:
            loader.load_state_dict(state)
        return [b["id"].tolist() for b in loader]

    whole = ids()
    assert whole[:2] != whole[2:]
    assert [a + b for a, b in zip(ids(0, 2), ids(1, 2), strict=True)] == whole
    assert ids(state={"step": 3, "seed": 0, "epoch": 1, "epoch_start": 2}) == whole[3:]
    with pytest.raises(ValueError, match=r"num_workers=2 with datasets' IterableDataset"):
        StreamLoader(stream, D.BATCH, num_workers=2)


def test_a_datasets_dataset_splits_and_resumes_as_one_device_loads_it():
    """The cheap form of the spawned run above: the loader over the ``datasets.Dataset`` at
    dp=2 (each replica its rows) and resumed at step 3 hands out one device's rows and
    tensors, which are ``Numbered``'s."""
    from plait.data import DistributedLoader

    def batches(dp_rank: int = 0, dp_size: int = 1, start: int = 0) -> list[dict]:
        return list(DistributedLoader(D.hf_numbered(), D.BATCH, dp_rank=dp_rank,
                                      dp_size=dp_size, steps=5, start_step=start,
                                      collate_fn=partial(D.pad, length=D.SEQ)))

    whole = batches()
    plain = list(DistributedLoader(D.Numbered(), D.BATCH, steps=5,
                                   collate_fn=partial(D.pad, length=D.SEQ)))
    for a, b in zip(whole, plain, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["id"], b["id"])
    halves = [batches(r, 2) for r in range(2)]
    for s, want in enumerate(whole):
        assert torch.equal(torch.cat([halves[0][s]["id"], halves[1][s]["id"]]), want["id"])
    assert [b["id"].tolist() for b in batches(start=3)] == [b["id"].tolist()
                                                           for b in whole[3:]]


class _Skipping(torch.utils.data.IterableDataset):
    """The documented seek for a ``datasets`` stream: ``iter_from`` is its ``skip``."""

    def __init__(self, stream):
        self.stream = stream

    def __iter__(self):
        return iter(self.stream)

    def iter_from(self, position: int):
        return iter(self.stream.skip(position))


def test_a_datasets_streams_skip_is_a_seek_unless_it_is_shuffled():
    """Resumed at step 3 (the second epoch, its second batch; dp=2, so replica 1 jumps to item
    12), the unshuffled stream's ``skip`` hands out the batches of the loader that read from
    the start. A shuffled stream's ``skip`` forgets the epoch: in the second epoch it hands
    out other items, which is why the docs say not to use it there."""
    from plait.data import StreamLoader

    def ids(stream, dp_rank: int = 0, dp_size: int = 1, resume: bool = False):
        loader = StreamLoader(stream, D.BATCH, dp_rank=dp_rank, dp_size=dp_size, steps=5,
                              collate_fn=partial(D.pad, length=D.SEQ))
        if resume:
            loader.load_state_dict({"step": 3, "seed": 0, "epoch": 1, "epoch_start": 2})
        return [b["id"].tolist() for b in loader]

    plain = D.hf_stream()
    whole = ids(plain)
    halves = [ids(_Skipping(plain), r, 2, resume=True) for r in range(2)]
    assert [a + b for a, b in zip(*halves, strict=True)] == whole[3:]
    shuffled = plain.shuffle(seed=3, buffer_size=8)
    assert ids(_Skipping(shuffled), resume=True) != ids(shuffled)[3:]
