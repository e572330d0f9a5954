"""Precision and memory options across layouts: bf16 mixed precision keeps fp32 master weights
and trains what one device trains under torch.autocast; ZeRO-3's CPU offload changes nothing;
activation checkpointing changes nothing; gradient clipping clips the norm one device's
clip_grad_norm_ computes (a tied weight counted once, frozen parameters not at all).

Models and data are written for the test (tests/_workers_precision.py); the reference is a
plain one-process SGD loop on the whole global batch.
"""

from __future__ import annotations

import pytest

from plait.spawn import run_distributed
from tests import _workers_precision as W

STEPS = 3
BATCHES = [W.mlm_batch(s) for s in range(STEPS)]


def _max_rel(ref: dict, got: dict) -> tuple[float, float]:
    """(largest relative loss difference, largest parameter difference relative to the
    tensor's largest entry (at least 1e-2))."""
    loss = max(abs(a - b) / abs(a) for a, b in zip(ref["losses"], got["losses"], strict=True))
    state = {k.removeprefix("inner."): v for k, v in got["state"].items()}
    assert set(state) >= set(ref["state"]), (got["plan"], sorted(state))
    param = max(float((state[n].float() - w).abs().max()) / max(float(w.abs().max()), 1e-2)
                for n, w in ref["state"].items())
    return loss, param


def _assert_close(ref: dict, got: dict, rel: float) -> tuple[float, float]:
    loss, param = _max_rel(ref, got)
    assert loss <= rel and param <= rel, (got["plan"], loss, param, rel)
    return loss, param


# ------------------------------------------------------------------------------ bf16
# bf16 keeps 8 bits of mantissa (relative spacing 2**-8 = 4e-3 per value): plait's layouts
# cast at other places than autocast does (FSDP2 casts whole parameters, autocast each op's
# inputs) and sum in other orders, so they agree with the autocast reference to a fraction of
# that (measured: 4e-4 on losses, 8e-4 on weights, worst of the layouts), not bit for bit. A
# run that ignored bf16 would equal the fp32 loop to 1e-6; each differs from it by 1e-4 here.
BF16_REL = 2e-3


@pytest.fixture(scope="module")
def bf16_refs():
    return {"flat": W.reference(W.masked_lm, BATCHES, W.mlm_loss, bf16=True),
            "flat32": W.reference(W.masked_lm, BATCHES, W.mlm_loss),
            "staged": W.reference(W.staged_lm, BATCHES, W.mlm_loss, bf16=True),
            "staged32": W.reference(W.staged_lm, BATCHES, W.mlm_loss)}


def test_bf16_keeps_fp32_master_weights_and_matches_autocast_on_one_device(bf16_refs):
    """Under dp=2, ZeRO-1/2/3, tp=2 and pp=2 with mixed_precision=bf16, the optimizer sees
    fp32 parameters and fp32 gradients at every step, the full state is fp32, the losses and
    weights are within bf16 rounding of one device under torch.autocast(bfloat16), and they
    really were computed in bf16 (not equal to the fp32 run)."""
    flat = ("dp=2", "dp_shard=2,zero=1", "dp_shard=2,zero=2", "dp_shard=2,zero=3", "tp=2",
            "dp_shard=2,zero=3,grad_accum=2")
    jobs = [(p + ",mp=bf16", W.masked_lm, BATCHES, W.mlm_loss) for p in flat]
    jobs.append(("pp=2,mb=2,mp=bf16", W.staged_lm, BATCHES, W.mlm_loss))
    got = run_distributed(W.train_jobs, 2, jobs, timeout=300)[0]
    for result in got:
        assert result["dtypes"] == ["grad torch.float32", "param torch.float32"], result
        assert {str(v.dtype) for v in result["state"].values()} == {"torch.float32"}, result["plan"]
        kind = "staged" if result["plan"].startswith("pp") else "flat"
        loss, param = _assert_close(bf16_refs[kind], result, BF16_REL)
        off32 = _max_rel(bf16_refs[kind + "32"], result)
        print(f"{result['plan']}: vs autocast loss {loss:.1e} params {param:.1e}; "
              f"vs fp32 loss {off32[0]:.1e} params {off32[1]:.1e}")
        assert off32[0] > 1e-5, (result["plan"], "bf16 had no effect", off32)


def test_bf16_sync_batchnorm_takes_its_statistics_in_fp32():
    """sync_bn under bf16 (dp=2 and ZeRO-2) keeps the running statistics one device's BatchNorm
    keeps under autocast: torch's batch_norm takes a bf16 input's statistics in fp32, and so
    must the synchronised one. It took them in bf16 (the per-rank count, 1156 here, is not a
    bf16 number): after one step (same weights, same bf16 input) the running statistics were
    off by 5e-3 of their size, now by 1e-7; after three steps (the weights apart by bf16
    rounding by then) the bound is loose."""
    batches = [W.image_batch(s) for s in range(STEPS)]
    refs = {n: W.reference(W.conv_bn, batches[:n], W.cross_entropy, bf16=True) for n in (1, 3)}
    jobs = [(p, W.conv_bn, batches[:n], W.cross_entropy) for n in (1, 3)
            for p in ("dp=2,mp=bf16,sync_bn=true", "dp_shard=2,zero=2,mp=bf16,sync_bn=true")]
    got = run_distributed(W.train_jobs, 2, jobs, timeout=300)[0]
    for (_, _, steps, _), result in zip(jobs, got, strict=True):
        ref = refs[len(steps)]
        stats = {n: v for n, v in result["state"].items() if "running" in n}
        assert len(stats) == 4, sorted(result["state"])
        worst = max(float((v - ref["state"][n]).abs().max() / ref["state"][n].abs().max())
                    for n, v in stats.items())
        loss = max(abs(a - b) / a for a, b in zip(ref["losses"], result["losses"], strict=True))
        print(f"{result['plan']}, {len(steps)} steps: running statistics {worst:.1e}, "
              f"loss {loss:.1e}")
        assert worst <= (1e-5 if len(steps) == 1 else 5e-3), (result["plan"], worst)
        assert loss <= BF16_REL, (result["plan"], loss)


# ------------------------------------------------------------------------------ fp32 options
# fp32 rounding of sums taken in another order, nothing more (as tests/test_semantics.py).
REL = 1e-6


def test_zero3_cpu_offload_changes_nothing():
    """offload=True (FSDP2's CPUOffloadPolicy) trains what the same ZeRO-3 plan trains without
    it, in fp32 and bf16, with accumulation, on a model with a tied and frozen weights."""
    plans = ("dp_shard=2,zero=3", "dp_shard=2,zero=3,grad_accum=2", "dp_shard=2,zero=3,mp=bf16")
    jobs = [(p + extra, f, BATCHES, W.mlm_loss) for f in (W.masked_lm, W.tied_clip_lm)
            for p in plans for extra in ("", ",offload=true")]
    got = run_distributed(W.train_jobs, 2, jobs, timeout=300)[0]
    for plain, offloaded in zip(got[::2], got[1::2], strict=True):
        assert offloaded["dtypes"] == ["grad torch.float32", "param torch.float32"], offloaded
        loss, param = _assert_close(plain, offloaded, REL)
        print(f"{offloaded['plan']}: loss {loss:.1e} params {param:.1e}")


def _ac_jobs(layout: str, flat: object) -> list:
    return [(f"{layout},ac={mode}", factory, BATCHES, W.mlm_loss)
            for mode, factory in (("full", W.tied_clip_lm), ("op", W.tied_clip_lm),
                                  ("op", W.head_first_lm), ("selective", flat),
                                  ("full", W.head_first_lm))]


@pytest.mark.parametrize("world,layouts", [
    (2, ("dp=2", "dp_shard=2,zero=3", "tp=2", "pp=2,mb=2")),
    pytest.param(4, ("dp_shard=2,zero=3,tp=2", "pp=2,tp=2,mb=2"), marks=pytest.mark.slow),
])
def test_activation_checkpointing_changes_nothing(world, layouts):
    """Every checkpointing mode trains what one device trains without it (no dropout): on a
    model whose head is tied to its embedding, with frozen weights and a LayerNorm in each
    block, on one whose blocks return a tuple, and on a plain residual stack. Under tensor
    parallelism op-level checkpointing of the pre-norm blocks failed in backward (the
    recompute counted the swap of the replicated norm weights for their local tensors, which
    the forward had made outside the checkpointed region)."""
    jobs = [job for layout in layouts
            for job in _ac_jobs(layout, W.staged_lm if layout.startswith("pp") else W.masked_lm)]
    refs = {f: W.reference(f, BATCHES, W.mlm_loss) for f in {j[1] for j in jobs}}
    got = run_distributed(W.train_jobs, world, jobs, timeout=300)[0]
    for (_, factory, _, _), result in zip(jobs, got, strict=True):
        assert result["wrapped"] > 0, result["plan"]
        loss, param = _assert_close(refs[factory], result, REL)
        print(f"{result['plan']} ({factory.args[0].__name__}): loss {loss:.1e} params {param:.1e}")


# Clipping at 0.05 with lr 0.5: active at every step (the one-device norms are 1-3), and a step
# large enough that a norm counted wrong moves the weights visibly.
CLIP, CLIP_LR = 0.05, 0.5


@pytest.mark.parametrize("world,layouts", [
    (2, ("dp=2", "dp_shard=2,zero=1", "dp_shard=2,zero=3", "tp=2", "pp=2,mb=2",
         "dp_shard=2,zero=2,grad_accum=2", "dp_shard=2,zero=3,offload=true")),
    pytest.param(4, ("pp=2,tp=2,mb=2", "dp_shard=2,zero=3,tp=2"), marks=pytest.mark.slow),
])
def test_clipping_clips_the_norm_one_device_computes(world, layouts):
    """With clipping active at every step, each layout's clipped update equals torch's
    clip_grad_norm_ on one device: the tied embedding/head weight counted once, the frozen
    position embedding and block not at all (they keep their initial values). Under pipelines
    also a model whose first stage holds no gradient at all."""
    ref = W.reference(W.tied_clip_lm, BATCHES, W.mlm_loss, lr=CLIP_LR, clip=CLIP)
    assert min(ref["norms"]) > 10 * CLIP, ref["norms"]
    jobs = [(f"{p},clip={CLIP}", W.tied_clip_lm, BATCHES, W.mlm_loss) for p in layouts]
    pipelines = [p for p in layouts if p.startswith("pp")]
    jobs += [(f"{p},clip={CLIP}", W.frozen_stage_lm, BATCHES, W.mlm_loss) for p in pipelines]
    got = run_distributed(W.train_jobs, world, jobs, CLIP_LR, timeout=300)[0]
    frozen_ref = W.reference(W.frozen_stage_lm, BATCHES, W.mlm_loss, lr=CLIP_LR, clip=CLIP)
    assert min(frozen_ref["norms"]) > 10 * CLIP, frozen_ref["norms"]
    start = W.tied_clip_lm().state_dict()
    for (_, factory, _, _), result in zip(jobs, got, strict=True):
        loss, param = _assert_close(ref if factory is W.tied_clip_lm else frozen_ref, result,
                                    1e-5)
        print(f"{result['plan']} ({factory.args[0].__name__}): loss {loss:.1e} "
              f"params {param:.1e}")
        if factory is W.tied_clip_lm:
            state = {k.removeprefix("inner."): v for k, v in result["state"].items()}
            for name in ("pos.weight", "blocks.0.1.weight", "blocks.0.0.weight"):
                assert (state[name] == start[name]).all(), (result["plan"], name)


# ------------------------------------------------------------------------------ fp16
# fp16 keeps 10 bits of mantissa (relative spacing 2**-11 = 5e-4 per value), four times bf16's;
# plait's layouts cast and sum in other places and orders than autocast on one device, so they
# agree with torch.amp.GradScaler's loop to a fraction of that, not bit for bit.
FP16_REL = 5e-4
# Six steps at 1.25 * 2**16 doubling after every clean step (growth_interval=1): both models
# overflow at step 3 (attempting 327680) and step 5, and the scale halves there and grows back.
# The pattern is the reference's from 0.85x to 1.5x this scale (masked LM) and from 1.02x to
# 1.5x (staged LM): an overflow decided by fp16 rounding would not hold over that range.
FP16_STEPS = 6
FP16_BATCHES = [W.mlm_batch(s) for s in range(FP16_STEPS)]
FP16_SCALE, FP16_GROWTH = 1.25 * 2.0 ** 16, 1


@pytest.fixture(scope="module")
def fp16_refs():
    return {kind: W.reference_fp16(factory, FP16_BATCHES, W.mlm_loss, init_scale=FP16_SCALE,
                                   growth_interval=FP16_GROWTH, clip=clip)
            for kind, factory, clip in (("flat", W.masked_lm, 1.0),
                                        ("unclipped", W.masked_lm, None),
                                        ("staged", W.staged_lm, 1.0))}


def _check_fp16(refs: dict, got: list[dict]) -> None:
    """Every rank's scales and skipped steps are the reference's; rank 0's losses and weights
    (the others hold no state) within fp16 rounding of it."""
    for result in got:
        kind = ("staged" if result["plan"].startswith("pp") else
                "unclipped" if "clip=0" in result["plan"] else "flat")
        ref = refs[kind]
        assert ref["skipped"] == [3, 5], ref["skipped"]  # the overflows the test is about
        assert result["dtypes"] == ["grad torch.float32", "param torch.float32"], result
        assert result["skipped"] == ref["skipped"], (result["plan"], result["skipped"])
        assert result["scales"] == ref["scales"], (result["plan"], result["scales"])
        assert result["summary_scale"] == ref["scales"][-1], result["plan"]
        if result["state"] is None:
            continue
        loss, param = _assert_close(ref, result, FP16_REL)
        print(f"{result['plan']}: scales {[f'{s:g}' for s in result['scales']]}, skipped "
              f"{result['skipped']}; vs GradScaler loss {loss:.1e} params {param:.1e}")


def test_fp16_scales_the_loss_as_gradscaler_does_and_skips_overflows_on_every_rank(fp16_refs):
    """mixed_precision=fp16 under ZeRO-3 (gradients clipped: the overflow is the job's norm)
    and dp=2 without clipping (the guard's agreement finds it; clipping would also hide
    gradients left scaled) trains what one device trains with torch.autocast(float16) and
    torch.amp.GradScaler: the same losses and weights (fp32 master weights and gradients),
    the same scale after every step, and the steps whose scaled gradients overflowed skipped
    on both ranks (each rank reports the agreed verdict)."""
    jobs = [(p + ",mp=fp16", W.masked_lm, FP16_BATCHES, W.mlm_loss)
            for p in ("dp_shard=2,zero=3", "dp=2,clip=0")]
    got = run_distributed(W.fp16_jobs, 2, jobs, FP16_SCALE, FP16_GROWTH, timeout=300)
    for rank_results in got:
        _check_fp16(fp16_refs, rank_results)


@pytest.mark.slow
def test_fp16_matches_gradscaler_under_every_layout(fp16_refs):
    """The same under DDP with clipping, ZeRO-1/2, ZeRO-3 with CPU offload, tensor
    parallelism (with and without clipping) and pipeline parallelism. With accumulation each
    fp16 backward sums half the rows one device's does, so the scale it overflows at is not
    the reference's (it skipped steps 4 and 6 here): it is compared on a scale that never
    overflows."""
    flat = ("dp=2", "dp_shard=2,zero=1", "dp_shard=2,zero=2", "dp_shard=2,zero=3,offload=true",
            "tp=2", "tp=2,clip=0")
    jobs = [(p + ",mp=fp16", W.masked_lm, FP16_BATCHES, W.mlm_loss) for p in flat]
    jobs.append(("pp=2,mb=2,mp=fp16", W.staged_lm, FP16_BATCHES, W.mlm_loss))
    got = run_distributed(W.fp16_jobs, 2, jobs, FP16_SCALE, FP16_GROWTH, timeout=300)
    for rank_results in got:
        _check_fp16(fp16_refs, rank_results)
    ref = W.reference_fp16(W.masked_lm, FP16_BATCHES, W.mlm_loss, init_scale=2.0 ** 10,
                           growth_interval=2000)
    jobs = [(p + ",mp=fp16", W.masked_lm, FP16_BATCHES, W.mlm_loss)
            for p in ("dp_shard=2,zero=3,grad_accum=2", "dp=2,grad_accum=2")]
    got = run_distributed(W.fp16_jobs, 2, jobs, 2.0 ** 10, 2000, timeout=300)
    for result in got[0]:
        assert result["skipped"] == [] and result["scales"] == [2.0 ** 10] * FP16_STEPS, result
        loss, param = _assert_close(ref, result, FP16_REL)
        print(f"{result['plan']}: vs GradScaler loss {loss:.1e} params {param:.1e}")


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_fp16_nan_loss_is_the_guards_not_an_overflow(policy):
    """A NaN loss (a bug in the loss, on rank 1 only) under fp16 is not taken for an overflow
    of the scaled gradients: the default policy stops at that step on every rank, naming the
    rank; "skip" drops the update and leaves the scale where it was."""
    got = run_distributed(W.fp16_nan_loss, 2, FP16_BATCHES[:3], policy, 2.0 ** 10, timeout=120)
    for result in got:
        assert result["overflows"] == [], result
        if policy == "stop":
            assert "step 2: non-finite loss on rank 1" in (result["error"] or ""), result
            assert result["scales"] == [2.0 ** 10], result
        else:
            assert result["error"] is None and result["skipped"] == [2], result
            assert result["scales"] == [2.0 ** 10] * 3, result


def test_fp16_checkpoint_keeps_the_loss_scale(tmp_path, fp16_refs):
    """run.save keeps the scale, its growth count and the count the next step scales by;
    run.load gives them back, so that a run resumed after step 3 (its first overflow) goes on
    with the reference's scales, skips step 5 as it does and ends on its weights (a resumed
    run that started its scale afresh would go on from 81920 instead of 163840)."""
    split = 3
    got = run_distributed(W.fp16_resume, 2, str(tmp_path / "ckpt"), FP16_BATCHES, split,
                          FP16_SCALE, FP16_GROWTH, timeout=300)
    ref = fp16_refs["flat"]
    for result in got:
        first, second = result["parts"]
        assert second["loaded"] == first["end"], (first["end"], second["loaded"])
        assert first["scales"] + second["scales"] == ref["scales"], result["parts"]
        assert second["end"]["skipped"] == ref["skipped"], second["end"]
    resumed = {"plan": "dp=2,mp=fp16 resumed",
               "losses": got[0]["parts"][0]["losses"] + got[0]["parts"][1]["losses"],
               "state": got[0]["state"]}
    loss, param = _assert_close(ref, resumed, FP16_REL)
    print(f"resumed after step {split}: loss {loss:.1e} params {param:.1e}")


def test_fp16_is_a_plan_precision_and_its_scaler_follows_gradscaler():
    """'mp=fp16' parses (it was refused as not one of fp32, bf16), and the scaler's own
    sequence is torch.amp.GradScaler's: halve on an overflow, double after growth_interval
    clean steps, a NaN-loss step (neither) leaving it alone."""
    import torch

    from plait.loss_scale import LossScaler
    from plait.parallel.zero import mixed_precision_policy
    from plait.plan import Plan
    from plait.report import format_summary, progress_line, summarize
    from plait.runtime import StepStats

    plan = Plan.from_string("dp_shard=2,zero=3,mp=fp16")
    assert plan.mixed_precision == "fp16" and "fp16" in plan.describe()
    policy = mixed_precision_policy(plan)  # FSDP2 gathers fp16, reduces in fp32
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float16, torch.float32)
    stats = StepStats(losses=[torch.tensor(1.0)], step_times=[0.1], tokens=[8],
                      overflows=[3, 5], loss_scale=163840.0)
    text = format_summary(summarize(plan, stats, [{"peak_rss_bytes": 1.0}], world_size=2,
                                    accelerator="cpu", wall_s=1.0))
    assert "loss scale      163840 (fp16), 2 overflows skipped: steps 3, 5" in text, text
    assert progress_line(1, None, 1.0, stats).endswith(" ms/step | scale 163840")
    ours = LossScaler(scale=8.0, growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    param = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=0.0)
    for step, overflow in enumerate([False, False, True, False, False, False, True, True], 1):
        theirs.scale(torch.ones(()))
        param.grad = torch.full((1,), float("inf") if overflow else 1.0)
        theirs.unscale_(opt)
        theirs.step(opt)
        theirs.update()
        ours.update(step, overflow=overflow, clean=not overflow, count=4.0)
        assert ours.scale == theirs.get_scale(), (step, ours.scale, theirs.get_scale())
    assert ours.skipped == [3, 7, 8] and ours.reference == 4.0
    ours.update(9, overflow=False, clean=False, count=5.0)  # the guard's policy skipped it
    assert (ours.scale, ours.growth_tracker, ours.reference) == (theirs.get_scale(), 0, 5.0)
    again = LossScaler(growth_interval=2)
    again.load_state_dict(ours.state_dict())
    assert again == ours
