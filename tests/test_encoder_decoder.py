"""Encoder-decoder (T5, BART) and two-tower contrastive (CLIP) models: each layout trains what
one device trains, or plait refuses it before training, naming the cause and the fix.

The default run: the contrastive guard on its own (no process group), and a two-tower model
written for the test with CLIP's ``logit_scale`` under dp=2: its loss over ``run.all_gather``
matches one device, a loss over each replica's rows alone is refused at the first step. The
grid over Hugging Face models built from configs is ``slow``: ``plait check`` (AdamW, 3 steps,
losses and every parameter) under each layout."""

from __future__ import annotations

import json

import pytest
import torch

from plait.cli import main
from plait.loss import _loss_key
from plait.parallel.contrastive import contrastive_parameters, guard_loss
from plait.parallel.pipeline_hf import bias_holder, other_block_stacks
from plait.parallel.tp_infer import infer_plan
from plait.parallel.zero import apply_fsdp
from plait.plan import Plan
from plait.spawn import WorkerError, run_distributed
from tests import _workers_beyond as B
from tests import _workers_encdec as E
from tests.test_models_beyond import _assert_matches


def test_the_guard_refuses_a_contrastive_loss_that_does_not_gather():
    """Under dp=2 a model with a ``logit_scale`` refuses its own loss (loss_fn=None) up front
    and a loss function that returns without ``run.all_gather``; one that gathers, dp=1, and
    a model without a temperature pass as they are."""
    model, calls = E.scaled_two_tower(), [0]
    assert contrastive_parameters(model) == ["logit_scale"]
    local = E.scaled_nce(B.no_gather)
    out = model(**B.pair_batch(0)[0])
    found = contrastive_parameters(model)
    assert guard_loss(model, local, 1, lambda: calls[0], found) is local
    other = B.two_tower()
    assert guard_loss(other, local, 2, lambda: calls[0], contrastive_parameters(other)) is local
    with pytest.raises(ValueError, match=r"ScaledTwoTower has logit_scale.*loss_fn=None.*"
                                         r"run.all_gather"):
        guard_loss(model, None, 2, lambda: calls[0], found)
    with pytest.raises(ValueError, match=r"1/2 of the global batch.*returned without calling "
                                         r"run.all_gather"):
        guard_loss(model, local, 2, lambda: calls[0], found)(out, None)

    def counted(t, return_index=False):
        calls[0] += 1
        return B.no_gather(t, return_index)

    gathering = E.scaled_nce(counted)
    guarded = guard_loss(model, gathering, 2, lambda: calls[0], found)
    assert torch.equal(guarded(out, None), E.scaled_nce(B.no_gather)(out, None))
    # answers kept per loss (the label-shift verdict) stay keyed on the user's loss, though
    # each step wraps it anew
    assert _loss_key(guarded) == _loss_key(gathering) == _loss_key(
        guard_loss(model, gathering, 2, lambda: calls[0], found))


def test_a_two_tower_model_with_logit_scale_under_dp_gathers_or_is_refused():
    """dp=2: the loss over ``run.all_gather`` trains what one device trains (logit_scale
    included); the same loss over each replica's rows alone is refused at the first step (it
    would train another model: fewer negatives per row)."""
    batches = [B.pair_batch(s) for s in range(3)]
    ref = B.reference(E.scaled_two_tower, batches, E.scaled_nce(B.no_gather))
    gathered = run_distributed(E.train_contrastive, 2, "dp=2", True, timeout=180)[0]
    _assert_matches(ref, gathered)
    refused = run_distributed(E.train_contrastive, 2, "dp=2", False, timeout=180)[0]
    # named as the user's model holds it, not as DDP's wrapper does (module.logit_scale)
    assert refused["refused"].startswith("ScaledTwoTower has logit_scale: "), refused
    assert "returned without calling run.all_gather" in refused["refused"], refused


def test_run_evaluate_of_a_two_tower_model_under_dp_is_one_devices_or_refused():
    """dp=2 after 3 steps: ``run.evaluate`` with the loss over ``run.all_gather`` gives the
    held-out loss one device computes on the whole batch (on both ranks); the loss over each
    replica's rows alone, and the model's own output (loss_fn=None), are refused as in a
    step, naming the parameter and run.all_gather (the mean of the replicas' losses over
    their own rows, which evaluate returned, was another number)."""
    batches = [B.pair_batch(s) for s in range(3)]
    loss = E.scaled_nce(B.no_gather)
    ref = B.reference(E.scaled_two_tower, batches, loss)
    model = E.scaled_two_tower()
    model.load_state_dict(ref["state"])
    inputs, targets = B.pair_batch(E.HELD_OUT)
    with torch.no_grad():
        want = float(loss(model(**inputs), targets))
    for got in run_distributed(E.evaluate_contrastive, 2, "dp=2", timeout=180):
        assert abs(got["gathered"] - want) <= 1e-6 * abs(want), (got, want)
        assert isinstance(got["own"], str) and got["own"].startswith(
            "ScaledTwoTower has logit_scale: "), got
        assert "returned without calling run.all_gather" in got["own"], got
        assert isinstance(got["none"], str) and "its own output.loss (loss_fn=None)" in \
            got["none"], got


def _stacked(plans: dict[str, tuple[int, int] | None], world: int) -> None:
    """Each plan: trains :func:`E.stacked_reference` (data ranks, microbatches per step), or
    (None) is refused before training, naming the zero-bubble schedule and the way out."""
    for got in run_distributed(E.train_stacked, world, list(plans), timeout=300)[0]:
        want = plans[got["plan"]]
        if want is None:
            assert "cannot train StackedTwoTower's logit_scale" in got.get("refused", ""), got
            assert "use pp_schedule='1f1b'" in got["refused"], got
            continue
        assert "refused" not in got, got
        _assert_matches(E.stacked_reference(*want), got)


def test_a_two_tower_model_with_logit_scale_under_a_pipeline():
    """pp=2 on a two-tower model written for the test (the image tower's blocks split, the
    text tower and logit_scale on the last stage), the loss over run.all_gather: 1F1B trains
    what one device accumulating over the microbatches trains. ZB-V is refused before
    training: torch's split backward freed the last stage's output ``logit_scale.exp()`` under
    its weight step ("Trying to use a saved tensor that has been detached in-place")."""
    _stacked({"pp=2,mb=2": (1, 2), "pp=2,schedule=zbv,v=2,mb=2": None}, 2)


def test_a_tower_run_before_the_blocks_but_placed_on_the_last_stage_is_explained():
    """The text tower runs before the image blocks but is registered after them (placed on the
    last stage): stage 0's stand-in passes the token ids on and the forward fails on them. The
    error names the tower, why it is on the last stage, and the fix."""
    with pytest.raises(WorkerError) as err:
        run_distributed(E.text_first_step, 2, "pp=2,mb=2", timeout=180)
    msg = str(err.value)
    assert "TextFirstTwoTower's forward calls `text` before the blocks in `blocks`" in msg, msg
    assert "registered after `blocks`" in msg and "Fix: call it after the blocks" in msg, msg


@pytest.mark.slow
def test_a_two_tower_model_with_logit_scale_under_dp_and_a_pipeline_world_4():
    """dp=2,pp=2: the loss gathers over the last stage's data replicas; one microbatch per
    step (gpipe) trains one device's whole-batch model, two (1F1B) one device accumulating
    over chunk j of every replica's rows; ZB-V is refused before training."""
    _stacked({"dp=2,pp=2,mb=1,schedule=gpipe": (1, 1), "dp=2,pp=2,mb=2": (2, 2),
              "dp=2,pp=2,schedule=zbv,v=2,mb=2": None}, 4)


def test_a_second_tower_is_found_beside_the_stack_a_pipeline_cuts():
    """Two towers (CLIP's text and vision encoders): the pipeline's stack and the other one;
    lists inside a block (a mixture of experts) and lists of mixed modules are not stacks."""
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    class Tower(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(Block() for _ in range(2))
            self.mixed = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)])

    two, one = torch.nn.Module(), torch.nn.Module()
    two.text, two.vision, one.text = Tower(), Tower(), Tower()
    assert other_block_stacks(two, "text.layers") == ["vision.layers"]
    assert other_block_stacks(two, "vision.layers") == ["text.layers"]
    assert other_block_stacks(one, "text.layers") == []


def test_a_relative_bias_computed_in_one_block_is_found():
    """T5's shape: only block 0's attention has ``has_relative_attention_bias`` (the others
    read what it computed); a stack where every block computes its own has no holder."""
    class Attention(torch.nn.Module):
        def __init__(self, bias: bool) -> None:
            super().__init__()
            self.has_relative_attention_bias = bias

    def stack(*flags: bool) -> torch.nn.Module:
        m = torch.nn.Module()
        m.block = torch.nn.ModuleList(torch.nn.Sequential(Attention(f)) for f in flags)
        return m

    assert bias_holder(stack(True, False, False), "block") == "block.0.0"
    assert bias_holder(stack(True, True), "block") == ""
    assert bias_holder(stack(False, False), "block") == ""


def test_zero_2_and_3_refuse_a_0_dim_parameter_by_name():
    """fully_shard cannot shard a 0-dim parameter (CLIP's logit_scale): refused before any
    unit is sharded (no mesh is read), naming it and zero=1."""
    for zero in (2, 3):
        with pytest.raises(ValueError, match=r"logit_scale has none \(a 0-dim parameter.*"
                                             r"use zero=1"):
            apply_fsdp(E.scaled_two_tower(), None, Plan.load(f"dp_shard=2,zero={zero}"))


@pytest.mark.slow
def test_a_two_tower_model_gathers_under_zero_1_and_zero_3_is_refused():
    batches = [B.pair_batch(s) for s in range(3)]
    ref = B.reference(E.scaled_two_tower, batches, E.scaled_nce(B.no_gather))
    _assert_matches(ref, run_distributed(E.train_contrastive, 2, "dp_shard=2,zero=1", True,
                                         timeout=180)[0])
    refused = run_distributed(E.train_contrastive, 2, "dp_shard=2,zero=3", True,
                              timeout=180)[0]
    assert "logit_scale has none (a 0-dim parameter" in refused["refused"], refused


class CrossAttention(torch.nn.Module):
    """Queries from the block input, keys and values from the encoder's output (``memory``)."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.num_heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.num_heads, -1).transpose(1, 2)
        k = self.k(memory).view(b, memory.shape[1], self.num_heads, -1).transpose(1, 2)
        v = self.v(memory).view(b, memory.shape[1], self.num_heads, -1).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class LeakyCrossAttention(CrossAttention):
    """Cross-attention whose key projection also reaches the block output beside ``o``: split
    column-wise, that sum would mix a rank's share of k into a whole tensor."""

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.num_heads, -1).transpose(1, 2)
        key = self.k(memory)
        k = key.view(b, memory.shape[1], self.num_heads, -1).transpose(1, 2)
        v = self.v(memory).view(b, memory.shape[1], self.num_heads, -1).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(out.transpose(1, 2).reshape(b, t, -1)) + key.mean(1, keepdim=True)


class Seq2SeqLM(torch.nn.Module):
    """Token embedding, one cross-attention over an encoded memory, a head tied to nothing;
    with ``logits_bias``, a vector added to the logits on the model (BART's
    ``final_logits_bias``)."""

    def __init__(self, logits_bias: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.cross = CrossAttention()
        self.head = torch.nn.Linear(8, 20)
        if logits_bias:
            self.register_buffer("final_logits_bias", torch.zeros(1, 20))

    def forward(self, ids: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.cross(self.embed(ids), memory))
        bias = getattr(self, "final_logits_bias", None)
        return logits if bias is None else logits + bias


def test_cross_attention_is_one_tensor_parallel_region_and_a_logits_bias_keeps_the_head():
    """k and v reading the encoder's output beside q reading the block input are one region
    (colwise q, k, v; rowwise o; heads divided; the 'region' style on the block, whose
    boundary replicates its first input only), in a block that names its head count (one
    without is refused: tests/test_tensor_parallel.py);
    k reaching the block output beside o is refused; a vocabulary-sized vector the model adds
    to the logits keeps the head whole."""
    plan = infer_plan(Seq2SeqLM(logits_bias=False))
    assert {k: plan.styles[k] for k in ("cross.q", "cross.k", "cross.v", "cross.o")} == {
        "cross.q": "colwise", "cross.k": "colwise", "cross.v": "colwise", "cross.o": "rowwise"}
    assert plan.styles["cross"] == "region" and plan.divide_attrs == {"cross": ("num_heads",)}
    assert plan.styles["head"] == "vocab_head" and plan.styles["embed"] == "vocab_embedding"
    biased = infer_plan(Seq2SeqLM(logits_bias=True))
    assert "head" not in biased.styles and "embed" not in biased.styles, biased.styles
    leaky = Seq2SeqLM(logits_bias=False)
    leaky.cross = LeakyCrossAttention()
    with pytest.raises(ValueError, match=r"cross \(LeakyCrossAttention\): linear\(s\) \['k', "
                                         r"'v'\] feed the output linear o from another input"):
        infer_plan(leaky)


def _check(capsys, model: str, plan: str) -> tuple[int, str]:
    code = main(["check", "--model", f"tests._workers_encdec:{model}", "--plan", plan,
                 "--steps", "3", "--format", "json"])
    return code, capsys.readouterr()


@pytest.mark.slow
@pytest.mark.parametrize("model,plan", [
    ("t5", "dp=2"), ("t5", "dp_shard=2,zero=3"), ("bart", "dp=2"), ("bart", "dp_shard=2,zero=3"),
    ("bart", "tp=2"),  # the plan inferred: cross-attention a region, the head whole
    # inferred from a recorded forward (fx cannot trace T5Attention or CLIPAttention): block
    # 0's relative_attention_bias split by head; CLIP's projections whole
    ("t5", "tp=2"), ("t5_gated", "tp=2"), ("t5_encoder", "tp=2,sp"), ("clip", "tp=2"),
    # the sequence split in each stack: the encoder's 8 positions, the decoder's 6
    ("t5", "tp=2,sp"), ("bart", "tp=2,sp"),
])
def test_encoder_decoders_train_as_one_device(capsys, model, plan):
    code, out = _check(capsys, model, plan)
    result = json.loads(out.out)
    assert code == 0 and result["ok"], result


@pytest.mark.slow
@pytest.mark.parametrize("model,plan,says", [
    (m, p, "is an encoder-decoder model: plait's pipeline cuts one stack of blocks")
    for m in ("t5", "bart") for p in ("pp=2", "pp=2,tp=2")])
def test_encoder_decoders_are_refused_where_a_layout_cannot_split_them(capsys, model, plan,
                                                                       says):
    code, out = _check(capsys, model, plan)
    assert code == 2 and says in out.err, out


# T5's layer plan by hand, as a user passes one: q, k, v column-parallel, o row-parallel, the
# relative attention bias (one column per head) split by head like q, and each attention's
# n_heads divided by tp (what inference finds, as one plan file).
T5_TP_PLAN = """tp: 2
options:
  tp_plan:
    styles:
      "*.block.*.layer.0.SelfAttention.q": colwise
      "*.block.*.layer.0.SelfAttention.k": colwise
      "*.block.*.layer.0.SelfAttention.v": colwise
      "*.block.*.layer.0.SelfAttention.o": rowwise
      "decoder.block.*.layer.1.EncDecAttention.q": colwise
      "decoder.block.*.layer.1.EncDecAttention.k": colwise
      "decoder.block.*.layer.1.EncDecAttention.v": colwise
      "decoder.block.*.layer.1.EncDecAttention.o": rowwise
      "*.block.*.layer.*.DenseReluDense.wi": colwise
      "*.block.*.layer.*.DenseReluDense.wo": rowwise
      "*.block.0.layer.0.SelfAttention.relative_attention_bias": colwise
    divide_attrs:
      "*.block.*.layer.0.SelfAttention": [n_heads]
      "decoder.block.*.layer.1.EncDecAttention": [n_heads]
"""


@pytest.mark.slow
def test_t5_trains_as_one_device_under_tp_with_its_layer_plan_given(capsys, tmp_path):
    plan = tmp_path / "t5_tp.yaml"
    plan.write_text(T5_TP_PLAN)
    code, out = _check(capsys, "t5", str(plan))
    assert code == 0 and json.loads(out.out)["ok"], out


@pytest.mark.slow
def test_t5s_encoder_trains_as_one_device_under_dp_and_is_refused_under_pp(capsys):
    """One stack whose block 0 computes the position bias every later block reads: dp=2
    matches one device; pp=2 is refused, naming the block that holds the bias."""
    code, out = _check(capsys, "t5_encoder", "dp=2")
    assert code == 0 and json.loads(out.out)["ok"], out
    code, out = _check(capsys, "t5_encoder", "pp=2")
    assert code == 2 and ("encoder.block.0.layer.0.SelfAttention computes the relative "
                          "position bias") in out.err, out


@pytest.mark.slow
@pytest.mark.parametrize("plan,says", [
    ("dp=2", "returned without calling run.all_gather"),
    ("dp_shard=2,zero=1", "returned without calling run.all_gather"),
    ("dp_shard=2,zero=3", "logit_scale has none (a 0-dim parameter"),
    # 16x16 images in 8x8 patches: 5 positions in the image tower (4 and the class token)
    ("tp=2,sp", "the sequence has 5 positions at vision_model.encoder.layers.0; use a "
                "multiple of 2 or sp=False"),
    ("pp=2", "CLIPModel has more than one stack of blocks (text_model.encoder.layers and "
             "vision_model.encoder.layers"),
])
def test_clip_is_refused_where_its_loss_or_a_layout_cannot_split_it(capsys, plan, says):
    code, out = _check(capsys, "clip", plan)
    assert code == 2 and says in out.err, out


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["dp=2", "dp_shard=2,zero=1"])
def test_clip_with_its_embeddings_gathered_trains_as_one_device(plan):
    """Hugging Face CLIP in the wrapper the docs show (embeddings and temperature out of the
    forward), its loss over run.all_gather: one device's losses and parameters, logit_scale
    included."""
    batches = [E.clip_batch(s) for s in range(3)]
    ref = B.reference(E.wrapped_clip, batches, E.scaled_nce(B.no_gather))
    got = run_distributed(E.train_wrapped_clip, 2, plan, timeout=240)[0]
    _assert_matches(ref, got)
    assert "clip.logit_scale" in got["state"]
