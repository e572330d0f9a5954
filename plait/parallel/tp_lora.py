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
    linears: dict[str, nn.Linear] = {}
    for n, m in module.named_modules():
        if n and isinstance(m, nn.Linear):
            linears[n] = m
            if len(linears) > 3:  # asked of every traced module: a block stops here
                return None
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


LORA_STYLES = ("colwise", "rowwise")  # the places a LoRA layer is split in


def expand(style: str, parts: LowRank) -> dict[str, str] | str:
    """The styles of a LoRA layer's parts for the ``style`` its place in a region asks for (see
    the module docstring), or why that style cannot apply to one."""
    if style == "colwise":
        return {parts.base: "colwise", parts.b: "colwise"}
    if style == "rowwise":
        return {parts.base: "rowwise", parts.a: "rowwise"}
    return (f"its place asks for {style!r}, which plait does not split LoRA layers by (only "
            f"column- and row-parallel)")


def sp_sums(module: nn.Module, matched: dict[str, str], regions: list[str]
            ) -> tuple[set[str], set[str]]:
    """Under sequence parallelism, the whole-on-every-rank parts of the LoRA layers ``matched``
    splits, as (summed, whole): names of those that read this rank's positions only, whose
    gradients are summed over tp like a norm's (the B after a row-parallel A, whose output is
    reduce-scattered over the sequence; the A of a column-parallel layer outside any region),
    and of those that read the gathered sequence, whose gradients are whole (the A of a
    column-parallel layer inside a region, which gathers its input)."""
    summed: set[str] = set()
    whole: set[str] = set()
    for name, style in matched.items():
        parent = name.rpartition(".")[0]
        parts = low_rank_parts(module.get_submodule(parent)) if parent else None
        if parts is None or name != f"{parent}.{parts.base}":
            continue
        if style == "rowwise":
            summed.add(f"{parent}.{parts.b}")
        elif style == "colwise":
            inside = any(parent.startswith(r + ".") for r in regions)
            (whole if inside else summed).add(f"{parent}.{parts.a}")
    return summed, whole
