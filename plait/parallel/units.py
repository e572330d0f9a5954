"""Which submodules are the units that sharding and checkpointing act on.

FSDP2 groups the parameters of each ``fully_shard``-ed module into one all-gather and one
reduce-scatter, and activation checkpointing recomputes whole modules; both want the model's
*repeated blocks*. For any ``nn.Module`` the default is the children of its largest container
(``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict``, by parameter count) — the
transformer's ``layers.*``, an MLP's ``blocks.*`` — and the user can override it with glob
patterns over the module names (``plan.options.shard_patterns``).

Names are matched in their canonical form (:func:`canonical_name`: wrapper parts stripped), so
a pattern written against the user's model keeps working after checkpointing wrapped the blocks.
The same rule names parameters wherever plait shows or compares them (``plait check``, the
traffic prediction).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch
import torch.nn as nn

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# The name parts wrappers insert: DDP's ``module``, activation checkpointing's, torch.compile's,
# FSDP1's and torch_xla's FSDPv2's (``_orig_module``). A user's own submodule named ``module``
# is dropped as well (it cannot be told apart from DDP's), identically in every layout, so
# names still match one device's.
_WRAPPER_PARTS = frozenset({"module", "_checkpoint_wrapped_module", "_orig_mod",
                            "_fsdp_wrapped_module", "_orig_module"})


def canonical_name(name: str) -> str:
    """The user-facing name of a module or parameter: wrapper parts dropped
    (``module.layers.3._checkpoint_wrapped_module.w`` -> ``layers.3.w``).

    Whole dotted parts only: a substring replace of ``module.`` would turn
    ``_checkpoint_wrapped_module.`` into ``_checkpoint_wrapped_``.
    """
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def user_name(name: str, wrapped: set[str] | frozenset[str] = frozenset()) -> str:
    """The name the one-device model gives a parameter or buffer of a laid-out module:
    the wrappers' parts dropped, DDP's ``module`` only right after a module in ``wrapped``
    (the paths of the DDP modules, ``""`` for the root), so that a ``module`` of the user's
    own (``AveragedModel.module``) stays."""
    kept: list[str] = []
    path: list[str] = []
    for part in name.split("."):
        at = ".".join(path)
        path.append(part)
        if part == "module" and at in wrapped:
            continue
        if part != "module" and part in _WRAPPER_PARTS:
            continue
        kept.append(part)
    return ".".join(kept)


def by_canonical_name(named: Iterable[tuple[str, torch.Tensor]], name: str,
                      what: str) -> torch.Tensor:
    """The tensor of ``named`` (a laid-out module's ``named_parameters`` or ``named_buffers``,
    duplicates kept) whose name is ``name`` once wrapper parts are dropped; ``what`` names it
    in the error."""
    for n, t in named:
        if canonical_name(n) == name:
            return t
    raise ValueError(f"{what} {name} not found in its pipeline stage after layout")


def _glob(pattern: str) -> re.Pattern[str]:
    """Glob over dotted names: ``*`` matches within one name part, ``**`` across parts."""
    out = []
    for token in re.split(r"(\*\*|\*|\?)", pattern):
        out.append({"**": ".*", "*": r"[^.]*", "?": r"[^.]"}.get(token, re.escape(token)))
    return re.compile("".join(out) + r"\Z")


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def repeated_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Children (with parameters) of ``module``'s largest container, by parameter count.

    Returns ``[(name, child), ...]`` in model order; empty when the model has no container with
    parameters (then the root alone is the unit). Ties go to the outermost container.
    """
    best: list[tuple[str, nn.Module]] = []
    best_size = 0
    for name, container in module.named_modules():
        if not isinstance(container, _CONTAINERS):
            continue
        children = [(f"{name}.{child_name}" if name else child_name, child)
                    for child_name, child in container.named_children() if _numel(child) > 0]
        size = sum(_numel(child) for _, child in children)
        if children and size > best_size:
            best, best_size = children, size
    return best


def select_units(module: nn.Module, patterns: Sequence[str] | None = None,
                 option: str = "shard_patterns") -> list[tuple[str, nn.Module]]:
    """The sharding units: the repeated blocks, or the modules whose names match ``patterns``.

    Patterns are globs over dotted module names: ``layers.*`` matches ``layers.3`` but not
    ``layers.3.attention`` (``*`` stays inside one name part; ``**`` crosses parts).

    Returned deepest first, so that wrapping them in order is bottom-up (a unit nested inside
    another is wrapped before its parent, as ``fully_shard`` requires). Raises ValueError naming
    any pattern that matches no module (naming ``option``, the setting the patterns came from).
    """
    if not patterns:
        return _callable(repeated_blocks(module))
    if isinstance(patterns, str):
        patterns = [patterns]
    named = [(name, m) for name, m in module.named_modules() if name]
    chosen: dict[str, tuple[str, nn.Module]] = {}  # canonical name -> outermost module
    unmatched = []
    for pattern in patterns:
        regex = _glob(pattern)
        hits = [(name, m) for name, m in named if regex.match(canonical_name(name))]
        if not hits:
            unmatched.append(pattern)
        for name, m in hits:
            key = canonical_name(name)
            if key not in chosen or len(name) < len(chosen[key][0]):
                chosen[key] = (name, m)
    if unmatched:
        examples = ", ".join(sorted({canonical_name(n) for n, _ in named})[:8])
        raise ValueError(f"{option} {unmatched} match no module of "
                         f"{type(module).__name__}; module names look like: {examples}")
    units = _callable([u for u in chosen.values() if _numel(u[1]) > 0])
    return sorted(units, key=lambda u: -canonical_name(u[0]).count("."))


def not_a_stack(module: nn.Module, blocks: list[tuple[str, nn.Module]],
                ignore: tuple[type, ...] = ()) -> str | None:
    """Why the blocks :func:`repeated_blocks` found in ``module`` are no stack of blocks, or
    None when they may be: their container holds layers of different kinds with a
    parameter-free one between them (Linear, SiLU, Linear: an MLP) and under half of the
    parameters, as a U-Net's timestep MLP or a recommender's bottom MLP, the largest container
    of a model whose real blocks are plain attributes. A stack of one kind of block, a stack
    of blocks of several kinds (a hybrid of attention and state-space layers: each holds
    parameters), or a container holding most of the model (a CNN's ``nn.Sequential`` of
    layers) may be. Children of the ``ignore`` types are not counted: a pipeline stage's
    parameter-free stand-ins for the blocks other stages hold sit among its own."""
    if not blocks:
        return None
    path = blocks[0][0].rpartition(".")[0]
    container = module.get_submodule(path) if path else module
    children = [m for m in container.children() if not isinstance(m, ignore)]
    kinds = list(dict.fromkeys(type(m).__name__ for m in children))
    held, total = _numel(container), _numel(module)
    bare = any(_numel(m) == 0 for m in children)  # an activation between layers
    if len(kinds) < 2 or not bare or not total or held >= total / 2:
        return None
    return (f"{path or type(module).__name__}, the nn.ModuleList/nn.Sequential/nn.ModuleDict "
            f"with the most parameters, holds {len(children)} modules of "
            f"different kinds ({', '.join(kinds)}) and {held:,} of {type(module).__name__}'s "
            f"{total:,} parameters ({held / total:.1%}), not a stack of blocks")


def _callable(units: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Units a forward calls: a block that is an ``nn.ModuleDict`` or ``nn.ModuleList`` (its
    parent's forward calls the modules it holds, ``block["attn"](h)``) has no forward for
    FSDP2 to hook, and ``fully_shard`` refuses it; its children with parameters are the
    units instead."""
    out = []
    for name, m in units:
        if isinstance(m, (nn.ModuleDict, nn.ModuleList)):
            out += _callable([(f"{name}.{k}", c) for k, c in m.named_children()
                              if _numel(c) > 0])
        else:
            out.append((name, m))
    return out


def sparse_embeddings(module: nn.Module) -> str:
    """``"big, small"``: the ``nn.Embedding``/``nn.EmbeddingBag`` modules of ``module`` built
    with ``sparse=True`` (three named, then a count), whose gradients are sparse tensors that
    FSDP2's reduce-scatter and tensor parallelism's DTensors cannot carry; "" for none."""
    names = [name for name, m in module.named_modules()
             if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
