"""Pipeline parallelism, part 2: stage modules for Hugging Face models.

Hugging Face layers take masks and rotary position embeddings that the model's forward
computes from its input, so a stage cannot feed its hidden states to a layer alone. What HF
offers instead: ``forward(inputs_embeds=h)`` skips the token embedding and builds the mask and
positions from ``h``. So a later stage calls the (skip-replaced) model with ``inputs_embeds=``
its input and the batch's keyword inputs (``attention_mask``, ``token_type_ids``); skipped
layers pass the hidden states through, and a stage without the last layer sends on what
reaches that layer's stand-in. An embedding module that adds positions
and types to the token embedding (BERT's ``embeddings``) is skipped whole on later stages.

:func:`plait.parallel.pipeline_split.build_stage_module` calls these on the outermost HF model
on the path to the blocks; ``transformers`` stays optional (nothing here imports it unless a
model is checked).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch.nn as nn

if TYPE_CHECKING:
    from .pipeline_split import StageSpec


def is_hf_model(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers not installed: no HF models to adapt
        return False
    return isinstance(module, PreTrainedModel)


def hf_added_embeddings(hf: nn.Module, before: list[nn.Module]) -> list[nn.Module]:
    """The embeddings before the layers other than the token embedding (GPT-2's ``wpe``, OPT's
    learned positions): HF decoders add their output to ``inputs_embeds``, so on later stages
    (which receive hidden states that already include them) their stand-in must add zero.

    Other parameterised modules there are refused: whether the decoder adds or applies them
    cannot be told from outside, and a wrong guess trains silently wrong."""
    if getattr(getattr(hf, "config", None), "is_encoder_decoder", False):
        raise ValueError(f"{type(hf).__name__} is an encoder-decoder model: plait's pipeline cuts "
                         f"one stack of blocks, and its decoder's layers read the encoder's "
                         f"output on every stage; run it with pp=1 (dp and zero scale it)")
    get_embeddings = getattr(hf, "get_input_embeddings", None)
    embed = get_embeddings() if callable(get_embeddings) else None
    # A module that holds the token embedding (BERT's ``embeddings``: word, position and
    # token-type embeddings, LayerNorm, dropout) is the embedding stem: HF models call it
    # with ``inputs_embeds=`` and it adds positions and types to them, so on later stages its
    # stand-in passes ``inputs_embeds`` through (the hidden states already went through it).
    other = [m for m in before
             if not any(sub is embed for sub in m.modules())
             and any(p.numel() for p in m.parameters())]
    unknown = [m for m in other if not isinstance(m, nn.Embedding)]
    if unknown:
        names = [n for n, m in hf.named_modules() if any(m is u for u in unknown)]
        raise ValueError(f"{type(hf).__name__} has parameterised modules {names} before its "
                         f"decoder layers that are neither the token embedding nor an "
                         f"embedding added to it; plait's HF pipeline adapter cannot tell how "
                         f"later stages should skip them: run this model with pp=1, or wrap "
                         f"it so those modules live inside the first block")
    return other


def adapt_hf_forward(clone: nn.Module, spec: StageSpec) -> None:
    """Give the stage copy of an HF model a forward that takes hidden states on later stages.

    The user's code calls ``hf(x)`` / ``hf(input_ids=x, attention_mask=m)`` as usual; on every
    stage after the first, ``x`` is the previous stage's hidden states and goes in as
    ``inputs_embeds`` (the keyword inputs, such as the attention mask, reach every stage). No
    KV cache (training). The output is the model's own (a ``ModelOutput``); a stage without
    the last layer sends on what reaches that layer's stand-in
    (:func:`plait.parallel.pipeline_split.hand_on`). A model whose forward takes no
    ``inputs_embeds`` (HF ViT) is refused for every stage but the first.
    """
    forward = type(clone).forward
    if not spec.is_first and "inputs_embeds" not in inspect.signature(forward).parameters:
        raise ValueError(f"{type(clone).__name__}.forward takes no inputs_embeds, so plait's "
                         f"Hugging Face pipeline adapter cannot give stage {spec.index} the "
                         f"hidden states of stage {spec.index - 1}: run this model with pp=1, or "
                         f"wrap it in a module whose forward chains its embeddings, blocks and "
                         f"head")

    def stage_forward(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("use_cache", False)
        if not spec.is_first:
            if args:
                hidden, args = args[0], args[1:]
            else:
                hidden = kwargs.pop("input_ids", None)
            if hidden is not None:
                kwargs["inputs_embeds"] = hidden
                kwargs.pop("input_ids", None)
        return forward(clone, *args, **kwargs)

    clone.forward = stage_forward
