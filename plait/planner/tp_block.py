"""Which tensor-parallel collectives one block of a user's model issues, read off the layer plan
plait lays it out with (the plan a transformers model ships, else the one inferred from the
model's structure), so the planner prices the block the runtime builds rather than plait's
reference block (attention + MLP: 4 all-reduces). An MLP-only block issues 2, a LoRA layer adds
the all-reduces of its low-rank path, a fused q|k|v bias an all-gather of its gradient. The same
plan says which parameters each rank holds whole (norms, row-parallel biases) and, with their
``requires_grad``, which it reduces over data parallelism (``Held``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from math import prod
from typing import TYPE_CHECKING, Any

from plait.comm.predict import TPBlock

if TYPE_CHECKING:
    import torch.nn as nn

# Tokens per sequence of the traced forward pass: any length the model accepts will do
TRACE_SEQ = 4


@dataclass(frozen=True)
class Held:
    """Parameter elements split over tp (``split``) or kept whole on every rank (``whole``:
    norms, row-parallel biases, low-rank paths), the trainable ones among each, and the
    number of trainable tensors (gradient clipping reduces one norm each)."""

    split: float = 0.0
    whole: float = 0.0
    split_trained: float = 0.0
    whole_trained: float = 0.0
    trained_tensors: float = 0.0

    def local(self, tp: int) -> float:
        """Elements one rank holds at ``tp``."""
        return self.split / tp + self.whole

    def grads(self, tp: int) -> float:
        """Gradient elements one rank reduces over data parallelism at ``tp``."""
        return self.split_trained / tp + self.whole_trained


# Styles whose collectives TPBlock describes; a plan with any other style in the block
# (colwise_gather, rowwise_split, replicated_kv named by hand) is priced as the reference block.
_KNOWN = {"colwise", "colwise_qkv", "rowwise", "region", "sequence_parallel", "grad_allreduce"}


def plan_of(model: nn.Module, example: Any = None) -> tuple[Any, bool] | None:
    """plait's layer plan for ``model`` and whether it ships (transformers, plait's reference)
    rather than being inferred (on ``example``, the user's input, where fx cannot trace a
    block); None where inference refuses."""
    from plait.parallel.tp_infer import infer_plan
    from plait.parallel.tp_plans import shipped_plan

    try:
        shipped = shipped_plan(model)
        return (shipped, True) if shipped is not None else (infer_plan(model, example), False)
    except Exception:  # noqa: BLE001 - no plan: the planner prices the reference block
        return None


# Styles whose module's weight tensor parallelism splits, and those whose bias it splits too.
_SPLIT_WEIGHT = {"colwise", "colwise_qkv", "rowwise", "vocab_embedding", "vocab_head"}
_SPLIT_BIAS = {"colwise"}


def split_dim(module: nn.Module, kind: str, style: str | None) -> int | None:
    """The dim of ``module``'s parameter ``kind`` ("weight", "bias") that tensor parallelism
    splits under ``style`` (``plait.parallel.tensor``), or None where it keeps it whole: a
    column-parallel layer's output features (dim 1 of an HF Conv1D weight, stored (in, out)),
    a row-parallel layer's input features (dim 0 of a Conv1D weight), a vocabulary-parallel
    embedding's rows, a column-parallel embedding's columns (torch's ``ColwiseParallel`` on an
    ``nn.Embedding``: a relative position bias, one column per head)."""
    import torch.nn as nn

    from .model_stats import _dims

    if style not in _SPLIT_WEIGHT or (kind != "weight" and style not in _SPLIT_BIAS):
        return None
    conv = kind == "weight" and _dims(module) is not None and not isinstance(module, nn.Linear)
    if style == "rowwise" and isinstance(module, nn.Linear):
        return 1
    if style in ("colwise", "colwise_qkv", "vocab_head"):
        return 1 if conv or (style == "colwise" and isinstance(module, nn.Embedding)) else 0
    return 0  # rowwise Conv1D weight, an embedding's rows


def held_parts(model: nn.Module, stack: str, found: tuple[Any, bool] | None
               ) -> tuple[Held, Held, Held] | None:
    """How tensor parallelism lays out the parameters of one block of the stack at ``stack``
    (their mean over the blocks), of the embeddings and of the rest outside the stack (final
    norm, head): elements split over tp or kept whole, trainable or not. None where plait has
    no layer plan for the model (``found``: :func:`plan_of` the model)."""
    import torch.nn as nn

    from plait.parallel.tp_plans import glob_regex

    if found is None:
        return None
    patterns = [(glob_regex(g), style) for g, style in found[0].styles.items()]
    embeds = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
              for p in m.parameters()}
    parts: list[list[int]] = [[0] * 5 for _ in range(3)]  # split, whole, trained x2, tensors
    blocks = len(model.get_submodule(stack)) if stack else 1  # type: ignore[arg-type]
    for name, p in model.named_parameters():
        owner, _, kind = name.rpartition(".")
        style = next((st for regex, st in patterns if regex.match(owner)), None)
        split = split_dim(model.get_submodule(owner), kind, style) is not None
        part = parts[0 if stack and name.startswith(stack + ".") else
                     1 if id(p) in embeds else 2]
        part[0 if split else 1] += p.numel()
        if p.requires_grad:
            part[2 if split else 3] += p.numel()
            part[4] += 1
    block = Held(*(n / blocks for n in parts[0]))
    return block, Held(*parts[1]), Held(*parts[2])


def rows_held(rows: Any) -> tuple[Held, Held, Held]:
    """:func:`held_parts` from a model's ``ParamRows`` (``plait.planner.fsdp_rows``: a
    config's, whose tensors carry the dim its layer plan splits): one block (their mean), the
    embeddings and the rest."""
    def held(tensors: tuple[Any, ...], per: int = 1) -> Held:
        part = [0.0] * 5  # split, whole, trained x2, tensors
        for r in tensors:
            numel = float(prod(r.shape))
            part[0 if r.tp_dim is not None else 1] += numel
            if r.trained:
                part[2 if r.tp_dim is not None else 3] += numel
                part[4] += 1
        return Held(*(n / per for n in part))

    return held(rows.block, max(rows.blocks, 1)), held(rows.embed), held(rows.rest)


def tp_block(model: nn.Module, block: str, found: tuple[Any, bool] | None,
             stack: tuple[str, str] | None = None, device_type: str = "cpu",
             example: Any = None) -> TPBlock | None:
    """The collectives of the block at module path ``block`` of ``model`` (on any device, the
    meta device included), or None where plait has no layer plan for it (inference refuses)
    or the plan uses styles TPBlock does not describe. The first block's input needs a
    gradient unless every embedding is frozen. ``found``: :func:`plan_of` the model;
    ``stack``: the paths of the stack's first and last blocks. The dtypes the collectives
    travel in under bf16 and what a checkpointed block replays are read off a forward pass on
    fake tensors under ``device_type``'s autocast rules (:mod:`plait.planner.tp_trace`), of
    token ids, or of the shapes of ``example`` (the user's input) where one is given."""
    import torch.nn as nn

    from plait.parallel.tp_plans import glob_regex

    from .tp_trace import trace

    if found is None:
        return None
    plan, ships = found
    shipped = plan if ships else None
    # An inferred plan splits the sequence inside the block stack under SP, and sums the
    # gradients of every parameter there that no entry names (plait.parallel.tp_infer).
    in_blocks = bool(plan.sp_blocks) if shipped is not None else True
    summed_unnamed = plan.sp_summed if shipped is not None else True
    patterns = [(glob_regex(g), style) for g, style in plan.styles.items()]

    def style_of(name: str) -> str | None:
        return next((style for regex, style in patterns if regex.match(name)), None)

    side_of = _side_of(plan)
    parts = _collectives(model, block, style_of, summed_unnamed, side_of)
    if parts is None:
        return None
    forward, backward, fwd_at, bwd_at, gathers, norms, summed = parts
    # cross-attention's keys and values: they read another stack's output, whole
    side = tuple(side_of(n) for n in bwd_at)
    embeds = [p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()]
    ends = {key: name for name, _ in model.named_modules()
            for key, want in (("embed", "vocab_embedding"), ("head", "vocab_head"))
            if style_of(name) == want}
    if stack is not None:
        ends.update(first=stack[0], last=stack[1])
    # the norms after the stack that run on sequence shards, read where the sequence is split
    # from the embedding to the head: their trainable tensors' gradients are summed over tp
    within = block.rpartition(".")[0] + "."
    end_norms = tuple(p.numel() for name, m in model.named_modules()
                      if style_of(name) == "sequence_parallel" and not name.startswith(within)
                      for p in m.parameters() if p.requires_grad)
    return TPBlock(forward=tuple(forward), backward=tuple(backward),
                   bias_gathers=tuple(gathers), sp_norms=tuple(norms),
                   summed=tuple(summed), sp_in_blocks=in_blocks,
                   input_grad=any(p.requires_grad for p in embeds) or not embeds,
                   vocab_ends=("embed" in ends, "head" in ends),
                   end_norms=None if in_blocks else end_norms,
                   side=side if any(side) else (),
                   traced=partial(trace, model, block, fwd_at, bwd_at, ends, seq=TRACE_SEQ,
                                  device_type=device_type, example=example))


def _side_of(plan: Any) -> Any:
    """Whether a module path is one of ``plan``'s ``side_inputs``."""
    from plait.parallel.tp_plans import glob_regex

    side = [glob_regex(g) for g in getattr(plan, "side_inputs", ())]
    return lambda name: any(r.match(name) for r in side)


_Parts = tuple[list[int], list[int], list[str], list[str], list[int], list[int], list[int]]


def _collectives(model: nn.Module, block: str, style_of: Any, summed_unnamed: bool,
                 side: Any = lambda name: False) -> _Parts | None:
    """The block at ``block``'s collectives as :class:`TPBlock` counts them (``style_of``:
    a module path's style in the layer plan): features of each row-parallel output and each
    column-parallel or region input, the modules they follow / precede, and the elements of
    the trainable fused q|k|v biases, sequence-parallel norms and gradient-summed parameters
    (their gradients are the ones issued: a frozen tensor has none). None where the plan uses
    a style TPBlock does not describe. ``side``: whether a column-parallel layer inside a
    region reads another input than the region's (``TPPlan.side_inputs``), so all-reduces its
    own."""
    root = model.get_submodule(block)
    styled = {f"{block}.{n}" if n else block: (style_of(f"{block}.{n}" if n else block), m)
              for n, m in root.named_modules()}
    styled = {n: sm for n, sm in styled.items() if sm[0] is not None}
    if any(style not in _KNOWN for style, _ in styled.values()):
        return None
    regions = [n for n, (style, _) in styled.items() if style == "region"]
    forward: list[int] = []
    backward: list[int] = []
    fwd_at: list[str] = []  # the module each collective follows / precedes
    bwd_at: list[str] = []
    gathers: list[int] = []
    norms: list[int] = []
    summed: list[int] = []
    for name, (style, module) in styled.items():
        dims = _in_out(module)
        inside = any(name.startswith(r + ".") for r in regions)
        if style == "rowwise" and dims:
            forward.append(dims[1])
            fwd_at.append(name)
        elif style in ("colwise", "colwise_qkv") and dims and (not inside or side(name)):
            backward.append(dims[0])
            bwd_at.append(name)
        elif style == "region":
            entry = next((_in_out(m) for n, (s, m) in styled.items()
                          if n.startswith(name + ".") and s in ("colwise", "colwise_qkv")
                          and _in_out(m)), None)
            if entry is None:
                return None
            backward.append(entry[0])
            bwd_at.append(name)
        elif style == "sequence_parallel":
            norms += [p.numel() for p in module.parameters() if p.requires_grad]
        elif style == "grad_allreduce":
            summed += [p.numel() for p in module.parameters() if p.requires_grad]
        bias = getattr(module, "bias", None)
        if style == "colwise_qkv" and bias is not None and bias.requires_grad:
            gathers.append(bias.numel())
    if summed_unnamed:  # parameters of modules no entry names (nor one above them)
        for name, module in root.named_modules():
            full = f"{block}.{name}" if name else block
            if not any(full == n or full.startswith(n + ".") for n in styled
                       if styled[n][0] != "region"):
                norms += [p.numel() for p in module.parameters(recurse=False)
                          if p.requires_grad]
    return forward, backward, fwd_at, bwd_at, gathers, norms, summed


@dataclass(frozen=True)
class Flow:
    """Where gradients flow through a stack whose model has frozen parameters
    (:func:`grad_flow`): ``input_grad``, whether the first block's input needs one (None: not
    read); ``block``: the block :func:`tp_block` read with that ``input_grad``; ``blocks``:
    each block's own collectives where the blocks differ in what trains (None: ``block``
    stands for all)."""

    input_grad: bool | None
    block: TPBlock | None
    blocks: tuple[TPBlock, ...] | None = None


def grad_flow(model: nn.Module, blocks: list[str], found: tuple[Any, bool] | None,
              ref: TPBlock | None, device_type: str = "cpu", example: Any = None) -> Flow:
    """Where gradients flow through the stack of blocks at ``blocks`` (module paths, in
    forward order), read off one forward pass on fake tensors with the parameters' own
    ``requires_grad`` (:func:`plait.planner.tp_trace.needs_grad`), run only where some
    parameter of the model is frozen.

    The first block's input needs a gradient where anything before it trains: an embedding,
    or a gain the model's own forward applies to it. A block issues the gradient collectives
    of its own trainable parameters (a frozen norm's gradient is never summed over tp), and
    its backward collectives only where the tensor they act on needs a gradient: a block
    behind frozen ones whose attention is frozen receives gradients in its MLP only. Where the
    pass cannot run, the first block's input needs a gradient where an embedding trains, and
    a block is reached whole or not at all (:func:`plait.comm.reach.reached`). Each block is
    ``ref`` (:func:`tp_block`'s) with those parts replaced, sharing its traced dtypes (the
    blocks are alike)."""
    from plait.comm.reach import reached
    from plait.parallel.tp_plans import glob_regex

    from .tp_trace import needs_grad

    if all(p.requires_grad for p in model.parameters()):
        return Flow(None, ref)
    parts: list[_Parts | None] = []
    if found is not None and ref is not None:
        plan, ships = found
        summed_unnamed = plan.sp_summed if ships else True
        patterns = [(glob_regex(g), style) for g, style in plan.styles.items()]

        def style_of(name: str) -> str | None:
            return next((style for regex, style in patterns if regex.match(name)), None)

        parts = [_collectives(model, b, style_of, summed_unnamed, _side_of(plan))
                 for b in blocks]
        if any(p is None or len(p[0]) != len(ref.forward) or len(p[1]) != len(ref.backward)
               for p in parts):
            parts = []  # blocks of different makes: priced alike, as the first that trains
    got = needs_grad(model, [blocks[0]] + [n for p in parts if p for n in p[3]],
                     [n for p in parts if p for n in p[2]], device_type=device_type,
                     example=example)
    input_grad = got[0][blocks[0]] if got is not None else None
    if ref is None:
        return Flow(input_grad, None)
    block = ref if input_grad is None else dataclasses.replace(ref, input_grad=input_grad)
    trains = [any(p.requires_grad for p in model.get_submodule(b).parameters())
              for b in blocks]
    if not parts or all(p.requires_grad for b in blocks
                        for p in model.get_submodule(b).parameters()):
        return Flow(input_grad, block)  # every block trains whole: ``block`` is each one's
    whole = reached(block.input_grad, trains)
    out = []
    for part, train, reach in zip(parts, trains, whole, strict=True):
        assert part is not None  # refused above
        _, _, fwd_at, bwd_at, gathers, norms, summed = part
        if got is None:
            fwd_grad, bwd_grad = (reach,) * len(fwd_at), (reach,) * len(bwd_at)
        else:
            fwd_grad = tuple(got[1][n] for n in fwd_at)
            bwd_grad = tuple(got[0][n] for n in bwd_at)
        out.append(dataclasses.replace(
            block, sp_norms=tuple(norms), summed=tuple(summed), bias_gathers=tuple(gathers),
            fwd_grad=fwd_grad, bwd_grad=bwd_grad, trains=train,
            traced=lambda: block.trace))
    return Flow(input_grad, block, tuple(out))


def _in_out(module: Any) -> tuple[int, int] | None:
    from .model_stats import _dims

    return _dims(module)
