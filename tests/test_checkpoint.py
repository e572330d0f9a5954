"""Checkpoints: exact resume, resharding to other layouts, atomic saves, refusals.

Exact resume: a run stopped at step 6 of 12 and resumed gives bitwise the losses 7-12 of the
uninterrupted run (fp32, CPU), with an LR scheduler and dropout in play. Resharding: a
checkpoint saved under one layout continues under another with the losses of one device within
``RESHARD_RTOL`` (summation order differs between layouts; nothing else does).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import plait
from plait.checkpoint import CheckpointError, resolve
from plait.checkpoint.store import from_plain, to_plain
from plait.cli import main as cli_main
from plait.spawn import WorkerError, run_distributed

from . import _workers_checkpoint as w

RESHARD_RTOL = 2e-5


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def saved(tmp_path, no_group):
    """A one-process checkpoint folder with steps 3 and 6."""
    folder = tmp_path / "ckpt"
    w.train("single", steps=6, checkpoint=str(folder), every=3)
    return folder


# ------------------------------------------------------------------------------ exact resume
def test_exact_resume_world2(tmp_path):
    plans = ["dp=2", "dp_shard=2,zero=1", "dp_shard=2,zero=3", "tp=2,sp",
             "pp=2,schedule=1f1b,mb=2"]
    result = run_distributed(w.exact_resume, 2, plans, str(tmp_path), 0.1, stop=False,
                             timeout=240)[0]
    for plan, (uninterrupted, resumed) in result.items():
        assert len(resumed) == 6, plan
        assert resumed == uninterrupted, f"{plan}: {resumed} != {uninterrupted}"


def test_exact_resume_one_process_async(tmp_path, no_group):
    result = w.exact_resume(0, 1, ["single"], str(tmp_path), dropout=0.1, async_save=True)
    uninterrupted, resumed = result["single"]
    assert resumed == uninterrupted
    assert sorted(p.name for p in (tmp_path / "p0").iterdir()) == [
        "step-00000006", "step-00000009", "step-00000012"]  # keep=3, every=3


# ------------------------------------------------------------------------------ resharding
def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= RESHARD_RTOL * abs(y)
                                    for x, y in zip(a, b, strict=True))


def test_reshard_world1_world2(tmp_path, no_group):
    reference = w.train("single", steps=6)
    w.save_under(0, 1, "single", str(tmp_path / "single"))
    out = run_distributed(w.reshard_world2, 2, str(tmp_path), timeout=240)[0]
    out["tp=2 -> one process"] = w.continue_under(0, 1, "single", str(tmp_path / "tp2"))
    for name, losses in out.items():
        expected = reference[:3] if "(saved)" in name else reference[3:]
        assert _close(losses, expected), f"{name}: {losses} vs one device {expected}"
    # The pipeline's checkpoint names parameters as the model does, not per stage or wrapper.
    from plait.checkpoint.safe import read_metadata

    keys = set(read_metadata(resolve(tmp_path / "pp2")).state_dict_metadata)
    params = {name for name, _ in w._model(0.0).named_parameters()}
    assert {k for k in keys if k.startswith("model.")} == {f"model.{n}" for n in params}
    assert {k.removeprefix("optim.state.").rpartition(".")[0] for k in keys
            if k.startswith("optim.state.")} == params
    # Exported, the three layouts' step-3 models are one model: equal up to the rounding that
    # Adam's 1/sqrt(v) amplifies on near-zero gradients (about 2e-5 here, one step being 3e-3).
    from plait.checkpoint.export import model_tensors

    one = model_tensors(tmp_path / "single")[0]
    for other in ("tp2", "pp2"):
        theirs = model_tensors(tmp_path / other)[0]
        assert theirs.keys() == one.keys()
        worst = max((theirs[k] - one[k]).abs().max().item() for k in one)
        assert worst < 1e-4, (other, worst)


@pytest.mark.slow  # a fused qkv layer under zero and tp: test_semantics in the default suite
def test_a_fused_qkv_layer_moves_between_layouts(tmp_path, no_group):
    """A fused q|k|v Linear split over tp holds rows of q, k and v on each rank, not one block
    of the whole: saved under tp=2 and ZeRO-3 x tp=2 and loaded into tp=2, dp=4 and one
    process, it continues with one device's losses (and optimizer state). Its embedding, tied
    to the head, moves into a pipeline (whose last stage holds a copy) and out of one."""
    reference = w.train("single", steps=6, fused=True)
    w.train("single", steps=3, checkpoint=str(tmp_path / "single"), every=3, fused=True)
    out = run_distributed(w.fused_qkv_reshard, 2, str(tmp_path), timeout=240)[0]
    out.update(run_distributed(w.fused_qkv_reshard, 4, str(tmp_path), timeout=300)[0])
    for saved in ("tp2", "pp2"):
        out[f"{saved} -> one process"] = w.train("single", steps=6,
                                                 load=str(tmp_path / saved), fused=True)
    for name, losses in out.items():
        expected = reference[:3] if "(saved)" in name else reference[3:]
        assert _close(losses, expected), f"{name}: {losses} vs one device {expected}"


def test_batchnorm_buffers_move_between_layouts(tmp_path, no_group):
    """Under TP a BatchNorm's running statistics are replicated DTensors; saved so, they load
    into one process as plain tensors, and back under tp=2, unchanged."""
    saved = run_distributed(w.batchnorm_state, 2, "tp=2", str(tmp_path / "tp2"), True,
                            timeout=180)[0]
    assert {"bn.running_mean", "bn.running_var", "shift.offset"} <= set(saved)
    assert saved["bn.running_var"].sub(1).abs().max() > 1e-3  # the statistics moved
    one = w.batchnorm_state(0, 1, "single", str(tmp_path / "tp2"), False)
    back = run_distributed(w.batchnorm_state, 2, "tp=2", str(tmp_path / "tp2"), False,
                           timeout=180)[0]
    for got in (one, back):
        assert got.keys() == saved.keys()
        assert all(torch.equal(got[k], saved[k]) for k in saved)


def test_random_states_across_world_sizes(tmp_path, no_group, capsys):
    """The same world size: each rank resumes its own random states. Another: every rank
    resumes saved rank 0's (plait.checkpoint.api.rng_source), and the load says so."""
    run = plait.init("single", quiet=True, seed=0)
    model = run.parallelize(w._model(0.0))
    torch.rand(3)
    one = torch.get_rng_state()
    run.save(tmp_path / "one", model=model)
    run.close()
    out = run_distributed(w.rng_world2, 2, str(tmp_path), timeout=180)
    for r in out:
        assert torch.equal(r["after_one"], one)  # 1 -> 2: rank 0's (the only one) everywhere
        assert torch.equal(r["back"], r["saved"])  # 2 -> 2: its own
    assert not torch.equal(out[0]["saved"], out[1]["saved"])
    run = plait.init("single", seed=0)
    model = run.parallelize(w._model(0.0))
    torch.rand(7)
    run.load(tmp_path / "two", model=model)
    assert torch.equal(torch.get_rng_state(), out[0]["saved"])  # 2 -> 1: rank 0's
    run.close()
    assert "saved by 2 rank(s): every rank continues rank 0's random states" in \
        capsys.readouterr().out


@pytest.mark.slow
def test_reshard_and_resume_world4(tmp_path, no_group):
    reference = w.train("single", steps=6)
    out = run_distributed(w.reshard_world4, 4, str(tmp_path), timeout=480)[0]
    for name, losses in out.items():
        assert _close(losses, reference[3:]), f"{name}: {losses} vs one device {reference[3:]}"
    plan = "pp=2,dp=2,schedule=1f1b,mb=2"
    result = run_distributed(w.exact_resume, 4, [plan], str(tmp_path / "exact"), 0.1,
                             timeout=480)[0]
    uninterrupted, resumed = result[plan]
    assert resumed == uninterrupted


# ------------------------------------------------------------------------------ atomicity
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_kill_during_save_keeps_previous(tmp_path, no_group, world):
    folder = tmp_path / "ckpt"
    with pytest.raises(WorkerError):  # the killed rank, or a peer that lost it mid-save
        run_distributed(w.killed_during_second_save, world, str(folder), timeout=120)
    assert resolve(folder).name == "step-00000002"
    assert any(p.name.startswith(".tmp-step-00000004") for p in folder.iterdir())
    run = plait.init("single", checkpoint=str(folder), quiet=True, seed=0)
    try:
        assert run.first_step == 2
        # a complete one exists: resumed from it, and the unfinished save is named
        assert run.checkpointing.note.endswith(
            "(step 2) (an unfinished save is ignored: .tmp-step-00000004)"), run.checkpointing.note
        model = run.parallelize(w._model(0.0))
        assert run.load(folder, model=model) == 2
    finally:
        run.close()


# ------------------------------------------------------------------------------ refusals
class _Payload:
    """Pickles to a call that creates a marker file, as a crafted checkpoint would."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _load_into_fresh(path: Path) -> int:
    run = plait.init("single", quiet=True, seed=0)
    try:
        model = run.parallelize(w._model(0.0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return run.load(path, model=model, optimizer=opt)
    finally:
        run.close()


def test_crafted_pickle_in_metadata_is_refused(saved, tmp_path):
    step = resolve(saved)
    marker = tmp_path / "pwned"
    meta = step / ".metadata"
    meta.write_bytes(pickle.dumps(_Payload(marker)))
    manifest = json.loads((step / "plait.json").read_text())
    manifest["files"][".metadata"] = meta.stat().st_size  # sizes agree: only content is bad
    (step / "plait.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"refers to .*open.*not checkpoint data"):
        _load_into_fresh(step)
    assert not marker.exists()


@pytest.mark.parametrize("damage, message", [
    ("truncate_shard", r"__0_0\.distcp is \d+ bytes, expected \d+"),
    ("truncate_manifest", r"plait\.json cannot be read"),
    ("future_format", r"checkpoint format 99.*reads format 1"),
    ("no_metadata", r"\.metadata is missing"),
])
def test_damaged_checkpoint_is_refused(saved, damage, message):
    step = resolve(saved)
    if damage == "truncate_shard":
        shard = step / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "truncate_manifest":
        (step / "plait.json").write_text((step / "plait.json").read_text()[:50])
    elif damage == "future_format":
        manifest = json.loads((step / "plait.json").read_text())
        manifest["format"] = 99
        (step / "plait.json").write_text(json.dumps(manifest))
    else:
        (step / ".metadata").unlink()
    before = _digest(saved)
    with pytest.raises(CheckpointError, match=message) as err:
        _load_into_fresh(step)
    assert str(step) in str(err.value)
    assert _digest(saved) == before  # nothing touched


def test_another_models_checkpoint_is_refused(saved):
    before = _digest(saved)
    run = plait.init("single", quiet=True, seed=0)
    try:
        other = run.parallelize(torch.nn.Sequential(torch.nn.Linear(4, 4)))
        with pytest.raises(CheckpointError, match=r"is of another model: .*0\.weight"):
            run.load(saved, model=other)
    finally:
        run.close()
    assert _digest(saved) == before


def test_a_damaged_newest_checkpoint_stops_the_resume(saved, tmp_path):
    """A newest step folder without plait.json (saves publish it by a rename after writing
    it: this one was damaged or copied in part) is refused by name, by a resuming run and by
    plait export alike; neither falls back to the older step 3 by itself."""
    shutil.copytree(saved / "step-00000006", saved / "step-00000009")
    (saved / "step-00000009" / "plait.json").unlink()
    message = (r"the newest checkpoint in .*, step-00000009, has no plait\.json: .* remove or "
               r"restore step-00000009 \(then step-00000006 is the newest\)")
    with pytest.raises(CheckpointError, match=message):
        plait.init("single", checkpoint=str(saved), quiet=True, seed=0)
    assert not dist.is_initialized()
    with pytest.raises(CheckpointError, match=message):
        resolve(saved)
    code = cli_main(["export", str(saved), "--to", str(tmp_path / "w.safetensors")])
    assert code == 2 and not (tmp_path / "w.safetensors").exists()


def test_missing_empty_and_half_written_folders(tmp_path, no_group):
    empty = tmp_path / "empty"
    empty.mkdir()
    half = tmp_path / "half"
    (half / ".tmp-step-00000004").mkdir(parents=True)
    cases = {tmp_path / "nope": "does not exist", empty: "is empty",
             half: "no complete checkpoint, only half-written saves",
             half / ".tmp-step-00000004": "is half-written"}
    for path, message in cases.items():
        with pytest.raises(CheckpointError, match=message) as err:
            _load_into_fresh(path)
        assert str(path) in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"every": 0}, r"every=0 must be a whole number >= 1"),
    ({"keep": 0}, r"keep=0 must be a whole number >= 1"),
    ({"every": 2.5}, r"every=2\.5 must be"),
])
def test_bad_settings_refused_before_training(tmp_path, no_group, kwargs, message):
    with pytest.raises(CheckpointError, match=message):
        plait.init("single", checkpoint=str(tmp_path / "c"), **kwargs)
    assert not dist.is_initialized()


def test_unwritable_or_foreign_folder_refused(tmp_path, no_group):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match=r"not writable"):
        plait.init("single", checkpoint=str(blocker / "ckpt"), seed=0)
    with pytest.raises(CheckpointError, match=r"is a file"):
        plait.init("single", checkpoint=str(blocker), seed=0)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"holds files that are not plait checkpoints"):
        plait.init("single", checkpoint=str(tmp_path / "mine"), seed=0)
    assert not dist.is_initialized()


def test_broken_newest_checkpoint_is_not_a_fresh_start(saved):
    newest = resolve(saved)
    (newest / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"expected"):
        plait.init("single", checkpoint=str(saved), seed=0)
    assert not dist.is_initialized()


def test_plain_data_round_trip():
    value = {"a": (1, 2.5, None), "b": [True, "x"], 3: {"t": torch.arange(4.0)},
             "inf": float("inf")}
    back = from_plain(json.loads(json.dumps(to_plain(value, "v"))))
    assert back["a"] == (1, 2.5, None) and back["b"] == [True, "x"]
    assert torch.equal(back[3]["t"], torch.arange(4.0)) and back["inf"] == float("inf")
    with pytest.raises(CheckpointError, match="holds a builtin_function_or_method"):
        to_plain({"f": len}, "scheduler state")


def test_keep_last_k(tmp_path, no_group):
    folder = tmp_path / "k"
    w.train("single", steps=5, checkpoint=str(folder), every=1, scheduler=False)
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["step-00000003", "step-00000004", "step-00000005"]
    shutil.rmtree(folder)


# ------------------------------------------------------------------------------ export
def test_export_answers_in_json(saved, tmp_path, capsys):
    """`plait export --format json`: what was written, as JSON on stdout alone."""
    out = tmp_path / "m.safetensors"
    assert cli_main(["export", str(saved), "--to", str(out), "--format", "json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 6 and info["to"] == str(out) and info["config"] is None
    assert info["bytes"] == out.stat().st_size and info["tensors"] > 0


def test_export_safetensors_loads_without_plait(saved, tmp_path):
    from safetensors.torch import load_file

    from plait.cli import main

    run = plait.init("single", quiet=True, seed=0)
    try:
        model = run.parallelize(w._model(0.0))
        run.load(saved, model=model)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        run.close()
    out = tmp_path / "model.safetensors"
    umask = os.umask(0o027)
    try:
        assert main(["export", str(saved), "--to", str(out)]) == 0
    finally:
        os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o640  # a plain new file's mode, to be shared
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model.safetensors"]
    tensors = load_file(str(out))
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    fresh = w._model(0.0)
    fresh.load_state_dict(tensors, strict=True)


def test_export_refusals(saved, tmp_path, capsys):
    from plait.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["export", str(saved), "--to", str(blocker / "m.safetensors")]) == 2
    assert f"{blocker} is a file, not a folder" in capsys.readouterr().err
    missing = tmp_path / "missing"
    assert main(["export", str(missing), "--to", str(tmp_path / "m.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # A missing folder is refused, as --plot refuses one, not created.
    assert main(["export", str(saved), "--to", str(missing / "m.safetensors")]) == 2
    assert f"folder {missing} does not exist; create it first" in capsys.readouterr().err
    assert main(["export", str(saved), "--to", str(missing / "hf")]) == 2
    assert f"folder {missing} does not exist; create it first" in capsys.readouterr().err
    assert main(["export", str(saved), "--to", str(tmp_path / "hf")]) == 2
    assert "not of a Hugging Face model" in capsys.readouterr().err
    # ... before a tensor is read: shards of the right size but unreadable are not reached
    for shard in resolve(saved).glob("*.distcp"):
        shard.write_bytes(b"\0" * shard.stat().st_size)
    assert main(["export", str(saved), "--to", str(tmp_path / "hf")]) == 2
    assert "not of a Hugging Face model" in capsys.readouterr().err
    assert main(["export", str(saved), "--to", str(tmp_path / "m.safetensors")]) == 2
    assert "cannot be read" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "file"]  # nothing left


def test_export_hugging_face_folder(tmp_path, no_group):
    transformers = pytest.importorskip("transformers")
    from plait.checkpoint.export import export
    from plait.data import TextDataset
    from plait.models.transformer import lm_loss

    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                                   max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    run = plait.init("single", quiet=True, checkpoint=str(tmp_path / "ckpt"), seed=0)
    try:
        model = run.parallelize(transformers.LlamaForCausalLM(cfg))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for batch in run.loader(TextDataset(seq_len=16), batch_size=4, steps=2):
            run.step(model, batch, lambda out, y: lm_loss(out.logits, y), opt)
        run.save()
        tokens = torch.arange(16).reshape(1, 16)
        with torch.no_grad():
            expected = model(tokens).logits
    finally:
        run.close()
    info = export(tmp_path / "ckpt", tmp_path / "hf")
    assert info["config"] and (tmp_path / "hf" / "config.json").is_file()
    assert info["values"] == sum(t.numel() for t in model.state_dict().values())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, expected, atol=1e-5)


class _WithExtraState(torch.nn.Module):
    """A module whose state dict holds a non-tensor value (DCP stores it as pickled bytes)."""

    def __init__(self, extra):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.extra = extra

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.extra = state


def test_non_tensor_values_load_as_plain_data_only(tmp_path, no_group):
    run = plait.init("single", quiet=True, seed=0)
    try:
        plain = run.parallelize(_WithExtraState({"calls": 3, "name": "x"}))
        run.save(tmp_path / "plain", model=plain)
        fresh = _WithExtraState({"calls": 0, "name": ""})  # the same structure, other values
        run.load(tmp_path / "plain", model=fresh)
        assert fresh.extra == {"calls": 3, "name": "x"}
        marker = tmp_path / "pwned"
        run.save(tmp_path / "crafted", model=_WithExtraState(_Payload(marker)))
        with pytest.raises(CheckpointError, match=r"'model\._extra_state' is not plain data"):
            run.load(tmp_path / "crafted", model=_WithExtraState(0))
        assert not marker.exists()
    finally:
        run.close()


def test_the_save_at_finish_records_the_batch_size(tmp_path, no_group):
    """finish() saves after the loader is used up (an empty loader is still the run's loader):
    the checkpoint records the global batch, and a resume with another is refused."""
    folder = tmp_path / "ckpt"
    w.train("single", steps=3, checkpoint=str(folder), every=100)
    assert [p.name for p in folder.iterdir()] == ["step-00000003"]
    run = plait.init("single", checkpoint=str(folder), quiet=True, seed=0)
    model = run.parallelize(w._model(0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with pytest.raises(CheckpointError, match=rf"trained with global batch {w.BATCH}, this "
                                              rf"loader's is {2 * w.BATCH}"):
        for batch in run.loader(w.TextDataset(seq_len=w.SEQ), batch_size=2 * w.BATCH, steps=6):
            run.step(model, batch, w.lm_loss, opt)
    run.close()


def test_a_resumed_model_holds_the_saved_weights_before_its_first_step(tmp_path, no_group):
    """run.parallelize already returns the trained model of a resumed run: an evaluation before
    the first step, or a run with no steps left, sees the saved weights, not the initial ones.
    A model the checkpoint does not hold (a teacher laid out first) is left as it is."""
    folder = tmp_path / "ckpt"
    run = plait.init("single", checkpoint=str(folder), quiet=True, seed=0)
    model = run.parallelize(w._model(0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in run.loader(w.TextDataset(seq_len=w.SEQ), batch_size=w.BATCH, steps=3):
        run.step(model, batch, w.lm_loss, opt)
    trained = {k: v.clone() for k, v in run.full_state_dict(model).items()}
    run.finish(print_summary=False)

    run = plait.init("single", checkpoint=str(folder), quiet=True, seed=0)
    teacher = run.parallelize(torch.nn.Linear(4, 4))
    before = teacher.weight.detach().clone()
    model = run.parallelize(w._model(0.0))
    assert torch.equal(teacher.weight, before)
    now = run.full_state_dict(model)
    assert set(now) == set(trained)
    for name, value in trained.items():
        assert torch.equal(now[name], value), name
    # An evaluation loader starts at its first batch on a resumed run too, and run.evaluate
    # sees the saved weights before any step.
    held_out = run.loader(w.TextDataset(seq_len=w.SEQ), batch_size=w.BATCH, steps=1,
                          evaluation=True)
    (batch,) = list(held_out)
    fresh = w._model(0.0)
    fresh.load_state_dict(trained)
    fresh.eval()
    with torch.no_grad():
        want = w.lm_loss(fresh(batch[0]), batch[1])
    assert float(run.evaluate(model, batch, w.lm_loss)) == pytest.approx(float(want), rel=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    assert list(run.loader(w.TextDataset(seq_len=w.SEQ), batch_size=w.BATCH, steps=3)) == []
    run.finish(print_summary=False)
    assert [p.name for p in folder.iterdir()] == ["step-00000003"]


def test_an_lr_scheduler_may_come_or_go_on_resume(tmp_path, no_group):
    """Resuming without the scheduler that was saved keeps the optimizer's LR and says so;
    resuming with one that was not saved starts it fresh and says so; an explicit run.load
    with a scheduler the checkpoint lacks is refused."""
    with_sched, without = tmp_path / "with", tmp_path / "without"
    w.train("single", steps=3, checkpoint=str(with_sched), every=3)
    w.train("single", steps=3, checkpoint=str(without), every=3, scheduler=False)
    with pytest.warns(UserWarning, match=r"holds an LR scheduler's state \(last step 3\).*"
                                         r"run.step\(\.\.\., scheduler=sched\)"):
        assert len(w.train("single", steps=4, checkpoint=str(with_sched), every=100,
                           scheduler=False)) == 1
    with pytest.warns(UserWarning, match=r"holds no LR scheduler state: StepLR starts from "
                                         r"its first step"):
        assert len(w.train("single", steps=4, checkpoint=str(without), every=100)) == 1
    with pytest.raises(CheckpointError, match=r"holds no LR scheduler state; load it without"):
        w.train("single", steps=5, load=str(without / "step-00000003"))


def test_weights_written_after_parallelize_are_still_resumed_over(tmp_path, no_group):
    """A script that writes the model's weights after run.parallelize (its own init, another
    load) still resumes the checkpoint's at the first step, as before the weights moved to
    parallelize: the first loss is the uninterrupted run's."""
    full = w.train("single", steps=4)
    folder = tmp_path / "ckpt"
    w.train("single", steps=3, checkpoint=str(folder), every=3)
    run = plait.init("single", checkpoint=str(folder), quiet=True, log_every=1, seed=0)
    model = run.parallelize(w._model(0.0))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    (batch,) = list(run.loader(w.TextDataset(seq_len=w.SEQ), batch_size=w.BATCH, steps=4))
    assert float(run.step(model, batch, w.lm_loss, opt, scheduler=sched)) == full[3]
    run.close()


def test_saving_a_data_by_tensor_parallel_layout_logs_no_torch_warning(tmp_path, no_group):
    """Gathering a tensor FSDP2 split over a tensor-parallel shard (a strided placement) for the
    save is two all-gathers, which torch's DTensor logs as "suboptimal ... may give inconsistent
    results between ranks due to different reduction orders": an all-gather reduces nothing, so
    the line only alarms the user of a correct save, and is kept quiet for that gather."""
    seen = run_distributed(w.torch_warnings_during_save, 4, "dp=2,tp=2", str(tmp_path / "c"),
                           timeout=240)
    assert seen == [[]] * 4, seen[0][:1]
