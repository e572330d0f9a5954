"""A small input a model's forward runs on, guessed from the model: what plait runs to record
the blocks torch.fx cannot trace and to check an inferred tensor-parallel plan.

One tensor is enough for most models: token ids for a model with an embedding, features for
one that starts with a linear, images for a convolution stem (:func:`example_input`). A model
that needs more than one input fails on it: an encoder-decoder that does not derive its
decoder's input from its labels (T5 asks for ``decoder_input_ids``), a two-tower model that
encodes text and images in one forward (CLIP asks for ``pixel_values``). Such a model then gets
one value per input its forward names the way Hugging Face names them
(:func:`example_call`): token ids for a parameter ending in ``input_ids``, images for
``pixel_values``. Nothing is inferred from a class name.

A guess can fail: a forward of several inputs (a U-Net's ``forward(x, t)``, a recommender's
dict of features), images of a size none of the tried ones is. The user then hands plait one
batch as ``run.step`` receives it (``run.parallelize(model, example=batch)``), which
:func:`from_batch` turns into the forward's arguments the way ``run.step`` does, labels left
out (but for an encoder-decoder that derives its decoder's input from them); every check that
would guess runs on it instead.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .._torch_compat import pytree, tree_map_only
from .tp_record import fake_forward

# Image (or signal) sizes a conv stem is tried on, most common first: a model with a learned
# position table per patch runs on one size only.
_SPATIAL = (224, 32, 64, 256, 28, 384, 128, 512, 16)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class Example:
    """The inputs of one forward: ``model(*args, **kwargs)``."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to(self, device: str | torch.device) -> Example:
        moved = tree_map_only()(torch.Tensor, lambda t: t.to(device), (self.args, self.kwargs))
        return Example(*moved)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors anywhere in ``value``: an :class:`Example`'s arguments, or a batch nested in
    tuples, lists, dicts and the containers torch's pytree knows (a ``ModelOutput``)."""
    if isinstance(value, Example):
        value = (value.args, value.kwargs)
    return [t for t in pytree()[0](value)[0] if isinstance(t, torch.Tensor)]


# The spelling every message that asks for a real input names.
PASS_EXAMPLE = "pass one batch as run.step takes it: run.parallelize(model, example=batch)"


def from_batch(model: nn.Module, batch: Any) -> Example:
    """The forward's arguments in ``batch``, one batch as ``run.step`` receives it, called as
    :func:`plait.train.call_model` calls the model, its targets left out: ``(inputs, targets)``
    gives ``inputs`` (a tuple's items as positional arguments, a dict's entries by name, or
    whole where the forward takes the dict as its one argument); a dict gives every entry but
    ``labels`` (kept for an encoder-decoder whose decoder reads its inputs off them); a lone
    tensor is the input itself; an :class:`Example` is used as it is; a
    :class:`~plait.MicroBatches` (what ``run.loader`` hands out under ``grad_accum`` for a batch
    that is not one row per example) gives its first micro-batch, whose forward is the one
    every part runs."""
    from ..batch_rows import MicroBatches
    from ..dict_batch import signature_of, whole_dict_parameter

    def of_dict(inputs: dict[str, Any]) -> Example:
        if whole_dict_parameter(signature_of(model.forward), inputs) is not None:
            return Example((inputs,))
        return Example(kwargs=dict(inputs))

    if isinstance(batch, Example):
        return batch
    if isinstance(batch, MicroBatches):
        return from_batch(model, batch.parts[0])
    if isinstance(batch, torch.Tensor):
        return Example((batch,))
    if isinstance(batch, dict):
        keep = "labels" in batch and _decoder_reads_labels(model, batch)
        return of_dict({k: v for k, v in batch.items() if keep or k != "labels"})
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs = batch[0]
        if isinstance(inputs, dict):
            return of_dict(inputs)
        if isinstance(inputs, (tuple, list)):
            return Example(tuple(inputs))
        return Example((inputs,))
    raise ValueError(f"example={type(batch).__name__}: an example is one batch as run.step "
                     f"takes it: (inputs, targets), a dict of the forward's arguments, or the "
                     f"input tensor alone")


def _decoder_reads_labels(model: nn.Module, batch: dict[str, Any]) -> bool:
    """Whether ``model``'s forward builds its decoder's input from ``labels``: it takes both
    ``labels`` and ``decoder_input_ids`` (a Hugging Face encoder-decoder, which shifts the
    labels right when it is given no decoder input) and ``batch`` holds no decoder input. Its
    forward cannot run without them, so the example keeps them (the forward then computes its
    loss too, as it does in ``run.step`` with ``loss_fn=None``)."""
    from ..dict_batch import signature_of

    signature = signature_of(model.forward)
    names = set(signature.parameters) if signature is not None else set()
    return ({"labels", "decoder_input_ids"} <= names
            and not {"decoder_input_ids", "decoder_inputs_embeds"} & set(batch))


def first_and_keywords(model: nn.Module, example: Example) -> tuple[Any, dict[str, Any]] | None:
    """``example`` as ``(first positional argument or None, keyword arguments)``, the form the
    pipeline's meta-device checks call a model with (``model(x, **kwargs)``): a second
    positional argument goes by its name in the forward's signature; None where the forward
    takes ``*args`` or its signature cannot be read."""
    if len(example.args) <= 1:
        return (example.args[0] if example.args else None), dict(example.kwargs)
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*example.args, **example.kwargs)
    except (TypeError, ValueError):
        return None
    kinds = {p.name: p.kind for p in signature.parameters.values()}
    if inspect.Parameter.VAR_POSITIONAL in kinds.values():
        return None
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if kinds[name] == inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return None, named


def run_on(model: nn.Module, example: torch.Tensor | Example) -> Any:
    """``model``'s forward on ``example`` (one tensor, or an :class:`Example`)."""
    if isinstance(example, Example):
        return model(*example.args, **example.kwargs)
    return model(example)


# What fake tensors raise where a forward reads its inputs' values (one_hot, routing tokens
# to experts): the input may well be the right one; it cannot run without real values.
READS_VALUES = ("DynamicOutputShapeException", "DataDependentOutputException")


def _runs(model: nn.Module, example: torch.Tensor | Example, *, values_ok: bool = False
          ) -> bool:
    """Whether ``model``'s forward runs on ``example``, tried on fake tensors; with
    ``values_ok``, also where it stops only because it reads the values (:data:`READS_VALUES`)."""
    try:
        with fake_forward(model):
            run_on(model, example)
    except Exception as exc:  # noqa: BLE001 - not this input
        return values_ok and type(exc).__name__ in READS_VALUES
    return True


def _token_ids(model: nn.Module) -> torch.Tensor | None:
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        return None
    return torch.randint(0, embedding.num_embeddings, (2, 4))


def _first_conv(model: nn.Module) -> nn.Conv1d | nn.Conv2d | nn.Conv3d | None:
    return next((m for m in model.modules() if isinstance(m, _CONVS)), None)


def _images(conv: nn.Conv1d | nn.Conv2d | nn.Conv3d, size: int) -> torch.Tensor:
    """Images (signals, volumes) of ``size`` per side for ``conv``'s channels, a batch of 2."""
    dims = 1 if isinstance(conv, nn.Conv1d) else 2 if isinstance(conv, nn.Conv2d) else 3
    return torch.randn(2, conv.in_channels, *[size] * dims)


def example_input(model: nn.Module) -> torch.Tensor | None:
    """A small input for a shape check: token ids when the model has an ``nn.Embedding`` (a
    model that embeds tokens starts there, wherever it registers the embedding); else, by the
    first Linear or convolution the model registers: features for a Linear; for a convolution,
    images (signals, volumes) of the first common size
    that a forward on fake tensors runs on; None when it cannot tell."""
    ids = _token_ids(model)
    if ids is not None:
        return ids
    first = next((m for m in model.modules() if isinstance(m, (nn.Linear, *_CONVS))), None)
    if isinstance(first, nn.Linear):
        return torch.randn(2, first.in_features)
    if isinstance(first, _CONVS):
        for size in _SPATIAL:
            guess = _images(first, size)
            if _runs(model, guess):
                return guess
    return None


def example_call(model: nn.Module) -> Example | None:
    """Inputs ``model``'s forward runs on (on fake tensors): :func:`example_input` when one
    tensor is enough; else one value per input the forward names as Hugging Face names them
    (token ids for ``*input_ids``, images of the first size that runs for ``pixel_values``);
    else, for a model with a convolution, images of the first size that runs as its one input,
    whatever the forward calls it (``forward(self, images)``, a ViT whose position table is an
    ``nn.Embedding``, which makes :func:`example_input` guess token ids, or whose head is
    registered before its stem). When none runs, :func:`example_input`'s guess (whose error
    says why the model cannot be checked; :func:`describe` says what was tried); None when
    there is none."""
    single = example_input(model)
    if single is not None and _runs(model, single):
        return Example((single,))
    guess = _named_inputs(model, single)
    if guess is not None:
        return guess
    conv = _first_conv(model)
    if conv is not None and not _tried_images(model):
        for size in _SPATIAL:
            images = Example((_images(conv, size),))
            if _runs(model, images) and _runs_for_real(model, images):
                return images
    return None if single is None else Example((single,))


def _tried_images(model: nn.Module) -> bool:
    """Whether :func:`example_input` already tried images on ``model``: it has no embedding and
    its first Linear or convolution is a convolution."""
    if any(isinstance(m, nn.Embedding) for m in model.modules()):
        return False
    first = next((m for m in model.modules() if isinstance(m, (nn.Linear, *_CONVS))), None)
    return isinstance(first, _CONVS)


def _runs_for_real(model: nn.Module, example: Example) -> bool:
    """Whether ``model``'s forward runs on ``example`` for real (eval mode, no gradients, the
    RNG left as it was): a position table that is an ``nn.Embedding`` indexed by patch runs on
    fake tensors for any image size (their values are not checked) and fails for real on one
    with more patches than rows. A model not wholly on the CPU is taken at the fake forward's
    word."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        return True
    training = model.training
    model.train(False)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            run_on(model, example)
    except Exception:  # noqa: BLE001 - not this input
        return False
    finally:
        model.train(training)
    return True


def describe(model: nn.Module, example: Example | None) -> str:
    """What :func:`example_call` tried on ``model``, for a message saying its forward does not
    run on it: the guess it returned, and the image sizes tried for a convolution stem."""
    def shape(v: Any) -> str:
        return (f"{'token ids' if not v.is_floating_point() else 'a tensor'} of shape "
                f"{tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__)
    parts = [] if example is None else [shape(a) for a in example.args] + [
        f"{k}={shape(v)}" for k, v in example.kwargs.items()]
    conv = _first_conv(model)
    if conv is not None:
        sides = ", ".join(str(s) for s in _SPATIAL)
        parts.append(f"images of {conv.in_channels} channels and {sides} pixels a side for its "
                     f"convolution stem")
    return "; ".join(parts) if parts else "nothing (no nn.Embedding, Linear or convolution)"


def _named_inputs(model: nn.Module, single: torch.Tensor | None) -> Example | None:
    """Token ids (``single`` when it is token ids) for every input of ``model``'s forward
    whose name ends in ``input_ids``, a mask of ones of their shape for an ``attention_mask``
    the forward requires (no default: ``forward(input_ids, attention_mask)``), and images for
    ``pixel_values``, when the forward runs on them; else None."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    names = list(parameters)
    embeds = any(isinstance(m, nn.Embedding) for m in model.modules())
    ids = single if embeds else None
    tokens = {n: ids for n in names if n.endswith("input_ids")} if ids is not None else {}
    if tokens and ids is not None:
        tokens |= {n: torch.ones_like(ids) for n, p in parameters.items()
                   if n.endswith("attention_mask") and p.default is inspect.Parameter.empty}
    conv = _first_conv(model)
    sizes: tuple[int | None, ...] = (
        _SPATIAL if "pixel_values" in names and conv is not None else (None,))
    if not tokens and sizes == (None,):
        return None
    for size in sizes:
        images = {} if size is None or conv is None else {"pixel_values": _images(conv, size)}
        guess = Example(kwargs={**tokens, **images})
        if _runs(model, guess, values_ok=True):
            return guess
    return None
