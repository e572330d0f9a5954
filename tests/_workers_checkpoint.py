"""Module-level workers for the checkpoint tests (spawned processes import them)."""

from __future__ import annotations

from pathlib import Path

import torch

import plait
from plait.data import TextDataset
from plait.models.transformer import build, lm_loss, preset

BATCH, SEQ = 8, 16


def _model(dropout: float, fused: bool = False):
    if fused:  # a fused q|k|v Linear with a bias, written by hand, the head tied
        from tests._workers_semantics import FusedQKVLM

        torch.manual_seed(0)
        return FusedQKVLM(vocab=256)
    return build(preset("test", dropout=dropout))


def train(plan: str, *, steps: int, checkpoint: str | None = None, every: int | None = None,
          dropout: float = 0.0, scheduler: bool = True, load: str | None = None,
          async_save: bool = False, fused: bool = False) -> list[float]:
    """Train the test model (``fused``: one with a fused q|k|v layer) under ``plan`` up to
    global step ``steps``; returns this process's per-step losses (resumed runs return only
    the steps they ran)."""
    run = plait.init(plan, checkpoint=checkpoint, every=every, log_every=1, quiet=True,
                     async_save=async_save, seed=0)
    model = run.parallelize(_model(dropout, fused))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5) if scheduler else None
    if load is not None:
        run.load(load, model=model, optimizer=opt, scheduler=sched)
    losses = []
    for batch in run.loader(TextDataset(seq_len=SEQ), batch_size=BATCH, steps=steps):
        losses.append(float(run.step(model, batch, lm_loss, opt, scheduler=sched)))
    if checkpoint is not None:
        run.finish(print_summary=False)  # waits for a background save
    else:
        run.close()
    return losses


def exact_resume(rank: int, world: int, plans: list[str], root: str, dropout: float = 0.0,
                 async_save: bool = False, stop: bool = True
                 ) -> dict[str, tuple[list[float], list[float]]]:
    """Per plan: (losses 7-12 of an uninterrupted run, losses 7-12 after resuming at step 6).

    ``stop``: the resumed run continues one that stopped at step 6 (three runs); otherwise it
    loads the step-6 checkpoint the uninterrupted run wrote on its way (two runs, the same
    state on disk)."""
    out = {}
    for i, plan in enumerate(plans):
        folder = str(Path(root) / f"p{i}")
        if stop:
            full = train(plan, steps=12, dropout=dropout)
            first = train(plan, steps=6, checkpoint=folder, every=3, dropout=dropout,
                          async_save=async_save)
            assert first == full[:6], (plan, first, full[:6])
            resumed = train(plan, steps=12, checkpoint=folder, every=3, dropout=dropout,
                            async_save=async_save)
        else:
            full = train(plan, steps=12, checkpoint=folder, every=6, dropout=dropout)
            resumed = train(plan, steps=12, dropout=dropout,
                            load=str(Path(folder) / "step-00000006"))
        out[plan] = (full[6:], resumed)
    return out


def save_under(rank: int, world: int, plan: str, folder: str, steps: int = 3) -> list[float]:
    """Train ``steps`` steps under ``plan`` and checkpoint; returns the losses."""
    return train(plan, steps=steps, checkpoint=folder, every=steps)


def continue_under(rank: int, world: int, plan: str, folder: str, steps: int = 6
                   ) -> list[float]:
    """Resume ``folder``'s newest checkpoint under ``plan`` (any layout) up to ``steps``."""
    return train(plan, steps=steps, load=folder)


def fused_qkv_reshard(rank: int, world: int, root: str) -> dict[str, list[float]]:
    """A fused q|k|v layer's checkpoint moved into and out of tp=2 and ZeRO-3 x tp=2 (whose
    shards of it are not blocks of the whole), and its tied embedding into and out of pp=2;
    ``root/single`` saved beforehand at step 3.
    Returns each run's losses (steps 1-3 saving, 4-6 continuing)."""
    base = Path(root)
    if world == 4:
        plan = "dp_shard=2,zero=3,tp=2"
        return {f"{plan} (saved)": train(plan, steps=3, checkpoint=str(base / "z3tp"),
                                         every=3, fused=True),
                f"{plan} -> dp=4": train("dp=4", steps=6, load=str(base / "z3tp"), fused=True),
                f"single -> {plan}": train(plan, steps=6, load=str(base / "single"),
                                           fused=True)}
    return {"single -> tp=2": train("tp=2", steps=6, load=str(base / "single"), fused=True),
            "tp=2 (saved)": train("tp=2", steps=3, checkpoint=str(base / "tp2"), every=3,
                                  fused=True),
            # The last stage holds the tied head's copy of the embedding, and its optimizer
            # state under the one-device model's name for it.
            "single -> pp=2": train("pp=2,mb=2", steps=6, load=str(base / "single"),
                                    fused=True),
            "pp=2 (saved)": train("pp=2,mb=2", steps=3, checkpoint=str(base / "pp2"), every=3,
                                  fused=True)}


def reshard_world2(rank: int, world: int, root: str) -> dict[str, list[float]]:
    """Checkpoints moved between layouts at world 2 (and from one process, saved beforehand in
    ``root/single``); returns each continuation's losses for steps 4-6."""
    base = Path(root)
    out = {"single -> dp_shard=2,zero=3": continue_under(rank, world, "dp_shard=2,zero=3",
                                                          str(base / "single"))}
    out["tp=2 (saved)"] = save_under(rank, world, "tp=2", str(base / "tp2"))
    out["tp=2 -> zero=2"] = continue_under(rank, world, "dp_shard=2,zero=2", str(base / "tp2"))
    out["pp=2,1f1b (saved)"] = save_under(rank, world, "pp=2,schedule=1f1b,mb=2", str(base / "pp2"))
    out["pp=2,1f1b -> pp=2,interleaved_1f1b,v=2"] = continue_under(
        rank, world, "pp=2,schedule=interleaved_1f1b,v=2,mb=2", str(base / "pp2"))
    out["pp=2,1f1b -> pp=2,zbv"] = continue_under(  # V: rank 0 holds the first and last stage
        rank, world, "pp=2,schedule=zbv,v=2,mb=2", str(base / "pp2"))
    return out


def reshard_world4(rank: int, world: int, root: str) -> dict[str, list[float]]:
    """dp=4 -> dp=2,tp=2 and zero=3 over 4 -> pp=2,dp_shard=2, plus pp2 x dp2 exact resume;
    ZB-V over data replicas (its gradients averaged after the schedule, no DDP) under ZeRO-1
    saved and moved to dp=4, and dp=4 moved into it without ZeRO."""
    base = Path(root)
    zbv = "pp=2,schedule=zbv,v=2,mb=2"
    save_under(rank, world, "dp=4", str(base / "dp4"))
    save_under(rank, world, "dp_shard=4,zero=3", str(base / "z3"))
    save_under(rank, world, f"dp_shard=2,zero=1,{zbv}", str(base / "z1zbv"))
    out = {"dp=4 -> dp=2,tp=2": continue_under(rank, world, "dp=2,tp=2", str(base / "dp4")),
           "zero=3 x4 -> pp=2,dp_shard=2": continue_under(
               rank, world, "pp=2,dp_shard=2,zero=3,schedule=1f1b,mb=2", str(base / "z3")),
           "dp=4 -> HSDP 2x2": continue_under(
               rank, world, "dp_replicate=2,dp_shard=2,zero=3", str(base / "dp4")),
           "zero=1 x zbv -> dp=4": continue_under(rank, world, "dp=4", str(base / "z1zbv")),
           "dp=4 -> dp=2 x zbv": continue_under(rank, world, f"dp=2,{zbv}", str(base / "dp4"))}
    return out


def killed_during_second_save(rank: int, world: int, folder: str) -> None:
    """Data parallel, a checkpoint every 2 steps; the last rank dies right after writing its
    shard of the second one (step 4), before DCP's metadata and plait's publishing."""
    import os

    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    original = _FileSystemWriter.write_data
    calls = []

    def write_then_die(self, plan, planner):
        future = original(self, plan, planner)
        calls.append(1)
        if rank == world - 1 and len(calls) == 2:
            future.wait()
            os._exit(9)
        return future

    _FileSystemWriter.write_data = write_then_die
    train(f"dp={world}", steps=6, checkpoint=folder, every=2)


def rng_world2(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    """At world 2: load ``root/one`` (saved by one process); draw a different count of numbers
    on each rank and save to ``root/two``; draw more and load ``root/two`` back. Returns the
    torch CPU random state after the first load, at the save, and after the second load."""
    run = plait.init("dp=2", quiet=True, seed=0)
    model = run.parallelize(_model(0.0))
    run.load(Path(root) / "one", model=model)
    after_one = torch.get_rng_state()
    torch.rand(1 + rank)  # the ranks' streams apart
    saved = torch.get_rng_state()
    run.save(Path(root) / "two", model=model)
    torch.rand(5)
    run.load(Path(root) / "two", model=model)
    back = torch.get_rng_state()
    run.close()
    return {"after_one": after_one, "saved": saved, "back": back}


def batchnorm_state(rank: int, world: int, plan: str, folder: str, save: bool
                    ) -> dict[str, torch.Tensor]:
    """The BatchNorm model of the semantics tests: trained 3 steps under ``plan`` and saved
    (``save``), or loaded from ``folder`` under ``plan``; its full state, buffers included."""
    from plait.check import _slice
    from tests import _workers_semantics as sem

    run = plait.init(plan, quiet=True, seed=0,
                     **({"checkpoint": folder, "every": 3} if save else {}))
    model = run.parallelize(sem.batchnorm_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if save:
        for step in range(3):
            run.step(model, _slice(sem.bn_batch(step), run.dp_rank, run.dp_size),
                     torch.nn.functional.cross_entropy, opt)
    else:
        run.load(folder, model=model, optimizer=opt)
    state = run.full_state_dict(model)
    if save:
        run.finish(print_summary=False)
    else:
        run.close()
    return state


def torch_warnings_during_save(rank: int, world: int, plan: str, folder: str) -> list[str]:
    """The warnings torch's DTensor redistribution logs while ``plan`` trains a step and saves:
    the README's ``plait run --nproc 4 train.py --plan dp=2,tp=2`` with ``checkpoint=``."""
    import logging

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    keep = Keep(logging.WARNING)
    logger.addHandler(keep)
    try:
        save_under(rank, world, plan, folder, steps=1)
    finally:
        logger.removeHandler(keep)
    return seen
