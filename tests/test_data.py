"""Bundled corpus, tokenizer and the distributed loader (pure, no process group)."""

import math
from functools import partial

import pytest
import torch

from plait.data import DistributedLoader, TextDataset, decode, encode, load_corpus, unigram_entropy


def test_corpus_and_tokenizer():
    data = load_corpus()
    assert len(data) > 1_000_000
    text = "To be, or not to be"
    assert decode(encode(text)) == text
    h = unigram_entropy(data)
    assert 2.5 < h < math.log(256)  # bytes of English text: well below uniform


def test_replicas_partition_the_global_batch():
    ds = TextDataset(seq_len=16)
    whole = DistributedLoader(ds, 8, seed=3).batch(5)
    parts = [DistributedLoader(ds, 8, dp_rank=r, dp_size=4, seed=3).batch(5) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
    assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
    x, y = whole
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens


def test_deterministic_and_resumable():
    ds = TextDataset(seq_len=16)
    full = [b[0] for b in DistributedLoader(ds, 4, seed=1, steps=6)]
    resumed = DistributedLoader(ds, 4, seed=1, steps=6)
    resumed.load_state_dict({"step": 3, "seed": 1})
    assert all(torch.equal(a, b[0]) for a, b in zip(full[3:], resumed, strict=True))
    other = [b[0] for b in DistributedLoader(ds, 4, seed=2, steps=6)]
    assert not torch.equal(full[0], other[0])


def test_epochs_cycle_with_new_order():
    ds = TextDataset(seq_len=64)
    loader = DistributedLoader(ds, 1024, steps=20)
    n = loader.batches_per_epoch
    assert not torch.equal(loader.global_indices(0), loader.global_indices(n))
    assert len(list(loader)) == 20


def test_bad_loader_input():
    ds = TextDataset(seq_len=16)
    with pytest.raises(ValueError, match="not divisible by the 3 data-parallel"):
        DistributedLoader(ds, 8, dp_size=3)
    with pytest.raises(ValueError, match="batch_size=0"):
        DistributedLoader(ds, 0)
    few = [torch.zeros(1)] * 5
    with pytest.raises(ValueError, match=r"5 items, fewer than one global batch of 8; use "
                                         r"batch_size=4 or less \(a multiple of the 2 data"):
        DistributedLoader(few, 8, dp_size=2)
    with pytest.raises(ValueError, match="the 8 data-parallel replicas need at least 8 items"):
        DistributedLoader(few, 8, dp_size=8)
    with pytest.raises(ValueError, match="split="):
        TextDataset(split="test")


def test_epoch_order_drawn_once_stays_a_function_of_seed_and_step():
    """The permutation is kept per epoch; a step's batch is still what a fresh loader (or one
    whose seed a checkpoint changed) computes for it."""
    ds = TextDataset(seq_len=512)
    walked = DistributedLoader(ds, batch_size=64, seed=3)
    per_epoch = walked.batches_per_epoch
    steps = [0, 1, per_epoch - 1, per_epoch, 2 * per_epoch + 1, 1]
    for step in steps:  # across epoch boundaries and back
        fresh = DistributedLoader(ds, batch_size=64, seed=3)
        assert torch.equal(walked.global_indices(step), fresh.global_indices(step))
    walked.load_state_dict({"step": 0, "seed": 4})
    assert torch.equal(walked.global_indices(1),
                       DistributedLoader(ds, batch_size=64, seed=4).global_indices(1))
    assert not torch.equal(walked.global_indices(1),
                           DistributedLoader(ds, batch_size=64, seed=3).global_indices(1))


def test_a_batch_of_the_wrong_kind_says_what_the_dataset_returned():
    import torch.nn as nn

    from plait.train import _forward_loss

    with pytest.raises(ValueError, match=r"got list of 8 items \(str\): the loader collated "
                                         r"dataset items that are str"):
        _forward_loss(nn.Linear(2, 2), ["text"] * 8, None)
    with pytest.raises(ValueError, match=r"got tuple of 3 items \(Tensor\)$"):
        _forward_loss(nn.Linear(2, 2), (torch.zeros(1),) * 3, None)


def test_what_the_loader_cannot_shard_is_refused_by_name():
    """A DataLoader would yield the same rows on every rank; DistributedLoader indexes, so a
    stream goes to StreamLoader (run.loader picks it), and StreamLoader reads streams only."""
    from torch.utils.data import DataLoader, IterableDataset

    from plait.data import StreamLoader

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(8)

    with pytest.raises(ValueError, match=r"dataset Stream has no len\(\) and dataset\[i\] "
                                         r"\(an iterable dataset\).*load a stream with "
                                         r"plait.data.StreamLoader"):
        DistributedLoader(Stream(), 4)
    with pytest.raises(ValueError, match=r"dataset list is map-style .* load it with "
                                         r"DistributedLoader"):
        StreamLoader(list(range(8)), 4)
    for loader in (DistributedLoader, StreamLoader):
        with pytest.raises(ValueError, match=r"takes the dataset, not a DataLoader "
                                             r"\(DataLoader\): pass its \.dataset"):
            loader(DataLoader(list(range(8)), batch_size=4), 4)
    with pytest.raises(ValueError, match=r"dataset list is empty \(len\(\) is 0\); pass one "
                                         r"with at least 4 items"):
        DistributedLoader([], 4)


def test_variable_length_items_take_a_collate_fn():
    items = [(torch.arange(n), torch.arange(n)) for n in range(1, 9)]
    with pytest.raises(ValueError, match=r"items of different shapes do not stack .* pass "
                                         r"run.loader\(\.\.\., collate_fn=\.\.\.\) that pads"):
        DistributedLoader(items, 4).batch(0)

    def pad(rows):
        return torch.nn.utils.rnn.pad_sequence([x for x, _ in rows], batch_first=True)

    whole = DistributedLoader(items, 4, seed=2, collate_fn=pad)
    mine = DistributedLoader(items, 4, seed=2, collate_fn=pad, dp_rank=1, dp_size=2)
    want = [len(items[int(i)][0]) for i in whole.global_indices(1)[2:]]
    got = mine.batch(1)
    assert got.shape == (2, max(want))
    assert (got != 0).sum(1).add(1).tolist() == want  # each row's own length, padded


def test_steps_none_runs_to_the_end_of_the_epoch_it_starts_in():
    """An epoch loop resumed mid-epoch finishes that epoch, then starts the next at its first
    batch (left over items: 10 items make 2 batches of 4)."""
    loader = DistributedLoader(list(range(10)), 4, start_step=3)
    assert loader.batches_per_epoch == 2
    assert len(loader) == 1
    assert [b.tolist() for b in loader] == [loader.global_indices(3).tolist()]
    assert len(loader) == 2  # iterated again: the next epoch, whole
    assert len(list(loader)) == 2


def _ids(batches) -> list[list[int]]:
    return [b["id"].tolist() for b in batches]


def _stream(dp_rank: int = 0, dp_size: int = 1, **kw):
    from plait.data import StreamLoader
    from tests import _workers_data as D

    data = kw.pop("data", None) or D.Blocks()
    return StreamLoader(data, 8, dp_rank=dp_rank, dp_size=dp_size,
                        collate_fn=partial(D.pad, length=D.SEQ), **kw)


def test_a_stream_splits_into_the_global_batches_one_device_reads():
    """22 items in batches of 8: each replica takes its consecutive rows of each global batch,
    and every replica ends the epoch after 2 steps. At dp=2 replica 0's rows of a third batch
    (items 16 to 19) exist, but the batch is not whole (it would need items up to 23): a
    replica that took them would wait in the step's collective for the other forever."""
    one = _ids(_stream())
    assert one == [list(range(8)), list(range(8, 16))]
    for dp in (2, 4, 8):
        parts = [_ids(_stream(r, dp)) for r in range(dp)]
        assert [sum((p[s] for p in parts), []) for s in range(2)] == one, (dp, parts)
    assert _ids(_stream(steps=5)) == one + one + one[:1]  # epochs cycle: the stream again


def test_a_stream_resumes_at_its_position_under_any_data_parallel_size():
    """Stopped after 3 steps (in its second epoch), the state (step, epoch, the step it began
    at) continues the global batches exactly, at the same dp size, at 1 and at 4 replicas."""
    whole = _ids(_stream(steps=7))
    first = _stream(0, 2, steps=7)
    taken = [b for _, b in zip(range(3), first, strict=False)]
    state = first.state_dict()
    assert len(taken) == 3 and state == {"step": 3, "seed": 0, "epoch": 1, "epoch_start": 2}
    for dp in (2, 1, 4):
        parts = []
        for r in range(dp):
            resumed = _stream(r, dp, steps=7)
            resumed.load_state_dict(state)
            parts.append(_ids(resumed))
        assert [sum((p[s] for p in parts), []) for s in range(4)] == whole[3:], dp


@pytest.mark.parametrize("persistent", [False, True])
def test_stream_workers_each_build_their_own_batches(persistent):
    """Two loader workers (each builds every other batch, reading the stream itself) hand out
    what the loader without workers does, across epochs, and resume at the next batch not
    handed out: no batch twice, none missing."""
    whole = _ids(_stream(1, 2, steps=7))
    loader = _stream(1, 2, steps=7, num_workers=2, persistent_workers=persistent)
    got = [b for _, b in zip(range(3), loader, strict=False)]
    assert {w for b in got for w in b["worker"].tolist()} == {0, 1}
    assert _ids(got) == whole[:3]
    assert _ids(loader) == whole[3:]  # the same loader, iterated again
    resumed = _stream(1, 2, steps=7, num_workers=2)
    resumed.load_state_dict({"step": 3, "seed": 0, "epoch": 1, "epoch_start": 2})
    assert _ids(resumed) == whole[3:]
    ended = _stream(1, 2, num_workers=2)  # steps=None: to the end of the epoch
    assert _ids(ended) == whole[:2] and ended.state_dict()["epoch"] == 1


def test_a_streams_own_randomness_is_the_same_for_every_reader():
    """A generator drawing from the global generators as it yields: one device, the replicas,
    loader workers and a resumed loader see the same draws, and loading leaves the training
    process's random states as they were."""
    from tests import _workers_data as D

    def inputs(batches):
        return [b["input_ids"] for b in batches]

    torch.manual_seed(5)
    before = torch.get_rng_state()
    whole = inputs(_stream(steps=5, data=D.Blocks(noise=True)))
    assert torch.equal(torch.get_rng_state(), before)
    plain = inputs(_stream(steps=5, data=D.Blocks()))
    assert any(not torch.equal(a, b) for a, b in zip(whole, plain, strict=True))  # it draws
    halves = [inputs(_stream(r, 2, steps=5, data=D.Blocks(noise=True), num_workers=2))
              for r in range(2)]
    for s, want in enumerate(whole):
        assert torch.equal(torch.cat([halves[0][s], halves[1][s]]), want)
    resumed = _stream(steps=5, data=D.Blocks(noise=True), num_workers=2)
    resumed.load_state_dict({"step": 3, "seed": 0, "epoch": 1, "epoch_start": 2})
    assert all(torch.equal(a, b) for a, b in zip(inputs(resumed), whole[3:], strict=True))


def test_a_stream_with_iter_from_jumps_to_its_position_instead_of_reading_there():
    """A dataset with ``iter_from`` resumed at step 3 (its second epoch's second batch, items
    8 to 15) is asked to start at each replica's first row and produces only the items from
    there: 8 of the 22 on one device, not 16; under dp=2 replica 1 starts at item 12. The
    batches and the draws of a stream drawing as it yields are those of the run that walked
    the stream from its start, with and without loader workers; an epoch's end is found the
    same way (steps=7 crosses two epoch ends), and a seek past the end ends the epoch."""
    from tests import _workers_data as D

    def batches(loader):
        return [(b["id"].tolist(), b["input_ids"]) for b in loader]

    state = {"step": 3, "seed": 0, "epoch": 1, "epoch_start": 2}
    whole = batches(_stream(steps=7, data=D.Blocks(noise=True)))
    for dp in (1, 2):
        parts = []
        for r in range(dp):
            data = D.SeekableBlocks(noise=True)
            resumed = _stream(r, dp, steps=4, data=data)
            resumed.load_state_dict(state)
            parts.append(batches(resumed))
            assert data.starts[0] == 8 + r * 8 // dp, (dp, r, data.starts)
            assert data.produced == 8 - r * 8 // dp, (dp, r, data.produced)
        for s, (ids, inputs) in enumerate(whole[3:4]):
            assert sum((p[s][0] for p in parts), []) == ids
            assert torch.equal(torch.cat([p[s][1] for p in parts]), inputs)
    for workers in (0, 2):
        resumed = _stream(steps=7, data=D.SeekableBlocks(noise=True), num_workers=workers)
        resumed.load_state_dict(state)
        got = batches(resumed)
        assert [ids for ids, _ in got] == [ids for ids, _ in whole[3:]]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, whole[3:], strict=True))
    past = D.SeekableBlocks()
    loader = _stream(steps=3, data=past)
    loader.load_state_dict({"step": 2, "seed": 0, "epoch": 0, "epoch_start": 0})
    assert _ids(loader) == [list(range(8))] and past.starts == [16, 0]


def test_a_datasets_own_generator_is_named_and_the_items_seed_is_the_fix():
    """A dataset drawing from a generator it holds (``self.g``) is not reseeded per item, so a
    run resumed at step 3 draws other masks than the run that went on: the loader warns on
    its first batch, naming the attribute and the fix, with workers too. The fix, the
    generator made in ``dataset[i]`` from ``torch.initial_seed()`` (the item's seed under
    plait), gives one device's draws to a resumed loader, to dp=2 and to loader workers,
    without a warning. A generator that drew only in ``__init__`` is not named, nor is a
    stream's own generator missed."""
    import warnings

    from plait.data import DistributedLoader
    from tests import _workers_data as D

    def inputs(loader):
        return [(b["id"].tolist(), b["input_ids"]) for b in loader]

    def make(data, **kw):
        return DistributedLoader(data, D.BATCH, steps=5, collate_fn=partial(D.pad, length=D.SEQ),
                                 **kw)

    def resumed(data, **kw):
        loader = make(data, **kw)
        loader.load_state_dict({"step": 3, "seed": 0})
        return inputs(loader)

    own = "plait: dataset OwnGenerator drew from a generator of its own while loading"
    fix = r"torch.Generator\(\).manual_seed\(torch.initial_seed\(\)\)"
    with pytest.warns(UserWarning, match=rf"{own} \(self.g \(Generator\)\).*{fix}"):
        whole = inputs(make(D.OwnGenerator()))
    with pytest.warns(UserWarning, match=own):
        again = resumed(D.OwnGenerator())
    assert [i for i, _ in again] == [i for i, _ in whole[3:]]
    assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(again, whole[3:], strict=True))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        whole = inputs(make(D.OwnGenerator(per_item=True)))
        assert all(torch.equal(a, b) for (_, a), (_, b)
                   in zip(resumed(D.OwnGenerator(per_item=True)), whole[3:], strict=True))
        halves = [inputs(make(D.OwnGenerator(per_item=True), dp_rank=r, dp_size=2,
                              num_workers=w)) for r, w in ((0, 0), (1, 2))]
        for s, (_, want) in enumerate(whole):
            assert torch.equal(torch.cat([halves[0][s][1], halves[1][s][1]]), want)
        inputs(make(D.OwnGenerator(draws=False)))
    with pytest.warns(UserWarning, match=r"dataset OwnGeneratorBlocks drew from a generator "
                                         r"of its own while loading \(self.g"):
        list(_stream(data=D.OwnGeneratorBlocks()))


def test_a_generator_of_its_own_drawn_only_in_a_later_epoch_is_named_once():
    """A dataset whose own generator draws only from its second epoch on (an augmentation
    switched on later) is named when it first draws, not missed because the first batch drew
    nothing, and once: the batches after it load without another warning. A stream's
    generator drawn only after its first batch is named too."""
    import warnings

    from plait.data import DistributedLoader
    from tests import _workers_data as D

    loader = DistributedLoader(D.OwnGenerator(draws_from=2 * D.BATCH), D.BATCH, steps=4,
                               collate_fn=partial(D.pad, length=D.SEQ))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        batches = iter(loader)
        for _ in range(2):  # the first epoch: nothing drawn, nothing said
            next(batches)
        assert not seen, [str(w.message) for w in seen]
        list(batches)
    own = [w for w in seen if "dataset OwnGenerator drew from a generator of its own" in
           str(w.message)]
    assert len(own) == 1 and "(self.g (Generator))" in str(own[0].message), seen

    class LateBlocks(D.OwnGeneratorBlocks):
        def _items(self, start: int):
            for n, item in enumerate(D.Blocks._items(self, start)):
                if n >= 8:
                    item["input_ids"] = (item["input_ids"]
                                         + torch.randint(0, 3, (1,), generator=self.g)) % D.VOCAB
                yield item

    with pytest.warns(UserWarning, match=r"dataset LateBlocks drew from a generator of its own"):
        list(_stream(steps=2, data=LateBlocks()))


def test_a_stream_with_set_epoch_is_told_each_epoch_on_every_reader():
    """A stream whose order comes from its epoch (``set_epoch``, as ``datasets``' shuffled
    streams): a loader running across epochs gives each epoch a new order, the same split over
    dp=2, in loader workers and after a resume in the second epoch."""
    from tests import _workers_data as D

    whole = _ids(_stream(steps=4, data=D.EpochBlocks()))
    assert whole[:2] != whole[2:]
    for epoch in (whole[:2], whole[2:]):
        assert len(set(sum(epoch, []))) == 16 and set(sum(epoch, [])) <= set(range(D.ITEMS))
    halves = [_ids(_stream(r, 2, steps=4, data=D.EpochBlocks(), num_workers=2 * r))
              for r in range(2)]
    assert [a + b for a, b in zip(*halves, strict=True)] == whole
    resumed = _stream(steps=4, data=D.EpochBlocks())
    resumed.load_state_dict({"step": 3, "seed": 0, "epoch": 1, "epoch_start": 2})
    assert _ids(resumed) == whole[3:]


def test_python_and_numpy_generators_a_dataset_holds_are_named_too():
    """``random.Random``, NumPy's ``Generator`` and ``RandomState`` held by a dataset and drawn
    from while loading are named, each; one made again while loading is not."""
    import random
    import warnings

    import numpy as np

    from plait.data import DistributedLoader

    class Held(torch.utils.data.Dataset):
        def __init__(self):
            self.py, self.npg = random.Random(1), np.random.default_rng(1)
            self.legacy = np.random.RandomState(1)

        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.tensor([self.py.random(), self.npg.random(), self.legacy.rand()])

    class Remade(Held):
        def __getitem__(self, i: int) -> torch.Tensor:
            self.py = random.Random(torch.initial_seed())
            return torch.tensor([self.py.random()])

    def first(data: torch.utils.data.Dataset) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            next(iter(DistributedLoader(data, 4)))
        return [str(w.message) for w in caught]

    [message] = first(Held())
    assert ("(self.legacy (RandomState), self.npg (Generator), self.py (Random))"
            in message), message
    assert first(Remade()) == []


def test_a_stream_too_short_or_read_once_is_named():
    from tests import _workers_data as D

    class HubStream(D.Blocks):  # named as datasets' own class is (datasets is not installed)
        pass

    HubStream.__module__ = "datasets.iterable_dataset"
    with pytest.raises(ValueError, match=r"num_workers=2 with datasets' HubStream: in a loader "
                                         r"worker it reads only that worker's share of its "
                                         r"files.* use num_workers=0"):
        _stream(data=HubStream(), num_workers=2)
    assert _ids(_stream(data=HubStream())) == _ids(_stream())

    with pytest.raises(ValueError, match=r"dataset Blocks yielded fewer than one global batch "
                                         r"of 8 items in epoch 0: give more data or a smaller "
                                         r"batch_size$"):
        list(_stream(data=D.Blocks(items=7)))
    once = (item for item in D.Blocks())  # a generator object: read once
    loader = _stream(data=once, steps=3)
    with pytest.raises(ValueError, match=r"dataset generator yielded fewer than one global "
                                         r"batch of 8 items in epoch 1.* not a generator object, "
                                         r"which is read once"):
        list(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_randomness_in_dataset_items_is_the_items_own(num_workers):
    """Random crops and masks drawn in dataset[i] (torch, random, NumPy) are a function of
    (seed, epoch, i): the same with workers or without, split over replicas or not, and in a
    loader resumed at step 3, as in the run that went on; the loading process's own random
    states are left as they were."""
    from tests import _workers_data as D

    def inputs(loader):
        return [(b["id"].tolist(), b["input_ids"]) for b in loader]

    def make(**kw):
        return DistributedLoader(D.Augmented(), D.BATCH, steps=6, collate_fn=D.pad, **kw)

    def same(got, want):
        return all(a[0] == b[0] and torch.equal(a[1], b[1])
                   for a, b in zip(got, want, strict=True))

    torch.manual_seed(5)
    before = torch.get_rng_state()
    whole = inputs(make())
    assert torch.equal(torch.get_rng_state(), before)
    assert same(inputs(make(num_workers=num_workers)), whole)
    resumed = make(num_workers=num_workers)
    resumed.load_state_dict({"step": 3, "seed": 0})
    assert same(inputs(resumed), whole[3:])
    half = inputs(make(dp_rank=1, dp_size=2, num_workers=num_workers))
    for (ids, x), (want_ids, want) in zip(half, whole, strict=True):
        n = x.shape[1]  # replica 1 pads to its own longest row, one device to the batch's
        assert ids == want_ids[4:]
        assert torch.equal(x, want[4:, :n]) and not want[4:, n:].any()


@pytest.mark.parametrize("stream", [False, True])
def test_randomness_in_the_collate_is_the_batches_own(stream):
    """A collate_fn that masks at random (a masked-LM collator) draws the same with two
    workers as without, and in a loader resumed at step 3 as in the run that went on."""
    from tests import _workers_data as D

    def make(**kw):
        if stream:
            from plait.data import StreamLoader

            return StreamLoader(D.Blocks(), D.BATCH, dp_rank=1, dp_size=2, steps=6,
                                collate_fn=D.masking_pad, **kw)
        return DistributedLoader(D.Numbered(), D.BATCH, dp_rank=1, dp_size=2, steps=6,
                                 collate_fn=D.masking_pad, **kw)

    whole = [b["input_ids"] for b in make()]
    assert any((x == 1).any() for x in whole)
    workers = [b["input_ids"] for b in make(num_workers=2)]
    assert all(torch.equal(a, b) for a, b in zip(workers, whole, strict=True))
    resumed = make(num_workers=2)
    state = make().state_dict()
    state.update(step=3, **({"epoch": 1, "epoch_start": 2} if stream else {}))
    resumed.load_state_dict(state)
    assert all(torch.equal(b["input_ids"], want)
               for b, want in zip(resumed, whole[3:], strict=True))
