"""plait: scale PyTorch training from one device to many.

    run = plait.init()                       # torchrun env, device, backend, plan, mesh
    model = run.parallelize(MyModel(cfg))    # PP split, TP/SP, checkpointing, FSDP/DDP
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for batch in run.loader(dataset, batch_size=32, steps=1000):
        loss = run.step(model, batch, loss_fn, opt)
    run.finish()
"""

from .parallel.layout import Layout, layout_of
from .plan import Plan, PlanOptions
from .runtime import Run, init

__version__ = "0.1.0"

__all__ = ["Layout", "Plan", "PlanOptions", "Run", "init", "layout_of", "__version__"]
