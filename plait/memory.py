"""Memory per rank: what the model state really occupies, beside the closed form for the plan.

Sharding is sold on memory, so plait measures it rather than asserting it. A
:class:`MemoryTracker` hooks a model and its optimizer and records, per rank:

* ``params``    — bytes of parameters held at rest: local shards for ZeRO-2/3 (the DTensor's
  local tensor), full tensors for DDP / ZeRO-1;
* ``grads``     — bytes of gradients held when the optimizer steps (after the reduction):
  local shards for ZeRO-2/3, full for DDP / ZeRO-1;
* ``optimizer`` — bytes of optimizer state (Adam's moments...) this rank holds: a partition for
  ZeRO-1/2/3, everything for DDP;
* ``gathered``  — bytes of gathered (unsharded) parameters still held when forward ends, i.e.
  kept for backward: every block for ZeRO-2, the root's own parameters for ZeRO-3, 0 otherwise;
* peak process memory (host RSS high-water mark; the accelerator allocator's peak where there
  is one).

``closed_form(plan, psi, ...)`` gives the same four figures from first principles, e.g. Adam in
fp32 with ZeRO-3 on d shard ranks: 4Ψ/d + 4Ψ/d + 8Ψ/d = 16Ψ/d bytes. Ψ is the number of
parameters this rank holds before data-parallel sharding (its TP shard's, its pipeline
stages'); each rank's closed form is computed from its own Ψ.

Tensor bytes are ``numel * element_size`` of each tensor (views into FSDP2's flat buffers are
counted once each, padding not at all); that is the model state the plan promises, independent
of allocator caching, which the RSS figure shows instead.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._torch_compat import is_split
from .parallel.layout import local_modules
from .plan import Plan

# Mesh dimensions along which parameters are split for data parallelism (not model parallelism).
DATA_AXES = frozenset({"dp_replicate", "dp_shard", "dp", "dp_shard_cp"})
GiB = 2**30
MiB = 2**20


# ------------------------------------------------------------------------------ measuring
def local_bytes(t: torch.Tensor) -> int:
    """Bytes of the part of ``t`` this rank holds (a DTensor's local shard)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def _is_data_sharded(p: torch.Tensor) -> bool:
    if not isinstance(p, DTensor):
        return False
    names = p.device_mesh.mesh_dim_names or ()
    return any(is_split(pl) and i < len(names) and names[i] in DATA_AXES
               for i, pl in enumerate(p.placements))


def replica_numel(p: torch.Tensor) -> int:
    """Elements of ``p`` in this rank's model replica: the full tensor, divided by model-parallel
    (TP) sharding but not by data-parallel sharding."""
    if not isinstance(p, DTensor):
        return p.numel()
    n = p.numel()
    names = p.device_mesh.mesh_dim_names or ()
    for i, pl in enumerate(p.placements):
        if is_split(pl) and not (i < len(names) and names[i] in DATA_AXES):
            n //= p.device_mesh.size(i)
    return n


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensor state this rank's optimizer holds (a ZeroRedundancyOptimizer: its shard)."""
    inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer keeps the local one here
    states = (inner if isinstance(inner, torch.optim.Optimizer) else optimizer).state
    return sum(local_bytes(v) for state in states.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p for m in local_modules(model) for p in m.parameters()]


def peak_process_memory(accelerator: Any = None) -> dict[str, float]:
    """Host RSS high-water mark of this process, and ``accelerator``'s allocator peak if any."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin"
                                                                 else 1024)
    out = {"peak_rss": float(rss)}
    peak = accelerator.peak_memory_bytes() if accelerator is not None else None
    if peak is not None:
        out["peak_device"] = float(peak)
    return out


def current_rss() -> int:
    """Resident set size of this process now (Linux /proc; falls back to the high-water mark)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return int(peak_process_memory()["peak_rss"])


class MemoryTracker:
    """Records the model-state bytes of one model + optimizer on this rank, step by step.

    Hooks: the optimizer's step pre-hook measures parameters and gradients (reduced, about to be
    used), its post-hook the optimizer state; for ZeRO-2/3 a forward hook on the root measures
    the gathered parameters kept for backward. Each figure is the maximum seen. Model state is
    fixed once the optimizer has allocated its state (the first step), so the hooks remove
    themselves after ``steps`` optimizer steps: a long run pays for the walk over every
    parameter and optimizer tensor a couple of times, not on every step.
    """

    #: optimizer steps measured before the hooks are removed
    steps_to_measure = 2

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 track_gathered: bool = True):
        self.model = model
        self.optimizer = optimizer
        self.params = self.grads = self.optimizer_state = self.gathered = 0
        self.steps = 0
        self._handles = [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_step_post_hook(self._after_step)]
        if track_gathered:
            for m in local_modules(model):
                self._handles.append(m.register_forward_hook(self._after_forward))

    def _before_step(self, *_: Any) -> None:
        params = _params(self.model)
        self.params = max(self.params, sum(local_bytes(p) for p in params))
        self.grads = max(self.grads, sum(local_bytes(p.grad) for p in params
                                         if p.grad is not None))

    def _after_step(self, *_: Any) -> None:
        self.steps += 1
        self.optimizer_state = max(self.optimizer_state, optimizer_state_bytes(self.optimizer))
        if self.steps >= self.steps_to_measure:
            self.remove()

    def _after_forward(self, *_: Any) -> None:
        # FSDP2 registers the unsharded parameters on a module while it is gathered and the
        # sharded DTensors otherwise; anything registered that is not data-sharded is gathered.
        # Only meaningful for FSDP2 models (the caller turns it off for DDP/ZeRO-1).
        gathered = sum(local_bytes(p) for p in _params(self.model) if not _is_data_sharded(p))
        self.gathered = max(self.gathered, gathered)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def measured(self) -> dict[str, float]:
        return {"params": float(self.params), "grads": float(self.grads),
                "optimizer": float(self.optimizer_state), "gathered": float(self.gathered),
                "model_state": float(self.params + self.grads + self.optimizer_state)}

    def root_psi(self) -> int | None:
        """Parameters of the root FSDP unit (those no inner ``fully_shard`` unit holds: the
        embeddings, final norm and head of a transformer), counted as :meth:`psi` counts;
        ZeRO-3 keeps them gathered from forward to backward. None without FSDP units."""
        from torch.distributed.fsdp import FSDPModule

        roots = list(local_modules(self.model))
        # fully_shard swaps in a class that is both FSDPModule and the module's own class; the
        # isinstance test would narrow ``m`` to FSDPModule alone, which has no parameters().
        units = [cast(nn.Module, m) for root in roots for name, m in root.named_modules()
                 if name and isinstance(m, FSDPModule)]
        inner = {id(p) for unit in units for p in unit.parameters()}
        if not inner:
            return None
        return sum(replica_numel(p) for root in roots for p in root.parameters()
                   if id(p) not in inner)

    def psi(self) -> int:
        """Parameters this rank holds before data-parallel sharding (its TP shard, its stages)."""
        return sum(replica_numel(p) for p in _params(self.model))

    def trained_psi(self) -> int:
        """The trainable ones among :meth:`psi` (what holds gradients and optimizer state)."""
        return sum(replica_numel(p) for p in _params(self.model) if p.requires_grad)


# ---------------------------------------------------------------------------- closed form
def optimizer_bytes_per_param(optimizer: torch.optim.Optimizer, dtype_bytes: int = 4
                              ) -> int | None:
    """State bytes per parameter for common optimizers (Adam/AdamW: 2 moments); None if unknown."""
    inner = getattr(optimizer, "optim", None)
    opt = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
    group = opt.param_groups[0] if opt.param_groups else {}
    name = type(opt).__name__
    if name in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax"):
        return dtype_bytes * (3 if group.get("amsgrad") else 2)
    if name in ("SGD",):
        return dtype_bytes if group.get("momentum", 0) else 0
    if name in ("Adagrad", "RMSprop"):
        return dtype_bytes
    return None


@dataclass(frozen=True)
class ClosedForm:
    """Bytes per rank the plan should hold, from first principles (see module docstring)."""

    params: float
    grads: float
    optimizer: float | None
    gathered: float | None  # None: transient, one unit at a time (ZeRO-3)

    @property
    def model_state(self) -> float | None:
        if self.optimizer is None:
            return None
        return self.params + self.grads + self.optimizer


def closed_form(plan: Plan, psi: int, optimizer_per_param: int | None, *,
                master_bytes: int = 4, root_psi: int | None = None,
                trained: int | None = None) -> ClosedForm:
    """Model-state bytes per rank for ``plan`` with ``psi`` parameters per replica.

    Parameters and gradients are kept in fp32 (``master_bytes``) under every plan — bf16 only
    changes the *gathered* copy and the compute (FSDP2 keeps fp32 shards as master weights and
    reduces in fp32; DDP uses autocast over fp32 weights). With d = dp_shard:

    ======  ==========  ==========  ==========  ===========================
    zero    params      grads       optimizer   gathered fwd -> bwd
    ======  ==========  ==========  ==========  ===========================
    0       4Ψ          4Ψ          KΨ          0 (nothing is sharded)
    1       4Ψ          4Ψ          KΨ/d        0
    2       4Ψ/d        4Ψ/d        KΨ/d        CΨ (every block stays gathered)
    3       4Ψ/d        4Ψ/d        KΨ/d        CΨ_root (and one block at a time)
    ======  ==========  ==========  ==========  ===========================

    K = optimizer bytes per parameter (Adam fp32: 8), C = compute bytes (fp32 4, bf16 2),
    Ψ_root = ``root_psi``, the parameters of the root FSDP unit (no inner unit holds them:
    they are gathered for the whole forward and backward); unknown: None. Gradients and
    optimizer state are those of the ``trained`` parameters among Ψ (all of them when None):
    a frozen parameter (a LoRA base) holds neither.
    """
    d = plan.dp_shard
    compute = 2 if plan.mixed_precision in ("bf16", "fp16") else master_bytes
    trained = psi if trained is None else trained
    full, grads = master_bytes * psi, master_bytes * trained
    opt_full = None if optimizer_per_param is None else optimizer_per_param * trained
    if plan.zero == 0:
        return ClosedForm(full, grads, opt_full, 0.0)
    opt = None if opt_full is None else opt_full / d
    if plan.zero == 1:
        return ClosedForm(full, grads, opt, 0.0)
    gathered = float(compute * psi) if plan.zero == 2 else \
        None if root_psi is None else float(compute * root_psi)
    return ClosedForm(full / d, grads / d, opt, gathered)


# ---------------------------------------------------------------------------------- report
def memory_report(tracker: MemoryTracker, plan: Plan, *, gather: bool = True,
                  accelerator: Any = None) -> dict[str, Any]:
    """Measured model state and peak memory per rank, beside the closed form for ``plan``
    (and ``accelerator``'s allocator peak, where it has one).

    Collective when ``gather`` (every rank must call it): the returned dict holds every rank's
    figures under ``"ranks"``.
    """
    psi = tracker.psi()
    form = closed_form(plan, psi, optimizer_bytes_per_param(tracker.optimizer),
                       root_psi=tracker.root_psi() if plan.zero == 3 else None,
                       trained=tracker.trained_psi())
    # Each rank's own: pipeline stages hold different parameters (Ψ differs by rank).
    local = {"measured": tracker.measured(), **peak_process_memory(accelerator), "psi": psi,
             "offloaded": bool(plan.offload),
             "closed_form": {**asdict(form), "model_state": form.model_state}}
    ranks: list[dict[str, object] | None] = [local]
    if gather and dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, local)
    return {"plan": plan.to_string(), "zero": plan.zero, "dp_shard": plan.dp_shard,
            "mixed_precision": plan.mixed_precision, "psi": psi,
            "closed_form": {**asdict(form), "model_state": form.model_state},
            "steps_measured": tracker.steps, "ranks": ranks}


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / MiB:,.2f} MiB" if x < GiB else f"{x / GiB:,.2f} GiB"


def format_memory_report(report: dict[str, Any]) -> str:
    """A table: measured bytes per rank beside the closed form, and peak process memory. Where
    the ranks hold different parameters (pipeline stages), each rank's closed form is shown
    under its measured figures."""
    ranks = report["ranks"]
    forms = [r.get("closed_form", report["closed_form"]) for r in ranks]
    psis = [r.get("psi", report["psi"]) for r in ranks]
    same = all(f == forms[0] for f in forms)
    if len(set(psis)) == 1:
        held = f"Ψ = {psis[0]:,}"
    else:
        held = "Ψ = " + ", ".join(
            f"{p:,} on rank{'s' * (len(on) > 1)} {', '.join(map(str, on))}"
            for p, on in sorted({p: [i for i, q in enumerate(psis) if q == p]
                                 for p in psis}.items(), key=lambda item: item[1][0]))
    held += ": each rank's parameters before data-parallel sharding"
    head = f"{'':12}" + (f"{'closed form':>16}" if same else "")
    lines = [f"--- memory per rank: {report['plan']} ({held}) ---",
             head + "".join(f"{'rank ' + str(i):>16}" for i in range(len(ranks)))]
    for key, label in (("params", "parameters"), ("grads", "gradients"),
                       ("optimizer", "optimizer"), ("model_state", "model state"),
                       ("gathered", "gathered*")):
        row = f"{label:<12}" + (f"{_fmt(forms[0].get(key)):>16}" if same else "")
        lines.append(row + "".join(f"{_fmt(r['measured'][key]):>16}" for r in ranks))
        if not same:
            lines.append(f"{' closed form':<12}" + "".join(f"{_fmt(f.get(key)):>16}"
                                                            for f in forms))
    blank = f"{'':>16}" if same else ""
    lines.append(f"{'peak RSS':<12}{blank}" + "".join(f"{_fmt(r['peak_rss']):>16}"
                                                      for r in ranks))
    if any("peak_device" in r for r in ranks):
        lines.append(f"{'peak device':<12}{blank}" + "".join(
            f"{_fmt(r.get('peak_device')):>16}" for r in ranks))
    lines.append("* gathered parameters still held when forward ends (kept for backward)")
    return "\n".join(lines)


def model_state_ratio(report: dict[str, Any]) -> list[float]:
    """Measured / closed-form model-state bytes, per rank, each against its own closed form
    (1.0 = exactly as predicted)."""
    return [r["measured"]["model_state"]
            / r.get("closed_form", report["closed_form"])["model_state"]
            for r in report["ranks"]]


def tensors_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(local_bytes(t) for t in tensors)
