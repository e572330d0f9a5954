"""The script's seed is the run's: ``torch.manual_seed(s)`` before ``plait.init()`` gives the
run of ``s``, as on one device, the same on every rank (``tests/_workers_seed.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.spawn import run_distributed
from tests import _workers_seed as W


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"], (a["losses"], b["losses"])
    assert _equal(a["state"], b["state"])


def test_a_seed_sweep_under_dp_runs_each_seed_and_the_replicas_start_alike() -> None:
    # plait.init() seeded 0 and run.parallelize seeded 0 again: torch.manual_seed(1) and
    # torch.manual_seed(2) before it gave one run, the same weights and losses.
    ranks = run_distributed(W.seeded_runs, 2, "dp=2", timeout=120)
    zero, one = ranks
    runs = zero
    assert not _equal(runs["one"]["built"], runs["two"]["built"])
    assert runs["one"]["losses"] != runs["two"]["losses"]
    for name in ("one", "two", "unseeded", "given_after_1"):
        # the replicas build the same model and draw the same numbers after it
        assert _equal(zero[name]["built"], one[name]["built"]), name
        assert torch.equal(zero[name]["next"], one[name]["next"]), name
        assert zero[name]["seed"] == one[name]["seed"], name
    # each rank's own random seed before plait.init, as fresh interpreters have
    assert zero["unseeded"]["initial_seed"] != one["unseeded"]["initial_seed"]
    assert (runs["one"]["seed"], runs["two"]["seed"]) == (1, 2)
    _same_run(runs["one"], runs["one_again"])
    # unseeded: rank 0's seed, said on rank 0, and plait.init(seed=that) runs it again
    assert runs["unseeded"]["seed"] == runs["unseeded"]["initial_seed"]
    assert (f"plait: seed {runs['unseeded']['seed']} (the script's torch.manual_seed, or drawn "
            f"when it sets none); plait.init(seed={runs['unseeded']['seed']}) runs this job "
            f"again") in runs["unseeded"]["printed"], runs["unseeded"]["printed"]
    assert one["unseeded"]["printed"] == ""
    _same_run(runs["unseeded"], runs["replayed"])
    assert runs["replayed"]["printed"] == ""  # a seed given is not said again
    # plait.init(seed=5) wins over the script's torch.manual_seed
    assert runs["given_after_1"]["seed"] == runs["given_after_7"]["seed"] == 5
    _same_run(runs["given_after_1"], runs["given_after_7"])
    torch.manual_seed(5)
    assert _equal(runs["given_after_1"]["built"], W.DropNet().state_dict())
    # a seed above 2**63 (half of the unseeded ones) orders the data as any other
    assert runs["top"]["seed"] == 2**64 - 1 and len(runs["top"]["losses"]) == W.STEPS


@pytest.mark.parametrize("seed", [3])
def test_one_process_with_dropout_trains_as_the_one_device_script(seed: int) -> None:
    # run.parallelize started the RNG from plait.init's seed 0: the dropout masks of training
    # were seed 0's, not what followed building the model after torch.manual_seed(3).
    want = W.one_device(seed)
    got = run_distributed(W.one_process, 1, seed, timeout=60)[0]
    _same_run(want, got)


def test_a_bad_seed_is_refused_naming_it() -> None:
    import plait

    for bad in (2**64, -(2**63) - 1, 1.5, "1", True):
        with pytest.raises(ValueError, match=r"seed=.*: use an integer from 0 to 2\*\*64 - 1"):
            plait.init("single", seed=bad, quiet=True)  # type: ignore[arg-type]


def test_the_plan_event_carries_the_seed() -> None:
    import json

    out = run_distributed(W.plan_event, 1, 4, timeout=60)[0]
    plan = next(e for e in map(json.loads, out.splitlines()) if e["event"] == "plan")
    assert plan["seed"] == 4, plan


def test_an_unseeded_job_resumed_goes_on_with_its_seed(tmp_path) -> None:
    # The resumed process drew a seed of its own and said it: plait.init(seed=that) did not
    # run the job it continued.
    first, resumed, again = run_distributed(W.resumed_seed, 1, str(tmp_path), timeout=60)[0]
    assert resumed[0] == first[0]
    assert f"plait: seed {first[0]} (the checkpoint's, of the run it resumes)" in resumed[1]
    assert again[0] == first[0]
    assert first[2] + resumed[2] == again[2]
