"""The planner's logits term (``memory_breakdown["logits"]``, through ``evaluate_plan`` as
``plait plan --plan`` prices a layout) against what torch holds for a model's logits and its
cross-entropy over one forward and backward (tests/_workers_logits.py: the CPU allocator's
peak of the tensors as large as the logits, read by ``torch.profiler``): a language model
with a tied head, one whose head sits beside a logits bias (the plan leaves it whole), a
vocabulary-wide classifier on the mean-pooled token, and a ViT classifier (no vocabulary);
fp32 and under bf16 autocast; at tp=2 on two processes (a vocabulary-split head under
``loss_parallel()``, a whole one); on a two-stage pipeline under GPipe and 1F1B. Every
figure is exact (tolerance 1e-9): the allocations are whole tensors of known size."""

from __future__ import annotations

import pytest
import torch

from plait.planner import evaluate_plan
from plait.spawn import run_distributed
from tests import _workers_logits as W


def _priced(name: str, plan: str, world: int = 1, factory=None, rows: int = W.ROWS) -> float:
    factory = factory or W.MODELS[name]
    est = evaluate_plan(plan, factory(), "cpu", world_size=world, global_batch=rows,
                        seq=W.seq(name))
    assert not est.reason, est.reason
    return est.memory_breakdown["logits"]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(W.MODELS))
def test_the_logits_term_is_what_torch_holds_for_them(name: str, bf16: bool) -> None:
    torch.manual_seed(0)
    x, labels = W.batch(name)
    held = W.held(W.MODELS[name](), x, labels, bf16=bf16)
    # what autograd saves of them from forward to backward: the fp32 log-softmax output
    assert held.saved == 4 * held.elements, held
    priced = _priced(name, "dp=1,mp=bf16" if bf16 else "dp=1")
    assert priced == pytest.approx(held.peak, rel=1e-9), (name, priced, held)


def test_at_tp2_each_rank_is_priced_for_its_share_of_the_logits() -> None:
    """A vocabulary-split head (the tied LM, the pooled vocabulary classifier) hands each
    rank 1/tp of the logits, whose loss_parallel() backward holds one more tensor of them; a
    head the plan leaves whole (beside a logits bias, a ViT's classifier) all of them."""
    got = run_distributed(W.tp_held, 2, timeout=180)
    assert got[0] == got[1], got
    for name in W.MODELS:
        priced = _priced(name, "tp=2", world=2)
        assert priced == pytest.approx(got[0][name]["peak"], rel=1e-9), (name, priced,
                                                                         got[0][name])
    assert got[0]["tied_lm"]["elements"] * 2 == got[0]["biased_lm"]["elements"]


PP_PLANS = ["pp=2,microbatches=4,pp_schedule=gpipe", "pp=2,microbatches=4,pp_schedule=1f1b"]


def test_a_pipelines_last_stage_holds_the_logits_of_the_microbatches_in_flight() -> None:
    """GPipe keeps every microbatch's logits and log-softmax output until its backward,
    1F1B one microbatch's: the last stage's peak, measured in a real two-stage step."""
    got = run_distributed(W.pp_held, 2, PP_PLANS, timeout=180)[1]
    for plan in PP_PLANS:
        est = evaluate_plan(plan, W.BiasedLM(W.PP_VOCAB), "cpu", world_size=2,
                            global_batch=4, seq=W.SEQ)
        assert est.memory_breakdown["pipeline_rank"] == 1, est.memory_breakdown
        assert est.memory_breakdown["logits"] == pytest.approx(got[plan]["peak"], rel=1e-9), (
            plan, est.memory_breakdown, got[plan])
    assert got[PP_PLANS[0]]["peak"] > 2 * got[PP_PLANS[1]]["peak"]
