"""Whether a scalar loss is the mean over the items plait counts, and the count of a model's
own class-weighted loss.

plait weighs each micro-batch's scalar loss by the items :func:`plait.loss.count_items` counts
(labels that are not -100, or rows), which is one device's loss over the global batch only if
the scalar *is* the mean over those items. A class-weighted mean is not: ``F.cross_entropy(
logits, y, weight=w)`` and ``F.nll_loss(..., weight=w)`` divide by the labels' summed weight
``w[y].sum()``, which differs between replicas and micro-batches holding other classes (an
imbalanced data set's rare classes land on some of them only), so each part's mean would be
weighted wrongly and the layout would train another model than one device.

plait cannot see inside a loss function, but it can ask it: a mean over counted items, cut
into two sets of rows, is the count-weighted mean of its two halves' values
(:func:`mean_over_counted`). A loss that is not (a weighted mean, a loss over pairs of rows)
is warned about once, with the fix: return ``(sum, count)`` with the weighted count. That
costs two loss calls on halves of the output, without autograd, on the first ``ASKED``
micro-batches of a run, and only when the global batch is split (data parallelism,
``grad_accum``). A loss that gathers other replicas' rows or runs a model of its own is not
asked (:func:`_loss_reaches_beyond`).

A model's own loss (``loss_fn=None``) cannot be asked again without running the model. When the
model holds an ``nn.CrossEntropyLoss`` or ``nn.NLLLoss`` with a ``weight`` whose mean over the
output's logits and the labels is the model's loss, the count is that weighted count
(:func:`weighted_module_count`): exact. A model's loss that is neither that nor the plain mean
cross-entropy of its logits is warned about once (:func:`own_loss_unexplained`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from .loss import IGNORE_INDEX, _counted, _loss_key, count_items
from .warn import user_stacklevel

# Micro-batches a loss function is asked on (the first of each run whose rows can be cut): a
# weighted mean agrees on a micro-batch whose halves hold the same mix of classes, which
# several in a row seldom do. Counted alike on every rank, whatever the answers.
ASKED = 3
# The relative difference between the whole's value times its count and the halves' sums
# beyond which a loss is not a mean over its counted items (float32 rounding is ~1e-7).
RTOL = 1e-4


def split_batch(plan: Any) -> bool:
    """Whether ``plan`` cuts the global batch (data replicas, micro-batches, a pipeline's
    microbatches or sequence chunks), the layouts under which a scalar is weighted by its
    count."""
    return bool(plan.dp > 1 or plan.grad_accum > 1 or plan.cp > 1 or plan.microbatches > 1)


def _rows(tree: Any) -> int | None:
    """The one dim-0 size every tensor in ``tree`` (a tensor, dict, tuple, list or dataclass)
    has; None when they differ, a tensor is 0-dim, another object holds tensors, or there is
    none."""
    sizes: set[int] = set()

    def walk(t: Any) -> bool:
        if isinstance(t, torch.Tensor):
            if t.ndim == 0 or hasattr(t, "full_tensor") or t.device.type in ("meta", "xla"):
                return False
            sizes.add(t.shape[0])
            return True
        if isinstance(t, dict):
            return all(walk(v) for v in t.values())
        if isinstance(t, (tuple, list)):
            return all(walk(v) for v in t)
        if dataclasses.is_dataclass(t) and not isinstance(t, type):
            return all(walk(getattr(t, f.name)) for f in dataclasses.fields(t))
        return not _tensors(t)  # an object holding tensors it cannot be cut through
    return sizes.pop() if walk(tree) and len(sizes) == 1 else None


def _cut(tree: Any, rows: slice) -> Any:
    """``tree`` with every tensor cut to ``rows`` along dim 0, each container of its own
    kind where it can be made again from its entries."""
    if isinstance(tree, torch.Tensor):
        return tree[rows]
    if isinstance(tree, dict):
        cut = {k: _cut(v, rows) for k, v in tree.items()}
        try:  # a dict of its own kind (Hugging Face's ModelOutput, read by attribute)
            return cut if type(tree) is dict else type(tree)(**cut)
        except TypeError:
            return cut
    if isinstance(tree, (tuple, list)):
        return type(tree)(_cut(v, rows) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(tree, **{f.name: _cut(getattr(tree, f.name), rows)
                                            for f in dataclasses.fields(tree) if f.init})
    return tree


def _halves(value: Any, output: Any, targets: Any) -> list[tuple[Any, Any]] | None:
    """``(output, targets)`` cut into their first and second half of rows, or None when the
    probe cannot cut them: ``value`` is not one number with a graph, or the tensors do not
    share one row count of two or more. Decided by shapes alone, which are the same on every
    data rank, so that every rank asks the loss as often (a loss may make collectives)."""
    if (not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad
            or hasattr(value, "full_tensor")):
        return None
    rows = _rows((output, targets))
    if rows is None or rows < 2:
        return None
    return [(_cut(output, half), _cut(targets, half))
            for half in (slice(0, rows // 2), slice(rows // 2, rows))]


# What the autograd node of a collective is called (torch.distributed.nn's and
# run.all_gather's _AllGatherBackward, funcol's), lower-cased without underscores.
_COLLECTIVES = ("allgather", "allreduce", "reducescatter", "alltoall", "broadcast")


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of an output (a tensor, dict, tuple, list or an object's attributes)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (tuple, list)):
        return [t for v in tree for t in _tensors(v)]
    attributes = getattr(tree, "__dict__", None)
    return _tensors(attributes) if isinstance(attributes, dict) else []


def _loss_reaches_beyond(value: torch.Tensor, output: Any) -> bool:
    """Whether the loss function's part of ``value``'s graph (from the loss back to the
    model's outputs) holds a collective or a parameter. A collective: a loss over every
    replica's rows (a contrastive loss gathering with run.all_gather), not a mean over this
    rank's. A parameter: a loss that runs a model of its own (a GAN's generator loss through
    the discriminator), which asking again would run (BatchNorm's statistics updated)."""
    tensors = _tensors(output)
    stops = {t.grad_fn for t in tensors if t.grad_fn is not None}
    leaves = {id(t) for t in tensors if t.grad_fn is None}
    seen: set[Any] = set()
    todo = [value.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stops:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):  # AccumulateGrad: a leaf, a parameter
            if id(variable) not in leaves:
                return True
            continue
        name = type(node).__name__.lower().replace("_", "")
        if any(c in name for c in _COLLECTIVES):
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False


def mean_over_counted(value: Any, output: Any, targets: Any,
                      loss_fn: Callable[[Any, Any], Any], *, shift: bool = False) -> bool | None:
    """Whether the scalar ``value`` of ``loss_fn(output, targets)`` is the mean over the items
    :func:`plait.loss.count_items` counts: ``loss_fn`` is asked again, without autograd, on
    the first and the second half of the rows of ``output`` and ``targets``, and a mean
    satisfies ``n * L = n_a * L_a + n_b * L_b``. None when this micro-batch cannot tell: the
    rows cannot be cut (:func:`_halves`), a half counts nothing, the halves' values agree
    (every row's loss the same), or the loss fails on a half."""
    halves = _halves(value, output, targets)
    if halves is None:
        return None
    return _agrees(value, targets, halves, loss_fn, shift)


def _agrees(value: torch.Tensor, targets: Any, halves: list[tuple[Any, Any]],
            loss_fn: Callable[[Any, Any], Any], shift: bool) -> bool | None:
    """:func:`mean_over_counted`'s answer once the rows are cut: both halves asked first,
    whatever the first one gives, so that every rank makes the same calls."""
    devices = [value.device] if value.device.type == "cuda" else []
    try:  # the random state put back: a loss that draws (dropout) draws as one device's
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            again = [loss_fn(out, part) for out, part in halves]
    except Exception:  # noqa: BLE001 - a loss that cannot take half the rows: cannot tell
        return None
    # Read on the host (Python floats, double precision on any device; a few reads, on the
    # first micro-batches of a run only).
    whole = float(value.detach().float())
    parts = []
    for loss, (_, part) in zip(again, halves, strict=True):
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return None
        parts.append((float(loss.detach().float()), float(count_items(part, shift=shift))))
    (a, n_a), (b, n_b) = parts
    if (min(n_a, n_b) <= 0 or not all(math.isfinite(x) for x in (whole, a, b))
            or math.isclose(a, b, rel_tol=RTOL)):
        return None
    n = float(count_items(targets, shift=shift))
    return math.isclose(n_a * a + n_b * b, n * whole, rel_tol=RTOL)


def check_mean(loss_fn: Callable[[Any, Any], Any], value: Any, output: Any, targets: Any, *,
               shift: bool, known: dict[Any, Any], plan: Any, warn: bool = True) -> bool:
    """Ask :func:`mean_over_counted` on the first ``ASKED`` micro-batches whose rows can be
    cut, and warn once per loss function when it says no, with the fix. Not asked of a loss
    whose graph holds a collective (:func:`_loss_reaches_beyond`) or that plait's contrastive
    guard wraps. ``known`` keeps, per loss (``plait.loss``'s key for it), the micro-batches
    asked and whether it warned.
    Returns True on the call that first found a no (``warn=False``: a pipeline's last stage,
    which has every rank warn instead, :func:`plait.parallel.pipeline.refuse_if_seen`)."""
    key = _loss_key(loss_fn)
    asked, warned = known.get(key, (0, False))
    if asked >= ASKED or getattr(loss_fn, "contrastive_guard", False):
        return False
    halves = _halves(value, output, targets)
    if halves is None:
        return False
    if len(known) >= 16:  # a loss function made anew every step (a lambda in the loop)
        known.clear()
    if asked == 0 and _loss_reaches_beyond(value, output):
        known[key] = (ASKED, False)
        return False
    verdict = _agrees(value, targets, halves, loss_fn, shift)
    known[key] = (asked + 1, warned or verdict is False)
    if verdict is not False or warned:
        return False
    if warn:
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        warnings.warn(not_a_mean_message(name, _counts_what(targets), plan),
                      stacklevel=user_stacklevel())
    return True


def _counts_what(targets: Any) -> str:
    labels = _counted(targets)
    if (isinstance(labels, torch.Tensor) and not labels.is_floating_point()
            and labels.dtype != torch.bool):
        return "its labels that are not -100"
    return "its rows"


def not_a_mean_message(name: str | None, counted: str, plan: Any) -> str:
    """The warning for a scalar loss that is not the mean over the items plait counts
    (``counted``, as :func:`_counts_what` says them); ``name``: the loss function's, where
    known."""
    which = f"the loss function {name}" if name else "the loss function"
    return (f"plait: {which} returned a scalar that is not the mean over {counted}: its value "
            f"on a micro-batch is not the count-weighted mean of its values on the two halves "
            f"of its rows (a class-weighted mean such as F.cross_entropy(..., weight=w) divides "
            f"by the labels' summed weight instead). Under {plan.to_string()} each replica's "
            f"and micro-batch's value is weighed by its count, which trains another model than "
            f"one device. Return (sum, count) instead: (F.cross_entropy(logits, y, weight=w, "
            f"reduction='sum'), w[y[y != -100]].sum()) for class weights; a loss comparing "
            f"rows with each other (in-batch negatives) gathers them with run.all_gather")


# --- a model's own loss (loss_fn=None) ---

# The key of a model's own weighted loss module in ``known`` (the module, or None: none).
_OWN_WEIGHTED = "output.loss weighted"


def _logits_and_labels(output: Any, targets: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(logits, integer labels) where the output's logits are one score per class for each
    label (``logits.shape[:-1] == labels.shape``), else None."""
    labels = _counted(targets)
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits",
                                                                            None)
    if (not isinstance(labels, torch.Tensor) or not isinstance(logits, torch.Tensor)
            or labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool
            or labels.ndim == 0 or tuple(logits.shape[:-1]) != tuple(labels.shape)
            or labels.device.type in ("meta", "xla") or hasattr(logits, "full_tensor")):
        return None
    return logits, labels


def _module_loss(module: nn.Module, logits: torch.Tensor, labels: torch.Tensor
                 ) -> torch.Tensor:
    """``module``'s mean loss of ``logits`` against ``labels``, every position a row."""
    flat, ys = logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)
    weight = cast(torch.Tensor, module.weight).to(flat.device)  # kept: it has one
    if isinstance(module, nn.CrossEntropyLoss):
        return F.cross_entropy(flat, ys, weight=weight, ignore_index=module.ignore_index,
                               label_smoothing=module.label_smoothing)
    return F.nll_loss(flat, ys, weight=weight, ignore_index=cast(int, module.ignore_index))


def _weighted_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules()
            if isinstance(m, (nn.CrossEntropyLoss, nn.NLLLoss))
            and isinstance(m.weight, torch.Tensor) and m.reduction == "mean"]


def weighted_module_count(model: nn.Module, value: Any, output: Any, targets: Any,
                          known: dict[Any, Any]) -> torch.Tensor | None:
    """The summed class weight of the labels (a float 0-dim tensor) when the model's own loss
    ``value`` is the mean of an ``nn.CrossEntropyLoss`` or ``nn.NLLLoss`` with a ``weight``
    that the model holds, over ``output.logits`` and the labels; else None. Which module (or
    none) is found once, on the first micro-batch that shows it, and kept in ``known``."""
    found = _logits_and_labels(output, targets)
    if found is None or not isinstance(value, torch.Tensor) or value.numel() != 1:
        return None
    logits, labels = found
    if _OWN_WEIGHTED not in known:
        candidates = _weighted_modules(model)
        if not candidates:
            known[_OWN_WEIGHTED] = None
            return None
        before = value.detach().float().reshape(())
        with torch.no_grad():
            for module in candidates:
                again = _module_loss(module, logits.detach(), labels)
                if bool(torch.isclose(again, before.to(again.device), rtol=1e-5, atol=0.0)):
                    known[_OWN_WEIGHTED] = module
                    break
            else:
                known[_OWN_WEIGHTED] = None  # none of them is the model's loss
                return None
    module = known[_OWN_WEIGHTED]
    if module is None:
        return None
    counted = labels != module.ignore_index
    weight = module.weight.to(labels.device)
    return weight[torch.where(counted, labels, 0)].mul(counted).sum().float()


# The key of the own-loss check in ``known`` (True once settled).
_OWN_CHECKED = "output.loss checked"


def own_loss_unexplained(value: Any, output: Any, targets: Any, known: dict[Any, Any],
                         plan: Any, warn: bool = True) -> bool:
    """Warn once when the model's own scalar loss is not the mean cross-entropy of its logits
    over the labels that are not -100 (nor over them shifted by one, a causal LM's) and no
    weighted loss module the model holds explains it: plait weighs it by those labels, which
    is one device's loss only if it is a mean over them. Asked once per run. Returns True
    when it found so (``warn=False``: a pipeline's last stage, which has every rank warn,
    :func:`plait.parallel.pipeline.refuse_if_seen`)."""
    if known.get(_OWN_CHECKED) or known.get(_OWN_WEIGHTED) is not None:
        return False
    found = _logits_and_labels(output, targets)
    if found is None or not isinstance(value, torch.Tensor) or value.numel() != 1:
        return False
    logits, labels = found
    if not bool((labels != IGNORE_INDEX).any()):
        return False
    before = value.detach().float().reshape(())
    with torch.no_grad():
        flat = logits.detach().reshape(-1, logits.shape[-1]).float()
        means = [F.cross_entropy(flat, labels.reshape(-1))]
        if labels.ndim > 1 and labels.shape[-1] > 1:
            means.append(F.cross_entropy(logits[..., :-1, :].reshape(-1, logits.shape[-1])
                                         .float(), labels[..., 1:].reshape(-1)))
    known[_OWN_CHECKED] = True
    if any(bool(torch.isclose(m, before.to(m.device), rtol=1e-4, atol=0.0)) for m in means):
        return False
    if warn:
        warnings.warn(own_loss_message(plan), stacklevel=user_stacklevel())
    return True


def own_loss_message(plan: Any) -> str:
    """The warning for a model's own loss that plait cannot explain as a mean over the labels
    it counts (:func:`own_loss_unexplained`)."""
    return (
        f"plait: the model's own loss (output.loss) is not the mean cross-entropy of its "
        f"output.logits over the labels that are not -100, and plait weighs each replica's "
        f"and micro-batch's loss by those labels under {plan.to_string()}. A mean over them "
        f"(label smoothing, a term averaged the same way) trains as one device; a "
        f"class-weighted mean does not (nn.CrossEntropyLoss(weight=w) made inside forward): "
        f"hold the loss module as an attribute of the model (plait then reads its weight), or "
        f"pass a loss_fn returning (sum, count), e.g. (F.cross_entropy(logits, y, weight=w, "
        f"reduction='sum'), w[y[y != -100]].sum())")
