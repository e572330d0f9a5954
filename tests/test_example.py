"""``run.parallelize(model, example=batch)``: the checks that run a model before training
(``plan="auto"``'s measurements, an inferred tensor-parallel plan's sequence-parallel check)
run on the user's batch where a guessed input does not fit the model (a forward of several
inputs, images of another size), and say ``example=`` where none was given."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.utils.data import default_collate

from plait.auto import AutoRequest, choose
from plait.parallel.tensor import tp_refusal
from plait.parallel.tp_example import Example, from_batch
from plait.planner.whole_model import from_factory, from_module
from plait.spawn import run_distributed
from tests._example_models import PatchViT, Pictures, train_vit, vit_reference
from tests._newcomer_models import DLRM, UNet, collate_clicks, denoiser, recommender

FIX = "run.parallelize(model, example=batch)"


def _unet_batch(rows: int = 4) -> dict[str, torch.Tensor]:
    _, data, _ = denoiser()
    return default_collate([data[i] for i in range(rows)])


def _clicks_batch(rows: int = 4, same: bool = False) -> dict[str, torch.Tensor]:
    """``same``: the first item ``rows`` times (a bag's length varies from item to item)."""
    _, data, _ = recommender()
    return collate_clicks([data[0 if same else i] for i in range(rows)])


def test_a_batch_becomes_the_forward_arguments_run_step_passes_without_labels() -> None:
    x, y = torch.randn(4, 3), torch.randn(4)
    unet = UNet()
    assert from_batch(unet, (x, y)).args == (x,)
    assert from_batch(unet, x).args == (x,)
    pair = from_batch(unet, ((x, y), y))
    assert pair.args == (x, y) and not pair.kwargs
    named = from_batch(unet, _unet_batch())
    assert sorted(named.kwargs) == ["t", "x"] and not named.args  # labels held back
    inputs = {"x": x, "t": y}
    assert from_batch(unet, (inputs, y)).kwargs == inputs

    class TakesTheDict(torch.nn.Module):
        def forward(self, batch: dict) -> torch.Tensor:
            return batch["features"]
    whole = from_batch(TakesTheDict(), {"features": x, "labels": y})
    assert len(whole.args) == 1 and list(whole.args[0]) == ["features"]
    with pytest.raises(ValueError, match="example=str: an example is one batch"):
        from_batch(unet, "images")


def test_an_encoder_decoder_that_shifts_its_labels_keeps_them_in_its_example() -> None:
    # T5 makes its decoder's input from the labels when it is given none: without them its
    # forward does not run, and a tp plan for blocks torch.fx cannot trace (T5Attention in
    # recent transformers) could not be recorded on the user's batch.
    pytest.importorskip("transformers")
    from plait.parallel.tp_infer import infer_plan
    from tests._workers_encdec import Seq2Seq, t5

    model, data, _ = t5()
    batch = default_collate([data[i] for i in range(2)])
    example = from_batch(model, batch)
    assert sorted(example.kwargs) == ["attention_mask", "input_ids", "labels"]
    plan = infer_plan(model, example)
    assert plan.styles["encoder.block.*.layer.*.SelfAttention.o"] == "rowwise", plan.styles
    assert plan.styles["decoder.block.*.layer.*.EncDecAttention"] == "region", plan.styles
    # given its decoder's input, the labels stay out, as for any other model
    given = {**batch, "decoder_input_ids": batch["input_ids"][:, :6]}
    assert "labels" not in from_batch(model, given).kwargs
    assert isinstance(data, Seq2Seq)
    # a forward whose labels are only its own loss's targets (a CTC head) gets none: its
    # loss need not run on the fake tensors the checks use
    class OwnLoss(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
                    ) -> torch.Tensor:
            return input_ids

    ids = torch.arange(4)
    assert from_batch(OwnLoss(), {"input_ids": ids, "labels": ids}).kwargs == {"input_ids": ids}


@pytest.mark.parametrize(("factory", "batch", "forward"), [
    (UNet, _unet_batch, "forward(x, t)"), (DLRM, _clicks_batch, "a dict of four inputs")])
def test_auto_prices_a_model_of_several_inputs_from_its_example(factory, batch, forward) -> None:
    # Without the example the guess (one tensor) does not run the forward: DDP, unpriced,
    # and the line says how to have it priced.
    torch.manual_seed(0)
    model = factory()
    request = AutoRequest(world_size=2, device_type="cpu")
    _, why = choose(model, request)
    assert "not priced" in why[0] and FIX in why[0], forward
    plan, why = choose(model, request, from_batch(model, batch()))
    assert "measured on the example given to run.parallelize" in why[0]
    assert plan.dp == 2 and "not priced" not in why[0]
    priced = [line for line in why[1:] if " step " in line]
    assert priced and all(" ms = compute " in line for line in priced)


@pytest.mark.parametrize(("factory", "batch", "spec"), [
    (UNet, _unet_batch, "tests._newcomer_models:denoiser"),
    (DLRM, partial(_clicks_batch, same=True), "tests._newcomer_models:recommender_collated")])
def test_an_example_of_several_rows_measures_per_row_what_a_dataset_sample_does(
        factory, batch, spec) -> None:
    torch.manual_seed(0)
    model = factory()
    given = from_module(model, from_batch(model, batch(4)))
    sampled, _ = from_factory(spec)
    assert given.flops_per_sample == sampled.flops_per_sample > 0
    assert given.saved_per_sample == sampled.saved_per_sample > 0
    assert given.sample_from == "given example" and given.grad_order is not None


def test_tp_on_images_no_guess_fits_is_refused_naming_example_and_checked_with_it() -> None:
    model = PatchViT()
    for sp in (True, False):  # without sp the plan was used unchecked
        refused = tp_refusal(model, 2, sp)
        assert refused is not None and "plan inferred for PatchViT cannot be checked" in refused
        assert "run.parallelize(model, example=loader.batch(0))" in refused, refused
    x = Pictures().x[:4]
    assert tp_refusal(model, 2, True, Example((x,))) is None


def test_tp_sp_on_images_of_an_odd_size_trains_like_one_device_with_the_example() -> None:
    # 40x40 images in 4x4 patches: 100 learned positions, which no guessed size (224, 32,
    # 64, ...) gives; with the first batch as example= the sequence split is checked and
    # trained: AdamW's losses and parameters are one device's.
    ref = vit_reference()
    got = run_distributed(train_vit, 2, "tp=2,sp", True, timeout=240)[0]
    assert "refused" not in got, got.get("refused")
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
    assert got["state"].keys() == ref["state"].keys()
    for name, value in ref["state"].items():
        torch.testing.assert_close(got["state"][name], value, rtol=1e-4, atol=5e-5, msg=name)


def test_the_planners_traced_passes_run_on_the_example_and_the_factorys_sample() -> None:
    # What keys and values reach attention in, under bf16 (what cp gathers; the ledger's
    # predictions read the same trace): token ids do not run a model of images, its example does.
    from plait.comm.predict import planner_stats
    from plait.plan import Plan
    from plait.planner.model_stats import from_factory, from_module

    model = PatchViT()
    x = Example((Pictures().x[:2],))
    assert from_module(model, attention_dtypes=True).attention_keys is None
    keys = from_module(model, attention_dtypes=True, example=x).attention_keys
    assert keys == ((32, 4, 4), (32, 4, 4))  # two blocks: 4 heads x 8, bf16 keys and values
    assert from_factory("tests._example_models:vit", attention_dtypes=True).attention_keys == keys
    plan = Plan(tp=2, sp=True, mixed_precision="bf16")
    assert planner_stats(model, "cpu", plan).tp_block.trace is None
    assert planner_stats(model, "cpu", plan, x).tp_block.trace is not None


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, h: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(h if skip is None else h + skip)


class _SkipAcross(torch.nn.Module):
    """``forward(x, t)``; the last block also reads the first block's output (a skip across
    the stack, which a pipeline stage is never sent)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.temb = torch.nn.Linear(16, 16), torch.nn.Linear(1, 16)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        first = self.blocks[0](self.inp(x) + self.temb(t[:, None].float()))
        h = self.blocks[2](self.blocks[1](first))
        return self.blocks[3](h, first)


def test_a_pipeline_split_is_checked_on_the_example_of_a_forward_of_two_inputs() -> None:
    from plait.auto import layout_check
    from plait.parallel.pipeline import pp_refusal
    from plait.plan import Plan

    model, plan = _SkipAcross(), Plan(pp=2, microbatches=2)
    assert pp_refusal(model, plan) is None  # no guess runs forward(x, t): not seen
    given = from_batch(model, ((torch.randn(4, 16), torch.arange(4)), torch.randn(4, 16)))
    why = pp_refusal(model, plan, example=given)
    assert why is not None and why.startswith("blocks.3 takes a tensor the forward computed")
    assert layout_check(model, example=given)(plan) == why


def test_plait_check_runs_tp_sp_on_a_factory_of_odd_images(capsys) -> None:
    # plait check hands each rank's first batch to run.parallelize: sp is checked on it
    from plait.cli import main

    code = main(["check", "--model", "tests._example_models:vit", "--plan", "tp=2,sp",
                 "--steps", "2"])
    assert code == 0, capsys.readouterr().err
    assert "PASS: tp=2,sp=true" in capsys.readouterr().out


def test_run_parallelize_hands_its_example_to_plan_auto(capfd) -> None:
    from plait.runtime import init

    run = init("auto", seed=0)
    try:
        run.parallelize(UNet(), example=_unet_batch(8))
    finally:
        run.close()
    got = capfd.readouterr()
    said = got.out + got.err
    assert "plait: plan 'auto' for UNet" in said
    assert "measured on the example given to run.parallelize" in said and " ms = compute " in said


def test_the_library_planner_takes_an_example_as_run_step_does() -> None:
    # plan_model / auto_plan called from a user's script: a forward(x, t) cannot be guessed,
    # so without example= the whole-model measurement fails; with one batch as run.step takes
    # it (labels left out) it is measured and priced like the factory's dataset sample.
    from plait.planner import auto_plan, plan_model

    torch.manual_seed(0)
    model = UNet()
    with pytest.raises(ValueError, match=r"missing 1 required positional argument: 't'.*"
                                         r"pass one batch as run.step takes it as example="):
        plan_model(model, "cpu", world_size=2, global_batch=8)
    result = plan_model(model, "cpu", world_size=2, global_batch=8, example=_unet_batch(4))
    assert result.best is not None and result.best.plan.dp == 2
    by_factory = plan_model("tests._newcomer_models:denoiser", "cpu", world_size=2,
                            global_batch=8)
    assert [e.plan for e in result.ranked] == [e.plan for e in by_factory.ranked]
    assert [e.memory_bytes_per_device for e in result.ranked] == [
        e.memory_bytes_per_device for e in by_factory.ranked]
    assert auto_plan(model, 2, "cpu", global_batch=8, example=_unet_batch(2)).dp == 2
    with pytest.raises(ValueError, match="example= is for a model given as an nn.Module"):
        plan_model("tests._newcomer_models:denoiser", "cpu", world_size=2, global_batch=8,
                   example=_unet_batch(2))
