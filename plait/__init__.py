"""plait: scale PyTorch training from one device to many.

    run = plait.init()                       # torchrun env, device, backend, plan, mesh
    model = run.parallelize(MyModel(cfg))    # PP split, TP/SP, checkpointing, FSDP/DDP
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for batch in run.loader(dataset, batch_size=32, steps=1000):
        loss = run.step(model, batch, loss_fn, opt)
    run.finish()

The names below are imported on first use (PEP 562), not with the package: ``plait run``'s
launcher and the CLI's argument parsing import ``plait.<module>`` without torch, so they start
in a fraction of a second instead of paying torch's import (seconds of CPU) first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .batch_rows import MicroBatches
    from .parallel.layout import Layout, layout_of
    from .plan import Plan, PlanOptions
    from .runtime import Run, init

__version__ = "0.1.0"

__all__ = ["Layout", "MicroBatches", "Plan", "PlanOptions", "Run", "init", "layout_of",
           "__version__"]

_LAZY = {"Layout": ".parallel.layout", "layout_of": ".parallel.layout", "Plan": ".plan",
         "MicroBatches": ".batch_rows",
         "PlanOptions": ".plan", "Run": ".runtime", "init": ".runtime"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'plait' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
