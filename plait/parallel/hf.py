"""Hugging Face transformers' classes, for ``isinstance`` checks on a user's model.

Looked up only when transformers is already imported: a model (or a layer inside one) can be
an instance of its classes only if its module was loaded, and importing transformers for a model
that does not use it costs each rank seconds.
"""

from __future__ import annotations

import importlib
import sys


def transformers_class(module: str, name: str) -> type | None:
    """``transformers.<module>.<name>`` (``module`` "" for the top level), or None when
    transformers is not imported in this process, or is and lacks it."""
    if "transformers" not in sys.modules:
        return None
    try:
        found = getattr(importlib.import_module(".".join(filter(None, ("transformers", module)))),
                        name)
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) else None
