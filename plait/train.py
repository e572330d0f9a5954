"""The training step: one call for every plan.

``train_step`` runs forward, backward, gradient clipping and the optimizer step for whatever
layout the model was parallelized with. Pipelined models carry their schedule in their
``Layout`` (see ``plait.parallel.layout``) and take the pipeline branch; everything else runs
gradient accumulation over ``plan.grad_accum`` micro-steps, with gradient synchronisation
switched off on all but the last so that accumulation costs no extra communication. Losses are
summed per micro-batch and divided by the global count of items once per step (``plait.loss``),
so a mean over a variable number of tokens is the mean one device computes.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .batch_rows import MicroBatches, per_example, refuse_ragged
from .dict_batch import signature_of, whole_dict_parameter
from .loss import (
    ctc_reduction,
    label_shift,
    loss_sum_and_count,
    missing_labels_fix,
    scale_gradients,
    shifts_labels,
    term_weights,
)
from .mean_probe import check_mean, own_loss_unexplained, split_batch, weighted_module_count
from .parallel.layout import layout_of
from .plan import Plan

# loss_fn(output, targets) -> a scalar mean over the counted items, (sum, count), or a dict of
# (sum, count) pairs, one per term; see plait.loss. None: the model returns its own loss
# (Hugging Face's output.loss).
LossFn = Callable[[Any, Any], Any]

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Switch gradient synchronisation on or off for DDP and FSDP2 modules alike."""
    if enabled:
        yield
        return
    if isinstance(model, DDP):
        with model.no_sync():
            yield
        return
    set_sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2 (fully_shard)
    if set_sync is None:
        yield
        return
    set_sync(False)
    try:
        yield
    finally:
        set_sync(True)


def autocast(plan: Plan, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 or fp16 compute with fp32 master weights, or nothing for fp32; every layout runs
    its forward under it.

    DDP, TP, pipelines and plain modules rely on it: their parameters and gradients stay fp32
    (the all-reduce then runs in fp32, as the plan promises) and autocast casts each op's
    inputs. FSDP2 also casts whole parameters to bf16/fp16 itself (MixedPrecisionPolicy,
    reducing in fp32), so under ZeRO the ops autocast would cast already receive them so.
    fp16 also needs its loss scaled (``plait.loss_scale``): see :func:`forward_backward`."""
    dtype = _AUTOCAST_DTYPES.get(plan.mixed_precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# How a batch that cannot be cut by rows gets its micro-batches: collated one by one.
COLLATE_EACH = ("load the batches with run.loader(dataset, batch_size, collate_fn=...), which "
                 "collates each micro-batch from its own items, or hand run.step a "
                 "plait.MicroBatches of batches you collated so, ")


def split_microbatches(batch: Any, n: int) -> list[Any]:
    """Split a batch (tensor, or tuple/list/dict of tensors) into ``n`` equal parts along dim 0;
    a :class:`~plait.batch_rows.MicroBatches` is its parts, as they were collated."""
    if isinstance(batch, MicroBatches):
        if len(batch.parts) != n:
            raise ValueError(f"the batch comes as {len(batch.parts)} micro-batches collated one "
                             f"by one (plait.MicroBatches), and the plan runs grad_accum={n}: "
                             f"make the loader under this plan (run.loader collates as many "
                             f"as the plan's grad_accum), or give {n} parts")
        return list(batch.parts)
    if n == 1:
        return [batch]
    refuse_ragged(batch, f"grad_accum={n} micro-batches", "grad_accum=1", fix=COLLATE_EACH)
    return _split(batch, n)


def _split(batch: Any, n: int, path: str = "") -> list[Any]:
    """``batch`` cut into ``n`` parts along dim 0; a list of one dict per example (a
    detector's targets, :func:`~plait.batch_rows.per_example`) by position, each dict whole."""
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % n:
            raise ValueError(f"batch of {batch.shape[0]} rows does not split into {n} equal "
                             f"micro-batches; make the per-replica batch a multiple of {n}")
        return list(batch.chunk(n))
    if per_example(batch, path):
        if len(batch) % n:
            raise ValueError(f"batch entry {path} holds {len(batch)} examples, which do not "
                             f"split into {n} equal micro-batches; make the per-replica batch "
                             f"a multiple of {n}")
        k = len(batch) // n
        return [type(batch)(batch[i * k:(i + 1) * k]) for i in range(n)]
    if isinstance(batch, dict):
        by_key = {k: _split(v, n, f"{path}[{k!r}]") for k, v in batch.items()}
        return [{k: v[i] for k, v in by_key.items()} for i in range(n)]
    if isinstance(batch, (tuple, list)):
        by_field = [_split(v, n, f"{path}[{i}]") for i, v in enumerate(batch)]
        return [type(batch)(p[i] for p in by_field) for i in range(n)]
    raise TypeError(f"cannot split a batch of type {type(batch).__name__} into micro-batches")


def call_model(model: nn.Module, batch: Any, loss_fn: LossFn | None,
               extra: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """Run the model on one (micro-)batch; return (what the loss reads, its targets).

    Batch conventions:

    * ``(inputs, targets)``: ``model(inputs)`` (``model(*inputs)`` for a tuple, ``model(**inputs)``
      for a dict), then ``loss_fn(output, targets)``; targets may be a tensor, tuple or dict.
    * a dict (the Hugging Face convention, ``{"input_ids": ..., "labels": ...}``): with
      ``loss_fn=None`` the model gets every key and computes its own loss (``output.loss``);
      with a ``loss_fn`` the ``labels`` entry is held back from the model and given to
      ``loss_fn(output, labels)``, as the Hugging Face Trainer does.
    * a forward that names none of a dict's keys and takes one argument (``forward(self,
      batch)``) gets the dict whole, ``model(batch)``, in either convention above.

    ``extra``: keyword arguments added to a non-dict model call (context parallelism's
    ``position_ids``, see ``plait.parallel.context.split_batch``).
    """
    extra = extra or {}
    if isinstance(batch, dict) and loss_fn is None and _takes_the_dict(model, batch):
        return model(batch), batch.get("labels")
    if isinstance(batch, dict):
        if loss_fn is None:
            try:
                return by_name(model, batch), batch.get("labels")
            except (RuntimeError, NotImplementedError) as exc:
                if not (layout_of(model).loss_parallel and "DTensor" in str(exc)):
                    raise
                raise type(exc)(
                    f"the model's forward failed on a DTensor: {str(exc).rstrip('.!')}. Tensor "
                    f"parallelism keeps its logits split over the vocabulary (the head is "
                    f"'vocab_head'), and the loss it computes from them: "
                    f"{_SHARDED_LOGITS_FIX}") from exc
        if "labels" not in batch:
            raise ValueError(f"a dict batch with a loss_fn needs a 'labels' entry for it "
                             f"(keys: {sorted(batch)}){missing_labels_fix(batch)}; or pass "
                             f"loss_fn=None when the model computes its own loss from the batch")
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if _takes_the_dict(model, inputs):
            return model(inputs), batch["labels"]
        return by_name(model, inputs), batch["labels"]
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        got = type(batch).__name__
        if isinstance(batch, (tuple, list)):
            kinds = sorted({type(b).__name__ for b in batch})
            got += f" of {len(batch)} items ({', '.join(kinds)})"
            if batch and not isinstance(batch[0], (torch.Tensor, tuple, list, dict)):
                got += (f": the loader collated dataset items that are {kinds[0]}, not "
                        f"(inputs, targets) tensors or a dict; make __getitem__ return those")
        raise ValueError(f"a batch is (inputs, targets) or a dict of model arguments; got {got}")
    inputs, targets = batch
    if isinstance(inputs, dict) and not extra and _takes_the_dict(model, inputs):
        out = model(inputs)
    elif isinstance(inputs, dict):
        out = by_name(model, inputs, extra)
    elif isinstance(inputs, (tuple, list)):
        out = model(*inputs, **extra)
    else:
        out = model(inputs, **extra)
    return out, targets


def by_name(model: nn.Module, inputs: dict[str, Any], extra: dict[str, Any] | None = None
            ) -> Any:
    """``model(**inputs)``; a key the forward has no parameter for (an id the collate keeps
    beside the features) is refused naming it and the forward's parameters, where Python's
    ``TypeError: forward() got an unexpected keyword argument`` says neither where the key
    came from nor what to do."""
    try:
        return model(**inputs, **(extra or {}))
    except TypeError as exc:
        if "unexpected keyword argument" not in str(exc):
            raise
        inner = model.module if isinstance(model, DDP) else model
        signature = signature_of(inner.forward)
        if signature is None or any(p.kind == p.VAR_KEYWORD
                                    for p in signature.parameters.values()):
            raise
        unknown = [k for k in inputs if k not in signature.parameters]
        if not unknown:
            raise
        takes = ", ".join(signature.parameters)
        raise ValueError(
            f"the batch's {', '.join(map(repr, unknown))} is not an argument of "
            f"{type(inner).__name__}.forward({takes}): a dict batch's entries go to the model "
            f"by name (all but 'labels' when a loss_fn is given); drop "
            f"{'it' if len(unknown) == 1 else 'them'} from the batch (the dataset's items or "
            f"the collate_fn), or rename to the argument meant") from exc


def _takes_the_dict(model: nn.Module, batch: dict[str, Any]) -> bool:
    """Whether ``model``'s forward takes a dict batch as its one argument (``forward(self,
    batch)``) rather than its entries by keyword (:func:`plait.dict_batch.whole_dict_parameter`);
    read off the user's module under a DDP wrapper, whose own forward takes anything."""
    inner = model.module if isinstance(model, DDP) else model
    forward = inner.forward
    func = getattr(forward, "__func__", forward)
    try:
        return _whole_dict(func, func is not forward, tuple(batch))
    except TypeError:  # an unhashable callable as the forward: read it each time
        return whole_dict_parameter(signature_of(forward), batch) is not None


@functools.lru_cache(maxsize=64)
def _whole_dict(func: Callable[..., Any], bound: bool, keys: tuple[str, ...]) -> bool:
    """:func:`_takes_the_dict` for the forward's function and the batch's keys, read once
    (``inspect.signature`` of a Hugging Face forward costs ~30 us, on every step otherwise);
    ``bound``: a method, whose first parameter (``self``) the call does not pass."""
    signature = signature_of(func)
    if signature is not None and bound:
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return whole_dict_parameter(signature, keys) is not None


def model_loss(out: Any, loss_fn: LossFn | None, targets: Any) -> Any:
    """``loss_fn(out, targets)``, or the model's own loss (``out.loss``) when loss_fn is None."""
    if loss_fn is not None:
        if _vocab_sharded(out):
            out = _beside_sharded_logits(out)
        try:
            return _a_loss(loss_fn(out, targets))
        except (AttributeError, TypeError) as exc:
            if isinstance(out, dict) and hasattr(exc, "add_note"):  # Python 3.11+
                first = next(iter(out), "logits")
                exc.add_note(f"plait: the model returned a dict (keys: {', '.join(map(str, out))}"
                             f"), which loss_fn(output, targets) receives as it is: read the "
                             f"entry there (output[{first!r}])")
            raise
        except (RuntimeError, NotImplementedError) as exc:
            if not _vocab_sharded(out):
                if isinstance(exc, RuntimeError) and hasattr(exc, "add_note"):  # 3.11+
                    # torch's "result type Float can't be cast to the desired output type
                    # Long" names no argument: say what the loss was given
                    exc.add_note(f"plait: loss_fn(output, targets) got output "
                                 f"{_described(out)} and targets {_described(targets)}")
                raise
            raise type(exc)(
                f"the loss function failed on the model's logits, which tensor parallelism "
                f"keeps split over the vocabulary (a DTensor: the head is 'vocab_head', and the "
                f"loss runs inside torch's loss_parallel()): {str(exc).rstrip('.!')}. "
                f"{_SHARDED_LOGITS_FIX}") from exc
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = summed_losses(out)
    if loss is None and isinstance(out, (tuple, list)) and out and all(
            isinstance(o, dict) for o in out):
        raise ValueError(
            f"loss_fn=None needs a model that returns its own loss, and it returned a "
            f"{type(out).__name__} of {len(out)} dicts (keys: {', '.join(map(str, out[0]))}), "
            f"one per example: a detector's detections, which torchvision-style models return "
            f"in eval mode (run.evaluate runs the model so) in place of their losses. Its "
            f"losses come in training mode only (run.step); score the detections yourself: "
            f"under model.eval() and torch.no_grad(), model(images) on each rank's batch")
    if loss is None:
        raise ValueError(f"loss_fn=None needs a model that returns its own loss (an output with "
                         f".loss, as Hugging Face models do when the batch holds 'labels', or "
                         f"a dict of scalar losses, as torchvision's detectors do in training "
                         f"mode); {_no_loss(out)}: pass a loss_fn")
    return loss


def summed_losses(out: dict[Any, Any]) -> torch.Tensor | None:
    """The sum of a dict of losses (torchvision's detection and segmentation models in
    training mode: ``{"loss_classifier": ..., "loss_box_reg": ...}``, which their reference
    loop sums), or None where a value is not a scalar floating-point tensor (such a dict is
    an output, not its losses). Each is a mean over the micro-batch, weighted so: one device's
    loss where every part's losses are means over its images (parts of equal size)."""
    values = list(out.values())
    if not values or not all(isinstance(v, torch.Tensor) and v.numel() == 1
                             and v.is_floating_point() for v in values):
        return None
    return torch.stack([v.reshape(()) for v in values]).sum()


def _no_loss(out: Any) -> str:
    """What the model returned instead of a loss."""
    if isinstance(out, dict):
        return f"it returned a dict (keys: {', '.join(map(str, out))}) without one"
    return f"it returned {type(out).__name__}, which has none"


def _described(x: Any) -> str:
    """``int64 tensor of shape (8,)`` for a tensor; the type (and keys) of anything else."""
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')} tensor of shape {tuple(x.shape)}"
    if isinstance(x, dict):
        return f"a dict ({', '.join(f'{k}: {_described(v)}' for k, v in x.items())})"
    return type(x).__name__


def _a_loss(value: Any) -> Any:
    """``value`` when a loss function may return it (a tensor, or a pair of them or numbers);
    a number (``loss.item()``) is refused here, before the count and the backward read it."""
    if isinstance(value, dict) and value:  # terms: checked by plait.loss.loss_terms
        first = next(iter(value.values()))
        parts = first if isinstance(first, (tuple, list)) and first else (value,)
    else:
        parts = value if isinstance(value, (tuple, list)) else (value,)
    if isinstance(parts[0], torch.Tensor) or isinstance(value, dict) and not isinstance(
            parts[0], (int, float)):
        return value
    shown = f"{parts[0]!r}"[:40]
    raise ValueError(f"the loss function returned {type(parts[0]).__name__} {shown}, not a "
                     f"tensor (loss.item() or float(loss) leaves autograd); return the loss "
                     f"tensor: a scalar mean (reduction='mean') or a (sum, count) pair")


def _with_graph(total: torch.Tensor) -> torch.Tensor:
    """``total`` when backward can run from it; a loss cut from the model's graph (detached,
    or computed under ``torch.no_grad()``) is refused by name, not by autograd's "element 0 of
    tensors does not require grad"."""
    if torch.is_grad_enabled() and not total.requires_grad:
        raise ValueError("the loss function returned a tensor without an autograd graph "
                         "(detached, or computed under torch.no_grad()); return the loss as "
                         "computed from the model's output")
    return total


# What runs on logits split over the vocabulary, and the way out for a loss that needs more.
_SHARDED_LOGITS_FIX = (
    "F.cross_entropy over the last dimension runs on them as is (reduction 'mean', or 'sum' "
    "and return (sum, count)); a metric counted beside the loss (logits.argmax(-1) == labels) "
    "reads them whole: logits.full_tensor(), a DTensor method that gathers the vocabulary; "
    "a loss that does more with them (multiplies in a mask, mixes "
    "them with plain tensors) needs the head whole: pass options.tp_plan without the "
    "'vocab_embedding' and 'vocab_head' entries")


def _vocab_sharded(out: Any) -> bool:
    """Whether the model's output is (or holds) a DTensor split on its last dimension."""
    from torch.distributed.tensor import DTensor, Shard

    values = out.values() if isinstance(out, dict) else out if isinstance(
        out, (tuple, list)) else (getattr(out, "logits", out),)
    return any(isinstance(v, DTensor) and any(
        isinstance(p, Shard) and p.dim in (-1, v.ndim - 1) for p in v.placements)
        for v in values)


def _beside_sharded_logits(out: Any) -> Any:
    """``out`` with each plain floating-point tensor beside the vocabulary-split logits (an
    auxiliary loss the model returns, such as a mixture of experts' balance loss) made a
    replicated DTensor on the logits' mesh, so a loss that adds it to the cross-entropy stays
    in DTensor arithmetic: a plain tensor mixed with the DTensor loss fails in the backward
    ("got mixed torch.Tensor and DTensor"). Every tensor-parallel rank holds the same plain
    values, which is what Replicate states; the backward hands each rank its gradient as is."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(out, (tuple, list, dict)):
        return out
    mesh = next(v for v in (out.values() if isinstance(out, dict) else out)
                if isinstance(v, DTensor)).device_mesh

    def lift(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.is_floating_point():
            return DTensor.from_local(v, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return v

    if isinstance(out, dict):  # a Hugging Face ModelOutput too: its type and attributes kept
        lifted_map = copy.copy(out)
        for k, v in out.items():
            lifted_map[k] = lift(v)
        return lifted_map
    lifted = [lift(v) for v in out]
    return type(out)(*lifted) if hasattr(out, "_fields") else type(out)(lifted)


# How DDP says, at the next forward, that the last backward left parameters without a gradient
# on this rank (its all-reduce could not finish); torch's advice names DDP's own argument.
DDP_UNUSED = "Expected to have finished reduction in the prior iteration"


# How DTensor refuses an op given a DTensor beside a plain tensor.
_MIXED = "got mixed torch.Tensor and DTensor"


def _mixed_message(model: nn.Module, torch_message: str, plan: Plan | None = None) -> str:
    """DTensor's refusal of a DTensor beside a plain tensor, said for tensor parallelism: the
    weights the plan splits are DTensors, which their layers' forwards handle; a forward that
    reads such a weight itself (a tied embedding's ``self.embed.weight`` in an expression)
    computes with a DTensor beside the plain activations. Names the split layers."""
    import re

    from torch.distributed.tensor import DTensor, Shard

    from .parallel.units import canonical_name

    split: dict[str, None] = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
            tp_dim = (p.device_mesh.mesh_dim_names or ()).index("tp")
            if isinstance(p.placements[tp_dim], Shard):
                layer = canonical_name(name).rpartition(".")[0]
                split[re.sub(r"\.\d+(?=\.|$)", ".*", layer)] = None
    names = list(split)
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    degree = f"tp={plan.tp}" if plan is not None else "tensor parallelism"
    op = torch_message.split(" got mixed")[0].strip()
    return (f"{type(model).__name__ if not isinstance(model, DDP) else type(model.module).__name__}"
            f"'s forward computed with a weight split over {degree} beside plain tensors "
            f"({op} got a DTensor and a torch.Tensor): the weights of {shown} are DTensors, "
            f"which their layers' own forwards handle, and a forward that reads one itself "
            f"(self.embed.weight.mean(0), F.linear(h, self.embed.weight)) mixes the two. Call "
            f"the layer instead (self.embed(ids)), or keep the layer whole: give "
            f"options.tp_plan without it")


def unused_message(model: DDP, torch_message: str, plan: Plan | None = None) -> str:
    """DDP's unused-parameter error as plait's fix: the plan's ``find_unused``, with the names
    of the parameters (torch gives indices into the parameters that require a gradient)."""
    import re

    names = [n for n, p in model.module.named_parameters() if p.requires_grad]
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", torch_message)
    index = [int(i) for i in found.group(1).split()] if found else []
    skipped = [names[i] for i in index if i < len(names)]
    example = (f"{plan.to_string()},find_unused" if plan is not None
               else "dp=2,find_unused")
    which = (f" ({', '.join(skipped[:3])}" + (f" and {len(skipped) - 3} more" if len(skipped) > 3
                                             else "") + ")") if skipped else ""
    return (f"parameters of {type(model.module).__name__}{which} got no gradient on this rank "
            f"in the previous step: its forward skipped them for these rows (an expert no token "
            f"was routed to, a branch for some rows only), so data parallelism could not "
            f"all-reduce their gradients; add find_unused to the plan (e.g. '{example}'), "
            f"which reduces zeros for them")


# The key under which a model's CTC loss reduction is kept in its layout's loss_checks.
_CTC_REDUCTION = "ctc loss reduction"


def forward_loss(model: nn.Module, batch: Any, loss_fn: LossFn | None,
                 extra: dict[str, Any] | None = None, plan: Plan | None = None,
                 share: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss with autograd, item count) of one micro-batch (see ``plait.loss``);
    ``extra``: keyword arguments for the model call (context parallelism's ``position_ids``);
    ``plan``: the one an error's suggested fix is written for; ``share``: the micro-batch's
    part of the step (:func:`step_share`), the count of a model's own loss that is a sum over
    the examples (``plait.loss.loss_sum_and_count``)."""
    try:
        out, targets = call_model(model, batch, loss_fn, extra)
    except RuntimeError as exc:
        if isinstance(model, DDP) and DDP_UNUSED in str(exc):
            raise ValueError(unused_message(model, str(exc), plan)) from exc
        if (_MIXED in str(exc) and exc.__cause__ is None  # not one plait already explained
                and "tensor_parallel" in layout_of(model).applied):
            raise ValueError(_mixed_message(model, str(exc), plan)) from exc
        raise
    value = model_loss(out, loss_fn, targets)
    shift = label_shift(loss_fn, out, value, targets, known=layout_of(model).first_label_skipped,
                        model_shifts=loss_fn is None and shifts_labels(model))
    context = layout_of(model).context
    if context is not None and shift is True:
        from .parallel.context import SHIFTED_LABELS

        raise ValueError(SHIFTED_LABELS.format(cp=context.size))
    checks = layout_of(model).loss_checks
    # a Hugging Face CTC model's own loss is read by its config's reduction (plait.loss),
    # looked up once per model, not in every micro-batch's walk over its modules
    if loss_fn is not None:
        reduction = None
    elif _CTC_REDUCTION in checks:
        reduction = checks[_CTC_REDUCTION]
    else:
        reduction = checks[_CTC_REDUCTION] = ctc_reduction(model)
    if loss_fn is None:
        if reduction is None:
            weighted = weighted_module_count(model, value, out, targets, checks)
            if weighted is not None:  # the mean of a class-weighted loss module the model holds
                total = value.reshape(()) * weighted.to(value.device)
                return (_with_graph(torch.where(weighted > 0, total, torch.zeros_like(total))),
                        weighted)
            if plan is not None and split_batch(plan):
                own_loss_unexplained(value, out, targets, checks, plan)
    elif plan is not None and split_batch(plan) and not isinstance(shift, torch.Tensor):
        check_mean(loss_fn, value, out, targets, shift=shift, known=checks, plan=plan)
    total, count = loss_sum_and_count(value, targets, shift=shift, share=share,
                                      reduction=reduction)
    return _with_graph(total), count


def step_share(micro_batches: int, group: dist.ProcessGroup | None) -> float:
    """One micro-batch's part of the step: one over the micro-batches times the ranks in
    ``group``, over which the step's totals are summed (the data replicas, and their cp ranks;
    None: this rank's totals are the step's, as under XLA SPMD). The shares of a step add up
    to 1."""
    ranks = dist.get_world_size(group) if group is not None else 1
    return 1.0 / (micro_batches * ranks)


def _forward_loss(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The micro-batch's mean loss (sum / count), for callers that want one scalar."""
    total, count = forward_loss(model, batch, loss_fn)
    return (total / count.clamp_min(1)).sum()  # a loss of terms: each over its own count


def sequence_part(model: nn.Module, part: Any
                  ) -> tuple[Any, dict[str, Any], contextlib.AbstractContextManager]:
    """Under context parallelism: this rank's slice of every sequence in ``part``, the
    keyword arguments the model call gets (``position_ids``) and the context its forward and
    backward run in (attention over the whole sequence); else ``part`` unchanged."""
    context = layout_of(model).context
    if context is None:
        return part, {}, contextlib.nullcontext()
    from .parallel.context import cp_attention, split_batch

    local, seq, extra = split_batch(part, context)
    return local, extra, cp_attention(context, seq, whole_model=True)


def loss_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """The context forward+loss+backward run in: torch's ``loss_parallel()`` for models whose
    head keeps vocabulary-sharded logits (tensor parallelism records it in the model's
    ``Layout.loss_parallel``)."""
    if layout_of(model).loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def grad_norm(parameters: list[torch.Tensor],
              pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The global L2 norm of the gradients (a plain 0-dim tensor), across pipeline stages too.

    ``torch.nn.utils.get_total_norm`` already handles DTensor gradients (FSDP/TP shards). With
    pipeline parallelism each rank holds only its stages' gradients, so the squared norms are
    summed over the ``pp`` group (the same norm as one device computes).
    """
    # A tied weight held by two pipeline stages counts once (its copies carry the same grad).
    grads = [p.grad for p in parameters
             if p.grad is not None and not getattr(p, "_plait_tied_copy", False)]
    # A sparse gradient (nn.Embedding/EmbeddingBag with sparse=True) has no norm kernel in
    # torch ("Could not run 'aten::linalg_vector_norm' ... 'SparseCPU'"); its coalesced values
    # (each row summed once) are the same entries as its dense form's non-zeros.
    grads = [g.coalesce().values() if g.is_sparse else g for g in grads]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        squared = norm.pow(2)
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    return norm


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float,
                   pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip the global gradient norm (see :func:`grad_norm`); returns the norm before clipping."""
    norm = grad_norm(parameters, pp_group)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


@dataclass
class TotalsExchange:
    """The step's all-reduce (SUM) of ``[loss sum, count]`` over the data replicas, started once
    the last backward has run. ``items``: this rank's throughput count for the step (tokens or
    samples, read off its batch on the host; the runtime sets it before each step), summed as
    the third value, so that tokens/s is the job's without a collective of its own (data ranks
    can keep different numbers of tokens: padding). ``extra(loss_sum)`` appends values summed
    alongside: the step guard's flags (``plait.guard.StepGuard.local_flags``), so that the guard
    needs no collective of its own either. ``pause``: a context in which the ledger does not
    count it (the runtime's bookkeeping, not the layout's traffic).
    """

    group: dist.ProcessGroup
    extra: Callable[[torch.Tensor], torch.Tensor] | None = None
    pause: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    items: float = 0.0
    _buffer: torch.Tensor | None = None
    _work: Any = None

    def start(self, totals: torch.Tensor) -> None:
        # torch.full is a fill on the device; torch.tensor([...], device=) a host copy that
        # waits for the queued backward on a GPU.
        parts = [totals.detach().float(),
                 torch.full((1,), float(self.items), device=totals.device)]
        if self.extra is not None:
            parts.append(self.extra(totals[0]).float().to(totals.device))
        self._buffer = torch.cat(parts)
        with self.pause():
            self._work = dist.all_reduce(self._buffer, group=self.group, async_op=True)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the global ``[loss sum, count]``, the summed items (a 0-dim tensor on the device,
        read once the step has ended: reading it here would stall the host), the summed extra
        values)."""
        if self._work is None or self._buffer is None:
            raise RuntimeError("TotalsExchange.finish() before start(): forward_backward "
                               "did not reach the last micro-batch's backward")
        self._work.wait()
        self._work = None
        return self._buffer[:2], self._buffer[2], self._buffer[3:]


def forward_backward(model: nn.Module, batch: Any, loss_fn: LossFn | None, *, plan: Plan,
                     device: torch.device, exchange: TotalsExchange | None = None,
                     loss_scale: float = 1.0, dp_group: dist.ProcessGroup | None = None
                     ) -> torch.Tensor:
    """Forward and backward of this rank's ``batch``; returns ``[loss sum, item count]``.

    ``exchange`` (not with pipelines): started with this rank's totals after the last
    backward (see :class:`TotalsExchange`).

    Backward runs on each micro-batch's loss *sum*: the gradients become those of the global
    mean only once :func:`apply_update` scales them by ``dp / global count``. For pipelined
    models the pair is only meaningful on the last stage (NaN elsewhere).

    ``loss_scale`` (fp16, ``plait.loss_scale.LossScaler.backward_factor``): backward runs on
    each sum times it, so that small gradients survive fp16's range; the totals returned are
    the unscaled sums, and :func:`apply_update` divides the gradients by it again.

    A loss of several terms, each over its own count (a dict of ``(sum, count)`` pairs,
    ``plait.loss.loss_terms``), needs every term's global count before the first backward:
    the first micro-batch's forward finds the terms, the later micro-batches run forward once
    more without autograd to count theirs (:func:`_later_counts`), and one all-reduce of the
    counts over the data replicas (``exchange``'s group, else ``dp_group``) weighs the terms.
    """
    from .parallel.buffer_sync import broadcast_written_buffers

    broadcast_written_buffers(model)  # FSDP2: rank 0's buffers on every data rank, as DDP
    pipeline = layout_of(model).pipeline
    if pipeline is not None:  # (sum, count) over its microbatches; backward ran on the sums
        return pipeline.step(batch, loss_fn, plan=plan, device=device, loss_scale=loss_scale)
    micro = split_microbatches(batch, plan.grad_accum)
    totals = torch.zeros(2, device=device)
    weights: tuple[torch.Tensor, torch.Tensor] | None = None
    group = exchange.group if exchange is not None else dp_group
    pause = exchange.pause if exchange is not None else contextlib.nullcontext
    unused = None
    if plan.find_unused and (plan.zero >= 2 or plan.tp > 1):  # FSDP2 reduces zeros for them
        from .parallel.unused import UnusedTracker

        unused = UnusedTracker(model)
    share = step_share(len(micro), group)
    for i, part in enumerate(micro):
        last = i == len(micro) - 1
        part, extra, sequence = sequence_part(model, part)
        # backward inside grad_sync too: FSDP2 reads the flag in backward (a backward
        # outside it reduce-scattered every micro-step); DDP reads it in forward. And inside
        # the cp attention: activation checkpointing recomputes attention in backward.
        with loss_context(model), grad_sync(model, enabled=last), sequence:
            with autocast(plan, device):
                total, count = forward_loss(model, part, loss_fn, extra, plan, share)
            if total.ndim:  # a dict of terms, each over its own global count
                if weights is None:
                    counts = count + _later_counts(model, micro[i + 1:], loss_fn, plan, device)
                    weights = term_weights(counts, _summed_over(group, pause))
                total, count = (weights[0] * total).sum(), (weights[1] * count).sum()
            totals += torch.stack([total.detach().float(), count.float().to(device)])
            if unused is not None:
                unused.note(total)
            (total * loss_scale if loss_scale != 1.0 else total).backward()
    if unused is not None:
        # Every rank runs this step (no pipeline here): the mask is reduced over all of them.
        unused.finish()
    if exchange is not None:
        # After backward, not during it: on gloo a collective in flight beside DDP's bucket
        # all-reduces slowed backward by more than the wait it would hide (10-15 ms of a
        # ~100 ms step for the tiny reference model on 2 CPU processes).
        exchange.start(totals)
    return totals


def _summed_over(group: dist.ProcessGroup | None,
                 pause: Callable[[], contextlib.AbstractContextManager]
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function that sums a tensor over ``group`` in place (the data replicas; nothing to
    do without one), inside ``pause`` (the ledger's: bookkeeping, not the layout's traffic)."""
    def reduce(t: torch.Tensor) -> torch.Tensor:
        if group is not None and dist.get_world_size(group) > 1:
            with pause():
                dist.all_reduce(t, group=group)
        return t
    return reduce


def _later_counts(model: nn.Module, parts: list[Any], loss_fn: LossFn | None, plan: Plan,
                  device: torch.device) -> torch.Tensor | float:
    """Each term's count summed over ``parts`` (the micro-batches after the first), from a
    forward without autograd: a loss of terms weighs them by their global counts before the
    first backward, and a count is the loss function's to give, from the output. The random
    state and the buffers (BatchNorm's running statistics) are put back afterwards, so that
    the real forwards draw and update what one device's do. Costs one forward per later
    micro-batch (grad_accum - 1 of them), and only for a loss of terms."""
    if not parts:
        return 0.0
    counts: torch.Tensor | float = 0.0
    saved = [b.detach().clone() for b in model.buffers()]
    cuda = [device] if device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=cuda):
        for part in parts:
            part, extra, sequence = sequence_part(model, part)
            with sequence, autocast(plan, device):
                _, count = forward_loss(model, part, loss_fn, extra, plan)
            counts = counts + count
        for b, old in zip(model.buffers(), saved, strict=True):
            b.copy_(old)
    return counts


def forward_only(model: nn.Module, batch: Any, loss_fn: LossFn | None, *, plan: Plan,
                 device: torch.device, dp_group: dist.ProcessGroup | None = None
                 ) -> torch.Tensor:
    """``[loss sum, item count]`` of this rank's ``batch`` with no autograd graph and no
    gradients touched: the layout's forward (FSDP's gathers, TP's collectives, a pipeline's
    schedule without backward) and the loss, as :func:`forward_backward` computes them.

    Split into ``plan.grad_accum`` micro-batches as a training step is: the plan chose that
    split for memory, and a whole batch's logits (batch x positions x vocabulary) can outgrow
    it even without an autograd graph. ``dp_group``: the data replicas, over which a loss of
    several terms sums each term's count (see :func:`forward_backward`)."""
    from .parallel.bn_running import average_running_stats
    from .parallel.buffer_sync import broadcast_written_buffers

    average_running_stats(model)  # FSDP2 without sync_bn: one value on every data rank
    broadcast_written_buffers(model)  # and rank 0's other buffers, as DDP
    pipeline = layout_of(model).pipeline
    if pipeline is not None:
        return pipeline.evaluate(batch, loss_fn, plan=plan, device=device)
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    micro = split_microbatches(batch, plan.grad_accum)
    share = step_share(len(micro), dp_group)
    with torch.no_grad(), loss_context(model), autocast(plan, device):
        for part in micro:
            part, extra, sequence = sequence_part(model, part)
            with sequence:
                total, count = forward_loss(model, part, loss_fn, extra, share=share)
            parts.append((total.detach().float().to(device), count.float().to(device)))
    sums = torch.stack([t for t, _ in parts]).sum(0)
    counts = torch.stack([c for _, c in parts]).sum(0)
    if sums.ndim:  # a dict of terms, each over its own global count
        weights, reference = term_weights(counts, _summed_over(dp_group, contextlib.nullcontext))
        sums, counts = (weights * sums).sum(), (reference * counts).sum()
    return torch.stack([sums, counts])


def reduce_totals(totals: torch.Tensor, *, dp_group: dist.ProcessGroup | None,
                  pp_group: dist.ProcessGroup | None, last_pp_rank: int = 0) -> torch.Tensor:
    """``[loss sum, count]`` of the whole global batch, on every rank: one all-reduce over the
    data replicas, and with pipelines a broadcast from the last stage (which alone has it)."""
    totals = totals.detach().float().clone()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.broadcast(totals, src=dist.get_global_rank(pp_group, last_pp_rank), group=pp_group)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(totals, group=dp_group)
    return totals


def pipeline_totals(totals: torch.Tensor, flags: torch.Tensor, *, holds_loss: bool,
                    pp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """With pipelines: the global ``totals`` (``[loss sum, count, ...]``, real only on the last
    stage, which ``holds_loss``) and ``flags`` (the step guard's ``local_flags``) summed, in one
    all-reduce (SUM) over ``pp`` and, with data replicas, one over ``dp``.

    Why a sum and not a broadcast from the last stage: the other stages add zeros, so the
    totals arrive as the last stage's, exactly, and the guard's flags travel in the same
    collective instead of an agreement of their own (one rendezvous per step fewer, which on a
    small step between processes is milliseconds). Returns (the summed totals, the summed
    flags)."""
    values = totals.detach().float() if holds_loss else torch.zeros_like(totals, dtype=torch.float)
    buffer = torch.cat([values, flags.float().to(values.device)])
    if dist.get_world_size(pp_group) > 1:
        dist.all_reduce(buffer, group=pp_group)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(buffer, group=dp_group)
    return buffer[:totals.numel()], buffer[totals.numel():]


def apply_update(optimizer: torch.optim.Optimizer,
                 totals: torch.Tensor | Callable[[], torch.Tensor], *, plan: Plan,
                 pp_group: dist.ProcessGroup | None = None,
                 data_replicas: int | None = None,
                 guard: Callable[[torch.Tensor], bool] | None = None,
                 loss_scale: float = 1.0) -> torch.Tensor:
    """Scale the gradients to the global mean (``dp / count``), clip, step, zero the gradients.
    Returns the global ``[loss sum, count]``.

    ``totals`` is the global ``[loss sum, count]`` from :func:`reduce_totals`, or a function
    that waits for it (``TotalsExchange.finish``): it is called only once the gradient norm has
    been computed, so that the norm's pass over the gradients hides the all-reduce's latency.
    Data parallelism averaged the gradients of the ``dp`` replicas' sums; ``dp / count`` turns
    that average into the gradient of (sum of every sum) / (sum of every count). A batch with
    nothing to count (every label ignored) leaves the gradients zero instead of NaN. Scaling
    and clipping are one multiplication: the norm of the scaled gradients is the scale times
    the norm of the unscaled ones. ``guard(grad_norm)`` (see ``plait.guard``) runs before the
    optimizer step; when it returns False the gradients are dropped and the step is not applied.
    ``loss_scale``: what :func:`forward_backward` multiplied the sums by (fp16), divided out in
    the same factor; a gradient it made overflow makes the norm non-finite, which the guard
    sees (the clipped norm is the job's; without clipping the guard agrees on it).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    clip = plan.grad_clip
    unscaled = grad_norm(params, pp_group) if clip else None
    if callable(totals):
        totals = totals()
    # data_replicas: how many replicas' gradients were averaged (plan.dp; 1 under XLA SPMD,
    # whose one program computes the global batch's gradients). Context-parallel ranks' partial
    # gradients are averaged with them (their sum is a sequence's gradient): dp x cp.
    replicas = plan.dp * plan.cp if data_replicas is None else data_replicas
    factor = replicas / (totals[1].clamp_min(1) * loss_scale)
    norm = None
    if clip and unscaled is not None:
        norm = unscaled * factor.to(unscaled.device)
        # torch.nn.utils.clip_grads_with_norm_'s coefficient, folded into the scale.
        factor = factor * (clip / (norm + 1e-6)).clamp(max=1.0).to(factor.device)
    scale_gradients(params, factor)
    if guard is not None:
        from .guard import local_grad_norm

        if not guard(norm if norm is not None else local_grad_norm(optimizer)):
            optimizer.zero_grad(set_to_none=True)
            return totals
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return totals


def train_step(model: nn.Module, batch: Any, loss_fn: LossFn | None,
               optimizer: torch.optim.Optimizer, *, plan: Plan, device: torch.device,
               dp_group: dist.ProcessGroup | None = None,
               pp_group: dist.ProcessGroup | None = None, last_pp_rank: int = 0
               ) -> torch.Tensor:
    """One optimizer step on this rank's ``batch``: :func:`forward_backward`,
    :func:`reduce_totals`, :func:`apply_update`. Returns the global mean loss (0-dim tensor)."""
    local = forward_backward(model, batch, loss_fn, plan=plan, device=device, dp_group=dp_group)
    totals = reduce_totals(local, dp_group=dp_group, pp_group=pp_group, last_pp_rank=last_pp_rank)
    apply_update(optimizer, totals, plan=plan, pp_group=pp_group)
    return totals[0] / totals[1].clamp_min(1)
