"""Models, a measurement and a worker for tests/test_planner_logits.py: what torch holds for
a model's logits and its loss at the memory peak, beside the planner's logits term.

The models share tests/_workers_tp_outside.py's blocks (attention as matmuls, a GELU MLP),
with a vocabulary of :data:`VOCAB`, so that the logits (and their shards at tp=2) are as
large as no other tensor the head and the loss make: a language model with its head tied to
the embedding, one whose head sits beside a logits bias (BART's ``final_logits_bias``: the
plan leaves it whole), a vocabulary-wide classifier on the mean-pooled token, and a ViT
classifier (no vocabulary at all)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests._workers_tp_outside import WIDTH, Block, PatchViT

VOCAB, LAYERS, ROWS, SEQ = 96, 2, 2, 10


class TiedLM(nn.Module):
    """Token embedding, blocks, final norm, a head tied to the embedding."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class BiasedLM(TiedLM):
    """:class:`TiedLM` untied, its logits given a bias the model holds (BART's
    ``final_logits_bias``): logits split over the vocabulary could not take it, so the plan
    leaves the head whole."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__(vocab)
        self.head = nn.Linear(WIDTH, vocab, bias=False)
        self.register_buffer("final_logits_bias", torch.zeros(1, vocab))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) + self.final_logits_bias


class PooledVocab(TiedLM):
    """:class:`TiedLM` untied, its vocabulary-wide head on the mean-pooled token: one row of
    logits per sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


MODELS = {"tied_lm": TiedLM, "biased_lm": BiasedLM, "pooled_vocab": PooledVocab,
          "vit": PatchViT}


def seq(name: str) -> int:
    """Tokens per row of model ``name``'s :func:`batch`: a ViT's 16 patches, else
    :data:`SEQ` (20 tokens in all: no tensor of the head's or the loss's is as large as the
    logits but theirs)."""
    return 16 if name == "vit" else SEQ


def batch(name: str, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, class labels) for model ``name``: :func:`seq` tokens per row, a label per
    token for a language model, per row for the others."""
    g = torch.Generator().manual_seed(0)
    if name == "vit":
        return torch.randn(rows, 3, 16, 16, generator=g), torch.randint(0, 10, (rows,),
                                                                          generator=g)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (rows,) if name == "pooled_vocab" else (rows, SEQ),
                           generator=g)
    return ids, labels


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class Held:
    """What torch held for the logits of one forward, loss and backward: their elements on
    this rank; the bytes autograd saved of tensors that size (the loss's log-softmax output);
    the bytes of the logits themselves; the most bytes of tensors that size live at once, as
    the CPU allocator saw them."""

    elements: int
    saved: int
    logits: int
    peak: int


def _peak(events: list[Any], sizes: set[int]) -> int:
    """The most bytes live at once in the allocations of ``sizes`` bytes among the
    profiler's memory ``events`` (each an allocation, or a free with negative bytes)."""
    live = top = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        if abs(e.nbytes()) in sizes:
            live += e.nbytes()
            top = max(top, live)
    return top


def held(model: nn.Module, x: torch.Tensor, labels: torch.Tensor, *, bf16: bool = False,
         keep: bool = False) -> Held:
    """What torch holds for the logits of ``model`` on ``x`` (:class:`Held`), over one
    forward, a cross-entropy
    against ``labels`` and its backward, under CPU bf16 autocast with ``bf16``. ``keep``: the
    logits stay referenced until the backward ends (a pipeline's schedule keeps its last
    stage's output until that microbatch's backward); else dropped once the loss is made (a
    train step without a pipeline). The allocations are the CPU allocator's, read by
    ``torch.profiler`` (``profile_memory``: every op's, those inside a DTensor's own ops
    too), of the logits' size (in 2 or 4 bytes an element: the models' sizes make no other
    tensor that large); the saved storages are those ``saved_tensors_hooks`` sees autograd
    save between the main stack's last block's output and the backward's return to it, as
    tests/_planner_idioms.py's ``measured_block`` reads a block's. Run on every tp rank alike
    where ``model`` is laid out."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, tuple[int, int]] = {}
    window: list[bool] = []

    def start(_m: Any, _args: Any, out: torch.Tensor) -> None:
        window.append(True)
        out.register_hook(lambda _grad: window.clear())

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = _local(t)
        if window and local.untyped_storage().data_ptr() not in params:
            saved[local.untyped_storage().data_ptr()] = (local.numel(),
                                                         local.untyped_storage().nbytes())
        return t

    handle = list(model.blocks)[-1].register_forward_hook(start)
    model.train()
    try:
        with prof, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(x)
                loss = F.cross_entropy(out.flatten(0, -2), labels.flatten())
            local = _local(out)
            elements, nbytes = local.numel(), local.untyped_storage().nbytes()
            if not keep:
                del out, local
            loss.backward()
    finally:
        handle.remove()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return Held(elements, sum(b for n, b in saved.values() if n == elements), nbytes,
                _peak(events, {2 * elements, 4 * elements}))


def tp_held(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    """Each model of :data:`MODELS` laid out with ``tp=world_size`` (plait's inferred plan),
    one forward, cross-entropy and backward under its loss context (``loss_parallel()`` for
    a vocabulary-split head), fp32: :func:`held` on this rank."""
    from plait.runtime import init
    from plait.train import loss_context

    torch.manual_seed(0)
    run = init(f"tp={world_size}", seed=0, quiet=True)
    out: dict[str, dict[str, int]] = {}
    for name, factory in MODELS.items():
        model = run.parallelize(factory())
        x, labels = batch(name)
        with loss_context(model):
            got = held(model, x, labels)
        out[name] = {"elements": got.elements, "saved": got.saved, "peak": got.peak}
    run.close()
    return out


def _loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), labels.flatten())


# The vocabulary of the pipelined model: logits large enough that its last stage, not its
# first (more microbatches' activations in flight under 1F1B), holds the most.
PP_VOCAB = 480


def pp_held(rank: int, world_size: int, plans: list[str]) -> dict[str, dict[str, int]]:
    """:class:`BiasedLM` of :data:`PP_VOCAB` laid out with each of ``plans`` (a pipeline of
    ``world_size`` stages, microbatches of one row each), one ``run.step`` (fp32): on the
    last stage, the elements of one microbatch's logits and the most bytes of tensors that
    size live at once (the CPU allocator's, as :func:`held`); empty on the other stages."""
    from torch.profiler import ProfilerActivity, profile

    from plait.plan import Plan
    from plait.runtime import init

    out: dict[str, dict[str, int]] = {}
    for plan in plans:
        torch.manual_seed(0)
        run = init(plan, seed=0, quiet=True)
        model = run.parallelize(BiasedLM(PP_VOCAB))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        g = torch.Generator().manual_seed(0)
        rows = Plan.from_string(plan).microbatches
        x, labels = (torch.randint(0, PP_VOCAB, (rows, SEQ), generator=g) for _ in "xy")
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with prof:
            run.step(model, (x, labels), _loss, opt)
        run.close()
        if rank == world_size - 1:
            elements = SEQ * PP_VOCAB  # one row's logits
            events = [e for e in prof.profiler.kineto_results.events()
                      if e.name() == "[memory]"]
            out[plan] = {"elements": elements,
                         "peak": _peak(events, {2 * elements, 4 * elements})}
    return out
