"""Whether a model trains with dropout (``ModelStats.dropout``), which decides whether the
planner's activation memory counts dropout masks: from a Hugging Face config of each family,
from a module, and for the presets and published runs."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.plan import Plan
from plait.planner.cost import Workload, evaluate
from plait.planner.hardware import load_cluster
from plait.planner.model_stats import from_hf_config, from_module, load_model
from plait.planner.published import PUBLISHED_RUNS, row_setup, run_setup

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
             intermediate_size=128)


@pytest.mark.parametrize("model_type, keys, expected", [
    # Llama, Mistral, Qwen: attention_dropout
    ("llama", {"attention_dropout": 0.0}, False),
    ("mistral", {"attention_dropout": 0.0}, False),
    ("qwen2", {"attention_dropout": 0.0}, False),
    ("llama", {"attention_dropout": 0.1}, True),
    # GPT-2 / GPT-J / Phi: resid_pdrop, attn_pdrop (embd_pdrop is outside the blocks)
    ("gpt2", {"resid_pdrop": 0.1, "attn_pdrop": 0.1, "embd_pdrop": 0.1}, True),
    ("gpt2", {"resid_pdrop": 0.0, "attn_pdrop": 0.0, "embd_pdrop": 0.1}, False),
    ("gptj", {"resid_pdrop": 0.0, "attn_pdrop": 0.0}, False),
    # GPT-NeoX, BLOOM, Falcon: hidden_dropout and attention_dropout
    ("gpt_neox", {"attention_dropout": 0.0, "hidden_dropout": 0.1}, True),
    ("bloom", {"attention_dropout": 0.0, "hidden_dropout": 0.0}, False),
    # OPT: dropout; BERT: hidden_dropout_prob, attention_probs_dropout_prob
    ("opt", {"dropout": 0.1, "attention_dropout": 0.0}, True),
    ("bert", {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.1}, True),
    ("bert", {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}, False),
    # none named: the family's transformers default (LlamaConfig 0.0, GPT2Config 0.1)
    ("llama", {}, False),
    ("mistral", {}, False),
    ("gpt_neox", {}, False),
    ("gpt2", {}, True),
    ("opt", {}, True),
])
def test_dropout_from_a_config_of_each_family(model_type, keys, expected):
    config = {**SHAPE, "model_type": model_type, **keys}
    assert from_hf_config(config).dropout is expected


class Block(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.0, functional: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        # kept as a number and handed to F.dropout, as Hugging Face attentions do
        self.attention_dropout = functional

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(F.gelu(self.fc1(x)))
        y = F.dropout(y, self.attention_dropout if self.training else 0.0, self.training)
        return x + self.drop(y)


class Net(nn.Module):
    def __init__(self, dropout: float = 0.0, functional: float = 0.0,
                 embed_dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.embed_drop = nn.Dropout(embed_dropout)
        self.blocks = nn.ModuleList(Block(16, dropout, functional) for _ in range(3))
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_drop(self.embed(tokens))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_dropout_from_a_module():
    assert from_module(Net(dropout=0.1)).dropout
    assert not from_module(Net()).dropout
    # a dropout outside the blocks saves no mask per block
    assert not from_module(Net(embed_dropout=0.1)).dropout
    # a model put in eval mode still trains with its p
    assert from_module(Net(dropout=0.1).eval()).dropout
    # a probability kept as a number for F.dropout, also in eval mode (which passes it 0)
    assert from_module(Net(functional=0.1)).dropout
    assert from_module(Net(functional=0.1).eval()).dropout
    with torch.device("meta"):  # as plait plan builds a factory's model
        assert from_module(Net(dropout=0.1)).dropout
        assert not from_module(Net()).dropout


def test_dropout_of_presets_and_published_runs():
    """Llama-family presets and runs train without dropout; Megatron's GPT runs and BLOOM with
    Megatron-LM's 0.1."""
    assert not load_model("llama-70b").dropout
    assert not load_model("llama-8b").dropout
    assert load_model("gpt-175b").dropout
    trained = {run.name: run_setup(run)[0].dropout for run in PUBLISHED_RUNS}
    assert not any(v for k, v in trained.items() if k.startswith(("Llama", "Nemotron")))
    assert all(v for k, v in trained.items() if k.startswith(("GPT", "MT-NLG", "BLOOM")))
    from plait.planner.published import NARAYANAN_2021
    assert all(row_setup(r)[0].dropout for r in NARAYANAN_2021)


def test_a_model_without_dropout_needs_less_activation_memory():
    """The masks are 2 of a Llama block's 40.5 sbh (flash attention): 5% of its activations."""
    base = load_model("llama-8b")
    import dataclasses
    masked = dataclasses.replace(base, dropout=True)
    cluster = load_cluster("dgx-h100", devices=8)
    plan = Plan.from_string("dp_shard=8,zero=3,ac=none,mp=bf16")
    work = Workload(8, 8192)
    without = evaluate(plan, base, cluster, work).memory_breakdown["activations"]
    with_masks = evaluate(plan, masked, cluster, work).memory_breakdown["activations"]
    h, f, kv = 4096, 14336, 1024
    per_token = 2 * h + 2 * (h + 2 * kv) + 2 * h + 2 * h + 8 * f + 4 * h
    blocks = with_masks - without
    assert blocks == pytest.approx(32 * 8192 * 2 * h * 2 / 2)
    assert blocks / (32 * 8192 * per_token) == pytest.approx(2 * h / per_token)
