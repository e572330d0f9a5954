"""Global-batch semantics: a loss averaged over a variable number of counted tokens trains what
one device trains, under every layout.

The model is a masked LM written for the test (tests/_workers_semantics.py); each global batch
has rows that count 1 to 8 labels (the rest are -100), so data ranks and micro-batches count
very different numbers of tokens and a mean of per-rank means is visibly wrong (more than 1e-2
relative here, see the first test). The reference is a plain one-process loop (SGD, lr 0.1,
torch's clipping at 1.0) on the whole global batch. Tolerance: 1e-6 relative on every step's
loss, and on every parameter after the last step 1e-6 relative to the tensor's largest entry
(at least 1e-2): fp32 rounding of sums taken in a different order, nothing more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from plait.plan import Plan
from plait.spawn import run_distributed
from tests import _workers_semantics as W

REL = 1e-6
# Parameters that stay near zero (BERT's key bias has no gradient: softmax ignores it) are
# compared relative to this scale instead (1e-8 absolute).
FLOOR = 1e-2


def _assert_matches(ref: dict, got: dict) -> None:
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True)):
        assert abs(a - b) <= REL * abs(a), (got["plan"], step, a, b)
    state = {k.removeprefix("inner."): v for k, v in got["state"].items()}
    assert set(state) >= set(ref["state"]), (got["plan"], sorted(state))
    for name, want in ref["state"].items():
        diff = (state[name] - want).abs().max().item()
        assert diff <= REL * max(want.abs().max().item(), FLOOR), (got["plan"], name, diff)


@pytest.fixture(scope="module")
def data():
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    return batches, W.reference(W.masked_lm, batches, W.mlm_loss)


def test_masked_lm_counts_differ_between_ranks(data):
    """The data really has unequal counts: the mean of the two halves' means is not the mean."""
    batches, _ = data
    model = W.masked_lm()
    tokens, labels = batches[0]
    with torch.no_grad():
        whole = W.mlm_loss(model(tokens), labels)
        halves = sum(W.mlm_loss(model(tokens[i:i + 4]), labels[i:i + 4]) for i in (0, 4)) / 2
    assert abs(float(whole - halves)) > 1e-2 * float(whole)


def test_masked_lm_one_process_with_grad_accum(data):
    """grad_accum splits the batch into micro-batches that count different numbers of tokens;
    run.step returns the real loss on steps that are not logged too."""
    batches, ref = data
    jobs = [(p, W.masked_lm, batches, W.mlm_loss) for p in ("single", "grad_accum=2",
                                                            "grad_accum=4")]
    got = run_distributed(W.train_jobs, 1, jobs, timeout=120)[0]
    for result in got:
        _assert_matches(ref, result)
    unlogged = run_distributed(W.step_losses_unlogged, 1, batches, timeout=120)[0]
    assert all(isinstance(x, torch.Tensor) and x.ndim == 0 for x in unlogged["raw"])
    assert unlogged["losses"] == pytest.approx(ref["losses"], rel=REL)


def test_masked_lm_data_parallel_zero_and_accumulation(data):
    """dp=2, ZeRO-3, ZeRO-2 with accumulation; a loss returning (sum, count); and the Hugging
    Face convention (one dict batch, the model returns .loss, loss_fn=None)."""
    batches, ref = data
    dicts = [{"input_ids": x, "labels": y} for x, y in batches]
    jobs = [(p, W.masked_lm, batches, W.mlm_loss)
            for p in ("dp=2", "dp_shard=2,zero=3", "dp=2,grad_accum=2",
                      "dp_shard=2,zero=2,grad_accum=2")]
    jobs += [("dp=2", W.masked_lm, batches, W.sum_count_loss),
             ("dp_shard=2,zero=3,grad_accum=2", W.masked_lm_with_loss, dicts, None)]
    got = run_distributed(W.train_jobs, 2, jobs, timeout=240)[0]
    for result in got:
        _assert_matches(ref, result)


def test_the_loss_tells_whether_it_reads_each_rows_first_label():
    """skips_first_label asks the loss with the first (then all other) labels ignored: a
    shifting loss is unchanged by the first, an ordinary one is not; with logits that give every
    item the same loss neither moves without the first labels, and an ordinary loss is the mean
    of its parts (a shifting one is left with nothing to average); dict targets are asked
    through their "labels"."""
    from plait.loss import skips_first_label

    torch.manual_seed(0)
    logits = torch.randn(4, 8, W.VOCAB)
    _, labels = W.mlm_batch(0)
    labels[:, 0] = 3  # every first label counted, so the two counts differ
    asks = []

    def ask(loss_fn, out):
        def recompute(t):
            asks.append(t)
            return loss_fn(out, t)
        return recompute

    lab = labels[:4]
    assert skips_first_label(W.shifted_loss(logits, lab), lab, ask(W.shifted_loss, logits))
    assert skips_first_label(W.mlm_loss(logits, lab), lab, ask(W.mlm_loss, logits)) is False
    flat = torch.zeros_like(logits)
    assert skips_first_label(W.mlm_loss(flat, lab), lab, ask(W.mlm_loss, flat)) is False
    assert skips_first_label(W.shifted_loss(flat, lab), lab, ask(W.shifted_loss, flat))
    as_dict = {"labels": lab, "mask": torch.ones(4)}

    def dict_loss(out, t):
        return W.shifted_loss(out, t["labels"])

    assert skips_first_label(dict_loss(logits, as_dict), as_dict, ask(dict_loss, logits))
    assert (asks[-1]["labels"][:, 1:] == -100).all() and (as_dict["labels"][:, 1:] != -100).any()
    assert skips_first_label(W.mlm_loss(logits[:, 0], lab[:, 0]), lab[:, 0],
                             ask(W.mlm_loss, logits[:, 0])) is None  # one dim: no rows


def test_a_loss_that_is_not_reduced_is_refused_by_name():
    """A loss function that returns one value per item (reduction='none') is named with its
    shape and the fix, not failed inside the first-label probe (which reads a scalar); so is
    one that returns a number or a tensor without an autograd graph."""
    from plait.train import forward_loss

    torch.manual_seed(0)
    model = nn.Linear(4, 5)
    x, y = torch.randn(3, 2, 4), torch.randint(0, 5, (3, 2))

    def per_item(out, t):
        return nn.functional.cross_entropy(out.flatten(0, 1), t.flatten(),
                                           reduction="none").view(t.shape)

    with pytest.raises(ValueError, match=r"returned \(3, 2\); return a scalar mean"):
        forward_loss(model, (x, y), per_item)

    def mean(out, t):
        return nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())

    # A number, and a tensor cut from the graph: named, not failed in the count or backward.
    with pytest.raises(ValueError, match=r"returned float 1\.\d+, not a tensor \(loss\.item\(\) "
                                         r"or float\(loss\) leaves autograd\); return the loss"):
        forward_loss(model, (x, y), lambda out, t: mean(out, t).item())
    with pytest.raises(ValueError, match=r"a tensor without an autograd graph \(detached"):
        forward_loss(model, (x, y), lambda out, t: mean(out, t).detach())
    with torch.no_grad():  # evaluation: no graph wanted
        assert forward_loss(model, (x, y), lambda out, t: mean(out, t).detach())[1] == 6


def test_two_closures_from_one_loss_factory_are_asked_apart():
    """The answer is kept per loss: two closures of one factory share their code but not what
    they close over, and each is counted by its own answer; a lambda made anew with the same
    captures is asked once."""
    from plait.loss import label_shift

    torch.manual_seed(0)
    logits = torch.randn(4, 8, W.VOCAB)
    labels = W.mlm_batch(0)[1][:4]
    labels[:, 0] = 3

    def make(shift):
        return lambda out, y: (W.shifted_loss if shift else W.mlm_loss)(out, y)

    known: dict = {}
    for shift in (True, False, True, False):
        f = make(shift)
        got = label_shift(f, logits, f(logits, labels), labels, known=known, model_shifts=False)
        assert got is shift
    assert len(known) == 2


def test_a_loss_that_shifts_labels_itself_under_every_layout():
    """A hand-written causal-LM loss (``logits[:, :-1]`` against ``labels[:, 1:]``, mean over
    the counted labels) trains what one device trains under dp, ZeRO-3 with accumulation, tp
    (the slice runs on vocabulary-sharded logits) and pp: plait counts the labels the loss
    reads, not every label in the batch (one more token per row whose first label counts)."""
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    ref = W.reference(W.masked_lm, batches, W.shifted_loss)
    staged = W.reference(W.staged_masked_lm, batches, W.shifted_loss)
    jobs = [(p, W.masked_lm, batches, W.shifted_loss)
            for p in ("dp=2", "dp_shard=2,zero=3,grad_accum=2", "tp=2")]
    jobs.append(("pp=2,mb=4", W.staged_masked_lm, batches, W.shifted_loss))
    got = run_distributed(W.train_jobs, 2, jobs, timeout=300)[0]
    for result in got[:3]:
        _assert_matches(ref, result)
    _assert_matches(staged, got[3])


def test_a_model_whose_own_loss_shifts_the_labels():
    """A model written in the Hugging Face style whose forward computes a causal-LM loss
    (``output.loss`` over ``logits[:, :-1]`` against ``labels[:, 1:]``; ``loss_fn=None``) is
    counted by the labels it reads, as a Hugging Face causal LM is: its logits say so (each
    row's first label counted, the loss was off by 4e-5 relative under dp=2 and the weights by
    2e-2 of their displacement)."""
    from plait.loss import label_shift

    torch.manual_seed(0)
    logits = torch.randn(4, 8, W.VOCAB)
    labels = W.mlm_batch(0)[1][:4]
    labels[:, 0] = 3
    for loss_fn, shifts in ((W.shifted_loss, True), (W.mlm_loss, False)):
        out = {"logits": logits, "loss": loss_fn(logits, labels)}
        known: dict = {}
        assert label_shift(None, out, out["loss"], labels, known=known,
                           model_shifts=False) is shifts
        assert list(known.values()) == [shifts]
    flat = torch.zeros_like(logits)  # every item's loss the same: cannot tell, asked again
    out = {"logits": flat, "loss": W.shifted_loss(flat, labels)}
    known = {}
    assert label_shift(None, out, out["loss"], labels, known=known, model_shifts=False) is False
    assert known == {}
    # Neither plain cross-entropy (label smoothing): every label counted, and not asked again.
    smoothed = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, W.VOCAB),
                                           labels[:, 1:].reshape(-1), label_smoothing=0.1)
    out = {"logits": logits, "loss": smoothed}
    assert label_shift(None, out, smoothed, labels, known=known, model_shifts=False) is False
    assert list(known.values()) == [False]

    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    ref = W.reference(W.masked_lm, batches, W.shifted_loss)
    dicts = [{"input_ids": x, "labels": y} for x, y in batches]
    jobs = [(p, W.causal_lm_with_loss, dicts, None)
            for p in ("dp=2", "dp_shard=2,zero=3,grad_accum=2")]
    for result in run_distributed(W.train_jobs, 2, jobs, timeout=300)[0]:
        _assert_matches(ref, result)


def test_a_loss_that_cannot_run_on_vocabulary_sharded_logits_says_what_to_do():
    """Under tp the head's logits stay split over the vocabulary; a loss that multiplies a
    plain mask into cross_entropy(reduction='none') fails on them with torch's words about
    mixed DTensors, and plait says why and what runs instead: a loss_fn, or the model's own
    loss computed in its forward."""
    from plait.spawn import WorkerError

    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    with pytest.raises(WorkerError, match=r"split over the vocabulary .*mixed torch.Tensor "
                       r"and DTensor.* options.tp_plan without the 'vocab_embedding'"):
        run_distributed(W.train_jobs, 2, [("tp=2", W.masked_lm, batches, W.sum_count_loss)],
                        timeout=120)
    dicts = [{"input_ids": x, "labels": y} for x, y in batches]  # the model's own loss
    with pytest.raises(WorkerError, match=r"forward failed on a DTensor: .*mixed torch.Tensor "
                       r"and DTensor.* options.tp_plan without the 'vocab_embedding'"):
        run_distributed(W.train_jobs, 2, [("tp=2", W.masked_lm_with_masked_loss, dicts, None)],
                        timeout=120)


def test_full_state_dict_loads_into_the_one_device_model():
    """run.full_state_dict is the one-device model's state_dict, whatever the layout: GPT-2's
    tied head under both names, Llama without its non-persistent rotary table, BatchNorm's
    integer step count in its own dtype; a fresh model's strict load_state_dict takes it."""
    pytest.importorskip("transformers")
    jobs = [("tp=2", W.hf_gpt2), ("dp_shard=2,zero=3", W.hf_llama), ("pp=2", W.hf_llama),
            ("dp=2", W.batchnorm_mlp)]
    problems = run_distributed(W.full_state_loads_into_the_original, 2, jobs, timeout=300)[0]
    assert problems == []


def test_evaluate_gives_one_devices_loss_under_every_layout():
    """run.evaluate: the held-out global batch's loss in eval mode (dropout off), the value one
    device computes, before training and after every step, under dp, tp, ZeRO-3, pp, gradient
    accumulation (in as many micro-batches as a step) and the Hugging Face convention; it
    leaves the training itself alone (the later evaluations follow
    one device's training) and puts the model back in the mode it was in."""
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    held_out = W.mlm_batch(99)
    dicts = [{"input_ids": x, "labels": y} for x, y in batches]
    held_dict = {"input_ids": held_out[0], "labels": held_out[1]}
    ref = W.reference_with_evals(W.masked_lm, batches, W.mlm_loss, held_out)
    jobs = [(p, W.masked_lm, batches, W.mlm_loss, held_out)
            for p in ("dp=2", "tp=2", "dp_shard=2,zero=3")]
    jobs += [("pp=2,mb=2", W.staged_masked_lm, batches, W.mlm_loss, held_out),
             ("dp=2", W.masked_lm_with_loss, dicts, None, held_dict),
             ("dp=2", W.dropout_lm, batches, W.mlm_loss, held_out),
             ("dp=2,grad_accum=2", W.masked_lm, batches, W.mlm_loss, held_out)]
    got = run_distributed(W.evaluate_jobs, 2, jobs, timeout=300)[0]
    refs = [ref] * 3 + [W.reference_with_evals(W.staged_masked_lm, batches, W.mlm_loss,
                                               held_out), ref,
                        W.reference_with_evals(W.dropout_lm, batches, W.mlm_loss, held_out), ref]
    # With grad_accum the evaluation is split as the step is: the plan's memory holds for it.
    assert got[-1]["eval_rows"] == [W.BATCH // 4] and got[0]["eval_rows"] == [W.BATCH // 2]
    for result, want in zip(got, refs, strict=True):
        assert result["evals"] == pytest.approx(want, rel=REL), result["plan"]
        assert result["modes"] == [result["mode"]] * W.STEPS, result["plan"]
        assert result["train_mode"] == [pytest.approx(want[-1], rel=REL), True], result["plan"]


def test_the_ledger_of_your_own_model_predicts_every_layout_and_says_where_it_cannot():
    """Your own model's ledger: under data parallelism the expected column is read off the
    laid-out model, under tensor parallelism it is the planner's prediction for the model
    given to parallelize (ratio 1.000 both). A model fed feature vectors through plain layers
    too, a token per row; under bf16 the dtypes its collectives travel in are read off a
    forward pass on token ids, which it cannot run: the table says so, why, and which command
    prices the layout."""
    got = run_distributed(W.ledger_tables, 2, ["dp=2", "tp=2"], timeout=120)[0]
    dp, tp = got["dp=2"], got["tp=2"]
    assert [(r["axis"], r["op"], r["ratio"]) for r in dp["comm"]["rows"]] == [
        ("dp_replicate", "all_reduce", 1.0)], dp["table"]
    assert "1.000" in dp["table"] and "no 'expected' column" not in dp["table"], dp["table"]
    assert [(r["axis"], r["op"], r["ratio"]) for r in tp["comm"]["rows"]] == [
        ("tp", "all_reduce", 1.0)], tp["table"]
    assert "no 'expected' column" not in tp["table"], tp["table"]
    fed = run_distributed(W.ledger_tables, 2, ["tp=2", "pp=2,mb=2", "tp=2,mixed_precision=bf16"],
                          True, timeout=120)[0]
    rows = fed["tp=2"]["comm"]["rows"]
    assert [(r["axis"], r["op"], r["ratio"]) for r in rows] == [
        ("tp", "all_reduce", 1.0)], fed["tp=2"]["table"]
    rows = fed["pp=2,mb=2"]["comm"]["rows"]
    assert {(r["axis"], r["op"], r["ratio"]) for r in rows} == {
        ("pp", "all_reduce", 1.0), ("pp", "send_recv", 1.0)}, fed["pp=2,mb=2"]["table"]
    table = fed["tp=2,mixed_precision=bf16"]["table"]
    assert "all_reduce" in table and "no 'expected' column" in table, table
    assert "mixed_precision=bf16" in table and "forward pass on token ids" in table, table
    assert "plait plan --model pkg.mod:factory --plan <plan>" in table, table


def test_batchnorm_sync_bn_matches_one_device_and_warns_without():
    """sync_bn: BatchNorm statistics over the data axes, parameters and running statistics
    equal to one device's (DDP and ZeRO-3). Without it: a warning naming the modules, and
    the per-rank statistics really train something else. A statistic the model's own forward
    keeps in a buffer is each rank's own too: the first step warns, naming it."""
    batches = [W.image_batch(s) for s in range(W.STEPS)]
    ref = W.reference(W.conv_bn, batches, torch.nn.functional.cross_entropy)
    jobs = [(p, W.conv_bn, batches, torch.nn.functional.cross_entropy)
            for p in ("dp=2,sync_bn", "dp_shard=2,zero=3,sync_bn", "dp=2")]
    features = [W.bn_batch(s) for s in range(W.STEPS)]
    jobs.append(("dp_shard=2,zero=3", W.running_features, features,
                 torch.nn.functional.cross_entropy))
    synced, synced_zero, plain, running = run_distributed(W.train_jobs, 2, jobs,
                                                          timeout=180)[0]
    own = W.reference(W.running_features, features, torch.nn.functional.cross_entropy)
    assert not torch.allclose(running["state"]["feature_mean"], own["state"]["feature_mean"])
    (warned,) = running["warnings"]
    assert "feature_mean" in warned and "calls" not in warned, warned
    assert not any("buffer" in w for w in plain["warnings"]), plain["warnings"]
    for result in (synced, synced_zero):
        assert not result["warnings"], result["warnings"]
        _assert_matches(ref, result)
    assert any("stem.1" in w and "body.1" in w and "sync_bn" in w for w in plain["warnings"])
    assert abs(plain["losses"][0] - ref["losses"][0]) > 1e-3 * ref["losses"][0]


def test_a_dict_batch_with_its_targets_under_label_is_told_the_rename():
    """{"pixels", "label"} (torchvision's and Hugging Face image datasets' name) with a loss_fn:
    the error names the rename; without a label-like key it names none."""
    from plait.train import call_model

    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"\(keys: \['label', 'pixels'\]\); rename 'label' "
                                         r"to 'labels' \(in the dataset's __getitem__"):
        call_model(model, {"pixels": torch.ones(2, 4), "label": torch.zeros(2)}, lambda o, t: o)
    with pytest.raises(ValueError, match=r"\(keys: \['pixels'\]\); or pass loss_fn=None"):
        call_model(model, {"pixels": torch.ones(2, 4)}, lambda o, t: o)


@pytest.mark.parametrize("plan", ["dp=2", "dp_shard=2,zero=3", "pp=2,dp=2,mb=2"])
def test_unsynced_batchnorm_warning_shows_the_runs_own_plan_with_sync_bn(plan):
    """The fix the warning shows is the run's plan with sync_bn added (under ZeRO-3 it is not
    'dp=2,sync_bn', which would switch ZeRO off), and it parses back to that plan."""
    from plait.parallel.batchnorm import warn_unsynced

    given = Plan.from_string(plan)
    with pytest.warns(UserWarning, match="per-rank statistics") as caught:
        warn_unsynced(W.conv_bn(), given)
    fixed = str(caught[0].message).split("add sync_bn to the plan ('")[1].split("')")[0]
    assert Plan.from_string(fixed) == given.replace(sync_bn=True), fixed
    # Shown at the caller's line (here; in a script, its run.parallelize), not plait's.
    assert caught[0].filename == __file__, caught[0].filename


def test_batchnorm_and_buffers_under_tensor_parallelism():
    """Modules TP leaves whole (BatchNorm, a module adding a buffer, the root with a parameter
    of its own) are replicated over tp with their buffers and run their forward as written;
    sync_bn still takes statistics over the data axes when tp shards the blocks. Parameters
    and running statistics equal one device's."""
    batches = [W.bn_batch(s) for s in range(W.STEPS)]
    ref = W.reference(W.batchnorm_mlp, batches, torch.nn.functional.cross_entropy)
    (tp,) = run_distributed(W.train_jobs, 2, [("tp=2", W.batchnorm_mlp, batches,
                                               torch.nn.functional.cross_entropy)],
                            timeout=180)[0]
    (hybrid,) = run_distributed(W.train_jobs, 4, [("dp=2,tp=2,sync_bn", W.batchnorm_mlp,
                                                   batches, torch.nn.functional.cross_entropy)],
                                timeout=240)[0]
    for result in (tp, hybrid):
        assert not result["warnings"], result["warnings"]
        _assert_matches(ref, result)
    assert {"bn.running_mean", "bn.running_var", "shift.offset", "gain"} <= set(ref["state"])
    # A BatchNorm over features through a transpose: the row-parallel output's gradient
    # arrives strided (its layout restored before the layer's backward views it).
    lm = [W.mlm_batch(s) for s in range(W.STEPS)]
    (strided,) = run_distributed(W.train_jobs, 2, [("tp=2", W.transposed_norm_lm, lm,
                                                    W.mlm_loss)], timeout=180)[0]
    _assert_matches(W.reference(W.transposed_norm_lm, lm, W.mlm_loss), strided)


def test_a_weight_read_by_another_module_under_tensor_parallelism():
    """The root reads the embedding's weight for its head: under TP (and ZeRO-3 x TP, where
    FSDP2 gathers the root's parameters first) it sees the local tensor, as on one device."""
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    ref = W.reference(W.parent_tied_lm, batches, W.mlm_loss)
    job = [("tp=2", W.parent_tied_lm, batches, W.mlm_loss)]
    (tp,) = run_distributed(W.train_jobs, 2, job, timeout=180)[0]
    job = [("dp_shard=2,zero=3,tp=2", W.parent_tied_lm, batches, W.mlm_loss)]
    (zero,) = run_distributed(W.train_jobs, 4, job, timeout=240)[0]
    for result in (tp, zero):
        _assert_matches(ref, result)


def test_a_fused_qkv_layer_under_zero_and_tensor_parallelism():
    """A fused q|k|v Linear with a bias, split over tp so that each rank holds its own q, k and
    v, then sharded again by ZeRO-2/3: the weights gathered back (run.full_state_dict) are
    one device's, in their places, as are the losses. Under sequence parallelism too, where
    the attention takes the sequence length from its input (``b, s, _ = x.shape``): the block
    is a region, which sees the whole sequence."""
    from plait.parallel.tp_infer import infer_plan

    assert infer_plan(W.fused_qkv_lm()).styles["blocks.*.attn"] == "region"
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    ref = W.reference(W.fused_qkv_lm, batches, W.mlm_loss)
    jobs = [(p, W.fused_qkv_lm, batches, W.mlm_loss)
            for p in ("dp_shard=2,zero=3,tp=2", "dp_shard=2,zero=2,tp=2")]
    got = run_distributed(W.train_jobs, 4, jobs, timeout=300)[0]
    got += run_distributed(W.train_jobs, 2, [("tp=2,sp", W.fused_qkv_lm, batches, W.mlm_loss)],
                           timeout=300)[0]
    for result in got:
        _assert_matches(ref, result)


def test_frozen_and_tied_weights_under_every_layout():
    """Frozen parameters (a tied embedding/head and a whole block) stay exactly where they
    started under DDP, ZeRO-2/3, TP and a pipeline that splits the tie, with weight decay on
    (a zero gradient where there should be none would move them); the rest trains as one
    device trains it. The pipeline also sends strided activations between its stages."""
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    ref = W.reference(W.frozen_tied_lm, batches, W.mlm_loss, weight_decay=0.1)
    start = W.frozen_tied_lm()
    frozen = {n: p.detach().clone() for n, p in start.named_parameters() if not p.requires_grad}
    assert set(frozen) == {"tok.weight", "blocks.0.1.weight", "blocks.0.1.bias",
                           "blocks.0.3.weight", "blocks.0.3.bias", "blocks.0.0.weight",
                           "blocks.0.0.bias"}
    moved = [n for n, p in start.named_parameters() if p.requires_grad
             and (ref["state"][n] - p).abs().max() == 0]
    assert not moved, moved  # the reference trains everything else
    plans = ("dp=2", "dp_shard=2,zero=2", "dp_shard=2,zero=3", "tp=2", "pp=2")
    jobs = [(p, W.frozen_tied_lm, batches, W.mlm_loss) for p in plans]
    for result in run_distributed(W.train_jobs, 2, jobs, weight_decay=0.1, timeout=300)[0]:
        _assert_matches(ref, result)
        state = {k.removeprefix("inner."): v for k, v in result["state"].items()}
        for name, want in frozen.items():
            assert torch.equal(state[name], want), (result["plan"], name)


# ------------------------------------------------------------------ TP inference: right or refuse
@pytest.mark.parametrize("factory,expect", [
    (W.flat_stack, {"0": "colwise", "2": "rowwise"}),
    (W.sequential_blocks, {"*.0": "colwise", "*.2": "rowwise"}),
    (W.pre_norm_net, {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}),
    (W.dict_net, {"blocks.first.0": "colwise", "blocks.first.2": "rowwise",
                  "blocks.second.0": "colwise", "blocks.second.2": "rowwise"}),
    (W.two_heads, {"body.0": "colwise", "body.2": "rowwise"}),
])
def test_inferred_tp_plans(factory, expect):
    """A Linear->act->Linear chain pairs its linears; an input layer and heads around blocks
    stay replicated (their blocks are the regions); a pre-norm block is a region."""
    from plait.parallel.tp_infer import infer_plan, verify_plan

    model = factory()
    plan = infer_plan(model)
    assert plan.styles == expect
    verify_plan(model, plan, 2)


def test_shape_check_catches_a_misplaced_split():
    """A column-parallel layer whose sharded output reaches a replicated one fails the
    fake-tensor forward, before anything is sharded, and the model is left as it was."""
    from plait.parallel.tp_infer import check_shapes

    model = W.flat_stack()
    x = torch.randn(2, 8)
    before = model(x)
    error = check_shapes(model, {"0": "colwise"}, {}, 2, x)
    assert error and "32" in error
    assert check_shapes(model, {"0": "colwise", "2": "rowwise"}, {}, 2, x) is None
    assert torch.equal(model(x), before)


def test_inferred_tp_trains_like_one_device():
    """tp=2 on each model above (SGD) equals the plain one-process loop."""
    batches = [W.feature_batch(s) for s in range(W.STEPS)]
    jobs = [("tp=2", f, batches, W.mse) for f in W.TP_FACTORIES]
    got = run_distributed(W.train_jobs, 2, jobs, timeout=240)[0]
    for factory, result in zip(W.TP_FACTORIES, got, strict=True):
        _assert_matches(W.reference(factory, batches, W.mse), result)


def test_plan_auto_asks_the_planner_prints_and_trains(data):
    batches, ref = data
    got = run_distributed(W.auto_worker, 2, batches, timeout=180)
    assert got[0]["plan"] == got[1]["plan"]
    printed = got[0]["printed"]
    assert "plan 'auto' for MaskedLM on 2 x" in printed and got[0]["plan"] in printed
    assert "best:" in printed and got[1]["printed"] == ""
    _assert_matches(ref, got[0])


# ------------------------------------------------------------------ SP on Hugging Face models
def test_sequence_parallel_on_hf_models():
    """tp=2 with sequence parallelism on GPT-2 (tied embeddings), Llama and BERT equals the
    plain one-process loop: the sequence is split inside the block stack only, so positions,
    masks and rotary tables are computed on whole sequences."""
    batches = [W.hf_batch(s) for s in range(2)]
    jobs = [("tp=2,sp", f, batches, W.mlm_loss) for f in W.HF_FACTORIES]
    got = run_distributed(W.train_jobs, 2, jobs, timeout=300)[0]
    for factory, result in zip(W.HF_FACTORIES, got, strict=True):
        _assert_matches(W.reference(factory, batches, W.mlm_loss), result)


# ------------------------------------------------------------------ pipelines
def test_masked_lm_pipeline_microbatches_and_dict_targets():
    """pp=2 with 4 microbatches (1F1B and GPipe with accumulation), each microbatch counting a
    different number of labels; and dict targets, which the schedule cannot split itself."""
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    ref = W.reference(W.staged_masked_lm, batches, W.mlm_loss)
    dicts = [(x, {"labels": y}) for x, y in batches]
    jobs = [("pp=2,mb=4", W.staged_masked_lm, batches, W.mlm_loss),
            ("pp=2,schedule=gpipe,mb=2,grad_accum=2", W.staged_masked_lm, batches, W.mlm_loss),
            ("pp=2,mb=4", W.staged_masked_lm, dicts, W.dict_target_loss)]
    got = run_distributed(W.train_jobs, 2, jobs, timeout=300)[0]
    for result in got:
        _assert_matches(ref, result)


def test_the_loss_torch_asks_during_shape_inference_decides_nothing():
    """torch's pipeline stage calls the loss while it infers shapes, on the outputs of
    uninitialised buffers: whatever that call says about the labels (here, certainly, that the
    loss shifts them) is not kept. Before, it was, when the memory happened to hold nearly
    uniform logits: every later microbatch counted one label per row too few, and the loss and
    gradient scale were off (3e-4 relative, in some runs of the same job)."""
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    for _, labels in batches:  # every first label counted; rows count different numbers
        labels[:, 0] = torch.arange(len(labels)) % W.VOCAB
    ref = W.reference(W.staged_masked_lm, batches, W.mlm_loss)
    for plan in ("pp=2,mb=2", "pp=2,schedule=gpipe,mb=1,grad_accum=2"):
        first, last = run_distributed(W.shape_inference_loss_job, 2, plan, batches,
                                      timeout=300)
        if not last["seen"]:
            pytest.skip("this torch's pipeline stage does not call the loss in shape inference")
        _assert_matches(ref, first)
        assert last["losses"] == first["losses"]


def test_pipeline_residuals_in_the_parent_and_two_embeddings_and_module_dict():
    """Models whose forward adds a block's output to its input (``h = h + block(h)``), sums two
    embeddings before the first block, or keeps its blocks in an nn.ModuleDict: stages that do
    not own such a module add zero instead of passing their input on (found with torch.fx)."""
    mlm = [W.mlm_batch(s) for s in range(W.STEPS)]
    feats = [W.feature_batch(s) for s in range(W.STEPS)]
    jobs = [("pp=2,mb=4", W.masked_lm, mlm, W.mlm_loss),
            ("pp=2,mb=4", W.dict_net, feats, W.mse)]
    got = run_distributed(W.train_jobs, 2, jobs, timeout=300)[0]
    _assert_matches(W.reference(W.masked_lm, mlm, W.mlm_loss), got[0])
    _assert_matches(W.reference(W.dict_net, feats, W.mse), got[1])


# ------------------------------------------------------------------ N-D layouts
def test_nd_world4_pipeline_with_tp_and_dp():
    """The cheap form of the world-8 cases below: pp x tp (interleaved 1F1B) and pp x dp."""
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    ref = W.reference(W.staged_masked_lm, batches, W.mlm_loss)
    jobs = [(p, W.staged_masked_lm, batches, W.mlm_loss)
            for p in ("pp=2,tp=2,schedule=interleaved_1f1b,v=2,mb=2", "pp=2,dp=2,mb=2")]
    for result in run_distributed(W.train_jobs, 4, jobs, timeout=400)[0]:
        _assert_matches(ref, result)


@pytest.mark.slow
def test_nd_world8_layouts_match_one_device():
    """8 processes: pp2 x dp2 x tp2, pp2 x ZeRO-3(2) x tp2 with SP, HSDP(2x2) x tp2, each 5
    steps equal to the plain one-process loop (the masked-token loss, SGD)."""
    batches = [W.token_batch(s) for s in range(5)]
    ref = W.reference(W.reference_lm, batches, W.mlm_loss)
    jobs = [(p, W.reference_lm, batches, W.mlm_loss)
            for p in ("pp=2,dp=2,tp=2,mb=2", "pp=2,dp_shard=2,zero=3,tp=2,sp,mb=2",
                      "dp_replicate=2,dp_shard=2,zero=3,tp=2")]
    for result in run_distributed(W.train_jobs, 8, jobs, timeout=900)[0]:
        _assert_matches(ref, result)


def test_torch_transformer_layers_under_tensor_and_pipeline_parallelism():
    """torch's own nn.TransformerEncoder: fx cannot trace its layers, so the TP plan (linear1
    column-, linear2 row-parallel; the attention replicated) comes from a recorded fake
    forward; a pipeline stage runs its forward, which reads the first layer's settings, with
    stand-ins for the layers it does not hold. nn.MultiheadAttention reads out_proj.weight
    without calling out_proj: replicated under DP x TP, where FSDP2 gathers it with the block."""
    from plait.parallel.tp_infer import infer_plan

    assert infer_plan(W.torch_encoder_lm()).styles == {
        "enc.layers.*.linear1": "colwise", "enc.layers.*.linear2": "rowwise",
        "tok": "vocab_embedding", "head": "vocab_head"}
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    ref = W.reference(W.torch_encoder_lm, batches, W.mlm_loss)
    jobs = [(p, W.torch_encoder_lm, batches, W.mlm_loss) for p in ("tp=2", "pp=2")]
    for result in run_distributed(W.train_jobs, 2, jobs, timeout=240)[0]:
        _assert_matches(ref, result)
    ref = W.reference(W.attention_lm, batches, W.mlm_loss)
    job = [("dp=2,tp=2", W.attention_lm, batches, W.mlm_loss)]
    (result,) = run_distributed(W.train_jobs, 4, job, timeout=240)[0]
    _assert_matches(ref, result)


def test_a_branch_some_ranks_skip_trains_with_find_unused():
    """A layer applied to some rows only: in some step one data rank's rows have none, so its
    parameters get no gradient there. With find_unused, DDP and ZeRO-3 reduce zeros for them
    and train what one device trains; so do ZeRO-2/3 for the experts of a top-1 MoE that a
    rank's rows did not pick (a module its forward does not call at all)."""
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    half = W.BATCH // 2
    used = [[bool((ids[r * half:(r + 1) * half, 0] < W.AUX_BELOW).any()) for r in (0, 1)]
            for ids, _ in batches]
    assert [True, False] in used or [False, True] in used, used  # the ranks disagree somewhere
    assert any(any(u) for u in used), used  # and the layer trains
    ref = W.reference(W.aux_branch_lm, batches, W.mlm_loss)
    from plait.plan import Plan

    zero3 = Plan.from_string("dp_shard=2,zero=3,find_unused=true")
    # Its blocks run in every forward (the skipped layer is inside the root), so they may be
    # units of their own, named by shard_patterns.
    per_block = zero3.replace(options=zero3.options.replace(shard_patterns=("blocks.*",)))
    plans = ("dp=2,find_unused=true", zero3, per_block)
    jobs = [(p, W.aux_branch_lm, batches, W.mlm_loss) for p in plans]
    # A top-1 MoE whose experts are FSDP2's default units: a rank none of whose rows picked an
    # expert does not call it, so it must not be a unit of its own (torch aborted both ranks).
    features = [W.feature_batch(s) for s in range(W.STEPS)]
    routes = [W.top_one_moe().routes(x) for x, _ in features]  # at the initial weights
    assert any(set(r[:half].tolist()) != set(r[half:].tolist()) for r in routes), routes
    moe_ref = W.reference(W.top_one_moe, features, W.mse)
    jobs += [(p, W.top_one_moe, features, W.mse)
             for p in ("dp_shard=2,zero=2,find_unused=true", "dp_shard=2,zero=3,find_unused=true")]
    for (given, factory, _, _), result in zip(jobs, run_distributed(W.train_jobs, 2, jobs,
                                                                    timeout=240)[0], strict=True):
        _assert_matches(moe_ref if factory is W.top_one_moe else ref, result)
        # ZeRO-3 as one unit is said, with the per-block way out, unless the blocks are named.
        plan = given if isinstance(given, Plan) else Plan.from_string(given)
        one_unit = [m for m in result["warnings"] if "find_unused with zero=3 shards" in m]
        assert bool(one_unit) == (plan.zero == 3 and not plan.options.shard_patterns), \
            (given, one_unit)
        if one_unit and factory is W.aux_branch_lm:
            assert "options={'shard_patterns': ['blocks.*']}" in one_unit[0], one_unit


def test_a_rank_that_aborts_is_named_before_the_peer_it_took_down():
    """The rank that died without a Python error is the cause; the peer's dropped connection
    is not, even when its report arrives first."""
    from plait.spawn import WorkerError

    with pytest.raises(WorkerError) as info:
        run_distributed(W.abort_on_rank0, 2, timeout=120)
    assert info.value.rank == 0
    assert "find_unused" in str(info.value) and "rank 1 failed too" in str(info.value)


def test_fused_qkv_flat_blocks_shared_blocks_and_dict_blocks():
    """What models written by hand look like: a flat block with a fused q|k|v layer under TP
    (the plan splits each third, and the block into an attention and an MLP region); one block
    applied at every depth under a pipeline; blocks that are ModuleDicts under ZeRO-3."""
    from plait.parallel.pipeline_split import plan_stages
    from plait.parallel.tp_infer import infer_plan
    from plait.plan import Plan

    plan = infer_plan(W.flat_lm())
    assert plan.styles == {"blocks.*.qkv": "colwise_qkv", "blocks.*.proj": "rowwise",
                           "blocks.*.up": "colwise", "blocks.*.down": "rowwise",
                           "tok": "vocab_embedding", "head": "vocab_head"}
    assert plan.divide_attrs == {"blocks.*": ("heads",)}
    with pytest.raises(ValueError, match=r"ModuleDicts, which the forward indexes .*pp=1"):
        plan_stages(W.dict_blocks_lm(), Plan(pp=2, microbatches=2))
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    jobs = [("tp=2", W.flat_lm), ("pp=2", W.shared_block_lm),
            ("dp_shard=2,zero=3", W.dict_blocks_lm)]
    results = run_distributed(W.train_jobs, 2, [(p, f, batches, W.mlm_loss) for p, f in jobs],
                              timeout=300)[0]
    for (_, factory), result in zip(jobs, results, strict=True):
        _assert_matches(W.reference(factory, batches, W.mlm_loss), result)


def test_per_head_norms_fused_layouts_and_side_modules_registered_out_of_order():
    """Per-head q/k norms inside an attention region: each rank's norms see its heads only, so
    inference names them grad_allreduce and their gradients are summed over tp (left
    replicated they trained on half the gradient: 2e-4 of their displacement off after three
    steps, and the ranks' copies apart); under DP x TP with ZeRO-3 too, where FSDP2 gathers
    them. A fused q|k|v layer laid out head by head: shapes cannot tell it from three blocks,
    swapping two ranks' shares can (split in thirds it trained a different model, its loss off
    by 8e-3 relative at step one); it gets a plain column split. A model that registers its
    head before its blocks, whose blocks return tuples, under a pipeline: the head goes to the
    last stage, and stand-ins return tuples."""
    from plait.parallel.pipeline_split import observe_forward
    from plait.parallel.tensor import match_plan
    from plait.parallel.tp_infer import infer_plan, verify_plan
    from plait.parallel.tp_verify import mixed_blocks

    styles = infer_plan(W.qk_norm_lm()).styles
    assert styles["blocks.*.q_norm"] == styles["blocks.*.k_norm"] == "grad_allreduce"
    assert "blocks.*.norm" not in styles
    model = W.interleaved_qkv_lm()
    guessed = infer_plan(model)
    assert guessed.styles["blocks.*.qkv"] == "colwise_qkv"
    assert mixed_blocks(model, match_plan(model, guessed.styles), 2,
                        torch.randint(0, W.VOCAB, (2, 4))) == ["blocks.0"]
    assert verify_plan(model, guessed, 2).styles["blocks.*.qkv"] == "colwise"
    assert verify_plan(W.flat_lm(), infer_plan(W.flat_lm()), 2).styles["blocks.*.qkv"] == \
        "colwise_qkv"
    assert observe_forward(W.head_first_lm(), "blocks") == (frozenset({"norm", "head"}), 2)
    # A block index collapses, a place inside the block does not (one pattern for all blocks,
    # which every pipeline stage's blocks match).
    assert infer_plan(W.attention_lm()).styles == {
        "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise", "tok": "vocab_embedding",
        "head": "vocab_head"}
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    jobs = [("tp=2", W.qk_norm_lm), ("tp=2", W.interleaved_qkv_lm), ("pp=2", W.head_first_lm)]
    results = run_distributed(W.train_jobs, 2, [(p, f, batches, W.mlm_loss) for p, f in jobs],
                              timeout=240)[0]
    job = [("dp_shard=2,zero=3,tp=2", W.qk_norm_lm, batches, W.mlm_loss)]
    results += run_distributed(W.train_jobs, 4, job, timeout=240)[0]
    for (_, factory), result in zip([*jobs, job[0][:2]], results, strict=True):
        _assert_matches(W.reference(factory, batches, W.mlm_loss), result)


def test_fewer_kv_heads_than_tp_are_replicated():
    """Multi-query attention (1 kv head) at tp=2, hand-written and transformers' Gemma (eager
    attention: it repeats kv heads by the module's stored group size), also under ZeRO-3 x TP;
    grouped-query attention with 2 kv heads at tp=4. The k/v projections stay whole on every
    rank, each rank computes the kv head its query heads read, and their gradients are summed
    over tp. A model whose query head i reads kv head i % kv_heads (``repeat``, not
    ``repeat_interleave``) cannot be split so: refused by the share-swap check, by name."""
    from plait.parallel.tensor import match_plan
    from plait.parallel.tp_infer import infer_plan, verify_plan
    from plait.parallel.tp_kv import replicated_kv

    model = W.gqa_lm()
    matched = match_plan(model, infer_plan(model).styles)
    kv = replicated_kv(model, matched, 4)
    assert sorted(kv) == ["blocks.0.wk", "blocks.0.wv", "blocks.1.wk", "blocks.1.wv"]
    assert kv["blocks.0.wk"].rows(3, 4) == slice(4, 8)  # ranks 2 and 3 read kv head 1
    assert replicated_kv(model, matched, 2) == {}  # tp divides the kv heads: split as usual
    tiled = W.tiled_gqa_lm()
    with pytest.raises(ValueError, match="splits blocks.0 over tp=4 into parts that are not "
                                         "whole heads"):
        verify_plan(tiled, infer_plan(tiled), 4)
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    jobs = [("tp=2", W.mqa_lm), ("tp=2", W.hf_gemma_mqa)]
    results = run_distributed(W.train_jobs, 2, [(p, f, batches, W.mlm_loss) for p, f in jobs],
                              timeout=240)[0]
    four = [("tp=4", W.gqa_lm), ("dp_shard=2,zero=3,tp=2", W.mqa_lm)]
    results += run_distributed(W.train_jobs, 4, [(p, f, batches, W.mlm_loss) for p, f in four],
                               timeout=240)[0]
    for (_, factory), result in zip(jobs + four, results, strict=True):
        _assert_matches(W.reference(factory, batches, W.mlm_loss), result)


class _Normalised(nn.Module):
    """A block model whose logits pass a BatchNorm: running statistics the checks' forwards
    would move."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm, self.bn = lm, nn.BatchNorm1d(W.VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lm(input_ids).transpose(1, 2)).transpose(1, 2)


def test_plan_auto_asks_the_model_before_proposing_tensor_or_sequence_parallelism():
    """The planner prices sizes; whether the model's blocks allow SP, or its layer plan a tp,
    is the model's to say (``plait.auto.layout_check``): asked without printing, leaving the
    model's buffers and the RNG as they were."""
    from plait.auto import layout_check

    ok = layout_check(W.positionwise_lm())
    assert ok(Plan(tp=2, sp=True)) is None and ok(Plan(tp=1)) is None
    model = _Normalised(W.shifted_lm())
    check = layout_check(model)
    before = model.bn.running_mean.clone(), torch.get_rng_state()
    why = check(Plan(tp=2, sp=True))  # runs the blocks
    assert why is not None and "lm.blocks.0 does not treat positions one by one" in why, why
    assert check(Plan(tp=2)) is None
    assert torch.equal(model.bn.running_mean, before[0]) and model.bn.num_batches_tracked == 0
    assert torch.equal(torch.get_rng_state(), before[1])
    assert check(Plan(tp=3)).startswith("cannot apply tensor parallelism tp=3")


def test_plan_auto_asks_the_model_before_cutting_a_pipeline():
    """The planner sees a stack of blocks; whether the model can be cut there is the model's
    to say: an encoder-decoder cannot, nor blocks the forward indexes, nor more stages than
    blocks, nor a tied weight on two stages one rank holds."""
    from plait.auto import layout_check

    lm = layout_check(W.positionwise_lm())
    assert lm(Plan(pp=2, microbatches=2)) is None
    interleaved = Plan(pp=2, virtual_stages=2, microbatches=4, pp_schedule="interleaved_1f1b")
    assert "but blocks has only 2 blocks" in lm(interleaved)
    assert "are ModuleDicts" in layout_check(W.dict_blocks_lm())(Plan(pp=2, microbatches=2))
    transformers = pytest.importorskip("transformers")
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=4))
    check = layout_check(t5)
    assert "is an encoder-decoder model" in check(Plan(pp=2, microbatches=2))
    assert check(Plan(dp_replicate=2)) is None
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=32, n_embd=16, n_layer=4, n_head=2, n_positions=16))  # tied head
    zbv = Plan(pp=2, virtual_stages=2, microbatches=2, pp_schedule="zbv")
    assert "is tied across stages that zbv puts on one rank" in layout_check(gpt2)(zbv)
    assert layout_check(gpt2)(Plan(pp=2, microbatches=2)) is None


def test_sequence_parallelism_on_an_inferred_plan():
    """tp=2,sp=true on a hand-written model (pre-norm attention with one kv head, an MLP, a
    layer-scale on each block): the blocks were run to show they treat positions one by one
    outside their regions, so the sequence is split inside the block stack and the norms' and
    layer-scales' gradients summed over tp; also under a pipeline, where each stage's own
    blocks split and gather; a position table added before the blocks meets the whole
    sequence. A block that adds the previous position's input is refused, by name, before
    anything is sharded; so is a forward that adds each block's output to its input itself
    (the residual in the parent meets a whole sequence and a split one), found by torch.fx
    or, where fx cannot trace the forward, by running it on the meta device."""
    from plait.parallel.tp_infer import infer_plan, verify_plan

    plan = verify_plan(W.positionwise_lm(), infer_plan(W.positionwise_lm()), 2, sp=True)
    assert plan.supports_sp and plan.sp_blocks == "blocks.*"
    shifted = verify_plan(W.shifted_lm(), infer_plan(W.shifted_lm()), 2, sp=True)
    assert not shifted.supports_sp and shifted.sp_refused.startswith(
        "blocks.0 does not treat positions one by one")
    for factory in (W.masked_lm, W.frozen_tied_lm):  # fx traces the first, not the second
        parent = verify_plan(factory(), infer_plan(factory()), 2, sp=True)
        assert not parent.supports_sp and parent.sp_refused.startswith(
            "its forward adds blocks.0's output to that block's input outside the block"), (
            factory, parent.sp_refused)
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    jobs = [("tp=2,sp=true", W.positionwise_lm), ("tp=2,sp=true", W.positioned_lm)]
    results = run_distributed(W.train_jobs, 2, [(p, f, batches, W.mlm_loss) for p, f in jobs],
                              timeout=240)[0]
    four = [("pp=2,tp=2,sp=true", W.positionwise_lm)]
    results += run_distributed(W.train_jobs, 4, [(p, f, batches, W.mlm_loss) for p, f in four],
                               timeout=240)[0]
    for (_, factory), result in zip(jobs + four, results, strict=True):
        _assert_matches(W.reference(factory, batches, W.mlm_loss), result)


def test_lora_layers_under_tensor_parallelism():
    """A model whose every linear in its blocks is a LoRA layer (frozen base, trainable A and
    B): the inferred plan splits each as one linear, its side path with it (B column-parallel
    beside a column-parallel base, A row-parallel beside a row-parallel one, the other whole),
    and the trained A, B, norms and layer-scales match one device at tp=2, with SP (an A
    inside a region reads the gathered sequence: its gradient is not summed over tp), with
    ZeRO-3 on the frozen bases, and at pp=2,tp=2,sp=true."""
    from plait.parallel.tp_infer import infer_plan

    styles = infer_plan(W.lora_lm()).styles
    assert styles["blocks.*.attn.q.B"] == "colwise" and styles["blocks.*.attn.o.A"] == "rowwise"
    assert "blocks.*.attn.q.A" not in styles and "blocks.*.attn.o.B" not in styles
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    jobs = [("tp=2", W.lora_lm), ("tp=2,sp=true", W.lora_lm), ("dp_shard=2,zero=3", W.lora_lm)]
    results = run_distributed(W.train_jobs, 2, [(p, f, batches, W.mlm_loss) for p, f in jobs],
                              timeout=240)[0]
    results += run_distributed(W.train_jobs, 4, [("pp=2,tp=2,sp=true", W.lora_lm, batches,
                                                  W.mlm_loss)], timeout=240)[0]
    reference = W.reference(W.lora_lm, batches, W.mlm_loss)
    for result in results:
        _assert_matches(reference, result)
        moved = [k for k, v in result["state"].items()
                 if not torch.equal(v, W.lora_lm().state_dict()[k])]
        assert moved and all(".base." not in k for k in moved), (result["plan"], moved)


def test_lora_layers_in_a_transformers_plan():
    """Llama as PEFT leaves it (its projections LoRA layers in PEFT's layout, everything else
    frozen): transformers' own plan names q_proj, ..., which are LoRA layers now, split as one;
    with SP the frozen norms stay frozen (torch's SequenceParallel registers new, trainable
    parameters: they trained on every rank before) and the B after a row-parallel A, which
    reads this rank's positions, is summed over tp."""
    batches = [W.hf_batch(s) for s in range(2)]
    jobs = [("tp=2", W.hf_llama_lora), ("tp=2,sp=true", W.hf_llama_lora)]
    got = run_distributed(W.train_jobs, 2, [(p, f, batches, W.mlm_loss) for p, f in jobs],
                          timeout=240)[0]
    reference = W.reference(W.hf_llama_lora, batches, W.mlm_loss)
    start = dict(W.hf_llama_lora().named_parameters())
    for result in got:
        _assert_matches(reference, result)
        moved = {k for k, v in result["state"].items()
                 if k in start and not torch.equal(v, start[k])}
        assert moved and all(".lora_" in k for k in moved), (result["plan"], sorted(moved))


HF_MORE_TP = [W.hf_qwen3, W.hf_phi3, W.hf_mixtral, W.hf_roberta_mlm]
HF_MORE_PP = [W.hf_opt, W.hf_falcon, W.hf_bloom, W.hf_distilbert]


def test_more_transformers_families():
    """tp=2 on Qwen3 (per-head norms: transformers' replicated_with_grad_allreduce), Phi-3
    (fused layers gathered, then split: colwise_gather_output and rowwise_split_input),
    Mixtral (attention split, the experts replicated, no region over them) and RoBERTa (BERT's
    layout; the masked-LM decoder tied to the embedding is split with it); pp=2 on OPT (final
    norm registered before the layers), Falcon (layers return tuples), BLOOM (a LayerNorm of the
    embeddings before its layers: applied, so later stages pass it) and DistilBERT (embeddings
    called positionally)."""
    batches = [W.hf_batch(s) for s in range(2)]
    jobs = [("tp=2", f) for f in HF_MORE_TP] + [("pp=2", f) for f in HF_MORE_PP]
    got = run_distributed(W.train_jobs, 2, [(p, f, batches, W.mlm_loss) for p, f in jobs],
                          timeout=420)[0]
    for (_, factory), result in zip(jobs, got, strict=True):
        _assert_matches(W.reference(factory, batches, W.mlm_loss), result)


def test_check_compares_every_ranks_copy_of_replicated_weights():
    """A plan that leaves per-head norms replicated without summing their gradients: each rank
    steps its copy differently. plait check names the copies that differ between ranks (rank
    0's alone is only slightly off), and passes the same model under the inferred plan."""
    from plait.check import CheckConfig, check
    from plait.plan import Plan

    cfg = CheckConfig(model_factory=W.qk_norm_lm, batch_factory=W.check_batch, steps=3,
                      optimizer="sgd", lr=0.1)
    styles = {"blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise",
              "blocks.*.o": "rowwise"}
    bad = check(Plan(tp=2, options={"tp_plan": {"styles": styles,
                                                "divide_attrs": {"blocks.*": ["heads"]}}}), cfg)
    assert not bad.ok
    assert "blocks.0.q_norm.weight (ranks 0 and 1)" in bad.replicas_differ, bad.format()
    assert "ranks hold different copies of" in bad.format()
    good = check(Plan(tp=2), cfg)
    assert good.ok and not good.replicas_differ, good.format()
