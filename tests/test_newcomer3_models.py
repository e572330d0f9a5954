"""A speech recognizer trained with CTC and a loss of two terms each averaged over its own
count, taken through what a newcomer tries (``tests/_newcomer3_models.py``): what trains
matches one device running the same AdamW steps with torch alone, and what cannot run says
why and what to do."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from plait.batch_rows import MicroBatches
from plait.data.loader import collate_each
from plait.loss import (
    count_items,
    ctc_reduction,
    first_label_skipped,
    loss_sum_and_count,
    term_weights,
)
from plait.spawn import run_distributed
from plait.train import step_share
from tests import _workers_cp as cp_workers
from tests._newcomer3_models import (
    Scenes,
    TinyASR,
    Utterances,
    collate_flat,
    collate_padded,
    collate_scenes,
    ctc_mean,
    reference,
    tiny_wav2vec2,
    token_terms,
    token_terms_scalar,
    tp_plan,
    train,
    train_each,
)
from tests.test_context_parallel import _assert_matches as assert_cp_matches
from tests.test_newcomer_models import _assert_trains_as_one_device as as_one_device


def _assert_trains_as_one_device(got: dict[str, Any], want: dict[str, Any]) -> None:
    # Softmax over the keys ignores a key bias (it adds one number to every score of a query),
    # so its true gradient is 0 and AdamW steps it on rounding noise alone, which differs with
    # the split (1e-6 against values of 5e-7).
    as_one_device(got, want, skip="attention.k_proj.bias")


@pytest.mark.parametrize("collate", [collate_padded, collate_flat])
def test_ctc_targets_count_their_examples(collate) -> None:
    # F.ctc_loss's default mean is over the examples (each divided by its target length);
    # plait counted the labels instead: padded, every entry (N x the longest transcript,
    # which differs between replicas), flat, every symbol. A dp=2 run parted from one device
    # by 6.6% in the loss at the second step.
    data = Utterances(4)
    inputs, targets = collate([data[i] for i in range(4)])
    assert float(count_items(targets)) == 4.0
    value = ctc_mean(TinyASR()(**inputs), targets)
    total, count = loss_sum_and_count(value, targets)
    assert float(count) == 4.0
    torch.testing.assert_close(total, value * 4)


def test_the_first_label_probe_does_not_feed_ctc_a_label_of_minus_100() -> None:
    # plait asked a scalar loss over 2-D integer labels again with each row's first label set
    # to -100, to learn whether it shifts them; F.ctc_loss reads -100 as a label index (out
    # of bounds, unchecked on the CPU: it returned a number; on a GPU a device assert).
    data = Utterances(4)
    inputs, targets = collate_padded([data[i] for i in range(4)])
    out = TinyASR()(**inputs)
    asked: list[Any] = []

    def recompute(t: Any) -> Any:
        asked.append(t)
        return ctc_mean(out, t)

    assert first_label_skipped(ctc_mean(out, targets), targets, recompute, {}, "ctc") is False
    assert asked == []


def test_a_ctc_models_sum_counts_its_part_of_the_step() -> None:
    # A Hugging Face CTC model's config says how its own loss reduced the examples; a sum is
    # the micro-batch's part of one device's sum, counted as its share of the step (the
    # shares of a step's micro-batches over its ranks add up to 1).
    assert ctc_reduction(tiny_wav2vec2("sum")) == "sum"
    assert ctc_reduction(tiny_wav2vec2("mean")) == "mean"
    assert ctc_reduction(TinyASR()) is None
    value = torch.tensor(6.0, requires_grad=True)
    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    total, count = loss_sum_and_count(value, labels, reduction="sum", share=step_share(2, None))
    assert total.requires_grad and total.item() == 6.0 and float(count) == 0.5
    _, count = loss_sum_and_count(value, labels, reduction="mean")
    assert float(count) == 2.0  # one per example, not the 3 labels that are not -100


def test_a_dict_of_terms_is_each_terms_sum_and_count() -> None:
    box, cls = torch.tensor(3.0, requires_grad=True), torch.tensor(8.0, requires_grad=True)
    sums, counts = loss_sum_and_count({"box": (box, 6), "cls": (cls, torch.tensor(4))}, None)
    assert sums.requires_grad and sums.tolist() == [3.0, 8.0] and counts.tolist() == [6.0, 4.0]
    # The reference is the term of the largest count; sum(w * S) / C_ref = S_box/6 + S_cls/4.
    weights, ref = term_weights(counts, lambda t: t)
    assert ref.tolist() == [1.0, 0.0]
    torch.testing.assert_close((weights * sums).sum() / (ref * counts).sum(),
                               torch.tensor(3.0 / 6 + 8.0 / 4))
    # A term that counts nothing anywhere weighs nothing (no 0/0).
    weights, _ = term_weights(torch.tensor([0.0, 4.0]), lambda t: t)
    assert weights.tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match=r"a dict whose 'box' is Tensor: a dict of terms holds "
                                         r"one \(sum, count\) pair per term"):
        loss_sum_and_count({"box": box}, None)
    with pytest.raises(ValueError, match=r"term 'box' has a sum of \(2,\)"):
        loss_sum_and_count({"box": (torch.ones(2), 2)}, None)


def test_flat_boxes_as_many_as_the_images_are_collated_per_micro_batch() -> None:
    # A replica's four images held 1, 1, 0 and 2 boxes: four boxes, so every tensor had four
    # rows and the batch looked like one row per example; grad_accum=2 cut it by rows, and
    # the second micro-batch's boxes pointed at images 3 and 3 of a micro-batch of two
    # ("IndexError: index 3 is out of bounds"; where the indices fit, other images' boxes).
    data = Scenes(32)
    items = [data[i] for i in (4, 6, 1, 7)]
    assert [it[2].shape[0] for it in items] == [1, 1, 0, 2]
    got = collate_each(collate_scenes, items, 2)
    assert isinstance(got, MicroBatches)
    for part, pair in zip(got.parts, (items[:2], items[2:]), strict=True):
        want = collate_scenes(pair)
        assert torch.equal(part[1]["owner"], want[1]["owner"])
    # Padding to the longest per part (another length, the same rows) is still handed whole.
    utterances = Utterances(4)
    whole = collate_each(collate_padded, [utterances[i] for i in range(4)], 2)
    assert isinstance(whole, tuple)


def test_ctc_over_flat_targets_trains_as_one_device_under_dp_and_grad_accum() -> None:
    want = reference("speech_flat")
    got = run_distributed(train, 2, "speech_flat", "dp=2,grad_accum=2", timeout=120)[0]
    _assert_trains_as_one_device(got, want)


def test_two_terms_each_over_its_count_train_as_one_device_under_dp_and_grad_accum() -> None:
    # A dict of (sum, count) pairs was refused ("return a scalar mean or a (sum, count)
    # pair"), and the scalar sum_box / n_box + sum_cls / n_img, weighted by each replica's
    # images, parted from one device by 4.7% at the first step.
    want = reference("boxes_and_class")
    got = run_distributed(train, 2, "boxes_and_class", "dp=2,grad_accum=2", timeout=120)[0]
    _assert_trains_as_one_device(got, want)


def test_two_terms_train_as_one_device_under_tp_and_grad_accum() -> None:
    # The heads read the body's output whole on every tp rank; each term's count is summed
    # over the data replicas only (each tp rank counts the same boxes and images).
    got = run_distributed(train, 2, "wide_boxes_and_class", tp_plan(grad_accum=2),
                          timeout=180)[0]
    _assert_trains_as_one_device(got, reference("wide_boxes_and_class"))


@pytest.mark.slow
@pytest.mark.parametrize("world, plan", [(2, tp_plan()), (4, tp_plan(dp=2)),
                                         (4, tp_plan(dp=2, grad_accum=2))])
def test_two_terms_train_as_one_device_under_tp_and_dp(world, plan) -> None:
    got = run_distributed(train, world, "wide_boxes_and_class", plan, timeout=180)[0]
    _assert_trains_as_one_device(got, reference("wide_boxes_and_class"))


def _token_terms_reference() -> tuple[list[Any], dict[str, Any]]:
    batches = [cp_workers.lm_batch(s) for s in range(cp_workers.STEPS)]
    return batches, cp_workers.reference_adamw(cp_workers.block_lm, batches, token_terms_scalar)


def test_two_terms_over_tokens_train_as_one_device_under_cp_and_grad_accum() -> None:
    # Counting the later micro-batches' terms ran their forward inside the first one's
    # context-parallel attention, which wrapped itself: "scaled_dot_product_attention got an
    # explicit attn_mask (shape (8, 16)) under context parallelism (cp=2)".
    batches, want = _token_terms_reference()
    jobs = [(plan, cp_workers.block_lm, batches, token_terms)
            for plan in ("cp=2", "cp=2,grad_accum=2")]
    for got in run_distributed(cp_workers.train_adamw, 2, jobs, timeout=180)[0]:
        assert_cp_matches(want, got)


@pytest.mark.slow
def test_two_terms_over_tokens_train_as_one_device_under_cp_with_dp_or_tp() -> None:
    batches, want = _token_terms_reference()
    jobs = [(plan, cp_workers.block_lm, batches, token_terms)
            for plan in ("dp=2,cp=2,grad_accum=2", "cp=2,tp=2", "cp=2,tp=2,grad_accum=2")]
    for got in run_distributed(cp_workers.train_adamw, 4, jobs, timeout=300)[0]:
        assert_cp_matches(want, got)


def test_a_hugging_face_ctc_models_own_mean_or_sum_trains_as_one_device(
        ) -> None:
    # Wav2Vec2ForCTC with ctc_loss_reduction="mean" returns F.ctc_loss's mean over its
    # examples; plait weighted each micro-batch's by its labels that are not -100: 1% off one
    # device's loss under dp=2, 7.7% under dp=2,grad_accum=2. With "sum" (the config's
    # default) its loss is a sum over the micro-batch's examples, which plait read as a mean:
    # each layout trained a weighted mean of the parts' sums, 50% off one device's loss under
    # dp=2 and fsdp=2, 75% under dp=2,grad_accum=2 (37.6 where one device has 151.3).
    cases = [("hf_ctc", "dp=2,grad_accum=2", None), ("hf_ctc_sum", "dp=2,grad_accum=2", None)]
    got = run_distributed(train_each, 2, cases, timeout=180)[0]
    for (name, _, loss), each in zip(cases, got, strict=True):
        _assert_trains_as_one_device(each, reference(name, loss))


@pytest.mark.slow
@pytest.mark.parametrize("name, loss", [("speech_padded", None), ("speech_flat", None),
                                        ("speech_flat", "ctc_mean_pair"),
                                        ("speech_flat", "ctc_sum_over_symbols"),
                                        ("speech_flat", "ctc_sum_of_the_batch"),
                                        ("boxes_and_class", None), ("hf_ctc", None),
                                        ("hf_ctc_sum", None)])
@pytest.mark.parametrize("world, plan", [(1, ""), (1, "grad_accum=2"), (2, "dp=2"),
                                         (2, "dp=2,grad_accum=2"), (2, "dp_shard=2,zero=1"),
                                         (2, "fsdp=2"), (2, "fsdp=2,grad_accum=2")])
def test_each_trains_as_one_device_under_every_data_parallel_layout(name, loss, world,
                                                                     plan) -> None:
    want = reference(name, loss)
    got = run_distributed(train, world, name, plan, loss, timeout=120)[0]
    _assert_trains_as_one_device(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_ctc", "hf_ctc_sum"])
def test_a_hugging_face_ctc_models_own_loss_trains_as_one_device_under_tp(name) -> None:
    want = reference(name)
    got = run_distributed(train, 2, name, "tp=2", timeout=120)[0]
    _assert_trains_as_one_device(got, want)


@pytest.mark.slow
def test_plait_check_passes_two_terms_under_dp_and_grad_accum(capsys) -> None:
    from plait.cli import main

    code = main(["check", "--plan", "dp=2,grad_accum=2", "--model",
                 "tests._newcomer3_models:boxes_and_class", "--steps", "2", "--timeout", "120",
                 "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, (out, err)
    assert json.loads(out)["ok"] is True, out


@pytest.mark.slow
def test_a_pipeline_refuses_two_terms_on_every_rank() -> None:
    # The last stage refused the dict mid-schedule and the first stage waited on its sends
    # until the timeout; the refusal now travels with the step's totals.
    got = run_distributed(train, 2, "classes", "pp=2,microbatches=2", timeout=120)
    for rank in got:
        assert "a dict of 2 (sum, count) terms" in rank["refused"], got
        assert "Train without pp (dp=N, or dp_shard=N,zero=3" in rank["refused"], got


@pytest.mark.slow
def test_a_pipeline_refuses_a_hugging_face_ctc_model_by_name() -> None:
    # Hugging Face's get_input_embeddings raised NotImplementedError for Wav2Vec2Model from
    # inside plait's pipeline adapter, a traceback instead of a refusal.
    got = run_distributed(train, 2, "hf_ctc_sum", "pp=2,microbatches=2", timeout=120)
    for rank in got:
        said = rank["refused"]
        assert said.startswith("Wav2Vec2ForCTC.forward takes no inputs_embeds"), said
        assert "run this model with pp=1" in said, said


@pytest.mark.slow
def test_a_pipeline_refuses_flat_targets_by_name() -> None:
    # Each microbatch's targets were taken by row from all the parts' boxes joined:
    # "IndexError: index out of range in self" inside torch's schedule.
    got = run_distributed(train, 2, "boxes_and_class", "pp=2,microbatches=2",
                          "two_terms_scalar", timeout=120)
    for rank in got:
        said = rank["refused"]
        assert "the targets' entry ['boxes'] has " in said and "not one row per example" in said
        assert "pad it to one row per example in the collate_fn, or train without pp" in said
