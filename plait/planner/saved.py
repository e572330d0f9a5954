"""What one block saves for backward, measured by running it rather than read off names.

The activation formula (:func:`plait.planner.memory.activation_bytes_per_block`) counts the
tensors a textbook block saves. A block as users write it saves what its ops save: an
activation called as a function (``torch.tanh`` saves only its output, ``x *
torch.sigmoid(x)`` its input and the sigmoid besides), a norm written as Python ops (its
normalized copy), and under autocast over fp32 weights, the fp32 residual stream at every
norm's input and one bf16 copy of a shared input per Linear that reads it (autocast casts
each call's input anew: separate q, k and v projections save three). This module runs the
block alone under ``torch.autograd.graph.saved_tensors_hooks`` (on zeros, or fake tensors
for a large block; bf16: under CPU autocast) and reports:

* the ffn-wide tensors it saves (fp32), which say what its activation saves besides its
  output (:attr:`plait.planner.model_stats.ModelStats.act_saved`);
* the bytes per token it saves, fp32 and under bf16 autocast, attention's (seq x seq)
  scores aside: the formula's figure plus what it misses;
* the bytes its (seq x seq) scores take per query and key, all heads, in each dtype (a
  softmax in fp32 under autocast where an fp32 bias was added to the scores, a dropout mask
  of one byte), which the formula prices where attention is not flash.

The block runs with the arguments the model's own forward hands it (a transformers decoder
layer's rotary ``position_embeddings``, its attention mask in the dtype the model makes it,
its position ids), its hidden states swapped for the measured input; a block whose model
does not run on token ids, on its (rows, seq, hidden) input alone. Each figure is the
difference between forwards on four rows and on two, per row, so what a forward saves once
whatever the batch (autocast's bf16 copies of the weights, a rotary table, a causal mask)
cancels. A block that runs neither way is not measured (None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Tokens per row of the measured forwards: odd and small, so that no tensor saved is
# mistaken for an ffn-wide one, or a (seq x seq) score, by its dims.
SEQ = 7
# Rows of the two measured forwards: a figure is their difference, per row. Two and four,
# not one and two: a reshape of one row's tensor can be a view where that of several rows
# copies (GPT-2's query split off its fused projection), which a difference from one row
# would miss.
ROWS = (2, 4)
# Tokens of the other stack (an encoder's source) in the measured forwards of a block whose
# cross-attention reads it, where the model takes each stack's ids by name: two lengths, odd,
# small and not SEQ, so that what scales with them is told from what scales with SEQ.
SIDE = (5, 11)
# Elements (parameters and buffers) of a block measured on real tensors: 64 MiB in fp32.
REAL_LIMIT = 1 << 24


@dataclass(frozen=True)
class BlockSaved:
    """What one block saves for backward per token, measured (:func:`measure`)."""

    ffn_wide: int            # distinct ffn-wide tensors saved (fp32)
    fp32: float              # bytes per token besides attention's scores, fp32
    bf16: float              # the same under bf16 autocast over fp32 weights
    scores: tuple[float, float]  # bytes of the scores per query and key (fp32, bf16)
    # a block whose cross-attention reads another stack measured at other lengths of it: the
    # bytes per token of that stack (fp32, bf16), and those of the cross-attention's scores
    # per query and key (``scores`` then the self-attention's); None: not told apart
    side: tuple[float, float] | None = None
    cross_scores: tuple[float, float] | None = None


@dataclass
class _Forward:
    """What one measured forward saved: bytes of the distinct non-parameter storages, scores
    aside; of those, ffn-wide tensors; bytes of the self-attention's (seq x seq) scores and
    of the cross-attention's (seq x other); the other stack's length it ran with."""

    saved: int = 0
    wide: int = 0
    scores: int = 0
    cross: int = 0
    other: int = SEQ


class _ReachedError(Exception):
    """Raised in the block's pre-hook: the model's forward has made the block's inputs."""


def _inputs(model: Any, block: Any, rows: int, hidden: int, bf16: bool,
            other: int | None = None
            ) -> tuple[tuple[Any, ...], dict[str, Any], int] | None:
    """The arguments ``model``'s own forward on ``rows`` x :data:`SEQ` token ids of zeros
    (as its one argument, else as each of its ``*input_ids``: an encoder-decoder's source
    and target) hands ``block`` (its first call), under CPU bf16 autocast with ``bf16``: a
    decoder layer's rotary ``position_embeddings``, its attention mask in the dtype the model
    makes it (an fp32 mask added to bf16 scores makes the softmax fp32), its position ids, a
    decoder block's encoder hidden states and position bias; the forward stops there, and
    the length the other stack ran on comes third. With ``other``, first each of the
    ``*input_ids`` in turn, the last first (a decoder's, named after its source's), of
    :data:`SEQ` tokens and the rest of ``other`` (the block's own stack on :data:`SEQ`, the
    stack it reads on ``other``). ``use_cache=False`` where the
    forward takes it (no key/value cache kept). Every parameter and buffer a zero expanded to
    its shape: no memory, whatever the embedding's size. None where the forward does not
    reach ``block`` so, with its first tensor argument its (rows, seq, hidden) input."""
    import inspect

    import torch
    from torch.func import functional_call

    state = {k: torch.zeros((), dtype=t.dtype).expand(t.shape)
             for k, t in (*model.named_parameters(), *model.named_buffers())}
    got: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def reached(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        got.append((args, kwargs))
        raise _ReachedError

    ids = torch.zeros(rows, SEQ, dtype=torch.long)
    try:
        takes = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    extra = {"use_cache": False} if "use_cache" in takes else {}
    # the ids as the one argument; else, for a forward that needs more (an encoder-decoder's
    # ``forward(input_ids, decoder_input_ids)``), every input Hugging Face names ``*input_ids``
    names = [n for n in takes if n.endswith("input_ids")]
    calls: list[tuple[tuple[Any, ...], dict[str, Any], int]] = []
    if other is not None and len(names) > 1:
        short = torch.zeros(rows, other, dtype=torch.long)
        calls += [((), {**{n: ids if n == own else short for n in names}, **extra}, other)
                  for own in reversed(names)]
    calls.append(((ids,), extra, SEQ))
    if len(names) > 1:
        calls.append(((), {**dict.fromkeys(names, ids), **extra}, SEQ))
    handle = block.register_forward_pre_hook(reached, with_kwargs=True)
    try:
        for args, kwargs, length in calls:
            got.clear()
            try:
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16,
                                                     enabled=bf16):
                    functional_call(model, state, args, kwargs)
            except _ReachedError:
                pass
            except Exception:  # noqa: BLE001 - a model that does not run on these inputs
                continue
            if not got:
                continue
            made = got[0]
            first = next((a for a in (*made[0], *made[1].values())
                          if isinstance(a, torch.Tensor)), None)
            if first is not None and tuple(first.shape) == (rows, SEQ, hidden):
                return made[0], made[1], length
    finally:
        handle.remove()
    return None


def _forward(block: Any, state: dict[str, Any], hidden: int, ffn: int, rows: int,
             bf16: bool, model: Any = None, side: bool = False, other: int | None = None
             ) -> _Forward:
    """What one forward of ``block`` on a ``rows`` x :data:`SEQ` x ``hidden`` input of
    zeros saves (:class:`_Forward`), ``state`` its tensors; ``bf16``: under CPU bf16
    autocast. With ``model``, the block's other arguments are those the model's forward hands
    it (:func:`_inputs`, the other stack on ``other`` tokens where the model takes each
    stack's ids), where it runs so; else the input alone. With ``side`` (a block whose
    cross-attention reads another stack's output), a ``hidden``-wide tensor it is handed
    besides its input is that output: one tensor every block of the stack reads, priced once
    beside the blocks (:func:`plait.planner.memory.side_input_bytes`), so its storage is not
    counted here (a copy of it the block makes, autocast's cast per Linear reading it, is)."""
    import torch
    from torch.func import functional_call
    from torch.multiprocessing.reductions import StorageWeakRef

    params = {StorageWeakRef(p.untyped_storage()) for p in state.values()}
    saved: dict[Any, int] = {}
    scores: dict[Any, int] = {}
    cross: dict[Any, int] = {}
    wide: set[Any] = set()
    out = _Forward()

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref in params:
            return t
        if t.dim() >= 2 and t.shape[-1] == t.shape[-2] == SEQ:
            scores[ref] = t.untyped_storage().nbytes()
            return t
        if t.dim() >= 2 and out.other != SEQ and tuple(t.shape[-2:]) == (SEQ, out.other):
            cross[ref] = t.untyped_storage().nbytes()
            return t
        saved[ref] = t.untyped_storage().nbytes()
        if t.dim() and t.shape[-1] == ffn and t.numel() == rows * SEQ * ffn:
            wide.add(ref)
        return t

    # not a leaf, as a block's input is in a model: autocast caches its bf16 cast of a leaf
    # that needs a gradient (a weight's), which a post-norm block's q, k and v would share
    x = torch.zeros(rows, SEQ, hidden).requires_grad_().clone()
    args: tuple[Any, ...] = (x,)
    kwargs: dict[str, Any] = {}
    made = None if model is None else _inputs(model, block, rows, hidden, bf16, other)
    if made is not None:  # the model's own arguments, its hidden states swapped for x
        first = next(a for a in (*made[0], *made[1].values()) if isinstance(a, torch.Tensor))
        args = tuple(x if a is first else a for a in made[0])
        kwargs = {k: x if v is first else v for k, v in made[1].items()}
        out.other = made[2]
        if side:
            params |= {StorageWeakRef(a.untyped_storage())
                       for a in (*made[0], *made[1].values())
                       if isinstance(a, torch.Tensor) and a is not first and a.dim() >= 2
                       and a.shape[-1] == hidden}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        functional_call(block, state, args, kwargs)
    out.saved, out.wide = sum(saved.values()), len(wide)
    out.scores, out.cross = sum(scores.values()), sum(cross.values())
    return out


def measure(block: Any, hidden: int, ffn: int, model: Any = None, side: bool = False
            ) -> BlockSaved | None:
    """What ``block`` (one of ``model``'s, where given) saves per token (:class:`BlockSaved`),
    ``side``: its cross-attention reads another stack's output, which it is handed with the
    other arguments the model's forward makes (the encoder's hidden states, its mask, a
    position bias), that output's own storage left out (:func:`_forward`), on two lengths of
    the other stack (:data:`SIDE`) where the model takes each stack's ids by name, telling
    what scales with its tokens (``side``, ``cross_scores``) from what scales with the
    block's own; else on :data:`SEQ` of them, all per token of the block's own;
    in training mode (its dropout masks saved, the global random state untouched), its own
    modes restored after; None where it cannot be measured so, or where it holds hooks or
    DTensors (a block already laid out, whose forward would run them). A block of up to
    :data:`REAL_LIMIT` elements runs on real CPU tensors of zeros (a meta tensor's ops
    include torch's Python references, and ``FakeTensorMode``, both of which import
    torch._dynamo: seconds of a ``plait plan``); a larger one on fake CPU tensors, which
    hold no memory."""
    import contextlib

    import torch

    from .._torch_compat import fake_tensor_mode

    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in block.modules())
    if hooked or any(type(p) is not torch.nn.Parameter for p in block.parameters()):
        return None  # laid out already (FSDP2's or TP's hooks, DTensors): not run here
    modes = [(m, m.training) for m in block.modules()]
    size = sum(t.numel() for t in (*block.parameters(), *block.buffers()))
    try:
        block.train()
        with torch.random.fork_rng(devices=[]), contextlib.nullcontext() \
                if size <= REAL_LIMIT else fake_tensor_mode()():
            # every weight trained, as the formula prices a block (a frozen Linear saves
            # no input for its weight's gradient)
            state = {k: torch.zeros(p.shape, dtype=p.dtype).requires_grad_(
                p.is_floating_point()) for k, p in block.named_parameters()}
            state.update({k: torch.zeros(b.shape, dtype=b.dtype)
                          for k, b in block.named_buffers()})
            # per dtype, per length of the other stack (a cross-attention block's), per rows
            runs = [[[_forward(block, state, hidden, ffn, r, bf16, model, side, other)
                      for r in ROWS] for other in (SIDE if side else (None,))]
                    for bf16 in (False, True)]
    except Exception:  # noqa: BLE001 - a block that does not run alone is not measured
        return None
    finally:
        for m, mode in modes:
            m.training = mode
    fp32 = runs[0][0]
    if fp32[1].saved <= fp32[0].saved:
        return None  # nothing grows with the rows: not a (rows, seq, hidden) block
    per = ROWS[1] - ROWS[0]  # rows between the two forwards

    def row(f: list[_Forward], what: str) -> float:  # bytes per row of ``what``
        return float(getattr(f[1], what) - getattr(f[0], what)) / per

    others = [f[0].other for f in runs[0]]
    if len(others) < 2 or others[0] == others[1]:  # the other stack as long as this one
        return BlockSaved(ffn_wide=fp32[0].wide, fp32=row(fp32, "saved") / SEQ,
                          bf16=row(runs[1][0], "saved") / SEQ,
                          scores=(row(fp32, "scores") / SEQ ** 2,
                                  row(runs[1][0], "scores") / SEQ ** 2))
    # bytes per row = own x SEQ + side x other: two lengths of the other stack tell them apart
    span = others[1] - others[0]
    side_bytes = [(row(d[1], "saved") - row(d[0], "saved")) / span for d in runs]
    own = [(row(d[0], "saved") - b * others[0]) / SEQ for d, b in zip(runs, side_bytes,
                                                                        strict=True)]
    return BlockSaved(ffn_wide=fp32[0].wide, fp32=own[0], bf16=own[1],
                      scores=(row(fp32, "scores") / SEQ ** 2,
                              row(runs[1][0], "scores") / SEQ ** 2),
                      side=(side_bytes[0], side_bytes[1]),
                      cross_scores=(row(fp32, "cross") / (SEQ * others[0]),
                                    row(runs[1][0], "cross") / (SEQ * others[0])))
