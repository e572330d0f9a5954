"""``plait.loss.skips_first_label_on_device`` (the question XLA asks without a host read), run
on the CPU beside the host version it stands in for, and ``settle_answers``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.loss import (
    IGNORE_INDEX,
    loss_sum_and_count,
    settle_answers,
    skips_first_label,
    skips_first_label_on_device,
)

V = 5


def shifted(logits, labels):
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))


def whole(logits, labels):
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def _batch():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, V, (3, 6), generator=g)
    labels[1, 4:] = IGNORE_INDEX
    return torch.randn(3, 6, V, generator=g), labels


def test_the_device_answer_is_the_host_answer():
    logits, labels = _batch()
    for loss_fn, expected in ((shifted, 1), (whole, 0)):
        value = loss_fn(logits, labels)
        recompute = lambda t, f=loss_fn: f(logits, t)  # noqa: E731
        on_device = skips_first_label_on_device(value, labels, recompute)
        assert int(on_device) == expected
        assert skips_first_label(value, labels, recompute) is bool(expected)
        # the count picked on the device is the one the host answer gives
        _, count = loss_sum_and_count(value, labels, shift=on_device == 1)
        _, host = loss_sum_and_count(value, labels, shift=bool(expected))
        assert float(count) == float(host)


def test_a_micro_batch_that_cannot_tell_is_asked_again():
    logits, labels = _batch()
    labels[:, 0] = IGNORE_INDEX  # every first label already ignored: both counts agree
    value = shifted(logits, labels)
    answer = skips_first_label_on_device(value, labels, lambda t: shifted(logits, t))
    assert int(answer) == -1
    known = {"a": answer, "b": torch.tensor(1), "c": torch.tensor(0), "d": True}
    settle_answers(known)
    assert known == {"b": True, "c": False, "d": True}
