"""Whether a model's blocks train with dropout, from a Hugging Face config or an ``nn.Module``.

Dropout with ``p > 0`` saves a one-byte mask per element for backward (Korthikanti et al.
2022: the attention probabilities' mask, and the masks after the attention output and after
the MLP), so a block's activation memory depends on it (:mod:`plait.planner.memory`).
Llama-style models (Llama 2/3, Mistral, Qwen, Nemotron) train with none; GPT-2 and
Megatron-LM's GPT with 0.1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
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


def module_dropout(model: Any, blocks: Sequence[Any], device_type: str = "cpu") -> bool:
    """Whether ``model``'s ``blocks`` train with dropout: a dropout module or a dropout
    probability kept as a number with ``p > 0`` in a block (:func:`random_modules`), or else a
    call of ``F.dropout`` (``p > 0``) or of ``F.scaled_dot_product_attention`` with
    ``dropout_p > 0`` inside a block during one forward pass on fake tensors in training mode
    (a probability written into the forward, which no attribute shows)."""
    if any(random_modules(block) for block in blocks):
        return True
    return _dropout_called(model, blocks, device_type)


def _dropout_called(model: Any, blocks: Sequence[Any], device_type: str) -> bool:
    """One fake forward of ``model`` in training mode (each module's mode restored after):
    True where a block calls dropout with a probability above 0; False where none does or the
    forward cannot run on fake token ids."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from .tp_trace import _fake_forward

    inside = [0]
    seen = [False]

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if inside[0]:
                if func in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d,
                            F.alpha_dropout, F.feature_alpha_dropout):
                    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
                    seen[0] = seen[0] or float(p) > 0
                elif func is F.scaled_dot_product_attention:
                    p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
                    seen[0] = seen[0] or float(p) > 0
            return func(*args, **kwargs)

    def enter(*_: Any) -> None:
        inside[0] += 1

    def leave(*_: Any) -> None:
        inside[0] -= 1

    @contextlib.contextmanager
    def around() -> Iterator[None]:
        hooks = [h for b in blocks for h in (b.register_forward_pre_hook(enter),
                                              b.register_forward_hook(leave))]
        try:
            with Watch():
                yield
        finally:
            for h in hooks:
                h.remove()

    modes = {m: m.training for m in model.modules()}
    model.train()
    try:
        _fake_forward(model, 8, "fp32", device_type, around)
    finally:
        for m, training in modes.items():
            m.training = training
    return seen[0]
