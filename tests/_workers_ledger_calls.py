"""Workers for tests/test_ledger_calls.py: DDP's bucket count measured beside the ledger's
expected calls (module-level so spawn can import them)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

# Linears of uneven sizes: weights 600,000, 400,000, 560,000 and 840,000 bytes (fp32), so a
# bucket closes at a different tensor for each cap and a count of payload / cap is wrong.
WIDTHS = (300, 500, 200, 700)
WARMUP, STEPS, ROWS = 2, 2, 4


class Chain(nn.Module):
    """A stack of Linears run front to back (the order DDP's rebuilt buckets follow, reversed)."""

    def __init__(self, widths: tuple[int, ...] = WIDTHS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in
                                    zip(widths, widths[1:] + widths[:1], strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Wide(nn.Module):
    """Eight 1024 x 1024 Linears: 32 MiB of fp32 gradients, more than DDP's 25 MiB bucket."""

    def __init__(self, width: int = 1024, depth: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def wide() -> nn.Module:
    torch.manual_seed(0)
    return Wide()


class HeadFirst(nn.Module):
    """Registers its head before its embedding and body, and runs them the other way round,
    so its gradients do not become ready in the parameters' reversed order: the head's come
    first, the embedding's last. 25.07 MiB of fp32 gradients: in the order they become ready
    the body and head stay under DDP's 25 MiB (24.57 MiB) and the embedding's 0.5 MiB closes
    the one bucket; in the parameters' reversed order the body and embedding reach 25.07 MiB
    and close a first bucket, the head's then fill a second."""

    def __init__(self, vocab: int = 16, width: int = 8192, hidden: int = 780) -> None:
        super().__init__()
        self.head = nn.Linear(64, vocab)
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, 64),
                                  nn.Tanh())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


def head_first() -> nn.Module:
    torch.manual_seed(0)
    return HeadFirst()


def ddp_buckets(rank: int, world: int, caps: list[float], widths: tuple[int, ...] = WIDTHS,
                find_unused: bool = False) -> dict[float, dict[str, Any]]:
    """Per ``bucket_cap_mb``: plait's DDP (``apply_ddp``) over all ranks trains
    ``Chain(widths)`` for WARMUP steps (DDP rebuilds its buckets after the first, unless
    ``find_unused``), then STEPS inside the ledger; the ledger's report, expected from the
    laid-out model (``plait.comm.held``) with the order its gradients became ready in the
    first step (``plait.comm.ready_order``), and under ``"unordered"`` the bucket count
    ``held_model`` reads without that order (None: not known)."""
    from torch.distributed.device_mesh import init_device_mesh

    from plait.comm.held import held_model, held_traffic
    from plait.comm.ledger import Ledger
    from plait.comm.predict import expected_rows
    from plait.comm.ready_order import ReadyOrder, agreed_order
    from plait.parallel.data import apply_ddp
    from plait.plan import Plan

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_replicate",))
    plan = Plan.from_string(f"dp_replicate={world}")
    out = {}
    for cap in caps:
        torch.manual_seed(0)
        model = apply_ddp(Chain(widths), mesh, device=torch.device("cpu"), bucket_cap_mb=cap,
                          find_unused=find_unused)
        recorder = ReadyOrder(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)
        ledger = Ledger({"dp_replicate": mesh})
        for i in range(WARMUP + STEPS):
            with ledger if i >= WARMUP else contextlib.nullcontext():
                opt.zero_grad()
                model(torch.randn(ROWS, widths[0], generator=g)).square().mean().backward()
                opt.step()
        # read in the first step, its hooks off the model since
        assert recorder.done and not recorder.hooked, cap
        held = held_model(model, ready_order=agreed_order(recorder))
        report = ledger.report(expected=expected_rows(held_traffic(plan, held)))
        out[cap] = {**report.to_dict(), "unordered": held_model(model).grad_calls}
    return out
