"""Models written for tests/test_sp_shapes.py: shapes of model whose tensor + sequence
parallelism plait must get right or refuse clearly.

``TupleResidualLM``: blocks that return ``(branch, attention output)`` as many Hugging Face
layers return a tuple, the residual added by the model's forward (``h = h + layer(h)[0]``);
``TupleResidualTowers``: the two towers of :mod:`tests._workers_tp_encdec` with such an image
tower. Sequence parallelism must refuse both (the residual meets a whole sequence and a split
one); a pipeline must add zero for a block another stage holds, not its input again.
``PatchViT``: convolution stems whose forward's input is not ``pixel_values``.
``plain_seq2seq``: an encoder-decoder whose stacks the planner reads (alike blocks), trained
with the ledger on sequences of two lengths (``seq2seq_ledger``), as two towers are
(``towers_ledger``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import _workers_tp_encdec as T
from tests._workers_beyond import _one_device, _optimizer, _state
from tests._workers_semantics import PositionwiseBlock

VOCAB, WIDTH, BATCH, SEQ, STEPS, CLASSES = T.VOCAB, T.WIDTH, 4, 8, 3, 5


@dataclass
class LayerOutput:
    """A block's output read by attribute (``out.last_hidden_state``), as a ModelOutput is."""

    last_hidden_state: torch.Tensor
    attention: torch.Tensor


class BranchBlock(T.Block):
    """Pre-norm attention and MLP returning the branch only, with the attention output beside
    it: ``(branch, attention)``; ``form`` "dict" returns ``{"hidden_states": branch, ...}``,
    "attr" a :class:`LayerOutput`. Parameters named as :class:`tests._workers_tp_encdec.Block`'s."""

    def __init__(self, form: str = "tuple") -> None:
        super().__init__(False, False, False)
        self.form = form

    def forward(self, h: torch.Tensor) -> Any:  # type: ignore[override]
        a = self.attn(self.norm_1(h))[0]
        branch = a + self.ff(self.norm_2(h + a))
        if self.form == "dict":
            return {"hidden_states": branch, "attention": a}
        if self.form == "attr":
            return LayerOutput(branch, a)
        return branch, a


def _branch(out: Any) -> torch.Tensor:
    """The hidden states a :class:`BranchBlock` returned, read as its form is read."""
    if isinstance(out, dict):
        return out["hidden_states"]
    if isinstance(out, LayerOutput):
        return out.last_hidden_state
    return out[0]


class TupleResidualLM(nn.Module):
    """An embedding, blocks whose residual the forward adds (``h = h + layer(h)[0]``), a norm
    and a head."""

    def __init__(self, form: str = "tuple") -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(BranchBlock(form) for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids)
        for layer in self.layers:
            h = h + _branch(layer(h))
        return self.head(self.norm(h))


def tuple_residual_lm(form: str = "tuple") -> nn.Module:
    torch.manual_seed(0)
    return TupleResidualLM(form)


class AuxSummingLM(TupleResidualLM):
    """Blocks returning ``{"hidden_states": branch, "attention": ...}``: the forward takes the
    hidden states as they come (halved, no residual) and sums the attention outputs' means over
    the blocks (an auxiliary term, added to the logits)."""

    def __init__(self) -> None:
        super().__init__("dict")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids)
        aux = torch.zeros(())
        for layer in self.layers:
            out = layer(h)
            h = out["hidden_states"] * 0.5
            aux = aux + out["attention"].mean()
        return self.head(self.norm(h)) + aux


def aux_summing_lm() -> nn.Module:
    torch.manual_seed(0)
    return AuxSummingLM()


class TupleResidualTower(T.Tower):
    """A tower adding its blocks' first outputs to their inputs itself, in a forward torch.fx
    cannot trace (it branches on the input's rank): found by running it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BranchBlock() for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.dim() == 2:
            h = h.unsqueeze(0)
        for layer in self.layers:
            h = h + layer(h)[0]
        return self.norm(h)[:, 0]


def tuple_residual_towers() -> nn.Module:
    """:func:`tests._workers_tp_encdec.towers` with the image tower a
    :class:`TupleResidualTower`; the text tower's blocks hold their residuals."""
    model = T.towers()
    model.vision_model = TupleResidualTower()
    return model


class PatchViT(nn.Module):
    """A convolution stem cutting 32x32 images into 16 patches of 8x8, a position table per
    patch, two transformer blocks over the patches, a class head on their mean. The forward's
    input is not called ``pixel_values``. ``table``: "embedding", an ``nn.Embedding`` of
    ``patches`` rows indexed by patch (it makes the guessed input token ids, and runs on fake
    tensors of any image size); "parameter", an ``nn.Parameter`` of 16 rows added to the
    patches, with the head registered before the stem (the first Linear makes the guess
    features). ``traced``: blocks torch.fx traces (else their attention branches on its
    input's rank, so that plait records them from a forward on the guessed input)."""

    def __init__(self, table: str, patches: int = 16, traced: bool = False) -> None:
        super().__init__()
        if table == "parameter":
            self.head = nn.Linear(WIDTH, CLASSES)
        self.stem = nn.Conv2d(3, WIDTH, 8, stride=8)
        if table == "embedding":
            self.pos = nn.Embedding(patches, WIDTH)
        else:
            self.pos_table = nn.Parameter(torch.randn(1, patches, WIDTH) * 0.1)
        self.traced = traced
        self.layers = nn.ModuleList(PositionwiseBlock() if traced else
                                    T.Block(False, False, False) for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        if table != "parameter":
            self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.stem(images).flatten(2).transpose(1, 2)
        if hasattr(self, "pos"):
            h = h + self.pos(torch.arange(h.shape[1]))
        else:
            h = h + self.pos_table
        for layer in self.layers:
            h = layer(h) if self.traced else layer(h, None)[0]
        return self.head(self.norm(h).mean(1))


def embedded_positions_vit() -> nn.Module:
    torch.manual_seed(0)
    return PatchViT("embedding")


def head_first_vit() -> nn.Module:
    torch.manual_seed(0)
    return PatchViT("parameter")


def odd_sized_vit(traced: bool) -> nn.Module:
    """A table of 25 patches: 40x40 images, a size plait does not try."""
    torch.manual_seed(0)
    return PatchViT("parameter", patches=25, traced=traced)


def image_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(600 + step)
    return (torch.randn(BATCH, 3, 32, 32, generator=g),
            torch.randint(0, CLASSES, (BATCH,), generator=g))


class PlainStack(T.Stack):
    """:class:`tests._workers_tp_encdec.Stack` whose blocks are alike (no relative position
    bias in block 0): a stack the planner reads."""

    def __init__(self, cross: bool) -> None:
        super().__init__(cross, False)
        self.block = nn.ModuleList(T.Block(False, cross, False) for _ in range(2))


def plain_seq2seq() -> nn.Module:
    """The encoder-decoder of :mod:`tests._workers_tp_encdec` (a shared embedding tied to the
    head, cross-attention) with alike blocks in each stack."""
    torch.manual_seed(0)
    model = T.RelBiasSeq2Seq()
    model.encoder, model.decoder = PlainStack(False), PlainStack(True)
    return model


def lm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


MODELS: dict[str, tuple[Any, Any, Any]] = {
    "tuple_residual_lm": (tuple_residual_lm, lm_batch, T.token_loss),
    "embedded_positions_vit": (embedded_positions_vit, image_batch, F.cross_entropy),
    "head_first_vit": (head_first_vit, image_batch, F.cross_entropy),
}


# A norm inside a block: the number of positions it sees (one rank's part under SP).
PROBES = {"embedded_positions_vit": "layers.0.norm_2", "head_first_vit": "layers.1.norm_1"}


def reference(name: str) -> dict[str, Any]:
    """One device, AdamW (weight decay 0.1), STEPS steps, clipping at 1.0 (plait's default)."""
    factory, batch, loss_fn = MODELS[name]

    def step_loss(model: nn.Module, inputs: Any, target: torch.Tensor) -> torch.Tensor:
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        return loss_fn(out, target)
    return _one_device(factory, [batch(step) for step in range(STEPS)], step_loss, "adamw")


def train(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Each (plan, model name) with AdamW, as :func:`reference` trains it; the losses and rank
    0's full state, or the message of a refusal."""
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
        lengths: list[int] = []
        if name in PROBES:
            model.get_submodule(PROBES[name]).register_forward_pre_hook(
                lambda mod, args, seen=lengths: seen.append(args[0].shape[1]))
        opt = _optimizer(model.parameters(), "adamw")
        losses = [float(run.step(model, batch(s), loss_fn, opt)) for s in range(STEPS)]
        state = _state(run, model)
        run.close()
        out.append({"plan": plan, "losses": losses, "state": state if rank == 0 else None,
                    "lengths": lengths})
    return out



SRC, TGT = 48, 16  # the encoder's and the decoder's sequence lengths in the ledger runs


def seq2seq_ledger(rank: int, world_size: int, plan: str) -> dict[str, Any]:
    """:func:`plain_seq2seq` trained 1 + 2 steps (the first not counted) on batches of 4 rows
    of SRC source and TGT target tokens with the ledger on; ``run.summary()["comm"]``."""
    from plait.runtime import init

    torch.set_num_threads(1)
    run = init(plan, quiet=True, ledger=True, seed=0)
    run.ledger_warmup = 1
    try:
        model = run.parallelize(plain_seq2seq())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(5)
        for _ in range(3):
            ids = torch.randint(0, VOCAB, (BATCH, SRC), generator=g)
            target = torch.randint(0, VOCAB, (BATCH, TGT), generator=g)
            run.step(model, ({"input_ids": ids, "decoder_input_ids": target}, target),
                     T.token_loss, opt)
        return dict(run.summary()["comm"])
    finally:
        run.close()


def towers_ledger(rank: int, world_size: int, plan: str) -> dict[str, Any]:
    """:func:`tests._workers_tp_encdec.towers` (a text tower on 6 tokens, an image tower on 4
    patches) trained 1 + 2 steps with the ledger on; ``run.summary()["comm"]``."""
    from plait.runtime import init

    torch.set_num_threads(1)
    run = init(plan, quiet=True, ledger=True, seed=0)
    run.ledger_warmup = 1
    try:
        model = run.parallelize(T.towers())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            run.step(model, T.towers_batch(step), T.clip_loss, opt)
        return dict(run.summary()["comm"])
    finally:
        run.close()
