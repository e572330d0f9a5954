"""Grouped-query attention with fewer key/value heads than tp: which layers replicate them.

Column parallelism gives each rank whole heads of every projection, so tp must divide the
number of kv heads. Models with few of them would cap tp there: multi-query attention (one kv
head: Gemma-2B, Falcon-7B, PaLM) or small GQA models (Qwen2.5-0.5B has 2). With K kv heads,
H query heads and tp = g·K, query head i reads kv head i // (H/K) (``repeat_kv``, and SDPA's
``enable_gqa``), so rank r's H/tp query heads all read kv head r // g. The k and v
projections then stay whole on every rank and each rank computes only that head (style
``replicated_kv``, :class:`plait.parallel.tensor._ReplicatedKV`); each rank's gradient covers
that head's rows as seen from its own query heads, so the gradients are summed over tp in
backward and every copy stays the same. Megatron-LM and vLLM replicate kv heads the same way.
Cost: the k/v weights are not divided by tp (2·K·head_dim·hidden per layer on every rank) and
their gradient is all-reduced over tp once per backward.

The attention module then sees one kv head per rank: its stored kv-head count becomes 1 and
its stored group size (query heads per kv head, transformers' ``num_key_value_groups``) H/tp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.nn as nn

# Attributes attention modules store their kv-head count in, and their query heads per kv head.
KV_COUNT_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads", "n_kv_head")
GROUP_ATTRS = ("num_key_value_groups", "num_kv_groups", "n_rep")
_Q_COUNT_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "heads")


@dataclass(frozen=True)
class KVHeads:
    """A k or v projection whose heads are fewer than tp: ``heads`` of ``head_dim`` features."""

    heads: int
    head_dim: int

    def rows(self, rank: int, tp: int) -> slice:
        """The output features (weight rows) rank ``rank`` of ``tp`` computes: one head."""
        head = rank // (tp // self.heads)
        return slice(head * self.head_dim, (head + 1) * self.head_dim)


def owner_head_dim(owner: nn.Module) -> int | None:
    """head_dim of an attention module, as it stores it (None when it does not)."""
    return _int_attr(owner, ("head_dim", "attention_head_size"))


def replicated_kv(model: nn.Module, matched: dict[str, str], tp: int) -> dict[str, KVHeads]:
    """{name: KVHeads} for the ``colwise`` linears of ``matched`` that hold K < tp kv heads, tp
    a multiple of K, in an attention module that says it has grouped kv heads (a stored kv-head
    count or group size) and whose query projection tp splits into whole heads. Anything else
    is left to the usual checks."""
    import torch.nn as nn

    by_owner: dict[str, list[str]] = {}
    for name, style in matched.items():
        owner, _, _ = name.rpartition(".")
        if style == "colwise" and owner and isinstance(model.get_submodule(name), nn.Linear):
            by_owner.setdefault(owner, []).append(name)
    out: dict[str, KVHeads] = {}
    for owner, names in by_owner.items():
        features: dict[str, int] = {n: model.get_submodule(n).out_features  # type: ignore[misc]
                                    for n in names}
        found = _grouped_heads(model.get_submodule(owner), set(features.values()))
        if found is None:
            continue
        q, k, head_dim = found
        if k < tp and tp % k == 0 and q % tp == 0:
            out.update({n: KVHeads(k, head_dim) for n, f in features.items()
                        if f == k * head_dim})
    return out


def _int_attr(owner: nn.Module, names: tuple[str, ...]) -> int | None:
    for attr in names:
        value = getattr(owner, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _grouped_heads(owner: nn.Module, widths: set[int]) -> tuple[int, int, int] | None:
    """(query heads, kv heads, head_dim) of an attention module with fewer kv heads than query
    heads, read from what it stores (head_dim, head counts, group size) and the widths of its
    column-parallel layers; None when it does not say so."""
    q_heads = _int_attr(owner, _Q_COUNT_ATTRS)
    kv_heads = _int_attr(owner, KV_COUNT_ATTRS)
    group = _int_attr(owner, GROUP_ATTRS)
    if kv_heads is None and group is None:
        return None  # no sign of grouped kv heads
    stored = owner_head_dim(owner)
    dims = [stored] if stored else sorted({w // q_heads for w in widths
                                           if q_heads and w % q_heads == 0})
    for head_dim in dims:
        heads = {w // head_dim for w in widths if w % head_dim == 0}
        if not heads:
            continue
        q = q_heads or max(heads)
        k = kv_heads or (q // group if group and q % group == 0 else None)
        if k and k < q and q in heads and k in heads:
            return q, k, head_dim
    return None


def local_attrs(owner: nn.Module, kv: KVHeads, tp: int) -> dict[str, int]:
    """The head-count attributes of ``owner`` (the attention module) as one rank sees them
    with its kv heads replicated: one kv head, H/tp query heads per kv head."""
    out = {}
    for attr in KV_COUNT_ATTRS:
        if getattr(owner, attr, None) == kv.heads:
            out[attr] = 1
    for attr in GROUP_ATTRS:
        value = getattr(owner, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value * kv.heads % tp == 0:
            out[attr] = value * kv.heads // tp
    return out


def owners(kv: dict[str, KVHeads]) -> dict[str, KVHeads]:
    """{attention module name: its KVHeads} for the layers of :func:`replicated_kv`."""
    return {name.rpartition(".")[0]: heads for name, heads in kv.items()}


def tp_fits_kv(kv_heads: int, tp: int) -> bool:
    """Whether ``tp`` works with ``kv_heads``: it divides them (each rank holds whole kv heads)
    or is a multiple of them (each rank computes one, replicated)."""
    return kv_heads % tp == 0 or tp % kv_heads == 0


def replicated_kv_elements(hidden: int, kv_heads: int, head_dim: int, tp: int) -> int:
    """Weight elements of one block's k and v projections that stay whole on every rank at
    ``tp`` (0 where tp divides the kv heads and they are split like the rest)."""
    return 2 * hidden * kv_heads * head_dim if 0 < kv_heads < tp else 0
