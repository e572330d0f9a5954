"""Two more models of kinds plait's own are not, as a newcomer brings them: a small speech
recognizer trained with CTC on variable-length "audio" features (padded, with
``input_lengths``; a strided conv subsampler, an LSTM encoder), its targets padded ``(N, S)``
or concatenated flat with ``target_lengths``; and a detector-style model whose loss has two
terms, each averaged over its own count across the whole batch (a box term over the batch's
boxes, a class term over its images). Each factory returns ``(model, dataset, loss_fn,
collate_fn)``, as ``plait check --model`` takes it; batches are ``(inputs, targets)``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

FEATURES, HIDDEN, VOCAB = 6, 16, 5  # VOCAB includes the blank (0)


class TinyASR(nn.Module):
    """Frames ``(N, T, FEATURES)`` through a stride-2 conv (the subsampler: ``T' = (T - 1) // 2
    + 1`` frames) and a one-way LSTM to per-frame log-probabilities over the vocabulary,
    ``(T', N, VOCAB)`` as ``F.ctc_loss`` takes them, with each example's output lengths. A
    one-way LSTM and zero padding make an example's outputs within its length independent of
    how far the batch is padded."""

    def __init__(self) -> None:
        super().__init__()
        self.sub = nn.Conv1d(FEATURES, HIDDEN, kernel_size=3, stride=2, padding=1)
        self.enc = nn.LSTM(HIDDEN, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, features: torch.Tensor, input_lengths: torch.Tensor
                ) -> dict[str, torch.Tensor]:
        x = F.relu(self.sub(features.transpose(1, 2))).transpose(1, 2)
        h, _ = self.enc(x)
        return {"log_probs": self.head(h).log_softmax(-1).transpose(0, 1),
                "output_lengths": (input_lengths - 1) // 2 + 1}


class Utterances(Dataset):
    """Utterances of 20 to 30 frames (10 to 15 after the subsampler: room for any CTC path),
    each with a transcript of 1 to 6 symbols (1..VOCAB-1), the frames a noisy function of the
    symbols so that there is something to learn. The transcripts' longest differs between
    the halves of a global batch of 8, so that padding to each replica's longest differs."""

    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            t = int(torch.randint(20, 31, (), generator=g))
            s = int(torch.randint(1, 7, (), generator=g))
            labels = torch.randint(1, VOCAB, (s,), generator=g)
            frames = torch.randn(t, FEATURES, generator=g) * 0.3
            span = t // s
            for j, symbol in enumerate(labels.tolist()):
                frames[j * span:(j + 1) * span, symbol] += 1.0
            self.items.append((frames, labels))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[i]


def _padded_frames(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    frames = [f for f, _ in items]
    return {"features": nn.utils.rnn.pad_sequence(frames, batch_first=True),
            "input_lengths": torch.tensor([f.shape[0] for f in frames])}


def collate_padded(items: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Frames padded with zeros to the batch's longest; targets padded with the blank (0) to
    the batch's longest transcript, ``(N, S)``, with their lengths."""
    labels = [y for _, y in items]
    return _padded_frames(items), {
        "labels": nn.utils.rnn.pad_sequence(labels, batch_first=True),
        "target_lengths": torch.tensor([y.shape[0] for y in labels])}


def collate_flat(items: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """As :func:`collate_padded`, the targets concatenated into one flat tensor instead (the
    other form ``F.ctc_loss`` takes): not one row per example."""
    labels = [y for _, y in items]
    return _padded_frames(items), {"labels": torch.cat(labels),
                                   "target_lengths": torch.tensor([y.shape[0] for y in labels])}


def ctc_mean(out: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> Any:
    """``F.ctc_loss``'s default: each example's loss divided by its target length, then the
    mean over the batch's examples. A scalar mean over the examples, whatever the targets'
    form: one count per example."""
    return F.ctc_loss(out["log_probs"], targets["labels"], out["output_lengths"],
                      targets["target_lengths"])


def ctc_mean_pair(out: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> Any:
    """The same loss as a ``(sum, count)`` pair: per-example losses over their target
    lengths, summed, and the number of examples."""
    per = F.ctc_loss(out["log_probs"], targets["labels"], out["output_lengths"],
                     targets["target_lengths"], reduction="none")
    lengths = targets["target_lengths"]
    return (per / lengths.clamp_min(1)).sum(), lengths.shape[0]


def ctc_sum_over_symbols(out: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]
                         ) -> Any:
    """``reduction="sum"`` over the batch's total number of target symbols: ``(sum, count)``."""
    total = F.ctc_loss(out["log_probs"], targets["labels"], out["output_lengths"],
                       targets["target_lengths"], reduction="sum")
    return total, targets["target_lengths"].sum()


def ctc_sum_of_the_batch(out: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]
                         ) -> Any:
    """``reduction="sum"`` as one device sums it over the whole global batch: the pair of the
    micro-batch's sum and its part of the global batch of ``BATCH`` examples."""
    total = F.ctc_loss(out["log_probs"], targets["labels"], out["output_lengths"],
                       targets["target_lengths"], reduction="sum")
    return total, targets["target_lengths"].shape[0] / BATCH


def ctc_sum_over_symbols_scalar(out: dict[str, torch.Tensor],
                                targets: dict[str, torch.Tensor]) -> Any:
    """:func:`ctc_sum_over_symbols` as the scalar a training loop writes (``sum / count``)."""
    total, count = ctc_sum_over_symbols(out, targets)
    return total / count


# --- two terms, each over its own count ---

POINTS, CLASSES = 8, 3


class BoxesAndClass(nn.Module):
    """An image (here a feature vector) to class logits and one box; the box is scored
    against each of the image's 0 to 3 ground-truth boxes (a flat ``(B, 4)`` list with each
    box's image in ``owner``, as a detector's matched boxes)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(POINTS, HIDDEN), nn.Tanh())
        self.cls = nn.Linear(HIDDEN, CLASSES)
        self.box = nn.Linear(HIDDEN, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(x)
        return {"logits": self.cls(h), "boxes": self.box(h)}


class WideBoxesAndClass(BoxesAndClass):
    """:class:`BoxesAndClass` with a two-layer MLP body that tensor parallelism splits (its
    first linear by columns, its second by rows), the heads kept whole on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(POINTS, 4 * HIDDEN), nn.Tanh(),
                                  nn.Linear(4 * HIDDEN, HIDDEN), nn.Tanh())


class Scenes(Dataset):
    """Images with a class and 0 to 3 boxes each."""

    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            x = torch.randn(POINTS, generator=g)
            k = int(torch.randint(0, 4, (), generator=g))
            boxes = x[:4].tanh() + 0.1 * torch.randn(k, 4, generator=g)
            self.items.append((x, int(x[4] > 0) + int(x[5] > 0), boxes))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        return self.items[i]


def collate_scenes(items: list[tuple[torch.Tensor, int, torch.Tensor]]
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The images stacked; the boxes flat with their image's index in the batch."""
    return torch.stack([x for x, _, _ in items]), {
        "labels": torch.tensor([c for _, c, _ in items]),
        "boxes": torch.cat([b for _, _, b in items]),
        "owner": torch.cat([torch.full((b.shape[0],), i) for i, (_, _, b) in enumerate(items)])}


def two_terms(out: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> Any:
    """The box term over the batch's boxes and the class term over its images, each as a
    ``(sum, count)`` pair of its own: plait's form for one device's
    ``sum_box / n_box + sum_cls / n_img``."""
    box = F.smooth_l1_loss(out["boxes"][targets["owner"]], targets["boxes"], reduction="sum")
    cls = F.cross_entropy(out["logits"], targets["labels"], reduction="sum")
    return {"box": (box, targets["boxes"].shape[0]), "cls": (cls, targets["labels"].shape[0])}


def two_terms_scalar(out: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> Any:
    """The same loss as one device writes it: ``sum_box / n_box + sum_cls / n_img``."""
    terms = two_terms(out, targets)
    return sum(s / c for s, c in terms.values())


def collate_classes(items: list[tuple[torch.Tensor, int, torch.Tensor]]
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The images and their classes only: targets of one row per example."""
    return torch.stack([x for x, _, _ in items]), {
        "labels": torch.tensor([c for _, c, _ in items])}


def class_terms(out: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> Any:
    """Two terms over rows of one per example, each over its own count: the cross-entropy
    over every image and again over the images of a class other than 0."""
    each = F.cross_entropy(out["logits"], targets["labels"], reduction="none")
    positive = targets["labels"] > 0
    return {"cls": (each.sum(), each.shape[0]), "positive": ((each * positive).sum(),
                                                             positive.sum())}


def token_terms(logits: torch.Tensor, labels: torch.Tensor) -> Any:
    """Two terms over a language model's tokens, each over its own count: the cross-entropy
    over the labelled tokens (not -100) and a z-loss (the squared log-partition, weighted
    0.1) over every position, labelled or not."""
    flat, y = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    ce = F.cross_entropy(flat, y, reduction="sum")
    z = flat.logsumexp(-1).pow(2)
    return {"ce": (ce, (y != -100).sum()), "z": (0.1 * z.sum(), z.numel())}


def token_terms_scalar(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """:func:`token_terms` as one device writes it: the sum of each term's sum over its count."""
    return sum(s / c for s, c in token_terms(logits, labels).values())


# --- a Hugging Face CTC model computing its own loss ---


def tiny_wav2vec2(reduction: str = "mean") -> nn.Module:
    """A two-layer-conv, one-layer-transformer ``Wav2Vec2ForCTC`` on raw samples, without
    dropout or time masking (which draw random numbers one device draws otherwise)."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    config = Wav2Vec2Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, conv_dim=(8, 8), conv_kernel=(3, 3), conv_stride=(2, 2),
        conv_bias=True, num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        feat_extract_norm="layer", do_stable_layer_norm=True, ctc_loss_reduction=reduction,
        pad_token_id=0, mask_time_prob=0.0, layerdrop=0.0, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0)
    return Wav2Vec2ForCTC(config)


class Waveforms(Dataset):
    """Raw "audio" of 48 to 80 samples with transcripts of 1 to 3 symbols."""

    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(48, 81, (), generator=g))
            s = int(torch.randint(1, 4, (), generator=g))
            self.items.append((torch.randn(length, generator=g),
                               torch.randint(1, VOCAB, (s,), generator=g)))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[i]


def collate_waveforms(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Hugging Face's CTC batch: samples padded with zeros, an attention mask, labels padded
    with -100."""
    waves = [w for w, _ in items]
    mask = nn.utils.rnn.pad_sequence([torch.ones_like(w, dtype=torch.long) for w in waves],
                                     batch_first=True)
    return {"input_values": nn.utils.rnn.pad_sequence(waves, batch_first=True),
            "attention_mask": mask,
            "labels": nn.utils.rnn.pad_sequence([y for _, y in items], batch_first=True,
                                                padding_value=-100)}


def hf_ctc() -> tuple[nn.Module, Dataset, Any, Any]:
    """``Wav2Vec2ForCTC`` with ``ctc_loss_reduction="mean"``, its own loss: ``loss_fn=None``."""
    torch.manual_seed(0)
    return tiny_wav2vec2(), Waveforms(), None, collate_waveforms


def hf_ctc_sum() -> tuple[nn.Module, Dataset, Any, Any]:
    """:func:`hf_ctc` with ``ctc_loss_reduction="sum"`` (the config's default): a sum over the
    batch's examples."""
    torch.manual_seed(0)
    return tiny_wav2vec2("sum"), Waveforms(), None, collate_waveforms


LOSSES = {"ctc_mean": ctc_mean, "ctc_mean_pair": ctc_mean_pair,
          "ctc_sum_over_symbols": ctc_sum_over_symbols,
          "ctc_sum_of_the_batch": ctc_sum_of_the_batch,
          "ctc_sum_over_symbols_scalar": ctc_sum_over_symbols_scalar,
          "two_terms": two_terms, "two_terms_scalar": two_terms_scalar,
          "class_terms": class_terms}


def speech_padded() -> tuple[nn.Module, Dataset, Any, Any]:
    torch.manual_seed(0)
    return TinyASR(), Utterances(), ctc_mean, collate_padded


def speech_flat() -> tuple[nn.Module, Dataset, Any, Any]:
    torch.manual_seed(0)
    return TinyASR(), Utterances(), ctc_mean, collate_flat


def boxes_and_class() -> tuple[nn.Module, Dataset, Any, Any]:
    torch.manual_seed(0)
    return BoxesAndClass(), Scenes(), two_terms, collate_scenes


def wide_boxes_and_class() -> tuple[nn.Module, Dataset, Any, Any]:
    """:func:`boxes_and_class` on :class:`WideBoxesAndClass`, a model tp splits."""
    torch.manual_seed(0)
    return WideBoxesAndClass(), Scenes(), two_terms, collate_scenes


def classes() -> tuple[nn.Module, Dataset, Any, Any]:
    """:func:`boxes_and_class` with its classes only, a loss of two terms over them."""
    torch.manual_seed(0)
    return BoxesAndClass(), Scenes(), class_terms, collate_classes


STEPS, BATCH = 3, 8


def _factory(name: str, loss: str | None) -> tuple[nn.Module, Dataset, Any, Any]:
    factories = {"speech_padded": speech_padded, "speech_flat": speech_flat,
                 "boxes_and_class": boxes_and_class, "classes": classes,
                 "wide_boxes_and_class": wide_boxes_and_class, "hf_ctc": hf_ctc,
                 "hf_ctc_sum": hf_ctc_sum}
    model, data, loss_fn, collate = factories[name]()
    return model, data, LOSSES[loss] if loss else loss_fn, collate


def train(rank: int, world_size: int, name: str, plan: Any, loss: str | None = None
          ) -> dict[str, Any]:
    """AdamW for STEPS steps on the factory ``name`` (its loss, or ``LOSSES[loss]``) under
    ``plan``, batches from ``run.loader`` with its collate_fn: the losses and the full state on
    rank 0, or the refusal's message."""
    from plait.runtime import init

    run = init(plan, quiet=True, seed=0)
    model, data, loss_fn, collate = _factory(name, loss)
    loader = run.loader(data, batch_size=BATCH, steps=STEPS, collate_fn=collate)
    try:
        model = run.parallelize(model, example=loader.batch(0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = [float(run.step(model, batch, loss_fn, opt)) for batch in loader]
        evaluated = [float(run.evaluate(model, batch, loss_fn))
                     for batch in run.loader(data, batch_size=BATCH, steps=1, evaluation=True,
                                             collate_fn=collate)]
    except ValueError as exc:
        run.close()
        return {"refused": str(exc)}
    state = run.full_state_dict(model)
    run.close()
    return {"losses": losses, "evaluated": evaluated, "state": state if rank == 0 else None}


# The split tensor parallelism gives WideBoxesAndClass (its heads stay whole): a plan as
# init takes it, with the other degrees added (tp_plan(dp=2)).
def tp_plan(**degrees: int) -> dict[str, Any]:
    return {"tp": 2, **degrees,
            "options": {"tp_plan": {"body.0": "colwise", "body.2": "rowwise"}}}


def train_each(rank: int, world_size: int, cases: list[tuple[str, Any, str | None]]
               ) -> list[dict[str, Any]]:
    """:func:`train` for each ``(name, plan, loss)`` in turn, in this process."""
    return [train(rank, world_size, name, plan, loss) for name, plan, loss in cases]


def one_device_loss(loss_fn: Any, out: Any, targets: Any) -> torch.Tensor:
    """What one device minimises: a scalar as it is, ``(sum, count)`` as ``sum / count``, a
    dict of pairs as the sum of each term's ``sum / count``."""
    value = loss_fn(out, targets)
    if isinstance(value, dict):
        return sum(s / c for s, c in value.values())
    if isinstance(value, tuple):
        return value[0] / value[1]
    return value


def reference(name: str, loss: str | None = None) -> dict[str, Any]:
    """The same AdamW steps with torch alone on one device: each global batch (the loader's
    order) collated whole, torch's clipping at 1.0 (plait's default), then the loss of the
    first global batch in eval mode."""
    from plait.data.loader import DistributedLoader

    model, data, loss_fn, collate = _factory(name, loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    order = DistributedLoader(data, BATCH)
    losses = []
    for step in range(STEPS):
        batch = collate([data[int(i)] for i in order.global_indices(step)])
        if loss_fn is None:  # the model's own loss
            value = model(**batch).loss
        else:
            inputs, targets = batch
            args = inputs if isinstance(inputs, dict) else {"x": inputs}
            value = one_device_loss(loss_fn, model(**args), targets)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(value.item())
    model.eval()
    with torch.no_grad():
        batch = collate([data[int(i)] for i in order.global_indices(0)])
        if loss_fn is None:
            evaluated = [model(**batch).loss.item()]
        else:
            inputs, targets = batch
            args = inputs if isinstance(inputs, dict) else {"x": inputs}
            evaluated = [one_device_loss(loss_fn, model(**args), targets).item()]
    return {"losses": losses, "evaluated": evaluated, "state": model.state_dict()}
