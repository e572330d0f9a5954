"""Models written for tests/test_tp_encdec.py: an encoder-decoder with T5's shape and a
two-tower model with CLIP's, each with attention torch.fx cannot trace (it branches on its
input's rank), and a forward that needs two inputs (so that one guessed tensor does not run).

``RelBiasSeq2Seq``: a shared token embedding tied to the head; an encoder and a decoder
stack; block 0 of each stack computes a relative position bias (a table with one column per
head) that the stack hands to every later block; the decoder's blocks attend to the encoder's
output (cross-attention); MLPs named ``wi``/``wo`` (gated ``wi_0``/``wi_1`` with ``gated``).
``ProjectedTowers``: a text tower and an image tower (a convolution stem), each a stack of
blocks, projection heads side by side on the root and a learned temperature
(``logit_scale``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests._workers_beyond import _one_device, _optimizer, _state

VOCAB, WIDTH, HEADS, BUCKETS, FF = 32, 16, 4, 8, 32
BATCH, SRC, TGT, STEPS = 4, 6, 4, 3


class Attention(nn.Module):
    """Multi-head attention; with ``bias``, a relative position bias per head (T5's); with
    ``weights``, its softmax returned third, as eager attention returns its weights."""

    def __init__(self, bias: bool, weights: bool = False) -> None:
        super().__init__()
        self.n_heads, self.weights = HEADS, weights
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))
        if bias:
            self.relative_attention_bias = nn.Embedding(BUCKETS, HEADS)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None,
                position_bias: torch.Tensor | None = None) -> tuple[Any, ...]:
        if x.dim() == 2:  # fx cannot trace a branch on the input's rank
            x = x.unsqueeze(0)
        kv = x if memory is None else memory
        b, t, s = x.shape[0], x.shape[1], kv.shape[1]
        q = self.q(x).view(b, t, self.n_heads, -1).transpose(1, 2)
        k = self.k(kv).view(b, s, self.n_heads, -1).transpose(1, 2)
        v = self.v(kv).view(b, s, self.n_heads, -1).transpose(1, 2)
        scores = q @ k.transpose(-1, -2)
        if position_bias is None and hasattr(self, "relative_attention_bias"):
            offset = torch.arange(s)[None, :] - torch.arange(t)[:, None]
            bucket = offset.clamp(-BUCKETS // 2, BUCKETS // 2 - 1) + BUCKETS // 2
            position_bias = self.relative_attention_bias(bucket).permute(2, 0, 1)[None]
        if position_bias is not None:
            scores = scores + position_bias
        probs = scores.softmax(-1)
        out = self.o((probs @ v).transpose(1, 2).reshape(b, t, -1))
        return (out, position_bias, probs) if self.weights else (out, position_bias)


class FeedForward(nn.Module):
    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.gated = gated
        if gated:
            self.wi_0, self.wi_1 = nn.Linear(WIDTH, FF, bias=False), nn.Linear(WIDTH, FF,
                                                                               bias=False)
        else:
            self.wi = nn.Linear(WIDTH, FF, bias=False)
            self.act = nn.ReLU()
        self.wo = nn.Linear(FF, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.wi_0(x)) * self.wi_1(x) if self.gated else self.act(self.wi(x))
        return self.wo(h)


class Block(nn.Module):
    """Pre-norm attention, cross-attention and MLP; with ``shift``, the MLP reads each
    position mixed with the one before (a token shift: no sequence-parallel split keeps it)."""

    def __init__(self, first: bool, cross: bool, gated: bool, shift: bool = False,
                 weights: bool = False) -> None:
        super().__init__()
        self.shift = shift
        self.norm_1, self.norm_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention(bias=first, weights=weights)
        self.cross = Attention(bias=False, weights=weights) if cross else None
        self.norm_c = nn.LayerNorm(WIDTH) if cross else None
        self.ff = FeedForward(gated)

    def forward(self, h: torch.Tensor, bias: torch.Tensor | None,
                memory: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        a, bias, *_ = self.attn(self.norm_1(h), position_bias=bias)
        h = h + a
        if self.cross is not None and self.norm_c is not None:
            h = h + self.cross(self.norm_c(h), memory)[0]
        if self.shift:
            h = (h + F.pad(h, (0, 0, 1, 0))[:, :-1]) / 2
        return h + self.ff(self.norm_2(h)), bias


class Stack(nn.Module):
    def __init__(self, cross: bool, gated: bool, shift: bool = False,
                 weights: bool = False) -> None:
        super().__init__()
        self.block = nn.ModuleList(Block(i == 0, cross, gated, shift, weights)
                                   for i in range(2))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, h: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        bias = None
        for block in self.block:
            h, bias = block(h, bias, memory)
        return self.norm(h)


class RelBiasSeq2Seq(nn.Module):
    def __init__(self, gated: bool = False, shifted_decoder: bool = False,
                 weights: bool = False) -> None:
        super().__init__()
        self.shared = nn.Embedding(VOCAB, WIDTH)
        self.encoder = Stack(False, gated, weights=weights)
        self.decoder = Stack(True, gated, shift=shifted_decoder, weights=weights)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.shared.weight  # tied, as T5's

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor
                ) -> torch.Tensor:
        memory = self.encoder(self.shared(input_ids))
        h = self.decoder(self.shared(decoder_input_ids), memory)
        return self.lm_head(h * WIDTH ** -0.5)


class KwargsSeq2Seq(RelBiasSeq2Seq):
    """Takes keyword arguments it does not use (``position_ids``), as Hugging Face models do:
    context parallelism's check of the signature alone would let it through."""

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor,
                **kwargs: Any) -> torch.Tensor:
        return super().forward(input_ids, decoder_input_ids)


def kwargs_seq2seq() -> nn.Module:
    torch.manual_seed(0)
    return KwargsSeq2Seq()


def seq2seq() -> nn.Module:
    torch.manual_seed(0)
    return RelBiasSeq2Seq()


def gated_seq2seq() -> nn.Module:
    torch.manual_seed(0)
    return RelBiasSeq2Seq(gated=True)


def weights_seq2seq() -> nn.Module:
    """Every attention returns its softmax third, as eager attention returns its weights."""
    torch.manual_seed(0)
    return RelBiasSeq2Seq(weights=True)


def shifted_seq2seq() -> nn.Module:
    """The decoder's blocks shift tokens outside their regions; the encoder's do not."""
    torch.manual_seed(0)
    return RelBiasSeq2Seq(shifted_decoder=True)


def seq2seq_batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(800 + step)
    return ({"input_ids": torch.randint(0, VOCAB, (BATCH, SRC), generator=g),
             "decoder_input_ids": torch.randint(0, VOCAB, (BATCH, TGT), generator=g)},
            torch.randint(0, VOCAB, (BATCH, TGT), generator=g))


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class Tower(nn.Module):
    """A stack of two blocks (self-attention only) and a final norm, pooled at position 0."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(False, False, False) for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h, None)[0]
        return self.norm(h)[:, 0]


class ProjectedTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB, WIDTH)
        self.patch_embedding = nn.Conv2d(3, WIDTH, 4, stride=4)
        self.text_model, self.vision_model = Tower(), Tower()
        self.text_projection = nn.Linear(WIDTH, 8, bias=False)
        self.visual_projection = nn.Linear(WIDTH, 8, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        text = self.text_projection(self.text_model(self.token_embedding(input_ids)))
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        image = self.visual_projection(self.vision_model(patches))
        text, image = F.normalize(text, dim=-1), F.normalize(image, dim=-1)
        return self.logit_scale.exp() * text @ image.T  # logits per text


def towers() -> nn.Module:
    torch.manual_seed(0)
    return ProjectedTowers()


class TokenBatchNorm(nn.Module):
    """BatchNorm over the batch and every position, per feature."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.bn(h.transpose(1, 2)).transpose(1, 2)


class TensorBlock(Block):
    """A block returning its output alone."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(h, None)[0]


class OuterResidualTower(Tower):
    """Adds each block's output to the block's input in the tower's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TensorBlock(False, False, False) for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = h + layer(h)
        return self.norm(h)[:, 0]


def outer_residual_towers() -> nn.Module:
    """The image tower adds its blocks' residuals outside them; the text tower does not."""
    model = towers()
    tower = OuterResidualTower()
    tower.load_state_dict(model.vision_model.state_dict())
    model.vision_model = tower
    return model


def batchnorm_towers() -> nn.Module:
    """The image tower's blocks normalise their MLP's input with BatchNorm."""
    model = towers()
    for layer in model.vision_model.layers:  # type: ignore[union-attr]
        layer.norm_2 = TokenBatchNorm()
    return model


def towers_batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    return ({"input_ids": torch.randint(0, VOCAB, (BATCH, 6), generator=g),
             "pixel_values": torch.randn(BATCH, 3, 8, 8, generator=g)}, torch.arange(BATCH))


def clip_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric loss over the rows the model saw (tensor parallelism sees them all)."""
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def hf_t5() -> nn.Module:
    from tests._workers_encdec import t5

    return t5()[0]


def hf_t5_gated() -> nn.Module:
    from tests._workers_encdec import t5_gated

    return t5_gated()[0]


def hf_t5_eager() -> nn.Module:
    from tests._workers_encdec import t5

    return t5(attn="eager")[0]


def hf_t5_gated_eager() -> nn.Module:
    from tests._workers_encdec import t5_gated

    return t5_gated(attn="eager")[0]


def hf_bart() -> nn.Module:
    from tests._workers_encdec import bart

    return bart()[0]


def hf_clip() -> nn.Module:
    """CLIP with 28x28 images in 4x4 patches: 50 positions in the image tower (49 and the
    class token), which tp=2 divides under sequence parallelism."""
    from tests._workers_encdec import clip_model

    return clip_model(image_size=28, patch_size=4)


def clip_batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    return ({"input_ids": torch.randint(3, VOCAB, (BATCH, 6), generator=g),
             "pixel_values": torch.randn(BATCH, 3, 28, 28, generator=g)}, torch.arange(BATCH))


def hf_clip_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return clip_loss(out.logits_per_text, target)


def logits_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """:func:`token_loss` on a Hugging Face output's ``logits``."""
    return token_loss(out.logits, labels)


MODELS = {"seq2seq": (seq2seq, seq2seq_batch, token_loss),
          "gated_seq2seq": (gated_seq2seq, seq2seq_batch, token_loss),
          "towers": (towers, towers_batch, clip_loss),
          "hf_t5": (hf_t5, seq2seq_batch, logits_loss),
          "hf_t5_gated": (hf_t5_gated, seq2seq_batch, logits_loss),
          "weights_seq2seq": (weights_seq2seq, seq2seq_batch, token_loss),
          "kwargs_seq2seq": (kwargs_seq2seq, seq2seq_batch, token_loss),
          "hf_t5_eager": (hf_t5_eager, seq2seq_batch, logits_loss),
          "hf_t5_gated_eager": (hf_t5_gated_eager, seq2seq_batch, logits_loss),
          "hf_bart": (hf_bart, seq2seq_batch, logits_loss),
          "hf_clip": (hf_clip, clip_batch, hf_clip_loss)}

# A norm in a block of each stack (the first block of one, the last of the other): the length
# of the sequence it normalises is one rank's part under sequence parallelism.
PROBES = {"seq2seq": ("encoder.block.0.norm_1", "decoder.block.1.norm_2"),
          "weights_seq2seq": ("encoder.block.0.norm_1", "decoder.block.1.norm_2"),
          "towers": ("text_model.layers.1.norm_1", "vision_model.layers.0.norm_2"),
          "hf_t5": ("encoder.block.0.layer.0.layer_norm", "decoder.block.1.layer.2.layer_norm"),
          "hf_t5_eager": ("encoder.block.0.layer.0.layer_norm",
                          "decoder.block.1.layer.2.layer_norm"),
          "hf_bart": ("model.encoder.layers.0.self_attn_layer_norm",
                      "model.decoder.layers.1.final_layer_norm"),
          "hf_clip": ("text_model.encoder.layers.1.layer_norm1",
                      "vision_model.encoder.layers.0.layer_norm2")}


# An attention block returning its weights third, of each model that has them: under tp each
# rank computes its own heads' weights only, which the block returns as None.
WEIGHTS = {"weights_seq2seq": "decoder.block.1.cross",
           "hf_t5_eager": "decoder.block.1.layer.1.EncDecAttention",
           "hf_t5_gated_eager": "encoder.block.0.layer.0.SelfAttention"}


def reference(name: str) -> dict[str, Any]:
    """One device, AdamW (weight decay 0.1), STEPS steps, clipping at 1.0 (plait's default)."""
    factory, batch, loss_fn = MODELS[name]
    return _one_device(factory, [batch(step) for step in range(STEPS)],
                       lambda model, inputs, target: loss_fn(model(**inputs), target), "adamw")


def _length_of(probe: str, lengths: dict[str, int]) -> Any:
    """A pre-hook noting the sequence length of the first input ``probe`` gets."""
    def hook(mod: nn.Module, args: tuple) -> None:
        lengths.setdefault(probe, args[0].shape[1])
    return hook


def _third_of(found: list[Any]) -> Any:
    """A forward hook noting the third value of each output (an attention's weights)."""
    def hook(mod: nn.Module, args: tuple, output: tuple) -> None:
        found.append(output[2])
    return hook


def train(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Each (plan, model name) under tensor parallelism with AdamW, as :func:`reference`
    trains it; the losses and rank 0's full state, or the message of a refusal."""
    from plait.runtime import init

    out: list[dict[str, Any]] = []
    for plan, name in jobs:
        factory, batch, loss_fn = MODELS[name]
        run = init(plan, quiet=True, seed=0)
        try:
            model = run.parallelize(factory())
        except ValueError as exc:
            run.close()
            out.append({"plan": plan, "refused": str(exc)})
            continue
        lengths: dict[str, int] = {}
        for probe in PROBES.get(name, ()):
            model.get_submodule(probe).register_forward_pre_hook(_length_of(probe, lengths))
        weights: list[Any] = []
        if name in WEIGHTS:
            model.get_submodule(WEIGHTS[name]).register_forward_hook(_third_of(weights))
        opt = _optimizer(model.parameters(), "adamw")
        losses = [float(run.step(model, batch(s), loss_fn, opt)) for s in range(STEPS)]
        state = _state(run, model)
        run.close()
        out.append({"plan": plan, "losses": losses, "state": state if rank == 0 else None,
                    "lengths": lengths, "weights": [w is None for w in weights]})
    return out


def ledger(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Each (plan, model name) trained 2 + 2 steps with SGD and the ledger on, the first two
    not counted (DDP rebuilds its buckets in the second, broadcasting their order), each data
    rank on its rows of the batch; ``run.summary()["comm"]`` of each."""
    from plait.runtime import init

    torch.set_num_threads(1)
    out: list[dict[str, Any]] = []
    for plan, name in jobs:
        factory, batch, loss_fn = MODELS[name]
        run = init(plan, quiet=True, ledger=True, seed=0)
        run.ledger_warmup = 2
        try:
            model = run.parallelize(factory())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(4):
                inputs, target = batch(step)
                rows = slice(run.dp_rank * BATCH // run.dp_size,
                             (run.dp_rank + 1) * BATCH // run.dp_size)
                run.step(model, ({k: v[rows] for k, v in inputs.items()}, target[rows]),
                         loss_fn, opt)
            out.append(dict(run.summary()["comm"]))
        finally:
            run.close()
    return out
