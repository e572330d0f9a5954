"""``plait.loss.skips_first_label_on_device`` and ``own_loss_skips_first_label_on_device`` (the
questions XLA asks without a host read), run on the CPU beside the host versions they stand in
for, and how the answers of a step's micro-batches are kept and settled."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.loss import (
    IGNORE_INDEX,
    _answer_on_device,
    loss_sum_and_count,
    own_loss_skips_first_label,
    own_loss_skips_first_label_on_device,
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


def test_a_models_own_loss_device_answer_is_the_host_answer():
    """A model's ``output.loss`` against its ``output.logits``: shifted (1), unshifted (0),
    neither (label smoothing: 0, for good), and a micro-batch that cannot tell (-1)."""
    logits, labels = _batch()
    smoothed = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), label_smoothing=0.1)
    ignored = labels.clone()
    ignored[:, 0] = IGNORE_INDEX
    cases = ((shifted(logits, labels), labels, 1, True), (whole(logits, labels), labels, 0, False),
             (smoothed, labels, 0, False), (shifted(logits, ignored), ignored, -1, None))
    for value, targets, expected, host in cases:
        output = {"loss": value, "logits": logits}
        assert int(own_loss_skips_first_label_on_device(value, output, targets)) == expected
        assert own_loss_skips_first_label(value, output, targets) is host


def test_a_later_micro_batch_answers_where_the_first_could_not():
    """Within the first step, micro-batch 1 cannot tell (-1) and micro-batch 2 can: the count
    of micro-batch 2 follows its own answer, and the step keeps it; an answer already given is
    kept over a later one."""
    known: dict = {}
    assert not bool(_answer_on_device(known, "k", torch.tensor(-1)))
    assert bool(_answer_on_device(known, "k", torch.tensor(1)))
    assert not bool(_answer_on_device(known, "j", torch.tensor(0)))
    assert not bool(_answer_on_device(known, "j", torch.tensor(1)))
    assert not _answer_on_device(known, "none", None)
    settle_answers(known)
    assert known == {"k": True, "j": False}


def _reader_whose_first_labels_average_near_the_whole(eps: float = 3e-6):
    """Logits of two classes, every label 0, each item's loss softplus(t) chosen so that the
    first labels' mean is the whole's less ``eps`` of it: ignoring them moves the mean by
    eps * 2/14 (4e-7, under a millionth), counting them alone by eps (3e-6)."""
    g = torch.Generator().manual_seed(0)
    rest = 1 + torch.rand(2, 7, generator=g, dtype=torch.float64)
    first = 14 * rest.mean() * (1 - eps) / (14 + 2 * eps)
    losses = torch.cat([first.expand(2, 1), rest], dim=1)
    t = torch.log(torch.expm1(losses))
    logits = torch.stack([torch.zeros_like(t), t], dim=-1).float()
    return logits, torch.zeros(2, 8, dtype=torch.long)


def test_a_loss_reading_every_label_is_told_apart_when_its_first_labels_average_near_the_whole():
    """A mean over every label whose first labels' mean is within a few millionths of the
    whole's: the loss hardly moves without them, yet it reads them (before: judged to skip
    them, which refused it under context parallelism and left them out of its count)."""
    logits, labels = _reader_whose_first_labels_average_near_the_whole()

    def every(lg, lab):
        return F.cross_entropy(lg.reshape(-1, 2), lab.reshape(-1))

    value = every(logits, labels)
    recompute = lambda t: every(logits, t)  # noqa: E731
    without_first = labels.clone()
    without_first[:, 0] = IGNORE_INDEX
    moved = float(every(logits, without_first) / value - 1)
    assert 0 < abs(moved) < 1e-6  # the case: the loss barely moves without the first labels
    assert skips_first_label(value, labels, recompute) is False
    assert int(skips_first_label_on_device(value, labels, recompute)) == 0
    # a loss that skips them still says so, on the same near case
    shift = lambda lg, lab: F.cross_entropy(lg[:, :-1].reshape(-1, 2),  # noqa: E731
                                            lab[:, 1:].reshape(-1))
    value = shift(logits, labels)
    assert skips_first_label(value, labels, lambda t: shift(logits, t)) is True
    assert int(skips_first_label_on_device(value, labels, lambda t: shift(logits, t))) == 1
