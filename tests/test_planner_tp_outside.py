"""Under tensor parallelism the planner prices what each rank runs outside the blocks: a
module the plan splits (a vocabulary-parallel head) 1/tp of its FLOPs, and what it leaves
whole (a ViT's patchify ``Conv2d`` stem and its pooled classifier, a ``Linear`` projection
before the blocks, a language model's head beside a logits bias, which logits split over the
vocabulary could not take) all of them, on every rank. Checked against the layout itself: two
processes at ``tp=2`` (plait's inferred plan) count the forward FLOPs each runs before its
first block and after its last (torch's formulas on each op's local tensors, a DTensor's
shard in place of the DTensor), and the planner's stem (first chunk) and head (last chunk)
times at ``tp=2`` are those FLOPs' forward and backward."""

from __future__ import annotations

import dataclasses

import pytest

from plait.plan import Plan
from plait.planner.compute import microbatch_times
from plait.planner.cost import Constants
from plait.planner.hardware import load_cluster
from plait.planner.model_stats import load_model
from plait.planner.outside_flops import Outside
from plait.spawn import run_distributed
from tests import _workers_tp_outside as W

ROWS, SEQ = 2, 16  # W.inputs: 2 rows of 16 tokens (a ViT's 16 patches)


def test_each_tp_rank_is_priced_for_what_it_runs_outside_the_blocks() -> None:
    counted = run_distributed(W.outside_flops, 2, timeout=120)
    assert counted[0] == counted[1], counted  # the same on every rank
    cluster = load_cluster("cpu", devices=2)
    c = Constants()
    priced = {}
    for name, factory in W.MODELS.items():
        stats = load_model(factory())
        bare = dataclasses.replace(stats, outside_flops=Outside(0.0, 0.0))
        t, t0 = (microbatch_times(Plan.from_string("tp=2"), s, cluster, ROWS, SEQ, c)
                 for s in (stats, bare))
        # the forward FLOPs behind the stem's and the head's times (forward + backward: 3x)
        priced[name] = {"before": round((t.embed - t0.embed) * t.rate / 3),
                        "after": round((t.head - t0.head) * t.rate / 3)}
        assert priced[name] == pytest.approx({k: counted[0][name][k]
                                              for k in ("before", "after")}, rel=1e-6), (
            name, priced[name], counted[0][name])
