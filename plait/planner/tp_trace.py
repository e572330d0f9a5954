"""What one forward pass of a user's model shows about the tensor-parallel collectives of its
blocks, beyond the layer plan: the dtype each collective travels in under bf16, and which
forward collectives a checkpointed block issues again in backward.

* bf16: plait trains under autocast over fp32 parameters (``plait.train.autocast``), so a
  row-parallel layer's output (a matmul's) is all-reduced in bf16, but the gradient of a
  column-parallel layer's input is all-reduced in that input's dtype, often fp32 (a norm's
  output on the fp32 residual stream), and parameter gradients stay fp32. Where FSDP2 casts the
  parameters to bf16 (``MixedPrecisionPolicy``: ZeRO-2/3, data parallelism over TP shards) the
  residual stream and the parameter gradients are bf16 too. Which is which depends on the
  model's own code, so it is read off a forward pass under each.
* Activation checkpointing (torch's non-reentrant checkpoint) replays a block's forward in
  backward only until the last tensor the block saves for backward is recomputed: a forward
  collective is issued again when the block saves a tensor after it (a LoRA B after a
  row-parallel A, a dropout mask after a row-parallel projection), not otherwise.

The pass runs on fake tensors (no memory, no compute: ``FakeTensorMode``) with the model's own
parameter shapes, on token ids of shape (1, ``seq``), under the autocast rules of the device the
model trains on; it works on the meta device too. Where it fails (the model's forward wants
something else), nothing is returned and the ledger says why it shows no expected column under
bf16 or checkpointing.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .._torch_compat import tree_map_only
from ..parallel.tp_example import Example, tensors_in
from .tp_sizes import FP32, Sizes


@dataclass(frozen=True)
class Trace:
    """What one forward pass showed (:func:`trace`): ``bf16`` under autocast over fp32
    parameters, ``bf16_params`` with the parameters cast to bf16 as FSDP2 does; ``replayed`` /
    ``replayed_gathers``: whether a checkpoint replay issues each forward collective again
    (row-parallel outputs; column-parallel and region inputs' all-gathers under SP)."""

    bf16: Sizes
    bf16_params: Sizes
    replayed: tuple[bool, ...]
    replayed_gathers: tuple[bool, ...]


def _first_tensor(values: Any) -> torch.Tensor | None:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v
        if isinstance(v, (tuple, list)) and v and isinstance(v[0], torch.Tensor):
            return v[0]
    return None


def _size(t: torch.Tensor | None) -> int:
    return t.element_size() if t is not None else FP32


def _pass(model: nn.Module, names: dict[str, nn.Module], seq: int, mode: str, device: str,
          example: Example | None = None
          ) -> tuple[dict[str, tuple[int, int, int, int]], int] | None:
    """One forward on fake tensors on ``device`` under ``mode`` (``fp32``, ``autocast``,
    ``params``): per
    module in ``names`` (input bytes/element, output bytes/element, tensors saved for backward
    before its input, before its output), and the number saved in all."""
    seen: dict[str, list[int]] = {}
    saved = [0]
    hooks = []

    def pre(name: str):
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            t = _first_tensor(list(args) + list(kwargs.values()))
            seen.setdefault(name, [_size(t), FP32, saved[0], saved[0], 0])
        return hook

    def post(name: str):
        def hook(_m: nn.Module, _args: tuple, _kwargs: dict, out: Any) -> None:
            t = _first_tensor([out])
            if name in seen and not seen[name][4]:  # the first call only
                seen[name][1], seen[name][3], seen[name][4] = _size(t), saved[0], 1
        return hook

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += 1
        return t

    try:
        for name, module in names.items():
            hooks.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
            hooks.append(module.register_forward_hook(post(name), with_kwargs=True))
        if not _fake_forward(model, seq, mode, device,
                             lambda: torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
                             example):
            return None
    finally:
        for h in hooks:
            h.remove()
    return {n: (v[0], v[1], v[2], v[3]) for n, v in seen.items()}, saved[0]


def _fake_forward(model: nn.Module, seq: int, mode: str, device: str,
                  around: Any, example: Example | None = None) -> bool:
    """One forward of ``model`` on fake token ids (1, ``seq``), or on fake tensors of the
    shapes and dtypes of ``example`` (the user's input), on ``device`` under ``mode``
    (``fp32``; ``autocast`` over fp32 parameters; ``params``: the parameters cast to bf16, as
    FSDP2's MixedPrecisionPolicy holds them, under autocast), inside the context ``around()``
    makes; False where the forward cannot run on fake tensors."""
    from torch.func import functional_call

    from .._torch_compat import fake_tensor_mode

    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # logs each failed op
    level = quiet.level
    try:
        quiet.setLevel(logging.CRITICAL)
        with fake_tensor_mode()():
            cast = torch.bfloat16 if mode == "params" else None
            state = {n: torch.empty(p.shape, dtype=cast if cast and p.is_floating_point()
                                    else p.dtype, device=device).requires_grad_(p.requires_grad)
                     for n, p in model.named_parameters()}
            state.update({n: torch.empty(b.shape, dtype=b.dtype, device=device)
                          for n, b in model.named_buffers()})
            call = Example((torch.zeros((1, seq), dtype=torch.long, device=device),)
                           ) if example is None else _fake_like(example, device)
            autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=mode != "fp32")
            with around(), autocast:
                functional_call(model, state, call.args, call.kwargs)
    except Exception:  # noqa: BLE001 - a forward the fake pass cannot run: no trace
        return False
    finally:
        quiet.setLevel(level)
    return True


def _fake_like(example: Example, device: str) -> Example:
    """``example``'s tensors as empty ones of their shapes and dtypes on ``device`` (fake
    under a fake mode): the trace reads dtypes and which tensors need a gradient, not values."""
    def like(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(v.shape, dtype=v.dtype, device=device)
    tree_map = tree_map_only()
    return Example(tree_map(torch.Tensor, like, example.args),
                   tree_map(torch.Tensor, like, example.kwargs))


def attention_keys(model: nn.Module, seq: int = 8, device_type: str = "cpu",
                   example: Example | None = None) -> tuple[tuple[int, int, int], ...] | None:
    """What each ``F.scaled_dot_product_attention`` call of one forward receives as keys and
    values, in call order: (features per token of the keys: heads x head_dim, bytes per
    element of a key plus a value under autocast over fp32 parameters, the same with the
    parameters in bf16 as FSDP2 holds them). Context parallelism all-gathers exactly these, so
    their dtypes are the model's own code's to say: a rotary embedding computed in fp32
    promotes autocast's bf16 keys to fp32 and leaves the values bf16 (4 + 2 bytes). None where
    the forward cannot run on fake token ids or the passes disagree on the calls."""
    import contextlib

    import torch.nn.functional as F

    if device_type not in ("cpu", "cuda") or (
            device_type == "cuda" and not torch.cuda.is_available()):
        return None
    runs: dict[str, list[tuple[int, int]]] = {}
    for mode in ("autocast", "params"):
        seen: list[tuple[int, int]] = []

        @contextlib.contextmanager
        def record(seen: list[tuple[int, int]] = seen) -> Any:
            original = F.scaled_dot_product_attention

            def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          *args: Any, **kwargs: Any) -> torch.Tensor:
                seen.append((key.shape[-3] * key.shape[-1] if key.ndim >= 3 else key.shape[-1],
                             key.element_size() + value.element_size()))
                return original(query, key, value, *args, **kwargs)

            F.scaled_dot_product_attention = attention
            try:
                yield
            finally:
                F.scaled_dot_product_attention = original

        if not _fake_forward(model, seq, mode, device_type, record, example):
            return None
        runs[mode] = seen
    auto, params = runs["autocast"], runs["params"]
    if len(auto) != len(params) or any(a[0] != p[0] for a, p in zip(auto, params, strict=True)):
        return None
    return tuple((a[0], a[1], p[1]) for a, p in zip(auto, params, strict=True))


def trace(model: nn.Module, block: str, forward: list[str], backward: list[str],
          ends: dict[str, str], seq: int, device_type: str = "cpu",
          example: Example | None = None) -> Trace | None:
    """Trace the block at ``block`` whose forward collectives follow the layers ``forward``
    (row-parallel: their outputs) and whose backward ones precede ``backward`` (column-parallel
    layers and regions: their inputs); ``ends``: module paths of the ``embed`` (vocabulary
    embedding), ``head`` (vocabulary head), ``first`` and ``last`` blocks of the stack, where the
    model has them; ``device_type``: whose autocast rules apply (they differ: CUDA runs norms
    and softmax in fp32, the CPU in bf16), where torch can run them (CPU; CUDA where a GPU is
    present). None where the forward cannot run on fake token ids (or on fake tensors like
    ``example``, the user's input, where one is given)."""
    if device_type not in ("cpu", "cuda") or (
            device_type == "cuda" and not torch.cuda.is_available()):
        return None
    names = {n: model.get_submodule(n) for n in {block, *forward, *backward, *ends.values()}}
    runs = {mode: _pass(model, names, seq, mode, device_type, example)
            for mode in ("fp32", "autocast", "params")}
    if any(r is None for r in runs.values()):
        return None
    got = {mode: r[0] for mode, r in runs.items() if r is not None}
    if any(n not in seen for seen in got.values() for n in names):
        return None  # a layer the forward never called: not the block the plan describes

    def sizes(mode: str) -> Sizes:
        seen = got[mode]

        def end(key: str, index: int, default: int) -> int:
            return seen[ends[key]][index] if key in ends else default

        grads = 2 if mode == "params" else FP32
        return Sizes(forward=tuple(seen[n][1] for n in forward),
                     backward=tuple(seen[n][0] for n in backward),
                     embed_out=end("embed", 1, seen[block][0]),
                     head_in=end("head", 0, seen[block][1]),
                     stack_in=end("first", 0, seen[block][0]),
                     stack_out=seen[block][1], grads=grads)

    seen = got["fp32"]
    last = seen[block][3]  # tensors saved by the end of the block's forward
    return Trace(bf16=sizes("autocast"), bf16_params=sizes("params"),
                 replayed=tuple(seen[n][3] < last for n in forward),
                 replayed_gathers=tuple(seen[n][2] < last for n in backward))


def needs_grad(model: nn.Module, inputs: list[str], outputs: list[str], seq: int = 4,
               device_type: str = "cpu", example: Example | None = None
               ) -> tuple[dict[str, bool], dict[str, bool]] | None:
    """Which tensor-parallel collectives the backward pass issues, read off one fp32 forward
    on fake tensors with the parameters' own ``requires_grad``: per module of ``inputs``
    (column-parallel layers and regions: their input's gradient is all-reduced, under SP
    reduce-scattered) whether its input requires grad, and per module of ``outputs``
    (row-parallel layers: under SP their output's gradient is all-gathered) whether its output
    does, at each one's first call.

    Autograd records a collective's backward only where its input requires grad, which the
    model's own code decides: a frozen attention behind a frozen norm, on a stream nothing
    before it trains, receives no gradient while the MLP after it does. None where the
    forward cannot run on fake token ids or does not call every module named."""
    if device_type not in ("cpu", "cuda") or (
            device_type == "cuda" and not torch.cuda.is_available()):
        device_type = "cpu"  # requires_grad follows no device's rules: any will do
    into: dict[str, bool] = {}
    out_of: dict[str, bool] = {}
    hooks = []

    def pre(name: str) -> Any:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            into.setdefault(name, any(t.requires_grad for t in tensors_in((args, kwargs))))
        return hook

    def post(name: str) -> Any:
        def hook(_m: nn.Module, _args: tuple, out: Any) -> None:
            out_of.setdefault(name, any(t.requires_grad for t in tensors_in(out)))
        return hook

    try:
        for name in dict.fromkeys(inputs):
            hooks.append(model.get_submodule(name).register_forward_pre_hook(
                pre(name), with_kwargs=True))
        for name in dict.fromkeys(outputs):
            hooks.append(model.get_submodule(name).register_forward_hook(post(name)))
        if not _fake_forward(model, seq, "fp32", device_type, contextlib.nullcontext,
                             example):
            return None
    finally:
        for h in hooks:
            h.remove()
    if any(n not in into for n in inputs) or any(n not in out_of for n in outputs):
        return None
    return into, out_of
