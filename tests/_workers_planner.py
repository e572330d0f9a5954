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


def model_state(rank: int, world: int, plan_text: str, model_name: str) -> dict:
    """This rank's parameter, gradient and optimizer-state bytes after one ``run.step`` of
    AdamW on the reference model (the runtime's own measurement: ``run.memory_report``)."""
    import torch

    from plait import runtime
    from plait.models import transformer as tfm

    torch.set_num_threads(1)
    run = runtime.init(plan_text, quiet=True)
    try:
        cfg = tfm.preset(model_name)
        model = run.parallelize(tfm.build(cfg, seed=run.seed))
        opt = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len + 1),
                            generator=torch.Generator().manual_seed(0))
        run.step(model, (ids[:, :-1], ids[:, 1:]), tfm.lm_loss, opt)
        report = run.memory_report()
        assert report is not None
        return dict(report["ranks"][rank]["measured"])
    finally:
        run.close()
