"""Workers for tests/test_stagefaults.py, with the model written for them: a user's error
raised on one rank only (in a block's forward, the loss function, a backward, the data
loader's ``__getitem__``, the loop between steps) under each layout, and a model whose own
loss module sits in an ``nn.ModuleDict`` / ``nn.ModuleList`` of a module another pipeline
stage owns."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

WIDTH, CLASSES, ROWS, SEQ, STEPS, LR = 8, 4, 8, 4, 4, 0.1
# The call of a block from which it raises (Block).
FAIL_AT = 4

# Where a fault is raised (fault_on_one_rank's ``where``).
PLACES = ("forward", "loss", "backward", "getitem", "loop")


class UserBugError(RuntimeError):
    """The error a user's code raises: the tests look for its message in the report."""


class _Refuse(torch.autograd.Function):
    """Identity forward; the backward raises (a user's custom Function with a bug)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise UserBugError("boom in backward")


class Block(nn.Module):
    """A residual MLP block whose forward (``fail="forward"``) or backward (``"backward"``)
    raises from its ``FAIL_AT``-th call on: a later step's, past the first step's set-up (a
    pipeline stage's first call infers its shapes, outside torch's schedule)."""

    def __init__(self, fail: str = "") -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.fail = fail
        self.calls = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        armed = self.calls >= FAIL_AT
        if armed and self.fail == "forward":
            raise UserBugError("boom in forward")
        out = h + self.down(torch.tanh(self.up(h)))
        return _Refuse.apply(out) if armed and self.fail == "backward" else out


class Net(nn.Module):
    """Inputs (B, SEQ, WIDTH) to per-token class logits: one attention over the sequence
    (F.scaled_dot_product_attention, which context parallelism needs), then two blocks
    (``position_ids``, given under context parallelism, changes nothing)."""

    def __init__(self, fail: str = "") -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(Block(fail) for _ in range(2))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        h = self.stem(x)[:, None]
        h = (h + F.scaled_dot_product_attention(h, h, h))[:, 0]
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class Rows(Dataset):
    """Random rows; ``__getitem__`` raises when ``fail``."""

    def __init__(self, fail: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, SEQ, WIDTH, generator=g)
        self.y = torch.randint(0, CLASSES, (64, SEQ), generator=g)
        self.fail = fail

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fail:
            raise UserBugError("boom in __getitem__")
        return self.x[i], self.y[i]


def token_loss(fail: bool) -> Any:
    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if fail:
            raise UserBugError("boom in the loss")
        return nn.functional.cross_entropy(logits.reshape(-1, CLASSES), y.reshape(-1))
    return loss


def fault_on_one_rank(rank: int, world_size: int, plan: str, where: str, bad_rank: int
                      ) -> None:
    """Train ``Net`` under ``plan`` for a few steps; rank ``bad_rank`` raises ``UserBugError`` at
    ``where``. Returns only if nothing raised."""
    from plait.runtime import init

    torch.set_num_threads(1)
    bad = rank == bad_rank
    run = init(plan, seed=0, quiet=True)
    torch.manual_seed(0)
    model = run.parallelize(Net(where if bad and where in ("forward", "backward") else ""),
                            example=torch.zeros(ROWS, SEQ, WIDTH))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loader = run.loader(Rows(bad and where == "getitem"), ROWS)
    loss = token_loss(bad and where == "loss")
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        if bad and where == "loop" and step == 1:
            raise UserBugError("boom between steps")
        run.step(model, batch, loss, opt)
    run.close()
