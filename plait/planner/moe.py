"""Routed mixture-of-experts layers, as the planner prices them: a token's compute passes through
the k experts its router picks of the layer's E (and the router), while memory, gradients and
the optimizer hold all E experts.

A routed layer is a module with an ``experts`` child, either

* an ``nn.ModuleList`` of E experts (Mixtral-style code written by hand, older transformers), or
* one module holding the E experts' weights stacked in 3-D parameters, (E, out, in) each
  (transformers' fused experts: ``gate_up_proj``, ``down_proj``).

Its top-k is read where models keep it: an attribute of the layer or of its router
(``top_k``, ``num_experts_per_tok``), else the model's Hugging Face config
(``num_experts_per_tok``). A layer whose top-k is found nowhere is priced with every expert
active, as a dense layer would be.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "moe_top_k", "router_topk")


@dataclass(frozen=True)
class Routed:
    """One routed layer of a block. Counts are over all E experts."""

    path: str             # the layer's name inside its block
    experts: int          # E
    top_k: int | None     # None: not found anywhere, every expert priced as active
    expert_matmul: int    # matmul weights of the E experts
    expert_params: int    # every parameter of the E experts (biases included)
    extra_matmul: int     # matmul weights no nn.Linear holds: stacked experts, a bare router

    @property
    def idle_fraction(self) -> float:
        """Fraction of the experts' weights a token does not pass through."""
        return 1.0 - self.top_k / self.experts if self.top_k else 0.0


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def config_top_k(model: Any) -> int | None:
    """``num_experts_per_tok`` of the first Hugging Face config among the model's modules."""
    for module in model.modules():
        k = _int(getattr(getattr(module, "config", None), "num_experts_per_tok", None))
        if k:
            return k
    return None


def _top_k(layer: Any) -> int | None:
    for module in (layer, *layer.children()):
        for attr in TOP_K_ATTRS:
            k = _int(getattr(module, attr, None))
            if k:
                return k
    return None


def routed_layers(block: Any, is_matmul: Callable[[Any], bool], default_top_k: int | None,
                  where: str = "block") -> list[Routed]:
    """The routed layers of ``block``. ``is_matmul``: whether a module is a matmul layer the
    caller already counts (nn.Linear and the like); ``default_top_k``: the model config's."""
    import torch.nn as nn

    found = []
    for path, layer in block.named_modules():
        experts = getattr(layer, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        stacked = [p for p in experts.parameters() if p.ndim == 3]
        if isinstance(experts, nn.ModuleList) and len(experts) >= 2:
            count = len(experts)
            inner: list[Any] = [m for m in experts.modules() if is_matmul(m)]
            matmul = sum(int(m.weight.numel()) for m in inner)
            extra = 0
        elif stacked and len({p.shape[0] for p in stacked}) == 1 and stacked[0].shape[0] >= 2:
            count = int(stacked[0].shape[0])
            matmul = extra = sum(p.numel() for p in stacked)
        else:
            continue
        for child in layer.children():  # a router that is no nn.Linear: a bare (E, h) weight
            weight = getattr(child, "weight", None)
            if child is not experts and not is_matmul(child) and \
                    isinstance(weight, nn.Parameter) and weight.ndim == 2 and \
                    weight.shape[0] == count:
                extra += weight.numel()
        k = _top_k(layer) or default_top_k
        if k is not None and not 1 <= k <= count:
            raise ValueError(f"{where}: the routed layer {path or type(layer).__name__!r} sends "
                             f"each token to top_k={k} of its {count} experts; top_k must be "
                             f"between 1 and {count}")
        found.append(Routed(path, count, k, matmul, sum(p.numel() for p in experts.parameters()),
                            extra))
    return found


def summary(layers: Iterable[Routed]) -> tuple[int, int] | None:
    """(top-k, experts) of a model's routed layers, the first one's where they differ; None
    where there are none or no top-k was found."""
    priced = [r for r in layers if r.top_k]
    return (priced[0].top_k, priced[0].experts) if priced else None  # type: ignore[return-value]
