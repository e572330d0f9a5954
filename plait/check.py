"""`plait check`: prove a layout trains the same model as one device.

Runs a few optimizer steps of a model under ``plan`` on ``plan.world_size`` processes and the
same steps on one process (same seed, same global batches), then compares the loss of every step
and every parameter after the last step. This is also the harness the test suite uses for each
parallelism, so "tested against a single-device reference" means exactly this code.

Parameters are compared by their *canonical* names, the names in the user's unwrapped model
(``plait.parallel.units.canonical_name``: wrappers such as DDP's ``module.``, checkpointing and
torch.compile are stripped), DTensor shards (TP, FSDP) are gathered into full tensors, and
pipeline stages pool their parameters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn as nn

from .parallel.layout import local_modules
from .parallel.tp_record import quiet_logger
from .parallel.units import canonical_name, user_name
from .plan import Plan
from .planner.dropout import random_modules
from .progress import Stages
from .spawn import run_distributed, user_errors
from .user_factory import build_parts, dataset_refusal, factory_or_preset, pipeline_refusal


def full_state(model: nn.Module, pp_group: dist.ProcessGroup | None = None, *,
               buffers: bool = False, user_names: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` as a full fp32 CPU tensor under its canonical name.

    With ``buffers``: what ``model.state_dict()`` of the one-device model holds, so that the
    original model's ``load_state_dict`` takes it as it is: the persistent buffers too (integer
    ones, such as BatchNorm's step count, keep their dtype; a non-persistent one, such as a
    rotary embedding's frequency table, is left out) and a tied weight under each of its names.

    With ``user_names``: the names the one-device model's ``state_dict()`` gives, a
    submodule the user named ``module`` (``AveragedModel.module``) kept: only the ``module``
    part that follows a DDP wrapper is dropped, where :func:`canonical_name` drops every one
    (it cannot tell the two apart from a name alone).

    Collective: every rank of the job must call it. With pipelines, stages pool their
    parameters over ``pp_group`` so each rank returns the whole model.
    """
    state: dict[str, torch.Tensor] = {}
    for module in local_modules(model):
        if user_names:
            # where DDP wraps a module (the root, or inside: an AveragedModel of a DDP model)
            wrapped = {n for n, m in module.named_modules()
                       if isinstance(m, (nn.parallel.DistributedDataParallel, nn.DataParallel))}
            rename: Callable[[str], str] = partial(user_name, wrapped=wrapped)
        else:
            rename = canonical_name
        named: list[tuple[str, torch.Tensor]] = (
            list(module.state_dict(keep_vars=True).items()) if buffers
            else list(module.named_parameters()))
        for name, p in named:
            if not isinstance(p, torch.Tensor):  # extra state a module keeps in its state_dict
                continue
            t = p.detach()
            if hasattr(t, "full_tensor"):
                # Gathering a (dp_shard, tp) parameter takes one all-gather per mesh axis, and
                # torch logs a performance warning on every rank saying so; this path is for
                # inspection and export, not the step.
                with quiet_logger("torch.distributed.tensor._redistribute"):
                    t = t.full_tensor()
            t = t.float() if t.is_floating_point() else t
            state[rename(name)] = t.cpu().clone()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        parts: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, state, group=pp_group)
        state = {k: v for part in parts for k, v in part.items()}
    return state


def _some(names: list[str]) -> str:
    """Up to three names, and how many more."""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def _named(name: str) -> str:
    """`` (name)`` after a figure, or `` (every parameter bitwise equal)`` when no parameter
    differs at all, so none is the worst."""
    return f" ({name})" if name else " (every parameter bitwise equal)"


# Default tolerances (``tolerance=None``), by optimizer. Losses: relative difference per step.
# Parameters: per tensor, the norm of the difference over the norm of how far the reference
# moved the tensor from its initial value (a wrong layout moves it elsewhere by a fraction of
# that; fp32 rounding by far less). SGD's update is linear in the gradient, so rounding stays
# rounding. Adam divides by sqrt(v): for entries whose gradient is pure rounding noise it turns
# noise of 1e-9 into a full step of +-lr, so a few entries differ by up to 2*lr per step while
# the rest match; the tensor-norm ratio keeps that small but not at fp32 level. Measured on the
# reference "test" model, 5 steps: losses within 1.8e-7 relative under dp=2, tp=2 and ZeRO-3
# with either optimizer; parameters within 1.7e-5 (SGD, lr 0.1) and 3.7e-5 (AdamW, lr 1e-3) of
# their displacement. The bounds leave a margin of 6x and 27x over that.
# A tensor that barely moves would make that ratio divide rounding by almost nothing: a
# projection whose gradient is tiny at initialisation, or one whose gradient is zero in exact
# arithmetic (an attention key bias: softmax ignores a shift shared by every key), which then
# moves by rounding noise alone. So a tensor's displacement counts as at least DISPLACEMENT_FLOOR
# of the larger of its own norm and what the whole model moved per entry, at its size. With the
# SGD bound such a tensor must match to 1e-6 of that, a few fp32 rounding steps, which a wrong
# layout does not reach. Adam cannot be held to this for a zero-gradient tensor: it scales the
# noise up to a sizeable fraction of a real step (m / (sqrt(v) + eps) with m, sqrt(v) ~ noise),
# differently on each layout: such tensors are judged by the rule below instead, and a FAIL
# whose losses match (but not its gradients) names SGD as the check to run.
DISPLACEMENT_FLOOR = 1e-2
# Adam's noise, judged where it arises. A tensor whose gradient, before the optimizer step, is
# at most GRAD_NOISE of the model's gradient per entry (at its size) on one device in every
# step has a gradient that is zero in exact arithmetic: what fp32 leaves of a sum that cancels.
# Measured on stock BERT and ViT from a config (2 layers): their attention key biases sit at
# 1e-11 to 2e-9 of that; the smallest real gradient (a query or key weight at initialisation)
# at 3.6e-5. Adam's step on such a tensor follows the noise's sign, differently on each
# layout, so its parameters have no one-device value to match; instead, (1) the layout's
# gradient of it must be noise too (a layout that gives it a real gradient FAILs), and (2)
# its parameters may differ by no more than two runs of Adam's largest steps apart
# (:func:`adam_reach`), beyond which no noise can take them.
GRAD_NOISE = 1e-6
# Gradient norms of one tensor on the two sides, relative to the reference's (at least
# DISPLACEMENT_FLOOR of the model's per entry, at its size): measured within 3.1e-6 on BERT,
# ViT and the reference "test" model under tp=2, pp=2 and ZeRO-2/3, 5 steps; gradients summed
# over dp=2 instead of averaged are 1 apart at the first step.
GRADIENTS_DIFFER = 1e-3
ADAM_BETAS = (0.9, 0.999)
TOLERANCES = {"sgd": {"loss": 1e-5, "param": 1e-4}, "adamw": {"loss": 1e-5, "param": 1e-3}}
# Under mixed precision each op rounds to 8 (bf16) or 11 (fp16) bits of mantissa, and a layout
# that splits the batch or a matmul rounds different partial sums: the two runs then differ by
# that rounding, not fp32's. Measured on the reference "test" model, 5 steps, under dp=2, tp=2,
# fsdp=2 and pp=2: bf16 losses within 2.0e-4 relative, parameters within 1.2e-3 (SGD) and 4.5e-2
# (AdamW) of their displacement; fp16 7e-6, 1.4e-4 and 1.9e-2. The bounds leave a margin of 4x
# to 14x over that; a layout error (a gradient not averaged, a tie broken) moves parameters by
# a large fraction of their displacement, and a plan checked without mixed_precision is held
# to the fp32 bounds above.
REDUCED_TOLERANCES = {
    "bf16": {"sgd": {"loss": 2e-3, "param": 1e-2}, "adamw": {"loss": 2e-3, "param": 0.2}},
    "fp16": {"sgd": {"loss": 1e-4, "param": 2e-3}, "adamw": {"loss": 1e-4, "param": 0.1}},
}


def adam_reach(lr: float, steps: int, betas: tuple[float, float] = ADAM_BETAS) -> float:
    """How far, per entry, two runs of Adam(W) of ``steps`` steps at ``lr`` can take one
    parameter apart when its gradients are noise of any sign: twice the sum of the largest
    step of each. Step t moves an entry by lr * |m_t / sqrt(v_t)| (bias-corrected, eps
    ignored: it only shrinks the step), and by Cauchy-Schwarz, with m_t = sum a_i g_i and
    v_t = sum b_i g_i^2, |m_t| / sqrt(v_t) <= sqrt(sum a_i^2 / b_i) whatever the gradients
    (1 at step 1, 1.011 at step 5 for the default betas). Weight decay moves both runs alike."""
    b1, b2 = betas
    total = 0.0
    for t in range(1, steps + 1):
        total += math.sqrt(sum(
            ((1 - b1) * b1 ** (t - i) / (1 - b1 ** t)) ** 2
            / ((1 - b2) * b2 ** (t - i) / (1 - b2 ** t)) for i in range(1, t + 1)))
    return 2 * lr * total


def noise_gradients(norms: dict[str, list[float]], sizes: dict[str, int],
                    reference: dict[str, list[float]] | None = None) -> set[str]:
    """The tensors of ``norms`` (each step's gradient norm by name) whose gradient is at most
    ``GRAD_NOISE`` of the model's per entry (at the tensor's size) in every step: zero but
    for rounding. ``reference``: the per-entry scale comes from these norms instead (so that
    a layout's gradients are held to one device's scale)."""
    scale_from = reference if reference is not None else norms
    names = [n for n in scale_from if n in sizes]
    entries = sum(sizes[n] for n in names)
    steps = min((len(v) for v in scale_from.values()), default=0)
    if not entries or not steps:
        return set()
    per_entry = [math.sqrt(sum(scale_from[n][t] ** 2 for n in names) / entries)
                 for t in range(steps)]
    # A gradient exactly zero (or none) in every step is not noise: Adam's step is then exact
    # (nothing, or the weight decay alone), and the displacement rule holds.
    return {n for n, v in norms.items() if n in sizes and len(v) >= steps and any(v) and all(
        v[t] <= GRAD_NOISE * per_entry[t] * math.sqrt(sizes[n]) for t in range(steps))}


def tolerances(optimizer: str, precision: str = "fp32") -> dict[str, float]:
    """The default relative bounds for ``optimizer`` (``"sgd"`` or ``"adamw"``) when the plan
    computes in ``precision``."""
    table = REDUCED_TOLERANCES.get(precision, TOLERANCES)
    return table.get(optimizer, table["adamw"])


@dataclass
class CheckResult:
    plan: str
    world_size: int
    steps: int
    losses_reference: list[float]
    losses_parallel: list[float]
    max_loss_diff: float
    max_param_diff: float
    worst_param: str
    missing: list[str] = field(default_factory=list)
    # Absolute tolerance on losses and parameters; None: the relative criteria below.
    tolerance: float | None = None
    optimizer: str = "adamw"
    max_loss_rel: float = 0.0          # max over steps of |loss diff| / |reference loss|
    max_param_rel: float = 0.0         # max over tensors of |diff| / |reference displacement|
    worst_param_rel: str = ""
    # Tensors whose copies on two ranks differ by more than the parameter bound ("name (ranks
    # 0 and 1)"): a replicated weight one rank stepped differently, which comparing rank 0's
    # copy with one device need not show.
    replicas_differ: list[str] = field(default_factory=list)
    # Modules that draw random numbers while training (dropout with p > 0), as
    # :func:`random_modules` names them: a reason for a FAIL no layout can remove.
    random: list[str] = field(default_factory=list)
    # Why BatchNorm layers train otherwise under this plan ("" when they do not): per-rank
    # statistics without sync_bn, or a step's batch normalised piece by piece.
    batchnorm: str = ""
    precision: str = "fp32"            # the plan's mixed_precision: what the bounds allow for
    # Under Adam: tensors whose gradient is rounding noise on one device (GRAD_NOISE), judged
    # by adam_reach instead of their displacement; the worst of them as |diff| / reach (<= 1
    # passes); and those of them the layout gave a real gradient (a FAIL).
    noise_gradients: list[str] = field(default_factory=list)
    max_noise_rel: float = 0.0
    worst_noise: str = ""
    noise_reach: float = 0.0           # adam_reach: per entry, what noise can move apart
    real_gradient: list[str] = field(default_factory=list)
    # Gradients before the optimizer step (their norms, per tensor and step), where both sides
    # recorded them: the largest relative difference and where. Not a verdict (the parameters
    # are); it tells a layout's wrong gradient from an optimizer's amplified noise.
    max_grad_rel: float = 0.0
    worst_grad: str = ""
    # Persistent buffers (BatchNorm's running statistics): the worst floating one as the norm of
    # its difference over how far the reference moved it (at least DISPLACEMENT_FLOOR of its
    # norm), held to the parameter bound; integer ones (a step count) must be equal, and are
    # listed where they are not.
    max_buffer_rel: float = 0.0
    worst_buffer: str = ""
    buffers_differ: list[str] = field(default_factory=list)

    @property
    def limits(self) -> dict[str, float]:
        return tolerances(self.optimizer, self.precision)

    @property
    def ok(self) -> bool:
        if self.missing or self.replicas_differ or self.real_gradient or self.buffers_differ:
            return False
        if self.max_noise_rel > 1.0 or math.isnan(self.max_noise_rel):
            return False
        if not self.max_buffer_rel <= self.limits["param"]:
            return False
        if self.tolerance is not None:
            return self.max_loss_diff <= self.tolerance and self.max_param_diff <= self.tolerance
        return (self.max_loss_rel <= self.limits["loss"]
                and self.max_param_rel <= self.limits["param"])

    def format(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        if self.tolerance is not None:
            rule = f"tolerance {self.tolerance:g} absolute"
        else:
            mixed = "" if self.precision == "fp32" else f", {self.precision}"
            rule = (f"{self.optimizer}{mixed}: loss within {self.limits['loss']:g} relative, "
                    f"parameters within {self.limits['param']:g} of their displacement")
        lines = [f"{verdict}: {self.plan} on {self.world_size} ranks vs 1 device, "
                 f"{self.steps} steps ({rule})",
                 f"  max |loss diff|  {self.max_loss_diff:.3e} ({self.max_loss_rel:.2e} "
                 f"relative)",
                 f"  max |param diff| {self.max_param_diff:.3e}{_named(self.worst_param)}; "
                 f"relative to displacement {self.max_param_rel:.2e}"
                 f"{_named(self.worst_param_rel)}"]
        if self.worst_buffer:
            lines.append(f"  buffers: relative to displacement {self.max_buffer_rel:.2e} "
                         f"({self.worst_buffer})")
        for i, (a, b) in enumerate(zip(self.losses_reference, self.losses_parallel, strict=True)):
            lines.append(f"  step {i + 1}: reference {a:.6f}  parallel {b:.6f}")
        if self.buffers_differ:
            lines.append(f"  buffers that differ from one device's: {_some(self.buffers_differ)}")
        if self.noise_gradients:
            lines.append(f"  {_some(self.noise_gradients)}: gradient zero but for rounding on "
                         f"one device ({self.optimizer} steps them by the noise's sign): held "
                         f"to the {self.noise_reach:.1e} per entry that {self.optimizer}'s "
                         f"steps can take two runs apart; at {self.max_noise_rel:.2e} of it "
                         f"({self.worst_noise})")
        if self.real_gradient:
            lines.append(f"  the layout gives {_some(self.real_gradient)} a gradient where one "
                         f"device's is zero but for rounding")
        if self.replicas_differ:
            lines.append(f"  ranks hold different copies of {', '.join(self.replicas_differ[:5])}"
                         + (f" (and {len(self.replicas_differ) - 5} more)"
                            if len(self.replicas_differ) > 5 else ""))
        if self.missing:
            lines.append(f"  parameters missing from the parallel run: {self.missing[:5]}")
        elif self.hint:
            lines.append(f"  {self.hint}")
        return "\n".join(lines)

    @property
    def hint(self) -> str:
        """Why a FAIL is expected and what to run instead: a model that draws random numbers
        while training, or only the parameters failing under an adaptive optimizer."""
        if not self.ok and self.batchnorm:
            return self.batchnorm
        if not self.ok and self.random and not self.missing:
            shown = ", ".join(self.random[:3]) + (
                f" and {len(self.random) - 3} more" if len(self.random) > 3 else "")
            return (f"the model draws random numbers while training ({shown}): each rank "
                    f"draws its own dropout masks for its rows, so a layout that splits the "
                    f"batch cannot reproduce one device's masks and the runs differ by the "
                    f"dropout noise; set dropout to 0 in your factory for the check (the "
                    f"layout's arithmetic is then compared exactly) and train with it")
        if (not self.ok and not self.missing and not self.replicas_differ
                and self.max_grad_rel > GRADIENTS_DIFFER):
            return (f"the gradients differ before the optimizer step ({self.worst_grad}: "
                    f"norms {self.max_grad_rel:.1e} apart, relative): the layout computes "
                    f"other gradients than one device, not rounding noise")
        if (not self.ok and not self.missing and not self.replicas_differ
                and self.tolerance is None and self.optimizer != "sgd"
                and self.max_loss_rel <= self.limits["loss"]):
            return (f"the losses match; {self.worst_param_rel} may follow rounding noise, which "
                    f"{self.optimizer} scales up: rerun with --optimizer sgd, whose update keeps "
                    f"rounding at rounding level")
        return ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "hint": self.hint,
                "limits": None if self.tolerance is not None else self.limits}


@dataclass(frozen=True)
class CheckConfig:
    """What `check` trains: a reference-model preset (or a factory) on the bundled corpus."""

    model: str = "test"              # reference-model preset name
    steps: int = 5
    batch_size: int = 8              # global batch
    seq_len: int = 16
    lr: float = 1e-3
    seed: int = 0
    optimizer: str = "adamw"         # "adamw" or "sgd"
    model_factory: Callable[[], nn.Module] | None = None  # overrides `model` when given
    batch_factory: Callable[[int, int], Any] | None = None  # (step, seed) -> global batch
    # The user's "pkg.module:function" returning (model, dataset, loss_fn) or (model, dataset,
    # loss_fn, collate_fn); overrides the rest.
    factory: str | None = None


def _user_parts(cfg: CheckConfig) -> tuple[nn.Module, Any, Callable | None]:
    """(model, dataset, loss_fn) from the user's factory, built under the check's seed."""
    parts = build_parts(cfg.factory, cfg.seed)  # type: ignore[arg-type]
    dataset = parts.dataset
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ValueError(f"--model {cfg.factory!r}: the dataset ({type(dataset).__name__}) has "
                         f"no len() and dataset[i] (an iterable dataset?): plait check draws the "
                         f"same rows for every layout by index; return a map-style dataset (a "
                         f"list of items, or a Dataset with __len__ and __getitem__)")
    return parts.model, dataset, parts.loss_fn


def _user_collate(cfg: CheckConfig) -> Callable[[list[Any]], Any] | None:
    """The collate_fn a factory returns as a fourth item, or None."""
    return build_parts(cfg.factory, cfg.seed).collate_fn  # type: ignore[arg-type]


@dataclass(frozen=True)
class Rows:
    """A global batch kept as its dataset items, collated per rank by ``collate_fn``: the
    reference collates them all, each data rank its own consecutive share, as ``run.loader``
    does. A collate that builds one tensor across rows (an EmbeddingBag's flat index list and
    offsets) is then right on every rank, where slicing one collated batch by rows is not."""

    items: list[Any]
    collate_fn: Callable[[list[Any]], Any]


def _dataset_batches(dataset: Any, cfg: CheckConfig) -> list[Any]:
    """Global batches of ``cfg.batch_size`` consecutive items (wrapping around after the last
    one: steps x batch may exceed the dataset, one batch may not), collated as a DataLoader
    would: the same rows for the reference and for every rank's share. With a factory's
    collate_fn, each batch stays items (:class:`Rows`), collated per rank."""
    from torch.utils.data import default_collate

    n = len(dataset)
    refusal = dataset_refusal(cfg.factory, dataset, cfg.batch_size)  # type: ignore[arg-type]
    if refusal is not None:
        raise ValueError(refusal)
    items = [[dataset[(step * cfg.batch_size + i) % n] for i in range(cfg.batch_size)]
             for step in range(cfg.steps)]
    collate = _user_collate(cfg)
    if collate is not None:
        return [Rows(rows, collate) for rows in items]
    try:
        return [default_collate(rows) for rows in items]
    except RuntimeError as exc:
        if "equal size" not in str(exc):
            raise
        raise ValueError(f"--model {cfg.factory!r}: the dataset's items do not stack into a "
                         f"batch ({str(exc).rstrip('.')}); return (model, dataset, loss_fn, "
                         f"collate_fn), the collate_fn building a batch from a list of items "
                         f"(padding them, or a flat index list with offsets), as "
                         f"run.loader(..., collate_fn=...) takes") from None


def _global_batches(cfg: CheckConfig, vocab: int) -> list[Any]:
    if cfg.factory is not None:
        return _dataset_batches(_user_parts(cfg)[1], cfg)
    if cfg.batch_factory is not None:
        return [cfg.batch_factory(step, cfg.seed) for step in range(cfg.steps)]
    from .data import TextDataset
    from .data.loader import DistributedLoader

    loader = DistributedLoader(TextDataset(seq_len=cfg.seq_len), cfg.batch_size, seed=cfg.seed)
    return [loader.batch(step) for step in range(cfg.steps)]


def _build(cfg: CheckConfig) -> tuple[nn.Module, Callable | None]:
    from .models.transformer import build, lm_loss, preset

    if cfg.factory is not None:
        model, _, loss_fn = _user_parts(cfg)
        return model, loss_fn
    if cfg.model_factory is not None:
        torch.manual_seed(cfg.seed)
        return cfg.model_factory(), _default_loss
    mcfg = preset(cfg.model)
    mcfg = mcfg.replace(max_seq_len=max(mcfg.max_seq_len, cfg.seq_len))
    return build(mcfg, seed=cfg.seed), lm_loss


def _default_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target.dtype in (torch.int64, torch.int32):
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return nn.functional.mse_loss(out, target)


def _make_optimizer(cfg: CheckConfig, params: Any) -> torch.optim.Optimizer:
    # foreach=False: under TP some parameters may be DTensors and others plain tensors, and the
    # foreach kernels reject that mix ("got mixed torch.Tensor and DTensor"). The parallel modules
    # make every parameter a DTensor, but the check must not depend on it.
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, foreach=False)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=ADAM_BETAS, weight_decay=0.01,
                                 foreach=False)
    raise ValueError(f"optimizer={cfg.optimizer!r} must be 'adamw' or 'sgd'")


def train(plan: Plan, cfg: CheckConfig, grad_norms: dict[str, list[float]] | None = None
          ) -> tuple[Any, nn.Module, list[float]]:
    """Inside a rank: train ``cfg.steps`` steps under ``plan`` on ``cfg``'s model and global
    batches. Returns (the Run, the parallelized model, the loss of every step); the caller
    closes the Run. With ``grad_norms``: each step's gradient norm of each of this rank's
    parameters is appended there (:func:`_record_grad_norms`)."""
    from .runtime import init

    # format given: not the --format of the command that spawned this worker (its sys.argv)
    run = init(plan, seed=cfg.seed, quiet=True, log_every=1, format="text")
    model, loss_fn = _build(cfg)
    dp_rank, dp_size = run.dp_rank, run.dp_size
    example = None
    if plan.tp > 1 or plan.pp > 1:
        # The layout's checks (an inferred tp plan, sp, the pipeline split) run on this rank's
        # first batch, as a user's run.parallelize(model, example=batch): built here apart,
        # with the RNG left as it was, so the steps see the RNG they always did.
        with torch.random.fork_rng(devices=[]):
            example = _slice(_global_batches(cfg, vocab=256)[0], dp_rank, dp_size)
    model = run.parallelize(model, example=example)
    opt = _make_optimizer(cfg, model.parameters())
    if grad_norms is not None:
        opt.register_step_pre_hook(_record_grad_norms(model, grad_norms))
    # as run.loader collates under this plan: grad_accum (x a pipeline's microbatches) parts
    micro = plan.grad_accum * (plan.microbatches if plan.pp > 1 else 1)
    losses = [float(run.step(model, _slice(batch, dp_rank, dp_size, micro), loss_fn, opt))
              for batch in _global_batches(cfg, vocab=256)]
    return run, model, losses


def _record_grad_norms(model: nn.Module, into: dict[str, list[float]]) -> Callable[..., None]:
    """An optimizer step pre-hook appending each parameter's gradient norm (full tensor,
    canonical name; 0 for no gradient) to ``into``: the gradients the optimizer is about to
    apply, after averaging, scaling and clipping. Collective under TP/FSDP (a sharded
    gradient's norm is reduced over its mesh), so every rank steps its optimizer together,
    as ``run.step`` does."""
    named = [(canonical_name(n), p) for module in local_modules(model)
             for n, p in module.named_parameters()]

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for name, p in named:
            g = p.grad
            if g is None:
                norm = 0.0
            else:
                n = torch.linalg.vector_norm(g.detach().float())
                n = n.full_tensor() if hasattr(n, "full_tensor") else n
                norm = float(n)
            into.setdefault(name, []).append(norm)
    return hook


def train_and_collect(rank: int, world_size: int, plan: Plan, cfg: CheckConfig) -> dict[str, Any]:
    """Worker: train ``cfg.steps`` steps under ``plan``; return losses and full parameters
    (and, on one rank, the initial ones: the reference's displacement)."""
    initial, initial_buffers, random, batchnorm = None, None, None, None
    if world_size == 1:
        model, _ = _build(cfg)
        initial = {canonical_name(n): p.detach().float().clone()
                   for n, p in model.named_parameters()}
        initial_buffers = {canonical_name(n): b.detach().float().clone()
                           for n, b in model.named_buffers() if b.is_floating_point()}
        random = random_modules(model)
        from .parallel.batchnorm import batchnorm_modules

        batchnorm = batchnorm_modules(model)
    norms: dict[str, list[float]] = {}
    run, model, losses = train(plan, cfg, norms)
    pp_group = run.mesh["pp"].get_group() if plan.pp > 1 else None
    state = full_state(model, pp_group)
    # The persistent buffers (BatchNorm's running statistics and step count): what the model
    # computes from its batches, which the parameters alone do not show (per-rank statistics).
    # A tied weight's second name is in the state dict too: a parameter, not a buffer.
    aliases = {canonical_name(n) for module in local_modules(model)
               for n, _ in module.named_parameters(remove_duplicate=False)}
    buffers = {k: v for k, v in full_state(model, pp_group, buffers=True).items()
               if k not in state and k not in aliases}
    if pp_group is not None:  # each stage recorded its own parameters: pool them
        parts: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, norms, group=pp_group)
        norms = {k: v for part in parts for k, v in part.items()}
    run.close()
    return {"losses": losses, "state": state if rank == 0 else None, "initial": initial,
            "buffers": buffers if rank == 0 else None, "initial_buffers": initial_buffers,
            "grad_norms": norms,
            "random": random, "batchnorm": batchnorm,
            "digest": {name: digest(name, t) for name, t in state.items()}}


def digest(name: str, t: torch.Tensor) -> tuple[float, float]:
    """Two random-sign projections of ``t`` (in float64; the signs fixed by ``name``, so every
    rank draws the same): copies that differ by d project apart by about |d|, so each rank's
    copy of a tensor is compared at the size of the difference without sending the tensor."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    flat = t.detach().double().flatten()
    signs = torch.randint(0, 2, (2, flat.numel()), generator=g, dtype=torch.float64) * 2 - 1
    a, b = (signs @ flat).tolist()
    return a, b


def _slice(batch: Any, index: int, parts: int, micro: int = 1) -> Any:
    """Data rank ``index``'s share of ``parts``; :class:`Rows` collated as ``run.loader`` does,
    in ``micro`` micro-batches where the collated batch is not one row per example."""
    if isinstance(batch, Rows):
        from .data.loader import collate_each

        n = len(batch.items) // parts
        return collate_each(batch.collate_fn, batch.items[index * n:(index + 1) * n], micro)
    if isinstance(batch, torch.Tensor):
        n = batch.shape[0] // parts
        return batch[index * n:(index + 1) * n]
    if isinstance(batch, dict):
        return {k: _slice(v, index, parts) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice(v, index, parts) for v in batch)
    return batch


def compare(plan: Plan, reference: dict[str, Any], parallel: dict[str, Any], steps: int,
            tolerance: float | None, optimizer: str = "adamw",
            digests: list[dict[str, tuple[float, float]]] | None = None,
            lr: float = 1e-3) -> CheckResult:
    """Rank 0's losses and parameters against the reference's; with every rank's ``digests``
    (:func:`digest`), also each rank's copies against rank 0's. Where both sides carry
    ``grad_norms`` (each step's gradient norm by name) and the optimizer is Adam(W) at ``lr``
    under the relative bounds, tensors whose one-device gradient is rounding noise are judged
    by :func:`adam_reach` (see ``GRAD_NOISE``)."""
    ref_state, par_state = reference["state"], parallel["state"]
    initial = reference.get("initial") or {}
    missing = sorted(set(ref_state) - set(par_state))
    worst, worst_name = 0.0, ""
    worst_rel, worst_rel_name = 0.0, ""
    # How far the reference moved each tensor, computed once: the floor below needs the total.
    displacement = {n: (ref - initial[n]).float().norm().item()
                    for n, ref in ref_state.items() if n in initial and ref.numel()}
    entries = sum(ref_state[n].numel() for n in displacement)
    moved_per_entry = (math.sqrt(sum(d * d for d in displacement.values()) / entries)
                       if entries else 0.0)

    def moved(name: str) -> float:
        """How far the reference moved tensor ``name``, at least the floor."""
        ref = ref_state[name]
        typical = moved_per_entry * math.sqrt(ref.numel())
        return max(displacement[name], DISPLACEMENT_FLOOR * max(ref.norm().item(), typical))

    noise: set[str] = set()
    real_gradient: list[str] = []
    ref_norms, par_norms = reference.get("grad_norms"), parallel.get("grad_norms")
    if ref_norms and par_norms and tolerance is None and optimizer != "sgd":
        sizes = {n: t.numel() for n, t in ref_state.items()}
        noise = noise_gradients(ref_norms, sizes)
        quiet = noise_gradients(par_norms, sizes, reference=ref_norms)
        real_gradient = sorted(n for n in noise if n in par_norms and n not in quiet)
        noise -= set(real_gradient)
    reach = adam_reach(lr, steps)
    worst_noise, worst_noise_name = 0.0, ""
    grad_rel, grad_rel_name = _gradients_apart(ref_norms or {}, par_norms or {}, ref_state,
                                               skip=noise | set(real_gradient))

    for name, ref in ref_state.items():
        if name not in par_state:
            continue
        got = par_state[name]
        if got.shape != ref.shape:
            missing.append(f"{name} (shape {tuple(got.shape)} != {tuple(ref.shape)})")
            continue
        diff = (got - ref).abs().max().item() if ref.numel() else 0.0
        if diff > worst or math.isnan(diff):
            worst, worst_name = diff, name
        if name in noise:
            rel = diff / reach
            if rel > worst_noise or math.isnan(rel):
                worst_noise, worst_noise_name = rel, name
        elif name in displacement:
            far = moved(name)
            off = (got - ref).norm().item()
            # A tensor that is zero and stayed zero must stay exactly zero.
            rel = off / far if far > 0 else (0.0 if off == 0 else math.inf)
            if rel > worst_rel or math.isnan(rel):
                worst_rel, worst_rel_name = rel, name
    bound = tolerance if tolerance is not None else tolerances(
        optimizer, plan.mixed_precision)["param"]
    differ = []
    digests = digests or []
    for name, first in (digests[0] if digests else {}).items():
        if name not in displacement:
            continue
        scale = 1.0 if tolerance is not None else moved(name)
        ranks = [r for r, other in enumerate(digests[1:], 1) if name in other and max(
            abs(x - y) for x, y in zip(other[name], first, strict=True)) > bound * scale]
        if ranks:
            differ.append(f"{name} (ranks 0 and {ranks[0]})")
    pairs = list(zip(reference["losses"], parallel["losses"], strict=True))
    random = list(reference.get("random") or [])
    loss_diff = max((abs(a - b) for a, b in pairs), default=0.0)
    loss_rel = max((abs(a - b) / max(abs(a), 1e-30) for a, b in pairs), default=0.0)
    if any(math.isnan(b) for _, b in pairs):
        loss_diff = loss_rel = math.nan
    buffer_rel, worst_buffer, buffers_differ = _buffers_apart(
        reference.get("buffers") or {}, parallel.get("buffers") or {},
        reference.get("initial_buffers") or {})
    return CheckResult(plan=plan.to_string(), world_size=plan.world_size, steps=steps,
                       losses_reference=reference["losses"], losses_parallel=parallel["losses"],
                       max_loss_diff=loss_diff, max_param_diff=worst, worst_param=worst_name,
                       missing=missing, tolerance=tolerance, optimizer=optimizer,
                       max_loss_rel=loss_rel, max_param_rel=worst_rel,
                       worst_param_rel=worst_rel_name, replicas_differ=differ,
                       random=random, batchnorm=_batchnorm_cause(
                           plan, reference.get("batchnorm") or []),
                       precision=plan.mixed_precision,
                       noise_gradients=sorted(noise), max_noise_rel=worst_noise,
                       worst_noise=worst_noise_name, real_gradient=real_gradient,
                       noise_reach=reach if noise else 0.0, max_grad_rel=grad_rel,
                       worst_grad=grad_rel_name, max_buffer_rel=buffer_rel,
                       worst_buffer=worst_buffer, buffers_differ=buffers_differ)


def _batchnorm_cause(plan: Plan, names: list[str]) -> str:
    """Why the BatchNorm layers ``names`` train otherwise under ``plan`` than on one device,
    with the fix, or "": a FAIL's likely cause, which the runtime also warns of."""
    if not names:
        return ""
    shown = f"BatchNorm {_some(names)}"
    parts = plan.grad_accum * (plan.microbatches if plan.pp > 1 else 1)
    if parts > 1:
        return (f"{shown} normalise each of the {parts} pieces of a step's batch (pipeline "
                f"microbatches, grad_accum) with its own statistics: use GroupNorm or "
                f"LayerNorm, or one piece per step (microbatches=1 with pp_schedule=gpipe, "
                f"no grad_accum)")
    if plan.dp > 1 and not plan.sync_bn:
        return (f"{shown} normalise each rank's rows with their own statistics: add sync_bn "
                f"to the plan ('{plan.replace(sync_bn=True).to_string()}') to take them over "
                f"the data axes")
    return ""


def _buffers_apart(ref: dict[str, torch.Tensor], par: dict[str, torch.Tensor],
                   initial: dict[str, torch.Tensor]) -> tuple[float, str, list[str]]:
    """The persistent buffers of the two sides: the largest norm of a floating buffer's
    difference over how far the reference moved it from ``initial`` (at least
    DISPLACEMENT_FLOOR of its norm, as for a parameter that barely moves), its name, and the
    buffers missing from the layout or, if integer (a step count), not equal."""
    worst, worst_name, differ = 0.0, "", []
    for name, want in ref.items():
        got = par.get(name)
        if got is None or got.shape != want.shape:
            differ.append(f"{name} (missing)" if got is None else
                          f"{name} (shape {tuple(got.shape)} != {tuple(want.shape)})")
            continue
        if not want.is_floating_point():
            if not torch.equal(got, want):
                differ.append(f"{name} ({got.tolist()} != {want.tolist()})"
                              if want.numel() == 1 else name)
            continue
        if not want.numel():
            continue
        start = initial.get(name)
        moved = (want - start).norm().item() if start is not None else 0.0
        far = max(moved, DISPLACEMENT_FLOOR * want.norm().item())
        off = (got.float() - want).norm().item()
        rel = off / far if far > 0 else (0.0 if off == 0 else math.inf)
        if rel > worst or math.isnan(rel):
            worst, worst_name = rel, name
    return worst, worst_name, differ


def _gradients_apart(ref: dict[str, list[float]], par: dict[str, list[float]],
                     state: dict[str, torch.Tensor], skip: set[str]) -> tuple[float, str]:
    """The largest difference of one tensor's gradient norm between the two sides, over
    steps, relative to the reference's (at least DISPLACEMENT_FLOOR of the model's gradient per
    entry, at its size: a gradient near zero is not divided by), and the tensor's name."""
    names = [n for n in ref if n in par and n in state and n not in skip]
    entries = sum(state[n].numel() for n in names)
    steps = min((min(len(ref[n]), len(par[n])) for n in names), default=0)
    worst, worst_name = 0.0, ""
    for t in range(steps if entries else 0):
        per_entry = math.sqrt(sum(ref[n][t] ** 2 for n in names) / entries)
        for n in names:
            floor = DISPLACEMENT_FLOOR * per_entry * math.sqrt(state[n].numel())
            scale = max(ref[n][t], floor)
            rel = abs(par[n][t] - ref[n][t]) / scale if scale > 0 else 0.0
            if rel > worst or math.isnan(rel):
                worst, worst_name = rel, n
    return worst, worst_name


def check(plan: Plan | str, cfg: CheckConfig | None = None, *, tolerance: float | None = None,
          timeout: float = 240.0, progress: TextIO | None = None,
          stdout_to_stderr: bool = False) -> CheckResult:
    """Train under ``plan`` and on one device; compare losses and parameters.

    ``tolerance``: an absolute bound on loss and parameter differences; None (the default)
    uses the optimizer's relative bounds, ``TOLERANCES`` (see there for why they differ).
    ``progress``: where to say which stage runs (:class:`plait.progress.Stages`); None: quiet.
    ``stdout_to_stderr``: what the model's code prints (in this process and in the workers)
    goes to stderr, leaving stdout to a JSON report."""
    plan = Plan.load(plan)
    cfg = cfg or CheckConfig()
    _refuse_unfit(plan, cfg)
    _refuse_pipeline(plan, cfg)
    stages = Stages(3, progress, "plait check")
    finished = False
    try:
        single = Plan(mixed_precision=plan.mixed_precision, grad_clip=plan.grad_clip)
        stages.start(f"{cfg.model}, {cfg.steps} steps on one device (the reference)")
        reference = run_distributed(train_and_collect, 1, single, cfg, timeout=timeout,
                                    stdout_to_stderr=stdout_to_stderr)[0]
        stages.start(f"the same steps under {plan.to_string()} on {plan.world_size} processes")
        ranks = run_distributed(train_and_collect, plan.world_size, plan, cfg, timeout=timeout,
                                stdout_to_stderr=stdout_to_stderr)
        stages.start("comparing losses and parameters")
        result = compare(plan, reference, ranks[0], cfg.steps, tolerance, cfg.optimizer,
                         digests=[r["digest"] for r in ranks], lr=cfg.lr)
        finished = True
        return result
    finally:
        stages.close(finished=finished)


def _refuse_unfit(plan: Plan, cfg: CheckConfig) -> None:
    """A plan on one rank compares nothing; a global batch the data-parallel ranks (and their
    micro-steps and micro-batches) cannot split evenly would train the two sides on different
    rows. Both are refused, as ``plait run``'s loader refuses the second."""
    if plan.world_size < 2:
        raise ValueError(f"plan {plan.describe()!r} runs on 1 rank: there is nothing to compare "
                         f"with one device; give a plan with a degree > 1, e.g. 'dp=2'")
    parts = plan.dp * plan.grad_accum * (plan.microbatches if plan.pp > 1 else 1)
    if cfg.batch_factory is None and cfg.batch_size % parts:
        micro = f" x {plan.microbatches} microbatches" if plan.pp > 1 else ""
        raise ValueError(
            f"--global-batch={cfg.batch_size} does not split over {plan.dp} data-parallel "
            f"replica(s) x grad_accum={plan.grad_accum}{micro} = {parts}: use a multiple of "
            f"{parts}, e.g. --global-batch {parts * max(1, cfg.batch_size // parts)}")


def _refuse_pipeline(plan: Plan, cfg: CheckConfig) -> None:
    """A pipeline the user's model cannot be cut into is refused here, before any process
    starts (:func:`plait.user_factory.pipeline_refusal`)."""
    why = pipeline_refusal(plan, cfg.factory) if cfg.factory is not None else None
    if why is not None:
        raise ValueError(why)


# ---------------------------------------------------------------------------------------- CLI
# Bounds of `plait check`'s own batches: it proves equivalence on a few small steps; attention
# cost grows with the square of the sequence, and 100,000 tokens ran for hours without a word.
MAX_SEQ_LEN = 1024
MAX_BATCH = 256


def command(args: argparse.Namespace) -> int:
    if args.seq_len is not None and ":" in args.model:
        raise ValueError(f"--seq={args.seq_len} sets the length of a reference preset's "
                         f"batches; with --model {args.model} the sequences are what your "
                         f"dataset returns: drop --seq")
    args.seq_len = 16 if args.seq_len is None else args.seq_len
    for name in ("steps", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if not args.timeout > 0:
        raise ValueError(f"--timeout={args.timeout} must be a positive number of seconds")
    if not args.lr > 0:
        raise ValueError(f"--lr={args.lr} must be a positive learning rate, e.g. 1e-3")
    if args.tolerance is not None and not (0 <= args.tolerance < float("inf")):
        # a negative bound fails every layout, after the whole run; nan passes none either
        raise ValueError(f"--tolerance={args.tolerance} must be a finite bound >= 0, e.g. "
                         f"--tolerance 1e-5 (or leave it out for the optimizer's relative "
                         f"bounds)")
    if args.seq_len > MAX_SEQ_LEN or args.batch_size > MAX_BATCH:
        raise ValueError(f"--seq={args.seq_len} --global-batch={args.batch_size}: check "
                         f"compares layouts on small batches, at most --seq {MAX_SEQ_LEN} "
                         f"and --global-batch {MAX_BATCH} (time and memory grow with both)")
    # --format json: stdout is the report alone; what the user's model code prints (at import,
    # when built, in the workers) goes to stderr
    own_output = (contextlib.redirect_stdout(sys.stderr) if args.format == "json"
                  else contextlib.nullcontext())
    with own_output:
        factory = factory_or_preset(args.model)  # a bad spec fails here, before any process
    cfg = CheckConfig(model=args.model, steps=args.steps, batch_size=args.batch_size,
                      seq_len=args.seq_len, optimizer=args.optimizer, lr=args.lr,
                      factory=factory)
    # Each stage as it starts, with the time so far: a bar on stderr on a terminal; else plain
    # lines on stdout above the report (stderr keeps the error, if any, as its only line), none
    # under --format json (stdout is the JSON object).
    progress = sys.stderr if sys.stderr.isatty() else (
        sys.stdout if args.format != "json" else None)
    with user_errors(), own_output:
        result = check(args.plan, cfg, tolerance=args.tolerance, timeout=args.timeout,
                       progress=progress, stdout_to_stderr=args.format == "json")
    print(json.dumps(result.to_dict(), indent=2) if args.format == "json" else result.format())
    return 0 if result.ok else 1
