"""Does an accelerator stack (torch-xla, torch-tpu) match the torch beside it?

Answered from package metadata, never by importing the stack: a torch_xla built for another
torch fails to import with an undefined-symbol error that names neither package, and importing
it starts the PJRT runtime. Both `plait doctor` and accelerator detection ask here.
"""

from __future__ import annotations

import importlib.metadata
import re

import torch

# The distribution name of each stack, and the torch it needs when its metadata does not say.
# torch-xla X.Y is built against torch X.Y.0 and declares no torch requirement; torch-tpu
# declares its range in its metadata.
STACKS = {"torch_xla": "torch-xla", "torch_tpu": "torch-tpu"}


def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"2.9.0+cu128"`` -> (2, 9, 0)."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def torch_requirement(dist: str) -> str | None:
    """The specifier ``dist``'s metadata puts on torch (``">=2.11,<2.16"``), or None."""
    try:
        requires = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in requires:
        if ";" in req and "extra" in req.split(";", 1)[1]:
            continue  # an optional extra's requirement
        match = re.match(r"\s*torch\s*(?:\[[^\]]*\])?\s*\(?([<>=!~][^;)]*)", req)
        if match:
            return match.group(1).replace(" ", "")
    return None


def _compare(have: tuple[int, ...], op: str, want: str) -> bool:
    wildcard = want.endswith(".*")
    target = release(want[:-2] if wildcard else want)
    if wildcard or op == "~=":
        prefix = target if wildcard else target[:-1]
        same = have[:len(prefix)] == prefix
        if op == "!=":
            return not same
        return same and (op != "~=" or have >= target)
    width = max(len(have), len(target))
    a, b = have + (0,) * (width - len(have)), target + (0,) * (width - len(target))
    return {"==": a == b, "===": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b,
            ">": a > b, "<": a < b}[op]


def satisfies(version: str, spec: str) -> bool:
    """Whether ``version`` meets every clause of ``spec`` (PEP 440 operators on release numbers;
    enough for the simple ranges torch stacks declare)."""
    have = release(version)
    for clause in filter(None, spec.split(",")):
        match = re.match(r"(===|==|!=|>=|<=|~=|>|<)\s*(.+)", clause.strip())
        if match is None or not _compare(have, match.group(1), match.group(2).strip()):
            return False
    return True


def stack_mismatch(module: str, torch_version: str | None = None) -> str | None:
    """One line naming the mismatch between the installed ``module`` stack and torch, or None
    when they match (or the stack is absent)."""
    dist = STACKS[module]
    version = installed_version(dist)
    if version is None:
        return None
    have = torch_version or torch.__version__
    spec = torch_requirement(dist)
    if spec is None and module == "torch_xla":
        spec = "==" + ".".join(str(p) for p in release(version)[:2]) + ".*"
    if spec is None or satisfies(have, spec):
        return None
    return (f"{dist} {version} needs torch{spec}, but torch {have} is installed; install a "
            f"matching pair (e.g. pip install {_fix(dist, version, spec)})")


def _fix(dist: str, version: str, spec: str) -> str:
    if dist == "torch-xla":
        major_minor = ".".join(str(p) for p in release(version)[:2])
        return f"torch=={major_minor}.0 {dist}=={version}"
    return f"'torch{spec}' {dist}=={version}"
