"""The step guard: before the optimizer step, every rank agrees on what happens to it.

Two things can make a step go wrong on some ranks only, and the ranks must still act alike:

* **A non-finite loss or gradient norm** (NaN/inf). Each rank sees only its own loss and its own
  gradient shards (FSDP, TP and PP split them), so a NaN can be invisible to the other ranks
  until the next step has spread it into every parameter. The guard finds it on the step it
  appears, on every rank. Policy ``"stop"`` (the default) raises ``NonFiniteError`` naming the
  step and the rank; ``"skip"`` drops that step's update (gradients zeroed, optimizer not
  stepped) on every rank and carries on.
* **A request to stop** (SIGTERM, the preemption notice of a cluster, see
  ``plait.lifecycle.StopRequest``). Ranks receive the signal at slightly different times; the
  guard makes them all stop after the same step, so a final checkpoint is a consistent one.
  On PyTorch/XLA, where the NaN/inf check does not run, the hosts agree on this flag alone
  after each step (``StepGuard.agree_stop``).

The agreement is one all-reduce (MAX) of three numbers over the whole job, issued between
backward and the optimizer step. When the data replicas are the whole job (DDP, ZeRO, HSDP) and
gradients are clipped, a clean step needs none of its own: two flags per rank (non-finite loss,
stop requested) are summed in the step's all-reduce of (loss sum, count), which every step makes
anyway, and the clipped norm is already the job-wide one; only a step whose sums or norm show a
problem takes the full agreement, to name the rank. Pipelines (alone or with data replicas) do
the same: their totals travel from the last stage as a sum over ``pp`` in which the other stages
add zeros (``plait.train.pipeline_totals``), and the flags ride along. Every other layout (tensor
parallel, or a pipeline beside it) pays the one all-reduce per step (~0.1 ms on gloo between
processes on one host once both have arrived, bench/rendezvous_cost.py; tens of microseconds on
NCCL). A one-rank job pays nothing but the local check.

Under ``mixed_precision=fp16`` a non-finite gradient norm with a finite loss is the loss
scale's overflow, not an error: the runtime skips that update on every rank (this agreement's
verdict) and halves the scale, whatever the policy (``plait.loss_scale``). A non-finite loss
follows the policy as under fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

NONFINITE_POLICIES = ("stop", "skip")


class NonFiniteError(RuntimeError):
    """A step produced a NaN/inf loss or gradient norm under ``nonfinite="stop"``."""


def check_policy(policy: str) -> str:
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite={policy!r} must be one of {', '.join(NONFINITE_POLICIES)}: "
                         f"'stop' ends the job on a NaN/inf step, 'skip' drops its update")
    return policy


def local_grad_norm(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The norm of this rank's own gradient values (DTensor shards as their local part): no
    communication; finite exactly when every local gradient value is."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0)


@dataclass
class Verdict:
    """What every rank agreed about one step."""

    bad_loss_rank: int | None = None   # lowest rank whose loss was NaN/inf
    bad_grad_rank: int | None = None   # lowest rank whose gradient norm was NaN/inf
    stop: bool = False                 # some rank was asked to stop
    job_norm: bool = False             # the gradient norm is the job's (clipping's), one for all

    @property
    def nonfinite(self) -> bool:
        return self.bad_loss_rank is not None or self.bad_grad_rank is not None

    def describe(self, step: int) -> str:
        parts = []
        if self.bad_loss_rank is not None:
            parts.append(f"non-finite loss on rank {self.bad_loss_rank}")
        if self.bad_grad_rank is not None:
            # The job's norm is non-finite on every rank alike: no rank to name.
            parts.append("non-finite gradient norm" if self.job_norm
                         else f"non-finite gradient norm on rank {self.bad_grad_rank}")
        return f"step {step}: " + " and ".join(parts)


@dataclass
class StepGuard:
    """Called by ``train_step`` between backward and the optimizer step; returns whether the
    update is applied. ``holds_loss``: whether this rank's loss is a real one (with pipelines
    only the last stage computes it; the others return NaN by convention)."""

    policy: str
    rank: int
    world_size: int
    holds_loss: bool = True
    stop_request: Any = None           # plait.lifecycle.StopRequest, or None
    pause: Any = None                  # context manager factory: the ledger does not count this
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # of the flags
    last: Verdict = field(default_factory=Verdict)

    def local_flags(self, loss: torch.Tensor) -> torch.Tensor:
        """``[1 if this rank's loss is NaN/inf, 1 if this rank was asked to stop]``, on the
        loss's device without reading it on the host; summed over the job they are the
        ``agreed`` of :meth:`__call__`."""
        bad = ~torch.isfinite(loss.detach().reshape(()))
        if not self.holds_loss:
            bad = torch.zeros_like(bad)
        stop = self.stop_request is not None and self.stop_request.requested
        # A fill on the device: torch.tensor(x, device=) is a host copy that, on a GPU, waits
        # for the queued backward.
        return torch.stack([bad.float(), torch.full((), float(stop), device=loss.device)])

    def agree_stop(self) -> bool:
        """The stop request alone, agreed on the host: where the NaN/inf check does not run.

        On PyTorch/XLA the loss and the gradient norm stay on the device (reading them would
        execute the graph mid-step), so only the stop flag is agreed, after the step, as a CPU
        tensor on the job's process group (gloo between the hosts there, which carries host
        objects only). One host reads its own flag; without a stop handler there is nothing to
        agree and no collective. Every host calls it at every step, as ``__call__``."""
        stop = self.stop_request is not None and self.stop_request.requested
        if self.stop_request is not None and self.world_size > 1:
            flag = torch.tensor([1.0 if stop else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        self.last = Verdict(stop=stop)
        return stop

    def __call__(self, loss: torch.Tensor, grad_norm: torch.Tensor, *,
                 agreed: torch.Tensor | None = None) -> bool:
        """The verdict on one step; True when its update is applied.

        ``agreed``: :meth:`local_flags` already summed over every rank of the job (the runtime
        sends them in the step's all-reduce of (loss sum, count) when that one spans the job),
        given only when ``grad_norm`` is the job-wide norm (the same on every rank, as gradient
        clipping computes it). A clean step then costs no collective of its own; when a flag
        or the norm says something is wrong, every rank sees it alike and all take the full
        agreement below, which names the lowest bad rank.
        """
        if agreed is not None:
            bad_losses, stops = (float(x) for x in agreed.tolist())
            if not bad_losses and math.isfinite(float(grad_norm)):
                self.last = Verdict(stop=stops > 0)
                return True
        mark = float(self.world_size - self.rank)  # MAX over ranks -> the lowest rank
        flags = torch.tensor([
            mark if self.holds_loss and not math.isfinite(float(loss)) else 0.0,
            mark if not math.isfinite(float(grad_norm)) else 0.0,
            1.0 if self.stop_request is not None and self.stop_request.requested else 0.0,
        ], device=self.device)
        if self.world_size > 1:
            if self.pause is not None:
                with self.pause():
                    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            else:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        loss_mark, grad_mark, stop = (float(x) for x in flags.tolist())
        self.last = Verdict(
            bad_loss_rank=self.world_size - int(loss_mark) if loss_mark else None,
            bad_grad_rank=self.world_size - int(grad_mark) if grad_mark else None,
            stop=bool(stop), job_norm=agreed is not None)
        return not self.last.nonfinite
