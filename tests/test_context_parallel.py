"""Context parallelism (``cp``): each rank holds a slice of every sequence; attention, the loss
and the gradients equal one device's.

Tolerance: 1e-5 absolute on attention outputs and gradients of unit-scale random q/k/v (fp32
sums taken in another order, nothing more; a wrong mask or a missing gradient term is off by
0.1 or more).
"""

from __future__ import annotations

import pytest
import torch

from plait.parallel.context import head_tail_positions
from plait.spawn import run_distributed
from tests import _workers_cp as W

TOL = 1e-5


def test_head_tail_positions_cover_the_sequence_once_and_balance_causal_work():
    seq, cp = 16, 4
    parts = [head_tail_positions(seq, cp, r) for r in range(cp)]
    assert parts[0].tolist() == [0, 1, 14, 15]
    assert parts[3].tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    # causal work: keys at or before each query, summed per rank: the same on every rank
    work = {int((p + 1).sum()) for p in parts}
    assert len(work) == 1


def test_attention_matches_one_device_at_cp2():
    """Causal, unmasked, GQA (enable_gqa) and a given scale: outputs and the gradients of q, k
    and v on each rank equal its slice of one-device SDPA's, and the patch is undone."""
    got = run_distributed(W.attention_matches, 2, 16, timeout=120)
    for rank in got:
        for case in rank:
            assert case["restored"], case
            for key in ("out", "q", "k", "v"):
                assert case[key] <= TOL, case


def test_attention_refuses_what_it_cannot_compute():
    messages = run_distributed(W.attention_refusals, 2, timeout=120)[0]
    assert len(messages) == 3, messages
    assert "attn_mask" in messages[0] and "is_causal=True" in messages[0]
    assert "dropout_p=0.1" in messages[1] and "0" in messages[1]
    assert "6 tokens" in messages[2] and "multiple of 4" in messages[2]


def test_positions_refuse_a_length_that_does_not_split():
    with pytest.raises(ValueError, match="multiple of 4"):
        head_tail_positions(10, 2, 0)
