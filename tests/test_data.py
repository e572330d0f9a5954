"""Bundled corpus, tokenizer and the distributed loader (pure, no process group)."""

import math

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
    """An iterable dataset or a DataLoader would yield the same rows on every rank."""
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(8)

    with pytest.raises(ValueError, match=r"dataset Stream has no len\(\) and dataset\[i\] "
                                         r"\(an iterable dataset\).*materialize it"):
        DistributedLoader(Stream(), 4)
    with pytest.raises(ValueError, match=r"takes the dataset, not a DataLoader \(DataLoader\): "
                                         r"pass its \.dataset"):
        DistributedLoader(DataLoader(list(range(8)), batch_size=4), 4)
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
