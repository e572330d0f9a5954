"""Models other than transformers under ``plait check``, ``plait plan`` and plan="auto": a
ResNet-like CNN with BatchNorm and a strided residual downsample, LSTM and GRU language
models, an MLP-Mixer, a model taking a dict batch whole and returning a dict, a U-Net whose
skips cross blocks, and blocks in an nn.ModuleDict (tests/_any_models.py).

For each model and layout: the layout trains what one device trains (``plait.check``: every
step's loss, every parameter and every persistent buffer after a few AdamW steps), or plait
refuses it before the first optimizer step with a message naming the cause and the fix; and
the planner does not propose a layout the model then refuses. The default run holds the
cheap forms (pure checks, and a few world-2 checks); the whole grid is slow."""

from __future__ import annotations

import inspect

import pytest
import torch

from plait.check import CheckConfig, check, compare
from plait.dict_batch import whole_dict_parameter
from plait.plan import Plan
from plait.spawn import WorkerError
from tests import _any_models as A


def _check(model: str, plan: str | Plan, steps: int = 3):
    return check(plan, CheckConfig(model=model, steps=steps, batch_size=8,
                                   factory=f"tests._any_models:{model}"), timeout=240)


# ------------------------------------------------------------------------------------- pure
def test_a_forward_that_takes_the_dict_whole_is_told_from_one_taking_its_entries():
    keys = ["features", "mask", "labels"]

    def sig(f):
        return inspect.signature(f)

    assert whole_dict_parameter(sig(lambda batch: None), keys) == "batch"
    assert whole_dict_parameter(sig(lambda batch, scale=1.0: None), keys) == "batch"
    # the Hugging Face convention: the entries by keyword
    assert whole_dict_parameter(sig(lambda features, mask=None, labels=None: None), keys) is None
    assert whole_dict_parameter(sig(lambda features, **kw: None), keys) is None
    assert whole_dict_parameter(sig(lambda **kw: None), keys) is None
    assert whole_dict_parameter(sig(lambda a, b: None), keys) is None  # two required
    assert whole_dict_parameter(None, keys) is None


@pytest.mark.parametrize("factory,named", [
    (A.ResNet, "convolutions (stem.0, layers.0.conv1, layers.0.conv2, ...)"),
    (A.LSTMLM, "recurrent layers (rnn)"),
    (A.UNet, "convolutions (downs.0.conv.0, downs.1.conv.0, downs.2.conv.0, ...)"),
])
def test_tensor_parallelism_names_the_layers_it_leaves_whole(factory, named):
    """A ConvNet or an RNN has no MLP or attention block to split: the refusal names its
    convolutions or recurrent layers, says tp does not split them, and gives data
    parallelism as the way to train it."""
    from plait.parallel.tp_infer import infer_plan

    with pytest.raises(ValueError) as info:
        infer_plan(factory())
    message = str(info.value)
    assert f"its {named} are not split over tp" in message, message
    assert "dp=N or dp_shard=N,zero=3" in message, message


class Normed(torch.nn.Module):
    """Linear blocks the planner prices, then a BatchNorm."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*(torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
            for _ in range(4)))
        self.bn = torch.nn.BatchNorm1d(16)

    def forward(self, x):
        return self.bn(self.blocks(x))


def test_the_planner_syncs_batchnorm_and_keeps_each_steps_batch_whole():
    """Every layout the planner ranks for a model with BatchNorm has sync_bn where it has
    data parallelism, no pipeline and no gradient accumulation (each would normalise the
    batch piece by piece), even where the batch per rank (32) exceeds the microbatch the
    search otherwise stops at (16); pipelines are counted as refused, with the reason."""
    from plait.planner import plan_model

    result = plan_model(Normed(), "cpu", world_size=4, global_batch=128, seq=4)
    assert result.ranked
    for est in result.ranked:
        plan = est.plan
        assert plan.pp == 1 and plan.grad_accum == 1, plan
        assert plan.sync_bn == (plan.dp > 1), plan
    assert any(k.startswith("BatchNorm normalises each pipeline microbatch")
               for k in result.rejected), result.rejected


def test_plan_auto_takes_batchnorm_statistics_over_the_data_axes():
    """plan="auto" for a CNN with BatchNorm: data parallelism with sync_bn (per-rank
    statistics would train another model), for a model the planner prices and one it
    cannot (the ResNet's convolutions)."""
    from plait.auto import AutoRequest, choose

    plan, why = choose(A.ResNet(), AutoRequest(world_size=2, device_type="cpu"))
    assert plan.sync_bn and plan.dp == 2, (plan, why)  # DDP or ZeRO: within 0.3% here

    plan, why = choose(Normed(), AutoRequest(world_size=2, device_type="cpu",
                                             global_batch=8, seq=4))
    assert plan.sync_bn and plan.pp == 1 and plan.grad_accum == 1, (plan, why)


def test_the_planner_refuses_what_the_model_refuses():
    """Asked by the planner: a pipeline or gradient accumulation for a model with BatchNorm
    (each piece of the batch normalised on its own), and a pipeline for a forward that takes
    the dict batch whole; data parallelism stays."""
    from plait.auto import layout_check

    bn = layout_check(A.ResNet())
    assert "normalise each of the 2 pieces" in bn(Plan(pp=2, microbatches=2))
    assert "normalise each of the 2 pieces" in bn(Plan(dp_replicate=2, grad_accum=2))
    assert bn(Plan(dp_replicate=2, sync_bn=True)) is None
    whole = layout_check(A.DictModel(), dict_keys=["features", "mask", "labels"])
    refused = whole(Plan(pp=2, microbatches=2))
    assert "takes the whole dict batch as one argument (batch)" in refused, refused
    assert whole(Plan(dp_replicate=2)) is None


def test_the_planner_prices_blocks_kept_in_a_module_dict():
    """Blocks in an nn.ModuleDict are a stack the pipeline splits in order: the planner
    prices them too (it used to find no stack and leave the model to be laid out by hand)."""
    from plait.planner.model_stats import from_module

    stats = from_module(A.Routed())
    assert stats.n_layers == 4
    assert stats.block_params == sum(p.numel() for p in A.Routed().blocks["first"].parameters())


def test_plan_for_a_dict_model_leaves_out_pipelines(capsys):
    from plait.cli import main

    code = main(["plan", "--model", "tests._any_models:dict_io", "--cluster", "cpu",
                 "--devices", "4", "--global-batch", "8", "--top", "20", "--format", "json"])
    import json

    out = json.loads(capsys.readouterr().out)
    assert code == 0
    plans = [Plan.from_dict(p["layout"]) for p in out["plans"]]
    assert plans and all(p.pp == 1 for p in plans), out["plans"]
    assert any("takes the whole dict batch" in k for k in out["rejected"]), out["rejected"]


def test_check_compares_buffers():
    """A layout whose parameters match one device's but whose BatchNorm running statistics
    or step count do not FAILs, naming the buffer."""
    plan = Plan(dp_replicate=2)
    w = torch.ones(3)
    ref = {"losses": [1.0], "state": {"w": w + 1}, "initial": {"w": w},
           "buffers": {"bn.running_mean": torch.tensor([0.5, 0.5]),
                       "bn.num_batches_tracked": torch.tensor(3)},
           "initial_buffers": {"bn.running_mean": torch.zeros(2)}}
    same = {**ref}
    assert compare(plan, ref, same, 1, None).ok
    moved = {**ref, "buffers": {**ref["buffers"], "bn.running_mean": torch.tensor([0.5, 0.4])}}
    result = compare(plan, ref, moved, 1, None)
    assert not result.ok and result.worst_buffer == "bn.running_mean", result
    counted = {**ref, "buffers": {**ref["buffers"], "bn.num_batches_tracked": torch.tensor(6)}}
    result = compare(plan, ref, counted, 1, None)
    assert not result.ok and result.buffers_differ == ["bn.num_batches_tracked (6 != 3)"]
    assert "bn.num_batches_tracked (6 != 3)" in result.format()


# ------------------------------------------------------------------------- world 2, cheap
def test_a_dict_in_dict_out_model_trains_as_one_device_and_a_pipeline_refuses_it():
    """``forward(self, batch)`` reading a dict and returning {"loss", "logits"}: under dp=2 the
    loss (a mean over the labels that are not -100, counted over the global batch) and every
    parameter match one device; a pipeline refuses the forward by name when it lays out the
    first step's batch (the slow grid runs it under pp=2)."""
    from plait.parallel.pipeline import stage_inputs

    result = _check("dict_io", "dp=2", steps=2)
    assert result.ok, result.format()
    batch = {"features": torch.zeros(2, 6, 10), "mask": torch.ones(2, 6),
             "labels": torch.zeros(2, 6, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"DictModel.forward takes the whole dict batch as one "
                                         r"argument \(batch\).*or run with pp=1"):
        stage_inputs(batch, None, inspect.signature(A.DictModel().forward), "DictModel")


def test_a_resnet_with_batchnorm_needs_sync_bn_and_then_matches_with_its_buffers():
    """BatchNorm under dp=2: without sync_bn the FAIL says why and gives the plan with it;
    with sync_bn the loss, the parameters and the running statistics match one device."""
    bad = _check("resnet", "dp=2", steps=2)
    assert not bad.ok and "add sync_bn to the plan ('dp_replicate=2,sync_bn=true')" in bad.hint, \
        bad.format()
    good = _check("resnet", "dp=2,sync_bn", steps=2)
    assert good.ok and good.worst_buffer.startswith(("stem", "layers")), good.format()


def test_an_lstm_before_the_blocks_under_a_pipeline():
    """An LSTM, then MLP blocks: under pp=2 the stage without the LSTM stands in for it with a
    pair, as ``h, _ = self.rnn(x)`` unpacks (it stood in with the bare hidden states: "too
    many values to unpack"), and trains as one device."""
    result = _check("lstm_mlp", "pp=2", steps=2)
    assert result.ok, result.format()


# ------------------------------------------------------------------------------ the grid
# (model, plan) -> what happens: "ok" (trains as one device) or a fragment of the refusal.
GRID = {
    ("resnet", "dp_shard=2,zero=3,sync_bn"): "ok",
    ("resnet", "tp=2"): "its convolutions (stem.0",
    ("resnet", "pp=2,sync_bn"): "normalise each of the 2 pieces",  # a FAIL, its hint
    ("resnet", "pp=2,microbatches=1,pp_schedule=gpipe"): "ok",
    ("lstm_lm", "dp=2"): "ok",
    ("lstm_lm", "dp_shard=2,zero=3"): "ok",
    ("lstm_lm", "tp=2"): "its recurrent layers (rnn)",
    ("lstm_lm", "pp=2"): "has no nn.ModuleList, nn.Sequential or nn.ModuleDict of blocks",
    ("lstm_mlp", "dp=2"): "ok",
    ("lstm_mlp", "tp=2"): "ok",  # the blocks split, the LSTM whole on every rank
    ("lstm_mlp", "pp=2,dp=2"): "ok",
    ("lstm_mlp", "pp=2,dp=2,pp_schedule=interleaved_1f1b,virtual_stages=2"): "ok",
    ("gru_packed", "dp=2"): "ok",
    ("gru_packed", "dp_shard=2,zero=3"): "ok",
    ("mixer", "dp=2"): "ok",
    ("mixer", "dp_shard=2,zero=3"): "ok",
    ("mixer", "tp=2"): "ok",
    ("mixer", "pp=2"): "ok",
    ("dict_io", "dp_shard=2,zero=3"): "ok",
    ("dict_io", "pp=2"): "takes the whole dict batch as one argument (batch)",
    ("unet", "dp=2"): "ok",
    ("unet", "dp_shard=2,zero=3"): "ok",
    ("unet", "tp=2"): "its convolutions (downs.0.conv.0",
    ("unet", "pp=2"): "a skip connection across the blocks of ups",  # before any process
    ("module_dict", "dp=2"): "ok",
    ("module_dict", "dp_shard=2,zero=3"): "ok",
    ("module_dict", "tp=2"): "ok",
    ("module_dict", "pp=2"): "ok",
}


@pytest.mark.slow
@pytest.mark.parametrize("model,plan", list(GRID))
def test_every_model_under_every_layout_trains_as_one_device_or_is_refused(model, plan):
    want = GRID[model, plan]
    try:
        result = _check(model, plan)
    except (WorkerError, ValueError) as exc:  # ValueError: refused before any process starts
        assert want != "ok" and want in str(exc), str(exc)[-2000:]
        return
    if want == "ok":
        assert result.ok, result.format()
    else:
        assert not result.ok and want in result.hint, result.format()


@pytest.mark.slow
@pytest.mark.parametrize("model,extra", [("mixer", ["--seq", "16"]), ("module_dict", []),
                                         ("lstm_mlp", [])])
def test_the_planners_first_choices_train_as_one_device(model, extra, capsys):
    """The best pipelined layout ``plait plan`` ranks for a model it prices (pp=2 x dp=2 on
    four ranks) trains what one device trains."""
    import json

    from plait.cli import main

    assert main(["plan", "--model", f"tests._any_models:{model}", "--cluster", "cpu",
                 "--devices", "4", "--global-batch", "8", "--top", "10", "--format", "json",
                 *extra]) == 0
    plans = [Plan.from_dict(p["layout"]) for p in json.loads(capsys.readouterr().out)["plans"]]
    piped = next(p for p in plans if p.pp > 1)
    result = _check(model, piped.replace(mixed_precision="fp32"))
    assert result.ok, result.format()


def ledger_worker(rank: int, world_size: int, plans: list[str], name: str) -> list[dict]:
    """Train factory ``name`` 2 warm-up and 2 counted steps under each plan with the ledger
    on; each run's ``summary()["comm"]``."""
    from torch.utils.data import default_collate

    from plait.runtime import init

    out = []
    for plan in plans:
        model, data, loss_fn = getattr(A, name)()
        run = init(plan, quiet=True, ledger=True, seed=0)
        run.ledger_warmup = 2  # DDP rebuilds its buckets (a broadcast) in the second step
        try:
            model = run.parallelize(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(4):
                rows = default_collate([data[step * 8 + i] for i in range(8)])
                mine = [t[run.dp_rank * 4:(run.dp_rank + 1) * 4] for t in rows]
                run.step(model, mine, loss_fn, opt)
            out.append(run.summary()["comm"])
        finally:
            run.close()
    return out


def test_the_ledger_predicts_sync_bn_statistics():
    """Under sync_bn on the CPU plait all-reduces each BatchNorm's statistics over the data
    axes, two fp32 all-reduces in forward and two in backward per layer: the ledger's
    expected column counts them, and every row of the ResNet matches it exactly under DDP and
    ZeRO-3 (it was 1.045 and 16.6 on the all-reduce rows)."""
    from plait.spawn import run_distributed

    plans = ["dp=2,sync_bn", "dp_shard=2,zero=3,sync_bn"]
    for comm in run_distributed(ledger_worker, 2, plans, "resnet", timeout=240)[0]:
        assert comm["rows"], comm
        for row in comm["rows"]:
            assert row["ratio"] == pytest.approx(1.0, abs=1e-12), row
            # and the calls: 4 per layer beside DDP's buckets, one buffer broadcast per dtype
            assert row["count"] == row["expected_calls"], row
