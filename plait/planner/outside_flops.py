"""Forward FLOPs of what a model runs outside its stacks of blocks, measured.

The per-block formula prices the blocks; what runs around them differs from model to model:
a language model's head (2 x hidden x vocab per token), a ViT's patchify ``Conv2d`` stem and a
classifier on one pooled token, a CNN stem in front of a transformer, a projection before the
stack. None of those is a formula the planner can know, so it is counted: one forward on fake
tensors under ``torch.utils.flop_counter.FlopCounterMode``, less the FLOPs counted inside the
blocks (forward hooks on each block).

The count is split by how it scales: what runs before the main stack makes its tokens (a
stem, an embedding, a projection), so it is priced per token of the stack's sequence; what
runs after it may run per token (a language model's head) or per row (a classifier on a
pooled token). A second forward, whose last block hands on only half its tokens, tells the
two apart: the FLOPs after the stack that drop with the tokens are per token, the rest per
row.

Of those FLOPs, the ones inside the modules a tensor-parallel plan splits outside the blocks
(a vocabulary-parallel head) are counted apart: each tp rank computes 1/tp of them, and the rest
(a patchify convolution, a projection, a classifier the plan leaves whole) whole.

The same two forwards read the output the loss reads (its logits: the output's ``logits``, else
its first floating-point tensor), per token and per row alike: what it holds
(:mod:`plait.planner.logits`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Outside:
    """Forward FLOPs outside the blocks: per token of the main stack's sequence and per row
    (sequence), at any length (a stem per token made, a head per token or per pooled row)."""

    per_token: float
    per_row: float
    # of ``per_token``, what runs before the main stack (a stem, a projection): on a
    # pipeline's first chunk, where the rest runs on its last
    before: float = 0.0
    # of ``per_token`` and ``per_row``, what runs in modules tensor parallelism splits (a
    # vocabulary-parallel head), and of the first, before the main stack
    split_token: float = 0.0
    split_row: float = 0.0
    split_before: float = 0.0

    def per_token_at(self, seq: int) -> float:
        """FLOPs per token at sequence length ``seq``."""
        return self.per_token + self.per_row / seq

    def per_rank_at(self, seq: int, tp: int) -> tuple[float, float]:
        """(FLOPs per token before the main stack, after it) that each of ``tp`` ranks runs at
        sequence length ``seq``: what a split module runs divided by ``tp``, the rest whole."""
        share = 1 - 1 / tp
        before = self.before - self.split_before * share
        split_after = self.split_token - self.split_before + self.split_row / seq
        return before, self.per_token_at(seq) - self.before - split_after * share


@dataclass(frozen=True)
class Output:
    """Elements of the forward's output the loss reads (its logits), per token of the main
    stack's sequence and per row, and its last dim (a head's width)."""

    per_token: float
    per_row: float
    width: int


@dataclass
class _Pass:
    """What one forward counted: FLOPs before the main stack, inside any block, in all, and
    the (rows, tokens per row) the main stack's first block received."""

    before: float = -1.0
    inside: float = 0.0
    total: float = 0.0
    shape: tuple[int, int] | None = None
    split: float = 0.0         # FLOPs in the modules tp splits
    split_before: float = 0.0  # of which, before the main stack
    output: tuple[int, int] = (0, 0)  # (elements, last dim) of the output the loss reads

    @property
    def after(self) -> float:
        return self.total - self.before - self.inside

    @property
    def split_after(self) -> float:
        return self.split - self.split_before


def _cut(out: Any) -> Any:
    """``out`` with its first tensor's dim 1 (the tokens) cut to its first half."""
    import torch

    if isinstance(out, torch.Tensor):
        return out[:, : out.shape[1] // 2]
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (_cut(out[0]), *out[1:])
    raise ValueError(f"a block output of type {type(out).__name__} cannot be cut")


@contextmanager
def _hooks(first: Any, last: Any, blocks: list[Any], counter: Any, got: _Pass,
           cut: bool, split: list[Any]) -> Iterator[None]:
    """Hooks that fill ``got`` from ``counter``: FLOPs inside each of ``blocks``, inside
    each of the ``split`` modules, and before the main stack's ``first`` block; with
    ``cut``, ``last`` hands on half its tokens."""
    entered: list[float] = []
    split_entered: list[float] = []
    handles = []

    def pre(_m: Any, args: tuple, kwargs: dict) -> None:
        entered.append(float(counter.get_total_flops()))

    def post(_m: Any, _args: tuple, _kwargs: dict, _out: Any) -> None:
        got.inside += float(counter.get_total_flops()) - entered.pop()

    def split_pre(_m: Any, _args: tuple) -> None:
        split_entered.append(float(counter.get_total_flops()))

    def split_post(_m: Any, _args: tuple, _out: Any) -> None:
        got.split += float(counter.get_total_flops()) - split_entered.pop()

    def first_pre(_m: Any, args: tuple, kwargs: dict) -> None:
        import torch

        x = args[0] if args else kwargs.get("hidden_states")
        if got.before < 0 and isinstance(x, torch.Tensor) and x.ndim >= 2:
            got.before = float(counter.get_total_flops()) - got.inside
            got.split_before = got.split
            got.shape = (int(x.shape[0]), int(x.shape[1]))

    def last_post(_m: Any, _args: tuple, out: Any) -> Any:
        return _cut(out)

    try:
        handles.append(first.register_forward_pre_hook(first_pre, with_kwargs=True))
        for block in blocks:
            handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(block.register_forward_hook(post, with_kwargs=True))
        for module in split:
            handles.append(module.register_forward_pre_hook(split_pre))
            handles.append(module.register_forward_hook(split_post))
        if cut:
            handles.append(last.register_forward_hook(last_post))
        yield
    finally:
        for h in handles:
            h.remove()


def _on_meta(model: Any) -> bool:
    """Whether ``model``'s parameters are on the meta device (a factory the planner built
    there): its inputs must be too, a fake forward refusing a CPU image beside a meta
    convolution weight."""
    params = list(model.parameters())
    return bool(params) and all(p.is_meta for p in params)


def _count(model: Any, example: Any, first: Any, last: Any, blocks: list[Any],
           cut: bool, split: list[Any]) -> _Pass | None:
    """One forward of ``model`` on fake tensors of ``example``, counted; None where it fails
    or does not reach the main stack."""
    from torch.utils.flop_counter import FlopCounterMode

    from plait.parallel.tp_example import run_on
    from plait.parallel.tp_record import fake_forward

    got = _Pass()
    try:
        with fake_forward(model):
            counter = FlopCounterMode(display=False)
            with counter, _hooks(first, last, blocks, counter, got, cut, split):
                out = run_on(model, example)
            got.total = float(counter.get_total_flops())
            logits = _logits(out)
            if logits is not None:
                got.output = (logits.numel(), int(logits.shape[-1]) if logits.ndim else 1)
    except Exception:  # noqa: BLE001 - a forward that does not run here counts nothing
        return None
    if got.shape is None or got.before < 0:
        return None
    return got


def _logits(out: Any) -> Any:
    """The tensor of a forward's output that the loss reads: the output itself, its
    ``logits`` (a Hugging Face output, a dict), else its first floating-point tensor; None
    where it holds none."""
    import torch

    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, dict) or hasattr(out, "logits"):
        named = out.get("logits") if isinstance(out, dict) else out.logits
        if isinstance(named, torch.Tensor):
            return named
        out = list(out.values()) if isinstance(out, dict) else []
    if isinstance(out, (tuple, list)):
        return next((t for t in map(_logits, out) if t is not None), None)
    return None


def _examples(model: Any, example: Any, guess: Callable[[Any], Any]) -> Iterator[Any]:
    """The inputs to count on, on the model's device: ``example``; without one, the input
    ``guess(model)`` makes, then, for a model on the meta device with a convolution (whose
    guess, images on the CPU, does not run there), meta images of each common size."""
    import torch

    from plait.parallel.tp_example import _SPATIAL, Example, _first_conv, _images

    meta = _on_meta(model)

    def placed(x: Any) -> Any:
        return x.to("meta") if meta and isinstance(x, (Example, torch.Tensor)) else x

    if example is not None:
        yield placed(example)
        return
    guessed = guess(model)
    if guessed is not None:
        yield placed(guessed)
    conv = _first_conv(model)
    if meta and conv is not None:
        for size in _SPATIAL:
            yield _images(conv, size).to("meta")


def measure(model: Any, main: list[Any], others: list[Any], example: Any,
            guess: Callable[[Any], Any], split: list[Any] | None = None
            ) -> tuple[Outside, Output] | None:
    """Forward FLOPs outside the blocks of ``model`` (the main stack's blocks ``main``, the
    further stacks' ``others``), counted on ``example`` (None: the input ``guess(model)``
    makes, or a guessed image size), those inside the ``split`` modules (outside the blocks,
    split by tensor parallelism) apart, and the elements of the output the loss reads;
    None where no forward runs on fake tensors."""
    if not main:
        return None
    blocks, split = [*main, *others], split or []
    full, ran = None, None
    for tried in _examples(model, example, guess):
        full, ran = _count(model, tried, main[0], main[-1], blocks, False, split), tried
        if full is not None:
            break
    if full is None or full.shape is None:
        return None
    rows, seq = full.shape
    before = full.before / (rows * seq)
    split_before = full.split_before / (rows * seq)
    # all per token unless the cut pass says otherwise
    after, split_after = full.after / (rows * seq), full.split_after / (rows * seq)
    half = _count(model, ran, main[0], main[-1], blocks, True, split) if seq >= 2 else None
    # the output all per token unless the cut pass says otherwise
    output = Output(full.output[0] / (rows * seq), 0.0, full.output[1])
    if half is not None and half.before == full.before:
        dropped = seq - seq // 2
        token = (full.after - half.after) / (rows * dropped)
        row = full.after / rows - token * seq
        split_token = (full.split_after - half.split_after) / (rows * dropped)
        split_row = full.split_after / rows - split_token * seq
        out_token = (full.output[0] - half.output[0]) / (rows * dropped)
        out_row = full.output[0] / rows - out_token * seq
        if out_token >= 0 and out_row >= 0:
            output = Output(out_token, out_row, full.output[1])
        if token >= 0 and row >= 0 and split_token >= 0 and split_row >= 0:
            return Outside(before + token, row, before, split_before + split_token,
                           split_row, split_before), output
    return (Outside(before + after, 0.0, before, split_before + split_after, 0.0,
                    split_before), output)
