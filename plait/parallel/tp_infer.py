"""Infer a tensor-parallel plan for a model that has none, from its structure (torch.fx).

A Megatron TP region is a block whose input feeds one or more linears (split column-wise) whose
outputs — through element-wise ops, reshapes or attention — feed exactly one linear that produces
the block's output (split row-wise). That is what both an MLP (up[, gate] -> act -> down) and an
attention block (q, k, v -> attention -> o) look like in a dataflow graph, whatever the modules
are called. So for every module with at least two direct ``nn.Linear`` children, we trace its
``forward`` with ``torch.fx.symbolic_trace`` and check that shape:

* entry linears read the block's (single) input directly; they become ``colwise``;
* one exit linear reads only values derived from the entry linears and its output reaches the
  block's output; it becomes ``rowwise``;
* no other linear, and no path from the input to the exit that bypasses the entries.

Several entries sharing the input also make the block a ``region`` (one backward all-reduce).
An attention block (softmax/SDPA/matmul in the graph) with an integer head-count attribute gets
that attribute divided by tp (``divide_attrs``), since its reshape must use the local count.
An ``nn.Embedding`` with a Linear of the same vocabulary size outside any block becomes
``vocab_embedding`` + ``vocab_head``.

Inference refuses (ValueError, naming the module and the reason) when a candidate block cannot be
traced or does not have that shape: a wrong guess would train a different model silently.
"""

from __future__ import annotations

import json
import operator
import re

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .tp_plans import TPPlan

_ATTENTION_FUNCS = {F.scaled_dot_product_attention, F.softmax, torch.softmax, torch.matmul,
                    torch.bmm, operator.matmul}
_ATTENTION_METHODS = {"softmax", "matmul", "bmm"}
_HEAD_ATTRS = ("n_heads", "num_heads", "n_head", "num_attention_heads", "n_kv_heads",
               "num_kv_heads", "num_key_value_heads", "heads")


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


def analyse_block(block: nn.Module, name: str) -> dict[str, str] | str:
    """{child name: style} if ``block`` is a TP region, else the reason it is not."""
    linears = {n for n, m in block.named_children() if isinstance(m, nn.Linear)}
    try:
        graph = fx.symbolic_trace(block).graph
    except Exception as exc:  # noqa: BLE001 - fx raises anything; data-dependent control flow, unsupported calls, ...
        return f"torch.fx cannot trace it ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    calls = {n: n.target for n in graph.nodes if n.op == "call_module" and n.target in linears}
    if len(set(calls.values())) != len(calls):
        return "a linear is called more than once"
    unused = linears - set(calls.values())
    if unused:
        return f"linear(s) {sorted(unused)} are not used in forward"
    nodes = set(calls)
    output = next(n for n in graph.nodes if n.op == "output")
    # Graph order, not set order: every rank must apply the styles in the same order.
    entries = [n for n in graph.nodes if n in nodes and n.args and n.args[0] in inputs]
    if not entries or len({n.args[0] for n in entries}) != 1:
        return "its linears do not read one shared block input"
    source = entries[0].args[0]
    exits = [n for n in graph.nodes if n in nodes and output in _reaches(n, nodes)]
    if len(exits) != 1 or exits[0] in entries:
        return (f"{len(exits)} linears produce the block output directly"
                if len(exits) != 1 else "the output linear reads the block input directly")
    exit_node = exits[0]
    middle = nodes - set(entries) - {exit_node}
    if middle:
        return f"linear(s) {sorted(calls[n] for n in middle)} sit between the entry and exit"
    for entry in entries:
        if exit_node not in _reaches(entry, nodes):
            return f"{calls[entry]} does not feed the output linear {calls[exit_node]}"
    if exit_node in _reaches(source, set(entries)):
        return "the block input reaches the output linear without passing an entry linear"
    styles = {calls[n]: "colwise" for n in entries}
    styles[calls[exit_node]] = "rowwise"
    if len(entries) > 1:
        styles[""] = "region"
    attention = any((n.op == "call_function" and n.target in _ATTENTION_FUNCS)
                    or (n.op == "call_method" and n.target in _ATTENTION_METHODS)
                    for n in graph.nodes)
    styles["__kind__"] = "attention" if attention else "mlp"
    return styles


def _globs(entries: dict[str, str]) -> dict[str, str]:
    """Collapse layer indices (``blocks.3.mlp`` -> ``blocks.*.mlp``) where the styles agree."""
    grouped: dict[str, set[str]] = {}
    for name, style in entries.items():
        grouped.setdefault(re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name), set()).add(style)
    out = {}
    for name, style in entries.items():
        glob = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name)
        out[glob if len(grouped[glob]) == 1 else name] = style
    return out


def infer_plan(model: nn.Module) -> TPPlan:
    """Propose a TP plan for ``model``; ValueError where it cannot decide (see module docs)."""
    styles: dict[str, str] = {}
    divide: dict[str, tuple[str, ...]] = {}
    sizes: dict[str, int] = {}
    refused = []
    in_blocks: set[str] = set()
    for name, block in model.named_modules():
        n_lin = sum(isinstance(m, nn.Linear) for m in block.children())
        if n_lin < 2:
            continue
        result = analyse_block(block, name)
        label = name or type(model).__name__
        if isinstance(result, str):
            refused.append(f"{label} ({type(block).__name__}): {result}")
            continue
        kind = result.pop("__kind__")
        for child, style in result.items():
            full = f"{name}.{child}".strip(".") if child else name
            if not full:
                refused.append(f"{label}: the model itself is a block; wrap it in a module")
                continue
            styles[full] = style
            in_blocks.add(full)
        if kind == "attention":
            attrs = tuple(a for a in _HEAD_ATTRS if isinstance(getattr(block, a, None), int))
            if attrs and name:
                divide[name] = attrs
            for a in attrs:
                sizes[f"{type(block).__name__}.{a}"] = getattr(block, a)
    if refused:
        raise ValueError(
            f"cannot infer a tensor-parallel plan for {type(model).__name__}: "
            + "; ".join(refused) + ". Pass Plan(options={'tp_plan': {module glob: style}}) "
            "(styles: colwise, rowwise, region, vocab_embedding, vocab_head, sequence_parallel)")
    if not styles:
        raise ValueError(
            f"cannot infer a tensor-parallel plan for {type(model).__name__}: no module has the "
            f"shape of an MLP or attention block (two or more nn.Linear children, input -> "
            f"column-parallel linears -> one row-parallel linear -> output). Pass "
            f"Plan(options={{'tp_plan': {{module glob: style}}}})")
    embeddings = {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) and n not in in_blocks and n not in styles:
            for en, emb in embeddings.items():
                if emb.num_embeddings == m.out_features and emb.embedding_dim == m.in_features:
                    styles[en], styles[n] = "vocab_embedding", "vocab_head"
    joined = _globs({k: "|".join(v) for k, v in divide.items()})
    divide_globs = {g: tuple(attrs.split("|")) for g, attrs in joined.items()}
    return TPPlan(styles=_globs(styles), divide_attrs=divide_globs,
                  source=f"inferred from {type(model).__name__}'s structure", sizes=sizes)


def format_plan(plan: TPPlan, model: nn.Module) -> str:
    return (f"plait: no tensor-parallel plan ships for {type(model).__name__}; this one was "
            f"inferred from its structure. Check it, then save it as options.tp_plan:\n"
            + json.dumps(plan.to_dict(), indent=2))
