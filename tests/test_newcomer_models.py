"""A recommender with a variable-length sparse feature and a diffusion U-Net, taken through
what a newcomer tries (``tests/_newcomer_models.py``): the refusals they meet are one line
naming the bad value and the fix, and what trains matches one device."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait.parallel.units import canonical_name
from plait.parallel.zero import apply_fsdp
from plait.plan import Plan
from plait.spawn import run_distributed
from plait.train import split_microbatches
from tests._newcomer_models import (
    DLRM,
    Clicks,
    Noised,
    UNet,
    click_loss,
    collate_clicks,
    recommender_reference,
    train_recommender,
)


def _clicks_batch(rows: int = 8) -> dict[str, torch.Tensor]:
    ds = Clicks()
    return collate_clicks([ds[i] for i in range(rows)])


def test_a_flat_index_list_is_not_cut_into_micro_batches_by_rows() -> None:
    # Cut by rows, the flat ids and their offsets split at other places: the second half's
    # offsets point past its ids (torch: "offsets[0] has to be 0"), or, where the sizes
    # divide, the bags mix. Refused by name before any part runs.
    batch = _clicks_batch()
    assert batch["big_idx"].shape[0] != 8  # the bags hold more ids than there are rows
    with pytest.raises(ValueError) as err:
        split_microbatches(batch, 2)
    message = str(err.value)
    assert f"'big_idx' has {batch['big_idx'].shape[0]} rows where the batch has 8" in message
    assert "grad_accum=2" in message and "padding_idx" in message
    assert "run.loader(dataset, batch_size, collate_fn=...), which collates each micro-batch " \
           "from its own items" in message, message
    assert "plait.MicroBatches" in message and "run with grad_accum=1" in message


def test_the_loader_collates_each_micro_batch_of_a_flat_index_list() -> None:
    # Under grad_accum the loader collated the replica's rows whole, and the step could only
    # refuse the batch (its flat ids cannot be cut by rows). Each micro-batch is now collated
    # from its own consecutive items: the bags and offsets one device builds for those rows.
    from plait import MicroBatches
    from plait.data.loader import DistributedLoader

    data = Clicks()
    loader = DistributedLoader(data, 16, dp_rank=1, dp_size=2, collate_fn=collate_clicks,
                               micro_batches=2, steps=1)
    batch = next(iter(loader))
    assert isinstance(batch, MicroBatches) and len(batch.parts) == 2
    rows = loader.rows(0)
    for part, items in zip(batch.parts, (rows[:4], rows[4:]), strict=True):
        want = collate_clicks([data[i] for i in items])
        assert set(part) == set(want)
        assert all(torch.equal(part[k], want[k]) for k in want)
        assert int(part["big_off"][0]) == 0
    # Built in a loader worker (the collate runs there): the same parts.
    workers = DistributedLoader(data, 16, dp_rank=1, dp_size=2, collate_fn=collate_clicks,
                                micro_batches=2, steps=1, num_workers=1)
    built = next(iter(workers))
    assert isinstance(built, MicroBatches)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(built.parts, batch.parts, strict=True)
               for k in a)
    assert split_microbatches(batch, 2) == list(batch.parts)
    with pytest.raises(ValueError, match=r"comes as 2 micro-batches collated one by one .*"
                                         r"the plan runs grad_accum=4"):
        split_microbatches(batch, 4)
    with pytest.raises(TypeError, match=r"read batch.parts\[i\]\['labels'\]"):
        batch["labels"]
    # A stream's loader collates so too.
    from torch.utils.data import IterableDataset

    from plait.data.stream import StreamLoader

    class Stream(IterableDataset):
        def __iter__(self):
            return (data[i] for i in range(len(data)))

    streamed = next(iter(StreamLoader(Stream(), 16, collate_fn=collate_clicks,
                                      micro_batches=2, steps=1)))
    assert isinstance(streamed, MicroBatches)
    want = collate_clicks([data[i] for i in range(8, 16)])
    assert all(torch.equal(streamed.parts[1][k], want[k]) for k in want)
    # A batch of one row per example stays one batch (the step cuts it by rows), and without
    # accumulation the flat index list stays whole too.
    flat = DistributedLoader(data, 16, collate_fn=collate_clicks, steps=1)
    assert isinstance(next(iter(flat)), dict)
    rowwise = DistributedLoader(Noised(), 8, micro_batches=2, steps=1)
    assert isinstance(next(iter(rowwise)), dict)


def test_one_row_per_example_still_splits() -> None:
    batch = _clicks_batch()
    del batch["big_idx"], batch["big_off"]
    parts = split_microbatches(batch, 2)
    assert [p["dense"].shape[0] for p in parts] == [4, 4]
    assert torch.equal(torch.cat([p["small_idx"] for p in parts]), batch["small_idx"])


def test_the_failure_summary_names_an_exception_whose_message_has_many_lines() -> None:
    # torch's message for an op without a sparse kernel ends with one line per dispatch key:
    # the summary named the last of them ("rank 0 (PythonDispatcher, exit code 1)").
    from plait.launch import exception_name

    traceback = (
        '[rank0]: Traceback (most recent call last):\n'
        '[rank0]:   File "train.py", line 9, in <module>\n'
        '[rank0]:     norm = torch.linalg.vector_norm(grad)\n'
        '[rank0]:            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n'
        "[rank0]: NotImplementedError: Could not run 'aten::linalg_vector_norm' with arguments "
        "from the 'SparseCPU' backend.\n"
        '[rank0]: \n'
        '[rank0]: CPU: registered at aten/src/ATen/RegisterCPU.cpp:30477 [kernel]\n'
        '[rank0]: PythonDispatcher: registered at aten/src/ATen/core/PythonFallbackKernel.cpp:196'
        ' [backend fallback]\n')
    assert exception_name(traceback) == "NotImplementedError"


def test_zero_2_and_3_refuse_a_sparse_embedding_bag_by_name() -> None:
    # FSDP2 failed on every rank with "Could not run 'fsdp::chunk_cat' with arguments from the
    # 'SparseCPU' backend"; refused before any unit is sharded (no mesh is read).
    for zero in (2, 3):
        with pytest.raises(ValueError, match=r"big, small gives sparse gradients \(sparse=True\)"
                                             r".*use sparse=False.*dp_shard=N,zero=1"):
            apply_fsdp(DLRM(sparse=True), None, Plan.load(f"dp_shard=2,zero={zero}"))


def test_tp_refuses_a_sparse_embedding_bag_by_name() -> None:
    # Every parameter becomes a DTensor under tp; the sparse gradient then failed in the
    # backward on every rank ("Could not run 'aten::view' ... 'SparseCPU' backend").
    from plait.parallel.tensor import apply_tensor_parallel

    with pytest.raises(ValueError, match=r"tp=2 makes every parameter of DLRM a DTensor .*"
                                         r"big, small gives sparse gradients .*"
                                         r"use sparse=False under tp"):
        apply_tensor_parallel(DLRM(sparse=True), None, Plan.load("tp=2"))


def _assert_trains_as_one_device(got: dict[str, Any], want: dict[str, Any],
                                 skip: str | None = None) -> None:
    """Losses, evaluated losses and every parameter (but those whose name ends with ``skip``)
    within 1e-5 of the one-device loop's."""
    assert "refused" not in got, got
    for a, b in zip(want["losses"] + want["evaluated"], got["losses"] + got["evaluated"],
                    strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (want, got)
    assert set(got["state"]) == set(want["state"])
    for name, w in want["state"].items():
        if skip is not None and name.endswith(skip):
            continue
        diff = (got["state"][name] - w).abs().max().item()
        assert diff <= 1e-5 * max(w.abs().max().item(), 1e-3), (name, diff)


def test_sparse_gradients_train_as_one_device_under_dp() -> None:
    # plait's gradient clipping took the norm of every gradient with torch's vector_norm,
    # which has no sparse kernel: an nn.EmbeddingBag(sparse=True) failed on the first step,
    # on one process and under every layout.
    want = recommender_reference()
    one = run_distributed(train_recommender, 1, "", True, timeout=120)[0]
    _assert_trains_as_one_device(one, want)
    got = run_distributed(train_recommender, 2, "dp=2", True, timeout=120)[0]
    _assert_trains_as_one_device(got, want)


def test_grad_accum_trains_a_flat_index_list_as_one_device() -> None:
    # grad_accum=2 refused the recommender's batch ("'big_idx' has 44 rows where the batch
    # has 16"). With each micro-batch collated on its own, one process accumulating two and
    # two ranks accumulating two each train what one device trains on the whole global batch
    # without accumulation: the losses and the parameters after AdamW steps, and
    # run.evaluate's loss of the trained model.
    want = recommender_reference("adamw")
    one = run_distributed(train_recommender, 1, "grad_accum=2", False, "adamw", timeout=120)[0]
    _assert_trains_as_one_device(one, want)
    got = run_distributed(train_recommender, 2, "dp=2,grad_accum=2", False, "adamw",
                          timeout=120)[0]
    _assert_trains_as_one_device(got, want)


def test_pipeline_microbatches_train_a_flat_index_list_as_one_device() -> None:
    # Every block of BagStack reads the flat ids and their offsets; torch's schedule cuts each
    # input by rows, and the batch was refused ("cannot cut it into microbatches=2 pipeline
    # parts"). Each microbatch collated on its own, its ids and offsets reach every stage's
    # forward of that microbatch: losses, run.evaluate and parameters after AdamW steps as
    # one device on the whole global batch.
    want = recommender_reference("adamw", "bag_stack")
    got = run_distributed(train_recommender, 2, "pp=2,microbatches=2,grad_accum=2", False,
                          "adamw", "bag_stack", timeout=180)[0]
    _assert_trains_as_one_device(got, want)


@pytest.mark.slow
def test_a_zero_bubble_pipeline_trains_a_flat_index_list_as_one_device() -> None:
    # Two stages per rank, the backward split in two: the stages add each microbatch's own ids
    # by the chunk torch runs, whatever the schedule's order.
    want = recommender_reference("adamw", "bag_stack")
    got = run_distributed(train_recommender, 2, "pp=2,microbatches=4,pp_schedule=zbv,"
                          "virtual_stages=2", False, "adamw", "bag_stack", False,
                          timeout=180)[0]
    _assert_trains_as_one_device(got, {**want, "evaluated": []})


@pytest.mark.slow
def test_sparse_gradients_train_as_one_device_under_zero_1_and_refuse_zero_3() -> None:
    want = recommender_reference()
    got = run_distributed(train_recommender, 2, "dp_shard=2,zero=1", True, timeout=120)[0]
    _assert_trains_as_one_device(got, want)
    refused = run_distributed(train_recommender, 2, "fsdp=2", True, timeout=120)[0]
    assert "gives sparse gradients (sparse=True)" in refused["refused"], refused


def test_an_inferred_tp_plan_that_splits_little_says_what_it_leaves_whole() -> None:
    # tp=2 on these models printed a plan of four (two) Linear layers and nothing more: the
    # 50,000-row EmbeddingBag (99.6% of the recommender) and every convolution of the U-Net
    # stayed whole on both ranks, which only the memory table at the end showed.
    from plait.models.transformer import build
    from plait.parallel.tp_infer import format_plan, infer_plan

    dlrm = DLRM()
    said = format_plan(infer_plan(dlrm), dlrm)
    assert "This plan splits 1,489 of 803,089 parameters (0.2%)" in said, said
    assert "the largest: big (EmbeddingBag, 800,000), small (EmbeddingBag, 1,600)" in said
    assert "dp_shard=N,zero=3" in said
    unet = UNet()
    said = format_plan(infer_plan(unet), unet)
    assert "This plan splits 1,344 of 16,889 parameters (8.0%)" in said, said
    assert "(Conv2d, 2,320)" in said
    lm = build("tiny")
    assert "This plan splits" not in format_plan(infer_plan(lm), lm)


def test_a_batch_key_the_forward_does_not_take_is_named_with_the_fix() -> None:
    # Python's "DLRM.forward() got an unexpected keyword argument 'user_id'" said neither
    # where the key came from nor what to do.
    from plait.train import call_model

    batch = {**_clicks_batch(), "user_id": torch.arange(8)}
    with pytest.raises(ValueError, match=r"the batch's 'user_id' is not an argument of "
                                         r"DLRM.forward\(dense, big_idx, big_off, small_idx\)"
                                         r".*drop it from the batch"):
        call_model(DLRM(), batch, click_loss)
    del batch["user_id"]
    out, labels = call_model(DLRM(), batch, click_loss)
    assert out.shape == labels.shape == (8,)


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="notes: Python 3.11+")
def test_a_loss_given_the_models_dict_output_is_told_to_read_the_entry() -> None:
    from plait.train import call_model, model_loss

    out, labels = call_model(DLRM(dict_out=True), _clicks_batch(), click_loss)
    with pytest.raises(AttributeError) as err:
        model_loss(out, click_loss, labels)
    assert "plait: the model returned a dict (keys: logits), which loss_fn(output, targets) " \
           "receives as it is: read the entry there (output['logits'])" in err.value.__notes__


def test_plait_check_asks_for_a_collate_fn_where_items_do_not_stack(capsys) -> None:
    # The factory had no way to give one: default_collate failed on the bags of different
    # lengths with torch's "stack expects each tensor to be equal size" from the worker.
    from plait.cli import main

    code = main(["check", "--plan", "dp=2", "--model", "tests._newcomer_models:recommender",
                 "--steps", "1", "--timeout", "120"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "the dataset's items do not stack into a batch" in err, err
    assert "return (model, dataset, loss_fn, collate_fn)" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("plan, factory", [
    ("dp=2", "recommender_collated"), ("dp=2,grad_accum=2", "recommender_collated"),
    ("pp=2,microbatches=2,grad_accum=2", "bag_stack_collated")])
def test_plait_check_collates_each_ranks_rows_with_the_factorys_collate_fn(plan, factory,
                                                                           capsys) -> None:
    # A batch collated whole and sliced by rows would hand each rank offsets into the other
    # rank's ids: each rank collates its own items, as run.loader does, and under grad_accum
    # and pipeline microbatches each micro-batch its own (the check refused the batch there).
    from plait.cli import main

    code = main(["check", "--plan", plan, "--model", f"tests._newcomer_models:{factory}",
                 "--steps", "2", "--timeout", "120", "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, (out, err)
    assert json.loads(out)["ok"] is True, out


@pytest.mark.parametrize("factory", ["denoiser", "recommender_collated"])
def test_plait_plan_measures_a_model_whose_forward_takes_the_batch_by_name(factory, capsys
                                                                           ) -> None:
    # The planner called forward(sample_dict) with the dict as one argument: "UNet.forward()
    # missing 1 required positional argument: 't'". It calls it as run.step does (entries by
    # name, 'labels' held back), and a factory's collate_fn builds the recommender's batch.
    from plait.cli import main

    code = main(["plan", "--model", f"tests._newcomer_models:{factory}", "--cluster", "cpu",
                 "--devices", "2", "--global-batch", "16", "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["measured"]["forward_flops_per_sample"] > 0, report["measured"]
    assert report["measured"]["sample_from"] == "dataset"


def test_a_pipeline_is_not_cut_in_a_small_container_of_mixed_layers() -> None:
    # pp=2 cut the U-Net in its timestep MLP (temb, the largest nn.Sequential: Linear, SiLU,
    # Linear, 8% of the parameters) and the recommender in its bottom MLP (0.1%); the last
    # stage then ran the forward on temb.0's output as the image and failed in a convolution,
    # with a note blaming an output gathered from every block. Refused before any stage runs.
    from plait.parallel.pipeline_split import plan_stages

    with pytest.raises(ValueError, match=r"pp=2 would cut UNet at temb, .*3 modules of "
                                         r"different kinds \(Linear, SiLU\) and 1,344 of "
                                         r"UNet's 16,889 parameters \(8.0%\).*options.pp_blocks.*"
                                         r"dp_shard=N,zero=3"):
        plan_stages(UNet(), Plan(pp=2, microbatches=2))
    with pytest.raises(ValueError, match=r"would cut DLRM at bottom, .*\(0.1%\)"):
        plan_stages(DLRM(), Plan(pp=2, microbatches=2))


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="notes: Python 3.11+")
def test_a_stage_failing_in_a_small_named_container_says_how_little_it_holds() -> None:
    # Named by hand (options.pp_blocks), the container is cut as asked; a stage that then
    # fails gets a note saying how little of the model the blocks hold.
    from plait.parallel.pipeline_split import build_stage_module, plan_stages
    from plait.plan import PlanOptions

    model = UNet()
    plan = Plan(pp=2, microbatches=2, options=PlanOptions(pp_blocks="temb"))
    path, specs = plan_stages(model, plan)
    last = build_stage_module(model, path, specs[-1])
    with pytest.raises(RuntimeError) as info:
        last(torch.randn(2, 32), t=torch.tensor([1, 2]))
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert ("The blocks cut into stages are temb, which hold 1,344 of its 16,889 parameters "
            "(8.0%): if that is not UNet's sequence of blocks") in note, note
    assert "name the right one with options.pp_blocks" in note and "dp=N" in note, note


def test_plait_comm_measures_the_unet_and_the_recommender(capsys) -> None:
    # `plait comm --model` trains the factory's own model: the U-Net's convolutions and the
    # recommender's bags (its collate_fn building each rank's batch) under DDP, every row the
    # ledger's closed form exactly.
    from plait.cli import main

    for factory in ("denoiser", "recommender_collated"):
        spec = f"tests._newcomer_models:{factory}"
        assert main(["comm", "--plan", "dp=2", "--model", spec, "--steps", "1",
                     "--timeout", "180", "--format", "json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["model"] == spec
        assert [(r["axis"], r["op"], r["ratio"]) for r in data["rows"]] == \
            [("dp_replicate", "all_reduce", 1.0)], data["rows"]


def test_a_resumed_scheduler_whose_length_changed_is_told_the_saved_one_continues(tmp_path
                                                                                  ) -> None:
    # A cosine schedule sized by --steps: the first run saved T_max=2, the resumed one with
    # more steps built T_max=4, and torch's load_state_dict silently put T_max=2 back (the
    # learning rate then climbs again after step 2).
    from tests._newcomer_models import cosine_run

    root = str(tmp_path / "ckpt")
    assert not any("T_max" in w for w in run_distributed(cosine_run, 1, root, 2, 2,
                                                             timeout=120)[0])
    said = run_distributed(cosine_run, 1, root, 4, 4, timeout=120)[0]
    note = next((w for w in said if "T_max" in w), "")
    assert "holds CosineAnnealingLR with T_max=2, and the script passes T_max=4" in note, said
    assert "e.g. sched.T_max = 4" in note, note


def test_checkpointing_a_unet_takes_the_blocks_it_is_told():
    """The largest container of a U-Net is its timestep MLP (Linear, SiLU, Linear: 8% of the
    parameters); activation checkpointing wrapped its two Linears, saving next to nothing,
    silently. It is refused naming options.checkpoint_patterns, and with the patterns the
    residual blocks are wrapped (the outermost where patterns nest) and train as unwrapped:
    the same loss and gradients."""
    from plait.parallel.checkpointing import apply_activation_checkpointing

    with pytest.raises(ValueError, match=r"activation_checkpointing='full' would wrap temb, .*"
                                         r"\(Linear, SiLU\).*options.checkpoint_patterns"):
        apply_activation_checkpointing(UNet(), Plan(activation_checkpointing="full"))
    with pytest.raises(ValueError, match=r"options.checkpoint_patterns \['nope\.\*'\] match no"):
        apply_activation_checkpointing(UNet(), Plan(
            activation_checkpointing="full", options={"checkpoint_patterns": ["nope.*"]}))
    torch.manual_seed(0)
    plain = UNet()
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, Plan(activation_checkpointing="full", options={
        "checkpoint_patterns": ["d?", "mid", "u1", "d1.c1"]}))
    kinds = {n: type(m).__name__ for n, m in wrapped.named_children()}
    assert [n for n, k in kinds.items() if k == "CheckpointWrapper"] == ["d1", "d2", "mid", "u1"]
    batch = Noised(8)
    x, t = torch.stack([batch[i]["x"] for i in range(8)]), torch.stack([batch[i]["t"]
                                                                        for i in range(8)])
    losses = []
    for m in (plain, wrapped):
        loss = F.mse_loss(m(x, t), torch.zeros_like(x))
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    got = {canonical_name(n): p.grad for n, p in wrapped.named_parameters()}
    for n, p in plain.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=0, atol=0)


def test_checkpointing_a_hybrid_stack_under_a_wide_embedding():
    """Blocks of two kinds (as a hybrid of attention and state-space layers), each holding
    parameters, under an embedding that outweighs them: a stack all the same, checkpointed;
    only a container with a parameter-free layer between its layers (an MLP) is refused."""
    import torch.nn as nn

    from plait.parallel.checkpointing import checkpoint_units
    from plait.parallel.units import not_a_stack

    class Mixer(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.proj = nn.Linear(d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.proj(x)

    class Conv(Mixer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.proj(x.cumsum(1))

    class Hybrid(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5000, 8)
            self.layers = nn.ModuleList([Mixer(8), Conv(8), Mixer(8), Conv(8)])

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.emb(ids)
            for layer in self.layers:
                h = layer(h)
            return h

    model = Hybrid()
    assert [n for n, _ in checkpoint_units(model, Plan(activation_checkpointing="full"))] == [
        f"layers.{i}" for i in range(4)]
    mlp = nn.Sequential(nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 8))
    model.layers = nn.ModuleList([mlp])  # the largest container is now an MLP's Sequential
    blocks = [("layers.0.0", mlp[0]), ("layers.0.2", mlp[2])]
    assert not_a_stack(model, blocks) is not None
