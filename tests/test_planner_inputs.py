"""The planner's inputs: model statistics from presets, Hugging Face configs, YAML and module
factories, and the cluster catalog."""

import contextlib
import io
import json

import pytest

from plait.models.transformer import PRESETS, TransformerConfig
from plait.planner.hardware import load_cluster, presets
from plait.planner.model_stats import from_transformer_config, load_model


def test_catalog_presets_load():
    names = presets()
    for name in ("dgx-a100-80gb", "dgx-h100", "h200", "mi300x", "tpu-v5p", "tpu-v5e", "gaudi2",
                 "cpu"):
        assert name in names
        c = load_cluster(name)
        assert c.memory_bytes > 0 and c.peak("bf16") > 0
    a100 = load_cluster("dgx-a100-80gb", devices=1536)
    assert (a100.nodes, a100.devices_per_node, a100.world_size) == (192, 8, 1536)
    assert a100.intra_bw == 300e9 and a100.inter_bw == 25e9


@pytest.mark.parametrize("name", ["test", "gpt2", "llama-8b", "gpt-145b"])
def test_model_stats_match_reference_param_count(name):
    assert load_model(name).num_params == PRESETS[name].num_params()


def test_hf_config_json(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 128256, "hidden_act": "silu", "tie_word_embeddings": False,
           "max_position_embeddings": 8192}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    stats = load_model(str(path))
    assert stats.num_params == PRESETS["llama-8b"].num_params()
    assert (stats.kv_heads, stats.mlp, stats.max_seq) == (8, "swiglu", 8192)


@pytest.mark.parametrize("model_type", [None, "gpt2"])
def test_gpt2_config_without_activation_is_not_swiglu(model_type):
    """GPT2Config's default activation is gelu_new: a config.json that omits
    ``activation_function`` is a plain 4h GELU MLP, not SwiGLU (which would read Megatron's
    145.6B model as 193.9B)."""
    cfg = {"n_embd": 12288, "n_layer": 80, "n_head": 96, "vocab_size": 51200,
           "n_positions": 2048}
    if model_type:
        cfg["model_type"] = model_type
    stats = load_model(cfg)
    assert stats.mlp == "gelu"
    assert stats.num_params == pytest.approx(145.6e9, rel=0.005)
    llama = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 100, "intermediate_size": 128}
    assert load_model(llama).mlp == "swiglu"  # Llama-style configs default to silu


def test_module_factory_on_meta():
    stats = load_model("tests._planner_factories:reference_test_model")
    ref = from_transformer_config(PRESETS["test"])
    assert stats.n_layers == ref.n_layers and stats.hidden == ref.hidden
    assert stats.block_params == ref.block_params
    assert stats.block_matmul_params == ref.block_matmul_params
    assert stats.num_params == PRESETS["test"].num_params()
    assert stats.n_heads == 8 and stats.attention
    mlp = load_model("tests._planner_factories:mlp_stack")
    assert mlp.n_layers == 6 and mlp.block_matmul_params == 2 * 32 * 64 and not mlp.attention


def test_factory_whose_dataset_reads_values_plans_with_its_parameters_on_meta():
    """A (model, dataset, loss_fn) factory whose dataset reads tensor values when built fails
    under torch.device('meta'); it is built again with only the parameters there, and the
    dataset's tensors real."""
    import torch

    from plait.planner.model_stats import build_factory

    stats = load_model("tests._planner_factories:model_with_eager_dataset")
    assert stats.n_layers == 6 and stats.block_matmul_params == 2 * 32 * 64
    model = build_factory("tests._planner_factories:model_with_eager_dataset", "meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    # The patch is undone: a module built afterwards has real parameters.
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
    with pytest.raises(ValueError, match=r"first item is a _LengthsDataset: return the "
                                         r"nn.Module, or \(model, dataset, loss_fn\)"):
        load_model("tests._planner_factories:dataset_first")


def test_a_factory_dataset_gives_the_sequence_length_to_price():
    """A (model, dataset, loss_fn) factory's dataset says the sequence that training runs: the
    longest of its first rows (token rows of 4 to 8 here; (positions, features) rows of 16 in
    the example), which the CLI prices without --seq and names as the dataset's."""
    from plait.cli import main

    assert load_model("tests._planner_factories:model_with_eager_dataset").data_seq == 8
    assert load_model("examples.your_own_model:factory").data_seq == 16
    assert load_model("tests._planner_factories:mlp_stack").data_seq is None  # no dataset
    # Rows that read a tensor's value when asked for (built on meta, they cannot): the dataset
    # is built again with real tensors, not priced at the model's maximum (32).
    lazy = load_model("tests._planner_factories:gpt2_with_lazy_dataset")
    assert (lazy.data_seq, lazy.max_seq) == (8, 32)
    common = ["plan", "--model", "examples.your_own_model:factory", "--cluster", "cpu",
              "--devices", "2", "--global-batch", "32", "--format", "json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(common) == 0
    data = json.loads(out.getvalue())
    assert (data["seq"], data["seq_from"]) == (16, "dataset")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*common, "--seq", "4"]) == 0
    data = json.loads(out.getvalue())
    assert (data["seq"], data["seq_from"]) == (4, "--seq")


def test_yaml_model(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("preset: test\nn_layers: 8\n")
    assert load_model(str(path)).n_layers == 8
    path.write_text("dim: 64\nn_layers: 2\nn_heads: 4\n")
    assert load_model(str(path)).num_params == TransformerConfig(dim=64, n_layers=2,
                                                                 n_heads=4).num_params()


def test_auto_plan_for_a_model_without_a_block_stack_is_data_parallel():
    """Nothing for tensor or pipeline parallelism to split, nothing per block to price: plan
    'auto' runs data parallelism and says why, instead of failing."""
    import torch.nn as nn

    from plait.auto import AutoRequest, choose

    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 30 * 30, 10))
    plan, why = choose(cnn, AutoRequest(world_size=2, device_type="cpu"))
    assert plan.to_string() == "dp_replicate=2"
    assert "no stack of repeated blocks" in why[0]


def test_auto_says_where_the_batch_and_sequence_it_planned_for_came_from():
    """A batch and sequence the script did not give are defaults, said as such with the
    init() argument that sets them; given ones are shown bare."""
    from plait.auto import AutoRequest, choose
    from tests._planner_factories import mlp_stack, tiny_gpt2

    _, why = choose(mlp_stack(), AutoRequest(world_size=2, device_type="cpu"))
    assert ("(global batch 16 (8 rows per rank; plait.init(global_batch=N) for yours), seq 128 "
            "(a default; plait.init(seq=N) for yours))") in why[0], why[0]
    _, why = choose(tiny_gpt2(), AutoRequest(world_size=2, device_type="cpu"))
    assert "seq 32 (the model's maximum)" in why[0], why[0]
    _, why = choose(mlp_stack(), AutoRequest(world_size=2, device_type="cpu", global_batch=4,
                                             seq=8))
    assert "(global batch 4, seq 8)" in why[0], why[0]


def test_a_convnet_of_repeated_blocks_is_left_to_data_parallelism_with_what_to_do():
    """Repeated conv blocks (no nn.Linear to price): plait plan says how to pick a layout by
    hand and prove it, and plan 'auto' runs data parallelism (was: 'blocks have no nn.Linear
    layers' with no next step, and plan 'auto' failing on it)."""
    import torch.nn as nn

    from plait.auto import AutoRequest, choose
    from plait.planner.model_stats import NoBlockStackError

    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1),
                        *[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
                          for _ in range(3)],
                        nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
    with pytest.raises(NoBlockStackError, match="have no nn.Linear layers.*pick the layout by "
                                                "hand.*dp=N.*plait check --plan P.*BatchNorm "
                                                r"layers \(1.1, ...\) need sync_bn"):
        load_model(cnn)
    plan, why = choose(cnn, AutoRequest(world_size=2, device_type="cpu"))
    assert plan.to_string() == "dp_replicate=2,sync_bn=true", why  # its BatchNorm synced


def _by_config_and_by_module(kind: str, vocab: int):
    """The planner's stats of one tiny decoder read from its config.json and off the model
    built from the same config on the meta device."""
    import torch
    import transformers

    from plait.planner.model_stats import from_hf_config, from_module

    if kind == "gpt2":  # fused q|k|v, Conv1D linears, position embeddings, a tied head
        config_cls, model_cls = "GPT2Config", "GPT2LMHeadModel"
        sizes = dict(n_embd=64, n_layer=4, n_head=4, n_positions=128)
    else:
        config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[kind]
        sizes = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     tie_word_embeddings=False)
    cfg = getattr(transformers, config_cls)(vocab_size=vocab, **sizes)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(cfg)
    data = json.loads(cfg.to_json_string())
    return from_hf_config(data, name=kind), from_module(model, name=kind), model


def _priced(stats, text: str):
    """Memory and traffic of ``stats`` under ``text``, what a built model's block saves
    beyond the formula's count aside: it is measured (plait.planner.saved), a config's is
    not (tests/test_planner_idioms.py checks it against torch)."""
    import dataclasses

    from plait.plan import Plan
    from plait.planner import constants_for
    from plait.planner.cost import Workload, evaluate, rank_traffic

    stats = dataclasses.replace(stats, saved_extra=(0.0, 0.0), saved_scores=None)
    plan = Plan.from_string(text)
    cluster = load_cluster("cpu", devices=plan.world_size)
    est = evaluate(plan, stats, cluster, Workload(16, 64), constants_for(cluster))
    traffic = [sorted((t.axis, t.op, t.what, t.payload, t.calls) for t in rank)
               for rank in rank_traffic(plan, stats, 16, 64)]
    return est.memory_breakdown, traffic


ODD_PLANS = ["dp_shard=8,zero=3", "dp_shard=8,zero=2", "dp_shard=8,zero=3,pp=2,microbatches=2",
             "tp=2", "dp_shard=4,zero=3,tp=2", "dp_replicate=2,dp_shard=4,zero=2"]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_a_config_prices_the_rows_fsdp2_pads_as_the_built_model(kind):
    """A vocabulary of 50257 at dp_shard=8: FSDP2 pads each shard of the embedding and the
    head to 6283 rows (50264 in all), and at tp=2 the first rank holds 25129 of them (GPT-2:
    its tied head one tensor with the embedding, beside the pipeline a copy on the last stage). The
    planner prices a config.json as it prices the model built from it, byte for byte: memory
    per rank and every collective of every pipeline rank."""
    import torch

    config, module, model = _by_config_and_by_module(kind, 50257)
    for text in ODD_PLANS:
        assert _priced(config, text) == _priced(module, text), (kind, text)
    memory, _ = _priced(config, "dp_shard=8,zero=3")
    shard = sum(torch.chunk(p, 8)[0].numel() for p in model.parameters())
    assert memory["params"] == 4 * shard  # FSDP2's padded shard on rank 0, fp32
    assert 8 * shard > sum(p.numel() for p in model.parameters())


def test_a_preset_prices_the_rows_fsdp2_pads_as_the_built_model():
    """plait's reference transformer with a vocabulary of 50257, from its config and built on
    the meta device: the same memory and data-parallel traffic under ZeRO-2/3 at dp_shard=8
    (untied and tied head), beside a pipeline too (untied)."""
    import torch

    from plait.models.transformer import Transformer, preset
    from plait.planner.model_stats import from_module

    for overrides, plans in (
            ({}, ODD_PLANS[:3]),
            ({"mlp": "gelu", "norm": "layernorm", "tie_embeddings": True}, ODD_PLANS[:2])):
        cfg = preset("test", vocab_size=50257, **overrides)
        with torch.device("meta"):
            model = Transformer(cfg)
        for text in plans:
            assert _priced(from_transformer_config(cfg), text) == \
                _priced(from_module(model), text), (overrides, text)


# Layouts whose traffic depends on what tensor parallelism keeps whole (norms, row-parallel
# biases, a mixture-of-experts block's router and experts), on the collectives one block
# issues under tp and SP, and on a tied head beside a pipeline.
SPLIT_PLANS = ["tp=2", "dp_shard=2,zero=3,tp=2", "dp=2,tp=2", "pp=2,microbatches=2",
               "pp=2,tp=2,microbatches=2", "dp_shard=2,zero=3,pp=2,microbatches=2",
               "dp_shard=2,zero=1,pp=2,microbatches=2"]


@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True},
                                       {"mlp": "gelu", "norm": "layernorm",
                                        "tie_embeddings": True}],
                         ids=["rmsnorm", "tied", "layernorm-tied"])
def test_a_preset_prices_tp_sp_and_a_tied_pipeline_as_the_built_model(overrides):
    """plait's reference transformer from its config and built on the meta device: under tp
    its norms (LayerNorm: weight and bias) and row-parallel biases are whole on every rank,
    reduced whole over data parallelism and, under SP, each tensor's gradient all-reduced over
    tp; a tied head beside a pipeline is a copy of the embedding on the last stage whose
    gradient is summed with the first stage's (ZeRO-1 broadcasts it, ZeRO-3 gathers it)."""
    import torch

    from plait.models.transformer import Transformer, preset
    from plait.planner.model_stats import from_module

    cfg = preset("test", vocab_size=1000, **overrides)
    with torch.device("meta"):
        model = Transformer(cfg)
    config, module = from_transformer_config(cfg), from_module(model)
    assert config.num_params == sum(p.numel() for p in model.parameters())
    for text in [*SPLIT_PLANS, "tp=2,sp=1", "dp=2,tp=2,sp=1"]:
        assert _priced(config, text) == _priced(module, text), (overrides, text)


@pytest.mark.parametrize("kind", ["gpt_neox", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
                                  "llama_tied"])
def test_a_config_of_each_family_prices_every_layout_as_the_built_model(kind):
    """A config.json of each family plait lays out tensor by tensor (GPT-NeoX's fused q|k|v
    and LayerNorms with biases, Qwen3's per-head q/k norms, Mixtral's, Qwen2-MoE's and
    Qwen3-MoE's router and fused experts, a Llama with a tied head) priced as the model built
    from it on the meta device: the same parameters per block, memory and every collective of
    every pipeline rank, under tp, ZeRO x tp, a pipeline and SP where the family's layer plan
    has a sequence-parallel layout (Llama's)."""
    import torch
    import transformers

    from plait.planner.model_stats import from_hf_config, from_module

    config_cls, model_cls, sizes = {
        "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
            intermediate_size=256, num_attention_heads=4, tie_word_embeddings=False)),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
            intermediate_size=176, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            tie_word_embeddings=False)),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
            intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
            intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
            tie_word_embeddings=False)),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
            intermediate_size=176, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            tie_word_embeddings=False)),
        "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(
            intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
            tie_word_embeddings=True)),
    }[kind]
    cfg = getattr(transformers, config_cls)(vocab_size=1001, hidden_size=64, num_hidden_layers=2,
                                            max_position_embeddings=128, **sizes)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(cfg)
    config = from_hf_config(json.loads(cfg.to_json_string()), name=kind)
    module = from_module(model, name=kind)
    assert config.num_params == sum(p.numel() for p in model.parameters())
    for name in ("block_params", "block_tensors", "head_params", "head_tensors", "tied_params",
                 "block_active_params", "experts", "n_heads", "kv_heads", "held"):
        assert getattr(config, name) == getattr(module, name), name
    plans = [*SPLIT_PLANS, "dp_shard=2,zero=2"] + (["tp=2,sp=1"] if kind == "llama_tied" else [])
    for text in plans:
        (memory, traffic), (want_memory, want_traffic) = \
            _priced(config, text), _priced(module, text)
        assert traffic == want_traffic, (kind, text)
        if config.experts:  # the activations of a routed block are an estimate either way
            memory, want_memory = ({k: v for k, v in m.items() if k != "activations"}
                                   for m in (memory, want_memory))
        assert memory == want_memory, (kind, text)
