"""Tensor and sequence parallelism against one device: per layer, whole models, plans, errors.

Multi-process cases run on CPU/gloo through plait.spawn (hard timeouts). Heavy layouts (tp=4,
dp x tp, AdamW) are marked slow; tp=2 with and without SP runs unmarked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.check import CheckConfig, check
from plait.models.transformer import Transformer, build, preset
from plait.parallel.tensor import make_style, match_plan, resolve_plan, validate
from plait.parallel.tp_infer import infer_plan
from plait.parallel.tp_plans import TPPlan, hf_plan
from plait.plan import Plan
from plait.spawn import run_distributed
from tests import _workers_semantics as W
from tests._workers_tp import (
    LAYER_CASES,
    CustomLM,
    custom_factory,
    foreach_adamw_worker,
    gpt2_factory,
    layers_worker,
    llama_factory,
    sp_stage_worker,
    token_batches,
)

TOL = 1e-5


# ------------------------------------------------------------------------------ per layer
def test_each_parallel_layer_matches_the_unsharded_layer():
    results = run_distributed(layers_worker, 2, timeout=120)
    for rank, per_case in enumerate(results):
        assert set(per_case) == set(LAYER_CASES)
        for case, diffs in per_case.items():
            assert "output" in diffs and any(k.endswith("grad") for k in diffs), case
            for what, rel in diffs.items():
                if what == "logits_local_fraction":
                    # vocabulary 37 over 2 ranks: this rank holds about half the logits
                    assert rel < 0.6, (rank, case, rel)
                    continue
                assert rel < TOL, f"rank {rank} {case} {what}: relative diff {rel:.2e}"


# ------------------------------------------------------------------------- whole models
def _sgd(steps: int = 5, **kw) -> CheckConfig:
    # SGD keeps the parameter comparison strict (1e-5): AdamW divides by sqrt(v) and amplifies
    # 1e-7 gradient differences on near-zero gradients (see the slow AdamW case).
    return CheckConfig(optimizer="sgd", steps=steps, **kw)


@pytest.mark.parametrize("layout", [pytest.param("tp=2", marks=pytest.mark.slow), "tp=2,sp=true"])
def test_reference_model_trains_like_one_device(layout):
    result = check(layout, _sgd(), tolerance=TOL, timeout=240)
    assert result.ok, result.format()
    assert result.max_loss_diff < TOL


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp=4", "tp=4,sp=true", "dp=2,tp=2", "dp=2,tp=2,sp=true"])
def test_reference_model_larger_layouts(layout):
    result = check(layout, _sgd(), tolerance=TOL, timeout=300)
    assert result.ok, result.format()


@pytest.mark.slow
def test_reference_model_adamw_loss_matches():
    result = check("tp=2,sp=true", CheckConfig(optimizer="adamw"), tolerance=TOL, timeout=240)
    assert result.max_loss_diff < TOL, result.format()
    assert not result.missing
    assert result.max_param_diff < 1e-4, result.format()  # Adam's amplification, see _sgd


@pytest.mark.parametrize("factory", [gpt2_factory, llama_factory], ids=["gpt2", "llama"])
def test_hf_models_train_like_one_device(factory):
    cfg = _sgd(steps=2, model_factory=factory, batch_factory=token_batches)
    result = check("tp=2", cfg, tolerance=TOL, timeout=240)
    assert result.ok, result.format()


@pytest.mark.slow
@pytest.mark.parametrize("plans, world", [(("tp=2,ac=op", "tp=2,sp=true,ac=op"), 2),
                                          (("dp=2,tp=2,ac=op",), 4)], ids=["tp", "dp_x_tp"])
def test_hf_models_with_op_level_checkpointing_train_like_one_device(plans, world):
    """ac=op recomputes each block in backward; transformers' blocks get a key/value cache they
    update, so they run without it (tests/test_checkpointing.py has the one-process form)."""
    pytest.importorskip("transformers")
    batches = [W.hf_batch(s) for s in range(2)]
    factories = (W.hf_gpt2, W.hf_llama)
    jobs = [(p, f, batches, W.mlm_loss) for p in plans for f in factories]
    results = run_distributed(W.train_jobs, world, jobs, timeout=300)[0]
    for (_, factory, _, _), got in zip(jobs, results, strict=True):
        ref = W.reference(factory, batches, W.mlm_loss)
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL), got["plan"]
        for name, want in ref["state"].items():
            diff = (got["state"][name] - want).abs().max().item()
            assert diff < TOL, (got["plan"], factory.__name__, name, diff)


@pytest.mark.slow
def test_inferred_plan_trains_like_one_device():
    cfg = _sgd(steps=3, model_factory=custom_factory, batch_factory=token_batches)
    result = check("tp=2", cfg, tolerance=TOL, timeout=240)
    assert result.ok, result.format()


def test_foreach_adamw_and_clipping_on_mixed_parameters():
    results = run_distributed(foreach_adamw_worker, 2, "tp=2", timeout=120)
    for r in results:
        assert r["all_dtensor"], r["kinds"]
        assert all(x == x and x < 10 for x in r["losses"]), r
    assert results[0]["losses"] == results[1]["losses"]


# ------------------------------------------------------------------------- plans as data
def test_shipped_hf_plans_match_their_models():
    gpt2, llama = gpt2_factory().model, llama_factory().model
    g = hf_plan(gpt2)
    assert g.styles["transformer.h.*.attn.c_attn"] == "colwise_qkv"
    assert g.styles["lm_head"] == "vocab_head"
    match_plan(gpt2, g.styles)  # every glob matches a module
    lp = hf_plan(llama)
    # taken from transformers' own base_model_tp_plan, under the base model's prefix
    for glob, style in llama.config.base_model_tp_plan.items():
        assert lp.styles[f"model.{glob}"] == style
    assert lp.sizes["num_key_value_heads"] == 4
    match_plan(llama, lp.styles)


def test_bert_plan_matches_bert():
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                num_attention_heads=4, intermediate_size=64))
    matched = match_plan(bert, hf_plan(bert).styles)
    assert matched["encoder.layer.0.attention.self.query"] == "colwise"
    assert matched["encoder.layer.0.output.dense"] == "rowwise"


def test_inference_finds_mlp_and_attention_styles():
    plan = infer_plan(CustomLM())
    assert plan.styles == {
        "blocks.*.attn.wq": "colwise", "blocks.*.attn.wk": "colwise",
        "blocks.*.attn.wv": "colwise", "blocks.*.attn.proj": "rowwise",
        "blocks.*.attn": "region", "blocks.*.mlp.fc1": "colwise",
        "blocks.*.mlp.fc2": "rowwise", "emb": "vocab_embedding", "head": "vocab_head"}
    assert plan.divide_attrs == {"blocks.*.attn": ("n_heads",)}
    # on the reference model, inference rediscovers the shipped plan (norms aside)
    ref = infer_plan(build("test")).styles
    shipped = {k: v for k, v in resolve_plan(build("test"), Plan(tp=2)).styles.items()
               if v != "sequence_parallel"}
    assert ref == shipped


class _Residual(nn.Module):
    """Two linears whose first output skips the second: not a TP region."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) + h


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: fx cannot trace it
            return self.b(self.a(x))
        return x


class _UnevenFused(nn.Module):
    """A fused layer of parts of different widths (grouped-query q|k|v): no even split."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(8, 12), nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).split([8, 2, 2], dim=-1)
        return self.o(q * (k * v).sum(-1, keepdim=True))


@pytest.mark.parametrize("model,reason", [(_Residual(), "produce the block output"),
                                           (_UnevenFused(), r"output of qkv \(12 features\) is "
                                                            r"wider than what o reads \(8\)"),
                                           (_Branchy(), "torch.fx cannot trace"),
                                           (nn.Sequential(nn.Conv2d(1, 1, 1)), "no module")])
def test_inference_refuses_what_it_cannot_read(model, reason):
    with pytest.raises(ValueError, match=reason):
        infer_plan(model)


class _ShapeBranch(nn.Module):
    """A block that branches on its input's rank (fx cannot trace that; a run can)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        if x.dim() == 2:
            x = x.unsqueeze(0)
        return self.down(self.up(x).relu())


class _Net(nn.Module):
    def __init__(self, block: nn.Module, head: nn.Module):
        super().__init__()
        self.stem, self.block, self.head = nn.Linear(8, 8), block, head

    def forward(self, x):
        h = self.stem(x)
        return self.head(h + self.block(h))


def test_inference_records_blocks_fx_cannot_trace():
    """The block's graph comes from a fake-tensor forward on a guessed input instead."""
    plan = infer_plan(_Net(_ShapeBranch(), nn.Linear(8, 3)))
    assert plan.styles == {"block.up": "colwise", "block.down": "rowwise"}


def test_parametrized_linears_are_not_sharded():
    """weight_norm computes the weight from two other tensors: inference leaves such a linear
    replicated, and a plan that names one is refused with the fix."""
    from torch.nn.utils.parametrizations import weight_norm

    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    model = _Net(mlp, weight_norm(nn.Linear(8, 3)))
    assert infer_plan(model).styles == {"block.0": "colwise", "block.2": "rowwise"}
    normed = _Net(nn.Sequential(weight_norm(nn.Linear(8, 16)), nn.ReLU(),
                                weight_norm(nn.Linear(16, 8))), nn.Linear(8, 3))
    with pytest.raises(ValueError, match=r"block \(Sequential\): its linear\(s\) \['0', '2'\] "
                                         r"are parametrized"):
        infer_plan(normed)
    plan = TPPlan(styles={"block.0": "colwise", "block.2": "rowwise"})
    with pytest.raises(ValueError, match=r"block\.0 \(colwise\) is parametrized \(weight: .*"
                                         r"remove_parametrizations"):
        validate(normed, plan, match_plan(normed, plan.styles), tp=2)


# ------------------------------------------------------------------------------- bad input
def test_tp_not_dividing_heads_names_module_and_numbers():
    model = build("test")  # 8 heads, 4 kv-heads
    plan = resolve_plan(model, Plan(tp=3))
    with pytest.raises(ValueError) as err:
        validate(model, plan, match_plan(model, plan.styles), tp=3)
    msg = str(err.value)
    assert "n_heads=8 is not divisible by tp=3" in msg
    assert "n_kv_heads=4 is not divisible by tp=3" in msg
    # one line per kind of block, not one per layer
    assert "layers.*.attention.q_proj (colwise): 8 heads of 8" in msg
    assert msg.count("attention.q_proj") == 1
    assert "tp values that fit every size: [1, 2, 4, 8]" in msg
    # A model of one's own: the hint counts its linears' sizes too, not only the stored counts
    # (4 query heads, 1 kv head, replicated at any tp that splits the queries; MLP width 32).
    from plait.parallel.tp_infer import verify_plan
    from tests._workers_semantics import positionwise_lm

    with pytest.raises(ValueError, match=r"blocks\.\*\.attn\.k \(colwise\): 1 head of 4 cannot.*"
                                         r"tp values that fit every size: \[1, 2, 4\]$"):
        verify_plan(positionwise_lm(), infer_plan(positionwise_lm()), 3)


def test_kv_heads_fewer_than_tp_are_replicated_else_refused():
    """4 kv heads at tp=8: the k/v projections switch to replicated_kv (validation then
    passes); named so in a user plan they are accepted; 6 kv heads at tp=4 are refused."""
    from plait.parallel.tensor import kv_layers

    llama = llama_factory()  # 8 heads, 4 kv heads
    plan = resolve_plan(llama, Plan(tp=8))
    matched = match_plan(llama, plan.styles)
    with pytest.raises(ValueError, match=r"num_key_value_heads=4 is not divisible by tp=8"):
        validate(llama, plan, dict(matched), tp=8)
    kv = kv_layers(llama, matched, 8)
    assert {n.rpartition(".")[2] for n in kv} == {"k_proj", "v_proj"} and len(kv) == 4
    assert {matched[n] for n in kv} == {"replicated_kv"}
    validate(llama, plan, matched, tp=8)
    user = {n: "replicated_kv" if n in kv else s for n, s in match_plan(llama, plan.styles).items()}
    assert kv_layers(llama, user, 8) == kv
    with pytest.raises(ValueError, match="needs an nn.Linear k or v projection"):
        make_style("replicated_kv", nn.Linear(4, 4), "x.k", sp=False)
    model = build(preset("test", dim=96, n_heads=12, n_kv_heads=6))
    plan = resolve_plan(model, Plan(tp=4))
    matched = match_plan(model, plan.styles)
    assert kv_layers(model, matched, 4) == {}
    with pytest.raises(ValueError, match="n_kv_heads=6 is not divisible by tp=4"):
        validate(model, plan, matched, tp=4)


def test_vocab_not_divisible_is_padded_and_said():
    model = Transformer(preset("test", vocab_size=255))
    plan = resolve_plan(model, Plan(tp=2))
    notes = validate(model, plan, match_plan(model, plan.styles), tp=2)
    assert any("255" in n and "padded to 256" in n for n in notes), notes


def test_pattern_matching_nothing_is_an_error():
    with pytest.raises(ValueError, match=r"layers\.\*\.attn\.wq.*match no module"):
        match_plan(build("test"), {"layers.*.attn.wq": "colwise"})


def test_style_on_a_module_that_is_not_linear():
    model = build("test")
    norm = model.get_submodule("layers.0.attention_norm")
    with pytest.raises(ValueError, match=r"'colwise' on 'layers.0.attention_norm'.*RMSNorm"):
        make_style("colwise", norm, "layers.0.attention_norm", sp=False)
    with pytest.raises(ValueError, match="unknown tensor-parallel style"):
        TPPlan.from_option({"layers.*.attention.q_proj": "diagonal"})


def test_sp_refused_for_plans_without_it():
    """A user plan without sequence_parallel entries, and an inferred plan for blocks that
    leave attention replicated (it mixes positions outside any region)."""
    from plait.parallel.tensor import apply_tensor_parallel

    styles = {"blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise"}
    with pytest.raises(ValueError, match="no sequence-parallel layout; use sp=False"):
        apply_tensor_parallel(custom_factory(), _FakeMesh(),
                              Plan(tp=2, sp=True, options={"tp_plan": styles}))
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"no sequence-parallel layout: enc\.layers\.0 does "
                                         r"not treat positions one by one"):
        apply_tensor_parallel(_EncoderLM(), _FakeMesh(), Plan(tp=2, sp=True))


class _EncoderLM(nn.Module):
    """torch's TransformerEncoder: its attention stays replicated under an inferred plan."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(24, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.enc(self.emb(tokens))


class _FakeMesh:
    """Just enough mesh for apply_tensor_parallel to reach its plan checks (they run first)."""

    def __getitem__(self, name):
        return self

    def size(self):
        return 2


class _CrossAttention(nn.Module):
    """q from the input, k and v from another tensor (the block's second input)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x, context):
        att = (self.q(x) @ self.k(context).transpose(-1, -2)).softmax(-1)
        return self.o(att @ self.v(context))


def test_inference_refuses_a_region_fed_from_two_inputs():
    """Splitting q alone while k and v stay whole would mix a rank's q heads with all heads."""
    with pytest.raises(ValueError, match=r"\['k', 'v'\] feed the output linear o from another "
                                         r"input than \['q'\]"):
        infer_plan(_CrossAttention())


class _ScaledHeads(nn.Module):
    """A learnable scale of the block's own applied to each rank's share of q, and a norm
    used both on the shares and on the whole output."""

    def __init__(self, shared_norm: bool):
        super().__init__()
        self.shared_norm = shared_norm
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
        self.scale = nn.Parameter(torch.ones(4))
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 2, 4)
        q = self.norm(q) if self.shared_norm else q * self.scale
        att = (q.flatten(2) @ self.k(x).transpose(-1, -2)).softmax(-1)
        out = self.o(att @ self.v(x))
        return self.norm(out.view(b, s, 2, 4)).flatten(2) if self.shared_norm else out


def test_inference_sums_gradients_of_weights_applied_to_shares_or_refuses():
    """A weight a region applies to each rank's share needs its gradient summed over tp: a
    submodule gets grad_allreduce; the block's own parameter, or a module also used outside
    the region, is refused by name (replicated, it would train on part of its gradient)."""
    with pytest.raises(ValueError, match=r"parameter\(s\) \['scale'\] are applied to each "
                                         r"rank's share"):
        infer_plan(_ScaledHeads(shared_norm=False))
    with pytest.raises(ValueError, match="norm is used both inside the tensor-parallel region"):
        infer_plan(_ScaledHeads(shared_norm=True))


def test_transformers_plans_translate_their_styles():
    """transformers' replicated_with_grad_allreduce, colwise_gather_output and
    rowwise_split_input become grad_allreduce, colwise_gather and rowwise_split; a
    mixture-of-experts MLP the plan leaves replicated gets no region; RoBERTa takes BERT's
    plan."""
    from tests._workers_semantics import hf_mixtral, hf_phi3, hf_qwen3, hf_roberta_mlm

    qwen3 = hf_plan(hf_qwen3().hf).styles
    assert qwen3["model.layers.*.self_attn.q_norm"] == "grad_allreduce"
    phi3 = hf_plan(hf_phi3().hf).styles
    assert phi3["model.layers.*.self_attn.qkv_proj"] == "colwise_gather"
    assert phi3["model.layers.*.mlp.down_proj"] == "rowwise_split"
    mixtral = hf_plan(hf_mixtral().hf).styles
    assert mixtral["model.layers.*.self_attn"] == "region"
    assert "model.layers.*.mlp" not in mixtral
    roberta = hf_plan(hf_roberta_mlm().hf)
    assert roberta.source == "plait plan for HF roberta (BERT's layout)"
    assert roberta.styles["roberta.encoder.layer.*.attention.self.query"] == "colwise"


def test_a_region_without_column_parallel_layers_is_refused():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    plan = TPPlan(styles={"0": "region"})
    with pytest.raises(ValueError, match=r"0 \(region\) holds no column-parallel layer"):
        validate(model, plan, match_plan(model, plan.styles), 2)


class _PatchNet(nn.Module):
    """A vision transformer in miniature: a conv stem, a learned position per patch (so it runs
    on 16x16 images only), blocks whose fused q|k|v is stored head by head."""

    def __init__(self):
        super().__init__()
        from tests._workers_semantics import WIDTH, InterleavedQKVBlock

        self.patch = nn.Conv2d(3, WIDTH, 4, 4)
        self.pos = nn.Parameter(torch.zeros(1, 16, WIDTH))
        self.blocks = nn.ModuleList(InterleavedQKVBlock() for _ in range(2))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, images):
        h = self.patch(images).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


def test_a_conv_stem_gets_images_of_a_size_it_runs_on_and_its_plan_is_checked():
    """Without a guessed input nothing could be checked, and the head-by-head fused layer would
    be split in thirds; the guess is the first common image size the model runs on."""
    from plait.parallel.tp_example import example_input
    from plait.parallel.tp_infer import verify_plan

    model = _PatchNet()
    assert example_input(model).shape == (2, 3, 16, 16)
    plan = infer_plan(model)
    assert plan.styles["blocks.*.qkv"] == "colwise_qkv"
    assert verify_plan(model, plan, 2).styles["blocks.*.qkv"] == "colwise"


class _WidthFromInput(nn.Module):
    """nanoGPT's way: q, k, v split by the width read off the block's input."""

    def __init__(self, width=16, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(b, t, c))


def test_a_block_reading_the_whole_width_is_refused_at_its_line_with_the_fix():
    """The inferred plan fails the fake-tensor forward: the error names the block and the line
    of the user's forward, and what to write there, not only the plan to pass."""
    from plait.parallel.tp_infer import verify_plan

    model = nn.Sequential(nn.Embedding(32, 16), *(_WidthFromInput() for _ in range(2)))
    with pytest.raises(ValueError, match=r"fails in 1 \(test_tensor_parallel.py line \d+\): "
                                         r"ValueError: .*write -1 or chunk\(3, dim=-1\) there"):
        verify_plan(model, infer_plan(model), 2)


def test_notices_go_to_stderr_so_json_reports_stay_clean(capsys):
    """The inferred plan (and every other tensor-parallel notice) is printed on stderr: a
    report's stdout under --format json is the JSON alone."""
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    resolve_plan(mlp, Plan(tp=2))
    out, err = capsys.readouterr()
    assert out == "" and "this one was inferred from its structure" in err


class _FlatAttentionMLP(nn.Module):
    """q, k, v, o and the MLP's up/down as direct children of one block, a stored head count
    and (kv_heads given) a stored kv-head count: two regions in one module."""

    def __init__(self, kv_heads: int | None = None, heads: int = 4, width: int = 32):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        if kv_heads is not None:
            self.n_kv_heads = kv_heads
        kv = (kv_heads or heads) * self.head_dim
        self.q, self.k, self.v = (nn.Linear(width, w) for w in (width, kv, kv))
        self.o = nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)


def test_kv_replication_reads_the_attention_not_the_widest_layer():
    """In a block holding attention and MLP linears alike, the MLP's up projection is not the
    queries: q, k and v of equal heads are split as usual; with a stored kv-head count of 1,
    k and v alone are replicated."""
    from plait.parallel.tp_kv import replicated_kv

    styles = {"blk.q": "colwise", "blk.k": "colwise", "blk.v": "colwise", "blk.o": "rowwise",
              "blk.up": "colwise", "blk.down": "rowwise"}
    mha = nn.Sequential()
    mha.add_module("blk", _FlatAttentionMLP())
    assert replicated_kv(mha, styles, 2) == {}
    mqa = nn.Sequential()
    mqa.add_module("blk", _FlatAttentionMLP(kv_heads=1))
    assert sorted(replicated_kv(mqa, styles, 2)) == ["blk.k", "blk.v"]


@pytest.mark.slow
def test_sp_refuses_an_uneven_sequence_at_the_embedding_only():
    """The sequence-length check sits on the embedding: a later pipeline stage receives a
    sequence shard (14 positions over tp=2: 7), which it must not refuse."""
    result = check("pp=2,tp=2,sp=true", _sgd(steps=1, seq_len=14, batch_size=4),
                   tolerance=TOL, timeout=300)
    assert result.ok, result.format()


def test_sp_stages_hand_on_their_sequence_shard():
    """Under sequence parallelism a pipeline stage hands on its rank's sequence shard (1/tp of
    the hidden states), and the next stage's first block starts from it: both stages of a pp=2
    split laid out for tp=2,sp=1 and chained by hand, for models whose layer plan is inferred
    (MLP blocks written for the test) or shipped (tiny Hugging Face Llama, whose later stage
    computes its causal mask and rotary table from the whole sequence's length; GPT-2, whose
    position table another stage holds). What stage 0 sends is this rank's half of what one
    device feeds the next block, and the logits and every gradient are one device's."""
    pytest.importorskip("transformers")
    models = ["mlp", "llama", "gpt2"]
    results = run_distributed(sp_stage_worker, 2, models, timeout=180)
    for rank, per_model in enumerate(results):
        for name in models:
            got = per_model[name]
            b, s, w = got["whole"]
            assert got["sent"] == (b, s // 2, w), (rank, name, got["sent"], got["whole"])
            assert got["sent_diff"] < TOL, (rank, name, got["sent_diff"])
            assert got["logits"] < TOL, (rank, name, got["logits"])
            assert len(got["grads"]) == got["params"], (rank, name, sorted(got["grads"]))
            assert max(got["grads"].values()) < TOL, (rank, name, got["grads"])


@pytest.mark.slow
def test_pipeline_with_sp_sends_shards_and_trains_like_one_device():
    """pp=2,tp=2,sp=1 through run.step (two microbatches, 1F1B) on a model written for the test
    (its plan inferred) and a tiny Hugging Face Llama: the loss and every parameter after three
    AdamW steps are one device's, and over the steps after the first (whose forward torch's
    stages run once more to infer their shapes) the ledger measures what it predicts on every
    row (ratio 1.000), the pipeline's sends included: each carries the rank's sequence shard,
    batch/2 x seq/2 x width fp32 per microbatch, forward and backward."""
    pytest.importorskip("transformers")
    from tests import _traffic_models as T
    from tests._workers_tp import adamw_layout, adamw_one_device

    models, steps = ["mlp", "llama"], 3
    got = run_distributed(adamw_layout, 4, "pp=2,tp=2,sp=1,microbatches=2", models, steps,
                          timeout=400)[0]
    for name in models:
        ref = adamw_one_device(name, steps)
        assert got[name]["losses"] == pytest.approx(ref["losses"], abs=TOL), name
        state = got[name]["state"]
        for key, want in ref["state"].items():
            if want.is_floating_point():
                diff = (state[key] - want).abs().max().item()
                assert diff < TOL, (name, key, diff)
        rows = {(r["axis"], r["op"]): r for r in got[name]["comm"]["rows"]}
        for key, r in rows.items():
            assert r["ratio"] == pytest.approx(1.0, abs=1e-12), (name, key, r)
        sent = rows[("pp", "send_recv")]
        # per step, each rank sends (stage 0 forward, stage 1 backward) one shard for each of
        # the 2 microbatches: (batch/2 rows) x (seq/2 positions) x width fp32
        assert sent["payload_bytes"] == 2 * (T.BATCH // 2) * (T.SEQ // 2) * T.WIDTH * 4, (
            name, sent)
