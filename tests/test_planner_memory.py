"""Memory per device (plait.planner.memory) against hand-computed values and published figures."""

import pytest
import torch

from plait.models.transformer import TransformerConfig
from plait.plan import Plan
from plait.planner.cost import Constants, Workload, evaluate
from plait.planner.hardware import load_cluster
from plait.planner.memory import activation_bytes_per_block
from plait.planner.model_stats import from_transformer_config, load_model


def test_activation_memory_matches_korthikanti():
    # GPT block (ffn 4h) trained with dropout: 34sbh + 5as^2b bytes at 2 bytes/element, no TP.
    m = from_transformer_config(TransformerConfig(vocab_size=100, dim=64, n_layers=2, n_heads=4,
                                                  mlp="gelu", norm="layernorm", dropout=0.1))
    assert m.dropout
    s, b, h, a = 32, 2, 64, 4
    c = Constants(flash_attention=False)
    assert activation_bytes_per_block(m, b, s, 1, False, 2, c) == pytest.approx(
        s * b * h * (34 + 5 * a * s / h))
    t = 4  # TP without SP: sbh(10 + 24/t + 5as/(ht)); with SP: sbh/t (34 + 5as/h)
    assert activation_bytes_per_block(m, b, s, t, False, 2, c) == pytest.approx(
        s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert activation_bytes_per_block(m, b, s, t, True, 2, c) == pytest.approx(
        s * b * h / t * (34 + 5 * a * s / h))
    # flash attention stores no s^2 scores; fp32 doubles everything
    flash = Constants(flash_attention=True)
    assert activation_bytes_per_block(m, b, s, 1, False, 4, flash) == pytest.approx(
        2 * s * b * h * 34)


def test_activation_memory_without_dropout_saves_no_masks():
    """A GPT block without dropout: Korthikanti's figures less the masks, 2sbh after the
    attention output and the MLP (both replicated under TP without SP) and as^2b on the
    attention probabilities, whose dropped copy (2as^2b) is the softmax output itself:
    32sbh + 2as^2b; a Llama block (SwiGLU, GQA) is 2sbh less with flash attention."""
    m = from_transformer_config(TransformerConfig(vocab_size=100, dim=64, n_layers=2, n_heads=4,
                                                  mlp="gelu", norm="layernorm"))
    assert not m.dropout
    s, b, h, a, t = 32, 2, 64, 4, 4
    c = Constants(flash_attention=False)
    assert activation_bytes_per_block(m, b, s, 1, False, 2, c) == pytest.approx(
        s * b * h * (32 + 2 * a * s / h))
    assert activation_bytes_per_block(m, b, s, t, False, 2, c) == pytest.approx(
        s * b * h * (8 + 24 / t + 2 * a * s / (h * t)))
    assert activation_bytes_per_block(m, b, s, t, True, 2, c) == pytest.approx(
        s * b * h / t * (32 + 2 * a * s / h))
    flash = Constants(flash_attention=True)
    llama = dict(vocab_size=100, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=160)
    kept = from_transformer_config(TransformerConfig(**llama, dropout=0.1))
    none = from_transformer_config(TransformerConfig(**llama))
    # Llama per token: attention 2h + 2(h + 2kv) + 2h, MLP 2h + 8f, norms 4h (+ h + h masks)
    kv, f = 2 * h // 8, 160
    plain = 2 * h + 2 * (h + 2 * kv) + 2 * h + 2 * h + 8 * f + 4 * h
    assert activation_bytes_per_block(none, b, s, 1, False, 2, flash) == pytest.approx(
        s * b * plain)
    assert activation_bytes_per_block(kept, b, s, 1, False, 2, flash) == pytest.approx(
        s * b * (plain + 2 * h))


def _tiny():
    return load_model("test")


def test_memory_of_ddp_and_zero_by_hand():
    m, c = _tiny(), load_cluster("cpu", devices=2)
    work = Workload(4, 32)
    P = m.num_params
    ddp = evaluate(Plan(dp_replicate=2), m, c, work)
    bd = ddp.memory_breakdown
    assert (bd["params"], bd["grads"], bd["optimizer"]) == (4 * P, 4 * P, 8 * P)
    z1 = evaluate(Plan(dp_shard=2, zero=1), m, c, work).memory_breakdown
    assert (z1["params"], z1["grads"], z1["optimizer"]) == (4 * P, 4 * P, 4 * P)
    z2 = evaluate(Plan(dp_shard=2, zero=2), m, c, work).memory_breakdown
    assert (z2["params"], z2["grads"], z2["optimizer"]) == (2 * P, 2 * P, 4 * P)
    assert z2["compute_copy"] == 4 * P  # fp32: the whole model gathered from fwd to bwd
    z3 = evaluate(Plan(dp_shard=2, zero=3), m, c, work).memory_breakdown
    assert (z3["params"], z3["grads"], z3["optimizer"]) == (2 * P, 2 * P, 4 * P)


def test_zero2_memory_matches_the_zero_paper():
    """ZeRO-2 (P_os+g) for 7.5B parameters on 64 devices: docs/zero.md's 16 Psi / d + 2 Psi
    = 16.9 GB, the ZeRO paper's Table 1 16.6 GB (it keeps 16-bit gradients: 14 Psi / d)."""
    cfg = TransformerConfig(vocab_size=51200, dim=4096, n_layers=36, n_heads=32,
                            max_seq_len=2048, mlp="gelu", norm="layernorm")
    m = from_transformer_config(cfg)
    assert m.num_params == pytest.approx(7.5e9, rel=0.03)
    c = load_cluster("dgx-a100-80gb", devices=64)
    fields = dict(mixed_precision="bf16", activation_checkpointing="full")
    e = evaluate(Plan(dp_shard=64, zero=2, **fields), m, c, Workload(64, 2048))
    bd = e.memory_breakdown
    state = bd["params"] + bd["grads"] + bd["optimizer"] + bd["compute_copy"]
    psi = m.num_params
    assert state == pytest.approx(16 * psi / 64 + 2 * psi)
    assert state / 1e9 == pytest.approx(16.6 * psi / 7.5e9, rel=0.03)
    z1 = evaluate(Plan(dp_shard=64, zero=1, **fields), m, c, Workload(64, 2048))
    assert z1.memory_breakdown["params"] == 4 * psi  # plait's runtime: DDP + ZeRO optimizer
    assert any("every rank" in n for n in z1.notes)
    assert not e.notes


@pytest.mark.parametrize("name", ["lora", "lora_block", "frozen_stage"])
def test_frozen_parameters_hold_no_gradient_and_no_optimizer_state(name):
    """A LoRA-style model (frozen base, small adapters) and one with its first blocks frozen:
    gradients and AdamW state per rank are those of the trainable parameters, as torch holds
    them after a real step on one process (they were priced for every parameter)."""
    from plait.planner.model_stats import from_module
    from tests import _traffic_models as T

    model = T.MODELS[name]()
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 8, (2, 8))
    out = model(ids)
    (out if isinstance(out, torch.Tensor) else out[0]).float().square().mean().backward()
    opt.step()
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    state = sum(t.nbytes for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    params = sum(p.nbytes for p in model.parameters())
    assert grads < params / 1.5  # the model is mostly frozen
    stats = from_module(T.MODELS[name]())
    for layout, shard in (("dp=2", 1), ("dp_shard=2,zero=1", 2)):
        plan = Plan.from_string(layout + ",mp=fp32")
        bd = evaluate(plan, stats, load_cluster("cpu", devices=2), Workload(4, 8)).memory_breakdown
        assert (bd["params"], bd["grads"], bd["optimizer"]) == (params, grads, state / shard)
