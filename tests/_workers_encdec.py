"""Workers for tests/test_encoder_decoder.py: tiny Hugging Face encoder-decoder and two-tower
models built from configs (no download), and a two-tower model written for the test with a
learned temperature (CLIP's ``logit_scale``) on its root."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.check import _slice
from tests import _workers_beyond as B
from tests._workers_semantics import STEPS


class ScaledTwoTower(B.TwoTower):
    """:class:`tests._workers_beyond.TwoTower` with CLIP's learned temperature on the root."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(2.3))

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> Any:  # type: ignore[override]
        image_emb, text_emb = super().forward(image, text)
        return image_emb, text_emb, self.logit_scale.exp()


def scaled_two_tower() -> nn.Module:
    torch.manual_seed(0)
    return ScaledTwoTower()


def scaled_nce(gather: Any) -> Any:
    """CLIP's symmetric loss, each row against every column ``gather`` gives, at the model's
    temperature; the identity for one device (or for a loss that forgets to gather)."""

    def loss(out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], _: Any) -> torch.Tensor:
        image, text, scale = out
        all_image, labels = gather(image, return_index=True)
        all_text = gather(text)
        return 0.5 * (F.cross_entropy(scale * image @ all_text.T, labels)
                      + F.cross_entropy(scale * text @ all_image.T, labels))

    return loss


def train_contrastive(rank: int, world_size: int, plan: str, gathers: bool) -> dict[str, Any]:
    """SGD on :func:`scaled_two_tower` under ``plan``, the loss gathering through
    ``run.all_gather`` or not; the refusal's message when the layout or the step refuses."""
    from plait.runtime import init

    run = init(plan, quiet=True, seed=0)
    loss_fn = scaled_nce(run.all_gather if gathers else B.no_gather)
    batches = [B.pair_batch(s) for s in range(STEPS)]
    try:
        model = run.parallelize(scaled_two_tower())
        opt = B._optimizer(model.parameters(), False)
        losses = [float(run.step(model, _slice(b, run.dp_rank, run.dp_size), loss_fn, opt))
                  for b in batches]
    except ValueError as exc:
        run.close()
        return {"refused": str(exc)}
    state = B._state(run, model)
    run.close()
    return {"plan": plan, "losses": losses, "state": state if rank == 0 else None}


class StackedTwoTower(nn.Module):
    """Two towers, the image one a stack of residual blocks (what a pipeline cuts), the text
    one an embedding and a projection beside it, CLIP's learned temperature on the root
    (shape (1,))."""

    def __init__(self) -> None:
        super().__init__()
        self.image_in = nn.Linear(10, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.Tanh(),
                                                  nn.Linear(32, 16)) for _ in range(4))
        self.image_out = nn.Linear(16, 8)
        self.text = nn.Sequential(nn.Embedding(B.VOCAB, 16), nn.Flatten(), nn.Linear(64, 8))
        self.logit_scale = nn.Parameter(torch.tensor([2.3]))

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> Any:
        h = self.image_in(image)
        for block in self.blocks:
            h = h + block(h)
        return (F.normalize(self.image_out(h), dim=-1), F.normalize(self.text(text), dim=-1),
                self.logit_scale.exp())


def stacked_two_tower() -> nn.Module:
    torch.manual_seed(0)
    return StackedTwoTower()


class TextFirstTwoTower(StackedTwoTower):
    """:class:`StackedTwoTower` whose forward runs the text tower before the image blocks; the
    tower is registered after them, and no input can be guessed for a forward of two
    tensors, so a pipeline places it by registration on the last stage."""

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> Any:
        t = F.normalize(self.text(text), dim=-1)
        h = self.image_in(image)
        for block in self.blocks:
            h = h + block(h)
        return F.normalize(self.image_out(h), dim=-1), t, self.logit_scale.exp()


def text_first_step(rank: int, world_size: int, plan: str) -> float:
    """One step of :class:`TextFirstTwoTower` under ``plan`` (a pipeline fails on stage 0)."""
    from plait.runtime import init

    run = init(plan, quiet=True, timeout=60, seed=0)
    try:
        torch.manual_seed(0)
        model = run.parallelize(TextFirstTwoTower())
        opt = B._optimizer(model.parameters(), False)
        return float(run.step(model, B.pair_batch(0), scaled_nce(B.no_gather), opt))
    finally:
        run.close()


def train_stacked(rank: int, world_size: int, plans: list[str]) -> list[dict[str, Any]]:
    """SGD on :func:`stacked_two_tower` under each plan, the loss over ``run.all_gather``:
    the losses and the full state, or the refusal's message."""
    from plait.runtime import init

    out: list[dict[str, Any]] = []
    for plan in plans:
        run = init(plan, quiet=True, seed=0)
        try:
            model = run.parallelize(stacked_two_tower())
            opt = B._optimizer(model.parameters(), False)
            losses = [float(run.step(model, _slice(B.pair_batch(s), run.dp_rank, run.dp_size),
                                     scaled_nce(run.all_gather), opt)) for s in range(STEPS)]
            out.append({"plan": plan, "losses": losses, "state": B._state(run, model)})
        except ValueError as exc:
            out.append({"plan": plan, "refused": str(exc)})
        finally:
            run.close()
    return out


def stacked_reference(data_ranks: int, micro: int) -> dict[str, Any]:
    """One device on :func:`stacked_two_tower` accumulating over ``micro`` chunks per step,
    chunk j holding micro-batch j of every data rank's rows (what a loss over
    ``run.all_gather`` compares in a pipeline's microbatch j); the whole batch at micro=1."""
    loss = scaled_nce(B.no_gather)

    def step_loss(model: nn.Module, inputs: dict[str, torch.Tensor], targets: Any
                  ) -> torch.Tensor:
        n = inputs["image"].shape[0] // (data_ranks * micro)
        chunks = [torch.cat([torch.arange((r * micro + j) * n, (r * micro + j + 1) * n)
                             for r in range(data_ranks)]) for j in range(micro)]
        return sum(loss(model(**{k: v[c] for k, v in inputs.items()}), targets)
                   for c in chunks) / micro

    return B._one_device(stacked_two_tower, [B.pair_batch(s) for s in range(STEPS)],
                         step_loss, False)


HELD_OUT = 100  # the seed of the evaluation batch, apart from the training batches


def evaluate_contrastive(rank: int, world_size: int, plan: str) -> dict[str, Any]:
    """SGD on :func:`scaled_two_tower` under ``plan`` with the loss over ``run.all_gather``,
    then ``run.evaluate`` on a held-out batch three ways: that loss ("gathered"), the loss
    over this rank's rows alone ("own") and the model's own output (loss_fn=None, "none");
    each the loss or the refusal's message."""
    from plait.runtime import init

    run = init(plan, quiet=True, seed=0)
    held = _slice(B.pair_batch(HELD_OUT), run.dp_rank, run.dp_size)
    out: dict[str, Any] = {}
    try:
        model = run.parallelize(scaled_two_tower())
        opt = B._optimizer(model.parameters(), False)
        for s in range(STEPS):
            run.step(model, _slice(B.pair_batch(s), run.dp_rank, run.dp_size),
                     scaled_nce(run.all_gather), opt)
        for name, loss_fn in (("gathered", scaled_nce(run.all_gather)),
                              ("own", scaled_nce(B.no_gather)), ("none", None)):
            try:
                out[name] = float(run.evaluate(model, held, loss_fn))
            except ValueError as exc:
                out[name] = str(exc)
    finally:
        run.close()
    return out


# ------------------------------------------------------------------ Hugging Face, from configs
class Seq2Seq(torch.utils.data.Dataset):
    """Source ids, and target ids with padding (-100) of a length that varies by row."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        labels = torch.randint(4, 64, (6,), generator=g)
        labels[5 - i % 3:] = -100
        return {"input_ids": torch.randint(4, 64, (8,), generator=g),
                "attention_mask": torch.ones(8, dtype=torch.long), "labels": labels}


def t5(attn: str | None = None) -> tuple[nn.Module, Any, None]:
    """T5: a relative attention bias in block 0 of each stack, embeddings tied across encoder,
    decoder and head."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                   num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    if attn is not None:  # "eager": attention weights computed and returned
        cfg._attn_implementation = attn
    return T5ForConditionalGeneration(cfg), Seq2Seq(), None


def t5_gated(attn: str | None = None) -> tuple[nn.Module, Any, None]:
    """T5 v1.1's shape: a gated feed-forward (``wi_0``, ``wi_1``, ``wo``) and a head not tied
    to the embeddings."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                   num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                   feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    if attn is not None:  # "eager": attention weights computed and returned
        cfg._attn_implementation = attn
    return T5ForConditionalGeneration(cfg), Seq2Seq(), None


def bart() -> tuple[nn.Module, Any, None]:
    """BART: learned positions, embeddings tied across encoder, decoder and head."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    cfg = BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                     decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
                     attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
                     bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    return BartForConditionalGeneration(cfg), Seq2Seq(), None


class Pairs(torch.utils.data.Dataset):
    """Caption ids and 16x16 images; ``labels`` only gives plait rows to count."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 64, (8,), generator=g),
                "pixel_values": torch.randn(3, 16, 16, generator=g), "labels": torch.tensor(i)}


def local_clip_loss(out: Any, _: Any) -> torch.Tensor:
    """CLIP's loss over the rows the model saw (what a script written for one device has)."""
    logits = out.logits_per_text
    target = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2


def clip_model(image_size: int = 16, patch_size: int = 8) -> nn.Module:
    """A tiny CLIP; the default images are 2x2 patches (5 image positions with the class
    token)."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    cfg = CLIPConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16,
                         bos_token_id=0, eos_token_id=2, pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=image_size,
                           patch_size=patch_size),
        projection_dim=16)
    return CLIPModel(cfg)


def clip() -> tuple[nn.Module, Any, Any]:
    """CLIP with the loss a one-device script computes from ``logits_per_text``."""
    return clip_model(), Pairs(), local_clip_loss


class Tagged(torch.utils.data.Dataset):
    """Token ids and one tag (of 32) per token."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + i)
        return {"input_ids": torch.randint(4, 64, (8,), generator=g),
                "labels": torch.randint(0, 32, (8,), generator=g)}


def hidden_as_tags(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy reading the 32 hidden features of each token as its tag's logits."""
    h = out.last_hidden_state
    return F.cross_entropy(h.reshape(-1, h.shape[-1]), labels.reshape(-1))


def t5_encoder() -> tuple[nn.Module, Any, Any]:
    """T5's encoder alone: one stack, whose block 0 computes the relative position bias that
    every later block reads (``position_bias``)."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=4, num_heads=4,
                   relative_attention_num_buckets=8, dropout_rate=0.0)
    return T5EncoderModel(cfg), Tagged(), hidden_as_tags


class Clip(nn.Module):
    """CLIPModel returning its embeddings and temperature, for a loss that gathers them (the
    wrapper the docs show)."""

    def __init__(self, clip: nn.Module) -> None:
        super().__init__()
        self.clip = clip

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> Any:
        out = self.clip(input_ids=input_ids, pixel_values=pixel_values)
        return out.image_embeds, out.text_embeds, self.clip.logit_scale.exp()


def wrapped_clip() -> nn.Module:
    return Clip(clip_model())


def clip_batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    items = [Pairs()[(step * 8 + i) % 16] for i in range(8)]
    return ({"input_ids": torch.stack([it["input_ids"] for it in items]),
             "pixel_values": torch.stack([it["pixel_values"] for it in items])},
            torch.arange(8))


def train_wrapped_clip(rank: int, world_size: int, plan: str) -> dict[str, Any]:
    """SGD on :func:`wrapped_clip` under ``plan``, its loss over ``run.all_gather``."""
    from plait.runtime import init

    run = init(plan, quiet=True, seed=0)
    model = run.parallelize(wrapped_clip())
    opt = B._optimizer(model.parameters(), False)
    loss_fn = scaled_nce(run.all_gather)
    losses = [float(run.step(model, _slice(clip_batch(s), run.dp_rank, run.dp_size), loss_fn,
                             opt)) for s in range(STEPS)]
    state = B._state(run, model)
    run.close()
    return {"plan": plan, "losses": losses, "state": state if rank == 0 else None}
