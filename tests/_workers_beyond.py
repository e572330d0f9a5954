"""Models that are not transformers, written for tests/test_models_beyond.py: a recurrent
sequence classifier (LSTM over packed sequences, then a GRU), a CNN that applies one convolution
twice with a frozen stem and a non-persistent buffer, a two-tower model and a two-view encoder
with blocks trained with a contrastive (InfoNCE) loss over the whole global batch, and a model
whose blocks and head hold branches that run on some steps only. Each is trained under plait in
spawned processes and compared with a plain one-process loop."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from plait.check import _slice
from tests._workers_semantics import LR, STEPS

BATCH, SEQ, VOCAB, WIDTH = 8, 6, 20, 12


class Recurrent(nn.Module):
    """Embedding, an LSTM over packed sequences of different lengths, a GRU, a class head
    read at each row's last real position."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.lstm = nn.LSTM(WIDTH, WIDTH, batch_first=True)
        self.gru = nn.GRU(WIDTH, WIDTH, batch_first=True)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.embed(tokens), lengths.cpu(), batch_first=True,
                                      enforce_sorted=False)
        h, _ = pad_packed_sequence(self.lstm(packed)[0], batch_first=True,
                                   total_length=tokens.shape[1])
        h, _ = self.gru(h)
        last = h[torch.arange(h.shape[0]), lengths - 1]
        return self.head(last)


def recurrent() -> nn.Module:
    torch.manual_seed(0)
    return Recurrent()


def sequence_batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Token rows of lengths 1..SEQ (padded with 0) and one class per row."""
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (BATCH,), generator=g)
    tokens[torch.arange(SEQ)[None, :] >= lengths[:, None]] = 0
    return {"tokens": tokens, "lengths": lengths}, torch.randint(0, 4, (BATCH,), generator=g)


class SharedConv(nn.Module):
    """A frozen stem, one convolution applied twice (a weight used twice in a step), GroupNorm,
    and a per-channel input normalisation held in a non-persistent buffer (not in the state
    dict, not in checkpoints)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pixel_mean", torch.tensor([0.1, -0.2, 0.3]).reshape(1, 3, 1, 1),
                             persistent=False)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stem.requires_grad_(False)
        self.shared = nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(x - self.pixel_mean))
        h = F.relu(self.norm(self.shared(h)))
        h = F.relu(self.shared(h)) + h
        return self.head(h.mean((2, 3)))


def shared_conv() -> nn.Module:
    torch.manual_seed(0)
    return SharedConv()


def image_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(600 + step)
    return torch.randn(BATCH, 3, 6, 6, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


class TwoTower(nn.Module):
    """Image and text encoders projecting into one embedding space (CLIP's shape, tiny)."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 8))
        self.text = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Flatten(), nn.Linear(16 * 4, 8))

    def forward(self, image: torch.Tensor, text: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return F.normalize(self.image(image), dim=-1), F.normalize(self.text(text), dim=-1)


def two_tower() -> nn.Module:
    torch.manual_seed(0)
    return TwoTower()


def pair_batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(image features, caption tokens) pairs; the targets are each row's index in the
    global batch (what the contrastive loss reads as the matching column)."""
    g = torch.Generator().manual_seed(700 + step)
    return ({"image": torch.randn(BATCH, 10, generator=g),
             "text": torch.randint(0, VOCAB, (BATCH, 4), generator=g)},
            torch.arange(BATCH))


def info_nce(gather: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The symmetric InfoNCE loss (CLIP's), each row against every column ``gather`` gives:
    the identity for one device, ``run.all_gather`` under data parallelism; ``targets`` are
    the rows' indices among those columns."""

    def loss(out: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        image, text = out
        all_image, all_text = gather(image), gather(text)
        local = targets - targets[0] if all_text.shape[0] == image.shape[0] else targets
        return 0.5 * (F.cross_entropy(image @ all_text.T / 0.1, local)
                      + F.cross_entropy(text @ all_image.T / 0.1, local))

    return loss


class Twin(nn.Module):
    """One encoder for two views of each row (SimCLR's shape, tiny): an input layer, residual
    MLP blocks (what tensor parallelism splits), a projection; ``(rows, 2 views, 8)``
    normalised embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(10, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(),
                                                  nn.Linear(2 * WIDTH, WIDTH))
                                    for _ in range(4))
        self.proj = nn.Linear(WIDTH, 8)

    def forward(self, views: torch.Tensor) -> torch.Tensor:
        h = self.embed(views)
        for block in self.blocks:
            h = h + block(h)
        return F.normalize(self.proj(h), dim=-1)


def twin() -> nn.Module:
    torch.manual_seed(0)
    return Twin()


def views_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two noisy views of each row's features; the targets are unused (the contrastive
    labels are each row's place among the gathered rows)."""
    g = torch.Generator().manual_seed(750 + step)
    base = torch.randn(BATCH, 1, 10, generator=g)
    return base + 0.3 * torch.randn(BATCH, 2, 10, generator=g), torch.zeros(BATCH)


def views_nce(gather: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """Symmetric InfoNCE between the two views, each row against the gathered rows of the
    other view, labelled with its place there: ``gather(t, return_index=True)`` is
    ``run.all_gather``, or for one device :func:`no_gather`."""

    def loss(out: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        a, b = out[:, 0], out[:, 1]
        all_a, labels = gather(a, return_index=True)
        all_b = gather(b)
        return 0.5 * (F.cross_entropy(a @ all_b.T / 0.1, labels)
                      + F.cross_entropy(b @ all_a.T / 0.1, labels))

    return loss


def no_gather(t: torch.Tensor, return_index: bool = False) -> Any:
    """One device's ``run.all_gather``: the rows themselves, at their own places."""
    return (t, torch.arange(t.shape[0])) if return_index else t


def accumulated_reference(factory: Callable[[], nn.Module], batches: list[Any],
                          loss_fn: Callable, data_ranks: int, micro: int) -> dict[str, Any]:
    """One device with gradient accumulation over ``micro`` chunks per step, chunk j holding
    micro-batch j of every data rank's slice (what a loss over ``run.all_gather`` compares
    under grad_accum or a pipeline's microbatches); the step's loss is the chunks' mean."""
    def step_loss(model: nn.Module, inputs: torch.Tensor, targets: Any) -> torch.Tensor:
        n = inputs.shape[0] // (data_ranks * micro)
        chunks = [torch.cat([inputs[(r * micro + j) * n:(r * micro + j + 1) * n]
                             for r in range(data_ranks)]) for j in range(micro)]
        return sum(loss_fn(model(c), targets) for c in chunks) / micro

    return _one_device(factory, batches, step_loss, False)


def held_out_losses(factory: Callable[[], nn.Module], state: dict[str, torch.Tensor],
                    batches: list[Any], loss_fn: Callable, data_ranks: int = 1,
                    micro: int = 1) -> list[float]:
    """One device's loss of each held-out batch with the trained ``state``, in eval mode and
    without gradients; with ``micro`` > 1 the mean over chunks as :func:`accumulated_reference`
    takes them (chunk j: micro-batch j of every data rank's slice)."""
    model = factory()
    model.load_state_dict(state)
    model.eval()
    out = []
    with torch.no_grad():
        for inputs, targets in batches:
            if isinstance(inputs, dict):
                out.append(float(loss_fn(model(**inputs), targets)))
                continue
            n = inputs.shape[0] // (data_ranks * micro)
            chunks = [torch.cat([inputs[(r * micro + j) * n:(r * micro + j + 1) * n]
                                 for r in range(data_ranks)]) for j in range(micro)]
            out.append(float(sum(loss_fn(model(c), targets) for c in chunks) / micro))
    return out


def _one_device(factory: Callable[[], nn.Module], batches: list[Any], step_loss: Callable,
                adam: bool | str) -> dict[str, Any]:
    """The one-device loop both references run: ``step_loss(model, inputs, targets)`` per
    batch, backward, torch's clipping at 1.0 (plait's default), a step; the losses and the
    final state."""
    model = factory()
    opt = _optimizer(model.parameters(), adam)
    losses = []
    for inputs, targets in batches[:STEPS]:
        loss = step_loss(model, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": {k: v.detach().clone()
                                        for k, v in model.state_dict().items()}}


def _state(run: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    return run.full_state_dict(model)


def _optimizer(params: Any, adam: bool | str) -> torch.optim.Optimizer:
    """SGD; Adam when ``adam``; AdamW with weight decay 0.1 when ``adam == "adamw"`` (a zero
    gradient moves a parameter there even without momentum: the decay)."""
    if adam == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
    return (torch.optim.Adam(params, lr=1e-2, foreach=False) if adam
            else torch.optim.SGD(params, lr=LR, foreach=False))


def train(rank: int, world_size: int, jobs: list[tuple[str, Callable, list[Any], Any]],
          adam: bool | str = False) -> list[dict[str, Any]]:
    """Train each (plan, factory, global batches, loss) in one process group with SGD, as
    tests/_workers_semantics.train_jobs does; a loss given as the string "info_nce" is
    :func:`info_nce` over ``run.all_gather``, "info_nce_local" over this rank's rows only.
    Batches after the first STEPS are held out: after training, ``run.evaluate``'s loss of
    each (this rank's slice, the same loss) goes in "evals"."""
    from plait.runtime import init

    out = []
    for text, factory, batches, loss_fn in jobs:
        run = init(text, quiet=True, log_every=1, seed=0)
        if loss_fn == "info_nce":
            loss_fn = info_nce(run.all_gather)
        elif loss_fn == "info_nce_local":
            loss_fn = info_nce(lambda t: t)
        elif loss_fn == "views_nce":
            loss_fn = views_nce(run.all_gather)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = run.parallelize(factory())
            opt = _optimizer(model.parameters(), adam)
            losses = [float(run.step(model, _slice(b, run.dp_rank, run.dp_size), loss_fn, opt))
                      for b in batches[:STEPS]]
            evals = [float(run.evaluate(model, _slice(b, run.dp_rank, run.dp_size), loss_fn))
                     for b in batches[STEPS:]]
        state = _state(run, model)
        run.close()
        out.append({"plan": text, "losses": losses, "state": state if rank == 0 else None,
                    "evals": evals, "warnings": [str(w.message) for w in caught]})
    return out


def reference(factory: Callable[[], nn.Module], batches: list[Any], loss_fn: Callable,
              adam: bool | str = False) -> dict[str, Any]:
    """One process on each whole global batch: SGD, torch's clipping at 1.0 (plait's default),
    inputs given as a dict passed by keyword."""
    def step_loss(model: nn.Module, inputs: Any, targets: Any) -> torch.Tensor:
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        return loss_fn(out, targets)

    return _one_device(factory, batches, step_loss, adam)


def resume(rank: int, world_size: int, factory: Callable[[], nn.Module], batches: list[Any],
           loss_fn: Callable, saved_as: str, loaded_as: str, root: str) -> dict[str, Any]:
    """Adam for len(batches) steps under ``saved_as``, saving after the first; then a fresh
    model and optimizer under ``loaded_as`` load that checkpoint and take the remaining steps.
    Rank 0's full state after both, and the steps' losses."""
    from plait.runtime import init

    def steps(run: Any, model: nn.Module, opt: Any, todo: list[Any]) -> list[float]:
        return [float(run.step(model, _slice(b, run.dp_rank, run.dp_size), loss_fn, opt))
                for b in todo]

    out: dict[str, Any] = {}
    for phase, plan in (("straight", saved_as), ("resumed", loaded_as)):
        run = init(plan, quiet=True, log_every=1, seed=0)
        model = run.parallelize(factory())
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
        if phase == "straight":
            losses = steps(run, model, opt, batches[:1])
            run.save(root, model=model, optimizer=opt)
        else:
            run.load(root, model=model, optimizer=opt)
            losses = []
        losses += steps(run, model, opt, batches[1:])
        state = _state(run, model)  # collective: every rank gathers
        out[phase] = {"losses": losses, "state": state if rank == 0 else None}
        run.close()
    return out


class ConvBlock(nn.Module):
    """A residual 3x3 convolution block with GroupNorm."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.GroupNorm(2, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.norm(self.conv(x)))


def conv_stack() -> nn.Module:
    """A CNN as one nn.Sequential: stem, four residual blocks, pooling, a class head."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *(ConvBlock(8) for _ in range(4)),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


class TwoHeads(nn.Module):
    """Two inputs (features and a tag) and two outputs: a class head every step, and a
    regression head only on the steps whose batch carries regression targets."""

    def __init__(self) -> None:
        super().__init__()
        self.features, self.tags = nn.Linear(10, 16), nn.Embedding(4, 16)
        self.classes, self.value = nn.Linear(16, 5), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, tag: torch.Tensor, with_value: torch.Tensor
                ) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.features(x) + self.tags(tag))
        out = {"classes": self.classes(h)}
        if bool(with_value.all()):
            out["value"] = self.value(h).squeeze(-1)
        return out


def two_heads() -> nn.Module:
    torch.manual_seed(0)
    return TwoHeads()


def two_head_batch(step: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every other step carries regression targets (the value head is used on those only)."""
    g = torch.Generator().manual_seed(800 + step)
    with_value = step % 2 == 0
    return ({"x": torch.randn(BATCH, 10, generator=g),
             "tag": torch.randint(0, 4, (BATCH,), generator=g),
             "with_value": torch.full((BATCH,), with_value)},
            {"labels": torch.randint(0, 5, (BATCH,), generator=g),
             "value": torch.randn(BATCH, generator=g)})


def two_head_loss(out: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]
                  ) -> torch.Tensor:
    loss = F.cross_entropy(out["classes"], targets["labels"])
    if "value" in out:
        loss = loss + 0.5 * F.mse_loss(out["value"], targets["value"])
    return loss


class GatedBlock(nn.Module):
    """A residual MLP, and a second branch that runs only when the batch's ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp, self.branch = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = h + torch.tanh(self.mlp(h))
        if bool(gate.all()):
            h = h + torch.tanh(self.branch(h))
        return h


class Gated(nn.Module):
    """Four :class:`GatedBlock` between an input layer and a class head, and an auxiliary
    head after the blocks that also runs only when ``gate`` is set (a pipeline's first stage
    holds gated branches, its last gated branches and the gated head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(10, WIDTH)
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(4))
        self.head, self.aux = nn.Linear(WIDTH, 5), nn.Linear(WIDTH, 5)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, gate)
        out = self.head(h)
        return out + self.aux(h) if bool(gate.all()) else out


def gated() -> nn.Module:
    torch.manual_seed(0)
    return Gated()


def gated_batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The gate is set on the even steps only: on the odd ones no rank uses the branches."""
    g = torch.Generator().manual_seed(900 + step)
    return ({"x": torch.randn(BATCH, 10, generator=g),
             "gate": torch.full((BATCH,), step % 2 == 0)},
            torch.randint(0, 5, (BATCH,), generator=g))


def conv_bn_frozen_stem() -> nn.Module:
    """tests/_workers_semantics.conv_bn with its first convolution frozen: the first
    BatchNorm's input is then the same under every layout and on one device."""
    from tests._workers_semantics import conv_bn

    model = conv_bn()
    model.stem[0].requires_grad_(False)
    return model


def batchnorm_buffers(rank: int, world_size: int, jobs: list[tuple[str, str]],
                      batches: list[Any]) -> list[dict[str, Any]]:
    """Train :func:`conv_bn_frozen_stem` under each (plan, read) with SGD, then read the
    model: ``read`` "evaluate" (``run.evaluate``), "forward" (the user's own ``model.eval()``
    and forward), or "state" (``run.full_state_dict`` alone). This rank's own BatchNorm
    running statistics after training and after the read, the state the run saves, and the
    losses."""
    from plait.parallel.data import unwrap
    from plait.runtime import init

    def running(model: nn.Module) -> dict[str, torch.Tensor]:
        return {n: b.detach().clone() for n, b in unwrap(model).named_buffers()
                if "running" in n}

    out = []
    for plan, read in jobs:
        run = init(plan, quiet=True, log_every=1, seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = run.parallelize(conv_bn_frozen_stem())
            opt = _optimizer([p for p in model.parameters() if p.requires_grad], False)
            losses = [float(run.step(model, _slice(b, run.dp_rank, run.dp_size),
                                     F.cross_entropy, opt)) for b in batches]
        trained = running(model)
        if read == "evaluate":
            model.eval()
            run.evaluate(model, _slice(batches[0], run.dp_rank, run.dp_size), F.cross_entropy)
        elif read == "forward":
            model.eval()
            with torch.no_grad():
                model(_slice(batches[0], run.dp_rank, run.dp_size)[0])
        evaluated = running(model)
        state = _state(run, model)
        run.close()
        out.append({"plan": plan, "read": read, "losses": losses, "trained": trained,
                    "evaluated": evaluated,
                    "saved": {k: v for k, v in state.items() if "running" in k}})
    return out


def batchnorm_reads(rank: int, world_size: int, plan: str, model_name: str
                    ) -> dict[str, Any]:
    """Train a model with BatchNorm under ``plan`` (SGD): "convnet",
    tests/_pipeline_models.SmallConvNet with BatchNorm in its stem (a pipeline's first
    stage), or "mlp", tests/_workers_semantics.batchnorm_mlp (tensor-parallel blocks, the
    BatchNorm replicated over tp); evaluate, take one more step and evaluate again. This
    rank's running statistics (its local copy) after each step and each evaluation, and the
    state the run saves."""
    from plait.parallel.layout import local_modules
    from plait.runtime import init
    from tests import _pipeline_models as M
    from tests import _workers_semantics as W

    def running(model: nn.Module) -> dict[str, torch.Tensor]:
        return {n: (b.to_local() if hasattr(b, "to_local") else b).detach().clone()
                for m in local_modules(model) for n, b in m.named_buffers() if "running" in n}

    run = init(plan, quiet=True, log_every=1, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = run.parallelize(M.SmallConvNet(batchnorm=True) if model_name == "convnet"
                                else W.batchnorm_mlp())
    batch = M.image_batch if model_name == "convnet" else W.bn_batch
    opt = _optimizer(model.parameters(), False)
    read: list[dict[str, torch.Tensor]] = []
    for steps in (range(3), range(3, 4)):
        for s in steps:
            run.step(model, _slice(batch(s), run.dp_rank, run.dp_size), F.cross_entropy, opt)
        read.append(running(model))
        model.eval()
        run.evaluate(model, _slice(batch(0), run.dp_rank, run.dp_size), F.cross_entropy)
        model.train()
        read.append(running(model))
    state = _state(run, model)
    run.close()
    return {"dp_rank": run.dp_rank, "read": read,
            "saved": {k: v for k, v in state.items() if "running" in k}}


def gathered_rows(rank: int, world_size: int, plans: list[str]) -> list[dict[str, Any]]:
    """Under each plan: ``run.all_gather`` of a row holding this rank's data rank (which data
    rank's rows come where), and of ``dp_rank + 1`` rows of a tensor with a gradient (uneven
    counts, as the last batch of an epoch may leave them), with the places of this rank's rows
    among the gathered ones and the gradient that a weighted sum of the gathered rows sends
    back to this rank's rows; the shape it gives a meta tensor (a shape check, which runs the
    loss with no other rank taking part). Under tp also a DTensor sharded over tp on its last
    dim (a tensor-parallel output), gathered whole and with its gradient, and the refusal of
    one sharded over tp on its rows."""
    from torch.distributed.tensor import DTensor, Shard

    from plait.runtime import init

    out = []
    for plan in plans:
        run = init(plan, quiet=True, seed=0)
        order = run.all_gather(torch.tensor([[float(run.dp_rank)]]))
        rows = torch.full((run.dp_rank + 1, 2), float(run.dp_rank), requires_grad=True)
        gathered, index = run.all_gather(rows, return_index=True)
        weights = torch.arange(gathered.numel(), dtype=torch.float).reshape(gathered.shape)
        (weights * gathered * (run.dp_rank + 1)).sum().backward()
        shape = tuple(run.all_gather(torch.empty(2, 3, device="meta")).shape)
        got: dict[str, Any] = {"plan": plan, "dp_rank": run.dp_rank, "dp_size": run.dp_size,
                               "order": order.flatten().tolist(), "gathered": gathered.detach(),
                               "index": index, "meta_shape": shape, "grad": rows.grad}
        if run.plan.tp > 1:
            tp_mesh = run._mesh()["tp"]
            tp_rank = tp_mesh.get_local_rank()
            piece = torch.full((2, 1), 10.0 * run.dp_rank + tp_rank, requires_grad=True)
            sharded = DTensor.from_local(piece, tp_mesh, [Shard(1)], run_check=False)
            whole = run.all_gather(sharded)
            (whole.full_tensor() * torch.arange(whole.shape[0] * 2.0).reshape(-1, 2)).sum(
                ).backward()
            got["dtensor"] = (whole.placements == sharded.placements,
                              whole.full_tensor().detach(), piece.grad, tp_rank)
            try:
                run.all_gather(DTensor.from_local(piece.detach(), tp_mesh, [Shard(0)],
                                                  run_check=False))
                got["rows_sharded"] = None
            except ValueError as exc:
                got["rows_sharded"] = str(exc)
        out.append(got)
        run.close()
    return out
