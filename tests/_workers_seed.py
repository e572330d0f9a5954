"""Workers for ``tests/test_user_seed.py``: a script seeded as on one device
(``torch.manual_seed(s)`` before ``plait.init()``), or not at all, or through
``plait.init(seed=)``, and what each run starts from and trains to."""

from __future__ import annotations

import contextlib
import io
import re
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

STEPS, BATCH, WIDTH = 3, 8, 12


class DropNet(nn.Module):
    """Two linear layers with dropout between them: its training loss depends on the random
    stream after the model is built, not only on the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.drop, self.out = nn.Linear(WIDTH, 16), nn.Dropout(0.3), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.tanh(self.inp(x))))


class Rows(Dataset):
    """Fixed rows and labels, drawn from a generator of their own (not the global stream)."""

    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(n, WIDTH, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = Rows()
    return [(data.x[k * BATCH:(k + 1) * BATCH], data.y[k * BATCH:(k + 1) * BATCH])
            for k in range(STEPS)]


def one_device(seed: int) -> dict[str, Any]:
    """The script on one device, no plait: seed, build, train on the fixed batches (clipping
    the gradient norm at 1.0, as plait's default plan does)."""
    torch.manual_seed(seed)
    model = DropNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for x, y in _batches():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # plait's default clip
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone()
                                        for k, v in model.state_dict().items()}}


def one_process(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    """The same script under plait in one process: ``torch.manual_seed(seed)``, then
    ``plait.init()``, build, ``run.parallelize``, ``run.step`` on the same batches."""
    import plait

    torch.manual_seed(seed)
    run = plait.init("single", quiet=True)
    model = run.parallelize(DropNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = [float(run.step(model, batch, F.cross_entropy, opt)) for batch in _batches()]
    state = run.full_state_dict(model)
    run.close()
    return {"losses": losses, "state": state}


def _case(plan: str, user_seed: int | None, seed: int | None) -> dict[str, Any]:
    """One run: the script seeds with ``user_seed`` (None: a fresh process's random seed,
    different on every rank), then ``plait.init(plan, seed=seed)``, builds, lays out, trains
    ``STEPS`` steps from ``run.loader``. What each rank started from and trained to, and what
    rank 0 printed."""
    import plait

    if user_seed is None:
        torch.seed()  # as a new interpreter starts: its own random seed on each rank
    else:
        torch.manual_seed(user_seed)
    before = torch.initial_seed()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run = plait.init(plan, **({} if seed is None else {"seed": seed}))
    said = printed.getvalue()  # what init printed (the progress lines go there too, later)
    model = DropNet()
    built = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model = run.parallelize(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = [float(run.step(model, batch, F.cross_entropy, opt))
              for batch in run.loader(Rows(), batch_size=BATCH, steps=STEPS)]
    after = torch.rand(4)  # what the script draws next, beside its replicas
    out = {"initial_seed": before, "seed": run.seed, "printed": said,
           "built": built, "losses": losses, "state": run.full_state_dict(model),
           "next": after}
    run.close()
    return out


def seeded_runs(rank: int, world_size: int, plan: str) -> dict[str, Any]:
    """The runs of a seed sweep, in one process per rank: seeds 1, 2, 1 again, unseeded (and
    that run again from the seed it printed), and ``plait.init(seed=5)`` after the script
    seeded 1 and 7."""
    runs = {"one": _case(plan, 1, None), "two": _case(plan, 2, None),
            "one_again": _case(plan, 1, None), "unseeded": _case(plan, None, None)}
    # the seed rank 0 printed (the test checks the line); the others print nothing
    said = re.search(r"plait: seed (\d+) ", runs["unseeded"]["printed"])
    runs["replayed"] = _case(plan, None, int(said.group(1)) if said else runs["unseeded"]["seed"])
    runs["given_after_1"] = _case(plan, 1, 5)
    runs["given_after_7"] = _case(plan, 7, 5)
    runs["top"] = _case(plan, 2**64 - 1, None)  # the largest seed torch takes: the loader too
    return runs


def plan_event(rank: int, world_size: int, user_seed: int) -> str:
    """What ``plait.init(format="json")`` writes on stdout after ``torch.manual_seed``."""
    import plait

    torch.manual_seed(user_seed)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run = plait.init("single", format="json")
        run.close()
    return printed.getvalue()


def resumed_seed(rank: int, world_size: int, folder: str) -> list[tuple[int, str, list[float]]]:
    """An unseeded job that saves at step 2 and stops, resumed by another unseeded process
    (a new random seed of its own), then the whole job again from the seed the first said:
    each one's seed, what rank 0 printed and its losses."""
    import plait

    out = []
    for steps, seed, where in ((2, None, folder), (4, None, folder), (4, -1, None)):
        torch.seed()
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            run = plait.init("single", checkpoint=where, every=2 if where else None,
                             seed=out[0][0] if seed == -1 else None)
        said = printed.getvalue()
        model = run.parallelize(DropNet())
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        losses = [float(run.step(model, batch, F.cross_entropy, opt))
                  for batch in run.loader(Rows(), batch_size=BATCH, steps=steps)]
        run.close()
        out.append((run.seed, said, losses))
    return out
