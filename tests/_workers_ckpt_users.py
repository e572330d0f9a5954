"""Workers for tests/test_checkpoint_users.py: checkpoints of models and optimizers written the
way users write them (not plait.models), saved under one layout and resumed under another.

Each run trains a named model with a named optimizer/scheduler on fixed global batches (the
plait loader over a seeded token stream), optionally saving to or resuming from a checkpoint
folder, and returns its per-step losses, learning rates and (rank 0) the final full state.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import plait
from plait.data import TextDataset
from tests._workers_ledger_any import VOCAB, WIDTH, Block, LoraLM, TiedLM
from tests._workers_semantics import seeded

SEQ, BATCH = 8, 8


class EmaNorm(nn.Module):
    """A BatchNorm over the features (running statistics: buffers a training forward changes)
    beside an EMA of the normalised mean the module keeps itself (a custom buffer, read by the
    forward)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(width)
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * h.detach().float().mean((0, 1)))
        return h + self.ema


class BnEmaLM(nn.Module):
    """Buffers a step changes, after the blocks (in ``trunk``, on a pipeline's last stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.trunk = nn.ModuleList(Block() for _ in range(2))
        self.norm = EmaNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.trunk:
            h = block(h)
        return self.head(self.norm(h))


class RootStatsLM(nn.Module):
    """Statistics the model's own forward keeps in buffers of the root module (not in a block,
    so every pipeline stage holds them): a count of the tokens seen and an EMA of the embedded
    features, written before the blocks; an EMA of the last block's output, written after them.
    One stage's forward computes each from the real activations, the others' from another
    stage's hidden states."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema_in", torch.zeros(WIDTH))
        self.register_buffer("ema_out", torch.zeros(WIDTH))
        # not saved (persistent=False), written on every stage too
        self.register_buffer("last_norm", torch.zeros(()), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.training:
            with torch.no_grad():
                self.tokens_seen += tokens.numel()
                self.ema_in.mul_(0.9).add_(0.1 * h.mean((0, 1)))
        for block in self.blocks:
            h = block(h)
        if self.training:
            with torch.no_grad():
                self.ema_out.mul_(0.9).add_(0.1 * h.mean((0, 1)))
                self.last_norm.copy_(h.norm())
        return self.head(h)


class RootParamLM(nn.Module):
    """Parameters of the model's own module, not of a block, so every pipeline stage holds
    them (tied over the stages): a scale applied to the embedding and to the logits, a shift
    added after the embedding and to every block's output (not a residual: the split passes
    the activation through the blocks a stage does not hold)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.scale = nn.Parameter(torch.tensor([1.5]))  # (1,): FSDP2 refuses a 0-dim one
        self.shift = nn.Parameter(torch.full((WIDTH,), 0.1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * self.scale + self.shift
        for block in self.blocks:
            h = block(h) + self.shift
        return self.head(h) * self.scale


class Stem(nn.Module):
    """The embedding, reached through a second module that also holds it."""

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = embed
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(self.embed(tokens))


class SharedModuleLM(nn.Module):
    """One embedding module registered under two names (``embed`` and ``stem.embed``, as T5 and
    BART register ``shared`` as ``encoder.embed_tokens`` too) and tied to the head: the model's
    state dict holds the weight under three names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.stem = Stem(self.embed)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.stem(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _hf(kind: str) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=24,
                                       num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=1, max_position_embeddings=SEQ,
                                       bos_token_id=0, eos_token_id=0)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=WIDTH, n_layer=2, n_head=2,
                                  n_positions=SEQ, bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "tied": partial(seeded, TiedLM), "lora": partial(seeded, LoraLM),
    "bnema": partial(seeded, BnEmaLM), "rootstats": partial(seeded, RootStatsLM),
    "rootparams": partial(seeded, RootParamLM), "sharedmod": partial(seeded, SharedModuleLM),
    "llama": lambda: _hf("llama"), "gpt2": lambda: _hf("gpt2")}
HF = ("llama", "gpt2")


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


class DictTokens(torch.utils.data.Dataset):
    """{"input_ids", "labels"} items: a Hugging Face causal LM shifts the labels itself."""

    def __init__(self, base: TextDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, _ = self.base[i]
        return {"input_ids": x, "labels": x}


def dataset(model: str) -> Any:
    g = torch.Generator().manual_seed(7)
    base = TextDataset(torch.randint(0, VOCAB, (4000,), generator=g), seq_len=SEQ)
    return DictTokens(base) if model in HF else base


def optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    """``adamw``: AdamW over the trainable parameters in two groups by name (no weight decay
    for biases, norms and embeddings); ``sgd``: SGD with momentum over every parameter (frozen
    ones included, as ``model.parameters()`` gives them)."""
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    if kind == "adamw1":
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=4e-3)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        flat = p.ndim < 2 or "bias" in name or "norm" in name or "embed" in name or "wte" in name
        (no_decay if flat else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3}],
                             lr=4e-3, betas=(0.9, 0.95))


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def scheduler(kind: str | None, opt: torch.optim.Optimizer, total: int) -> Any:
    if kind is None:
        return None
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
    if kind == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=[g["lr"] for g in opt.param_groups], total_steps=total + 2)
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=1e-4)


# The blocks' tensor-parallel layer plan (plait infers one for its own and Hugging Face models).
BLOCKS = {"tied": "blocks", "lora": "stack", "bnema": "trunk", "rootstats": "blocks",
          "rootparams": "blocks", "sharedmod": "blocks"}


def _plan(plan: str, model: str) -> Any:
    from plait.plan import Plan

    parsed = Plan.load(plan)
    if parsed.tp > 1 and model not in HF:
        parsed = parsed.replace(options=parsed.options.replace(tp_plan={
            f"{BLOCKS[model]}.*.lora_a": "colwise", f"{BLOCKS[model]}.*.lora_b": "rowwise"}))
    return parsed


def train(plan: str, model: str, *, steps: int, opt: str = "adamw", sched: str | None = None,
          checkpoint: str | None = None, every: int | None = None, keep: int | None = 3,
          load: str | None = None, total: int = 8, export: bool = False) -> dict[str, Any]:
    """Train ``model`` under ``plan`` up to global step ``steps``; with ``checkpoint`` resume
    from it when it holds one and save every ``every`` steps. Returns the losses and learning
    rates of the steps this run took, and (``export``) the full state at the end."""
    run = plait.init(_plan(plan, model), checkpoint=checkpoint, every=every, keep=keep,
                     quiet=True, seed=0)
    try:
        net = run.parallelize(MODELS[model]())
        o = optimizer(opt, net)
        s = scheduler(sched, o, total)
        if load is not None:
            run.load(load, model=net, optimizer=o, scheduler=s)
        loss_fn = None if model in HF else lm_loss
        losses, lrs = [], []
        for batch in run.loader(dataset(model), batch_size=BATCH, steps=steps):
            losses.append(float(run.step(net, batch, loss_fn, o, scheduler=s)))
            lrs.append([g["lr"] for g in o.param_groups])
        state = run.full_state_dict(net) if export else None
        if checkpoint is not None:
            run.finish(print_summary=False)
    finally:
        run.close()
    return {"losses": losses, "lrs": lrs, "state": state}


def runs(rank: int, world: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``train(**job)`` for each job in turn, in these processes; rank 0's results (the
    others' None, to keep the pickles small)."""
    torch.set_num_threads(1)
    out = [train(**job) for job in jobs]
    return out if rank == 0 else []


def folder(root: str, name: str) -> str:
    return str(Path(root) / name)
