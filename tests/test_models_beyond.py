"""Models that are not transformers, under every data layout, against one device.

Models written for the test (tests/_workers_beyond.py): a recurrent classifier (LSTM over
packed sequences, then a GRU, dict inputs), a CNN with a frozen stem, one convolution applied
twice and a non-persistent buffer, a two-tower model and a two-view encoder with blocks (under
pp and tp) trained with a contrastive (InfoNCE) loss over the whole global batch through
``run.all_gather``, models with heads or branches some steps skip (find_unused, under pp too),
and CNNs with BatchNorm (what their running statistics become without sync_bn). The reference
is a plain one-process loop (SGD, lr 0.1, torch's clipping at 1.0; Adam or AdamW where a test
says so) on the whole global batch. Tolerance:
2e-6 relative on every step's loss, and on every parameter and persistent buffer after the
last step 2e-6 relative to the tensor's largest entry (at least 1e-2): fp32 rounding of sums
taken in another order, a few units in the last place after three steps (a wrong weighting
or a missed reduction is 1e-3 or more).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.plan import Plan
from plait.spawn import WorkerError, run_distributed
from tests import _workers_beyond as B

REL, FLOOR = 2e-6, 1e-2


def _assert_matches(ref: dict, got: dict) -> None:
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True)):
        assert abs(a - b) <= REL * abs(a), (got["plan"], step, a, b)
    assert set(got["state"]) == set(ref["state"]), (got["plan"], sorted(got["state"]))
    for name, want in ref["state"].items():
        diff = (got["state"][name].float() - want.float()).abs().max().item()
        assert diff <= REL * max(want.abs().max().item(), FLOOR), (got["plan"], name, diff)


# The seed of the held-out batch that run.evaluate scores after training, apart from the
# training batches' seeds.
HELD_OUT = 100


def _assert_evaluates(want: list[float], got: dict) -> None:
    """run.evaluate's held-out losses are one device's, 1e-6 relative (on every rank)."""
    assert len(got["evals"]) == len(want), (got["plan"], got["evals"])
    for a, b in zip(want, got["evals"], strict=True):
        assert abs(a - b) <= REL * abs(a), (got["plan"], a, b)


def test_a_contrastive_loss_over_the_global_batch_with_all_gather():
    """InfoNCE compares each row with every row of the batch. With ``run.all_gather`` the
    loss and the parameters equal one device's under DDP and ZeRO-3, and so does
    ``run.evaluate``'s loss of a held-out batch after training; over each rank's rows alone
    the loss is another one (fewer negatives), which the last job shows."""
    batches = [B.pair_batch(s) for s in range(3)]
    held = [B.pair_batch(HELD_OUT)]
    ref = B.reference(B.two_tower, batches, B.info_nce(lambda t: t))
    want = B.held_out_losses(B.two_tower, ref["state"], held, B.info_nce(lambda t: t))
    jobs = [(p, B.two_tower, batches + held, loss) for p, loss in
            (("dp=2", "info_nce"), ("dp_shard=2,zero=3", "info_nce"), ("dp=2", "info_nce_local"))]
    ddp, zero3, local = run_distributed(B.train, 2, jobs, timeout=180)[0]
    for got in (ddp, zero3):
        _assert_matches(ref, got)
        _assert_evaluates(want, got)
    assert abs(local["losses"][0] - ref["losses"][0]) > 1e-2 * ref["losses"][0]


def test_recurrent_and_shared_weight_models_under_ddp_and_zero():
    """An LSTM over packed sequences and a GRU (dict inputs), and a CNN applying one
    convolution twice with a frozen stem and a non-persistent buffer: the same losses and
    parameters as one device under DDP and ZeRO-1/2/3 (ZeRO-3 with gradient accumulation),
    and the non-persistent buffer is in no state dict, as on one device."""
    rnn_batches = [B.sequence_batch(s) for s in range(3)]
    conv_batches = [B.image_batch(s) for s in range(3)]
    refs = {"rnn": B.reference(B.recurrent, rnn_batches, F.cross_entropy),
            "conv": B.reference(B.shared_conv, conv_batches, F.cross_entropy)}
    jobs = [(p, B.recurrent, rnn_batches, F.cross_entropy)
            for p in ("dp=2", "dp_shard=2,zero=1", "dp_shard=2,zero=3,grad_accum=2")]
    jobs += [(p, B.shared_conv, conv_batches, F.cross_entropy)
             for p in ("dp=2", "dp_shard=2,zero=2", "dp_shard=2,zero=3")]
    results = run_distributed(B.train, 2, jobs, timeout=240)[0]
    for (_, factory, _, _), got in zip(jobs, results, strict=True):
        _assert_matches(refs["rnn" if factory is B.recurrent else "conv"], got)
        assert not got["warnings"] or all("jit" in w for w in got["warnings"]), got
    assert "pixel_mean" not in refs["conv"]["state"]


@pytest.mark.parametrize("factory,batches,saved_as,loaded_as", [
    (B.shared_conv, [B.image_batch(s) for s in range(3)], "dp=2", "dp=2"),
    (B.recurrent, [B.sequence_batch(s) for s in range(3)], "dp_shard=2,zero=3", "dp=2"),
])
def test_resume_and_load_into_another_layout(tmp_path, factory, batches, saved_as, loaded_as):
    """Saved after one Adam step and loaded by a fresh model and optimizer: the remaining
    steps give bitwise the same losses and parameters under the same plan (the frozen stem
    and the non-persistent buffer, which no checkpoint holds, included), and the same to fp32
    rounding under another."""
    (got,) = run_distributed(B.resume, 2, factory, batches, F.cross_entropy, saved_as,
                             loaded_as, str(tmp_path / "ckpt"), timeout=240)[:1]
    straight, resumed = got["straight"], got["resumed"]
    assert resumed["losses"] == straight["losses"][1:] or saved_as != loaded_as
    for name, want in straight["state"].items():
        diff = (resumed["state"][name].float() - want.float()).abs().max().item()
        limit = 0.0 if saved_as == loaded_as else REL * max(want.abs().max().item(), FLOOR)
        assert diff <= limit, (saved_as, loaded_as, name, diff)
    if saved_as != loaded_as:
        for a, b in zip(straight["losses"][1:], resumed["losses"], strict=True):
            assert abs(a - b) <= REL * abs(a), (a, b)


def test_a_head_some_steps_skip_keeps_no_gradient_under_find_unused():
    """Two inputs, two heads, the second used only on every other step: on the others one
    device leaves its parameters without a gradient and Adam leaves them (and their moments)
    as they are. Under find_unused DDP does the same; ZeRO-2/3 must not hand Adam a zero
    gradient for them either (Adam would move them by its momentum). Without find_unused DDP
    stops and names the plan's fix."""
    batches = [B.two_head_batch(s) for s in range(3)]
    ref = B.reference(B.two_heads, batches, B.two_head_loss, adam=True)
    plans = ("dp=2,find_unused", "dp_shard=2,zero=2,find_unused",
             "dp_shard=2,zero=3,find_unused", "dp_shard=2,zero=3")
    jobs = [(p, B.two_heads, batches, B.two_head_loss) for p in plans]
    for got in run_distributed(B.train, 2, jobs, True, timeout=240)[0]:
        _assert_matches(ref, got)
    with pytest.raises(WorkerError, match=r"got no gradient.*'dp_shard=2,zero=1,find_unused'"):
        run_distributed(B.train, 2, [("dp_shard=2,zero=1", B.two_heads, batches,
                                      B.two_head_loss)], True, timeout=120)


def test_what_batchnorm_running_statistics_become_without_sync_bn():
    """The rule docs/data_parallel.md states for BatchNorm without sync_bn (per-rank
    statistics in training, a warning at parallelize). DDP broadcasts rank 0's buffers before
    every forward (torch's broadcast_buffers), so every rank evaluates and saves rank 0's.
    Under ZeRO-2/3 each rank trains its own, and once the model is read (run.evaluate, the
    user's own eval-mode forward, run.full_state_dict) every rank holds the mean of the
    ranks' statistics, which is what is saved: for a BatchNorm whose input does not depend
    on the layout (after a frozen convolution) the running mean is one device's. None of them
    is one device's otherwise (sync_bn's are, see tests/test_semantics.py)."""
    from tests import _workers_semantics as W

    batches = [W.image_batch(s) for s in range(3)]
    ref = W.reference(B.conv_bn_frozen_stem, batches, F.cross_entropy)
    jobs = [("dp=2", "evaluate"), ("dp_shard=2,zero=3", "evaluate"),
            ("dp_shard=2,zero=2", "forward"), ("dp_shard=2,zero=3", "state")]
    ranks = run_distributed(B.batchnorm_buffers, 2, jobs, batches, timeout=180)
    for rank0, rank1 in zip(*ranks, strict=True):
        ddp = rank0["plan"] == "dp=2"
        for name, mine in rank0["trained"].items():
            assert not torch.equal(rank1["trained"][name], mine), (rank0["plan"], name)
            mean = (mine + rank1["trained"][name]) / 2
            want = mine if ddp else mean
            if "num_batches" in name:
                want = mine
            for got in (rank0, rank1):
                read = got["saved" if got["read"] == "state" else "evaluated"][name]
                assert torch.equal(got["saved"][name], read), (got["plan"], name)
                assert torch.allclose(read.float(), want.float(), rtol=1e-6, atol=1e-7), (
                    got["plan"], got["read"], name)
            if "running_var" in name or "num_batches" in name:
                continue
            diff = (rank0["saved"][name] - ref["state"][name]).abs().max().item()
            if ddp or name.startswith("body"):
                assert diff > 1e-3, (rank0["plan"], name, diff)
            else:  # after the frozen stem: the mean of the ranks' running means is exact
                assert diff < 1e-6, (rank0["plan"], name, diff)


@pytest.mark.parametrize("plan,model", [
    ("pp=2,dp_shard=2,zero=3,mb=1,schedule=gpipe", "convnet"),
    pytest.param("dp_shard=2,zero=2,tp=2", "mlp", marks=pytest.mark.slow),
    pytest.param("dp=2,tp=2", "mlp", marks=pytest.mark.slow),
])
def test_batchnorm_running_statistics_under_pipeline_and_tp_with_zero(plan, model):
    """World 4. pp=2 over ZeRO-3 data replicas (BatchNorm on the first stage), and ZeRO-2 or
    replicated DP (FSDP2's replicate path) over tp=2 (BatchNorm replicated over tp, its
    statistics DTensors): after training each data rank holds its own statistics;
    run.evaluate gives every rank their mean (again after a further step), and that is what
    the run saves."""
    ranks = run_distributed(B.batchnorm_reads, 4, plan, model, timeout=240)
    holders = [r for r in ranks if r["read"][0]]  # under pp, the ranks of the first stage
    assert len(holders) == (2 if "pp" in plan else 4)
    for trained, evaluated in ((0, 1), (2, 3)):
        for name in holders[0]["read"][trained]:
            own = {r["dp_rank"]: r["read"][trained][name] for r in holders}
            assert not torch.equal(own[0], own[1]), name
            mean = (own[0] + own[1]) / 2
            for r in holders:
                assert torch.allclose(r["read"][evaluated][name].float(), mean.float(),
                                      rtol=1e-6, atol=1e-7), (name, r["dp_rank"])
    for r in ranks:
        for name, value in holders[0]["read"][3].items():
            assert torch.equal(r["saved"][name], value), name


def test_a_cnn_as_a_sequence_of_blocks_under_pipeline_and_checkpointing():
    """A CNN written as one nn.Sequential (stem, residual GroupNorm blocks, pooling, head):
    split into two pipeline stages (GPipe and 1F1B microbatches) and with its blocks
    checkpointed under DDP and ZeRO-3, the same losses and parameters as one device."""
    batches = [B.image_batch(s) for s in range(3)]
    ref = B.reference(B.conv_stack, batches, F.cross_entropy)
    plans = ("pp=2,microbatches=2", "pp=2,microbatches=4,schedule=1f1b", "dp=2,ac=full",
             "dp_shard=2,zero=3,ac=selective")
    jobs = [(p, B.conv_stack, batches, F.cross_entropy) for p in plans]
    for got in run_distributed(B.train, 2, jobs, timeout=240)[0]:
        _assert_matches(ref, got)


def test_all_gather_orders_rows_by_data_rank_and_sends_each_rank_its_gradient():
    """World 4: over dp_replicate x dp_shard (HSDP) the rows come in data-rank order, under
    dp=2,tp=2 only the data ranks are gathered (tp peers hold the same rows), and with
    uneven row counts the gradient of a rank's rows is the sum over ranks of what their
    losses send back to them, and ``return_index`` gives their places among the gathered
    rows. A meta tensor (a shape check) gets the gathered shape without communication. Under
    tp a DTensor sharded on its last dim keeps its layout and gets its gradient; one sharded
    on its rows is refused."""
    ranks = run_distributed(B.gathered_rows, 4, ["dp_replicate=2,dp_shard=2,zero=3",
                                                 "dp=2,tp=2"], timeout=180)
    for per_rank in ranks:
        for got in per_rank:
            size, me = got["dp_size"], got["dp_rank"]
            assert got["order"] == [float(r) for r in range(size)], got
            assert got["meta_shape"] == (2 * size, 3), got
            counts = [r + 1 for r in range(size)]
            want = torch.cat([torch.full((n, 2), float(r)) for r, n in enumerate(counts)])
            assert torch.equal(got["gathered"], want), got
            start = sum(counts[:me])
            weights = torch.arange(want.numel(), dtype=torch.float).reshape(want.shape)
            # data rank r's loss is (r + 1) * sum(weights * gathered): summed over the data
            # ranks (tp peers gather in groups of their own)
            factor = sum(r + 1 for r in range(size))
            assert torch.equal(got["grad"], factor * weights[start:start + counts[me]]), got
            assert got["index"].tolist() == list(range(start, start + counts[me])), got
            if "dtensor" in got:  # tp=2: data rank r's tp rank t holds column t of 10r + t
                same_layout, whole, grad, tp = got["dtensor"]
                assert same_layout, got
                assert torch.equal(whole, torch.tensor([[0.0, 1.0]] * 2 + [[10.0, 11.0]] * 2))
                # every rank's loss is sum(whole * w): the gather sums over the 2 data ranks
                # what their losses send back to this rank's rows, in this tp rank's column
                w = torch.arange(8.0).reshape(4, 2)
                assert torch.equal(grad, 2 * w[2 * me:2 * me + 2, tp:tp + 1]), got
                assert "sharded on its rows over tp" in got["rows_sharded"], got


@pytest.mark.parametrize("plans", [
    ("pp=2,dp_shard=2,zero=2,find_unused,mb=2",
     "pp=2,dp_shard=2,zero=3,find_unused,mb=2,schedule=gpipe"),
    pytest.param(("pp=2,dp=2,find_unused,mb=2",
                  "pp=2,dp_shard=2,zero=2,find_unused,mb=2,schedule=interleaved_1f1b,v=2,"
                  "grad_accum=2"), marks=pytest.mark.slow),
])
def test_branches_some_steps_skip_keep_no_gradient_in_a_pipeline_under_find_unused(plans):
    """A pipeline (pp=2) whose stages hold branches, and a head, that run only on every
    other step, with data replicas over ZeRO-2/3 and find_unused: on the steps that skip
    them their parameters get no gradient on any rank, and AdamW (weight decay 0.1) leaves
    them as one device does, rather than decaying and moving them by a zero gradient. DDP
    (find_unused_parameters) leaves them so too; so does an interleaved schedule (two stages
    per rank) with gradient accumulation."""
    batches = [B.gated_batch(s) for s in range(3)]
    ref = B.reference(B.gated, batches, F.cross_entropy, adam="adamw")
    jobs = [(p, B.gated, batches, F.cross_entropy) for p in plans]
    for got in run_distributed(B.train, 4, jobs, "adamw", timeout=300)[0]:
        _assert_matches(ref, got)


def _gated_tp(text: str) -> Plan:
    """``text`` with a tensor-parallel plan for :class:`Gated`'s blocks (fx cannot trace its
    data-dependent branch, so none is inferred): each Linear column-parallel, its output
    gathered (the head and the auxiliary head, 5 classes, stay replicated)."""
    styles = {g: "colwise_gather" for g in ("blocks.*.mlp", "blocks.*.branch")}
    return Plan.from_string(text).replace(options={"tp_plan": {"styles": styles}})


@pytest.mark.parametrize("world,plans", [
    (4, ("pp=2,tp=2,find_unused,mb=2",)),
    pytest.param(8, ("pp=2,dp=2,tp=2,find_unused,mb=2",
                     "pp=2,dp_shard=2,zero=3,tp=2,find_unused,mb=2"), marks=pytest.mark.slow),
])
def test_branches_some_steps_skip_under_pipeline_and_tensor_parallelism(world, plans):
    """find_unused with pp x tp (its unused-parameter pass then runs over the data group,
    of one rank at world 4): the gated branches and head, which every rank skips on every
    other step, keep no gradient there, so AdamW (weight decay 0.1) leaves them as one device
    does; with data replicas (world 8) under DDP and under FSDP2 (ZeRO-3) too."""
    batches = [B.gated_batch(s) for s in range(3)]
    ref = B.reference(B.gated, batches, F.cross_entropy, adam="adamw")
    jobs = [(_gated_tp(p), B.gated, batches, F.cross_entropy) for p in plans]
    for got in run_distributed(B.train, world, jobs, "adamw", timeout=500)[0]:
        _assert_matches(ref, got)


@pytest.mark.parametrize("plans", [
    ("pp=2,dp_shard=2,zero=3,mb=2", "dp=2,tp=2,grad_accum=2", "pp=2,dp=2,mb=2"),
    pytest.param(("pp=2,dp=2,mb=1,schedule=gpipe", "dp_shard=2,zero=3,tp=2",
                  "pp=2,dp=2,mb=4,schedule=interleaved_1f1b,v=2"), marks=pytest.mark.slow),
])
def test_a_contrastive_loss_with_all_gather_under_pipeline_and_tensor_parallelism(plans):
    """SimCLR's loss over ``run.all_gather`` on a model with blocks, labelled by the places
    ``return_index`` gives: under a pipeline the loss runs on the last stage and gathers over
    its data replicas, under tp over the data ranks only. With one micro-batch per step the
    losses and parameters are one device's on the global batch; with a pipeline's
    microbatches or grad_accum each call gathers micro-batch j of every data rank, which is
    one device's gradient accumulation over those chunks (0.36 against 0.52 at the third
    step here), and that is what they match. ``run.evaluate`` of a held-out batch after
    training (a pipeline's schedule forward only) is one device's loss, on every rank, over
    the same chunks."""
    batches = [B.views_batch(s) for s in range(3)]
    held = [B.views_batch(HELD_OUT)]
    loss = B.views_nce(B.no_gather)
    whole = B.reference(B.twin, batches, loss)
    jobs = [(p, B.twin, batches + held, "views_nce") for p in plans]
    for rank_results in run_distributed(B.train, 4, jobs, timeout=300):
        for got in rank_results:
            plan = Plan.from_string(got["plan"])
            micro = plan.grad_accum * (plan.microbatches if plan.pp > 1 else 1)
            ref = whole if micro == 1 else B.accumulated_reference(B.twin, batches, loss,
                                                                  plan.dp, micro)
            if got["state"] is not None:  # rank 0's
                _assert_matches(ref, got)
            # run.evaluate splits the batch as a step does: its chunks are the reference's
            _assert_evaluates(B.held_out_losses(B.twin, ref["state"], held, loss, plan.dp,
                                                micro), got)
