"""Which step of the job each ``run.step`` call belongs to, and when its progress line is drawn.

A step of the job is one batch. Several models stepped on one batch (a GAN's discriminator and
generator, a WGAN critic's ``n_critic`` updates and its generator's) are one step:
``steps_done``, the loader's position, a checkpoint's step number and the progress line count
batches, not calls. The rules, each a method of :class:`JobSteps`:

* **Joins or begins** (:meth:`JobSteps.joins`). A call joins the current step when every call
  of that step so far was ``inner=True`` (a critic's updates, then its generator's), or when
  it is not inner and its model is not yet stepped in that step (a GAN's generator after its
  discriminator). Any other call begins the next step: the same model again, or the first
  call of all.
* **Inner calls share the step's batch** (:meth:`JobSteps.begin`). An inner call that joins is
  refused once a batch was drawn from the training loader since its step began: the loader
  would run ahead of ``steps_done``, where ``run.loader`` starts again and a resumed run
  continues.
* **The call that ends the step** (:meth:`JobSteps.ends_step`), not an inner one: a call on
  the last model the step before stepped, or on one the step before did not step (the first
  step's only model, the call after inner ones, the first call on a model trained after
  another).
* **Which step's line to draw** (:meth:`JobSteps.draw`). Each step's line is drawn once: at
  the call that ends it, or else at the next step's first call or at ``finish()`` (a critic's
  batches of its own, then the generator's call on the last one). Loading a checkpoint of an
  earlier step draws its steps' lines again (:meth:`JobSteps.rewind`).
* **Labels** (:meth:`JobSteps.begin`). Each model's loss shows under its class name, the
  second model of one class as ``Name#2``; the line shows the models of the current step and
  the step before (:meth:`JobSteps.shown`).
* **One model under checkpoint=** (:meth:`JobSteps.begin`): its checkpoints hold one model,
  so a call on a second model is refused.

Models are keyed by ``id()``: the laid-out modules live as long as the run holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Call:
    """One ``run.step`` call as the bookkeeping placed it."""

    model: int  # id() of the model stepped
    inner: bool
    joins: bool  # part of the current step (False: it begins the next)
    first: bool  # the first call on this model: it learns what it must about the model
    closes: bool  # the call without inner=True after inner ones only: it ends their step


@dataclass
class JobSteps:
    """The bookkeeping of the job's steps over one run's ``run.step`` calls."""

    # id(model) -> its label, in the order first stepped.
    labels: dict[int, str] = field(default_factory=dict)
    # The models stepped in the current step, in order, and in the step before it.
    current: list[int] = field(default_factory=list)
    previous: list[int] = field(default_factory=list)
    # Whether every call of the current step so far was inner: the next call joins it.
    inner_open: bool = False
    inner_calls: bool = False  # whether any inner call was made
    # (id(training loader), its position) when the current step began, None without one.
    batch_began: tuple[int, int] | None = None
    line_drawn: int = 0  # the last step whose progress line was drawn

    def joins(self, model: int, inner: bool) -> bool:
        """Whether a call on ``model`` joins the current step (False: it begins the next)."""
        return bool(self.current) and (self.inner_open or (
            not inner and model not in self.current))

    def begin(self, model: int, name: str, *, inner: bool,
              loader: tuple[int, int] | None = None, one_model: bool = False) -> Call:
        """Place a call on ``model`` (its class name ``name``) before it runs. ``loader``:
        (id, position) of the training loader; ``one_model``: checkpoints are on, which hold
        one model. Raises ValueError for an inner call after a batch was drawn since its step
        began, and for a second model under ``one_model``."""
        joins = self.joins(model, inner)
        closes = joins and self.inner_open and not inner
        self.inner_calls = self.inner_calls or inner
        if inner and joins:
            self._refuse_drawn(name, loader)
        elif not joins:
            self.batch_began = loader
        first = model not in self.labels
        if first:
            if self.labels and one_model:
                raise ValueError(
                    f"plait.init(checkpoint=...) saves and resumes one model with its "
                    f"optimizer, and run.step now trains a second ({name} after "
                    f"{next(iter(self.labels.values()))}): its checkpoints would resume this "
                    f"one from its initial weights. Save each model yourself, e.g. "
                    f"run.save(folder + '/gen', model=gen, optimizer=opt_g) per model, and "
                    f"resume each with run.load(..., model=..., optimizer=...); leave "
                    f"checkpoint= out of plait.init")
            taken = sum(1 for label in self.labels.values() if label.split("#")[0] == name)
            self.labels[model] = name if not taken else f"{name}#{taken + 1}"
        return Call(model=model, inner=inner, joins=joins, first=first, closes=closes)

    def _refuse_drawn(self, name: str, loader: tuple[int, int] | None) -> None:
        """The loader moved since the step began (another batch drawn): refused."""
        began = self.batch_began
        if loader is None or began is None or began[0] != loader[0] or loader[1] == began[1]:
            return
        raise ValueError(
            f"run.step({name}, ..., inner=True) on a batch drawn from run.loader after its "
            f"step began ({loader[1] - began[1]} more drawn): inner calls share the step's "
            f"batch, so that the loader's position stays the job's step. Leave inner=True out "
            f"when each update draws its own batch: each batch is then a step "
            f"(run.loader(..., steps=n_critic * generator_steps))")

    def done(self, call: Call) -> None:
        """Record ``call`` once its update is made: the models of this step and the step
        before move on when it began the next step."""
        if call.joins:
            if call.model not in self.current:
                self.current.append(call.model)
            self.inner_open = self.inner_open and call.inner
        else:
            self.inner_open = call.inner
            self.previous, self.current = self.current, [call.model]

    def shown(self) -> set[str]:
        """The labels whose losses the line shows: the current step's models and the step
        before's."""
        return {self.labels[k] for k in (*self.previous, *self.current)}

    def ends_step(self, call: Call) -> bool:
        """Whether ``call`` (recorded by :meth:`done`) ends the job's step, every model's loss
        known. An inner call never does."""
        if call.inner:
            return False
        if not self.previous:
            return self.current == [call.model] or call.closes
        return call.model not in self.previous or call.model == self.previous[-1]

    def draw(self, step: int) -> bool:
        """Whether ``step``'s line is still to be drawn; it counts as drawn from now on."""
        if step <= self.line_drawn:
            return False
        self.line_drawn = step
        return True

    def rewind(self, step: int) -> None:
        """A checkpoint of ``step`` was loaded: the lines after it are drawn again."""
        self.line_drawn = min(self.line_drawn, step)
