"""Mixture-of-experts models under every layout, against one device (tests/_moe_models.py).

A Mixtral-like LM written for the test (a stack of attention + routed top-2 MoE blocks, tokens
dispatched by index and summed back with ``index_add``), the same model adding a balance loss
to its output, and tiny Hugging Face MoE models built from configs. Tolerances as in
tests/test_semantics.py (1e-6 relative on losses and parameters).

A balance loss is a statistic of the batch (the fraction of its tokens routed to each expert
times their mean router probability), not a mean over rows: each data rank computes it over its
own rows, as gradient accumulation does over each micro-batch on one device. Under data
parallelism the loss is therefore the mean of the per-rank losses, which the test states
exactly.
"""

from __future__ import annotations

import pytest
import torch

from plait.plan import Plan
from plait.spawn import WorkerError, run_distributed
from tests import _moe_models as M
from tests import _workers_semantics as W
from tests.test_semantics import _assert_matches


def _batches(steps: int = 2) -> list:
    return [M.batch(s) for s in range(steps)]


def test_tp_trains_an_auxiliary_loss_beside_vocabulary_split_logits():
    """tp=2 splits the head over the vocabulary; the model's balance loss, a plain tensor
    beside those logits, is added to the cross-entropy by the user's loss (it failed in the
    backward: "got mixed torch.Tensor and DTensor")."""
    batches = _batches(1)
    (got,) = run_distributed(W.train_jobs, 2, [("tp=2", M.mixtral_like_aux, batches,
                                                 M.aux_loss)], timeout=240)[0]
    _assert_matches(W.reference(M.mixtral_like_aux, batches, M.aux_loss), got)


def test_tp_splits_each_expert_and_sequence_parallelism_is_refused_by_cause():
    """The inferred plan splits each expert as an MLP of its own (a region per expert, the
    router replicated); sp=True is refused naming why: a routing forward picks tokens by value
    and does not run on fake tensors (it said "no input could be guessed")."""
    from plait.parallel.tp_infer import infer_plan, verify_plan

    model = M.mixtral_like()
    plan = infer_plan(model)
    assert plan.styles["blocks.*.moe.experts.*"] == "region"
    assert plan.styles["blocks.*.moe.experts.*.w2"] == "rowwise"
    assert not any("router" in g for g in plan.styles), plan.styles
    refused = verify_plan(model, plan, 2, sp=True).sp_refused
    assert refused.startswith("its forward does not run on fake tensors (in blocks.0.moe ("
                              "_moe_models.py line "), refused
    assert "DynamicOutputShapeException: aten.nonzero" in refused, refused
    assert "routing tokens to experts" in refused, refused


def test_transformers_plan_entries_for_absent_modules_are_dropped():
    """Qwen2-MoE's plan in transformers names the dense MLP (mlp.gate_proj, ...) of layers
    without experts; a model whose every layer routes has none, and tp=2 refused it ("match no
    module"). The experts and routers stay replicated, attention is split."""
    from plait.parallel.tensor import match_plan
    from plait.parallel.tp_plans import hf_plan

    model = M.hf_qwen2_moe().hf
    styles = hf_plan(model).styles
    assert not [g for g in styles if ".mlp." in g], styles
    assert styles["model.layers.*.self_attn.q_proj"] == "colwise"
    assert "model.layers.0.self_attn.o_proj" in match_plan(model, styles)


def test_a_router_loss_keeps_the_head_whole_under_tp():
    """Mixtral asked for its router logits adds their balance loss to its own loss inside its
    forward: over vocabulary-split logits that sum fails in the backward, so the head gathers
    its logits whole."""
    from plait.parallel.tp_plans import hf_plan

    assert hf_plan(M.hf_mixtral_router_loss()).styles["lm_head"] == "colwise_gather"
    assert hf_plan(M.hf_mixtral().hf).styles["lm_head"] == "vocab_head"


def test_a_router_loss_is_refused_under_a_pipeline():
    """The last stage, which computes the loss, runs only its own layers' routers: Mixtral's
    balance loss over them alone trained another model (7e-4 relative at the first step)."""
    from plait.parallel.pipeline_split import build_stage_module, plan_stages

    model = M.hf_mixtral_router_loss()
    path, specs = plan_stages(model, Plan(pp=2, microbatches=2))
    with pytest.raises(ValueError, match=r"MixtralForCausalLM is asked for its routers' logits "
                       r"\(config.output_router_logits=True\).*run with pp=1.*"
                       r"output_router_logits=False"):
        build_stage_module(model, path, specs[1])


def test_an_output_gathered_from_every_block_is_explained_under_a_pipeline():
    """A forward that sums the balance loss each block keeps reads, on the last stage, the
    stand-ins of the blocks other stages hold: the error names the stage, its blocks and the
    fix. The first stage ends its forward at the last stage's first block, before the sum, and
    hands on that block's input."""
    from plait.parallel.pipeline_split import build_stage_module, plan_stages

    model = M.mixtral_like_aux()
    path, specs = plan_stages(model, Plan(pp=2, microbatches=2))
    first, last = (build_stage_module(model, path, spec) for spec in specs)
    tokens, _ = M.batch(0)
    assert first(tokens).shape == (M.BATCH, M.SEQ, M.WIDTH)
    hidden = torch.randn(M.BATCH, M.SEQ, M.WIDTH)
    with pytest.raises(TypeError) as info:
        last(hidden)
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert ("MixtralLike's forward failed after its last block, on pipeline stage 1, which holds "
            "blocks.2 .. blocks.3; blocks.0 .. blocks.1 are held by other stages") in note, note
    assert "run with pp=1" in note, note
    assert "in place of the model input" not in note, note  # not the first-argument note


@pytest.mark.slow
def test_moe_lm_under_every_layout():
    """The Mixtral-like LM under dp, ZeRO-1/2/3, tp (each expert split as an MLP, the router
    replicated), pp (1F1B), dp x tp and pp x tp; with its balance loss under tp. Qwen2-MoE
    (fused experts, a shared expert) under dp, ZeRO-3, tp and pp; Mixtral (fused experts)
    under ZeRO-3 and pp (its tp=2 is in tests/test_semantics.py)."""
    batches = _batches(3)
    plans = ("dp=2", "dp_shard=2,zero=1", "dp_shard=2,zero=2", "dp_shard=2,zero=3", "tp=2",
             "pp=2,schedule=1f1b,mb=4")
    jobs = [(p, M.mixtral_like, batches, M.lm_loss) for p in plans]
    jobs += [("tp=2", M.mixtral_like_aux, batches, M.aux_loss)]
    jobs += [(p, M.hf_qwen2_moe, batches, M.lm_loss)
             for p in ("dp=2", "dp_shard=2,zero=3", "tp=2", "pp=2")]
    jobs += [(p, M.hf_mixtral, batches, M.lm_loss) for p in ("dp_shard=2,zero=3", "pp=2")]
    got = run_distributed(W.train_jobs, 2, jobs, timeout=600)[0]
    four = [(p, M.mixtral_like, batches, M.lm_loss) for p in ("dp=2,tp=2", "pp=2,tp=2")]
    got += run_distributed(W.train_jobs, 4, four, timeout=600)[0]
    jobs += four
    refs: dict = {}
    for (_, factory, _, loss), result in zip(jobs, got, strict=True):
        key = (factory, loss)
        refs.setdefault(key, W.reference(factory, batches, loss))
        _assert_matches(refs[key], result)


@pytest.mark.slow
def test_balance_loss_is_per_data_rank():
    """Under dp=2 each rank computes the balance loss over its own rows, so the step's loss is
    the mean of the two halves' losses (exactly), not the whole batch's (7e-4 apart here)."""
    batches = _batches(1)
    (got,) = run_distributed(W.train_jobs, 2, [("dp=2", M.mixtral_like_aux, batches,
                                                 M.aux_loss)], timeout=240)[0]
    model = M.mixtral_like_aux()
    tokens, labels = batches[0]
    half = M.BATCH // 2
    with torch.no_grad():
        whole = float(M.aux_loss(model(tokens), labels))
        halves = float(sum(M.aux_loss(model(tokens[i:i + half]), labels[i:i + half])
                           for i in (0, half)) / 2)
    assert abs(whole - halves) > 1e-4 * whole
    assert got["losses"][0] == pytest.approx(halves, rel=1e-6)


@pytest.mark.slow
def test_hf_router_loss_trains_under_tp():
    """Mixtral with its router loss in its own loss (dict batches, loss_fn=None) under tp=2:
    the head gathers its logits whole, and training matches one device."""
    batches = [M.dict_batch(s) for s in range(2)]
    (got,) = run_distributed(W.train_jobs, 2, [("tp=2", M.hf_mixtral_router_loss, batches,
                                                 None)], timeout=300)[0]
    model = M.hf_mixtral_router_loss()
    opt = torch.optim.SGD(model.parameters(), lr=W.LR)
    losses = []
    for b in batches:
        loss = model(**b).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    ref = {"losses": losses, "state": {n: p.detach() for n, p in model.named_parameters()}}
    _assert_matches(ref, got)
    with pytest.raises(WorkerError, match="routers' logits"):
        run_distributed(W.train_jobs, 2, [("pp=2", M.hf_mixtral_router_loss, batches, None)],
                        timeout=300)


@pytest.mark.parametrize("walk", [False, True], ids=["if-not-none", "modules"])
def test_a_balance_loss_the_last_stage_cannot_see_is_refused(walk):
    """A forward that skips the blocks without a balance loss, or sums it over
    ``self.modules()``, runs on the last pipeline stage over that stage's blocks only: pp=2
    trained at 3.595 where one device's first loss is 3.799. The first step's check (a meta
    forward and loss: the loss reads blocks.0 and blocks.1 besides the hidden states they
    hand on) refuses it, naming those blocks; the model without the term is not refused."""
    from plait.parallel.pipeline import StageInputs, loss_checker
    from plait.parallel.pipeline_split import plan_stages

    tokens, labels = M.batch(0)
    inputs = StageInputs(first=tokens, every={}, last_only={}, targets=labels)
    model = M.guarded_balance(walk)
    path, specs = plan_stages(model, Plan(pp=2, microbatches=2))
    check = loss_checker(model, path, specs)
    assert check is not None
    with pytest.raises(ValueError, match=r"the loss reads what blocks\.0 \.\. blocks\.1 compute "
                       r"besides the hidden states .* under pp=2 .*Run with pp=1"):
        check(inputs, M.aux_loss)
    check(inputs, M.lm_loss)  # the logits alone: computed on the last stage
    plain = M.mixtral_like()
    loss_checker(plain, *plan_stages(plain, Plan(pp=2, microbatches=2)))(inputs, M.lm_loss)
    # A residual in the forward (h = h + block(h)) reads every block through the input of the
    # last stage's first block: not refused.
    residual = W.masked_lm()
    ids, mlm = W.mlm_batch(0)
    loss_checker(residual, *plan_stages(residual, Plan(pp=2, microbatches=2)))(
        StageInputs(first=ids, every={}, last_only={}, targets=mlm), W.mlm_loss)
    if walk:  # the refusal reaches the user from a real pipeline's first step
        with pytest.raises(WorkerError, match="the loss reads what blocks.0 .. blocks.1"):
            run_distributed(W.train_jobs, 2, [("pp=2", M.guarded_balance_walk, _batches(1),
                                               M.aux_loss)], timeout=300)


def test_the_planner_reads_heads_from_the_layer_plan():
    """The planner priced tp=2 as refused for the Mixtral-like LM ("does not divide attention
    heads=1"): its attention keeps the count as ``self.heads``, a name it did not read. The
    layer plan divides that attribute, so the planner takes the count from there."""
    from plait.planner.model_stats import from_module

    stats = from_module(M.mixtral_like(), "mixtral-like")
    assert stats.attention and stats.n_heads == 4
    assert stats.tp_refuses(2) == ""


def test_a_workers_error_reaches_the_user_with_its_notes():
    """plait check turns a rank's TypeError into its message and the note that says why a
    pipeline stage failed after its blocks: the message alone ("unsupported operand type(s)
    for +: 'int' and 'NoneType'") does not say."""
    from plait.spawn import user_errors

    with pytest.raises(ValueError) as info, user_errors():
        run_distributed(M.last_stage_forward, 1, timeout=120)
    said = str(info.value)
    assert said.startswith("unsupported operand type(s) for +: 'int' and 'NoneType'"), said
    assert "MixtralLike's forward failed after its last block, on pipeline stage 1" in said, said
