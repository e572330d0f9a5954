"""Published results, repriced: Megatron-LM's table 1 and published FSDP runs on A100 and H100.

The A100 efficiency was fitted on Megatron's table, the H100 efficiency on one torchtitan run
(``fitted=True``); every other run is held out. Each is priced at its published layout, and the
planner's own pick for the same model, cluster and batch is compared with the publication.
docs/planner.md shows every row, the misses included.
"""

from __future__ import annotations

import statistics

import pytest

from plait.planner import constants_for
from plait.planner.cost import evaluate
from plait.planner.published import (
    NARAYANAN_2021,
    PUBLISHED_RUNS,
    SEQ,
    VOCAB,
    megatron_flops,
    row_setup,
    run_setup,
)
from plait.planner.search import search

# Picks predicted faster than the publication of the same model, cluster and batch, with why.
# No published run is known to reach these picks' speed: they are misses of the model, shown in
# docs/planner.md ("Fidelity"), not claims.
PICK_FASTER_THAN_PUBLISHED = {
    # HSDP inside a node without recomputation: no published run at this scale shows it.
    "Llama 3 8B, 64 A100, FSDP",
    # microbatch 1 without recomputation instead of the published selective checkpointing.
    "Llama 3.1 8B, 8 H100, FSDP",
}


def test_megatron_table1_median_within_10_percent():
    errors = []
    for row in NARAYANAN_2021:
        model, cluster, work, plan = row_setup(row)
        e = evaluate(plan, model, cluster, work)
        assert e.feasible, (row.params_b, e.reason)
        flops = megatron_flops(row.batch, SEQ, row.layers, row.hidden, VOCAB)
        errors.append(abs(flops / e.step_time_s / row.gpus / 1e12 / row.tflops - 1))
    assert statistics.median(errors) <= 0.10, errors


@pytest.mark.parametrize("run", PUBLISHED_RUNS, ids=lambda r: r.name)
def test_published_runs_repriced(run):
    """The fitted run within 5%; held-out runs within 20% at their published layout (the
    errors are in docs/planner.md); the pick never predicted faster than the publication
    except the listed misses."""
    model, cluster, work, plan = run_setup(run)
    k = constants_for(cluster)
    e = evaluate(plan, model, cluster, work, k)
    assert e.feasible, e.reason
    error = e.tokens_per_s / run.devices / run.tokens_per_s_per_gpu - 1
    assert abs(error) <= (0.05 if run.fitted else 0.20), error
    pick = search(model, cluster, work, top=1, constants=k).best
    faster = pick.tokens_per_s / run.devices > run.tokens_per_s_per_gpu
    assert faster == (run.name in PICK_FASTER_THAN_PUBLISHED), pick.plan.describe()
