"""Tensor parallelism for low-rank adapters (LoRA): a linear with a trainable side path.

A LoRA layer computes ``base(x) + B(A(x))`` (times a scale, after a dropout): ``base`` is the
frozen (in -> out) linear, ``A`` maps in -> r and ``B`` maps r -> out, r much smaller. Where the
plan splits the base linear, the side path must give each rank the same share of ``out``:

* base column-parallel (each rank computes its heads of ``out``): ``B`` column-parallel too,
  ``A`` whole on every rank (it reads the whole input, as the base does; its r outputs are
  what every rank's ``B`` share needs);
* base row-parallel (each rank holds a slice of ``in`` and the outputs are summed): ``A``
  row-parallel too (its r outputs are summed the same way, r numbers per position), ``B``
  whole on every rank, fed the summed r.

So the inferred plan treats a LoRA layer as one linear when it finds the blocks' regions, and
names its parts with these styles. Any module whose only linears are such a triple is taken
for one, the hand-written kind (``self.base``, ``self.A``, ``self.B``) and PEFT's
(``base_layer``, ``lora_A["default"]``, ``lora_B["default"]``) alike; what it computes is
checked like every inferred plan, by running the blocks with ranks' shares swapped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class LowRank:
    """Names (relative to the layer) of a LoRA layer's base linear and its A and B."""

    base: str
    a: str
    b: str


def low_rank_parts(module: nn.Module) -> LowRank | None:
    """The base, A and B of ``module`` when it is a LoRA layer: exactly three linears below it,
    none of them ``module`` itself, shaped (in -> out), (in -> r) and (r -> out) with r below
    both in and out; else None."""
    if isinstance(module, nn.Linear):
        return None
    linears = {n: m for n, m in module.named_modules() if n and isinstance(m, nn.Linear)}
    if len(linears) != 3:
        return None
    for base, lin in linears.items():
        rest = {n: m for n, m in linears.items() if n != base}
        a = [n for n, m in rest.items() if m.in_features == lin.in_features
             and m.out_features < min(lin.in_features, lin.out_features)]
        b = [n for n, m in rest.items() if m.out_features == lin.out_features
             and m.in_features < min(lin.in_features, lin.out_features)]
        if len(a) == 1 and len(b) == 1 and a != b and \
                linears[a[0]].out_features == linears[b[0]].in_features:
            return LowRank(base, a[0], b[0])
    return None


def base_linear(module: nn.Module) -> nn.Linear | None:
    """``module`` if it is a linear, the base linear of a LoRA layer, else None."""
    if isinstance(module, nn.Linear):
        return module
    parts = low_rank_parts(module)
    if parts is None:
        return None
    base = module.get_submodule(parts.base)
    assert isinstance(base, nn.Linear)
    return base


def expand(style: str, parts: LowRank) -> dict[str, str] | str:
    """The styles of a LoRA layer's parts for the ``style`` its place in a region asks for (see
    the module docstring), or why that style cannot apply to one."""
    if style == "colwise":
        return {parts.base: "colwise", parts.b: "colwise"}
    if style == "rowwise":
        return {parts.base: "rowwise", parts.a: "rowwise"}
    return (f"its place asks for {style!r}, which plait does not split LoRA layers by (only "
            f"column- and row-parallel)")


def reads_gathered(module: nn.Module, matched: dict[str, str], regions: list[str]) -> set[str]:
    """Names of the A of each LoRA layer whose base is column-parallel inside a region: under
    sequence parallelism the region hands it the gathered sequence, so its gradient is whole
    on every rank and must not be summed over tp like the other modules between regions (an
    A outside any region reads this rank's positions only, and is summed)."""
    found = set()
    for name, style in matched.items():
        parent = name.rpartition(".")[0]
        if style != "colwise" or not any(parent.startswith(r + ".") for r in regions):
            continue
        parts = low_rank_parts(module.get_submodule(parent)) if parent else None
        if parts is not None and name == f"{parent}.{parts.base}":
            found.add(f"{parent}.{parts.a}")
    return found
