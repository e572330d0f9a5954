"""Multi-process workers for the planner tests (module-level so spawn can import them)."""

from __future__ import annotations

import dataclasses


def local_share(rank: int, world: int, plan_text: str, model_name: str) -> dict:
    """What this rank holds of the reference model once plait's runtime laid it out
    (``plait.comm.predict.local_model``: the ledger's view), with its pipeline rank."""
    import torch

    from plait import runtime
    from plait.comm.predict import local_model
    from plait.models import transformer as tfm

    torch.set_num_threads(1)
    run = runtime.init(plan_text, quiet=True)
    try:
        model = run.parallelize(tfm.build(tfm.preset(model_name), seed=run.seed))
        share = dataclasses.asdict(local_model(model, run.plan))
        share["pp_rank"] = rank // (world // run.plan.pp)  # pp is the outermost mesh axis
        return share
    finally:
        run.close()
