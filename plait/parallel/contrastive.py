"""Two-tower contrastive models (CLIP and its kin) under data parallelism: a loss over the whole
batch needs the other replicas' rows, and a step that computes it without them is refused.

A contrastive loss (CLIP's, SigLIP's) scores every text of a batch against every image of it:
each row's loss depends on every other row. One device computes it over the global batch; a
data replica sees only its own rows and computes another loss, over fewer negatives, whose
gradients are not one device's. Averaging the replicas' losses does not give the global one
back, so nothing after the loss can repair it: the loss must read every replica's rows, which
``run.all_gather`` gives (:mod:`plait.parallel.gather`). A model's own loss (Hugging Face's
``CLIPModel(..., return_loss=True)``) is computed inside its forward from the rows it got, where
no gather can reach, so it is refused under data parallelism; a loss function is refused when
it returns without having called ``run.all_gather``.

Such models are recognised by the learned temperature of their loss: a parameter named
``logit_scale`` (CLIP, CLAP, OWL-ViT, GroupViT, open_clip's models) or ``logit_bias``
(SigLIP), which exists only to scale an in-batch similarity matrix. Gradient accumulation and
a pipeline's micro-batches are not refused: there one device accumulating over the same chunks
is the reference (``run.all_gather``'s docs), as for every other loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

from .units import canonical_name

_TEMPERATURES = ("logit_scale", "logit_bias")


def contrastive_parameters(model: nn.Module) -> list[str]:
    """Names (without wrappers such as DDP's ``module.``) of ``model``'s parameters that are
    a contrastive loss's temperature or bias."""
    return [canonical_name(name) for name, _ in model.named_parameters()
            if name.rsplit(".", 1)[-1] in _TEMPERATURES]


def _cause(model: nn.Module, found: list[str], dp: int) -> str:
    inner = getattr(model, "module", model)  # DDP's wrapper: the user's class is inside
    return (f"{type(inner).__name__} has {', '.join(found[:2])}: a contrastive loss over the "
            f"whole batch (every row against every other row), and each of the {dp} data "
            f"replicas holds 1/{dp} of the global batch, so a loss over its own rows is not "
            f"the loss one device computes")


def own_loss_refusal(model: nn.Module, found: list[str], dp: int) -> str:
    """The message for ``loss_fn=None`` on a contrastive model under data parallelism."""
    return (f"{_cause(model, found, dp)}; its own output.loss (loss_fn=None) is computed "
            f"inside its forward, where no replica sees the others' rows: pass a loss_fn that "
            f"gathers the embeddings with run.all_gather (e.g. out.text_embeds and "
            f"out.image_embeds, scaled by logit_scale.exp()), or train with dp=1")


def ungathered_refusal(model: nn.Module, found: list[str], dp: int) -> str:
    """The message for a loss function that returned without calling ``run.all_gather``."""
    return (f"{_cause(model, found, dp)}; the loss function returned without calling "
            f"run.all_gather: gather the embeddings it compares with run.all_gather(t) "
            f"(labels from run.all_gather(t, return_index=True)), or train with dp=1 (a loss "
            f"that scores each row on its own, with no in-batch negatives, is read as "
            f"contrastive by the parameter's name: give the parameter another name)")


def guard_loss(model: nn.Module, loss_fn: Any, dp: int, gathers: Callable[[], int],
               found: list[str]) -> Any:
    """``loss_fn`` as the step should call it: refused (ValueError, before any backward) on a
    contrastive model under ``dp`` > 1 data replicas unless each call gathers; ``gathers()``
    counts the run's ``run.all_gather`` calls so far; ``found``: the model's
    :func:`contrastive_parameters`. Anything else passes as it is."""
    if dp <= 1 or not found:
        return loss_fn
    if loss_fn is None:
        raise ValueError(own_loss_refusal(model, found, dp))

    def gathered(out: Any, targets: Any) -> Any:
        before = gathers()
        value = loss_fn(out, targets)
        if gathers() == before:
            raise ValueError(ungathered_refusal(model, found, dp))
        return value

    # What plait keys per-loss answers on (plait.loss._loss_key): the user's loss, not this
    # wrapper, which is made anew each step.
    gathered.guarded_loss = loss_fn  # type: ignore[attr-defined]
    # Every call gathers (or is refused): plait's mean check leaves it alone.
    gathered.contrastive_guard = True  # type: ignore[attr-defined]
    return gathered


def chunked_message(loss_fn: Any, plan_parts: str, parts: int, found: list[str],
                    gathered: bool) -> str:
    """The warning for a loss over the whole batch computed on each of ``parts`` parts."""
    name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
    what = ("gathers rows with run.all_gather" if gathered else
            f"is a contrastive loss (the model has {', '.join(found[:2])})")
    return (f"plait: the loss function {name} {what}, a loss over the whole batch (in-batch "
            f"negatives, a balance loss over the batch's tokens), and {plan_parts} computes "
            f"it on each of {parts} parts of the global batch apart: each part's rows are "
            f"compared with that part's rows (of every replica) only, which is one device "
            f"accumulating gradients over those {parts} parts, not one device's loss over "
            f"the whole batch. For the whole batch in one loss set grad_accum=1 (and "
            f"microbatches=1 under pp); to keep {plan_parts}, know that the loss is the mean "
            f"of the parts' losses")


def warn_chunked(loss_fn: Any, parts: int, plan_parts: str, gathers: Callable[[], int],
                 found: list[str], warned: list[bool]) -> Any:
    """``loss_fn`` as the step should call it when gradient accumulation or a pipeline's
    microbatches cut the global batch into ``parts`` > 1 parts: it warns once (``warned``
    holds whether it did) when a call gathers with ``run.all_gather`` or the model is
    contrastive (``found``), since such a loss over each part is not the loss over the whole
    batch. Anything else passes as it is."""
    if parts <= 1 or loss_fn is None or warned[0]:
        return loss_fn
    import warnings

    from ..warn import user_stacklevel

    def chunked(out: Any, targets: Any) -> Any:
        before = gathers()
        value = loss_fn(out, targets)
        if not warned[0] and (gathers() > before or found):
            warned[0] = True
            inner = getattr(loss_fn, "guarded_loss", loss_fn)
            warnings.warn(chunked_message(inner, plan_parts, parts, found, gathers() > before),
                          UserWarning, stacklevel=user_stacklevel())
        return value

    # keyed on the user's loss as the guard is; the mean check still asks of it (any loss
    # under grad_accum), unless the guard inside makes every call gather
    chunked.guarded_loss = getattr(loss_fn, "guarded_loss", loss_fn)  # type: ignore[attr-defined]
    chunked.contrastive_guard = getattr(  # type: ignore[attr-defined]
        loss_fn, "contrastive_guard", False)
    return chunked
