"""Models written for the global-batch semantics tests, their data, a plain one-process training
loop (the reference) and the workers that train them under plait (spawned processes import
this module)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.check import _slice

VOCAB, WIDTH, SEQ, BATCH, STEPS, LR = 24, 16, 8, 8, 3, 0.1


class MaskedLM(nn.Module):
    """A small masked-LM: token + position embeddings, residual MLP blocks, a vocabulary head."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, depth: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(SEQ, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(),
                                                  nn.Linear(2 * width, width))
                                    for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def masked_lm() -> nn.Module:
    torch.manual_seed(0)
    return MaskedLM()


def mlm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the labels that are not -100 (F.cross_entropy's default)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def mlm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch whose rows count very different numbers of labels: row i keeps i + 1 of
    its SEQ labels (the first rows, which land on data rank 0, count far fewer)."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.full_like(tokens, -100)
    for i in range(BATCH):
        keep = torch.randperm(SEQ, generator=g)[:min(i + 1, SEQ)]
        labels[i, keep] = torch.randint(0, VOCAB, (len(keep),), generator=g)
    return tokens, labels


def reference(factory: Callable[[], nn.Module], batches: list[Any], loss_fn: Callable,
              *, clip: float | None = 1.0, weight_decay: float = 0.0) -> dict[str, Any]:
    """A plain single-process loop: SGD on each whole global batch, torch's own clipping."""
    model = factory()
    opt = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=weight_decay)
    losses = []
    for inputs, targets in batches:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    state.update({n: b.clone() for n, b in model.state_dict().items()
                  if n not in params and b.is_floating_point()})
    return {"losses": losses, "state": state}



def train_jobs(rank: int, world_size: int, jobs: list[tuple[str, Callable, list[Any],
                                                             Callable | None]],
               weight_decay: float = 0.0) -> list[dict[str, Any]]:
    """Train each (plan, model factory, global batches, loss_fn) in one process group (SGD);
    per job the loss of every step as run.step returned it, rank 0's full state and the
    warnings of parallelize and the steps."""
    from plait.runtime import init

    out = []
    for text, factory, batches, loss_fn in jobs:
        run = init(text, quiet=True, log_every=1, seed=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = run.parallelize(factory())
            opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False,
                                  weight_decay=weight_decay)
            losses = []
            for batch in batches:
                losses.append(float(run.step(model, _slice(batch, run.dp_rank, run.dp_size),
                                             loss_fn, opt)))
        state = run.full_state_dict(model)
        run.close()
        out.append({"plan": text, "losses": losses, "state": state if rank == 0 else None,
                    "warnings": [str(w.message) for w in caught]})
    return out


def sum_count_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The masked-LM loss as (sum, count): per-token losses weighted 1 (counted) or 0."""
    flat = labels.reshape(-1)
    weight = (flat != -100).float()
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat.clamp_min(0),
                                reduction="none")
    return (per_token * weight).sum(), weight.sum()


def shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A causal-LM loss that shifts the labels itself: position t is scored against label
    t + 1, so each row's first label is never read (mean over the rest that are not -100)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           labels[:, 1:].reshape(-1))


class WithLoss(nn.Module):
    """A model in the Hugging Face style: ``forward(input_ids, labels=None)`` returns a dict
    with ``loss`` (``loss(logits, labels)``, by default the mean over the labels that are not
    -100) and ``logits``."""

    def __init__(self, inner: nn.Module, loss: Callable = mlm_loss):
        super().__init__()
        self.inner = inner
        self.loss = loss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.inner(input_ids)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = self.loss(logits, labels)
        return out


def masked_lm_with_loss() -> nn.Module:
    return WithLoss(masked_lm())


def causal_lm_with_loss() -> nn.Module:
    return WithLoss(masked_lm(), shifted_loss)


def masked_mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """:func:`sum_count_loss` as one mean."""
    total, count = sum_count_loss(logits, labels)
    return total / count


def masked_lm_with_masked_loss() -> nn.Module:
    return WithLoss(masked_lm(), masked_mean_loss)


def step_losses_unlogged(rank: int, world_size: int, batches: list[Any]) -> dict[str, Any]:
    """run.step's return value on steps that are not logged (log_every larger than the run)."""
    from plait.runtime import init

    run = init("single", quiet=True, log_every=1000, seed=0)
    model = run.parallelize(masked_lm())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    raw = [run.step(model, batch, mlm_loss, opt) for batch in batches]
    run.close()
    return {"raw": raw, "losses": [float(x) for x in raw]}


class ConvBN(nn.Module):
    """A small ConvNet with BatchNorm after each convolution."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)).mean(dim=(2, 3)))


def conv_bn() -> nn.Module:
    torch.manual_seed(0)
    return ConvBN()


class RunningFeatures(nn.Module):
    """An MLP that keeps, in forward, an average of its hidden features (a floating-point
    buffer, over the rows it sees) and a count of its calls (an integer buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, WIDTH), nn.Linear(WIDTH, 6)
        self.register_buffer("feature_mean", torch.zeros(WIDTH))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.training:
            self.calls += 1
            self.feature_mean.mul_(0.5).add_(0.5 * h.detach().mean(0))
        return self.fc2(h)


def image_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose two halves have different statistics (per-rank BatchNorm would show it)."""
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randn(BATCH, 3, 6, 6, generator=g)
    x[BATCH // 2:] = 2.0 * x[BATCH // 2:] + 1.0
    return x, torch.randint(0, 5, (BATCH,), generator=g)


class Shift(nn.Module):
    """x * scale + offset, the offset a buffer (a constant the module owns, not trained)."""

    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.offset


class BatchNormMLP(nn.Module):
    """An input layer, BatchNorm, a module with a buffer, and residual MLP blocks: the blocks
    are tensor-parallel, the rest replicated over tp with their buffers. The root holds a
    parameter of its own and builds a tensor in forward (ViT's position table, minGPT's)."""

    def __init__(self):
        super().__init__()
        self.inp, self.bn, self.shift = nn.Linear(8, 16), nn.BatchNorm1d(16), Shift(16)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.blocks = nn.ModuleList(_mlp() for _ in range(2))
        self.out = nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shift(self.bn(self.inp(x))) * self.gain
        h = h + 0.01 * torch.arange(h.shape[-1], dtype=h.dtype)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def batchnorm_mlp() -> nn.Module:
    torch.manual_seed(0)
    return BatchNormMLP()


def bn_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose two halves have different statistics (per-rank BatchNorm would show it)."""
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randn(BATCH, 8, generator=g)
    x[BATCH // 2:] = 3.0 * x[BATCH // 2:] - 1.0
    return x, torch.randint(0, 6, (BATCH,), generator=g)


def _pre_norm_mlps(width: int, depth: int) -> nn.ModuleList:
    """``depth`` blocks LayerNorm -> Linear -> Tanh -> Linear (the residual is the caller's)."""
    return nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width),
                                       nn.Tanh(), nn.Linear(2 * width, width))
                         for _ in range(depth))


class FrozenTiedLM(nn.Module):
    """Fine-tuning as users do it: the input embedding, tied to the output head, and the first
    block are frozen (``requires_grad=False``). Activations are kept in (seq, batch) memory
    order, as seq-first models keep them, so every block output is strided, not dense. The
    forward's assert branches on a tensor property, which torch.fx cannot trace: a pipeline
    finds the residuals this forward adds by running it."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, depth: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.blocks = _pre_norm_mlps(width, depth)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.tok.weight.requires_grad_(False)
        self.blocks[0].requires_grad_(False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids).transpose(0, 1).contiguous().transpose(0, 1)
        assert not h.is_contiguous()
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class ParentTiedLM(nn.Module):
    """GPT-2's head as many write it: the root multiplies by the embedding's weight itself
    (``F.linear(h, self.tok.weight)``), so no head module owns the tie."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, depth: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.blocks = _pre_norm_mlps(width, depth)
        self.norm = nn.LayerNorm(width)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids)
        for block in self.blocks:
            h = h + block(h)
        return F.linear(self.norm(h), self.tok.weight)


def parent_tied_lm() -> nn.Module:
    torch.manual_seed(0)
    return ParentTiedLM()


def frozen_tied_lm() -> nn.Module:
    torch.manual_seed(0)
    return FrozenTiedLM()


class FusedAttention(nn.Module):
    """Causal self-attention as users write it: one fused q|k|v Linear (with a bias unless
    ``qkv_bias=False``), split with ``chunk(3)``, heads from a stored count."""

    def __init__(self, width: int = WIDTH, heads: int = 4, qkv_bias: bool = True):
        super().__init__()
        self.n_head = heads
        self.qkv = nn.Linear(width, 3 * width, bias=qkv_bias)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.n_head, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class FusedBlock(nn.Module):
    """Pre-norm: attention, then an MLP, each added to the residual."""

    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = FusedAttention(width)
        self.mlp = _pre_norm_mlps(width, 1)[0]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm(h))
        return h + self.mlp(h)


class FusedQKVLM(nn.Module):
    """Blocks of fused-qkv attention and an MLP, the head tied to the embedding."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, depth: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(FusedBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def fused_qkv_lm() -> nn.Module:
    torch.manual_seed(0)
    return FusedQKVLM()


# ---------------------------------------------------------------- models for TP inference
def _mlp(width: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))


class PreNormBlock(nn.Module):
    """x + fc2(act(fc1(norm(x)))): the linears read norm(x), not the block input."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.norm, self.fc1, self.fc2 = (nn.LayerNorm(width), nn.Linear(width, 2 * width),
                                         nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class PreNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(PreNormBlock() for _ in range(2))
        self.out = nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class DictNet(nn.Module):
    """Residual MLP blocks kept in an nn.ModuleDict, between an input layer and a head."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleDict({"first": _mlp(), "second": _mlp()})
        self.out = nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks.values():
            h = h + block(h)
        return self.out(h)


class TwoHeads(nn.Module):
    """An input layer, one MLP block, and two heads (the output is a pair)."""

    def __init__(self):
        super().__init__()
        self.inp, self.body = nn.Linear(8, 16), _mlp()
        self.head_a, self.head_b = nn.Linear(16, 4), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(torch.tanh(self.inp(x)))
        return self.head_a(h), self.head_b(h)


def flat_stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 6))


def sequential_blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), _mlp(), nn.Tanh(), _mlp(), nn.Linear(16, 6))


def pre_norm_net() -> nn.Module:
    torch.manual_seed(0)
    return PreNormNet()


def dict_net() -> nn.Module:
    torch.manual_seed(0)
    return DictNet()


def two_heads() -> nn.Module:
    torch.manual_seed(0)
    return TwoHeads()


def feature_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 6, generator=g)


def mse(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error; a pair of outputs is compared with the target's two column blocks."""
    if isinstance(out, tuple):
        return (F.mse_loss(out[0], target[:, :4]) + F.mse_loss(out[1], target[:, 4:])) / 2
    return F.mse_loss(out, target)


TP_FACTORIES = [flat_stack, sequential_blocks, pre_norm_net, dict_net, two_heads]


def auto_worker(rank: int, world_size: int, batches: list[Any]) -> dict[str, Any]:
    """plait.init("auto"): the planner's plan for the masked LM, printed, then trained."""
    import contextlib
    import io

    from plait.runtime import init

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run = init("auto", log_every=1000, global_batch=BATCH, seq=SEQ, seed=0)
        model = run.parallelize(masked_lm())
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    losses = [float(run.step(model, _slice(b, run.dp_rank, run.dp_size), mlm_loss, opt))
              for b in batches]
    plan = run.plan.to_string()
    state = run.full_state_dict(model)
    run.close()
    return {"plan": plan, "printed": out.getvalue(), "losses": losses,
            "state": state if rank == 0 else None}


# ---------------------------------------------------------------- Hugging Face models (SP)
HF_VOCAB = 64


class Logits(nn.Module):
    """A transformers model -> plain logits (or a tagging head on BERT's hidden states)."""

    def __init__(self, hf: nn.Module, head: nn.Module | None = None):
        super().__init__()
        self.hf, self.head = hf, head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.hf(input_ids=input_ids)
        return self.head(out.last_hidden_state) if self.head is not None else out.logits


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=HF_VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return Logits(GPT2LMHeadModel(cfg))


def hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=16)
    return Logits(LlamaForCausalLM(cfg))


def hf_bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=HF_VOCAB, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=16,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Logits(BertModel(cfg, add_pooling_layer=False), nn.Linear(32, HF_VOCAB))


def hf_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels with -100 at random positions (a masked-LM style count)."""
    g = torch.Generator().manual_seed(400 + step)
    tokens = torch.randint(0, HF_VOCAB, (4, SEQ), generator=g)
    labels = torch.randint(0, HF_VOCAB, (4, SEQ), generator=g)
    labels[torch.rand(4, SEQ, generator=g) < 0.5] = -100
    return tokens, labels


HF_FACTORIES = [hf_gpt2, hf_llama, hf_bert]


# ---------------------------------------------------------------- pipelines
class Embed(nn.Module):
    """Token plus position embedding as one module (what runs before the first block)."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(SEQ, width)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))


class Residual(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(),
                                 nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class StagedMaskedLM(nn.Module):
    """The masked LM with its residuals inside the blocks: embed, 4 blocks, head."""

    def __init__(self):
        super().__init__()
        self.embed = Embed()
        self.blocks = nn.ModuleList(Residual() for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def staged_masked_lm() -> nn.Module:
    torch.manual_seed(0)
    return StagedMaskedLM()


def dict_target_loss(logits: torch.Tensor, targets: dict) -> torch.Tensor:
    """The masked-LM loss reading its labels from a dict of targets."""
    return mlm_loss(logits, targets["labels"])


def reference_lm() -> nn.Module:
    """plait's reference transformer (its TP plan has a sequence-parallel layout)."""
    from plait.models.transformer import build, preset

    return build(preset("test", n_layers=4), seed=0)


def token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, 256, (BATCH, 17), generator=g)
    labels = tokens[:, 1:].clone()
    labels[torch.rand(labels.shape, generator=g) < 0.3] = -100
    return tokens[:, :-1].contiguous(), labels


# ---------------------------------------------------------------- torch's own layers, branches
def seeded(cls: Callable[[], nn.Module]) -> nn.Module:
    """``cls()`` built under seed 0 (``partial(seeded, cls)`` is a factory the spawned ranks
    can unpickle)."""
    torch.manual_seed(0)
    return cls()


class TorchEncoderLM(nn.Module):
    """torch's ``nn.TransformerEncoder`` between an embedding and a head: fx cannot trace its
    layers (their forward branches on the input), and its own forward reads the first layer's
    settings (``self.layers[0].self_attn.batch_first``) on every pipeline stage."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.tok(input_ids)))


class AttentionBlock(nn.Module):
    """``nn.MultiheadAttention`` (which reads ``out_proj.weight`` without calling ``out_proj``)
    and an MLP, pre-norm."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = _mlp(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class BlockLM(nn.Module):
    """An embedding, two blocks made by ``block``, a head."""

    def __init__(self, block: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class TransposedNormLM(MaskedLM):
    """:class:`MaskedLM` with a BatchNorm over the features after the blocks, applied as
    sequence models do (``bn(h.transpose(1, 2)).transpose(1, 2)``): the gradient reaching the
    last row-parallel layer's output is laid out transposed, not as its forward output was."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(WIDTH)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.bn(h.transpose(1, 2)).transpose(1, 2))


transposed_norm_lm = partial(seeded, TransposedNormLM)


class PositionedLM(BlockLM):
    """:class:`BlockLM` with a learned position table added at the root, before the blocks:
    under SP the sequence is split at the first block, so the table meets the whole sequence."""

    def __init__(self, block: Callable[[], nn.Module]) -> None:
        super().__init__(block)
        self.pos = nn.Embedding(SEQ, WIDTH)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


AUX_BELOW = 4  # rows whose first token is below this go through the auxiliary layer


class AuxBranchLM(MaskedLM):
    """An auxiliary layer for some rows only (those whose first token is below AUX_BELOW), as
    one device computes it row by row; a data rank whose rows have none leaves its
    parameters without gradients in that step."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(WIDTH, WIDTH)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            h = h + block(h)
        rows = input_ids[:, 0] < AUX_BELOW
        if rows.any():
            h = h.clone()
            h[rows] = h[rows] + self.aux(h[rows])
        return self.head(h)


class TopOneMoE(nn.Module):
    """Top-1 routing over four experts, one device's arithmetic: each row goes through the
    expert its router scores highest, so an expert no row of a data rank picked is not called
    on that rank. The experts are the model's largest container (FSDP2's default units)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.router = nn.Linear(WIDTH, 4)
        self.experts = nn.ModuleList(_mlp(WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, 6)

    def routes(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(self.inp(x)).argmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        gate, pick = self.router(h).softmax(-1).max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = pick == e
            if rows.any():
                out[rows] = gate[rows, None] * expert(h[rows])
        return self.head(h + out)


top_one_moe = partial(seeded, TopOneMoE)


torch_encoder_lm = partial(seeded, TorchEncoderLM)


running_features = partial(seeded, RunningFeatures)


attention_lm = partial(seeded, partial(BlockLM, AttentionBlock))


aux_branch_lm = partial(seeded, AuxBranchLM)


def abort_on_rank0(rank: int, world_size: int) -> None:
    """Rank 0 dies as torch kills a rank whose collective received the wrong size (SIGABRT, no
    Python error); rank 1 then loses its peer in the next collective."""
    import os
    import time

    import torch.distributed as dist

    if rank == 0:
        time.sleep(0.5)
        os.abort()
    dist.barrier()


class FlatBlock(nn.Module):
    """Attention with one fused q|k|v layer and an MLP, all four linears direct children (as
    minGPT-style code writes them): two TP regions in one block."""

    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class SharedBlockLM(MaskedLM):
    """One block applied at every depth (ALBERT): ``nn.ModuleList([block] * 4)``, residual in
    the parent, so a pipeline stage must add zero for each of its names it does not hold."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([self.blocks[0]] * 4)


class DictBlocksLM(MaskedLM):
    """Blocks that are nn.ModuleDicts the parent indexes (``block["mlp"](block["norm"](h))``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(norm=nn.LayerNorm(WIDTH), mlp=_mlp(WIDTH)))
                                    for _ in range(2))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            h = h + block["mlp"](block["norm"](h))
        return self.head(h)


flat_lm = partial(seeded, partial(BlockLM, FlatBlock))


shared_block_lm = partial(seeded, SharedBlockLM)


dict_blocks_lm = partial(seeded, DictBlocksLM)


class QKNormBlock(nn.Module):
    """Attention with a per-head RMSNorm on q and k after the heads are split (Qwen3, OLMo-2,
    Gemma-3 write it so): under TP each rank's norms see its heads only."""

    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(WIDTH)
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.q_norm, self.k_norm = nn.RMSNorm(WIDTH // heads), nn.RMSNorm(WIDTH // heads)
        with torch.no_grad():  # not ones: a wrong gradient then shows in the weights
            self.q_norm.weight.uniform_(0.5, 1.5)
            self.k_norm.weight.uniform_(0.5, 1.5)
        self.o = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm(x)
        q = self.q_norm(self.q(h).view(b, s, self.heads, -1)).transpose(1, 2)
        k = self.k_norm(self.k(h).view(b, s, self.heads, -1)).transpose(1, 2)
        v = self.v(h).view(b, s, self.heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, s, -1))


class TupleBlock(nn.Module):
    """A residual MLP block returning ``(hidden, None)``, as older transformers layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = _mlp(WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x + self.mlp(x), None


class HeadFirstLM(nn.Module):
    """Registers its final norm and head before the embedding and the blocks (OPT's decoder
    registers its final norm before its layers); its blocks return tuples."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(TupleBlock() for _ in range(4))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids)
        for block in self.blocks:
            h = block(h)[0]
        return self.head(self.norm(h))


class InterleavedQKVBlock(nn.Module):
    """Attention whose fused q|k|v layer is laid out head by head, ``[q0 k0 v0 | q1 k1 v1]``
    (GPT-NeoX stores it so): split in three blocks, rank 0 would get q and k of head 0 and v
    of head 0 and q of head 1... A plain column split gives it whole heads."""

    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.norm(x)).view(b, s, self.heads, -1).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, s, -1))


class GroupedQueryBlock(nn.Module):
    """Grouped-query attention as Llama's reference code writes it: head counts stored, the
    group size computed once, k and v repeated head by head (query head i reads kv head
    i // n_rep); ``tile=True`` repeats them whole instead (query head i reads i % kv_heads),
    which replicating kv heads over tp cannot express."""

    def __init__(self, kv_heads: int, heads: int = 4, tile: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = heads, kv_heads, WIDTH // heads
        self.n_rep, self.tile = heads // kv_heads, tile
        self.norm = nn.LayerNorm(WIDTH)
        self.wq = nn.Linear(WIDTH, WIDTH, bias=False)
        self.wk = nn.Linear(WIDTH, kv_heads * self.head_dim)  # a bias: sliced with the rows
        self.wv = nn.Linear(WIDTH, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm(x)
        q = self.wq(h).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.tile:
            k, v = k.repeat(1, self.n_rep, 1, 1), v.repeat(1, self.n_rep, 1, 1)
        else:
            k, v = k.repeat_interleave(self.n_rep, 1), v.repeat_interleave(self.n_rep, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.wo(y.transpose(1, 2).reshape(b, s, -1))


class SelfAttention(nn.Module):
    """q, k, v read the module's input; heads reshaped with -1 (whatever length comes in)."""

    def __init__(self, heads: int = 4, kv_heads: int = 1) -> None:
        super().__init__()
        self.head_dim, self.n_kv_heads = WIDTH // heads, kv_heads
        self.q = nn.Linear(WIDTH, WIDTH)
        self.k, self.v = (nn.Linear(WIDTH, kv_heads * self.head_dim) for _ in range(2))
        self.o = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).flatten(2))


class PositionwiseBlock(nn.Module):
    """Pre-norm attention (one kv head) and MLP modules with a layer-scale on the block: between
    its regions everything treats positions one by one (sequence parallelism applies);
    ``shift=True`` adds the previous position's input, which it does not."""

    def __init__(self, shift: bool = False) -> None:
        super().__init__()
        self.shift = shift
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn, self.mlp = SelfAttention(), _mlp(WIDTH)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shift:
            x = x + F.pad(x, (0, 0, 1, 0))[:, :-1]
        x = x + self.scale * self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LoRALinear(nn.Module):
    """A frozen linear plus a trainable low-rank update, the hand-written LoRA:
    base(x) + scale * B(A(x)). B starts non-zero (LoRA starts it at zero) so that A gets a
    gradient from the first step."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Linear(base.in_features, rank, bias=False)
        self.B = nn.Linear(rank, base.out_features, bias=False)
        self.scale = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * self.B(self.A(x))


class LoRABlock(PositionwiseBlock):
    """PositionwiseBlock with two kv heads, every linear wrapped in LoRA (only A and B, the
    norms and the layer-scale train)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = SelfAttention(kv_heads=2)
        linears = [(parent, name) for parent in self.modules()
                   for name, child in parent.named_children() if isinstance(child, nn.Linear)]
        for parent, name in linears:
            setattr(parent, name, LoRALinear(getattr(parent, name)))


class PeftLayoutLoRA(nn.Module):
    """A LoRA layer laid out as PEFT lays it out (``base_layer``, ``lora_A["default"]``,
    ``lora_B["default"]``, ``lora_dropout["default"]``), written here: PEFT is not a
    dependency."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, base.out_features, bias=False)})
        self.lora_dropout = nn.ModuleDict({"default": nn.Identity()})
        self.scaling = {"default": 2.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = self.lora_B["default"](self.lora_A["default"](self.lora_dropout["default"](x)))
        return self.base_layer(x) + lora * self.scaling["default"]


def hf_llama_lora() -> nn.Module:
    """Llama with every projection of its layers a PEFT-layout LoRA layer and everything else
    frozen (norms, embeddings, head), as PEFT leaves a model: only the A and B train."""
    model = hf_llama()
    for p in model.parameters():
        p.requires_grad_(False)
    targets = [(parent, name) for parent in model.modules() for name, child in
               parent.named_children() if isinstance(child, nn.Linear)
               and name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj")]
    for parent, name in targets:
        setattr(parent, name, PeftLayoutLoRA(getattr(parent, name)))
    return model


qk_norm_lm = partial(seeded, partial(BlockLM, QKNormBlock))


positionwise_lm = partial(seeded, partial(BlockLM, PositionwiseBlock))


shifted_lm = partial(seeded, partial(BlockLM, partial(PositionwiseBlock, shift=True)))
positioned_lm = partial(seeded, partial(PositionedLM, PositionwiseBlock))


lora_lm = partial(seeded, partial(BlockLM, LoRABlock))


mqa_lm = partial(seeded, partial(BlockLM, partial(GroupedQueryBlock, 1)))


gqa_lm = partial(seeded, partial(BlockLM, partial(GroupedQueryBlock, 2)))


tiled_gqa_lm = partial(seeded, partial(BlockLM, partial(GroupedQueryBlock, 2, tile=True)))


interleaved_qkv_lm = partial(seeded, partial(BlockLM, InterleavedQKVBlock))


head_first_lm = partial(seeded, HeadFirstLM)


# ---------------------------------------------------------------- more transformers families
def _hf(config_cls: str, model_cls: str, **kw: Any) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**kw)
    return Logits(getattr(transformers, model_cls)(cfg))


_DECODER = dict(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, max_position_embeddings=16)


def hf_qwen3() -> nn.Module:
    """Per-head q/k norms: transformers' plan names them replicated_with_grad_allreduce."""
    return _hf("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=8,
               tie_word_embeddings=True, **_DECODER)


def hf_phi3() -> nn.Module:
    """Fused qkv_proj and gate_up_proj: transformers' plan gathers them (colwise_gather_output)
    and splits the next layer's input (rowwise_split_input)."""
    return _hf("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=2, pad_token_id=0,
               **_DECODER)


def hf_mixtral() -> nn.Module:
    """A mixture-of-experts MLP that the plan leaves replicated (attention split)."""
    return _hf("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2,
               num_local_experts=4, num_experts_per_tok=2, **_DECODER)


def hf_roberta_mlm() -> nn.Module:
    """BERT's layout without a plan of its own; the masked-LM decoder tied to the embedding."""
    return _hf("RobertaConfig", "RobertaForMaskedLM", vocab_size=HF_VOCAB, hidden_size=32,
               num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               max_position_embeddings=SEQ + 2, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, pad_token_id=1)


def hf_opt() -> nn.Module:
    """Registers the decoder's final norm before its layers."""
    return _hf("OPTConfig", "OPTForCausalLM", vocab_size=HF_VOCAB, hidden_size=32, ffn_dim=64,
               num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=16,
               word_embed_proj_dim=32, dropout=0.0, pad_token_id=1)


def hf_falcon() -> nn.Module:
    """Its decoder layers return tuples."""
    return _hf("FalconConfig", "FalconForCausalLM", vocab_size=HF_VOCAB, hidden_size=32,
               num_hidden_layers=4, num_attention_heads=4, hidden_dropout=0.0,
               attention_dropout=0.0)


def hf_gemma_mqa() -> nn.Module:
    """One kv head (multi-query attention, as Gemma-2B), eager attention: its repeat_kv reads
    the module's num_key_value_groups."""
    return _hf("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=1, head_dim=8,
               attn_implementation="eager", **_DECODER)


def hf_bloom() -> nn.Module:
    """A LayerNorm of the embeddings before its layers (applied, not added); tuple layers."""
    return _hf("BloomConfig", "BloomForCausalLM", vocab_size=HF_VOCAB, hidden_size=32, n_layer=4,
               n_head=4, hidden_dropout=0.0, attention_dropout=0.0)


def hf_distilbert() -> nn.Module:
    """Calls its embeddings positionally: ``self.embeddings(input_ids, inputs_embeds)``."""
    return _hf("DistilBertConfig", "DistilBertForMaskedLM", vocab_size=HF_VOCAB, dim=32,
               n_layers=4, n_heads=4, hidden_dim=64, max_position_embeddings=16, dropout=0.0,
               attention_dropout=0.0)


def check_batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``mlm_batch`` as ``plait.check.CheckConfig.batch_factory`` takes it."""
    return mlm_batch(step)


def full_state_loads_into_the_original(rank: int, world_size: int,
                                       jobs: list[tuple[str, Callable]]) -> list[str]:
    """Per (plan, factory): one step, then run.full_state_dict loaded (strict) into a fresh
    one-device model; returns the keys the two differ in (none expected)."""
    from plait.runtime import init

    problems = []
    for text, factory in jobs:
        run = init(text, quiet=True, seed=0)
        model = run.parallelize(factory())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        batch = bn_batch(0) if factory is batchnorm_mlp else hf_batch(0)
        loss = F.cross_entropy if factory is batchnorm_mlp else mlm_loss
        run.step(model, _slice(batch, run.dp_rank, run.dp_size), loss, opt)
        state = run.full_state_dict(model)
        run.close()
        fresh = factory()
        want = fresh.state_dict()
        fresh.load_state_dict(state)  # strict: the same keys, no more, no fewer
        problems += [f"{text}: {k} {state[k].dtype} != {v.dtype}" for k, v in want.items()
                     if state[k].dtype != v.dtype]
        problems += [f"{text}: {k} not loaded" for k, v in fresh.state_dict().items()
                     if not torch.equal(v, state[k])]
    return problems



class DropoutLM(nn.Module):
    """The masked LM with dropout after its embedding: its loss in train mode is random."""

    def __init__(self):
        super().__init__()
        self.inner, self.drop = MaskedLM(), nn.Dropout(0.5)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1])
        h = self.drop(self.inner.tok(input_ids) + self.inner.pos(positions))
        for block in self.inner.blocks:
            h = h + block(h)
        return self.inner.head(h)


def dropout_lm() -> nn.Module:
    torch.manual_seed(0)
    return DropoutLM()


def reference_with_evals(factory: Callable[[], nn.Module], batches: list[Any],
                         loss_fn: Callable | None, held_out: Any) -> list[float]:
    """One device: the held-out batch's loss in eval mode before training and after each
    step of :func:`reference`'s loop (SGD, clipping at 1.0); dropout, if any, is off in both
    the evaluations and (for comparability) the steps."""
    model = factory()
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def loss_of(batch: Any) -> torch.Tensor:
        if loss_fn is None:
            return model(**batch)["loss"]
        return loss_fn(model(batch[0]), batch[1])

    model.eval()
    evals = []
    for batch in [None, *batches]:
        if batch is not None:
            loss_of(batch).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            evals.append(float(loss_of(held_out)))
    return evals


def _note_rows_without_grad(rows: set[int], module: nn.Module, args: tuple) -> None:
    if args and not torch.is_grad_enabled():
        rows.add(int(getattr(args[0], "shape", (0,))[0]))


def evaluate_jobs(rank: int, world_size: int, jobs: list[tuple[str, Callable, list[Any],
                                                                Callable | None, Any]]
                  ) -> list[dict[str, Any]]:
    """Per (plan, factory, batches, loss_fn, held-out batch): run.evaluate on the held-out
    batch before training and after each run.step; whether the model is back in train mode.
    Dropout models train in eval mode here so that the steps are deterministic."""
    from plait.runtime import init

    out = []
    for text, factory, batches, loss_fn, held_out in jobs:
        run = init(text, quiet=True, seed=0)
        model = run.parallelize(factory())
        if factory is dropout_lm:
            model.eval()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        share = _slice(held_out, run.dp_rank, run.dp_size)
        rows: set[int] = set()  # the batch sizes the model's forward saw without autograd
        model.register_forward_pre_hook(partial(_note_rows_without_grad, rows))
        evals = [float(run.evaluate(model, share, loss_fn))]
        modes = []
        for batch in batches:
            run.step(model, _slice(batch, run.dp_rank, run.dp_size), loss_fn, opt)
            evals.append(float(run.evaluate(model, share, loss_fn)))
            modes.append(model.training)
        model.train()
        train_mode = [float(run.evaluate(model, share, loss_fn)), model.training]
        run.close()
        out.append({"plan": text, "evals": evals, "modes": modes, "train_mode": train_mode,
                    "mode": factory is not dropout_lm, "eval_rows": sorted(rows)})
    return out


def ledger_tables(rank: int, world_size: int, plans: list[str], features: bool = False
                  ) -> dict[str, dict[str, Any]]:
    """Three steps of the masked LM (``features``: of ``pre_norm_net`` on feature vectors) with
    the ledger on under each plan (one ``plait.init`` each, in this process); per plan the
    communication table and its dict."""
    from plait.runtime import init

    factory, batch_of, loss_fn = ((pre_norm_net, feature_batch, mse) if features else
                                  (masked_lm, mlm_batch, mlm_loss))
    out = {}
    for plan in plans:
        run = init(plan, quiet=True, ledger=True, seed=0)
        model = run.parallelize(factory())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(3):
            run.step(model, _slice(batch_of(step), run.dp_rank, run.dp_size), loss_fn, opt)
        info = run.finish(print_summary=False)
        out[plan] = {"table": info["comm_table"], "comm": info["comm"]}
    return out


class ShiftsInShapeInference:
    """``mlm_loss``, except when torch's pipeline stage calls it during its shape inference
    (its ``_backward_metadata_inference`` frame on the stack) and on its own recomputations of
    that output: there it scores fixed logits as a loss that shifts the labels does. That
    call's outputs come from uninitialised buffers, so any answer is possible there; this one
    makes the wrong answer certain. ``seen``: whether such a call came."""

    def __init__(self):
        self.inference_output = None
        self.seen = False

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        import sys

        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "_backward_metadata_inference":
                self.inference_output, self.seen = logits, True
                break
            frame = frame.f_back
        if logits is self.inference_output:  # finite logits, still on the autograd path
            fixed = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
            return shifted_loss(logits.nan_to_num(0.0, 0.0, 0.0) * 0 + fixed, labels)
        return mlm_loss(logits, labels)


def shape_inference_loss_job(rank: int, world_size: int, plan: str,
                             batches: list[Any]) -> dict[str, Any]:
    """Train the staged masked LM under ``plan`` with :class:`ShiftsInShapeInference`."""
    from plait.runtime import init

    run = init(plan, quiet=True, log_every=1, seed=0)
    model = run.parallelize(staged_masked_lm())
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    loss = ShiftsInShapeInference()
    losses = [float(run.step(model, _slice(batch, run.dp_rank, run.dp_size), loss, opt))
              for batch in batches]
    state = run.full_state_dict(model)
    run.close()
    return {"plan": plan, "losses": losses, "state": state, "seen": loss.seen}
