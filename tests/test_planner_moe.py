"""Routed mixture-of-experts models in the planner: compute priced on the k experts a token is
routed to (and the router), memory on all E experts. Models: the Mixtral-like LM written for the
layout tests, and Hugging Face Mixtral and Qwen2-MoE built from tiny configs; published
parameter counts of Mixtral-8x7B and Qwen1.5-MoE-A2.7B from their configs."""

import dataclasses

import pytest

from plait.plan import Plan
from plait.planner.cli import main as plan_main
from plait.planner.cost import Workload, evaluate
from plait.planner.hardware import load_cluster
from plait.planner.model_stats import from_hf_config, from_module
from tests import _moe_models as moe

# Mixtral-8x7B's config.json (mistralai/Mixtral-8x7B-v0.1)
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
                "max_position_embeddings": 32768, "hidden_act": "silu",
                "tie_word_embeddings": False}
# Qwen1.5-MoE-A2.7B's config.json: 60 routed experts (top-4) and a shared expert
QWEN15_MOE = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
              "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
              "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
              "vocab_size": 151936, "num_experts": 60, "num_experts_per_tok": 4,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
              "max_position_embeddings": 8192, "tie_word_embeddings": False}


def _swiglu(h, f):
    return 3 * h * f


def test_mixtral_like_prices_two_of_four_experts():
    stats = from_module(moe.mixtral_like())
    w = moe.WIDTH
    attention, router, expert = 4 * w * w, w * moe.EXPERTS, _swiglu(w, 2 * w)
    assert stats.experts == (moe.TOP_K, moe.EXPERTS)
    assert stats.block_matmul_params == attention + router + moe.TOP_K * expert
    # memory: every expert (weights and biases), the attention and the norms
    expert_all = expert + 2 * 2 * w + w
    assert stats.block_params == attention + 4 * w + router + moe.EXPERTS * expert_all + 4 * w
    assert stats.block_active_params == stats.block_params - \
        (moe.EXPERTS - moe.TOP_K) * expert_all


@pytest.mark.parametrize("build, ffn, shared", [(moe.hf_mixtral, 64, 0),
                                                (moe.hf_qwen2_moe, 32, _swiglu(32, 64) + 32)])
def test_hf_fused_experts_and_router_are_priced(build, ffn, shared):
    """transformers' fused experts hold the E experts in 3-D parameters and the router is a bare
    weight, neither an nn.Linear: both are counted, k of E experts per token."""
    stats = from_module(build())
    h, kv = 32, 16
    attention = 2 * h * h + 2 * h * kv
    assert stats.experts == (2, 4)
    assert stats.block_matmul_params == attention + 4 * h + 2 * _swiglu(h, ffn) + shared


@pytest.mark.parametrize("build", [moe.hf_mixtral, moe.hf_qwen2_moe])
def test_hf_config_and_module_agree(build):
    model = build()
    from_config = from_hf_config(model.hf.config.to_dict())
    from_model = from_module(model)
    for name in ("block_params", "block_matmul_params", "block_active_params", "experts",
                 "block_tensors", "num_params", "active_params"):
        assert getattr(from_config, name) == getattr(from_model, name), name


@pytest.mark.parametrize("config, total, active", [(MIXTRAL_8X7B, 46.7e9, 12.9e9),
                                                   (QWEN15_MOE, 14.3e9, 2.7e9)])
def test_published_total_and_active_parameters(config, total, active):
    """Mistral publishes 46.7B parameters of which 12.9B are used per token; Qwen 14.3B and
    2.7B activated. Both within the rounding of the published figure."""
    stats = from_hf_config(config)
    assert stats.num_params == pytest.approx(total, rel=0.005)
    assert stats.active_params == pytest.approx(active, rel=0.02)


def test_training_flops_are_six_times_active_matmul_params_per_token():
    stats = from_hf_config(MIXTRAL_8X7B)
    h, f, kv, L, V, seq, tokens = 4096, 14336, 1024, 32, 32000, 4096, 8 * 4096
    active_matmul = L * (2 * h * h + 2 * h * kv + 8 * h + 2 * _swiglu(h, f)) + h * V
    attention = 3 * L * 4 * seq * h * tokens  # the s^2 attention FLOPs, forward + backward
    assert stats.model_flops(tokens, seq) == 6 * active_matmul * tokens + attention


def test_memory_holds_every_expert_compute_only_the_routed_ones():
    """At one layout, the MoE model and the same model priced with every expert active hold the
    same bytes; the routed one computes for 12.9B of 46.7B parameters. At dp_shard=8 FSDP2
    splits the 8 fused experts (dim 0) evenly; over more ranks it pads that dim, each rank
    holding a whole expert's rows or none (priced as the rows FSDP2 pads)."""
    stats = from_hf_config(MIXTRAL_8X7B)
    dense = dataclasses.replace(stats, block_matmul_params=stats.block_matmul_params
                                + 6 * _swiglu(4096, 14336), experts=None,
                                block_active_params=None)
    cluster = load_cluster("dgx-h100", devices=8).with_memory(1e12)
    work = Workload(64, 4096)
    plan = Plan(dp_shard=8, zero=3, activation_checkpointing="full", mixed_precision="bf16")
    routed, every = (evaluate(plan, m, cluster, work) for m in (stats, dense))
    assert routed.feasible and every.feasible
    assert routed.memory_breakdown["params"] == every.memory_breakdown["params"] == \
        pytest.approx(4 * 46.7e9 / 8, rel=0.005)
    assert routed.memory_breakdown["optimizer"] == every.memory_breakdown["optimizer"]
    assert routed.comm_bytes_per_step == every.comm_bytes_per_step
    # compute (the step's gathers of all 46.7B parameters aside): the FLOPs of 2 of 8 experts
    flops = every.tflops_per_device * every.step_time_s / (
        routed.tflops_per_device * routed.step_time_s)
    assert flops == pytest.approx(dense.model_flops(4096, 4096) / stats.model_flops(4096, 4096))
    assert flops > 2.5
    assert every.time_breakdown["pipeline"] / routed.time_breakdown["pipeline"] > 2.5


def test_top_k_found_nowhere_prices_every_expert():
    model = moe.mixtral_like()
    for block in model.blocks:
        del block.moe.top_k
    stats = from_module(model)
    assert stats.experts is None and stats.block_active_params is None
    assert stats.block_matmul_params == sum(
        m.weight.numel() for m in model.blocks[0].modules() if hasattr(m, "in_features"))


def test_bad_expert_configs_are_refused_with_the_field():
    with pytest.raises(ValueError, match="num_experts_per_tok=9 is more than the 8 experts"):
        from_hf_config({**MIXTRAL_8X7B, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="decoder_sparse_step=2.*factory"):
        from_hf_config({**QWEN15_MOE, "decoder_sparse_step": 2})
    model = moe.mixtral_like()
    model.blocks[0].moe.top_k = 5
    with pytest.raises(ValueError, match="top_k=5 of its 4 experts"):
        from_module(model)


def test_plan_header_says_active_parameters(tmp_path, capsys):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL_8X7B))
    assert plan_main(["--model", str(path), "--cluster", "dgx-h100", "--devices", "64",
                      "--global-batch", "64", "--seq", "4096", "--top", "1"]) == 0
    assert "46.7B params, 12.9B active: top-2 of 8 experts" in capsys.readouterr().out
