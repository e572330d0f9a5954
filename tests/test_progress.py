"""Rank 0's progress output: plain lines off a terminal, a tqdm bar on one, TensorBoard scalars
and the end-of-run plot, each checked against the figures the run measured."""

import io
import math
import re

import pytest
import torch

from plait import report
from plait.plan import Plan
from plait.progress import Progress, check_extras, plot_run
from plait.runtime import StepStats


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def _stats(n, step_s=0.5, tokens=1000):
    s = StepStats()
    s.step_times = [step_s] * n
    s.tokens = [tokens] * n
    return s


def test_progress_line_has_throughput_and_eta():
    line = report.progress_line(4, 10, 2.5, _stats(4))
    assert line == "step  4/10 | loss 2.5000 | 2,000 tok/s | 500.0 ms/step | ETA 0:00:03"
    assert "ETA" not in report.progress_line(4, None, 2.5, _stats(4))
    assert report.eta(10, 10, _stats(10)) == "0:00:00"
    assert report.eta(0, 7300, _stats(1, step_s=1.0)) == "2:01:40"


def test_rates_leave_the_first_step_out_and_the_eta_counts_time_between_steps():
    """A slow first step (allocation, compilation) does not drag tokens/s below what ms/step
    says; the ETA runs on wall time between step ends, which includes what the loop does
    outside run.step (here 0.5 s of data loading per 0.5 s step)."""
    stats = _stats(5)
    stats.step_times[0] = 5.0
    assert report.recent_throughput(stats) == (2000.0, 500.0)
    assert report.eta(5, 25, stats) == "0:00:10"  # no step ends recorded: 20 x 0.5 s
    stats.step_ends = [10.0 + i for i in range(5)]  # one step per second of wall time
    assert report.eta(5, 25, stats) == "0:00:20"  # 20 steps x 1 s


def test_plain_lines_only_on_logged_steps():
    out = io.StringIO()
    p = Progress(enabled=True, log_every=2, total=4, stream=out)
    assert not p.live
    stats = StepStats()
    for step, loss in enumerate([3.0, math.nan, 2.0, 1.5], 1):
        stats.step_times.append(0.1)
        stats.tokens.append(10)
        p.update(step, loss, stats)
    p.close()
    lines = out.getvalue().splitlines()
    assert [ln.split("|")[0].strip() for ln in lines] == ["step 1/4", "step 2/4", "step 4/4"]
    assert "loss 3.0000" in lines[1]  # a step without a loss shows the last one known
    assert "loss 1.5000" in lines[-1]


def test_live_bar_on_a_terminal_keeps_the_last_reduced_loss():
    out = FakeTerminal()
    p = Progress(enabled=True, log_every=10, total=3, stream=out)
    assert p.live
    stats = StepStats()
    for step, loss in enumerate([4.25, math.nan, math.nan], 1):
        stats.step_times.append(0.2)
        stats.tokens.append(100)
        p.update(step, loss, stats)
    p.close()
    text = out.getvalue()
    assert "3/3" in text and "loss 4.2500" in text and "500 tok/s" in text
    assert "\r" in text  # redrawn in place, not one line per step


def test_disabled_progress_prints_nothing():
    out = FakeTerminal()
    p = Progress(enabled=False, log_every=1, total=2, stream=out)
    p.update(1, 1.0, _stats(1))
    p.close()
    assert out.getvalue() == ""


def test_tensorboard_scalars_match_the_run(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    p = Progress(enabled=True, log_every=2, total=3, stream=io.StringIO(),
                 tensorboard=str(tmp_path))
    stats = StepStats()
    for step, (loss, t) in enumerate([(3.0, 0.5), (math.nan, 0.25), (2.0, 0.125)], 1):
        stats.step_times.append(t)
        stats.tokens.append(64)
        p.update(step, loss, stats)
    p.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss == [(1, 3.0), (3, 2.0)]  # only the steps whose loss was reduced
    ms = [e.value for e in acc.Scalars("train/step_time_ms")]
    assert ms == pytest.approx([500.0, 250.0, 125.0])
    tps = [e.value for e in acc.Scalars("train/tokens_per_s")]
    assert tps == pytest.approx([128.0, 256.0, 512.0])


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = plot_run(tmp_path / "sub" / "run.png", [3.0, math.nan, 2.0],
                   [[0.1, 0.2, 0.1], [0.1, 0.3, 0.1]], title="dp=2")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_extra_is_named_before_training(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'plait\[tensorboard\]'"):
        check_extras(tensorboard="runs", plot=None)


def _train_with_outputs(rank, world, tb_dir, png):
    import plait
    from plait.data import TextDataset
    from plait.models.transformer import build, lm_loss

    run = plait.init(f"dp={world}", log_every=2, tensorboard=tb_dir, plot=png, seed=0)
    model = run.parallelize(build("test", seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in run.loader(TextDataset(seq_len=16), batch_size=4, steps=3):
        run.step(model, batch, lm_loss, opt)
    losses = [float(v) for v in run.stats.losses]
    info = run.finish(print_summary=False)
    return losses, info["plot"]


def test_two_ranks_write_tensorboard_and_plot_on_rank_0(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from plait.spawn import run_distributed

    png = tmp_path / "run.png"
    out = run_distributed(_train_with_outputs, 2, str(tmp_path / "tb"), str(png), timeout=180)
    losses = out[0][0]
    assert png.read_bytes()[:4] == b"\x89PNG"
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    logged = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert logged == [(i + 1, pytest.approx(v)) for i, v in enumerate(losses) if v == v]
    assert len(list((tmp_path / "tb").iterdir())) == 1  # rank 0 only


def test_throughput_counts_tokens_positions_or_samples():
    """Token ids count each id (those an attention_mask keeps, when there is one); a float
    batch x positions x features input counts positions;
    images and feature rows count samples, shown as samples/s."""
    from plait.runtime import _count_items

    assert _count_items(torch.zeros(4, 16, dtype=torch.long)) == (64, "tokens")
    assert _count_items({"input_ids": torch.zeros(2, 8, dtype=torch.long)}) == (16, "tokens")
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 5:] = 0  # three padding positions are not throughput
    ids = torch.zeros(2, 8, dtype=torch.long)
    assert _count_items({"input_ids": ids, "attention_mask": mask}) == (13, "tokens")
    assert _count_items(({"input_ids": ids, "attention_mask": mask.bool()}, ids)) == (13, "tokens")
    assert _count_items((torch.zeros(4, 16, 12), torch.zeros(4))) == (64, "tokens")
    assert _count_items(torch.zeros(4, 3, 32, 32)) == (4, "samples")
    assert _count_items(torch.zeros(4, 12)) == (4, "samples")
    stats = StepStats(step_times=[0.5, 0.5], tokens=[4, 4], unit="samples")
    assert "8 samples/s" in report.progress_line(2, 4, 1.0, stats)
    info = report.summarize(Plan(), stats, [], world_size=1, accelerator="cpu", wall_s=1.0)
    assert info["samples_per_s"] == 8 and info["tokens_per_s"] is None


def test_summary_rates_leave_out_the_warm_up_and_agree_with_the_mean_step():
    """On PyTorch/XLA the first two steps compile: they stay out of the throughput (it was
    ~18x below what the median step time implied); what is kept is a whole rate, so it is the
    tokens per step over the mean step time, printed beside the median."""
    times = [30.0, 25.0, 0.1, 0.1, 0.3, 0.1]  # two compiling steps, one slow step later
    stats = StepStats(step_times=times, tokens=[128] * 6)
    info = report.summarize(Plan(), stats, [{"peak_rss_bytes": 1.0}], world_size=1,
                            accelerator="xla", wall_s=60.0, warmup=2)
    assert info["warmup_steps"] == 2 and info["mean_step_time_s"] == pytest.approx(0.15)
    assert info["tokens_per_s"] == pytest.approx(128 / 0.15)
    assert info["step_time_s"] == pytest.approx(0.1)
    text = report.format_summary(info)
    assert "853 tokens/s" in text and "100.0 ms (median), 150.0 ms (mean), after 2 warm-up " \
                                      "steps" in text, text
    short = report.summarize(Plan(), StepStats(step_times=times[:4], tokens=[1] * 4), [],
                             world_size=1, accelerator="xla", wall_s=1.0, warmup=2)
    assert short["warmup_steps"] == 0  # fewer than 3 steps would remain: all are counted


class _MaskedLM(torch.nn.Module):
    """Token ids with an attention_mask in, logits out (a model written for this test)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(32, 8)
        self.out = torch.nn.Linear(8, 32)

    def forward(self, input_ids, attention_mask):
        return self.out(self.emb(input_ids) * attention_mask[..., None])


def _masked_batch(step, rank):
    """Rows of 12 positions; each rank keeps its own number of them (padding differs)."""
    g = torch.Generator().manual_seed(10 * step + rank)
    ids = torch.randint(0, 32, (2, 12), generator=g)
    kept = torch.tensor([3 + 4 * rank + step, 12 - rank])
    mask = (torch.arange(12) < kept[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, -100)


def _tokens_per_step(rank, world, spec):
    import torch.nn.functional as F

    import plait

    run = plait.init(spec, quiet=True, seed=0)
    model = run.parallelize(_MaskedLM())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        run.step(model, _masked_batch(step, rank),
                 lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), opt)
    tokens = list(run.stats.tokens)
    run.finish(print_summary=False)
    return tokens


@pytest.mark.parametrize("spec", ["dp=2", "dp=2,zero=3"])
def test_tokens_per_step_sum_what_each_data_rank_kept(spec):
    """Throughput counts the tokens every data rank's attention_mask keeps, not rank 0's times
    the number of ranks: padding differs from rank to rank."""
    from plait.spawn import run_distributed

    out = run_distributed(_tokens_per_step, 2, spec, timeout=180)
    want = [sum(int(_masked_batch(step, r)[0]["attention_mask"].sum()) for r in range(2))
            for step in range(3)]
    assert want != [2 * int(_masked_batch(s, 0)[0]["attention_mask"].sum()) for s in range(3)]
    assert out[0] == want and out[1] == want


def test_a_run_with_no_steps_left_says_so_instead_of_a_nan_step_time():
    """A run resumed from a checkpoint at its last step trains nothing (the README's commands
    run one after another on one ckpt/ do): its summary says no step ran, not 'nan ms'."""
    info = report.summarize(Plan(), StepStats(), [{"peak_rss_bytes": 1.0}], world_size=1,
                            accelerator="cpu", wall_s=1.0)
    text = report.format_summary(info)
    assert "nan" not in text, text
    assert "step time       - (no step ran)" in text, text


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_stages_are_plain_lines_in_a_log_and_a_bar_on_a_terminal():
    """plait check's stages: elsewhere than a terminal, one line as each starts (numbered,
    with the time so far) and one at the end; on a terminal a tqdm bar whose description is
    the stage running; silent without a stream."""
    from plait.progress import Stages

    log = io.StringIO()
    stages = Stages(2, log, "plait check")
    stages.start("the reference")
    stages.start("comparing")
    stages.close()
    lines = log.getvalue().splitlines()
    assert [re.sub(r"\d+\.\d+s", "Ts", line) for line in lines] == [
        "plait check: [1/2] the reference (Ts elapsed)",
        "plait check: [2/2] comparing (Ts elapsed)",
        "plait check: done in Ts"], lines

    tty = _Terminal()
    stages = Stages(2, tty, "plait check")
    stages.start("the reference")
    drawn = tty.getvalue()
    stages.close()
    assert "plait check: the reference [0/2 stages, 00:00]" in drawn, drawn
    assert "[1/2]" not in tty.getvalue()  # the bar, not the log lines

    Stages(2, None, "x").start("nothing")  # no stream: nothing to write to, no error

    failed = io.StringIO()
    stages = Stages(2, failed, "plait check")
    stages.start("the reference")
    stages.close(finished=False)  # a stage failed: its error is the last word, not "done"
    assert len(failed.getvalue().splitlines()) == 1, failed.getvalue()
