"""Whether a model's blocks train with dropout, from a Hugging Face config or an ``nn.Module``.

Dropout with ``p > 0`` saves a one-byte mask per element for backward (Korthikanti et al.
2022: the attention probabilities' mask, and the masks after the attention output and after
the MLP), so a block's activation memory depends on it (:mod:`plait.planner.memory`).
Llama-style models (Llama 2/3, Mistral, Qwen, Nemotron) train with none; GPT-2 and
Megatron-LM's GPT with 0.1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Config keys of a dropout inside the blocks, as each family names it (Llama/Mistral/Qwen:
# attention_dropout; GPT-NeoX/BLOOM/Falcon: hidden_dropout too; GPT-2/GPT-J/Phi: resid_pdrop,
# attn_pdrop; OPT: dropout; BERT: hidden_dropout_prob, attention_probs_dropout_prob;
# GPT-Neo: resid_dropout; Starcoder2: residual_dropout; T5: dropout_rate). Dropouts outside
# the blocks (embd_pdrop, classifier_dropout) save no mask per block.
CONFIG_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "dropout",
               "hidden_dropout_prob", "attention_probs_dropout_prob", "resid_dropout",
               "residual_dropout", "dropout_rate")

# Families whose transformers config class defaults a block dropout above 0 (GPT2Config and
# GPTBigCodeConfig: resid_pdrop = attn_pdrop = 0.1; OPTConfig: dropout 0.1; BertConfig and
# its kin: hidden_dropout_prob 0.1; T5Config: dropout_rate 0.1). Every other family's
# (LlamaConfig, MistralConfig, Qwen2Config, GPTNeoXConfig, BloomConfig, ...) defaults to 0.
_DROPOUT_BY_DEFAULT = ("gpt2", "gpt_bigcode", "opt", "bert", "roberta", "xlm-roberta",
                       "electra", "t5", "mt5")


def config_dropout(data: Mapping[str, Any], model_type: str) -> bool:
    """Whether a Hugging Face config trains its blocks with dropout: any of
    :data:`CONFIG_KEYS` above 0; a config that names none of them means its transformers
    class's default, which is dropout only for the families in ``_DROPOUT_BY_DEFAULT``."""
    named = [data[k] for k in CONFIG_KEYS if isinstance(data.get(k), (int, float))
             and not isinstance(data.get(k), bool)]
    if not named:
        return model_type in _DROPOUT_BY_DEFAULT
    return any(value > 0 for value in named)


def random_modules(model: Any) -> list[str]:
    """Where ``model`` draws random numbers in training: dropout modules with ``p > 0``, and
    modules that keep a dropout probability as a number (``nn.MultiheadAttention.dropout``, a
    Hugging Face attention's ``attention_dropout``), as ``"name (Dropout p=0.1)"``. A module
    in eval mode is listed all the same: it trains with its ``p``.

    One device draws one mask over the global batch; a data-parallel rank (or a pipeline
    microbatch) draws its own over its rows from its own generator state, so no layout that
    splits the batch reproduces the reference's masks: ``plait check`` says so when it fails."""
    import torch.nn as nn

    found = []
    for name, module in model.named_modules():
        where = name or type(model).__name__
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if module.p > 0:
                found.append(f"{where} ({type(module).__name__} p={module.p:g})")
            continue
        for attr, value in vars(module).items():
            if (("dropout" in attr or "pdrop" in attr) and isinstance(value, float)
                    and value > 0):
                found.append(f"{where}.{attr}={value:g}")
    return found


def module_dropout(model: Any, blocks: Sequence[Any]) -> bool:
    """Whether ``model``'s ``blocks`` train with dropout: a dropout module, or a dropout
    probability a module keeps as a number (a Hugging Face attention's ``attention_dropout``,
    which it hands to ``F.dropout`` or to attention's ``dropout_p``), above 0 in a block
    (:func:`random_modules`), in eval mode or not. A probability written into a forward's
    code (``F.dropout(x, 0.1)``) is not read: seeing it takes a forward pass, and one on the
    meta device imports torch's compiler stack, which reading a model must not."""
    del model  # the blocks say it
    return any(random_modules(block) for block in blocks)
