"""Sequence parallelism for a model whose tensor-parallel plan was inferred.

Under SP the activations between TP regions are split along the sequence (dimension 1) over
the tp ranks; each region all-gathers its input and reduce-scatters its output. That computes
the same model only if everything between the regions treats each position on its own (norms,
residual adds, dropout, per-token gates): a token shift, a causal convolution or a position
table added inside a block would see only this rank's positions. Hugging Face models compute
positions, masks and rotary tables around their block stack, so plait splits the sequence at
the stack's first block and gathers it after the last (``TPPlan.sp_blocks``); it does the same
here, for the stack of repeated blocks, and for each further stack whose layers the plan splits
(``TPPlan.sp_more_blocks``: an encoder-decoder's other stack, a two-tower model's other tower),
which runs a sequence of its own and is checked by itself.

Whether a block is per-position outside its regions cannot be read off its code in general, so
it is run (:func:`mixes_positions`): each kind of block once on the full sequence, then on each
half of it with every region computing on the full sequence, as SP's gather and scatter make it:
each region entry (a column-parallel layer) checks that it is handed its half of what it got
on the full sequence and returns what it returned then, and each exit (row-parallel) returns
its half. The block's output must be the half of its full output; anything else mixes
positions outside a region, and SP is refused for it, naming the block.

Parameters of modules in the stack that run between regions (norms, a layer-scale) see one
rank's positions, so their gradients are summed over tp in backward, like ``grad_allreduce``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .tp_example import Example
from .tp_infer import _glob_levels
from .tp_plans import glob_regex
from .tp_verify import _copied, _first_tensor, block_inputs
from .units import repeated_blocks

_ENTRIES = ("colwise", "colwise_qkv", "replicated_kv")


def block_stack(model: nn.Module) -> str | None:
    """The glob of the model's stack of repeated blocks (``blocks.*``), or None."""
    blocks = repeated_blocks(model)
    if len(blocks) < 2:
        return None
    names = {_glob_levels(name)[0] for name, _ in blocks}
    return names.pop() if len(names) == 1 else None


def residual_outside(model: nn.Module, stack: str, example: torch.Tensor | Example
                     ) -> str | None:
    """The first block of ``stack`` whose output the model's forward adds to the block's input
    itself (``h = h + block(h)``; ``h + layer(h)[0]`` for a block returning a tuple,
    ``h + layer(h).last_hidden_state`` or a key for one returning a mapping), or None. Under
    SP a block's output is split by position
    while what the forward computed before the stack is whole, so that addition meets half a
    sequence and a whole one. Found as a pipeline finds the residuals it must not double
    (torch.fx, else one meta-device forward on ``example``)."""
    from .pipeline_chain import meta_replica
    from .pipeline_split import additive_modules

    # The stack's own blocks: repeated_blocks names only the largest stack's, and a model with
    # several (an encoder-decoder, two towers) has each checked.
    pattern = glob_regex(stack)
    blocks = [name for name, _ in model.named_modules() if name and pattern.match(name)]
    if not blocks:
        return None
    path = blocks[0].rpartition(".")[0]
    found = additive_modules(model, path)
    if found is None:
        replica = meta_replica(model)
        found = set() if replica is None else _additive_on_meta(replica, path, example)
    return next((name for name in blocks if name in found), None)


def _additive_on_meta(replica: nn.Module, path: str, example: torch.Tensor | Example
                      ) -> set[str]:
    """:func:`plait.parallel.pipeline_split.additive_by_running` on ``example`` moved to the
    meta device (``replica``'s)."""
    from .pipeline_split import additive_by_running
    from .tp_example import first_and_keywords

    if isinstance(example, torch.Tensor):
        return additive_by_running(replica, path, example.to("meta"), {})
    call = first_and_keywords(replica, example.to("meta"))  # forward(x, t): t by its name
    return set() if call is None else additive_by_running(replica, path, call[0], call[1])


def mixes_positions(model: nn.Module, matched: dict[str, str], stack: str,
                    example: torch.Tensor | Example) -> str | None:
    """The first block of ``stack`` whose computation outside its TP regions mixes positions
    (why SP cannot apply), "" when none does, or None when the check cannot run. One block of
    each kind (class) in the stack is run."""
    pattern = glob_regex(stack)
    kinds: dict[type, str] = {}
    for name, sub in model.named_modules():
        if pattern.match(name):
            kinds.setdefault(type(sub), name)
    found = block_inputs(model, list(kinds.values()), example)
    if found is None:
        return None
    for name in kinds.values():
        if name not in found:
            return None
        verdict = _block_mixes(model, model.get_submodule(name), name, matched, *found[name])
        if verdict != "":
            return verdict
    return ""


def _block_mixes(model: nn.Module, block: nn.Module, first: str, matched: dict[str, str],
                 args: tuple, kwargs: dict) -> str | None:
    """``first`` if this block mixes positions outside its regions, "" if not, None when it
    cannot be run on its recorded input."""
    x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
    if not isinstance(x, torch.Tensor) or x.ndim < 2 or x.shape[1] < 2:
        return None
    prefix = first + "."
    roles = {n[len(prefix):]: s for n, s in matched.items() if n.startswith(prefix)}
    regions = [n for n, s in roles.items() if s == "region"]

    def inside(n: str) -> bool:
        return any(n.startswith(r + ".") for r in regions)
    # A region gathers the sequence at its input and scatters it at its output; a column-
    # parallel layer outside any region gathers its own input, its row-parallel exit scatters.
    entries = [n for n, s in roles.items() if s in _ENTRIES and not inside(n)]
    exits = [n for n, s in roles.items() if s == "rowwise" and not inside(n)]
    if not regions and not entries:
        return ""
    training = model.training
    model.train(False)
    try:
        with torch.no_grad():
            full, seen = _run(block, args, kwargs, x, None, regions, entries, exits, {})
            if full is None:
                return None
            half = x.shape[1] // 2
            for part in (slice(0, half), slice(half, x.shape[1])):
                got, _ = _run(block, args, kwargs, x, part, regions, entries, exits, seen)
                if got is None or got.shape != full[:, part].shape or not torch.allclose(
                        got, full[:, part], rtol=1e-4,
                        atol=1e-5 * max(1.0, full.abs().max().item())):
                    return first
    except _MixedError:
        return first
    finally:
        model.train(training)
    return ""


class _MixedError(Exception):
    """A region entry was handed something other than its half of the full-sequence input."""


def _run(block: nn.Module, args: tuple, kwargs: dict, x: torch.Tensor, part: slice | None,
         regions: list[str], entries: list[str], exits: list[str],
         seen: dict[str, list[Any]]) -> tuple[torch.Tensor | None, dict[str, list[Any]]]:
    """Run ``block`` on ``x`` (``x[:, part]`` when part is given). On the full run, record what
    each region and each lone entry received (and what an entry returned), per call; on a
    part, check that each is handed its part of that, give regions the full input and entries
    their full output back, and cut region and lone exit outputs to the part."""
    record: dict[str, list[Any]] = {n: [] for n in regions + entries}
    calls = dict.fromkeys(regions + entries, 0)
    handles = []

    def recorded(name: str, got: torch.Tensor) -> Any:
        value = seen[name][calls[name]]
        calls[name] += 1
        full_in = value[0]
        if got.shape != full_in[:, part].shape or not torch.allclose(
                got, full_in[:, part], rtol=1e-4, atol=1e-5):
            raise _MixedError
        return value

    def region_in(name: str) -> Any:
        def hook(mod: nn.Module, a: tuple, k: dict) -> Any:
            t = a[0] if a and isinstance(a[0], torch.Tensor) else k.get("hidden_states")
            if not isinstance(t, torch.Tensor):
                raise _MixedError
            if part is None:
                record[name].append((t.detach().clone(),))
                return None
            full_in = recorded(name, t)[0]
            if a and isinstance(a[0], torch.Tensor):
                return (full_in, *a[1:]), k
            return a, {**k, "hidden_states": full_in}
        return hook

    def entry(name: str) -> Any:
        def hook(mod: nn.Module, inputs: tuple, output: Any) -> Any:
            if part is None:
                record[name].append((inputs[0].detach().clone(), output))
                return None
            return recorded(name, inputs[0])[1]
        return hook

    def cut(mod: nn.Module, inputs: tuple, output: Any) -> Any:
        if part is None:
            return None
        if isinstance(output, tuple):
            return (output[0][:, part], *output[1:])
        return output[:, part]

    try:
        for n in regions:
            sub = block.get_submodule(n)
            handles.append(sub.register_forward_pre_hook(region_in(n), with_kwargs=True))
            handles.append(sub.register_forward_hook(cut))
        for n in entries:
            handles.append(block.get_submodule(n).register_forward_hook(entry(n)))
        for n in exits:
            handles.append(block.get_submodule(n).register_forward_hook(cut))
        given = x if part is None else x[:, part]
        a, k = _copied((args, kwargs))
        if a and isinstance(a[0], torch.Tensor):
            a = (given, *a[1:])
        else:
            k = {**k, "hidden_states": given}
        try:
            out = _first_tensor(block(*a, **k))
        except _MixedError:
            raise
        except Exception:  # noqa: BLE001 - a block that cannot run on half: not per-position
            if part is None:
                return None, record
            raise _MixedError from None
        return (None if out is None else out.clone()), record
    finally:
        for h in handles:
            h.remove()
