"""The dataflow graph of a block that torch.fx cannot trace, recorded by running it once.

``torch.fx.symbolic_trace`` runs a forward on proxies, so a forward that branches on its input
(``if src.dim() != 3`` in torch's own ``nn.TransformerEncoderLayer``, mask canonicalisation,
fast-path checks) cannot be traced. Running the model once on fake tensors (shapes, no memory,
no compute) takes every branch concretely; this module records what the block's call computed
as the fx graph symbolic tracing would have produced:

* a placeholder per tensor input of the block;
* a ``call_module`` node per call of a submodule fx would keep whole: ``nn.Linear`` and the
  other ``torch.nn`` modules (norms, ``nn.MultiheadAttention``), and any module without a
  linear; nothing is recorded inside it;
* a ``call_function`` / ``call_method`` node per torch function or tensor method that returns
  a tensor, with tensors it read as arguments (a parameter of the block read directly is a
  ``get_attr`` node, as in a traced graph);
* the output node.

Only data dependencies are kept: arguments that are not recorded tensors become None. That is
all :func:`plait.parallel.tp_infer.analyse_block` reads, so a recorded block gets the same
verdict its traced graph would get.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from .._torch_compat import fake_tensor_mode

if TYPE_CHECKING:
    from .tp_example import Example


def _kept_whole(m: nn.Module) -> bool:
    """What :class:`torch.fx.Tracer` keeps as one ``call_module`` node by default (torch.nn
    modules but ``Sequential``), and what plait's tracer also keeps whole: linears (subclasses
    included), LoRA layers (:mod:`plait.parallel.tp_lora`) and modules without a linear."""
    from .tp_lora import low_rank_parts

    torch_nn = m.__module__.startswith(("torch.nn", "torch.ao.nn")) and not isinstance(
        m, nn.Sequential)
    return torch_nn or isinstance(m, nn.Linear) or not any(
        isinstance(sub, nn.Linear) for sub in m.modules()) or low_rank_parts(m) is not None


class _Recording:
    """One block's first call, as an fx graph (``graph`` once the call returned)."""

    def __init__(self, block: nn.Module):
        self.block = block
        self.names = {id(m): n for n, m in block.named_modules()}
        self.params = {id(p): n for n, p in block.named_parameters()}
        self.graph: fx.Graph | None = None
        self.done = False
        self.nodes: dict[int, fx.Node] = {}
        self.keep: list[torch.Tensor] = []  # ids stay unique while recorded tensors live
        # Per submodule call: (its ops are not recorded, its inputs when it is one node).
        self.stack: list[tuple[bool, Any]] = []

    @property
    def live(self) -> bool:
        return self.graph is not None and not self.done

    @property
    def quiet(self) -> bool:
        """Inside a submodule recorded whole: its own ops are not recorded."""
        return any(muted for muted, _ in self.stack)

    def arg(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            node = self.nodes.get(id(value))
            if node is None and id(value) in self.params and self.graph is not None:
                # A parameter read by an op, as fx's get_attr: where a region uses a weight.
                node = self.nodes[id(value)] = self.graph.get_attr(self.params[id(value)])
            return node
        if isinstance(value, list):
            return [self.arg(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.arg(v) for v in value)
        if isinstance(value, dict):
            return {k: self.arg(v) for k, v in value.items()}
        return None

    def bind(self, output: Any, node: fx.Node) -> bool:
        """Map every tensor in ``output`` to ``node``; False when there is none."""
        found = False
        if isinstance(output, torch.Tensor):
            self.nodes[id(output)] = node
            self.keep.append(output)
            return True
        if isinstance(output, (tuple, list)):
            for v in output:
                found = self.bind(v, node) or found
        elif isinstance(output, dict):
            for v in output.values():
                found = self.bind(v, node) or found
        return found

    def enter(self, m: nn.Module, args: tuple, kwargs: dict) -> None:
        if m is self.block and self.graph is None:
            self.graph = fx.Graph()
            for i, v in enumerate([*args, *kwargs.values()]):
                if isinstance(v, torch.Tensor):
                    self.bind(v, self.graph.placeholder(f"input_{i}"))
            return
        if self.live and m is not self.block:
            whole = not self.quiet and _kept_whole(m)
            self.stack.append((whole or self.quiet, (args, kwargs) if whole else None))

    def leave(self, m: nn.Module, output: Any) -> None:
        if not self.live:
            return
        if m is self.block:
            assert self.graph is not None
            self.graph.output(self.arg(output))
            self.done = True
            return
        _, inputs = self.stack.pop()
        if inputs is not None:
            assert self.graph is not None
            args, kwargs = inputs
            node = self.graph.call_module(self.names[id(m)], self.arg(args), self.arg(kwargs))
            self.bind(output, node)

    def op(self, func: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if not self.live or self.quiet:
            return
        assert self.graph is not None
        name = getattr(func, "__name__", "")
        if getattr(torch.Tensor, name, None) is func:
            node = self.graph.call_method(name, self.arg(args), self.arg(kwargs))
        else:
            node = self.graph.call_function(func, self.arg(args), self.arg(kwargs))
        if not self.bind(output, node):
            self.graph.erase_node(node)


@contextlib.contextmanager
def quiet_logger(logger_name: str) -> Iterator[None]:
    """Raise one of torch's loggers to CRITICAL for the duration (what it would say is
    expected and not the user's to act on)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def fake_forward(model: nn.Module) -> Iterator[None]:
    """For the duration, a forward of ``model`` runs on fake tensors (shapes and dtypes, no
    memory, no compute) without autograd, and leaves the model as it was: under FakeTensorMode
    a training-mode forward's in-place update of running statistics can still reach a real
    buffer, so buffers are put back. FakeTensorMode logs a failing op's stack at ERROR level;
    callers take the error itself, so that log is silenced."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with fake_tensor_mode()(allow_non_fake_inputs=True), torch.no_grad(), \
                quiet_logger("torch._subclasses.fake_tensor"):
            yield
    finally:
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)


class _Watch(TorchFunctionMode):
    def __init__(self, recordings: list[_Recording]):
        super().__init__()
        self.recordings = recordings

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        for r in self.recordings:
            r.op(func, args, kwargs, output)
        return output


def record_blocks(model: nn.Module, blocks: dict[str, nn.Module],
                  example: torch.Tensor | Example, failed: list[str] | None = None
                  ) -> dict[str, fx.Graph]:
    """{name: graph} for each of ``blocks`` that ``model(example)`` calls, recorded in one
    fake-tensor forward (nothing computed, the model left as it was: buffers a training-mode
    forward updates in place are put back). Blocks the forward does not reach, or all of them
    when it raises, are left out; ``failed`` then gets what it raised, one line."""
    from .tp_example import run_on

    recordings = {name: _Recording(block) for name, block in blocks.items()}
    handles = []
    for r in recordings.values():
        for m in r.block.modules():
            handles.append(m.register_forward_pre_hook(
                lambda mod, a, kw, r=r: r.enter(mod, a, kw), with_kwargs=True))
            handles.append(m.register_forward_hook(
                lambda mod, a, out, r=r: r.leave(mod, out), always_call=True))
    try:
        with fake_forward(model), _Watch(list(recordings.values())):
            run_on(model, example)
    except Exception as exc:  # noqa: BLE001 - not runnable on the input: nothing recorded
        if failed is not None:
            failed.append(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:160])
        return {}
    finally:
        for h in handles:
            h.remove()
    return {name: r.graph for name, r in recordings.items() if r.done and r.graph is not None}
