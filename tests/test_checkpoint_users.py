"""Checkpoints as users write their training: their own models (a tied head, LoRA-like frozen
parameters, BatchNorm and an EMA buffer, blocks not called ``layers``), AdamW with parameter
groups chosen by name, SGD with momentum, LR schedulers. Saved under one layout and resumed
under another (and again), each run continues with the losses of one uninterrupted device.

Tolerances: within a layout and across world sizes, fp32 losses differ only by the order of
reductions (a few 1e-7 relative per step, ``RTOL``); the final parameters are compared with
SGD (linear in the gradient) at ``RTOL`` of their size, and with AdamW loosely, as Adam's
1/sqrt(v) turns rounding noise on near-zero gradients into up to a step of lr.
"""

from __future__ import annotations

import os

import pytest
import torch

from plait.spawn import WorkerError, run_distributed

from . import _workers_ckpt_users as u

RTOL = 2e-6
BATCH_TOKENS = u.BATCH * u.SEQ


def _close(got: list[float], want: list[float], rtol: float = RTOL) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= rtol * abs(b)
                                         for a, b in zip(got, want, strict=True))


def _state_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float
                 ) -> str | None:
    if got.keys() != want.keys():
        return f"keys differ: {sorted(got.keys() ^ want.keys())}"
    for k in want:
        scale = want[k].float().abs().max().clamp_min(1.0)
        if (got[k].float() - want[k].float()).abs().max() > rtol * scale:
            return f"{k}: {(got[k].float() - want[k].float()).abs().max():.3g}"
    return None


def test_tied_copies_in_groups_of_different_settings_are_refused(tmp_path):
    """Under a pipeline the last stage holds the tied embedding as ``head.weight``: AdamW
    groups chosen by name ("no weight decay for embeddings") put the two copies in groups with
    another lr and weight decay, so they drift apart (3e-3 relative loss after 3 steps, and a
    checkpoint holding the weight's settings twice). Refused on every rank at the first step,
    naming the weight, both names, the settings that differ and the fix."""
    job = dict(plan="pp=2,mb=2", model="tied", steps=2, opt="adamw")
    with pytest.raises(WorkerError) as err:
        run_distributed(u.runs, 2, [job], timeout=120)
    text = str(err.value)
    assert ("weight embed.weight is tied across pipeline stages, and the optimizer gives its "
            "copies different settings (as embed.weight (stage 0): lr=0.002, weight_decay=0.0; "
            "as head.weight (stage 1): lr=0.004, weight_decay=0.1)") in text, text
    assert "Put every name of it in the same parameter group" in text


def test_buffers_and_frozen_adapters_resume_across_layouts(tmp_path, no_group):
    """A model whose BatchNorm statistics and EMA buffer change every step, saved under a
    pipeline (whose shape inference runs the stage's forward on garbage: its buffer updates
    are put back) and resumed in one process; a LoRA-like model (base frozen) saved under
    ZeRO-3 with AdamW groups and OneCycle, resumed under tensor parallelism, then resumed again
    in one process past a save on its last step; each continues one device's losses and
    learning rates, and ``plait export`` gives the plain model ``run.full_state_dict``."""
    from safetensors.torch import load_file

    from plait.cli import main

    bn = dict(model="bnema", opt="sgd", sched="lambda", total=4)
    lora = dict(model="lora", opt="adamw", sched="onecycle", total=8)
    ref_bn = u.train("single", steps=4, export=True, **bn)
    ref_lora = u.train("single", steps=8, export=True, **lora)
    bn_dir, lora_dir = str(tmp_path / "bn"), str(tmp_path / "lora")
    saved = run_distributed(u.runs, 2, [
        dict(plan="pp=2,schedule=gpipe,mb=1", steps=2, checkpoint=bn_dir, every=2, **bn),
        dict(plan="dp_shard=2,zero=3", steps=3, checkpoint=lora_dir, every=3, **lora),
        dict(plan="tp=2", steps=6, checkpoint=lora_dir, every=3, keep=2, **lora),
    ], timeout=240)[0]
    assert _close(saved[0]["losses"], ref_bn["losses"][:2])
    assert _close(saved[1]["losses"], ref_lora["losses"][:3])
    assert _close(saved[2]["losses"], ref_lora["losses"][3:6]), (saved[2], ref_lora)
    assert saved[2]["lrs"] == ref_lora["lrs"][3:6]
    assert sorted(os.listdir(lora_dir)) == ["step-00000003", "step-00000006"]  # keep=2
    bn_resumed = u.train("single", steps=4, checkpoint=bn_dir, export=True, **bn)
    assert bn_resumed["losses"] == ref_bn["losses"][2:]
    assert _state_close(bn_resumed["state"], ref_bn["state"], RTOL) is None
    assert "norm.bn.running_var" in ref_bn["state"] and "norm.ema" in ref_bn["state"]
    # Twice in a row, through a run that stops on its last step: nothing left to do, no save.
    again = u.train("single", steps=6, checkpoint=lora_dir, **lora)
    assert again["losses"] == [] and sorted(os.listdir(lora_dir)) == [
        "step-00000003", "step-00000006"]
    last = u.train("single", steps=8, checkpoint=lora_dir, export=True, **lora)
    assert _close(last["losses"], ref_lora["losses"][6:]), (last, ref_lora)
    assert last["lrs"] == ref_lora["lrs"][6:]
    assert _state_close(last["state"], ref_lora["state"], 1e-4) is None
    frozen = [n for n, p in u.MODELS["lora"]().named_parameters() if not p.requires_grad]
    assert all(torch.equal(last["state"][n], ref_lora["state"][n]) for n in frozen)
    out = tmp_path / "lora.safetensors"
    assert main(["export", lora_dir, "--to", str(out)]) == 0
    plain = u.MODELS["lora"]()
    plain.load_state_dict(load_file(str(out)), strict=True)
    assert all(torch.equal(v, last["state"][k]) for k, v in plain.state_dict().items())


def test_buffers_every_stage_holds_are_saved_as_the_stage_that_writes_them(tmp_path, no_group):
    """The root's own buffers are on every pipeline stage, and the forward writes them on
    every stage: a token count and an EMA of the embedded features (written before the blocks:
    right on the first stage only), an EMA of the last block's output (on the last stage only).
    A checkpoint took each from the rank DCP's balancing picked, ``run.full_state_dict`` from
    the last: the EMA of the features 1.8 relative away from one device's, the count 16 times
    it. Saved under 1F1B and ZB-V (rank 0 holds the first and the last stage) at step 2,
    exported, and resumed in one process, each matches one device with the microbatches as
    accumulation steps; resumed under dp=2, the losses and parameters do."""
    from plait.checkpoint.export import model_tensors

    job = dict(model="rootstats", opt="sgd", total=4)
    ref2 = u.train("grad_accum=2", steps=2, export=True, **job)
    ref = u.train("grad_accum=2", steps=4, export=True, **job)
    one, zbv = str(tmp_path / "1f1b"), str(tmp_path / "zbv")
    saved = run_distributed(u.runs, 2, [
        dict(plan="pp=2,schedule=1f1b,mb=2", steps=2, checkpoint=one, every=2, export=True,
             **job),
        dict(plan="pp=2,schedule=zbv,v=2,mb=2", steps=4, checkpoint=zbv, every=2, export=True,
             **job),
        dict(plan="dp=2", steps=4, load=one, export=True, **job)], timeout=240)[0]
    names = ("tokens_seen", "ema_in", "ema_out")
    for got, want in ((saved[0]["state"], ref2["state"]), (model_tensors(one)[0], ref2["state"]),
                      (saved[1]["state"], ref["state"]), (model_tensors(zbv)[0], ref["state"])):
        assert _state_close({k: got[k] for k in names}, {k: want[k] for k in names},
                            RTOL) is None, {k: (got[k], want[k]) for k in names}
    assert int(ref["state"]["tokens_seen"]) == 4 * BATCH_TOKENS
    assert "last_norm" not in model_tensors(zbv)[0]  # a non-persistent buffer is not saved
    # Into data parallelism: each replica keeps its own statistics of its rows (as the first
    # step warns), the parameters are one device's.
    params = {n for n, _ in u.MODELS["rootstats"]().named_parameters()}
    assert _close(saved[2]["losses"], ref["losses"][2:]), (saved[2]["losses"], ref["losses"])
    assert _state_close({k: saved[2]["state"][k] for k in params},
                        {k: ref["state"][k] for k in params}, RTOL) is None
    resumed = u.train("grad_accum=2", steps=4, checkpoint=one, export=True, **job)
    assert _close(resumed["losses"], ref["losses"][2:]), (resumed["losses"], ref["losses"])
    assert _state_close(resumed["state"], ref["state"], RTOL) is None


def test_root_parameters_resume_under_a_pipeline_and_into_data_parallelism(tmp_path, no_group):
    """Parameters of the model's own module (a scale, a shift) are on every pipeline stage,
    tied over the stages, each with its AdamW state: saved at step 2 under pp=2 and resumed,
    the run gives bitwise the losses of the uninterrupted one; resumed under dp=2 instead,
    one device's; each ends on one device's parameters."""
    job = dict(model="rootparams", opt="adamw", total=4)
    ref = u.train("single", steps=4, export=True, **job)
    one = str(tmp_path / "1f1b")
    pp = "pp=2,schedule=1f1b,mb=2"
    out = run_distributed(u.runs, 2, [
        dict(plan=pp, steps=4, export=True, **job),
        dict(plan=pp, steps=2, checkpoint=one, every=2, **job),
        dict(plan="dp=2", steps=4, load=one, export=True, **job),
        dict(plan=pp, steps=4, checkpoint=one, every=2, export=True, **job)], timeout=240)[0]
    whole, saved, into_dp, resumed = out
    assert _close(whole["losses"], ref["losses"]), (whole["losses"], ref["losses"])
    assert saved["losses"] == whole["losses"][:2]
    assert resumed["losses"] == whole["losses"][2:], (resumed["losses"], whole["losses"])
    assert _close(into_dp["losses"], ref["losses"][2:]), (into_dp["losses"], ref["losses"])
    for run in (whole, into_dp, resumed):
        assert _state_close(run["state"], ref["state"], 1e-5) is None
    assert {"scale", "shift"} <= ref["state"].keys()


def test_a_module_registered_twice_resumes_under_data_parallelism(tmp_path, no_group):
    """A module held under two names (T5's and BART's shared embedding) puts its weight in the
    state dict under each: saved at step 2 on one device and resumed under dp=2 (DDP), the run
    continues one device's losses and ends on its parameters (torch's ``set_state_dict`` adds
    DDP's ``module.`` to the keys by walking each module once, so the second name kept no
    prefix and the load refused it as missing)."""
    job = dict(model="sharedmod", opt="adamw", total=4)
    ref = u.train("single", steps=4, export=True, **job)
    folder = str(tmp_path / "single")
    u.train("single", steps=2, checkpoint=folder, every=2, **job)
    resumed = run_distributed(u.runs, 2, [
        dict(plan="dp=2", steps=4, checkpoint=folder, every=2, export=True, **job)],
        timeout=180)[0][0]
    assert _close(resumed["losses"], ref["losses"][2:]), (resumed["losses"], ref["losses"])
    assert _state_close(resumed["state"], ref["state"], 1e-5) is None
    assert {"embed.weight", "stem.embed.weight", "head.weight"} <= ref["state"].keys()


@pytest.mark.slow
def test_root_parameters_resume_across_pipeline_schedules(tmp_path, no_group):
    """Saved under interleaved 1F1B (two stages per rank, sharing one copy of each root
    parameter), resumed under it, under ZB-V (rank 0 holds the first and the last stage) and
    in one process: each continues one device's losses and ends on its parameters."""
    job = dict(model="rootparams", opt="adamw", total=4)
    ref = u.train("single", steps=4, export=True, **job)
    folder, into_zbv = str(tmp_path / "interleaved"), str(tmp_path / "zbv")
    interleaved = "pp=2,schedule=interleaved_1f1b,v=2,mb=2"
    out = run_distributed(u.runs, 2, [
        dict(plan=interleaved, steps=2, checkpoint=folder, every=2, **job),
        dict(plan="pp=2,schedule=zbv,v=2,mb=2", steps=4, load=folder, checkpoint=into_zbv,
             every=4, export=True, **job),
        dict(plan=interleaved, steps=4, checkpoint=folder, every=2, export=True, **job)],
        timeout=240)[0]
    single = u.train("single", steps=4, load=into_zbv, export=True, **job)
    assert _close(out[0]["losses"], ref["losses"][:2])
    for run in out[1:]:
        assert _close(run["losses"], ref["losses"][2:]), (run["losses"], ref["losses"])
        assert _state_close(run["state"], ref["state"], 1e-5) is None
    assert single["losses"] == []  # the zbv run saved its last step
    assert _state_close(single["state"], ref["state"], 1e-5) is None
