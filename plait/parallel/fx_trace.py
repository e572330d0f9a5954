"""Tracing a user's module with torch.fx without changing it.

fx runs the module's forward on proxies, and on the real tensors where the forward reads its
module's attributes. A forward that writes to its module (a step counter ``self.count += 1``, a
cache ``self.last = h``) then changes the user's model: a buffer reassigned from a proxy becomes
an ``fx.Proxy`` (the next ``model.to(device)`` fails with fx's "symbolically traced variables
cannot be used as inputs to control flow"), one updated in place from plain values takes one
more update than training makes. :func:`trace_kept` traces and puts every module's attributes,
parameters, buffers (their values too) and children back as they were.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

_REGISTRIES = ("_parameters", "_buffers", "_modules")


def trace_kept(tracer: fx.Tracer, module: nn.Module) -> fx.Graph:
    """``tracer.trace(module)``, with ``module`` and its submodules left as they were (the
    registries put back in place, as shallow copies of the model may share them; a buffer
    written in place gets its value back)."""
    saved: list[tuple[nn.Module, dict[str, Any], list[dict[str, Any]]]] = [
        (m, dict(m.__dict__), [dict(getattr(m, r)) for r in _REGISTRIES])
        for m in module.modules()]
    values = [(b, b._version, b.detach().clone()) for b in module.buffers()]
    try:
        return tracer.trace(module)
    finally:
        for m, attrs, registries in saved:
            for name, kept in zip(_REGISTRIES, registries, strict=True):
                registry = attrs[name]
                # by identity: comparing a Proxy left there would be traced
                if registry.keys() != kept.keys() or any(registry[k] is not v
                                                         for k, v in kept.items()):
                    registry.clear()
                    registry.update(kept)
            for key in [k for k in m.__dict__ if k not in attrs]:
                del m.__dict__[key]
            for key, value in attrs.items():
                if m.__dict__.get(key) is not value:
                    m.__dict__[key] = value
        with torch.no_grad():
            for buffer, version, value in values:
                if buffer._version != version:
                    buffer.copy_(value)
