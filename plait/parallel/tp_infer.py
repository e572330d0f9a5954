"""Infer a tensor-parallel plan for a model that has none, from its structure (torch.fx).

A Megatron TP region is a block whose input feeds one or more linears (split column-wise) whose
outputs — through element-wise ops, reshapes or attention — feed exactly one linear that produces
the block's output (split row-wise). That is what both an MLP (up[, gate] -> act -> down) and an
attention block (q, k, v -> attention -> o) look like in a dataflow graph, whatever the modules
are called. So for every module with at least two direct ``nn.Linear`` children, we trace its
``forward`` with ``torch.fx.symbolic_trace`` (or, where fx cannot trace it, a forward that
branches on its input, record the same graph from one fake-tensor forward of the model on a
guessed input: :mod:`plait.parallel.tp_record`, :mod:`plait.parallel.tp_example`) and check
that shape:

* entry linears read the block's (single) input directly; they become ``colwise``;
* one exit linear reads only values derived from the entry linears and its output reaches the
  block's output; it becomes ``rowwise``;
* no other linear, and no path from the input to the exit that bypasses the entries.

Several entries sharing the input also make the block a ``region`` (one backward all-reduce).
An attention block (softmax/SDPA/matmul in the graph) with an integer head-count attribute gets
that attribute divided by tp (``divide_attrs``), since its reshape must use the local count,
and an ``nn.Embedding`` child one column per head wide (a relative position bias) is split by
its columns with the heads. Linears that each read a value of their own and feed no other
(projection heads side by side, one per tower) are no region and stay whole.
An ``nn.Embedding`` with a Linear of the same vocabulary size outside any block becomes
``vocab_embedding`` + ``vocab_head``.

Inference refuses (ValueError, naming the module and the reason) when a candidate block cannot be
traced or does not have that shape: a wrong guess would train a different model silently.
"""

from __future__ import annotations

import json
import operator
import re
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrize import is_parametrized

from .fx_trace import trace_kept
from .tp_example import PASS_EXAMPLE, READS_VALUES, Example, describe, example_call, run_on
from .tp_kv import GROUP_ATTRS, KV_COUNT_ATTRS, KVHeads, local_attrs, owners, replicated_kv
from .tp_lora import base_linear, expand, low_rank_parts
from .tp_plans import STYLES, TPPlan, glob_regex, under
from .tp_record import fake_forward, record_blocks

_ATTENTION_FUNCS = {F.scaled_dot_product_attention, F.softmax, torch.softmax, torch.matmul,
                    torch.bmm, operator.matmul}
_ATTENTION_METHODS = {"softmax", "matmul", "bmm", "__matmul__", "__rmatmul__"}
_HEAD_ATTRS = ("n_heads", "num_heads", "n_head", "num_attention_heads", "n_kv_heads",
               "num_kv_heads", "num_key_value_heads", "heads")


# The same layer plan from the command line (plait check, plait run: a plan string cannot hold
# options), said after "Pass Plan(options=...)".
_ON_THE_COMMAND_LINE = (", or on the command line a plan file (--plan plan.yaml) holding "
                        "tp: 2 and options: {tp_plan: {module glob: style}}")

def _is_metadata(node: fx.Node) -> bool:
    """Shape/dtype queries: they carry no tensor data (``b, s, h = x.shape`` is not a path)."""
    if node.op == "call_method" and node.target in ("size", "dim", "numel"):
        return True
    return node.op == "call_function" and (
        (node.target is getattr and node.args[1] in ("shape", "dtype", "device", "ndim"))
        or node.target is len)


def _reaches(start: fx.Node, stop: set[fx.Node]) -> set[fx.Node]:
    """Nodes reachable forward from ``start`` without passing through a node in ``stop``."""
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user not in seen and not _is_metadata(user):
                seen.add(user)
                if user not in stop:
                    todo.append(user)
    return seen


def _shardable(m: nn.Module) -> bool:
    """A linear TP can split: not parametrized (weight_norm and spectral_norm compute its
    weight from other tensors, which torch's styles cannot shard; it stays replicated)."""
    return isinstance(m, nn.Linear) and not is_parametrized(m)


def _linear_like(m: nn.Module) -> bool:
    """A linear, or a LoRA layer (one linear with a low-rank side path, split as one)."""
    return isinstance(m, nn.Linear) or low_rank_parts(m) is not None


def _shardable_like(m: nn.Module) -> bool:
    if isinstance(m, nn.Linear):
        return _shardable(m)
    parts = low_rank_parts(m)
    return parts is not None and all(_shardable(m.get_submodule(n))
                                     for n in (parts.base, parts.a, parts.b))


class _LinearTracer(fx.Tracer):
    """Traces into a module only when it holds a linear: what a module without one computes
    (a norm, a BatchNorm synchronised over the data axes, a rotary table) has no say in where
    the TP regions are, and its forward may branch on its input, which fx cannot trace."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # A Linear subclass with a forward of its own (Falcon's FalconLinear) is still a linear.
        return (super().is_leaf_module(m, module_qualified_name) or _linear_like(m)
                or not any(isinstance(sub, nn.Linear) for sub in m.modules()))


def trace_block(block: nn.Module) -> fx.Graph | str:
    """``block``'s dataflow graph traced by torch.fx, or why fx cannot trace it."""
    try:
        return trace_kept(_LinearTracer(), block)
    except Exception as exc:  # noqa: BLE001 - fx raises anything; data-dependent control flow, unsupported calls, ...
        return f"torch.fx cannot trace it ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"


def analyse_block(block: nn.Module, name: str, graph: fx.Graph | None = None
                  ) -> dict[str, str] | str | None:
    """{child name: style} if ``block`` is a TP region (or a chain of them), the reason it is
    not, or None when it is a container: linears of its sub-blocks sit between its own (an
    input layer and a head around blocks), so its sub-blocks are the regions, not itself.
    ``graph`` is its dataflow (traced by fx when not given)."""
    linears = {n for n, m in block.named_children() if _linear_like(m)}
    if graph is None:
        traced = trace_block(block)
        if isinstance(traced, str):
            return traced
        graph = traced
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    calls = {n: n.target for n in graph.nodes if n.op == "call_module" and n.target in linears}
    if len(set(calls.values())) != len(calls):
        return "a linear is called more than once"
    unused = linears - set(calls.values())
    if unused:
        return f"linear(s) {sorted(unused)} are not used in forward"
    nodes = set(calls)
    output = next(n for n in graph.nodes if n.op == "output")
    # Linears of sub-modules (fx traces through Sequential, ModuleList/Dict and custom modules).
    nested = {n for n in graph.nodes if n.op == "call_module" and n not in nodes
              and _linear_like(block.get_submodule(n.target))}
    if nested and any(nested & _reaches(n, nodes) for n in nodes):
        return None
    heads_out = _head_outputs(graph, output, nodes)
    if heads_out:
        # Left out of the output for the analysis below; under tp they are dropped from the
        # block's output (plait.parallel.tensor), as torch's own attention leaves them None.
        output.args = (tuple(None if i in heads_out else a
                             for i, a in enumerate(output.args[0])),)
    if _side_by_side(nodes, output):
        return None
    fixed = sorted(n for n in linears if not _shardable_like(block.get_submodule(n)))
    if fixed:
        return (f"its linear(s) {fixed} are parametrized (weight_norm or spectral_norm compute "
                f"the weight from other tensors), which torch's tensor-parallel styles cannot "
                f"shard")
    # Cross-attention is split by heads: only a block that names its head count (divided by
    # tp below) says its projections' columns are whole heads.
    headed = any(isinstance(getattr(block, a, None), int) for a in _HEAD_ATTRS)
    regions = _regions([n for n in graph.nodes if n in nodes], nodes, output, calls,
                       cross=headed)
    if isinstance(regions, str):
        return regions
    styles: dict[str, str] = {}
    for entries, exit_node in regions:
        packed = _packing(block, entries, exit_node, calls)
        if packed not in ("colwise", "colwise_qkv"):
            return packed  # the reason
        for n in entries:
            styles[calls[n]] = packed
        styles[calls[exit_node]] = "rowwise"
        inside = _weights_inside(block, graph, entries, exit_node)
        if isinstance(inside, str):
            return inside
        styles.update(dict.fromkeys(inside, "grad_allreduce"))
    entries = regions[0][0] if len(regions) == 1 else []
    if entries and entries[0].args[0] in inputs and all(
            e.args[0] is entries[0].args[0] for e in entries) and (
            len(entries) > 1 or styles[calls[entries[0]]] == "colwise_qkv"):
        # One replicated input for q/k/v (gate/up): one backward all-reduce. Only when they read
        # the block input itself; after a pre-norm each colwise layer reduces its own. A fused
        # q|k|v layer too: under SP the block then sees the whole sequence, as attention that
        # takes its length from its input (``B, T, C = x.shape``) needs.
        styles[""] = "region"
    elif entries and inputs and entries[0].args[0] is inputs[0] and len(
            {e.args[0] for e in entries}) == 2:
        # Cross-attention (q of the block's first input, k and v of a second one, whole on
        # every rank): a region too, whose boundary replicates the first input only. Under SP
        # the queries' sequence is then gathered once, the block (and a position bias it
        # sizes by its input, T5's) sees the whole of it, and k and v read the encoder's
        # whole output as it is instead of gathering it as if it were a shard.
        styles[""] = "region"
        styles["__side__"] = "|".join(calls[e] for e in entries
                                      if e.args[0] is not entries[0].args[0])
    if heads_out:
        styles["__head_outputs__"] = "|".join(map(str, heads_out))
    attention = any((n.op == "call_function" and n.target in _ATTENTION_FUNCS)
                    or (n.op == "call_method" and n.target in _ATTENTION_METHODS)
                    for n in graph.nodes)
    styles["__kind__"] = "attention" if attention else "mlp"
    return styles


_SOFTMAX_FUNCS = {F.softmax, torch.softmax}


def _head_outputs(graph: fx.Graph, output: fx.Node, nodes: set[fx.Node]) -> list[int]:
    """Positions past the first in the block's output tuple that hold attention weights (what
    eager attention returns beside its output: the softmax of the queries' and keys' scores,
    one map per head). They come from the region's entry linears alone, so under tp each rank
    holds its own heads' maps, not all of them; the block output proper is the first value.
    A value counts when a softmax lies on its path from an entry and every linear it comes
    from reads no other linear's output (q and k, not what an output projection computed)."""
    values = output.args[0] if output.args else None
    if not isinstance(values, tuple):
        return []
    softmaxes = {n for n in graph.nodes
                 if (n.op == "call_function" and n.target in _SOFTMAX_FUNCS)
                 or (n.op == "call_method" and n.target == "softmax")}
    found = []
    for i, value in enumerate(values):
        if i == 0 or not isinstance(value, fx.Node):
            continue
        above = _ancestors(value) | {value}
        linears = above & nodes
        if (value not in nodes and linears and softmaxes & above
                and not any(_ancestors(n) & nodes for n in linears)
                and all(s in set().union(*(_reaches(n, set()) for n in linears))
                        for s in softmaxes & above)):
            found.append(i)
    return found


def _side_by_side(nodes: set[fx.Node], output: fx.Node) -> bool:
    """Whether the linears ``nodes`` each read a value of their own and reach the output
    without feeding one another: heads side by side (a two-tower model's projection of each
    tower's output), not a tensor-parallel region. Nothing of a split would be gathered by
    another linear, so they stay replicated; linears sharing an input (an attention block
    missing its output projection) are still a block plait cannot read."""
    sources = [n.args[0] if n.args else None for n in nodes]
    if any(s is None for s in sources) or len(set(sources)) != len(sources):
        return False
    return all(not (_reaches(n, nodes) & nodes) and output in _reaches(n, nodes)
               for n in nodes)


Region = tuple[list[fx.Node], fx.Node]


def _regions(order: list[fx.Node], nodes: set[fx.Node], output: fx.Node,
             calls: dict[fx.Node, str], cross: bool = False) -> list[Region] | str:
    """The block's linears, in graph order, as consecutive TP regions (entries, exit), or why
    they are not. A region's entries read one shared value (the block input, a norm of it, or
    what an earlier region produced, which is whole again after its row-parallel exit); their
    outputs reach exactly one linear, the exit, and nothing else reaches the block output on
    the way; the shared value reaches the exit only through them. An attention region and an
    MLP region in one flat block, or Linear -> act -> Linear -> act -> ... pairs, are several
    regions; an odd last linear after at least one region stays replicated. With ``cross``
    (a block that names its head count), linears reading a second value whole on every rank
    (cross-attention's keys and values) join the region of the entries beside them."""
    left = list(order)
    regions: list[Region] = []
    while left:
        source = left[0].args[0] if left[0].args else None
        entries = [n for n in left if n.args and n.args[0] is source]
        if not isinstance(source, fx.Node) or any(m in left for m in _ancestors(source)):
            return "its first linears do not read one shared value"
        reach = set().union(*(_reaches(e, nodes) for e in entries))
        exits = [n for n in left if n in reach]
        if output in reach:
            if regions and entries == left and not reach & nodes:
                break  # an odd last linear, feeding no other: replicated
            direct = [calls[e] for e in entries if output in _reaches(e, nodes)]
            return (f"{len(direct) + 1} linears produce the block output directly"
                    if regions or exits else
                    f"linear(s) {direct} produce the block output directly: no linear "
                    f"gathers their output")
        if len(exits) != 1:
            return (f"linear(s) {sorted(calls[n] for n in exits)} sit between the entry and exit"
                    if exits else "its first linears do not read one shared value")
        exit_node = exits[0]
        for entry in entries:
            if exit_node not in _reaches(entry, nodes):
                return f"{calls[entry]} does not feed the output linear {calls[exit_node]}"
        others = [m for m in left if m not in entries and m is not exit_node
                  and exit_node in _reaches(m, nodes)]
        if others:  # cross-attention: k and v read another input than q
            second = _second_input(others, left, nodes, exit_node, output) if cross else None
            if second is None:
                return (f"linear(s) {[calls[m] for m in others]} feed the output linear "
                        f"{calls[exit_node]} from another input than "
                        f"{sorted(calls[e] for e in entries)}")
            entries = entries + others
        if exit_node in _reaches(source, set(entries)):
            return "the block input reaches the output linear without passing an entry linear"
        regions.append((entries, exit_node))
        left = [n for n in left if n not in entries and n is not exit_node]
    return regions


def _second_input(others: list[fx.Node], left: list[fx.Node], nodes: set[fx.Node],
                  exit_node: fx.Node, output: fx.Node) -> fx.Node | None:
    """The one value ``others`` (linears beside a region's entries that also feed its exit)
    all read, when it makes them entries of the same region: cross-attention, whose keys and
    values come from the encoder's output while the queries come from the block input. The
    value must not depend on the block's linears (it is whole on every tensor-parallel rank,
    as the block input is), and reach the exit only through them; their outputs must reach
    no linear but the exit, and the block output only through it. None otherwise."""
    sources = {m.args[0] if m.args else None for m in others}
    second = next(iter(sources)) if len(sources) == 1 else None
    if not isinstance(second, fx.Node) or any(m in left for m in _ancestors(second)):
        return None
    if exit_node in _reaches(second, set(others)):
        return None
    for m in others:
        reach = _reaches(m, nodes)
        if reach & nodes != {exit_node} or output in reach:
            return None
    return second


def _weights_inside(block: nn.Module, graph: fx.Graph, entries: list[fx.Node],
                    exit_node: fx.Node) -> list[str] | str:
    """Submodules with parameters that a region applies between its entries and its exit (a
    per-head q/k norm): on each rank they see that rank's heads only, so their gradients must
    be summed over the tp ranks (style ``grad_allreduce``); or the reason the block is refused:
    the block's own parameter used there (no module to name in a plan), or such a module also
    used outside the region (its gradient would be part summed, part not)."""
    inside = set().union(*(_reaches(e, {exit_node}) for e in entries)) - {exit_node}
    owners: dict[str, set[fx.Node]] = {}
    for node in graph.nodes:
        reads = [node] if node.op == "call_module" else [
            a for a in node.all_input_nodes if a.op == "get_attr"]
        for r in reads:
            target = str(r.target)
            owner = target if r.op == "call_module" else target.rpartition(".")[0]
            held = (any(True for _ in block.get_submodule(owner).parameters())
                    if r.op == "call_module" else _is_parameter(block, target))
            if held:
                owners.setdefault(owner, set()).add(node)
    found = []
    for owner, users in owners.items():
        if not users & inside:
            continue
        if not owner:
            names = sorted({str(a.target) for u in users & inside for a in u.all_input_nodes
                            if a.op == "get_attr"})
            return (f"its parameter(s) {names} are applied to each rank's share of a "
                    f"tensor-parallel region (between {entries[0].target} and "
                    f"{exit_node.target}), whose gradient then has to be summed over the tp "
                    f"ranks; put them in a submodule and name it 'grad_allreduce' in "
                    f"options.tp_plan")
        if users - inside:
            return (f"{owner} is used both inside the tensor-parallel region ending at "
                    f"{exit_node.target} (on each rank's share) and outside it; its gradient "
                    f"cannot be summed for one use only")
        found.append(owner)
    return found


def _is_parameter(block: nn.Module, target: str) -> bool:
    owner, _, name = target.rpartition(".")
    try:
        return name in block.get_submodule(owner)._parameters
    except AttributeError:
        return False


def _packing(block: nn.Module, entries: list[fx.Node], exit_node: fx.Node,
             calls: dict[fx.Node, str]) -> str:
    """The style of a region's entries: ``colwise``, or ``colwise_qkv`` for one fused q|k|v
    layer (its output three times what the exit reads: a plain split would give rank 0 all of
    q and half of k); any other entry wider than what the exit reads packs parts plait cannot
    tell apart, and the reason is returned instead."""
    def linear(node: fx.Node) -> nn.Linear:
        module = base_linear(block.get_submodule(calls[node]))
        assert module is not None
        return module

    width = linear(exit_node).in_features
    for n in entries:
        out = linear(n).out_features
        if out > width:
            if len(entries) == 1 and out == 3 * width:
                return "colwise_qkv"
            return (f"the output of {calls[n]} ({out} features) is wider than what "
                    f"{calls[exit_node]} reads ({width}): a fused layer whose parts a split "
                    f"cannot tell apart; name its style in options.tp_plan ('colwise_qkv' for "
                    f"q|k|v of equal widths one after the other; else 'colwise_gather' on "
                    f"{calls[n]} and 'rowwise_split' on {calls[exit_node]}, which gathers its "
                    f"output whole on every rank)")
    return "colwise"


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), [node]
    while todo:
        for arg in todo.pop().all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                todo.append(arg)
    return seen


def _glob_levels(name: str) -> list[str]:
    """Patterns for ``name``, most general first: every index a ``*``; every index but a last
    one (``blocks.3.ff.0`` -> ``blocks.*.ff.0``: the 0 is a place in the block, not a block);
    the first index only; the name itself."""
    parts = name.split(".")
    numbers = [i for i, p in enumerate(parts) if p.isdigit() and len(parts) > 1]

    def starred(which: set[int]) -> str:
        return ".".join("*" if i in which else p for i, p in enumerate(parts))
    return [starred(set(numbers)), starred(set(numbers) - {len(parts) - 1}),
            starred(set(numbers[:1])), name]


def _globs(entries: dict[str, str], names: list[str] | None = None) -> dict[str, str]:
    """Collapse layer indices (``blocks.3.mlp`` -> ``blocks.*.mlp``) where the styles agree and,
    given the model's module ``names``, the pattern matches no module outside ``entries``."""
    out: dict[str, str] = {}
    for name, style in entries.items():
        for glob in _glob_levels(name):
            regex = re.compile("^" + re.escape(glob).replace(r"\*", "[^.]+") + "$")
            group = [n for n in entries if regex.match(n)]
            if len({entries[n] for n in group}) == 1 and (
                    names is None or all(n in entries for n in names if regex.match(n))):
                out[glob] = style
                break
    return out


def _beside_logits(model: nn.Module, head: nn.Module, embeddings: Any) -> list[str]:
    """Vectors of the head's output size (``(vocab,)`` or ``(1, vocab)``) that a module with
    children holds itself (BART's ``final_logits_bias`` on the model, added to the logits in
    its forward; a layer's own bias or norm weight is not one): a forward that combines them
    with the logits fails on logits split over the vocabulary (a plain tensor beside a
    DTensor), so such a head stays whole."""
    vocab = head.out_features
    found = []
    for owner, m in model.named_modules():
        if m is head or any(m is e for e in embeddings) or not any(True for _ in m.children()):
            continue
        for name, t in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)):
            if t is not None and t.ndim and t.shape[-1] == vocab and t.numel() == vocab:
                found.append(f"{owner}.{name}".strip("."))
    return found


def _per_head_tables(block: nn.Module, attrs: tuple[str, ...]) -> list[str]:
    """The ``nn.Embedding`` children of an attention block one column per head wide (a relative
    position bias: T5's ``relative_attention_bias`` looks up a bias per head for each offset
    and adds it to that head's scores). Each rank computes its own heads' scores, so the table
    is split by its columns with them (``colwise``); left whole, its bias would not fit the
    scores of a rank's heads, and later blocks that read it would get every head."""
    heads = {getattr(block, a) for a in attrs}
    return [n for n, m in block.named_children()
            if isinstance(m, nn.Embedding) and m.embedding_dim in heads]


# Layers tensor parallelism leaves whole: a convolution's channels and a recurrent layer's
# gates could be split, but torch's parallel styles (ColwiseParallel, RowwiseParallel) shard
# nn.Linear and nn.Embedding only, and plait writes no styles of its own for them.
_WHOLE_KINDS = (((nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                  nn.ConvTranspose3d), "convolutions"), ((nn.RNNBase,), "recurrent layers"))


def _not_split(model: nn.Module) -> str:
    """``"; its convolutions (stem.0, ...) ... are not split over tp: ..."``, naming the layers
    of ``model`` tensor parallelism has no style for, or "" when it has none of them: what a
    ConvNet or an RNN is told in place of a plan."""
    found = []
    for kind, label in _WHOLE_KINDS:
        names = [n for n, m in model.named_modules() if isinstance(m, kind)]
        if names:
            more = ", ..." if len(names) > 3 else ""
            found.append(f"{label} ({', '.join(names[:3])}{more})")
    if not found:
        return ""
    return (f"; its {' and '.join(found)} are not split over tp (plait's tensor parallelism "
            f"shards nn.Linear and nn.Embedding layers only): train it with data parallelism "
            f"instead, dp=N or dp_shard=N,zero=3 to shard its state")


def _why_not_recorded(failed: list[str]) -> str:
    """What the recording forward raised, and why where it read a value: it runs on fake
    tensors, which have shapes and no values (``int(batch.max())``, a graph network's count
    of graphs, cannot be read there)."""
    if not failed:
        return ""
    values = ("; the recording runs on fake tensors, which hold shapes and no values, so a "
              "forward that reads one (int(batch.max()), .item()) cannot run there"
              if "DataDependent" in failed[0] or "data-dependent" in failed[0] else "")
    return f" (it raised {failed[0]}{values})"


def infer_plan(model: nn.Module, example: Example | None = None) -> TPPlan:
    """Propose a TP plan for ``model``; ValueError where it cannot decide (see module docs).
    ``example``: the input the blocks fx cannot trace are recorded on (the user's batch, see
    :func:`plait.parallel.tp_example.from_batch`); guessed without one."""
    styles: dict[str, str] = {}
    divide: dict[str, tuple[str, ...]] = {}
    sizes: dict[str, int] = {}
    refused: dict[str, None] = {}  # "blocks (type): reason", repeated blocks as one glob
    in_blocks: set[str] = set()
    side: set[str] = set()  # column-parallel layers of a region that read another input
    head_outputs: dict[str, tuple[int, ...]] = {}  # blocks returning per-head attention maps
    candidates = {name: block for name, block in model.named_modules()
                  if sum(_linear_like(m) for m in block.children()) >= 2
                  and low_rank_parts(block) is None}
    graphs = {name: trace_block(block) for name, block in candidates.items()}
    untraced = {name: candidates[name] for name, g in graphs.items() if isinstance(g, str)}
    given = example is not None
    if untraced and example is None:
        example = example_call(model)
    # Run the model once instead: branches are taken concretely.
    failed: list[str] = []
    recorded = (record_blocks(model, untraced, example, failed)
                if untraced and example is not None else {})
    graphs.update(recorded)
    unguessed = "" if not untraced or recorded else (
        f"; nor does the model's forward run on the example given to record it instead"
        f"{_why_not_recorded(failed)}" if given
        else f"; nor does the model's forward run on any input plait guessed to record it "
             f"instead (tried {describe(model, example)}): {PASS_EXAMPLE}")
    for name, block in candidates.items():
        graph = graphs[name]
        result = (graph + unguessed if isinstance(graph, str) else
                  analyse_block(block, name, graph))
        label = name or type(model).__name__
        if result is None:
            continue
        if isinstance(result, str):
            glob = next(iter(_globs({label: ""}))) if name else label
            refused[f"{glob} ({type(block).__name__}): {result}"] = None
            continue
        kind = result.pop("__kind__")
        dropped = result.pop("__head_outputs__", "")
        if dropped and name:
            head_outputs[name] = tuple(int(i) for i in dropped.split("|"))
        side.update(f"{name}.{child}".strip(".") for child in result.pop("__side__", "").split("|")
                    if child)
        for child, style in result.items():
            full = f"{name}.{child}".strip(".") if child else name
            if not full:
                refused[f"{label}: the model itself is a block; wrap it in a module"] = None
                continue
            parts = low_rank_parts(model.get_submodule(full)) if child else None
            if parts is None:
                styles[full] = style
                in_blocks.add(full)
                continue
            split = expand(style, parts)  # a LoRA layer: its base and side path
            if isinstance(split, str):
                glob = next(iter(_globs({full: ""})))
                refused[f"{glob} (a LoRA layer): {split}"] = None
                continue
            styles.update({f"{full}.{part}": s for part, s in split.items()})
            in_blocks.update(f"{full}.{part}" for part in (parts.base, parts.a, parts.b))
        if kind == "attention":
            attrs = tuple(a for a in _HEAD_ATTRS if isinstance(getattr(block, a, None), int))
            if attrs and name:
                divide[name] = attrs
            for a in attrs:
                sizes[f"{type(block).__name__}.{a}"] = getattr(block, a)
            for child in _per_head_tables(block, attrs):
                styles[f"{name}.{child}".strip(".")] = "colwise"
                in_blocks.add(f"{name}.{child}".strip("."))
    if refused:
        raise ValueError(
            f"cannot infer a tensor-parallel plan for {type(model).__name__}: "
            + "; ".join(refused) + ". Pass Plan(options={'tp_plan': {module glob: style}}) "
            f"(styles: {', '.join(STYLES)}){_ON_THE_COMMAND_LINE}")
    if not styles:
        fixed = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not
                 _shardable(m)]
        more = ", ..." if len(fixed) > 3 else ""
        why = (f"; its parametrized linears ({', '.join(fixed[:3])}{more}: weight_norm or "
               f"spectral_norm) cannot be sharded" if fixed else "") + _not_split(model)
        raise ValueError(
            f"cannot infer a tensor-parallel plan for {type(model).__name__}: no module has the "
            f"shape of an MLP or attention block (two or more nn.Linear children, input -> "
            f"column-parallel linears -> one row-parallel linear -> output){why}. Pass "
            f"Plan(options={{'tp_plan': {{module glob: style}}}}){_ON_THE_COMMAND_LINE}")
    embeddings = {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    # nn.MultiheadAttention's forward reads out_proj.weight itself, so its out_proj is no head
    # (a square one matched an Embedding whose vocabulary equals the width).
    inside_mha = {f"{n}.out_proj" for n, m in model.named_modules()
                  if isinstance(m, nn.MultiheadAttention)}
    for n, m in model.named_modules():
        if _shardable(m) and n not in in_blocks and n not in styles and n not in inside_mha \
                and not _beside_logits(
                model, m, embeddings.values()):
            for en, emb in embeddings.items():
                if emb.num_embeddings == m.out_features and emb.embedding_dim == m.in_features \
                        and en not in styles:
                    styles[en], styles[n] = "vocab_embedding", "vocab_head"
    names = [n for n, _ in model.named_modules() if n]
    joined = _globs({k: "|".join(v) for k, v in divide.items()}, names)
    divide_globs = {g: tuple(attrs.split("|")) for g, attrs in joined.items()}
    positions = _globs({k: "|".join(map(str, v)) for k, v in head_outputs.items()}, names)
    return TPPlan(styles=_globs(styles, names), divide_attrs=divide_globs,
                  source=f"inferred from {type(model).__name__}'s structure", sizes=sizes,
                  side_inputs=tuple(_globs(dict.fromkeys(side, "side"), names)),
                  head_outputs={g: tuple(int(i) for i in v.split("|"))
                                for g, v in positions.items()})


def with_sp(model: nn.Module, plan: TPPlan, matched: dict[str, str],
            example: torch.Tensor | Example) -> TPPlan:
    """``plan`` with sequence parallelism inside every stack of blocks whose layers it splits
    (an encoder-decoder's two, a two-tower model's towers), where running each stack's blocks
    shows it computes the same (:mod:`plait.parallel.tp_sp`), else with the reason, naming
    the stack. Each stack splits its own sequence at its first block and gathers it after its
    last, so what another stack reads of it (the decoder's cross-attention reading the
    encoder's output as keys and values) is whole."""
    from .tp_sp import block_stack

    stack = block_stack(model)
    if stack is None:
        return replace(plan, sp_refused="it has no stack of repeated blocks to split the "
                                        "sequence in")
    found = [stack, *(f"{other}.*" for other in _split_stacks(model, stack, matched))]
    names = [n for n, _ in model.named_modules()]
    stacks = sorted(found, key=lambda glob: next(
        (i for i, n in enumerate(names) if glob_regex(glob).match(n)), len(names)))
    for one in stacks:
        why = _stack_refusal(model, one, matched, example)
        if why is not None:
            if len(stacks) > 1:
                why = (f"it has {len(stacks)} stacks of blocks whose layers the plan splits "
                       f"({', '.join(stacks)}), each splitting its own sequence, and {one} "
                       f"cannot: {why}")
            return replace(plan, sp_refused=why)
    return replace(plan, supports_sp=True, sp_blocks=stacks[0], sp_more_blocks=tuple(stacks[1:]),
                   sp_summed=True)


def _stack_refusal(model: nn.Module, stack: str, matched: dict[str, str],
                   example: torch.Tensor | Example) -> str | None:
    """Why the sequence cannot be split in the stack of blocks ``stack``, or None."""
    from .tp_sp import mixes_positions, residual_outside

    batchnorms = [n for n, m in model.named_modules() if n and under(n, stack)
                  and isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if batchnorms:
        return f"{batchnorms[0]} is a BatchNorm, whose statistics would cover one rank's positions"
    outside = residual_outside(model, stack, example)
    if outside is not None:
        return (f"its forward adds {outside}'s output to that block's input outside the block "
                f"(h = h + block(h), or h = h + block(h)[0] for a block returning a tuple), where "
                f"the sequence is whole but the block's output is split by position: move the "
                f"residual into the block (its forward returning h + f(h))")
    mixed = mixes_positions(model, matched, stack, example)
    if mixed is None:
        return (f"its blocks ({stack}) could not be run on a guessed input to check that they "
                f"treat positions one by one")
    if mixed:
        return (f"{mixed} does not treat positions one by one outside its tensor-parallel "
                f"regions (run on half the sequence, with its regions seeing all of it, it "
                f"computes something else or fails: attention left replicated, a token shift, a "
                f"convolution over positions, a position table added inside the block, or a "
                f"reshape by the sequence length of its own input where the region's is meant; "
                f"write -1 there)")
    return None


def _split_stacks(model: nn.Module, stack: str, matched: dict[str, str]) -> list[str]:
    """The stacks of blocks other than ``stack`` (an encoder-decoder's other stack, a
    two-tower model's other tower) that hold a module the plan splits: the sequence is split
    in each of them too, else their regions would take a whole sequence for one rank's part."""
    from .pipeline_hf import other_block_stacks

    return [other for other in other_block_stacks(model, stack.removesuffix(".*"))
            if any(n.startswith(other + ".") for n in matched)]


def format_plan(plan: TPPlan, model: nn.Module) -> str:
    return (f"plait: no tensor-parallel plan ships for {type(model).__name__}; this one was "
            f"inferred from its structure. Check it, then save it as options.tp_plan:\n"
            + json.dumps(plan.to_dict(), indent=2) + split_share(plan, model))


# Below this share of the parameters split, tp costs its collectives for little: each rank
# still holds and computes the rest whole.
_FEW_SPLIT = 0.5


def split_share(plan: TPPlan, model: nn.Module) -> str:
    """A note, when ``plan`` splits under half of ``model``'s parameters, naming the largest
    layers it leaves whole on every tp rank (a recommender's embedding-bag tables, a U-Net's
    convolutions): there tp saves little memory and every rank computes them in full, which
    the plan alone does not show; "" otherwise."""
    patterns = [glob_regex(g) for g in plan.styles]
    total = sum(p.numel() for p in model.parameters())
    split: set[int] = set()
    for name, m in model.named_modules():
        if name and any(r.match(name) for r in patterns):
            split.update(id(p) for p in m.parameters())
    done = sum(p.numel() for p in model.parameters() if id(p) in split)
    if not total or done >= _FEW_SPLIT * total:
        return ""
    whole = sorted(((sum(p.numel() for p in m.parameters(recurse=False) if id(p) not in split),
                     name, type(m).__name__) for name, m in model.named_modules()),
                   reverse=True)
    shown = ", ".join(f"{name} ({kind}, {n:,})" for n, name, kind in whole[:3] if n)
    return (f"\nThis plan splits {done:,} of {total:,} parameters ({done / total:.1%}); the "
            f"rest is whole on every tp rank, each computing it in full, the largest: {shown} "
            f"(tensor parallelism shards nn.Linear and nn.Embedding only). For this model "
            f"dp=N, or dp_shard=N,zero=3 to shard its state, does more")


def _sharded_forward(module: nn.Module, style: str, tp: int | slice):
    """What the module computes on one rank under ``style`` (plain tensors, no collectives):
    colwise keeps 1/tp of the output features (of each third for a fused q|k|v), rowwise
    reads 1/tp of the input features; replicated_kv (``tp`` is then the rows) one kv head."""
    w: torch.Tensor = module.weight  # type: ignore[assignment]
    if isinstance(module, nn.Embedding):  # colwise: 1/tp of the columns (a per-head table's)
        cols = w[:, :w.shape[1] // tp] if style == "colwise" and isinstance(tp, int) else None
        return None if cols is None else lambda ids: F.embedding(ids, cols, module.padding_idx)
    b: torch.Tensor | None = module.bias  # type: ignore[assignment]
    if isinstance(tp, slice):
        return lambda x: F.linear(x, w[tp], None if b is None else b[tp])
    if style == "colwise":
        out = w.shape[0] // tp
        return lambda x: F.linear(x, w[:out], None if b is None else b[:out])
    if style == "colwise_qkv":  # the first 1/tp of each third: [q_0, k_0, v_0]
        third = w.shape[0] // 3
        rows = torch.cat([torch.arange(i * third, i * third + third // tp) for i in range(3)])
        return lambda x: F.linear(x, w[rows], None if b is None else b[rows])
    if style == "rowwise":
        return lambda x: F.linear(x, w[:, :w.shape[1] // tp], b)
    return None


def check_shapes(model: nn.Module, matched: dict[str, str], divide: dict[str, tuple[str, ...]],
                 tp: int, example: torch.Tensor | Example,
                 kv: dict[str, KVHeads] | None = None) -> str | None:
    """Run one forward of ``model`` on fake tensors (no memory, no compute) with every linear of
    ``matched`` computing its rank's share, and head counts divided by tp; return the error a
    misplaced split raises (a sharded activation read where a full one is expected), or None.
    Nothing of the model changes: the overrides are removed afterwards, and buffers are put
    back as they were (a training-mode forward may update running statistics in place, and
    under FakeTensorMode such an update can still reach a real buffer). ``kv``: the k/v
    projections whose heads are replicated (:mod:`plait.parallel.tp_kv`); they compute one
    head, and their attention module's head counts are what one rank sees."""
    kv = kv or {}
    kv_owners = owners(kv)
    overrides, saved = [], []
    try:
        for name, style in matched.items():
            sub = model.get_submodule(name)
            fn = (_sharded_forward(sub, style, tp) if isinstance(sub, (nn.Linear, nn.Embedding))
                  else None)
            if name in kv:
                fn = _sharded_forward(sub, "replicated_kv", kv[name].rows(0, tp))
            if fn is not None:
                sub.forward = fn
                overrides.append(sub)
        for name, attrs in divide.items():
            sub = model.get_submodule(name)
            for attr in attrs:
                if name in kv_owners and attr in KV_COUNT_ATTRS + GROUP_ATTRS:
                    continue
                saved.append((sub, attr, getattr(sub, attr)))
                setattr(sub, attr, getattr(sub, attr) // tp)
        for name, heads in kv_owners.items():
            sub = model.get_submodule(name)
            for attr, value in local_attrs(sub, heads, tp).items():
                saved.append((sub, attr, getattr(sub, attr)))
                setattr(sub, attr, value)
        with fake_forward(model):
            run_on(model, example)
    except Exception as exc:  # noqa: BLE001 - the error is the answer
        return f"{_where(exc, model)}{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    finally:
        for sub in overrides:
            del sub.forward
        for sub, attr, value in saved:
            setattr(sub, attr, value)
    return None


def _where(exc: BaseException, model: nn.Module) -> str:
    """``"in blocks.0 (train.py line 19): "``: the innermost frame of the traceback that runs a
    forward of one of ``model``'s modules, so that the user sees which line of theirs reads a
    full width where it gets a rank's share; empty when no such frame is found."""
    names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            file = tb.tb_frame.f_code.co_filename.rsplit("/", 1)[-1]
            found = f"in {names[id(owner)]} ({file} line {tb.tb_lineno}): "
        tb = tb.tb_next
    return found




def unchecked_refusal(model: nn.Module, plan: TPPlan, tp: int, guess: Example | None,
                      unrun: str | None) -> str:
    """Why an inferred plan is refused when the model's forward does not run on the input
    plait guessed (``guess``, None where none could be; ``unrun``: what the forward raised on
    it): one line naming the model, the guess and ``example=``. No "; " before the fix: the
    planner keeps a refusal's first clause (:func:`plait.parallel.tensor.tp_refusal`)."""
    name = type(model).__name__
    tried = describe(model, guess).replace("; ", ", ")
    raised = "" if unrun is None else f", on the first: {unrun}"
    return (f"tp={tp}: the tensor-parallel plan inferred for {name} cannot be checked: its "
            f"forward does not run on any input plait guessed for it (tried {tried}{raised}), "
            f"and a split that does not fit its dataflow would fail at the "
            f"first step, or train wrong, after every parameter is sharded. Pass one batch as "
            f"run.step takes it, run.parallelize(model, example=loader.batch(0)), which the "
            f"plan is checked on, or name the split yourself with Plan(options={{'tp_plan': "
            f"{json.dumps(plan.styles)}}}) (the inferred one)")


def verify_plan(model: nn.Module, plan: TPPlan, tp: int, sp: bool = False,
                example: Example | None = None) -> TPPlan:
    """Check an inferred plan before any sharding; return it, or refuse it (ValueError).

    One fake-tensor forward (:func:`check_shapes`) on an input guessed by
    :func:`example_input` catches a split that changes shapes; then a real forward of each kind
    of block with two ranks' shares swapped (:func:`plait.parallel.tp_verify.mixed_blocks`)
    catches one that keeps them but mixes heads. A fused q|k|v layer guessed to be three blocks
    ``[q | k | v]`` that turns out to be laid out head by head gets a plain column split
    instead (then whole heads). A model whose unsharded forward fails on every input plait
    guesses (a forward of several inputs, images of another size) is refused naming
    ``example=`` (:func:`unchecked_refusal`): neither check can run, and a plan used unchecked
    fails at the first step, after every parameter is sharded, where it does not fit. One
    whose forward fails on the example given, or on fake tensors of a guess because it reads
    values (routing tokens to experts), is not checked (the input is wrong, not the plan).
    With ``sp``, whether sequence parallelism keeps the model the same
    (:mod:`plait.parallel.tp_sp`): the returned plan then supports it, or says why not.
    ``example``: the user's input to run the checks on (:func:`plait.parallel.tp_example.
    from_batch`) in place of a guessed one."""
    from .tensor import match_plan, validate
    from .tp_verify import mixed_blocks

    given = example is not None
    example = example if example is not None else example_call(model)
    if example is None:
        raise ValueError(unchecked_refusal(model, plan, tp, None, None))
    unrun = check_shapes(model, {}, {}, 1, example)
    if unrun is not None and not given and not any(kind in unrun for kind in READS_VALUES):
        # The guess is not the model's input (a forward of several inputs, images of another
        # size): neither check can run, and a split that does not fit fails at the first step
        # (or trains wrong) only after every parameter is sharded and the optimizer built.
        raise ValueError(unchecked_refusal(model, plan, tp, example, unrun))
    if unrun is not None and not sp:
        return plan
    if unrun is not None and any(kind in unrun for kind in READS_VALUES):
        # A routed mixture of experts picks its tokens by value (nonzero, where): no
        # fake-tensor forward, so no check that a sequence split keeps the model the same.
        return replace(plan, sp_refused=(
            f"its forward does not run on fake tensors ({unrun}; a forward that reads values, "
            f"such as one routing tokens to experts by index), so whether splitting the "
            f"sequence keeps the model the same cannot be checked"
            + ("" if given else f"; it ran on a guessed input: if the model takes another, "
               f"{PASS_EXAMPLE}")))
    if unrun is not None:  # the example given; a guess that does not run is refused above
        return replace(plan, sp_refused=(
            f"its forward does not run on the example given ({unrun}), so whether splitting "
            f"the sequence keeps the model the same cannot be checked"))
    matched = match_plan(model, plan.styles)
    divide = {n: a for glob, a in plan.divide_attrs.items()
              for n in match_plan(model, {glob: "divide"})}
    kv = replicated_kv(model, matched, tp)
    matched = {n: "replicated_kv" if n in kv else s for n, s in matched.items()}
    validate(model, plan, matched, tp)  # sizes tp does not divide, by name, before any forward
    error = check_shapes(model, matched, divide, tp, example, kv)
    if error is not None:
        raise ValueError(
            f"the tensor-parallel plan inferred for {type(model).__name__} does not fit its "
            f"dataflow at tp={tp} (a forward with it fails {error}); nothing was sharded. A "
            f"block that splits or reshapes by a width it reads whole (x.shape[-1], a stored "
            f"n_embd) gets 1/tp of it from a column-parallel layer: write -1 or chunk(3, "
            f"dim=-1) there. Or pass Plan(options={{'tp_plan': {{module glob: style}}}}) (the "
            f"inferred one was {json.dumps(plan.styles)})")
    mixed = mixed_blocks(model, matched, tp, example, kv)
    if not mixed:
        return with_sp(model, plan, matched, example) if sp else plan
    fused = {g for g, style in plan.styles.items() if style == "colwise_qkv"}
    if fused:
        styles = {g: "colwise" if g in fused else style for g, style in plan.styles.items()}
        if not mixed_blocks(model, {n: "replicated_kv" if n in kv else s for n, s in
                                    match_plan(model, styles).items()}, tp, example, kv):
            fixed = TPPlan(styles=styles, divide_attrs=plan.divide_attrs, source=plan.source,
                           sizes=plan.sizes, side_inputs=plan.side_inputs,
                           head_outputs=plan.head_outputs)
            return with_sp(model, fixed, match_plan(model, styles), example) if sp else fixed
    raise ValueError(
        f"the tensor-parallel plan inferred for {type(model).__name__} splits "
        f"{', '.join(mixed)} over tp={tp} into parts that are not whole heads (swapping two "
        f"ranks' shares changes what the block computes: a fused layer whose parts are laid "
        f"out some other way, or a weight applied across heads); nothing was sharded. Pass "
        f"Plan(options={{'tp_plan': {{module glob: style}}}}) ('colwise_gather' on a fused "
        f"layer and 'rowwise_split' on its output layer keep it whole on every rank; the "
        f"inferred plan was {json.dumps(plan.styles)})")
