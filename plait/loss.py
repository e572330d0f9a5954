"""Global-batch loss semantics: the loss one device computes, under every layout.

A loss that is a *mean over counted items* — tokens whose label is not ``ignore_index``, rows of
padding left out, weighted samples — is not the mean of per-rank (or per-micro-batch) means
when the ranks count different numbers of items. plait therefore works with the pair
``(sum over items, number of items)`` for every micro-batch, and the step's loss is

    sum of every micro-batch's sum, over every data rank  /  sum of their counts

which is exactly the mean one device computes over the whole global batch. The count is
all-reduced over the data axes once per step (with the loss sum: one 2-element all-reduce),
and the gradients, which backward computed for the sums, are scaled by ``dp / count`` (data
parallelism averages gradients over its ``dp`` replicas) before clipping and the optimizer step.

What a loss function may return (``loss_fn(output, targets)``):

* ``(sum, count)``: the summed loss of the micro-batch and how many items it sums over (an int
  or a tensor). Use this for weighted samples (``(sum(w * l), sum(w))``) or anything unusual.
* a dict of ``(sum, count)`` pairs, one per term, for a loss whose terms are each averaged
  over a count of their own (a detector's ``sum_box / n_box + sum_cls / n_img``): the step's
  loss is the sum over the terms of (the term's global sum / its global count), see
  :func:`loss_terms` and :func:`term_weights`.
* a scalar: read as the *mean* over the micro-batch's counted items, the count taken from the
  targets by :func:`count_items`: targets with a ``target_lengths`` entry (``F.ctc_loss``'s
  form) count their examples, integer labels count the entries that are not
  ``IGNORE_INDEX`` (-100, the default of ``F.cross_entropy`` and of Hugging Face models), any
  other targets count rows. So ``F.cross_entropy(..., ignore_index=-100)`` (mean reduction),
  Hugging Face's ``output.loss`` and ``F.mse_loss`` are right with no change. A Hugging Face
  CTC model's own loss is read by its ``config.ctc_loss_reduction`` (:func:`ctc_reduction`):
  ``"mean"`` counts its examples; ``"sum"`` is a sum already, counted as the micro-batch's
  part of the step so that the step's count is 1 and it trains one device's sum over the
  global batch. A loss function's reduction is not seen: ``(sum, n / global_batch)`` is a
  sum's pair, ``n`` the micro-batch's examples.

A loss that shifts the labels itself (a causal LM's ``logits[:, :-1]`` against
``labels[:, 1:]``) averages over every label but each row's first. plait learns this from the
loss: on the first micro-batch whose two counts differ it computes the loss again, without
autograd, with each row's first label set to ``IGNORE_INDEX`` (:func:`skips_first_label`). An
unchanged value (where ignoring every other label instead does change it) means the first
labels were never read, and from then on they are not counted. The answer is kept per loss
function for the model's lifetime, so the one or two extra loss calls happen once per run.
On XLA the answer is not read mid-step (that would execute the graph early, a host sync):
the first step computes it on the device and picks the count there (``torch.where``), and it
is read once that step's graph has run (:func:`settle_answers`). A model's own loss
(``loss_fn=None``) cannot be asked again without running the model: a Hugging Face causal LM
is known to shift (:func:`shifts_labels`); any other model's ``output.loss`` is compared with
the mean cross-entropy of its ``output.logits`` against the labels shifted and unshifted
(:func:`own_loss_skips_first_label`), once per run (on XLA on the device, as for a loss
function, :func:`own_loss_skips_first_label_on_device`).

What happens otherwise: a scalar that is *not* a mean over those counted items (a sum, or a mean
over items the targets do not show, such as a class-weighted mean, which divides by the labels'
summed weight) is still weighted by the count, so the layout trains a differently weighted loss
than one device; return ``(sum, count)`` instead. :mod:`plait.mean_probe` asks a scalar loss
whether it is such a mean, and warns when it is not. With every
micro-batch counting the same number of items (no ignored labels), the weighting is uniform
and a scalar of any kind trains what one device trains on the mean of the micro-batch losses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

# The label value losses skip: F.cross_entropy's and Hugging Face's default ignore_index.
IGNORE_INDEX = -100


# Keys other conventions give the targets under: torchvision-style and Hugging Face image
# datasets ("label"), HF's "label_ids" (its default collator renames both to "labels").
_LABEL_LIKE = ("label", "label_ids", "target", "targets")


def missing_labels_fix(keys: Any) -> str:
    """The end of the error for a dict batch without ``labels``: the rename when a key looks
    like the targets (``{"pixels", "label"}``), else nothing."""
    near = [k for k in _LABEL_LIKE if k in keys]
    return (f"; rename {near[0]!r} to 'labels' (in the dataset's __getitem__ or a collate_fn)"
            if near else "")


def count_items(targets: Any, *, shift: bool = False) -> torch.Tensor:
    """How many items a mean loss over ``targets`` averages over (a float 0-dim tensor).

    Targets with a ``target_lengths`` entry (a dict, as ``F.ctc_loss`` takes them): the
    examples, one per length (:func:`_with_lengths`). Integer labels: the entries that are not
    ``IGNORE_INDEX``; with ``shift=True`` the first
    position of every row is dropped first (a causal LM predicts token t+1 from t, so Hugging
    Face's causal-LM loss never reads the first label). A dict: its ``"labels"`` entry if there
    is one, else its first tensor. Anything else: the rows (dim 0) of the first tensor.
    """
    examples = _with_lengths(targets)
    if examples is not None:
        return torch.full((), float(examples.shape[0]), device=examples.device)
    targets = _counted(targets)
    if not isinstance(targets, torch.Tensor):
        return torch.ones(())
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        # A fill on the device, not a host copy (which waits for queued work on a GPU).
        return torch.full((), float(targets.shape[0] if targets.ndim else 1),
                          device=targets.device)
    labels = targets[..., 1:] if shift and targets.ndim > 1 else targets
    return (labels != IGNORE_INDEX).sum().float()


# The key a sequence loss's targets give their lengths under: the argument F.ctc_loss and
# torchaudio's rnnt_loss take them as.
LENGTHS_KEY = "target_lengths"


def _with_lengths(targets: Any) -> torch.Tensor | None:
    """The ``target_lengths`` entry (one per example) of a dict of targets that has one, else
    None. Such targets are labels padded (or concatenated) with their lengths beside them, as
    ``F.ctc_loss`` takes them: their padding is not ``IGNORE_INDEX``, and the losses that take
    them (CTC's and RNN-T's ``reduction="mean"``: each example's loss over its target length,
    then the mean over the examples) average over the examples, not over the labels."""
    if not isinstance(targets, dict):
        return None
    lengths = targets.get(LENGTHS_KEY)
    return lengths if isinstance(lengths, torch.Tensor) and lengths.ndim == 1 else None


def _counted(targets: Any) -> Any:
    """The tensor :func:`count_items` counts: a dict's ``"labels"`` entry (else its first
    tensor), a sequence's first tensor, or ``targets`` itself."""
    if isinstance(targets, dict):
        return targets["labels"] if "labels" in targets else next(
            (v for v in targets.values() if isinstance(v, torch.Tensor)), None)
    if isinstance(targets, (tuple, list)):
        return next((v for v in targets if isinstance(v, torch.Tensor)), None)
    return targets


def _replace_counted(targets: Any, new: torch.Tensor) -> Any:
    """``targets`` with the tensor :func:`_counted` picks replaced by ``new``."""
    old = _counted(targets)
    if isinstance(targets, dict):
        return {k: new if v is old else v for k, v in targets.items()}
    if isinstance(targets, (tuple, list)):
        return type(targets)(new if v is old else v for v in targets)
    return new


def skips_first_label(loss: torch.Tensor, targets: Any,
                      recompute: Callable[[Any], Any]) -> bool | None:
    """Whether a scalar mean loss leaves out each row's first label, as a causal-LM loss that
    shifts (``logits[:, :-1]`` against ``labels[:, 1:]``) does.

    ``recompute(targets)`` computes the same loss on the same outputs, without autograd. With
    every row's first label set to ``IGNORE_INDEX``, a loss that reads those labels averages
    over fewer items and changes: False. If it hardly changes, every label *but* the first
    ones is ignored instead: a loss that reads every label is then the mean of the two values,
    weighed by their counts (the first labels' mean was near the whole's, or every item's loss
    is the same, as under a head initialised to zero): False; a loss that skips the first
    labels has nothing left to average (NaN, or 0) and changes: True. None when this
    micro-batch cannot tell: the targets are not integer labels of two or more dimensions,
    every first label is already ignored (both counts are then equal), or neither holds. On XLA
    :func:`skips_first_label_on_device` asks it instead, without reading the answer mid-step.
    """
    labels = _counted(targets)
    if loss.numel() != 1:  # not a scalar: loss_sum_and_count says what to return instead
        return None
    if (not isinstance(labels, torch.Tensor) or labels.ndim < 2 or labels.shape[-1] < 2
            or labels.is_floating_point() or labels.is_complex()
            or labels.dtype == torch.bool or labels.device.type in ("meta", "xla")):
        return None
    if not bool((labels[..., 0] != IGNORE_INDEX).any()):
        return None
    before = loss.detach().float().reshape(())
    if before.device.type == "meta" or not bool(before.isfinite()):
        return None

    first = _loss_without(labels, slice(0, 1), targets, recompute)
    if first is None:
        return None
    if _moved(first, before):
        return False
    # The loss barely moved: it skips the first labels, or reads them and their mean is
    # within a millionth or so of the whole's (one micro-batch in a hundred of a small LM)
    only = _loss_without(labels, slice(1, None), targets, recompute)
    if only is None:
        return None
    if _mean_of_parts(labels, before, first, only):
        return False
    return True if _moved(only, before) else None


def _moved(after: torch.Tensor, before: torch.Tensor) -> Any:
    """Whether the loss asked again (``after``) is not ``before``, beyond a millionth."""
    return ~torch.isclose(after, before.to(after.device), rtol=1e-6, atol=0.0)


def _mean_of_parts(labels: torch.Tensor, whole: torch.Tensor, without_first: torch.Tensor,
                   first_only: torch.Tensor) -> Any:
    """Whether ``whole`` is the mean over counted labels of its two parts: the loss with the
    first labels ignored and with only them counted, weighed by how many each counts. So reads
    a loss that averages every label, however near the first labels' mean is to the whole's
    (its value then hardly moves without them). A loss that skips them has nothing to average
    with only them (NaN, or 0 where it clamps the count, plus any term of its own, such as an
    auxiliary loss): a tenth of the gap that leaves tells them apart, far above the rounding of
    a float32 sum of a million labels."""
    counted = labels != IGNORE_INDEX
    # float64 where the device has it (a TPU does not: float32 there, whose rounding of the
    # sums stays far inside the tenth for any sequence under a million tokens)
    wide = torch.float32 if whole.device.type == "xla" else torch.float64
    n = counted.sum().to(whole.device, wide)
    r = counted[..., 0].sum().to(whole.device, wide)
    w, a, f = (t.to(whole.device, wide) for t in (whole, without_first, first_only))
    gap = (w * n - (f * r + a * (n - r))).abs()
    return f.isfinite() & a.isfinite() & (gap <= 0.1 * w.abs() * r)


def _loss_without(labels: torch.Tensor, columns: slice, targets: Any,
                  recompute: Callable[[Any], Any]) -> torch.Tensor | None:
    """The loss asked again with ``labels``' ``columns`` ignored (a 0-dim float tensor, no
    gradient), or None when the answer is not one number."""
    probe = labels.clone()
    probe[..., columns] = IGNORE_INDEX
    with torch.no_grad():
        again = _full(recompute(_replace_counted(targets, probe)))
    if not isinstance(again, torch.Tensor) or again.numel() != 1:
        return None
    return again.detach().float().reshape(())


def first_label_skipped(value: Any, targets: Any, recompute: Callable[[Any], Any],
                        known: dict[Any, Any], key: Any) -> bool | torch.Tensor:
    """:func:`skips_first_label` for a loss function's scalar ``value``, asked once per
    ``key`` (the loss function) and kept in ``known``; False for a ``(sum, count)`` pair,
    whose count is the loss's own. On XLA: a 0-dim bool tensor on the device
    (:func:`skips_first_label_on_device`), kept in ``known`` until :func:`settle_answers`."""
    if isinstance(value, (tuple, list, dict)) or _with_lengths(targets) is not None:
        # A pair or terms carry their own counts; labels with lengths are counted per
        # example, and their padding is not IGNORE_INDEX: a loss such as F.ctc_loss would
        # read the probe's -100 as a label index (out of bounds, unchecked on the CPU).
        return False
    if key in known and not isinstance(known[key], torch.Tensor):
        return known[key]
    labels = _counted(targets)
    if isinstance(labels, torch.Tensor) and labels.device.type == "xla":
        return _answer_on_device(known, key, skips_first_label_on_device(_full(value), targets,
                                                                          recompute))
    verdict = skips_first_label(_full(value), targets, recompute)
    if verdict is None:  # this micro-batch cannot tell (its two counts agree, or every
        return False     # item's loss is the same): counted whole, asked again next time
    if len(known) >= 16:  # a loss function made anew every step (a lambda in the loop)
        known.clear()
    known[key] = verdict
    return verdict


def skips_first_label_on_device(loss: torch.Tensor, targets: Any,
                                recompute: Callable[[Any], Any]) -> torch.Tensor | None:
    """:func:`skips_first_label`'s answer as a 0-dim integer tensor on the loss's device (1:
    skips, 0: reads them, -1: this micro-batch cannot tell), computed without reading a value
    on the host, for XLA, where a read mid-step executes the graph early. None when the
    targets' shapes or types already say it cannot tell."""
    labels = _counted(targets)
    if (loss.numel() != 1 or not isinstance(labels, torch.Tensor) or labels.ndim < 2
            or labels.shape[-1] < 2 or labels.is_floating_point() or labels.is_complex()
            or labels.dtype == torch.bool):
        return None
    before = loss.detach().float().reshape(())

    first = _loss_without(labels, slice(0, 1), targets, recompute)
    only = _loss_without(labels, slice(1, None), targets, recompute)
    if first is None or only is None:
        return None
    before = before.to(first.device)
    reads = _moved(first, before) | _mean_of_parts(labels, before, first, only)
    known = (labels[..., 0] != IGNORE_INDEX).any() & before.isfinite()
    verdict = torch.where(reads, 0, torch.where(_moved(only, before), 1, -1))
    return torch.where(known.to(verdict.device), verdict, -1)


def _answer_on_device(known: dict[Any, Any], key: Any, answer: torch.Tensor | None
                      ) -> torch.Tensor | bool:
    """Keep this micro-batch's on-device ``answer`` (1, 0, -1) under ``key`` until
    :func:`settle_answers` reads it, the step's earlier micro-batches' answer first where they
    could tell (as one device asks again after a micro-batch that could not); return whether
    this micro-batch's count leaves the first labels out (a 0-dim bool tensor, or False)."""
    pending = known.get(key)
    if answer is None:
        return pending == 1 if isinstance(pending, torch.Tensor) else False
    if isinstance(pending, torch.Tensor):
        answer = torch.where(pending >= 0, pending, answer.to(pending.device))
    known[key] = answer
    return answer == 1


def settle_answers(known: dict[Any, Any]) -> None:
    """Read the answers :func:`first_label_skipped` left on the device (XLA) once the step's
    graph has run (a copy, no execution): 1 or 0 is kept for the rest of the run, -1 (this
    step's micro-batch could not tell) asked again."""
    for key, answer in list(known.items()):
        if isinstance(answer, torch.Tensor):
            value = int(answer.cpu())
            if value < 0:
                del known[key]
            else:
                known[key] = value == 1


def label_shift(loss_fn: Callable | None, output: Any, value: Any, targets: Any, *,
                known: dict[Any, Any], model_shifts: bool) -> bool | torch.Tensor:
    """Whether the count leaves out each row's first label: for the model's own loss
    (``loss_fn`` None) ``model_shifts`` (:func:`shifts_labels`), else its output's answer
    (:func:`own_loss_skips_first_label`, kept in ``known``); for a loss function, its answer
    (:func:`first_label_skipped`, kept in ``known`` under :func:`_loss_key`)."""
    if loss_fn is None:
        if model_shifts or isinstance(value, (tuple, list)):
            return model_shifts
        if _OWN_LOSS in known and not isinstance(known[_OWN_LOSS], torch.Tensor):
            return known[_OWN_LOSS]
        labels = _counted(targets)
        if isinstance(labels, torch.Tensor) and labels.device.type == "xla":
            return _answer_on_device(known, _OWN_LOSS,
                                     own_loss_skips_first_label_on_device(value, output, targets))
        verdict = own_loss_skips_first_label(value, output, targets)
        if verdict is None:  # this micro-batch cannot tell: counted whole, asked again
            return False
        known[_OWN_LOSS] = verdict
        return verdict
    return first_label_skipped(value, targets, lambda t: loss_fn(output, t), known,
                               _loss_key(loss_fn))


# The key of a model's own loss (``loss_fn=None``) in ``first_label_skipped``'s answers.
_OWN_LOSS = "output.loss"


def own_loss_skips_first_label(value: Any, output: Any, targets: Any) -> bool | None:
    """Whether a model's own scalar loss (``output.loss``, ``loss_fn=None``) leaves out each
    row's first label, as a causal LM that shifts its labels inside ``forward`` does: its
    value is the mean cross-entropy of ``output.logits`` against the labels shifted by one and
    not against them unshifted (computed here without autograd). False, for good, when it is
    neither (label smoothing, an extra term): counted over every label, and not asked again
    (each asking is two cross-entropies over the vocabulary and a host sync). None when this
    micro-batch cannot tell: no logits of the labels' shape, every first label ignored, or both
    match (every item's loss the same). On XLA
    :func:`own_loss_skips_first_label_on_device` asks it instead, without reading the answer
    mid-step."""
    probe = _own_loss_probe(value, output, targets)
    if probe is None or probe[0].device.type in ("meta", "xla"):
        return None
    labels, before, shifted, whole = probe
    if not bool((labels[..., 0] != IGNORE_INDEX).any()) or not bool(before.isfinite()):
        return None

    def near(t: torch.Tensor) -> bool:
        return bool(torch.allclose(t, before.to(t.device), rtol=1e-4, atol=0.0))
    reads_shifted, reads_whole = near(shifted), near(whole)
    if reads_shifted != reads_whole:
        return reads_shifted
    return None if reads_shifted else False


def own_loss_skips_first_label_on_device(value: Any, output: Any, targets: Any
                                         ) -> torch.Tensor | None:
    """:func:`own_loss_skips_first_label`'s answer as a 0-dim integer tensor on the device (1:
    skips, 0: reads them or is neither, -1: this micro-batch cannot tell), computed without
    reading a value on the host, for XLA. None when shapes or types already say it cannot
    tell."""
    probe = _own_loss_probe(value, output, targets)
    if probe is None:
        return None
    labels, before, shifted, whole = probe
    reads_shifted = torch.isclose(shifted, before, rtol=1e-4, atol=0.0)
    reads_whole = torch.isclose(whole, before, rtol=1e-4, atol=0.0)
    verdict = torch.where(reads_shifted != reads_whole, reads_shifted.int(),
                          torch.where(reads_shifted, -1, 0))
    known = (labels[..., 0] != IGNORE_INDEX).any() & before.isfinite()
    return torch.where(known, verdict, -1)


def _own_loss_probe(value: Any, output: Any, targets: Any
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(labels, the model's loss, the mean cross-entropy of ``output.logits`` against the
    labels shifted by one, and against them unshifted), each loss a 0-dim float tensor
    without gradient; None when the output has no logits of the labels' shape or the loss is
    not one number."""
    labels = _counted(targets)
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits",
                                                                            None)
    if (not isinstance(labels, torch.Tensor) or not isinstance(logits, torch.Tensor)
            or labels.ndim < 2 or labels.shape[-1] < 2 or labels.is_floating_point()
            or labels.is_complex() or labels.dtype == torch.bool
            or tuple(logits.shape[:-1]) != tuple(labels.shape)
            or labels.device.type == "meta" or logits.device.type == "meta"):
        return None
    loss = _full(value)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return None
    vocab = logits.shape[-1]
    with torch.no_grad():
        shifted = _full(torch.nn.functional.cross_entropy(
            logits[..., :-1, :].reshape(-1, vocab).float(), labels[..., 1:].reshape(-1)))
        whole = _full(torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab).float(), labels.reshape(-1)))
    before = loss.detach().float().reshape(())
    return (labels, before.to(shifted.device), shifted.float().reshape(()),
            whole.float().reshape(()))


def _loss_key(loss_fn: Callable) -> Any:
    """What identifies a loss across steps: its code with what it closes over and the object
    a method is bound to, so that a lambda written in the training loop (a new object every
    step) is asked once, while two closures from one factory (``make(shift=True)``,
    ``make(shift=False)``) or two instances of one loss class are asked apart."""
    loss_fn = getattr(loss_fn, "guarded_loss", loss_fn)  # plait.parallel.contrastive's guard
    code = getattr(loss_fn, "__code__", None)
    if code is None:
        return loss_fn
    cells: list[int | None] = []
    for cell in getattr(loss_fn, "__closure__", None) or ():
        try:
            cells.append(id(cell.cell_contents))
        except ValueError:  # a cell not yet filled
            cells.append(None)
    return code, id(getattr(loss_fn, "__self__", None)), tuple(cells)


def loss_sum_and_count(value: Any, targets: Any, *, shift: bool | torch.Tensor = False,
                       reduction: str | None = None, share: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss with autograd, count) from what a loss function returned (module docs);
    for a dict of terms, each term's sum and count, as two tensors of one entry per term
    (:func:`loss_terms`).

    ``reduction``: how a model's own loss reduced its examples, where its config says so
    (:func:`ctc_reduction`). ``"mean"``: a mean over the examples, one count per row.
    ``"sum"``: a sum over the examples, which is already the micro-batch's part of one
    device's sum over the global batch; its count is ``share``, the micro-batch's part of the
    step (one over the micro-batches times the ranks whose totals are summed), so that the
    step's counts add up to 1 and its loss and gradients are one device's sum."""
    if isinstance(value, dict):
        return loss_terms(value)
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"a loss function returns a scalar mean or a (sum, count) pair; "
                             f"got a {type(value).__name__} of {len(value)} items")
        total, count = value
        total = _full(total)
        count = torch.as_tensor(_full(count), dtype=torch.float32, device=total.device)
        return total, count.detach().reshape(())
    loss = _full(value)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"the loss function returned {shape}; return a scalar mean "
                         f"(reduction='mean') or a (sum, count) pair")
    if reduction == "sum":
        return loss.reshape(()), torch.full((), share, device=loss.device)
    if reduction == "mean":  # a mean over the examples: one count per row
        labels = _counted(targets)
        rows = labels.shape[0] if isinstance(labels, torch.Tensor) and labels.ndim else 1
        count = torch.full((), float(rows), device=loss.device)
    elif isinstance(shift, torch.Tensor):  # answered on the device (XLA): chosen there
        count = torch.where(shift.to(loss.device), count_items(targets, shift=True).to(
            loss.device), count_items(targets).to(loss.device))
    else:
        count = count_items(targets, shift=shift).to(loss.device)
    # A micro-batch that counts nothing (every label of this rank's rows ignored, as on a
    # context-parallel rank holding only prompt tokens) has a mean of 0/0 = NaN: its sum is 0,
    # as one device summing over the global batch sees it (chosen on the device: no host read).
    # Its gradients are zero either way (a loss over no items reads no logits).
    total = loss.reshape(()) * count
    return torch.where(count > 0, total, torch.zeros_like(total)), count


def loss_terms(value: dict[Any, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(each term's sum, with autograd; each term's count) of a loss function's dict of
    ``(sum, count)`` pairs, as two 1-D tensors in the dict's order.

    Why a form of its own: a loss such as a detector's ``sum_box / n_box + sum_cls / n_img``
    divides each term by its own count over the whole batch, and a sum of ratios is not one
    ``(sum, count)`` pair. Each term's counts are summed over the micro-batches and data
    replicas before backward (:func:`term_weights`), so that the step trains one device's
    sum of ``sum / count`` over the global batch."""
    if not value:
        raise ValueError("the loss function returned an empty dict; return a scalar mean, a "
                         "(sum, count) pair, or a dict of (sum, count) pairs, one per term")
    sums, counts = [], []
    for name, term in value.items():
        if not isinstance(term, (tuple, list)) or len(term) != 2:
            shown = (f"a {type(term).__name__} of {len(term)} items"
                     if isinstance(term, (tuple, list)) else type(term).__name__)
            raise ValueError(
                f"the loss function returned a dict whose {name!r} is {shown}: a dict of "
                f"terms holds one (sum, count) pair per term ({{{name!r}: (loss.sum(), n), "
                f"...}}), each term then divided by its own count over the global batch; for "
                f"one mean loss return it alone, or (sum, count)")
        total = _full(term[0])
        if not isinstance(total, torch.Tensor) or total.numel() != 1:
            got = (tuple(total.shape) if isinstance(total, torch.Tensor)
                   else type(total).__name__)
            raise ValueError(f"the loss function's term {name!r} has a sum of {got}; each "
                             f"term is (summed loss as a 0-dim tensor, count)")
        sums.append(total.reshape(()))
        counts.append(torch.as_tensor(_full(term[1]), dtype=torch.float32,
                                      device=total.device).detach().reshape(()))
    return torch.stack(sums), torch.stack(counts)


def term_weights(counts: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(each term's weight, which term is the reference: a one-hot) for a loss of several
    terms (:func:`loss_terms`), from ``counts``, this rank's count of each term summed over
    its micro-batches, and ``reduce``, which sums a tensor over the data replicas.

    The step's ``(sum, count)`` is then ``(sum over terms of weight * sum, the reference
    term's count)``: with the reference the term of the largest global count ``C_r`` and each
    weight ``C_r / C_k``, the global sum over the global count is ``sum over k of
    S_k / C_k``, one device's loss, and the usual scaling by ``dp / count`` makes its
    gradients. A term that counts nothing anywhere weighs 0 (its sum is 0 as well)."""
    total = reduce(counts.detach().float().clone())
    reference = torch.nn.functional.one_hot(total.argmax(), total.numel()).to(total.dtype)
    weights = torch.where(total > 0, (total * reference).sum() / total.clamp_min(1e-30),
                          torch.zeros_like(total))
    return weights, reference


def _full(t: Any) -> Any:
    """A replicated DTensor loss (vocabulary-parallel head under loss_parallel) as a tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def ctc_reduction(model: nn.Module) -> str | None:
    """``config.ctc_loss_reduction`` of a Hugging Face CTC model (``Wav2Vec2ForCTC``,
    ``HubertForCTC``, ...), else None. ``"mean"``: its ``output.loss`` is ``F.ctc_loss``'s
    mean, each example over its target length and then the mean over the examples, so it is
    counted per example, not per label that is not -100. ``"sum"`` (the config's default):
    the sum over the examples, which one device sums over the whole global batch."""
    for sub in model.modules():
        config = getattr(sub, "config", None)
        reduction = getattr(config, "ctc_loss_reduction", None)
        if type(sub).__name__.endswith("ForCTC") and reduction in ("mean", "sum"):
            return str(reduction)
    return None


def shifts_labels(model: nn.Module) -> bool:
    """True for a Hugging Face causal LM, whose ``output.loss`` skips each row's first label."""
    for sub in model.modules():
        name = type(sub).__name__
        if name.endswith(("ForCausalLM", "LMHeadModel")) and hasattr(sub, "config"):
            return True
    return False


def scale_gradients(parameters: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every gradient by ``factor`` (0-dim), one foreach call per device. A DTensor
    gradient is scaled through its local shard: the same values, without DTensor's per-call
    sharding propagation."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if hasattr(g, "to_local") else g
        by_device.setdefault(local.device, []).append(local)
    with torch.no_grad():
        for device, grads in by_device.items():
            torch._foreach_mul_(grads, factor.to(device))
