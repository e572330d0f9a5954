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
    run = runtime.init(plan_text, quiet=True, seed=0)
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
    run = runtime.init(plan_text, quiet=True, seed=0)
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


def factory_ledger(rank: int, world: int, factory: str, plans: list[str], rows: int,
                   steps: int = 2) -> dict:
    """Per plan: the ledger's measured rows (payload bytes and calls per axis and op, per
    step) after ``steps`` steps of ``factory``'s (model, dataset, loss_fn) through plait's
    runtime, each rank on its ``rows`` rows of the dataset per step (all micro-steps)."""
    import importlib

    import torch
    from torch.utils.data import default_collate

    from plait.runtime import init

    torch.set_num_threads(1)
    module, name = factory.split(":")
    out: dict = {}
    for plan in plans:
        torch.manual_seed(0)
        model, data, loss_fn = getattr(importlib.import_module(module), name)()
        run = init(plan, quiet=True, ledger=True, seed=0)
        # DDP rebuilds its buckets in the second step (broadcasting their order): one-off
        run.ledger_warmup = 2
        try:
            model = run.parallelize(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for step in range(2 + steps):
                start = (step * world + run.dp_rank) * rows
                batch = default_collate([data[(start + i) % len(data)] for i in range(rows)])
                run.step(model, batch, loss_fn, opt)
            out[plan] = [{k: r[k] for k in ("axis", "op", "payload_bytes", "count")}
                         for r in run.summary()["comm"]["rows"]]
        finally:
            run.close()
    return out
