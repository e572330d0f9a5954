"""Workers for tests/test_compile.py (spawned processes import this module)."""

from __future__ import annotations

from typing import Any

import torch

from plait.check import _slice
from tests import _workers_semantics as W


def compiled_masked_lm() -> torch.nn.Module:
    """The one-device model as a user compiles it: torch.compile of the whole model."""
    return torch.compile(W.masked_lm())


def compiled_reference_lm() -> torch.nn.Module:
    """plait's reference transformer (a TP plan with a vocabulary-parallel embedding before
    the blocks), torch.compile'd on one device."""
    return torch.compile(W.reference_lm())


def train_compiled(rank: int, world_size: int, plan: str, factory: Any,
                   batches: list[Any], by_hand: bool = False) -> dict[str, Any]:
    """Train like ``W.train_jobs``; also report whether torch compiled anything and what a
    torch.compile of the laid-out model is told at run.step. ``by_hand``: the user compiles
    each block's forward of the laid-out model, plait is not told."""
    from plait._torch_compat import dynamo_graph_count, reset_dynamo
    from plait.runtime import init

    reset_dynamo()
    run = init(plan, quiet=True, log_every=1)
    model = run.parallelize(factory())
    if by_hand:
        from plait.parallel.units import repeated_blocks

        for _, block in repeated_blocks(model):
            block.forward = torch.compile(block.forward)
    opt = torch.optim.SGD(model.parameters(), lr=W.LR, foreach=False)
    losses = [float(run.step(model, _slice(b, run.dp_rank, run.dp_size), W.mlm_loss, opt))
              for b in batches]
    graphs = dynamo_graph_count()
    refused = None
    try:
        run.step(torch.compile(model), _slice(batches[0], run.dp_rank, run.dp_size), W.mlm_loss,
                 opt)
    except ValueError as exc:
        refused = str(exc)
    state = run.full_state_dict(model)
    out = {"plan": run.plan.to_string(), "losses": losses, "graphs": graphs,
           "refused": refused, "state": state if rank == 0 else None}
    run.close()
    return out
