"""Workers for tests/test_compile.py (spawned processes import this module)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from plait.check import _slice
from tests import _workers_semantics as W


def compiled_masked_lm() -> torch.nn.Module:
    """The one-device model as a user compiles it: torch.compile of the whole model."""
    return torch.compile(W.masked_lm())


def compiled_reference_lm() -> torch.nn.Module:
    """plait's reference transformer (a TP plan with a vocabulary-parallel embedding before
    the blocks), torch.compile'd on one device."""
    return torch.compile(W.reference_lm())


class UntracedResidualLM(nn.Module):
    """Residuals in the parent's forward (``h = h + block(h)``), in a forward torch.fx cannot
    trace (it branches on a tensor's shape): the pipeline finds the residuals by running the
    forward once on a meta-device copy at the first step, and a later stage's stand-in for an
    earlier block then adds zero."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(W.VOCAB, W.WIDTH), nn.Embedding(W.SEQ, W.WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(W.WIDTH, W.WIDTH), nn.Tanh())
                                    for _ in range(4))
        self.head = nn.Linear(W.WIDTH, W.VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > W.SEQ:
            raise ValueError("sequence longer than the position table")
        h = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def untraced_residual_lm() -> nn.Module:
    torch.manual_seed(0)
    return UntracedResidualLM()


def first_step_check(rank: int, world_size: int, plan: str, factory: Any,
                     batch: Any) -> dict[str, Any]:
    """The pipeline's first-step check of the split, run on ``batch`` laid out for the stages:
    the residual modules it found, and what torch.compile was asked to compile meanwhile."""
    from plait._torch_compat import dynamo_frames, reset_dynamo
    from plait.parallel.layout import layout_of
    from plait.parallel.pipeline import stage_inputs
    from plait.runtime import init

    reset_dynamo()
    run = init(plan, quiet=True, seed=0)
    model = run.parallelize(factory())
    runner = layout_of(model).pipeline
    laid_out = stage_inputs(batch, W.mlm_loss, runner.signature, runner.model_name)
    found = sorted(runner.check_split(laid_out))
    out = {"found": found, "frames": dynamo_frames()}
    run.close()
    return out


def train_compiled(rank: int, world_size: int, plan: str, factory: Any,
                   batches: list[Any], by_hand: bool = False) -> dict[str, Any]:
    """Train like ``W.train_jobs``; also report whether torch compiled anything and what a
    torch.compile of the laid-out model is told at run.step. ``by_hand``: the user compiles
    each block's forward of the laid-out model, plait is not told."""
    from plait._torch_compat import dynamo_frames, dynamo_graph_count, reset_dynamo
    from plait.runtime import init

    reset_dynamo()
    run = init(plan, quiet=True, log_every=1, seed=0)
    model = run.parallelize(factory())
    if by_hand:
        from plait.parallel.units import repeated_blocks

        for _, block in repeated_blocks(model):
            block.forward = torch.compile(block.forward)
    opt = torch.optim.SGD(model.parameters(), lr=W.LR, foreach=False)
    losses = [float(run.step(model, _slice(b, run.dp_rank, run.dp_size), W.mlm_loss, opt))
              for b in batches]
    graphs, frames = dynamo_graph_count(), dynamo_frames()
    refused = None
    try:
        run.step(torch.compile(model), _slice(batches[0], run.dp_rank, run.dp_size), W.mlm_loss,
                 opt)
    except ValueError as exc:
        refused = str(exc)
    state = run.full_state_dict(model)
    out = {"plan": run.plan.to_string(), "losses": losses, "graphs": graphs, "frames": frames,
           "refused": refused, "state": state if rank == 0 else None}
    run.close()
    return out


class BatchNormBlockLM(nn.Module):
    """A masked LM whose blocks hold a BatchNorm (running statistics updated in the compiled
    forward) and a dropout layer: what a warm-up run of the blocks must leave as it was."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(W.VOCAB, W.WIDTH)
        self.blocks = nn.ModuleList(BatchNormBlock(dropout) for _ in range(4))
        self.head = nn.Linear(W.WIDTH, W.VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class BatchNormBlock(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.fc, self.bn, self.drop = nn.Linear(W.WIDTH, W.WIDTH), nn.BatchNorm1d(W.WIDTH), \
            nn.Dropout(dropout)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.drop(torch.tanh(self.bn(self.fc(h).transpose(1, 2)).transpose(1, 2)))


def batchnorm_block_lm() -> nn.Module:
    torch.manual_seed(0)
    return BatchNormBlockLM()


def microbatched_reference(factory: Any, batches: list[Any], microbatches: int
                           ) -> dict[str, Any]:
    """One device, eager, as a pipeline computes: the forward on each microbatch in turn (a
    BatchNorm normalises over a microbatch and updates its running statistics once per
    microbatch), the loss over the whole batch, SGD with torch's clipping (``W.reference``)."""
    model = factory()
    opt = torch.optim.SGD(model.parameters(), lr=W.LR)
    losses = []
    for tokens, labels in batches:
        logits = torch.cat([model(x) for x in tokens.chunk(microbatches)])
        loss = W.mlm_loss(logits, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": {n: t.detach().clone()
                                        for n, t in model.state_dict().items()}}


def train_pipeline_compiled(rank: int, world_size: int, plan: str, factory: Any,
                            batches: list[Any]) -> dict[str, Any]:
    """Train under a pipeline plan; also what torch.compile had built when torch's schedule
    began its shape inference (the first stage's forward, sends and all), and at the end."""
    from plait._torch_compat import dynamo_frames, dynamo_graph_count, reset_dynamo
    from plait.parallel.layout import layout_of
    from plait.runtime import init

    reset_dynamo()
    run = init(plan, quiet=True, log_every=1, seed=0)
    model = run.parallelize(factory())
    at_inference: list[tuple[int, int]] = []
    for stage in layout_of(model).pipeline.stages:
        infer = stage._prepare_forward_infra

        def first_seen(*args: Any, _infer: Any = infer, **kwargs: Any) -> Any:
            if not at_inference:
                at_inference.append(dynamo_frames())
            return _infer(*args, **kwargs)

        stage._prepare_forward_infra = first_seen
    opt = torch.optim.SGD(model.parameters(), lr=W.LR, foreach=False)
    losses = [float(run.step(model, b, W.mlm_loss, opt)) for b in batches]
    state = run.full_state_dict(model)
    out = {"losses": losses, "graphs": dynamo_graph_count(), "frames": dynamo_frames(),
           "at_inference": at_inference[0], "state": state if rank == 0 else None}
    run.close()
    return out
