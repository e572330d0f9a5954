"""Tiny Hugging Face transformers models built from their configs (no download), for
tests/test_planner_idioms.py and bench/planner_idioms.py: what the planner prices of a block
a user does not write. Their decoder and encoder layers take more than the hidden states:
Llama's and Qwen2's rotary ``position_embeddings`` (made by the model's ``rotary_emb``) and
an attention mask the model makes (a float mask in eager attention, none under SDPA),
GPT-2's position ids, T5's relative position bias (the first block's); BERT is post-norm (its
attention reads the block's input), T5 a seq2seq whose decoder blocks read the encoder's
output. Sizes match tests/_planner_idioms.py's: width 32, 4 heads, ffn 96, 3 layers,
vocabulary 64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from tests._planner_idioms import FFN, HEADS, LAYERS, VOCAB, WIDTH

SIZES = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN,
             num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=64)


def _build(model_cls: str, config_cls: str, attn: str, **sizes: Any) -> nn.Module:
    import transformers

    config = getattr(transformers, config_cls)(attn_implementation=attn, **sizes)
    return getattr(transformers, model_cls)(config)


def llama_sdpa() -> nn.Module:
    return _build("LlamaForCausalLM", "LlamaConfig", "sdpa", num_key_value_heads=2, **SIZES)


def llama_eager() -> nn.Module:
    return _build("LlamaForCausalLM", "LlamaConfig", "eager", num_key_value_heads=2, **SIZES)


def qwen2() -> nn.Module:
    return _build("Qwen2ForCausalLM", "Qwen2Config", "sdpa", num_key_value_heads=2, **SIZES)


def _gpt2(attn: str) -> nn.Module:
    return _build("GPT2LMHeadModel", "GPT2Config", attn, vocab_size=VOCAB, n_embd=WIDTH,
                  n_inner=FFN, n_layer=LAYERS, n_head=HEADS, n_positions=64, bos_token_id=0,
                  eos_token_id=0)


def gpt2() -> nn.Module:
    return _gpt2("eager")


def gpt2_sdpa() -> nn.Module:
    return _gpt2("sdpa")


def bert() -> nn.Module:
    return _build("BertForMaskedLM", "BertConfig", "eager", **SIZES)


def bert_sdpa() -> nn.Module:
    return _build("BertForMaskedLM", "BertConfig", "sdpa", **SIZES)


def _t5_sizes() -> dict[str, Any]:
    return dict(vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=FFN,
                num_layers=LAYERS, num_heads=HEADS, decoder_start_token_id=0, pad_token_id=0)


def t5_encoder() -> nn.Module:
    return _build("T5EncoderModel", "T5Config", "eager", **_t5_sizes())


class Seq2Seq(nn.Module):
    """A seq2seq model called on token ids alone: the decoder reads the same ids."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, decoder_input_ids=input_ids).logits


def t5() -> nn.Module:
    return Seq2Seq(_build("T5ForConditionalGeneration", "T5Config", "eager", **_t5_sizes()))


# name -> (factory, the block measured: the one the planner prices, a stack's second)
MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "hf_llama_sdpa": (llama_sdpa, "model.layers.1"),
    "hf_llama_eager": (llama_eager, "model.layers.1"),
    "hf_qwen2": (qwen2, "model.layers.1"),
    "hf_gpt2": (gpt2, "transformer.h.1"),
    "hf_gpt2_sdpa": (gpt2_sdpa, "transformer.h.1"),
    "hf_bert": (bert, "bert.encoder.layer.1"),
    "hf_bert_sdpa": (bert_sdpa, "bert.encoder.layer.1"),
    "hf_t5_encoder": (t5_encoder, "encoder.block.1"),
    "hf_t5": (t5, "model.decoder.block.1"),
}


def batch(rows: int, seq: int, seed: int = 0) -> torch.Tensor:
    """Token ids of ``rows`` samples of ``seq`` tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, seq), generator=g)
