"""What rank 0 shows while a run trains, and what it can leave behind.

- On a terminal: a live tqdm bar (step, loss, tokens/s, ms/step, ETA), redrawn every step;
  samples/s instead of tokens/s for inputs that are not token ids or sequences of vectors.
  Elsewhere (a pipe, a log file, ``plait run``'s tee'd rank-0 output, where a redrawn line
  would arrive as one long line or not at all): one plain line every ``log_every`` steps.
- ``events=True`` (``--format json``): at the same steps, one JSON object per line instead
  (``{"event": "progress", "step": ..., "loss": ...}``), never a bar.
- ``tensorboard=DIR``: loss, tokens/s and step time as TensorBoard scalars
  (``torch.utils.tensorboard``; needs the ``tensorboard`` package, the ``tensorboard`` extra);
  with several models stepped on each batch, each one's loss too (``train/loss/Generator``,
  by the label the line gives it).
- ``plot=PATH``: at ``finish()``, a PNG of the loss and of every rank's step time (matplotlib,
  the ``plot`` extra).

Both extras are checked when the run starts, so a missing package fails before any training.
The loss shown is the global one the runtime already computed for the step: drawing the bar
adds no communication.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from . import report


def check_extras(*, tensorboard: str | None, plot: str | None) -> None:
    """Fail fast, with the install command, when an output that was asked for cannot be made."""
    if tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(f"tensorboard={tensorboard!r} needs the tensorboard package; install it "
                         f"with: pip install 'plait[tensorboard]'")
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"plot={plot!r} needs matplotlib; install it with: "
                         f"pip install 'plait[plot]'")


class Progress:
    """Rank 0's view of training: a bar or plain lines, plus TensorBoard scalars on request.

    Built on every rank; only an ``enabled`` one (rank 0, not quiet) prints or writes.
    """

    def __init__(self, *, enabled: bool, log_every: int, total: int | None = None,
                 tensorboard: str | None = None, stream: TextIO | None = None,
                 events: bool = False):
        self.enabled = enabled
        self.log_every = log_every
        self.total = total
        self.stream = stream if stream is not None else sys.stdout
        self.events = events
        self.live = enabled and not events and _is_terminal(self.stream)
        self._bar: Any = None
        self._loss = float("nan")
        self._writer: Any = None
        if enabled and tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=tensorboard)

    def update(self, step: int, loss: float, stats: Any) -> None:
        """After step ``step`` (1-based) with its global loss (NaN when unknown)."""
        if not self.enabled:
            return
        if not math.isnan(loss):
            self._loss = loss
        if self._writer is not None:
            self._write_scalars(step, None if math.isnan(loss) else loss, stats)
        if self.live:
            self._draw(step, stats)
        elif step == 1 or step % self.log_every == 0 or step == self.total:
            line = (report.progress_event(step, self.total, self._loss, stats) if self.events
                    else report.progress_line(step, self.total, self._loss, stats))
            print(line, file=self.stream, flush=True)

    def _draw(self, step: int, stats: Any) -> None:
        from tqdm.auto import tqdm

        if self._bar is None:
            # A pseudo-terminal that reports 0 columns would get an empty bar: use 100.
            wide = shutil.get_terminal_size((0, 0)).columns > 0
            self._bar = tqdm(total=self.total, file=self.stream, unit="step",
                             dynamic_ncols=wide, ncols=None if wide else 100, leave=True)
        tps, ms = report.recent_throughput(stats)
        unit = "tok" if getattr(stats, "unit", "tokens") == "tokens" else "samples"
        self._bar.set_postfix_str(f"{report.loss_text(self._loss, stats)} | {tps:,.0f} "
                                  f"{unit}/s | {ms:.1f} ms/step", refresh=False)
        self._bar.update(step - self._bar.n)

    def _write_scalars(self, step: int, loss: float | None, stats: Any) -> None:
        if loss is not None:
            self._writer.add_scalar("train/loss", loss, step)
        named = getattr(stats, "named_losses", {})
        if len(named) > 1:  # several models stepped on each batch: each one's, as the line
            for name, value in named.items():
                self._writer.add_scalar(f"train/loss/{name}", float(value), step)
        self._writer.add_scalar("train/step_time_ms", 1000 * stats.step_times[-1], step)
        if stats.step_times[-1] > 0:
            self._writer.add_scalar(f"train/{getattr(stats, 'unit', 'tokens')}_per_s",
                                    stats.tokens[-1] / stats.step_times[-1],
                                    step)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class Stages:
    """A command's few long stages (``plait check``: the one-device run, the layout's run, the
    comparison), each said as it starts with the time since the first began.

    On a terminal: a tqdm bar over the stages, its description the stage running and its
    clock the elapsed time, redrawn in place. Elsewhere (a pipe, a log): one plain line per
    stage as it starts and one when all are done, so a log shows which stage a slow or hung
    command is in. ``stream=None``: silent.
    """

    def __init__(self, total: int, stream: TextIO | None, prefix: str):
        self.total, self.stream, self.prefix = total, stream, prefix
        self.live = stream is not None and _is_terminal(stream)
        self._bar: Any = None
        self._done = 0
        self._start = time.monotonic()

    def start(self, what: str) -> None:
        """Stage ``what`` begins (the one before it is done)."""
        if self.stream is None:
            return
        if self._bar is None and self.live:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, file=self.stream, unit="stage", leave=False,
                             bar_format="{desc} [{n_fmt}/{total_fmt} stages, {elapsed}]")
        if self._bar is not None:
            self._bar.n = self._done
            self._bar.set_description_str(f"{self.prefix}: {what}", refresh=True)
        else:
            print(f"{self.prefix}: [{self._done + 1}/{self.total}] {what} "
                  f"({time.monotonic() - self._start:.1f}s elapsed)", file=self.stream,
                  flush=True)
        self._done += 1

    def close(self, *, finished: bool = True) -> None:
        """The bar goes; a plain log gets the total time when every stage ``finished`` (after
        a failure the error is the last word, not "done")."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.stream is not None and self._done and finished:
            print(f"{self.prefix}: done in {time.monotonic() - self._start:.1f}s",
                  file=self.stream, flush=True)


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def plot_run(path: str | Path, losses: list[float], step_times_per_rank: list[list[float]],
             title: str = "") -> Path:
    """Loss per logged step (left) and every rank's step time (right), saved as a PNG.

    A rank whose line sits above the others is the straggler the whole job waits for.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    points = [(i + 1, v) for i, v in enumerate(losses) if not math.isnan(v)]
    if points:
        steps, values = zip(*points, strict=True)
        left.plot(steps, values, marker=".")
    left.set(xlabel="step", ylabel="loss (mean over the global batch)", title="loss")
    for rank, times in enumerate(step_times_per_rank):
        right.plot(range(1, len(times) + 1), [1000 * t for t in times], label=f"rank {rank}")
    right.set(xlabel="step", ylabel="ms", title="step time per rank")
    if len(step_times_per_rank) <= 16:
        right.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
