"""The search's results do not move: every layout it ranks, with its step time, memory and
traffic to full float precision, equals what the search found before its caches existed
(tests/data/planner_fingerprints.json), on configs, a mixture of experts, and modules read
tensor by tensor (tied, frozen, FSDP2-padded)."""

import json

import pytest

from tests._planner_fingerprint import STORED, cases, fingerprint

STORED_PRINTS = json.loads(STORED.read_text())


@pytest.mark.parametrize("name", sorted(STORED_PRINTS))
def test_search_results_equal_the_stored_fingerprint(name):
    assert fingerprint(cases()[name]()) == STORED_PRINTS[name]
