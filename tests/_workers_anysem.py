"""Workers for tests/test_anysem.py, with the models written for them: token taggers whose own
loss is class-weighted (a loss module they hold, or one made in forward) for pipelines, and
sequence models plait cannot name for context parallelism (an encoder-decoder whose forward
is ``forward(src, tgt)``, a model of two inputs read as one sequence, keys and values
projected from the sequence on a path of their own, a prefix concatenated to the sequence)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.check import _slice

VOCAB, WIDTH, TAGS, SEQ, BATCH, STEPS, LR = 16, 16, 4, 8, 8, 3, 0.1
# Tag frequencies far from equal and inverse-frequency weights: each microbatch's labels
# weigh differently from their count.
FREQUENCY, WEIGHTS = (0.65, 0.2, 0.1, 0.05), (0.5, 1.0, 2.5, 5.0)


# ------------------------------------------------------------- a model's own weighted loss


@dataclass
class TagOutput:
    """A Hugging Face-style output object: the loss and the logits as attributes."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class WeightedTagger(nn.Module):
    """Token ids to per-token tag logits through a stack of blocks (each token on its own),
    returning ``TagOutput`` with the loss of the ``nn.CrossEntropyLoss(weight=...)`` it holds
    when given ``labels`` (-100: padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                                    for _ in range(2))
        self.head = nn.Linear(WIDTH, TAGS)
        self.loss_fct = nn.CrossEntropyLoss(weight=torch.tensor(WEIGHTS))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
                ) -> TagOutput:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        logits = self.head(h)
        loss = None if labels is None else self.own_loss(logits, labels)
        return TagOutput(loss, logits)

    def own_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fct(logits.reshape(-1, TAGS), labels.reshape(-1))


class InlineTagger(WeightedTagger):
    """:class:`WeightedTagger` with its weighted loss made inside forward from a buffer, as
    many Hugging Face heads do: no loss module plait can read the weights of."""

    def __init__(self) -> None:
        super().__init__()
        del self.loss_fct
        self.register_buffer("class_weights", torch.tensor(WEIGHTS))

    def own_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, TAGS), labels.reshape(-1),
                               weight=self.class_weights)


class Stem(nn.Module):
    """The token embedding, and the model's weighted loss module kept beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.loss_fct = nn.CrossEntropyLoss(weight=torch.tensor(WEIGHTS))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tok(input_ids)


class StemHeldTagger(WeightedTagger):
    """:class:`WeightedTagger` whose loss module is held by its stem (the first stage's
    module), registered before the blocks, and called from there after them."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.embed = Stem()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                                    for _ in range(2))
        self.head = nn.Linear(WIDTH, TAGS)

    def own_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.embed.loss_fct(logits.reshape(-1, TAGS), labels.reshape(-1))


class Scoring(nn.Module):
    """What scores the tags: the weighted loss module, and how many tags there are."""

    def __init__(self) -> None:
        super().__init__()
        self.tags = TAGS
        self.loss_fct = nn.CrossEntropyLoss(weight=torch.tensor(WEIGHTS))


class LossBlock(nn.Module):
    """A block that also holds a loss module (as a model may keep one in its first layer)."""

    def __init__(self, loss: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        if loss:
            self.scoring = Scoring()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h))


class BlockHeldTagger(WeightedTagger):
    """:class:`WeightedTagger` whose loss module sits two levels down in its first block (the
    first stage's), called after the blocks."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(LossBlock(i == 0) for i in range(2))
        self.head = nn.Linear(WIDTH, TAGS)

    def own_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.layers[0].scoring.loss_fct(logits.reshape(-1, TAGS), labels.reshape(-1))


class WrappedTagger(nn.Module):
    """A wrapper holding the weighted loss module, registered first, around a tagger that
    returns logits."""

    def __init__(self) -> None:
        super().__init__()
        self.loss_fct = nn.CrossEntropyLoss(weight=torch.tensor(WEIGHTS))
        self.model = InlineTagger()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
                ) -> TagOutput:
        logits = self.model(input_ids).logits
        loss = None if labels is None else self.loss_fct(logits.reshape(-1, TAGS),
                                                         labels.reshape(-1))
        return TagOutput(loss, logits)


class DictStem(nn.Module):
    """The token embedding, and the model's weighted loss module in an ``nn.ModuleDict``
    beside an unused projection (an entry the last stage does not hold)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.losses = nn.ModuleDict({"proj": nn.Linear(WIDTH, WIDTH),
                                     "ce": nn.CrossEntropyLoss(weight=torch.tensor(WEIGHTS))})

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tok(input_ids)


class DictHeldTagger(StemHeldTagger):
    """:class:`StemHeldTagger` whose loss module is an entry of its stem's ``nn.ModuleDict``,
    indexed by key after the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = DictStem()

    def own_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.embed.losses["ce"](logits.reshape(-1, TAGS), labels.reshape(-1))


class ListBlock(LossBlock):
    """A block holding an ``nn.ModuleList`` of a gate and the weighted loss module."""

    def __init__(self, loss: bool) -> None:
        super().__init__(False)
        if loss:
            self.extras = nn.ModuleList([nn.Linear(WIDTH, 1),
                                         nn.CrossEntropyLoss(weight=torch.tensor(WEIGHTS))])


class ListHeldTagger(BlockHeldTagger):
    """:class:`BlockHeldTagger` whose loss module is entry 1 of its first block's
    ``nn.ModuleList``, indexed after the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ListBlock(i == 0) for i in range(2))

    def own_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.layers[0].extras[-1](logits.reshape(-1, TAGS), labels.reshape(-1))


# Where a model holds its own weighted loss module, by name (tagger's argument).
HOLDERS = {"stem": StemHeldTagger, "block": BlockHeldTagger, "wrapper": WrappedTagger,
           "dict": DictHeldTagger, "list": ListHeldTagger}
# The holders whose models keep a parameter no forward uses.
UNUSED = ("dict", "list")


def tagger(inline: bool | str) -> nn.Module:
    """The tagger whose loss is made in forward (True), held by the model (False), or held
    where ``HOLDERS`` names."""
    torch.manual_seed(0)
    if isinstance(inline, str):
        return HOLDERS[inline]()
    return InlineTagger() if inline else WeightedTagger()


def tag_batch(step: int) -> dict[str, torch.Tensor]:
    """A dict batch whose tags follow ``FREQUENCY``; rows end in 0 to 3 padded (-100)
    positions."""
    g = torch.Generator().manual_seed(300 + step)
    tags = torch.multinomial(torch.tensor(FREQUENCY), BATCH * SEQ, replacement=True,
                             generator=g).view(BATCH, SEQ)
    ids = (tags * 4 + torch.randint(0, 4, (BATCH, SEQ), generator=g)) % VOCAB
    labels = tags.clone()
    for i in range(BATCH):
        labels[i, SEQ - i % 4:] = -100
    return {"input_ids": ids, "labels": labels}


def tagger_reference(inline: bool | str) -> dict[str, Any]:
    """One device: SGD on each whole batch, torch's clipping at 1.0 (run.step's default)."""
    model = tagger(inline)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(**tag_batch(step)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": {n: p.detach().clone()
                                        for n, p in model.named_parameters()}}


def train_taggers(rank: int, world_size: int, jobs: list[tuple[bool | str, str]]
                  ) -> list[dict[str, Any]]:
    """Each (inline, plan) evaluated on the first batch (run.evaluate), then trained with SGD
    through run.step, with the model's own loss (loss_fn=None); the losses, rank 0's full
    state and plait's warnings on this rank."""
    from plait.runtime import init

    torch.set_num_threads(1)
    out = []
    for inline, plan in jobs:
        run = init(plan, quiet=True, seed=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = run.parallelize(tagger(inline), example=tag_batch(0))
            # evaluated first: what the model's own loss is is learnt there, and still said
            evaluated = float(run.evaluate(model, _slice(tag_batch(0), run.dp_rank,
                                                         run.dp_size), None))
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            losses = [float(run.step(model, _slice(tag_batch(s), run.dp_rank, run.dp_size),
                                     None, opt)) for s in range(STEPS)]
        state = run.full_state_dict(model)
        run.close()
        out.append({"plan": plan, "holder": inline, "losses": losses, "evaluated": evaluated,
                    "state": state if rank == 0 else None,
                    "warnings": [str(w.message) for w in caught
                                 if str(w.message).startswith("plait:")]})
    return out


# ----------------------------------------------------- sequence models plait cannot name


def _heads(t: torch.Tensor) -> torch.Tensor:
    """(batch, seq, WIDTH) as (batch, 2 heads, seq, WIDTH // 2)."""
    return t.view(t.shape[0], t.shape[1], 2, -1).transpose(1, 2)


def _merge(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], WIDTH)


class Attention(nn.Module):
    """Multi-head attention through F.scaled_dot_product_attention, the queries from ``x``
    and the keys and values from ``memory`` (``x`` itself when None)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH)
        self.kv = nn.Linear(WIDTH, 2 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None,
                causal: bool = False) -> torch.Tensor:
        k, v = self.kv(x if memory is None else memory).chunk(2, dim=-1)
        a = F.scaled_dot_product_attention(_heads(self.q(x)), _heads(k), _heads(v),
                                           is_causal=causal)
        return self.out(_merge(a))


class Seq2Seq(nn.Module):
    """An encoder-decoder with no config and no parameter named for a second sequence:
    ``forward(src, tgt)``, an encoder of self-attention over ``src``, a decoder of causal
    self-attention over ``tgt`` and cross-attention to the encoder's output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.encoder = nn.ModuleList(Attention() for _ in range(2))
        self.self_attn = nn.ModuleList(Attention() for _ in range(2))
        self.cross_attn = nn.ModuleList(Attention() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(src.shape[1]).expand(src.shape[0], -1)
        memory = self.embed(src) + self.pos(position_ids)
        for layer in self.encoder:
            memory = memory + layer(memory)
        h = self.embed(tgt) + self.pos(position_ids)
        for own, cross in zip(self.self_attn, self.cross_attn, strict=True):
            h = h + own(h, causal=True)
            h = h + cross(h, memory)
        return self.head(h)


class TwoInputLM(nn.Module):
    """A causal LM of two inputs read as one sequence (a token and its segment at each
    position, ``forward(src, tgt)`` as well): every attention's queries, keys and values
    come from that one sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.segment = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Attention() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(src.shape[1]).expand(src.shape[0], -1)
        h = self.embed(src) + self.segment(tgt) + self.pos(position_ids)
        for block in self.blocks:
            h = h + block(h, causal=True)
        return self.head(h)


class ProjectedKV(TwoInputLM):
    """:class:`TwoInputLM` whose attention takes its keys and values from the same sequence
    on a path of its own (a norm and a projection the queries do not go through)."""

    def __init__(self) -> None:
        super().__init__()
        self.kv_path = nn.ModuleList(nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH))
                                     for _ in range(2))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(src.shape[1]).expand(src.shape[0], -1)
        h = self.embed(src) + self.segment(tgt) + self.pos(position_ids)
        for block, path in zip(self.blocks, self.kv_path, strict=True):
            h = h + block(h, path(h), causal=True)
        return self.head(h)


class PrefixLM(nn.Module):
    """A causal LM over a prefix (``src``) concatenated before the sequence (``tgt``), every
    attention over the joined sequence; the logits of ``tgt``'s positions."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Attention() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        h = self.embed(torch.cat([src, tgt], dim=1))
        for block in self.blocks:
            h = h + block(h, causal=True)
        return self.head(h[:, src.shape[1]:])


SEQUENCE_MODELS = {"seq2seq": Seq2Seq, "two_input": TwoInputLM, "projected_kv": ProjectedKV,
                   "prefix": PrefixLM}


def sequence_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return SEQUENCE_MODELS[name]()


def pair_batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({src, tgt}, labels): source and target of one length, the labels the target's next
    tokens (-100 at the end)."""
    g = torch.Generator().manual_seed(400 + step)
    src = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    labels = tgt[:, 1:].clone()
    labels[:, -1] = -100
    return {"src": src, "tgt": tgt[:, :-1].contiguous()}, labels


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def sequence_reference(name: str) -> dict[str, Any]:
    """One device: SGD on each whole batch, torch's clipping at 1.0."""
    model = sequence_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        inputs, labels = pair_batch(step)
        loss = lm_loss(model(**inputs), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": {n: p.detach().clone()
                                        for n, p in model.named_parameters()}}


def train_sequences(rank: int, world_size: int, jobs: list[tuple[str, str]]
                    ) -> list[dict[str, Any]]:
    """Each (model name, plan) trained with SGD through run.step; the losses and rank 0's
    full state, or the refusal's message. Name ``seq2seq/lengths``: :class:`Seq2Seq` given
    a source half as long as its target."""
    from plait.runtime import init

    torch.set_num_threads(1)
    out: list[dict[str, Any]] = []
    for name, plan in jobs:
        run = init(plan, quiet=True, seed=0)
        batch = long_target_batch if name.endswith("/lengths") else pair_batch
        try:
            model = run.parallelize(sequence_model(name.split("/")[0]))
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            losses = [float(run.step(model, _slice(batch(s), run.dp_rank, run.dp_size),
                                     lm_loss, opt)) for s in range(STEPS)]
        except ValueError as exc:
            out.append({"plan": plan, "name": name, "refused": str(exc)})
            run.close()
            continue
        state = run.full_state_dict(model)
        run.close()
        out.append({"plan": plan, "name": name, "losses": losses,
                    "state": state if rank == 0 else None})
    return out


def long_target_batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """:func:`pair_batch` with a source half as long as the target."""
    inputs, labels = pair_batch(step)
    return {"src": inputs["src"][:, :SEQ // 2], "tgt": inputs["tgt"]}, labels



# ------------------------------------- transformers' own tp plan, eager attention's weights


def hf_attentions(rank: int, world_size: int, plan: str) -> dict[str, Any]:
    """A tiny Hugging Face Llama built with ``attn_implementation="eager"`` (from a config, no
    download) laid out under ``plan``: its shipped plan's ``head_outputs`` (and its SDPA
    form's), what a forward with ``output_attentions=True`` returns as each layer's attention
    weights (their shapes, None where it returns None), and the hidden states' largest
    difference from one device's."""
    from plait.parallel.tp_plans import shipped_plan
    from plait.runtime import init
    from tests._workers_cp import hf_llama, lm_batch

    torch.set_num_threads(1)
    ids = lm_batch(0)[0]
    with torch.no_grad():
        want = hf_llama("eager")(ids, output_attentions=True, output_hidden_states=True)
    run = init(plan, quiet=True, seed=0)
    model = run.parallelize(hf_llama("eager"))
    with torch.no_grad():
        got = model(ids, output_attentions=True, output_hidden_states=True)
    run.close()
    eager, sdpa = shipped_plan(hf_llama("eager")), shipped_plan(hf_llama())
    return {"head_outputs": eager.head_outputs if eager is not None else None,
            "sdpa_head_outputs": sdpa.head_outputs if sdpa is not None else None,
            "attentions": [None if a is None else tuple(a.shape) for a in got.attentions],
            "one_device": [tuple(a.shape) for a in want.attentions],
            "hidden": max(float((g - w).abs().max()) for g, w in zip(
                got.hidden_states, want.hidden_states, strict=True))}
