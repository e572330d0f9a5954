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

import torch
import torch.nn as nn

from .contrastive import contrastive_parameters
from .hf import transformers_class

if TYPE_CHECKING:
    from .pipeline_split import StageSpec


def is_hf_model(module: nn.Module) -> bool:
    pretrained = transformers_class("", "PreTrainedModel")
    return pretrained is not None and isinstance(module, pretrained)


def hf_added_embeddings(hf: nn.Module, before: list[nn.Module], path: str) -> list[nn.Module]:
    """The modules before the layers (``path``, the block sequence in ``hf``) other than the
    token embedding whose output the decoder adds to ``inputs_embeds`` (GPT-2's ``wpe``, OPT's
    learned positions): on later stages, which receive hidden states that already include them,
    their stand-in must add zero. Every other one is applied to the hidden states (BLOOM's
    LayerNorm of the embeddings), so its stand-in passes them on, as they already went through
    it.

    An embedding is taken as added. For any other parameterised module, one forward of the
    model on fake tensors shows whether its output is added to something
    (:func:`plait.parallel.pipeline_split.additive_by_running`); where that forward cannot
    run on a guessed input, the model is refused: a wrong guess trains silently wrong."""
    if getattr(getattr(hf, "config", None), "is_encoder_decoder", False):
        raise ValueError(f"{type(hf).__name__} is an encoder-decoder model: plait's pipeline cuts "
                         f"one stack of blocks, and its decoder's layers read the encoder's "
                         f"output on every stage; run it with pp=1 (dp and zero scale it)")
    # A two-tower contrastive model runs both stacks on every step; a vision-and-language
    # model whose image tower a text-only batch never calls keeps its pipeline.
    others = other_block_stacks(hf, path) if contrastive_parameters(hf) else []
    if others:
        raise ValueError(f"{type(hf).__name__} has more than one stack of blocks ({path} and "
                         f"{', '.join(others)}: two towers, as CLIP's text and vision "
                         f"encoders): plait's pipeline cuts one stack into stages and cannot cut "
                         f"a forward that runs two; run it with pp=1 (dp and zero scale it)")
    holder = bias_holder(hf, path)
    if holder:
        raise ValueError(f"{type(hf).__name__}'s {holder} computes the relative position bias "
                         f"that every later block of {path} reads (T5's position_bias, handed "
                         f"on by the stack's forward): a stage without that block would run "
                         f"its blocks without the bias; run it with pp=1 (dp and zero scale it)")
    embed = _input_embeddings(hf)
    # A module that holds the token embedding (BERT's ``embeddings``: word, position and
    # token-type embeddings, LayerNorm, dropout) is the embedding stem: HF models call it
    # with ``inputs_embeds=`` and it adds positions and types to them, so on later stages its
    # stand-in passes ``inputs_embeds`` through (the hidden states already went through it).
    other = [m for m in before
             if not any(sub is embed for sub in m.modules())
             and any(p.numel() for p in m.parameters())]
    unknown = [m for m in other if not isinstance(m, nn.Embedding)]
    if not unknown:
        return other
    names = {id(m): n for n, m in hf.named_modules()}
    added = _added_by_running(hf, path)
    if added is None:
        listed = [names[id(u)] for u in unknown]
        raise ValueError(f"{type(hf).__name__} has parameterised modules {listed} before its "
                         f"decoder layers that are neither the token embedding nor an "
                         f"embedding added to it, and its forward does not run on a guessed "
                         f"input to show whether it adds or applies them; plait's HF pipeline "
                         f"adapter cannot tell how later stages should skip them: run this "
                         f"model with pp=1, or wrap it so those modules live inside the first "
                         f"block")
    return [m for m in other if isinstance(m, nn.Embedding) or names[id(m)] in added]



def _input_embeddings(hf: nn.Module) -> nn.Module | None:
    """The model's token embedding, or None for a model without one: Hugging Face's
    ``get_input_embeddings`` raises NotImplementedError for models on other inputs
    (``Wav2Vec2Model``'s raw samples)."""
    get_embeddings = getattr(hf, "get_input_embeddings", None)
    if not callable(get_embeddings):
        return None
    try:
        embed = get_embeddings()
    except NotImplementedError:
        return None
    return embed if isinstance(embed, nn.Module) else None


def other_block_stacks(hf: nn.Module, path: str) -> list[str]:
    """Names of ``hf``'s module lists of two or more blocks of one class, with parameters,
    other than the stack at ``path`` and outside it (a second tower's encoder layers; a
    mixture of experts' list inside a block is not one)."""
    found: list[str] = []
    for name, m in hf.named_modules():
        if (not isinstance(m, nn.ModuleList) or len(m) < 2 or name == path
                or name.startswith(path + ".") or path.startswith(name + ".")
                or any(name.startswith(f + ".") for f in found)):
            continue
        kinds = {type(c) for c in m}
        if len(kinds) == 1 and any(p.numel() for p in m.parameters()):
            found.append(name)
    return found


def bias_holder(hf: nn.Module, path: str) -> str:
    """The name of the module in the stack at ``path`` that alone computes a relative
    attention bias the others reuse (T5's ``relative_attention_bias``, in block 0 only:
    ``has_relative_attention_bias``), or ``""``."""
    stack = hf.get_submodule(path) if path else hf
    holders = [f"{path}.{name}" for name, m in stack.named_modules()
               if getattr(m, "has_relative_attention_bias", False) is True]
    with_flag = [m for m in stack.modules() if hasattr(m, "has_relative_attention_bias")]
    return holders[0] if holders and len(holders) < len(with_flag) else ""


def _added_by_running(hf: nn.Module, path: str) -> set[str] | None:
    """The modules beside the blocks whose output ``hf``'s forward adds to something, seen in
    one forward on fake tensors of a guessed input; None when it cannot run."""
    from .pipeline_split import additive_by_running
    from .tp_example import example_input
    from .tp_record import fake_forward

    example = example_input(hf)
    if example is None:
        return None
    try:
        with fake_forward(hf):
            hf(example)  # the guess runs at all: else additive_by_running finds nothing
            return additive_by_running(hf, path, example, {})
    except Exception:  # noqa: BLE001 - not runnable on the guess
        return None


# The keyword under which the last stage of a model that pools at its last non-pad token gets
# the batch's token ids (see :func:`pools_by_pad_token`); popped before the model's forward.
TOKEN_IDS = "_plait_token_ids"


def pools_by_pad_token(hf: nn.Module) -> bool:
    """Whether ``hf``'s head reads its token ids after its base model: a decoder's sequence
    classifier (Llama's, GPT-2's, Gemma 3's, Qwen 3.5's ``...ForSequenceClassification``)
    pools the logits at each row's last token that is not the pad token, found in
    ``input_ids``. Given ``inputs_embeds`` instead, as a later pipeline stage is, it pools at
    the last position, a padding token under right padding, and trains on another model's
    output.

    Seen in one forward on fake tensors of a guessed input (:func:`_reads_ids_outside_base`):
    what the forward does, however its class hands the call on (Gemma 3's forward calls the
    shared one of its base class) and wherever it keeps the pad token (a text sub-config).
    Where that forward cannot run, read from the source of every ``forward`` in the class's
    MRO (:func:`_pad_pooling_in_source`)."""
    seen = _reads_ids_outside_base(hf)
    return _pad_pooling_in_source(hf) if seen is None else seen


def _embedding_holders(hf: nn.Module) -> list[nn.Module]:
    """The modules of ``hf`` (not ``hf`` itself) that hold its token embedding: the base model
    and the stack inside it (TrOCR calls its ``model.decoder`` directly), which a later
    pipeline stage gives ``inputs_embeds`` in place of the token ids."""
    get_embeddings = getattr(hf, "get_input_embeddings", None)
    try:
        embed = get_embeddings() if callable(get_embeddings) else None
    except (NotImplementedError, AttributeError):
        embed = None
    if not isinstance(embed, nn.Module):
        return []
    return [m for m in hf.modules() if m is not hf and any(sub is embed for sub in m.modules())]


def _reads_ids_outside_base(hf: nn.Module) -> bool | None:
    """Whether a forward of ``hf`` on a guessed input of token ids runs an op on them outside
    the modules that embed them (the head's pooling); metadata (shape, device) does not
    count. None when ``hf`` has no token embedding or the forward cannot run on fake tensors
    (with and without an attention mask: HF checks unmasked ids for padding, and some
    models check a given mask for it, reads of values fake tensors do not have)."""
    from torch.overrides import TorchFunctionMode

    from .tp_record import fake_forward

    holders = _embedding_holders(hf)
    embed = holders[-1] if holders else None
    if not isinstance(embed, nn.Embedding):
        return None
    # Token ids below the embedding's size (example_input's guess takes the first embedding,
    # which in a multimodal model may be the vision tower's positions). Fake tensors carry no
    # values, so any ids do; not drawn at random, which would move this rank's generator alone.
    example = torch.arange(8, device=embed.weight.device).reshape(2, 4) % embed.num_embeddings
    metadata = {"__get__", "size", "dim", "numel", "stride", "__len__", "is_floating_point",
                "get_device", "is_contiguous"}
    inside = [0]  # depth of calls into the modules that embed the ids
    read: list[str] = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            flat = [*args, *kwargs.values()]
            flat += [x for a in flat if isinstance(a, (list, tuple)) for x in a]
            if (not inside[0] and getattr(func, "__name__", "") not in metadata
                    and any(a is example for a in flat)):
                read.append(getattr(func, "__name__", str(func)))
            return func(*args, **kwargs)

    def enter(*_: Any, **__: Any) -> None:
        inside[0] += 1

    def leave(*_: Any, **__: Any) -> None:
        inside[0] -= 1

    handles = [h for m in holders
               for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        for extra in ({}, {"attention_mask": torch.ones_like(example)}):
            read.clear()
            inside[0] = 0
            try:
                with fake_forward(hf), Watch():
                    hf(input_ids=example, **extra)
            except Exception:  # noqa: BLE001 - not runnable on this guess
                continue
            return bool(read)
        return None
    finally:
        for h in handles:
            h.remove()


def _pad_pooling_in_source(hf: nn.Module) -> bool:
    """The fallback of :func:`pools_by_pad_token`: some ``forward`` in the class's MRO (the
    one the class calls, or a base class's it hands on to) names both ``input_ids`` and
    ``pad_token_id``, and the config (or its text sub-config) sets a pad token."""
    if pad_token_of(hf) is None:
        return False
    for cls in type(hf).__mro__:
        forward = vars(cls).get("forward")
        try:
            source = inspect.getsource(forward) if forward is not None else ""
        except (OSError, TypeError):
            continue
        if "pad_token_id" in source and "input_ids" in source:
            return True
    return False


def pad_token_of(hf: nn.Module) -> Any:
    """``hf``'s pad token id, from its config or the text sub-config a multimodal one nests."""
    config = getattr(hf, "config", None)
    found = getattr(config, "pad_token_id", None)
    text_config = getattr(config, "get_text_config", None)
    if found is None and callable(text_config):
        found = getattr(text_config(), "pad_token_id", None)
    return found


def _drop_ids_beside_embeds(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """Forward pre-hook: given ``inputs_embeds``, the token ids the model reads for its pooling
    are not given to its base model too (HF models take exactly one of the two)."""
    if kwargs.get("inputs_embeds") is None:
        return args, kwargs
    kwargs.pop("input_ids", None)
    return ((None, *args[1:]) if args else args), kwargs


def reentrant_checkpointing(hf: nn.Module) -> list[str]:
    """The modules of ``hf`` whose Hugging Face gradient checkpointing is on with
    ``use_reentrant=True`` (``gradient_checkpointing_enable(gradient_checkpointing_kwargs=
    {"use_reentrant": True})``, or torch's default when not given). Reentrant checkpointing
    cannot give a stage's input its gradient through ``torch.autograd.grad``, which torch's
    pipeline stages call: the later stage raises in its first backward, the earlier one
    waits for that gradient until the timeout."""
    found = []
    for name, module in hf.named_modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if not getattr(module, "gradient_checkpointing", False) or func is None:
            continue
        if getattr(func, "keywords", {}).get("use_reentrant") is not False:
            found.append(name or type(module).__name__)
    return found


def router_loss_refusal(model: str, given: str, stages: int) -> str:
    """Why a mixture-of-experts model asked for its routers' logits is refused under a
    pipeline: its balance loss is computed from the router logits of every layer, and the
    last stage, which computes the loss, runs only its own layers (the others stand in)."""
    return (f"{model} is asked for its routers' logits ({given}), from which it adds a "
            f"balance loss over every layer's router; under pp={stages} the stage that computes "
            f"the loss holds only its own layers, so that loss would count their routers alone "
            f"and train another model: run with pp=1 (zero=3 or tp split the model instead), "
            f"or set output_router_logits=False under a pipeline")


def adapt_hf_forward(clone: nn.Module, spec: StageSpec, *, is_root: bool = True) -> None:
    """Give the stage copy of an HF model a forward that takes hidden states on later stages.

    The user's code calls ``hf(x)`` / ``hf(input_ids=x, attention_mask=m)`` as usual; on every
    stage after the first, ``x`` is the previous stage's hidden states and goes in as
    ``inputs_embeds`` (the keyword inputs, such as the attention mask, reach every stage). No
    KV cache (training). The output is the model's own (a ``ModelOutput``); a stage without
    the last layer sends on what reaches that layer's stand-in
    (:func:`plait.parallel.pipeline_split.hand_on`). A model whose forward takes no
    ``inputs_embeds`` (HF ViT) is refused for every stage but the first.

    A model that pools at its last non-pad token (:func:`pools_by_pad_token`) gets the batch's
    token ids on its last stage under :data:`TOKEN_IDS` (the pipeline runner adds them when
    this model is the one it runs) and reads them for its pooling, its base model the hidden
    states; inside a model of the user's, whose input need not be the token ids, it is refused.
    """
    forward = type(clone).forward
    if spec.num_stages > 1 and getattr(getattr(clone, "config", None), "output_router_logits",
                                       False):
        raise ValueError(router_loss_refusal(type(clone).__name__, "config.output_router_logits"
                                             "=True", spec.num_stages))
    reentrant = reentrant_checkpointing(clone) if spec.num_stages > 1 else []
    if reentrant:
        shown = ", ".join(reentrant[:3]) + (f" (+{len(reentrant) - 3} more)"
                                            if len(reentrant) > 3 else "")
        raise ValueError(f"{type(clone).__name__} has gradient checkpointing on with "
                         f"use_reentrant=True ({shown}); under pp={spec.num_stages} each stage "
                         f"takes its input's gradient with torch.autograd.grad, which reentrant "
                         f"checkpointing cannot give: call model.gradient_checkpointing_enable("
                         f"gradient_checkpointing_kwargs={{'use_reentrant': False}}) (the same "
                         f"gradients), or put activation_checkpointing=full in the plan instead")
    # Only the last stage pools; a model inside the user's is refused on every stage.
    pools = (spec.num_stages > 1 and (spec.is_last or not is_root)
             and pools_by_pad_token(clone))
    if pools and not is_root:
        raise ValueError(f"{type(clone).__name__} pools its logits at each row's last token that "
                         f"is not pad_token_id={pad_token_of(clone)}, "
                         f"which it finds in "
                         f"input_ids; inside another module under pp={spec.num_stages}, its last "
                         f"stage gets hidden states only and would pool at the last position "
                         f"(padding, under right padding): pass {type(clone).__name__} itself "
                         f"to run.parallelize, or run with pp=1")
    if not spec.is_first and "inputs_embeds" not in inspect.signature(forward).parameters:
        raise ValueError(f"{type(clone).__name__}.forward takes no inputs_embeds, so plait's "
                         f"Hugging Face pipeline adapter cannot give stage {spec.index} the "
                         f"hidden states of stage {spec.index - 1}: run this model with pp=1, or "
                         f"wrap it in a module whose forward chains its embeddings, blocks and "
                         f"head")

    hooked: list[nn.Module] = []  # the base model, once its pre-hook is registered

    def stage_forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("output_router_logits"):
            raise ValueError(router_loss_refusal(type(clone).__name__,
                                                 "output_router_logits=True", spec.num_stages))
        kwargs.setdefault("use_cache", False)
        positions = kwargs.get("position_ids")
        if spec.context_parallel and positions is not None and kwargs.get(
                "attention_mask") is None:
            # Without a KV cache (use_cache=False) and without a mask, transformers reads
            # position ids that jump (a cp slice's head and tail chunks) as packed sequences
            # and builds a mask of its own, which cp's attention cannot split; an all-ones
            # padding mask says there is none to build (SDPA then runs causal, unmasked).
            kwargs["attention_mask"] = torch.ones(positions.shape, dtype=torch.long,
                                                  device=positions.device)
        token_ids = kwargs.pop(TOKEN_IDS, None)
        if not spec.is_first:
            if args:
                hidden, args = args[0], args[1:]
            else:
                hidden = kwargs.pop("input_ids", None)
            if hidden is not None:
                kwargs["inputs_embeds"] = hidden
                kwargs.pop("input_ids", None)
            if pools and spec.is_last and token_ids is not None and not args:
                base = getattr(clone, getattr(clone, "base_model_prefix", ""), None)
                if isinstance(base, nn.Module) and not hooked:
                    base.register_forward_pre_hook(_drop_ids_beside_embeds, with_kwargs=True)
                    hooked.append(base)
                kwargs["input_ids"] = token_ids
        return forward(clone, *args, **kwargs)

    clone.forward = stage_forward
