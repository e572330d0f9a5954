"""Imbalanced classes and weighted losses, as a newcomer brings them: a small classifier on
feature vectors whose classes are far from equally common, trained with class weights
(``F.cross_entropy(weight=...)``, with ``ignore_index`` and label smoothing, ``F.nll_loss``),
a multi-label head with ``pos_weight``, a focal loss written by hand, a Hugging Face-style
model computing its own weighted loss (``output.loss``), and a token classifier with padded
labels and class weights. Each factory returns ``(model, dataset, loss_fn, collate_fn)``;
batches are ``(inputs, targets)``, or a dict with ``labels`` for the model's own loss.

A weighted mean divides by the sum of the targets' class weights, not by their number: each
replica's (and micro-batch's) share of the global batch holds other classes, so it weighs
differently from its count of labels. The data is drawn so that it does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

FEATURES, HIDDEN, CLASSES = 8, 16, 4
# Class frequencies 60%, 25%, 10%, 5%, and inverse-frequency weights.
FREQUENCY = (0.60, 0.25, 0.10, 0.05)
WEIGHTS = (0.5, 1.0, 2.5, 5.0)
STEPS, BATCH = 3, 8


def class_weights() -> torch.Tensor:
    return torch.tensor(WEIGHTS)


class Classifier(nn.Module):
    """Features to class logits (``log_probs``: log-probabilities, as ``F.nll_loss`` takes)."""

    def __init__(self, log_probs: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(),
                                  nn.Linear(HIDDEN, CLASSES))
        self.log_probs = log_probs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.body(x)
        return logits.log_softmax(-1) if self.log_probs else logits


class Imbalanced(Dataset):
    """Feature vectors with a class drawn by ``FREQUENCY``, the features a noisy function of
    it; ``ignored``: that share of the labels is -100 (unlabelled rows)."""

    def __init__(self, n: int = 32, seed: int = 0, ignored: float = 0.0):
        g = torch.Generator().manual_seed(seed)
        labels = torch.multinomial(torch.tensor(FREQUENCY), n, replacement=True, generator=g)
        centers = torch.randn(CLASSES, FEATURES, generator=g)
        x = centers[labels] + 0.8 * torch.randn(n, FEATURES, generator=g)
        drop = torch.rand(n, generator=g) < ignored
        self.items = [(x[i], int(labels[i]) if not drop[i] else -100) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.items[i]


def collate_rows(items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


def weighted_ce(logits: torch.Tensor, y: torch.Tensor) -> Any:
    """``F.cross_entropy`` with class weights: the mean divides by the sum of the labels'
    weights."""
    return F.cross_entropy(logits, y, weight=class_weights().to(logits.device))


def weighted_ce_pair(logits: torch.Tensor, y: torch.Tensor) -> Any:
    """The same loss as ``(sum, count)``: the weighted sum and the labels' summed weight."""
    w = class_weights().to(logits.device)
    return F.cross_entropy(logits, y, weight=w, reduction="sum"), w[y].sum()


def smoothed_ce(logits: torch.Tensor, y: torch.Tensor) -> Any:
    """Class weights, -100 labels left out, label smoothing 0.1."""
    return F.cross_entropy(logits, y, weight=class_weights().to(logits.device),
                           ignore_index=-100, label_smoothing=0.1)


def smoothed_ce_pair(logits: torch.Tensor, y: torch.Tensor) -> Any:
    """:func:`smoothed_ce` as ``(sum, count)``: its mean divides both the target term and the
    smoothing term by the summed weight of the labels that are not -100."""
    w = class_weights().to(logits.device)
    total = F.cross_entropy(logits, y, weight=w, ignore_index=-100, label_smoothing=0.1,
                            reduction="sum")
    return total, w[y[y != -100]].sum()


def weighted_nll(log_probs: torch.Tensor, y: torch.Tensor) -> Any:
    return F.nll_loss(log_probs, y, weight=class_weights().to(log_probs.device))


def weighted_nll_pair(log_probs: torch.Tensor, y: torch.Tensor) -> Any:
    w = class_weights().to(log_probs.device)
    return F.nll_loss(log_probs, y, weight=w, reduction="sum"), w[y].sum()


def focal(logits: torch.Tensor, y: torch.Tensor, gamma: float = 2.0) -> Any:
    """A focal loss by hand: ``alpha_y (1 - p_y)^gamma (-log p_y)`` per row, the mean over the
    rows (the class weights scale rows, they do not divide)."""
    logp = logits.log_softmax(-1).gather(1, y[:, None]).squeeze(1)
    alpha = class_weights().to(logits.device)[y]
    return (alpha * (1 - logp.exp()).pow(gamma) * -logp).mean()


# --- multi-label ---


class MultiLabel(Dataset):
    """Feature vectors with 0 to 4 of the classes on (multi-hot float targets), each class
    on with its ``FREQUENCY``."""

    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        on = torch.rand(n, CLASSES, generator=g) < torch.tensor(FREQUENCY)
        centers = torch.randn(CLASSES, FEATURES, generator=g)
        x = on.float() @ centers + 0.5 * torch.randn(n, FEATURES, generator=g)
        self.items = [(x[i], on[i].float()) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[i]


def collate_multi(items: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def bce_pos_weight(logits: torch.Tensor, multi_hot: torch.Tensor) -> Any:
    """``pos_weight`` scales each class's positive term; the mean is over every entry
    (rows x classes), not over weights."""
    pos = (1.0 / torch.tensor(FREQUENCY)).to(logits.device)
    return F.binary_cross_entropy_with_logits(logits, multi_hot, pos_weight=pos)


# --- a Hugging Face-style model with its own weighted loss ---


class WeightedHead(nn.Module):
    """Returns ``{"loss", "logits"}`` as a Hugging Face model does, its loss an
    ``nn.CrossEntropyLoss(weight=...)`` it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = Classifier()
        self.loss_fct = nn.CrossEntropyLoss(weight=class_weights())

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None
                ) -> dict[str, torch.Tensor]:
        logits = self.classifier(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = self.loss_fct(logits.view(-1, CLASSES), labels.view(-1))
        return out


@dataclass
class Output:
    """A Hugging Face-style output object: the loss and the logits as attributes."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class WeightedInForward(nn.Module):
    """:class:`WeightedHead` with its loss made inside ``forward`` from a buffer of class
    weights, as many Hugging Face heads do (``loss_fct = CrossEntropyLoss(...)``), returning
    an output object: plait sees no loss module to read the weights of."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = Classifier()
        self.register_buffer("class_weights", class_weights())

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        logits = self.classifier(x)
        loss = None
        if labels is not None:
            loss_fct = nn.CrossEntropyLoss(weight=self.class_weights)
            loss = loss_fct(logits.view(-1, CLASSES), labels.view(-1))
        return Output(loss, logits)


def collate_hf(items: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    x, y = collate_rows(items)
    return {"x": x, "labels": y}


# --- token classification ---

VOCAB, TAGS = 12, CLASSES


class Tagger(nn.Module):
    """Token ids ``(B, T)`` to per-token tag logits ``(B, T, TAGS)``, each token on its own
    (so that padding a batch further changes no real token's logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Sequential(nn.Tanh(), nn.Linear(HIDDEN, TAGS))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


class Sentences(Dataset):
    """Sentences of 2 to 9 tokens, each token's tag drawn by ``FREQUENCY`` (most tokens are
    "outside", tag 0), its id a noisy function of the tag."""

    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(2, 10, (), generator=g))
            tags = torch.multinomial(torch.tensor(FREQUENCY), length, replacement=True,
                                     generator=g)
            ids = (tags * 3 + torch.randint(0, 3, (length,), generator=g)) % VOCAB
            self.items.append((ids, tags))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[i]


def collate_tokens(items: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids padded with 0 and tags with -100, to the batch's longest sentence."""
    pad = nn.utils.rnn.pad_sequence
    return (pad([i for i, _ in items], batch_first=True),
            pad([t for _, t in items], batch_first=True, padding_value=-100))


def token_ce(logits: torch.Tensor, tags: torch.Tensor) -> Any:
    """Class-weighted cross-entropy over every token that is not padding."""
    return F.cross_entropy(logits.reshape(-1, TAGS), tags.reshape(-1),
                           weight=class_weights().to(logits.device))


def token_ce_pair(logits: torch.Tensor, tags: torch.Tensor) -> Any:
    w = class_weights().to(logits.device)
    total = F.cross_entropy(logits.reshape(-1, TAGS), tags.reshape(-1), weight=w,
                            reduction="sum")
    return total, w[tags[tags != -100]].sum()


LOSSES = {"weighted_ce": weighted_ce, "weighted_ce_pair": weighted_ce_pair,
          "smoothed_ce": smoothed_ce, "smoothed_ce_pair": smoothed_ce_pair,
          "weighted_nll": weighted_nll, "weighted_nll_pair": weighted_nll_pair,
          "focal": focal, "bce_pos_weight": bce_pos_weight, "token_ce": token_ce,
          "token_ce_pair": token_ce_pair}


def _factory(name: str) -> tuple[nn.Module, Dataset, Any, Any]:
    """The model, data, loss and collate_fn of case ``name``: a loss of ``LOSSES``, or
    ``hf_weighted`` (the model's own loss)."""
    torch.manual_seed(0)
    if name == "hf_weighted":
        return WeightedHead(), Imbalanced(), None, collate_hf
    if name == "hf_weighted_in_forward":
        return WeightedInForward(), Imbalanced(), None, collate_hf
    loss = LOSSES[name]
    if name.startswith("weighted_nll"):
        return Classifier(log_probs=True), Imbalanced(), loss, collate_rows
    if name.startswith("smoothed"):
        return Classifier(), Imbalanced(ignored=0.25), loss, collate_rows
    if name == "bce_pos_weight":
        return Classifier(), MultiLabel(), loss, collate_multi
    if name.startswith("token"):
        return Tagger(), Sentences(), loss, collate_tokens
    return Classifier(), Imbalanced(), loss, collate_rows


def _inputs(batch: Any) -> tuple[Any, Any]:
    """(the model's keyword arguments, the targets) of a collated batch."""
    if isinstance(batch, dict):
        return batch, None
    inputs, targets = batch
    return {"ids" if inputs.dtype == torch.long else "x": inputs}, targets


def train(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Per job ``(case, plan)`` (one ``plait.init`` each, in this process): AdamW for STEPS
    steps with batches from ``run.loader``, the losses, ``run.evaluate``'s loss of the first
    global batch, the full state on rank 0 and plait's warnings (their messages)."""
    import warnings

    from plait.runtime import init

    torch.set_num_threads(1)
    out = []
    for name, plan in jobs:
        run = init(plan, quiet=True, seed=0)
        model, data, loss_fn, collate = _factory(name)
        loader = run.loader(data, batch_size=BATCH, steps=STEPS, collate_fn=collate)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = run.parallelize(model, example=loader.batch(0))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = [float(run.step(model, batch, loss_fn, opt)) for batch in loader]
            evaluated = [float(run.evaluate(model, batch, loss_fn))
                         for batch in run.loader(data, batch_size=BATCH, steps=1,
                                                 evaluation=True, collate_fn=collate)]
        state = run.full_state_dict(model)
        run.close()
        said = [str(w.message) for w in caught if str(w.message).startswith("plait:")]
        out.append({"case": name, "plan": plan, "losses": losses, "evaluated": evaluated,
                    "warnings": said, "state": state if rank == 0 else None})
    return out


def _one_device_loss(loss_fn: Any, model: nn.Module, batch: Any) -> torch.Tensor:
    """What one device minimises on a whole batch: a scalar as it is, ``(sum, count)`` as
    ``sum / count``, the model's own loss."""
    inputs, targets = _inputs(batch)
    if loss_fn is None:
        out = model(**inputs)
        return out["loss"] if isinstance(out, dict) else out.loss
    value = loss_fn(model(**inputs), targets)
    return value[0] / value[1] if isinstance(value, tuple) else value


def reference(name: str) -> dict[str, Any]:
    """The same AdamW steps with torch alone on one device: each global batch (the loader's
    order) collated whole, torch's clipping at 1.0 (plait's default), then the loss of the
    first global batch in eval mode."""
    from plait.data.loader import DistributedLoader

    model, data, loss_fn, collate = _factory(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    order = DistributedLoader(data, BATCH)
    losses = []
    for step in range(STEPS):
        value = _one_device_loss(loss_fn, model, collate([data[int(i)] for i in
                                                          order.global_indices(step)]))
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(value.item())
    model.eval()
    with torch.no_grad():
        first = collate([data[int(i)] for i in order.global_indices(0)])
        evaluated = [_one_device_loss(loss_fn, model, first).item()]
    return {"losses": losses, "evaluated": evaluated, "state": model.state_dict()}
