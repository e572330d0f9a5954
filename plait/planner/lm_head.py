"""Whether a language model's head reads every token of its main stack's output, told from
the model's code alone.

A model whose parameters outside its blocks are embeddings, norms and one hidden x vocab
``Linear`` is priced by the formula, 2 x hidden x vocab per token, without a forward: any
forward of it (an ``nn.Embedding`` on fake or meta tensors) imports ``torch._dynamo``, most
of a second of a ``plait plan``. The same parameters may be a classifier on one pooled token
(the mean over the tokens, the first token), whose FLOPs are per row. ``torch.fx``'s symbolic
trace (no op runs, no dynamo) shows what lies between the last block and the head: only
per-token ops (a norm, a dropout, an activation, an elementwise op) keep the formula; anything
else (a mean over the tokens, an index, a reshape) has the head counted on one forward
(:mod:`plait.planner.outside_flops`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

# Ops that act on each token alone: between the last block and the head, they keep the
# head's input one row per token.
_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
              "add", "sub", "mul", "div", "neg", "tanh", "relu", "gelu", "silu", "sigmoid",
              "dropout", "layer_norm", "rms_norm", "float", "to", "type_as", "contiguous",
              "clone", "detach", "rsqrt", "sqrt", "pow"}


def _per_token(target: Any) -> bool:
    name = target if isinstance(target, str) else getattr(target, "__name__", None)
    return target in _FUNCTIONS or name in _FUNCTIONS


def reads_every_token(model: Any, last: Any, head: Any, blocks: Sequence[Any] = ()
                      ) -> bool | None:
    """Whether ``head`` reads every token ``last`` (the main stack's last block) hands on:
    True where only per-token ops (a module without a matrix: a norm, a dropout, an
    activation; an elementwise function or method) lie between them; False where anything
    else does, or the head reads something else; None where ``model`` does not trace
    (``torch.fx``: a forward with data-dependent control flow), so its code says nothing.
    ``blocks`` (every block of the stacks) are traced as leaves too: what lies inside a block
    (a shape read off its input) says nothing about the head."""
    import torch.fx as fx

    names = {id(m): n for n, m in model.named_modules()}
    leaves = {id(last), id(head), *map(id, blocks)}

    class _Tracer(fx.Tracer):
        def is_leaf_module(self, m: Any, name: str) -> bool:
            return id(m) in leaves or super().is_leaf_module(m, name)

    try:
        graph = _Tracer().trace(model)
    except Exception:  # noqa: BLE001 - a forward fx cannot trace says nothing
        return None
    calls = {n.target: n for n in graph.nodes if n.op == "call_module"}
    block, start = calls.get(names.get(id(last), "")), calls.get(names.get(id(head), ""))
    if block is None or start is None:
        return False
    seen, todo = set(), [a for a in start.all_input_nodes]
    while todo:
        node = todo.pop()
        if node is block or node in seen:
            continue
        seen.add(node)
        if node.op == "get_attr":
            continue
        if node.op == "call_module":
            module = model.get_submodule(str(node.target))
            if any(p.ndim > 1 for p in module.parameters()):
                return False
        elif node.op == "call_function" and node.target is operator.getitem:
            # the first output of a block that returns a tuple, not an index into the tokens
            if node.args[0] is not block or not isinstance(node.args[1], int):
                return False
        elif node.op not in ("call_function", "call_method") or not _per_token(node.target):
            return False
        todo.extend(node.all_input_nodes)
    return True
