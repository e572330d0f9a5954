"""A torchvision-style object detector and a graph network on PyG-style mini-batches, taken
through what a newcomer tries (``tests/_newcomer2_models.py``): what trains matches one device
running the same AdamW steps with torch alone, and what cannot run says why and what to do."""

from __future__ import annotations

import json

import pytest
import torch

from plait.batch_rows import MicroBatches
from plait.spawn import run_distributed
from plait.train import model_loss, split_microbatches
from tests._newcomer2_models import (
    GraphNet,
    Molecules,
    Shapes,
    TinyDetector,
    collate_detection,
    collate_graphs,
    reference,
    train,
)
from tests.test_newcomer_models import _assert_trains_as_one_device


def test_a_detectors_dict_of_losses_is_its_loss() -> None:
    # With loss_fn=None plait read output.loss only, and refused the dict torchvision's
    # detectors return in training mode ("dict has none: pass a loss_fn"), where a loss_fn
    # could not help: a dict batch with one holds its 'labels' back from the model, which
    # needs its targets to match boxes. The losses are summed, as torchvision's loop does.
    torch.manual_seed(0)
    model, data = TinyDetector(), Shapes(4)
    out = model(**collate_detection([data[i] for i in range(4)]))
    assert set(out) == {"loss_classifier", "loss_box_reg"}
    loss = model_loss(out, None, None)
    assert loss.requires_grad
    torch.testing.assert_close(loss, out["loss_classifier"] + out["loss_box_reg"])
    with pytest.raises(ValueError, match=r"it returned a dict \(keys: logits, aux\) without"):
        model_loss({"logits": torch.zeros(2, 3), "aux": torch.ones(())}, None, None)


def test_run_evaluate_of_a_detector_says_its_losses_come_in_training_mode_only() -> None:
    # In eval mode (run.evaluate runs the model so) the detector returns its detections, and
    # the refusal said only "list has none: pass a loss_fn".
    model, data = TinyDetector().eval(), Shapes(2)
    out = model(**collate_detection([data[0], data[1]]))
    with pytest.raises(ValueError) as err:
        model_loss(out, None, None)
    said = str(err.value)
    assert "a list of 2 dicts (keys: boxes, scores, labels), one per example" in said, said
    assert "run.evaluate runs the model so" in said and "training mode only (run.step)" in said
    assert "under model.eval() and torch.no_grad(), model(images)" in said, said


def test_a_list_of_one_dict_per_image_is_cut_by_image() -> None:
    # Every tensor of a replica's batch of four four-box images has four rows, so the batch
    # looked like one row per example and grad_accum=2 cut it by rows: each image's boxes
    # were halved, and each micro-batch of two images got all four targets (the model's zip
    # then dropped two), silently. The list is cut by position, each dict whole.
    data = Shapes(4, per_image=4)
    batch = collate_detection([data[i] for i in range(4)])
    parts = split_microbatches(batch, 2)
    for k, part in enumerate(parts):
        torch.testing.assert_close(part["images"], batch["images"][2 * k:2 * k + 2])
        assert len(part["targets"]) == 2
        for got, want in zip(part["targets"], batch["targets"][2 * k:2 * k + 2], strict=True):
            assert got["boxes"] is want["boxes"] and got["labels"] is want["labels"]
    # At the top level a pair of dicts is (inputs, targets), still cut by rows.
    pair = ({"x": torch.arange(4)}, {"y": torch.arange(4)})
    assert [p[1]["y"].tolist() for p in split_microbatches(pair, 2)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"\['targets'\] holds 3 examples, which do not split "
                                         r"into 2"):
        split_microbatches({"targets": batch["targets"][:3], "images": batch["images"][:3]},
                           2)


def test_example_takes_the_batch_the_loader_hands_out_under_grad_accum() -> None:
    # The docs' run.parallelize(model, example=loader.batch(0)) was refused under grad_accum
    # for a batch of graphs ("example=MicroBatches: an example is one batch as run.step takes
    # it"): the loader hands such a batch as micro-batches collated one by one.
    from plait.parallel.tp_example import from_batch

    data = Molecules(4)
    parts = (collate_graphs([data[0], data[1]]), collate_graphs([data[2], data[3]]))
    example = from_batch(GraphNet(), MicroBatches(parts))
    assert example.args == () and set(example.kwargs) == {"x", "edge_index", "batch"}
    assert example.kwargs["x"] is parts[0]["x"]


def test_a_detector_trains_as_one_device_under_dp_and_grad_accum() -> None:
    # Four four-box images per replica: cut by rows before (see above), the losses and the
    # parameters parted from one device's at the first step (0.056 after three).
    want = reference("detector_four_boxes")
    got = run_distributed(train, 2, "detector_four_boxes", "dp=2,grad_accum=2",
                          timeout=120)[0]
    _assert_trains_as_one_device(got, {**want, "evaluated": []})


def test_a_graph_network_trains_as_one_device_under_dp_and_grad_accum() -> None:
    # Rows are nodes, the targets one per graph: each replica collates its own graphs (edge
    # indices offset from its first node, its own batch vector), each micro-batch its own,
    # and the mean over graphs is one device's; run.evaluate too.
    want = reference("graph_net", evaluate=True)
    got = run_distributed(train, 2, "graph_net", "dp=2,grad_accum=2", True, timeout=120)[0]
    _assert_trains_as_one_device(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["detector", "graph_net"])
@pytest.mark.parametrize("world, plan", [(1, ""), (1, "grad_accum=2"), (2, "dp=2"),
                                         (2, "dp_shard=2,zero=1"), (2, "dp_shard=2,zero=2"),
                                         (2, "fsdp=2")])
def test_both_train_as_one_device_under_every_data_parallel_layout(name, world, plan) -> None:
    want = reference(name)
    got = run_distributed(train, world, name, plan, timeout=120)[0]
    _assert_trains_as_one_device(got, want)


@pytest.mark.slow
def test_a_pipeline_of_graph_batches_says_the_rows_are_nodes_of_other_counts() -> None:
    # Each microbatch of graphs holds another number of nodes; the refusal said "give each
    # part as many rows", which a batch of graphs cannot do as it stands.
    with pytest.raises(Exception) as err:
        run_distributed(train, 2, "graph_net", "pp=2,microbatches=2", timeout=120)
    said = str(err.value)
    assert "rows in GraphNet.forward's first input 'x', which the stages chain" in said, said
    assert "(a batch of graphs, whose rows are nodes), pad each part" in said, said
    assert "train without pp (dp=N, or dp_shard=N,zero=3 for memory)" in said, said


@pytest.mark.slow
@pytest.mark.parametrize("factory", ["detector", "graph_net"])
def test_plait_check_passes_both_under_dp_and_grad_accum(factory, capsys) -> None:
    from plait.cli import main

    code = main(["check", "--plan", "dp=2,grad_accum=2", "--model",
                 f"tests._newcomer2_models:{factory}", "--steps", "2", "--timeout", "120",
                 "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, (out, err)
    assert json.loads(out)["ok"] is True, out


def test_a_pipeline_refuses_a_list_of_one_dict_per_image_by_name() -> None:
    # pp=2 cut the detector in its backbone, and the step then asked to "rename 'targets' to
    # 'labels'", which would hold the targets back from the model that matches them; torch's
    # schedule hands a list whole to every microbatch.
    import inspect

    from plait.parallel.pipeline import stage_inputs

    data = Shapes(2)
    batch = collate_detection([data[0], data[1]])
    signature = inspect.signature(TinyDetector().forward)
    for given, where in ((batch, "'targets'"), ((batch["images"], batch["targets"]), "[1]"),
                         (({"images": batch["images"], "targets": batch["targets"]},
                           batch["targets"]), "[0]['targets']")):
        with pytest.raises(ValueError) as err:
            stage_inputs(given, None, signature, "TinyDetector")
        assert (f"batch entry {where} is a list of one dict per example (a detector's "
                f"targets), which torch's pipeline schedule does not cut") in str(err.value)
        assert "train TinyDetector without pp (dp=N, or dp_shard=N,zero=3" in str(err.value)


def test_tp_on_a_graph_network_says_why_its_forward_could_not_be_recorded() -> None:
    # tp=2 said the forward "does not run on the example given" and not why: it reads the
    # number of graphs from the batch vector (int(batch.max()) + 1, as PyG's pooling does),
    # which the fake tensors the recording runs on do not hold.
    from plait.parallel.tp_example import from_batch
    from plait.parallel.tp_infer import infer_plan

    data, model = Molecules(4), GraphNet()
    with pytest.raises(ValueError) as err:
        infer_plan(model, from_batch(model, collate_graphs([data[i] for i in range(4)])))
    said = str(err.value)
    assert ("nor does the model's forward run on the example given to record it instead (it "
            "raised DataDependentOutputException: aten._local_scalar_dense.default; the "
            "recording runs on fake tensors, which hold shapes and no values, so a forward "
            "that reads one (int(batch.max()), .item()) cannot run there)") in said, said
    assert "no linear gathers their output" in said, said


def test_plait_plan_leaves_out_a_pipeline_for_batches_of_graphs(capsys) -> None:
    # plait plan ranked pp=2 (1f1b and zbv) for the graph network, whose step then refuses
    # microbatches of other node counts: the planner now asks the data, one item collated
    # alone, and says why the pipelines are left out.
    from plait.cli import main

    assert main(["plan", "--model", "tests._newcomer2_models:graph_net", "--cluster", "cpu",
                 "--devices", "2", "--global-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "pp=2" not in out.split("left out")[0], out
    assert ("refused by the model (one item of its dataset collates to 5, 7, 4, 5, 3, 6, 4, 6 "
            "rows in GraphNet.forward's first input 'x' (rows that are not examples, as a "
            "graph's nodes)") in out, out
    assert "dp_replicate=2" in out
