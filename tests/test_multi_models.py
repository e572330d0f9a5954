"""Several models trained together (``tests/_multi_models.py``): knowledge distillation with a
frozen teacher, a GAN's two models and optimizers stepped on each batch, each against the same
loop in plain torch on one device (losses and every parameter), saved apart and resumed under
another layout, with the progress line, the step count and the ledger a user sees."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.spawn import WorkerError, run_distributed
from tests import _multi_models as M

REL, ATOL = 1e-6, 1e-6


def _same(want: list[float], got: list[float]) -> None:
    assert len(got) == len(want), (want, got)
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert abs(a - b) <= REL * abs(a), (step, want, got)


def _same_state(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), (sorted(want), sorted(got))
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=ATOL, msg=name)


def _gan_as_one_device(got: dict[str, Any], want: dict[str, Any]) -> None:
    _same(want["d_losses"], got["d_losses"])
    _same(want["g_losses"], got["g_losses"])
    _same_state(want["gen"], got["gen"])
    _same_state(want["disc"], got["disc"])


GAN_SLOW = [pytest.param(p, marks=pytest.mark.slow)
            for p in ("dp_shard=2,zero=1", "fsdp=2", "tp=2", "dp=2,grad_accum=2")]


@pytest.mark.parametrize("plan", ["", "dp=2", *GAN_SLOW])
def test_a_gan_trains_as_one_device(plan: str) -> None:
    # The generator's step runs backward through the discriminator, which left the
    # discriminator's gradients (of that step's loss sums) on its parameters, and its next
    # run.step added them to its own: from the second step on every layout, one process
    # included, trained another discriminator than one device's loop, which zeroes them. And
    # the two run.step calls per batch counted as two steps (steps_done 6 after 3 batches).
    want = M.gan_reference()
    got = run_distributed(M.train_gan, 1 if plan in ("", "grad_accum=2") else 2, plan,
                          timeout=120)[0]
    _gan_as_one_device(got, want)
    assert got["steps_done"] == M.STEPS


def test_the_progress_line_counts_batches_and_shows_each_models_loss() -> None:
    # Each model's run.step drew its own line under a step number of its own ("step 1/3" to
    # "step 6/3"), the loss one model's or the other's by turns.
    want = M.gan_reference()
    lines = run_distributed(M.train_gan, 1, "", timeout=120)[0]["progress"]
    assert [line.split(" | ")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3"], \
        lines
    # the first step's line comes at its first model's step; from then on, once every model
    # stepped, with each one's loss by its class name (two Nets: the second numbered)
    assert lines[0].split(" | ")[1] == f"loss {want['d_losses'][0]:.4f}", lines
    for step in (1, 2):
        assert lines[step].split(" | ")[1] == (
            f"loss Net {want['d_losses'][step]:.4f}, Net#2 {want['g_losses'][step]:.4f}"), lines


@pytest.mark.parametrize("plan", ["dp=2", *[pytest.param(p, marks=pytest.mark.slow) for p in (
    "", "dp_shard=2,zero=1", "fsdp=2", "tp=2")]])
def test_distillation_from_a_frozen_teacher_trains_as_one_device(plan: str) -> None:
    # The teacher (no parameter trains) laid out beside the student: under DDP it is a
    # replica without a DDP wrapper, which torch refuses for such a module.
    want = M.distill_reference()
    got = run_distributed(M.train_distill, 1 if not plan else 2, plan, timeout=120)[0]
    _same(want["losses"], got["losses"])
    assert abs(got["evaluated"] - want["evaluated"]) <= REL * want["evaluated"]
    _same_state(want["state"], got["state"])


@pytest.mark.parametrize("plan", ["fsdp=2", pytest.param("tp=2", marks=pytest.mark.slow)])
def test_two_models_saved_apart_resume_under_another_layout(tmp_path, plan: str) -> None:
    # Saved after 2 batches under dp=2, each model with its optimizer in its own folder: the
    # checkpoints said step 4 (two run.step calls a batch), and the resumed loader started at
    # batch 4 of a 3-step run, training nothing.
    folder = str(tmp_path)
    first = run_distributed(M.train_gan, 2, "dp=2", 2, folder, timeout=120)[0]
    assert sorted(p.name for p in (tmp_path / "gen").iterdir()) == ["step-00000002"]
    rest = run_distributed(M.train_gan, 2, plan, M.STEPS, folder, True, timeout=120)[0]
    want = M.gan_reference()
    _gan_as_one_device({**rest, "d_losses": first["d_losses"] + rest["d_losses"],
                        "g_losses": first["g_losses"] + rest["g_losses"]}, want)


def test_checkpointing_in_init_refuses_a_second_stepped_model(tmp_path) -> None:
    # plait.init(checkpoint=...) saved the last model stepped (the generator) alone, and a
    # resumed run loaded it into the first model it stepped.
    with pytest.raises(WorkerError) as err:
        run_distributed(M.train_gan, 1, "", checkpoint=str(tmp_path), timeout=120)
    message = err.value.message
    assert "plait.init(checkpoint=...) saves and resumes one model" in message, message
    assert "a second (Net after Net)" in message, message
    assert "run.save(folder + '/gen', model=gen, optimizer=opt_g)" in message, message


def _params(factory: Any) -> int:
    return sum(p.numel() for p in factory().parameters())


def test_the_ledger_measures_every_models_traffic_per_batch() -> None:
    # Both models' run.step calls counted as steps (6 "steps" of 5 batches, the bytes per step
    # halved) beside an expected column for one model (ratio 1.5): now per batch, all of them
    # (the generator's backward reduces the discriminator's gradients too), no expected.
    got = run_distributed(M.train_gan, 2, "dp=2", 5, None, False, True, timeout=120)[0]
    comm = got["summary"]["comm"]
    assert comm["steps"] == 3, comm  # 5 batches, the first 2 left out
    (row,) = comm["rows"]
    disc, gen = _params(M.discriminator), _params(M.generator)
    assert row["payload_bytes"] == 4 * (disc + gen + disc), row
    assert row["expected_bytes"] is None, row
    assert any("run.step trained 2 models on each batch (Net, Net#2)" in n
               for n in comm["notes"]), comm["notes"]


def test_the_ledger_prices_the_student_not_the_teacher_laid_out_after_it() -> None:
    # The expected column priced the last model laid out: the frozen teacher, no gradient.
    got = run_distributed(M.train_distill, 2, "dp=2", 4, True, timeout=120)[0]
    (row,) = got["summary"]["comm"]["rows"]
    assert row["payload_bytes"] == 4 * _params(M.student), row
    assert row["ratio"] == pytest.approx(1.0), row


@pytest.mark.parametrize("plan", ["fsdp=2", *[pytest.param(p, marks=pytest.mark.slow) for p in (
    "", "dp=2", "dp_shard=2,zero=1", "tp=2")]])
def test_an_ema_copy_laid_out_as_its_model_trains_as_one_device(plan: str) -> None:
    # The copy taken before run.parallelize and laid out itself (frozen): each of its
    # parameters is laid out as the model's (the same shard under ZeRO-3, the same split under
    # tp), so the update pairs them; run.evaluate of the copy is one device's.
    want = M.ema_reference()
    got = run_distributed(M.train_ema, 1 if not plan else 2, plan, timeout=120)[0]
    _same(want["losses"], got["losses"])
    assert abs(got["evaluated"] - want["evaluated"]) <= REL * want["evaluated"]
    _same_state(want["ema"], got["ema"])


@pytest.mark.parametrize("plan", ["", "dp=2"])
def test_a_model_built_after_another_is_laid_out_draws_on_as_one_device(plan: str) -> None:
    # run.parallelize started the RNG from the seed: a second critic of the same class built
    # after the first one's call drew what the first drew (one device builds two different
    # critics from one stream of draws), and plait warned about it. It now leaves the stream
    # where building the model left it.
    want = M.two_critics_reference()
    for built_first in (False, True):
        one, two, said = run_distributed(M.two_critics, 2 if plan else 1, plan, built_first,
                                         timeout=60)[0]
        assert not said, said
        _same_state(want[0], one)
        _same_state(want[1], two)


def test_noise_drawn_in_the_loop_is_named_as_the_same_on_every_replica() -> None:
    # plait seeds every rank alike, so the generator's noise drawn with torch.randn in the loop
    # was the same on both data replicas. The first-step check of the replicas' batches ran on
    # the first model's first step only (the discriminator's rows differ): nothing was said.
    said = run_distributed(M.noise_in_the_loop, 2, "dp=2", timeout=60)[0]
    (same,) = [w for w in said if "got the same batch at the first step" in w]
    assert "a GAN's noise, torch.randn(...)) is the same on every rank" in same, same
    assert "draw it in the dataset's __getitem__" in same, same


@pytest.mark.slow
def test_distillation_under_a_pipeline_keeps_the_teacher_whole() -> None:
    # A laid-out teacher cannot be called under pp (it runs through its schedule): kept whole
    # on the device, the pipelined student trains as one device's.
    want = M.distill_reference()
    got = run_distributed(M.train_distill, 2, "pp=2,mb=2", M.STEPS, False, True,
                          timeout=120)[0]
    _same(want["losses"], got["losses"])
    _same_state(want["state"], got["state"])


@pytest.mark.slow
def test_plait_check_passes_the_student_beside_its_teacher_as_one_module(capsys) -> None:
    import json

    from plait.cli import main

    code = main(["check", "--plan", "dp=2", "--model", "tests._multi_models:distill_factory",
                 "--steps", "3", "--timeout", "120", "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, (out, err)
    assert json.loads(out)["ok"] is True, out


def test_calling_a_pipelined_teacher_says_to_keep_it_whole() -> None:
    from plait.parallel.pipeline import PipelinedModel

    with pytest.raises(RuntimeError, match=r"a frozen teacher giving distillation targets\) "
                                           r"needs no pipeline: leave it out of "
                                           r"run.parallelize .*teacher.to\(run.device\)"):
        PipelinedModel([torch.nn.Linear(2, 2)])(torch.zeros(1, 2))


def test_the_progress_event_carries_each_models_loss() -> None:
    import json

    from plait.report import progress_event, progress_line
    from plait.runtime import StepStats

    stats = StepStats(step_times=[0.1], tokens=[16], unit="samples",
                      named_losses={"Discriminator": torch.tensor(0.5),
                                    "Generator": torch.tensor(0.25)})
    event = json.loads(progress_event(1, 3, 0.5, stats))
    assert event["loss"] == 0.5 and event["losses"] == {"Discriminator": 0.5, "Generator": 0.25}
    assert "| loss Discriminator 0.5000, Generator 0.2500 |" in progress_line(1, 3, 0.5, stats)
    stats.named_losses = {"Net": torch.tensor(0.5)}  # one model: the line as it always was
    assert "losses" not in json.loads(progress_event(1, 3, 0.5, stats))
    assert "| loss 0.5000 |" in progress_line(1, 3, 0.5, stats)


@pytest.mark.slow
def test_plan_auto_lays_out_both_models_as_it_chose_for_the_first() -> None:
    want = M.gan_reference(clip=1.0)
    got = run_distributed(M.train_gan, 2, "auto", timeout=300)[0]
    assert got["plan"] == "dp_replicate=2", got["plan"]
    _gan_as_one_device(got, want)


def test_the_other_models_optimizer_is_named_as_such() -> None:
    # It was refused as an optimizer built before run.parallelize replaced the parameters.
    said = run_distributed(M.swapped_optimizers, 1, "", timeout=60)[0]
    held = len(list(M.generator().parameters()))
    assert said.startswith(f"run.step got the optimizer of another model: it holds {held} "
                           f"parameter(s) of Net, laid out with run.parallelize"), said
    assert "pass each model its own optimizer" in said and "built before" not in said, said


@pytest.mark.slow
def test_a_gan_under_a_pipeline_stops_at_the_first_call_outside_its_step() -> None:
    with pytest.raises(WorkerError, match=r"a pipelined model runs through its schedule"):
        run_distributed(M.train_gan, 2, "pp=2,mb=2", timeout=120)


def test_a_model_trained_after_another_counts_its_own_steps() -> None:
    # Counted as a second model stepped on each batch: every call on the second joined the
    # first model's last step (steps_done stayed at 3, no progress line). Its first call still
    # joins that step (nothing tells it from a GAN's second model yet); each call after it
    # begins a step of its own and draws its line. Each step's line comes once: step 3's was
    # drawn again at the second model's first call.
    got = run_distributed(M.one_after_another, 1, "", timeout=60)[0]
    assert got["steps_done"] == [M.STEPS, 2 * M.STEPS - 1], got
    lines = [line.split(" | ")[:2] for line in got["progress"]]
    assert [step for step, _ in lines] == [
        "step 1/3", "step 2/3", "step 3/3", "step 4/3", "step 5/3"], got["progress"]
    # each model's loss while both step; the second's alone once the first is done
    assert [loss.count(",") for _, loss in lines] == [0, 0, 0, 1, 0], got["progress"]


def _each_models_loss_in_the_summary_and_tensorboard(got: dict[str, Any], want: dict[str, Any],
                                                     folder: Any, steps: int) -> None:
    # The summary's final loss and TensorBoard's train/loss were the first model's alone (the
    # critic's first update of the last step), the generator's nowhere.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from plait.report import format_summary

    critic = [want["c_losses"][(i + 1) * M.N_CRITIC - 1] for i in range(steps)]
    summary = got["summary"]
    assert summary["final_losses"] == pytest.approx(
        {"Net": critic[-1], "Net#2": want["g_losses"][-1]}, rel=REL, abs=REL), summary
    assert (f"final loss      Net {critic[-1]:.4f}, Net#2 {want['g_losses'][-1]:.4f}"
            in format_summary(summary).splitlines()), format_summary(summary)
    events = EventAccumulator(str(folder))
    events.Reload()
    for tag, values in (("train/loss/Net", critic), ("train/loss/Net#2", want["g_losses"])):
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == list(range(1, steps + 1)), tag
        assert [s.value for s in scalars] == pytest.approx(values, rel=REL, abs=REL), tag


def _wgan_as_one_device(got: dict[str, Any], want: dict[str, Any]) -> None:
    # a Wasserstein estimate crosses zero: within 1e-6 of its value or of 1
    for name in ("c_losses", "g_losses"):
        assert len(got[name]) == len(want[name]), (want[name], got[name])
        for a, b in zip(want[name], got[name], strict=True):
            assert abs(a - b) <= REL * max(abs(a), 1.0), (name, want[name], got[name])
    _same_state(want["gen"], got["gen"])
    _same_state(want["critic"], got["critic"])


@pytest.mark.parametrize("plan", ["dp=2", *[pytest.param(p, marks=pytest.mark.slow) for p in (
    "", "fsdp=2")]])
def test_a_wgan_critic_stepped_n_times_per_batch_counts_generator_steps(tmp_path, plan: str
                                                                        ) -> None:
    # Each of the critic's 3 run.step calls on a batch began a step of the job: steps_done,
    # the progress line, the saved step and the ledger's steps counted 3 per batch (15 after
    # 5 batches). With inner=True they join the step the generator's call ends.
    # The same run's summary and TensorBoard scalars carry each model's loss.
    steps = 5
    want = M.wgan_reference(steps)
    got = run_distributed(M.train_wgan, 1 if not plan else 2, plan, steps, str(tmp_path),
                          True, str(tmp_path / "tb"), timeout=120)[0]
    _wgan_as_one_device(got, want)
    _each_models_loss_in_the_summary_and_tensorboard(got, want, tmp_path / "tb", steps)
    per_batch = [i for i in range(1, steps + 1) for _ in range(M.N_CRITIC + 1)]
    assert got["steps_done"] == per_batch, got["steps_done"]
    assert got["saved"] == [f"step-{steps:08d}"], got["saved"]
    lines = [line.split(" | ")[:2] for line in got["progress"]]
    assert [step for step, _ in lines] == [f"step {i}/{steps}" for i in range(1, steps + 1)], \
        got["progress"]
    # the critic's last update's loss, the generator's, by class name (under fsdp=2 the
    # names were FSDP2's: "FSDPNet", "FSDPNet#2")
    for i, (_, loss) in enumerate(lines):
        assert loss == (f"loss Net {want['c_losses'][(i + 1) * M.N_CRITIC - 1]:.4f}, "
                        f"Net#2 {want['g_losses'][i]:.4f}"), got["progress"]
    summary = got["summary"]
    assert summary["steps"] == steps, summary
    if plan:
        assert summary["comm"]["steps"] == steps - 2, summary["comm"]  # the first 2 left out
    if plan == "dp=2":
        (row,) = summary["comm"]["rows"]
        # per step: the critic's gradients at each of its updates, then the generator's and
        # the critic's again in the generator's backward through it
        critic, gen = _params(M.discriminator), _params(M.generator)
        assert row["payload_bytes"] == 4 * (M.N_CRITIC * critic + gen + critic), row


def test_one_models_summary_is_as_it_was() -> None:
    from plait.plan import Plan
    from plait.report import format_summary, summarize
    from plait.runtime import StepStats

    stats = StepStats(losses=[torch.tensor(0.5)], step_times=[0.1], tokens=[16],
                      named_losses={"Net": torch.tensor(0.5)})
    info = summarize(Plan(), stats, [], world_size=1, accelerator="cpu", wall_s=1.0)
    assert "final_losses" not in info and info["final_loss"] == 0.5
    assert "final loss      0.5000" in format_summary(info).splitlines()


@pytest.mark.parametrize("plan", ["", pytest.param("dp=2", marks=pytest.mark.slow)])
def test_critic_updates_that_draw_their_own_batches_are_each_a_step(plan: str) -> None:
    # Each batch drawn from run.loader is a step: 3 critic batches per generator update make
    # 9 steps of a 9-batch loader, the loader's position, as one device trains them. The
    # progress line read steps 1, 2, 3, 3, 5, 6, 6, 8, 9, 9: the generator's call joining a
    # step drew its line again, and a critic's step after it was taken to wait for one.
    steps = 3
    got = run_distributed(M.train_wgan_drawn, 1 if not plan else 2, plan, False, steps,
                          timeout=120)[0]
    _wgan_as_one_device(got, M.wgan_drawn_reference(steps))
    total = steps * M.N_CRITIC
    assert got["steps_done"] == total, got["steps_done"]
    assert [line.split(" | ")[0] for line in got["progress"]] == [
        f"step {i}/{total}" for i in range(1, total + 1)], got["progress"]
    if plan:
        return
    # inner=True on batches drawn after the step began would leave the loader's position
    # ahead of steps_done, where run.loader starts again and a resumed run continues
    refused = run_distributed(M.train_wgan_drawn, 1, plan, True, steps, timeout=120)[0]
    assert refused == {"refused": (
        "run.step(Net, ..., inner=True) on a batch drawn from run.loader after its step began "
        "(1 more drawn): inner calls share the step's batch, so that the loader's position "
        "stays the job's step. Leave inner=True out when each update draws its own batch: "
        "each batch is then a step (run.loader(..., steps=n_critic * generator_steps))")}


def test_the_ledger_of_one_model_with_inner_updates_counts_the_job_steps() -> None:
    # The ledger counted each call as a step (6 for the 2 batches measured, the bytes a third
    # of a batch's) and priced one update beside them.
    got = run_distributed(M.inner_one_model, 2, "dp=2", timeout=120)[0]
    assert got["steps_done"] == 4, got
    comm = got["comm"]
    assert comm["steps"] == 2, comm  # 4 batches, the first 2 left out
    (row,) = comm["rows"]
    assert row["payload_bytes"] == 4 * 3 * _params(M.discriminator), row
    assert row["expected_bytes"] is None, row
    assert any("run.step(..., inner=True) stepped Net several times per step" in n
               for n in comm["notes"]), comm["notes"]
