"""The job-step rules of ``plait.job_steps`` on their own, without a process group: which step
each ``run.step`` call belongs to, which call ends it, and which progress lines are drawn.
``tests/test_multi_models.py`` checks the same rules through ``run.step`` against one device."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from plait.job_steps import JobSteps

LOADER = 1234  # an id() standing for the training loader's


@dataclass
class Job:
    """``run.step``'s calls into :class:`JobSteps`, in its order, with what they decided:
    the job's step number of each call, and the steps whose lines were drawn."""

    steps: JobSteps = field(default_factory=JobSteps)
    done: int = 0  # job steps so far (len(stats.step_times) in the runtime)
    numbers: list[int] = field(default_factory=list)  # each call's step
    lines: list[int] = field(default_factory=list)  # each line drawn, by its step
    drawn: list[list[int]] = field(default_factory=list)  # the lines each call drew
    shown: list[set[str]] = field(default_factory=list)  # the labels on each step's line

    def call(self, model: int, name: str, inner: bool = False, position: int = 0) -> None:
        call = self.steps.begin(model, name, inner=inner, loader=(LOADER, position))
        self.drawn.append([])
        step = self.done + (0 if call.joins else 1)
        self.steps.done(call)
        if not call.joins:
            self._draw(step - 1)
            self.shown.append(self.steps.shown())
            self.done += 1
        if self.steps.ends_step(call):
            self._draw(step)
        self.numbers.append(step)

    def finish(self) -> None:
        self._draw(self.done)

    def _draw(self, step: int) -> None:
        if step > 0 and self.steps.draw(step):
            self.lines.append(step)
            if self.drawn:
                self.drawn[-1].append(step)


def test_a_gans_two_calls_per_batch_are_one_step() -> None:
    job = Job()
    for _ in range(3):
        job.call(1, "Disc")
        job.call(2, "Gen")
    job.finish()
    assert job.numbers == [1, 1, 2, 2, 3, 3]
    # step 1's line at its first call (nothing tells a GAN from one model yet); each later
    # step's at the generator's call, the last of the step before
    assert job.drawn == [[1], [], [], [2], [], [3]]
    assert job.shown == [{"Disc"}, {"Disc", "Gen"}, {"Disc", "Gen"}]
    assert list(job.steps.labels.values()) == ["Disc", "Gen"]
    assert not job.steps.inner_calls


def test_two_models_of_one_class_are_labelled_apart() -> None:
    steps = JobSteps()
    first = steps.begin(1, "Net", inner=False)
    second = steps.begin(2, "Net", inner=False)
    again = steps.begin(1, "Net", inner=False)
    assert steps.labels == {1: "Net", 2: "Net#2"}
    assert (first.first, second.first, again.first) == (True, True, False)


def test_a_model_trained_after_another_counts_its_own_steps() -> None:
    job = Job()
    for model, name in ((1, "A"), (2, "B")):
        for _ in range(3):
            job.call(model, name)
    job.finish()
    # B's first call joins A's last step; each call on B after it begins a step of its own
    assert job.numbers == [1, 2, 3, 3, 4, 5]
    assert job.lines == [1, 2, 3, 4, 5]  # step 3's line once, not again at B's first call
    assert job.drawn == [[1], [2], [3], [], [4], [5]]
    assert job.shown == [{"A"}, {"A"}, {"A"}, {"A", "B"}, {"B"}]


def test_a_wgan_critics_inner_calls_join_the_generators_step() -> None:
    job = Job()
    for batch in range(3):
        for _ in range(3):
            job.call(1, "Critic", inner=True, position=batch + 1)
        job.call(2, "Gen", position=batch + 1)
    job.finish()
    assert job.numbers == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert job.lines == [1, 2, 3]
    assert job.drawn == [[], [], [], [1], [], [], [], [2], [], [], [], [3]]  # the closing calls
    assert job.steps.inner_calls
    assert list(job.steps.labels.values()) == ["Critic", "Gen"]


def test_one_model_with_inner_calls_counts_the_call_without_it() -> None:
    job = Job()
    for _ in range(2):
        for inner in (True, True, False):
            job.call(1, "Net", inner=inner)
    assert job.numbers == [1, 1, 1, 2, 2, 2]
    assert job.drawn == [[], [], [1], [], [], [2]]


def test_critic_calls_on_batches_of_their_own_are_each_a_step() -> None:
    job = Job()
    position = 0
    for _ in range(3):
        for _ in range(3):
            position += 1
            job.call(1, "Critic", position=position)
        job.call(2, "Gen", position=position)  # on the critic's last batch: joins its step
    job.finish()
    assert job.numbers == [1, 2, 3, 3, 4, 5, 6, 6, 7, 8, 9, 9]
    assert job.lines == list(range(1, 10))  # each step's line once
    # a critic's step after the generator's call is drawn at the next step's first call
    assert job.drawn == [[1], [2], [3], [], [], [4, 5], [6], [], [], [7, 8], [9], []]


def test_an_inner_call_on_a_batch_drawn_after_its_step_began_is_refused() -> None:
    steps = JobSteps()
    steps.done(steps.begin(1, "Critic", inner=True, loader=(LOADER, 1)))
    steps.done(steps.begin(1, "Critic", inner=True, loader=(LOADER, 1)))  # the same batch
    with pytest.raises(ValueError, match=r"^run\.step\(Critic, \.\.\., inner=True\) on a batch "
                                         r"drawn from run\.loader after its step began "
                                         r"\(2 more drawn\)"):
        steps.begin(1, "Critic", inner=True, loader=(LOADER, 3))
    # another loader (a new run.loader) and no loader are not the step's batch
    steps.begin(1, "Critic", inner=True, loader=(LOADER + 1, 3))
    steps.begin(1, "Critic", inner=True, loader=None)


def test_a_call_without_inner_after_a_drawn_batch_begins_the_next_step() -> None:
    steps = JobSteps()
    steps.done(steps.begin(1, "Critic", inner=True, loader=(LOADER, 1)))
    closing = steps.begin(2, "Gen", inner=False, loader=(LOADER, 1))
    assert closing.joins and closing.closes
    steps.done(closing)
    again = steps.begin(1, "Critic", inner=False, loader=(LOADER, 2))
    assert not again.joins


def test_a_second_model_under_checkpoints_is_refused() -> None:
    steps = JobSteps()
    steps.begin(1, "Gen", inner=False, one_model=True)
    steps.begin(1, "Gen", inner=False, one_model=True)
    with pytest.raises(ValueError, match=r"trains a second \(Disc after Gen\)"):
        steps.begin(2, "Disc", inner=False, one_model=True)


def test_loading_an_earlier_step_draws_its_lines_again() -> None:
    steps = JobSteps()
    assert steps.draw(1) and steps.draw(2) and steps.draw(3)
    assert not steps.draw(3) and not steps.draw(2)
    steps.rewind(1)
    assert steps.draw(2)
    steps.rewind(5)  # a later step changes nothing
    assert not steps.draw(2)
