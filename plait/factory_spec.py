"""What ``--model pkg.module:function`` is told when it was given as a file path.

Every command that takes a factory (``plait check``, ``plait plan``) imports it by its module's
dotted name, as ``python -m`` does; a path such as ``models/vit.py:build`` is the first thing
a user types, and Python's "No module named 'models/vit'" does not say what to write instead.
"""

from __future__ import annotations

from pathlib import Path


def file_path_hint(module_name: str, function: str) -> str:
    """``"; 'models/vit.py' is a file path: give the module's dotted name, e.g. --model
    models.vit:build"`` for a module written as a path (a ``/`` or a ``.py`` ending), else
    "". A path outside the current folder is named with the folder to run from."""
    if not (module_name.endswith(".py") or "/" in module_name or "\\" in module_name):
        return ""
    func = function or "factory"
    path = Path(module_name.replace("\\", "/"))
    path = path.with_suffix("") if path.suffix == ".py" else path
    if path.is_absolute() or ".." in path.parts:
        resolved = path.resolve()
        try:
            path = resolved.relative_to(Path.cwd())
        except ValueError:
            return (f"; {module_name!r} is a file path: run from {str(resolved.parent)!r} and "
                    f"give the module's name, --model {resolved.name}:{func}")
    dotted = ".".join(part for part in path.parts if part not in ("", "."))
    return (f"; {module_name!r} is a file path: give the module's dotted name, e.g. --model "
            f"{dotted}:{func}")
