"""Pipeline parallelism: schedules as data, stage splitting, and training equal to one device.

Correctness cases run ``plait.check.check`` (5 AdamW steps, fp32, every parameter compared by
canonical name against a single-process run). The cheap, unmarked set covers one schedule of
each runtime family (single-stage 1F1B, multi-stage zero-bubble with split backward), a
non-transformer model, and pp x dp; ``-m slow`` runs every schedule at pp=2 and pp=4.
"""

import math
import os

import pytest
import torch
import torch.nn as nn

from plait.check import CheckConfig, check
from plait.models.transformer import build, preset
from plait.parallel.pipeline import PipelineRunner
from plait.parallel.pipeline_split import (
    PipelineSkip,
    PipelineZero,
    add_zero_stand_ins,
    additive_by_running,
    additive_modules,
    build_stage_module,
    find_blocks,
    plan_stages,
    shared_parameters,
)
from plait.parallel.schedules import (
    TORCH_SCHEDULE_NAMES,
    check_schedule_args,
    format_schedule,
    peak_in_flight,
    rank_orders,
    schedule_class,
    schedule_grid,
    stage_to_rank,
    theoretical_bubble,
)
from plait.partition import balanced_partition, bounds
from plait.plan import PP_SCHEDULES, Plan
from plait.spawn import run_distributed
from tests._pipeline_models import (
    deep_mlp,
    evaluate_reference,
    evaluate_under_schedules,
    mlp_batch,
    timeline_worker,
    transformer8,
)

ALL = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2),
       ("interleaved_zb", 2), ("zbv", 2)]
TOL = 1e-5


# ------------------------------------------------------------------ schedules as data (pure)
def _parse_grid(text):
    """Rank rows of a formatted schedule -> {rank: [(kind, mb, stage) per time step or None]}."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("rank "):
            parts = line.split()
            cells = []
            for c in parts[2:]:
                if c == ".":
                    cells.append(None)
                    continue
                label, _, stage = c.partition("@")
                cells.append((label[0], int(label[1:]), int(stage) if stage else None))
            rows[int(parts[1])] = cells
    return rows


@pytest.mark.parametrize("schedule,v", ALL)
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (2, 6)])
def test_printed_grid_orders_each_microbatch_once_forward_first(schedule, v, pp, m):
    if schedule in ("interleaved_1f1b", "interleaved_zb") and m % max(1, m // pp):
        pytest.skip("microbatches not a multiple of the rounds")
    text = format_schedule(schedule, pp, m, v)
    rows = _parse_grid(text)
    assert sorted(rows) == list(range(pp))
    owner = stage_to_rank(schedule, pp, v)
    for rank, cells in rows.items():
        seen = {}
        for t, cell in enumerate(cells):
            if cell is None:
                continue
            kind, mb, stage = cell
            stage = rank if stage is None else stage
            assert owner[stage] == rank
            assert (kind, mb, stage) not in seen, f"{kind}{mb}@{stage} twice on rank {rank}"
            seen[(kind, mb, stage)] = t
        for stage in [s for s in range(pp * v) if owner[s] == rank]:
            for mb in range(m):
                f = seen[("F", mb, stage)]
                back = [seen[(k, mb, stage)] for k in ("B", "I") if (k, mb, stage) in seen]
                assert len(back) == 1, f"stage {stage} mb {mb}: backward must appear once"
                assert f < back[0], f"{schedule}: B{mb} before F{mb} on stage {stage}"
                if ("I", mb, stage) in seen:
                    assert seen[("W", mb, stage)] > back[0]
        # across ranks: a forward never runs before the previous stage's forward of that mb
    flat = {(k, mb, s if s is not None else r): t
            for r, cells in rows.items() for t, c in enumerate(cells) if c
            for k, mb, s in [c]}
    for (k, mb, s), t in flat.items():
        if k == "F" and s > 0:
            assert flat[("F", mb, s - 1)] < t


def test_bubble_theory_and_memory_in_flight():
    assert theoretical_bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("1f1b", 2, 16) == pytest.approx(1 / 17)
    assert theoretical_bubble("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    # zero-bubble beats 1F1B at the same p and m; the V schedule too once m >= 2p
    for pp, m in [(2, 4), (4, 8), (4, 16)]:
        assert theoretical_bubble("interleaved_zb", pp, m, 2) < theoretical_bubble("1f1b", pp, m)
        assert theoretical_bubble("zbv", pp, m, 2) < theoretical_bubble("1f1b", pp, m)
    assert peak_in_flight("gpipe", 4, 8) == {r: 8 for r in range(4)}
    assert peak_in_flight("1f1b", 4, 8) == {0: 4, 1: 3, 2: 2, 3: 1}  # p - rank


def test_grid_has_no_idle_row_and_1f1b_text():
    text = format_schedule("1f1b", 2, 4)
    assert "rank 0  F0 F1 .  B0 F2 B1 F3 B2 .  B3" in text
    assert "rank 1  .  F0 B0 F1 B1 F2 B2 F3 B3" in text
    grid = schedule_grid("gpipe", 2, 2)
    assert grid == [["F0", "F1", ".", ".", "B0", "B1"], [".", "F0", "F1", "B0", "B1", "."]]
    assert rank_orders("zbv", 2, 4, 2)[0][0].stage == 0
    assert stage_to_rank("zbv", 2, 2) == [0, 1, 1, 0]


@pytest.mark.parametrize("args,match", [
    (("1f1b", 4, 2, 1), r"at least 4 microbatches.*microbatches=2.*gpipe"),
    (("interleaved_1f1b", 2, 5, 2), r"microbatches=5 is not a multiple of its 2 rounds"),
    (("zbv", 2, 4, 3), r"exactly 2 stages per rank"),
    (("gpipe", 2, 4, 2), r"virtual_stages=2 needs interleaved"),
    (("bogus", 2, 4, 1), r"unknown pipeline schedule 'bogus'"),
])
def test_bad_schedule_arguments_name_numbers_and_fix(args, match):
    with pytest.raises(ValueError, match=match):
        check_schedule_args(*args)


def test_schedule_command_prints_every_schedule(capsys):
    import argparse

    from plait.parallel.schedules import add_schedule_arguments, schedule_command

    parser = argparse.ArgumentParser()
    add_schedule_arguments(parser)
    assert schedule_command(parser.parse_args(["--all", "--pp", "2", "-m", "4"])) == 0
    out = capsys.readouterr().out
    for name, _ in ALL:
        assert f"{name}: pp=2 microbatches=4" in out


# ------------------------------------------------------------------ stage splitting (pure)
def test_split_keeps_canonical_names_and_only_own_parameters():
    model = build(preset("test"), seed=0)
    full = dict(model.named_parameters())
    plan = Plan(pp=2, microbatches=2)
    path, specs = plan_stages(model, plan)
    assert path == "layers" and [(s.start, s.end) for s in specs] == [(0, 2), (2, 4)]
    names = []
    for spec in specs:
        stage = build_stage_module(model, path, spec)
        own = dict(stage.named_parameters())
        assert all(full[n] is p for n, p in own.items())
        names += list(own)
    assert sorted(names) == sorted(full)  # every parameter on exactly one stage
    first = build_stage_module(model, path, specs[0])
    last = build_stage_module(model, path, specs[1])
    assert isinstance(first.output, PipelineSkip) and isinstance(last.tok_embeddings, PipelineSkip)
    assert isinstance(first.layers[3], PipelineSkip)
    assert not isinstance(model.layers[3], PipelineSkip)
    # the stages chained reproduce the full model's forward
    tokens = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), model(tokens))


class _UntracedParentResidual(nn.Module):
    """Residuals in the parent's forward (h = h + block(h)) and a second embedding added to
    the first, in a forward torch.fx cannot trace (it branches on a tensor's shape)."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(16, 8), nn.Embedding(6, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > 6:
            raise ValueError("sequence longer than the position table")
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_residuals_in_an_untraceable_parent_are_found_by_running_it():
    """fx cannot trace the forward; running it once on meta tensors finds what adds to the
    running activation (the blocks, the position embedding; not the token embedding), and the
    stages with stand-ins that add zero chain to the full model's forward."""
    torch.manual_seed(0)
    model = _UntracedParentResidual()
    path, specs = plan_stages(model, Plan(pp=2, microbatches=2))
    assert path == "blocks" and additive_modules(model, path) is None
    tokens = torch.randint(0, 16, (2, 5))
    found = additive_by_running(model, path, tokens, {})
    assert found == {"blocks.0", "blocks.1", "blocks.2", "blocks.3", "pos"}
    first, last = (build_stage_module(model, path, s) for s in specs)
    assert isinstance(first.blocks[3], PipelineSkip)  # built before the forward ran
    add_zero_stand_ins([first, last], found)
    assert isinstance(first.blocks[3], PipelineZero) and isinstance(last.pos, PipelineZero)
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), model(tokens))


class _CountingBlock(nn.Module):
    """A block that counts its calls in a buffer it reassigns (``+=`` on a 0-dim tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.down = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return h + self.down(torch.relu(self.up(h)))


def test_fx_traces_leave_a_forward_that_assigns_to_its_module_unchanged():
    """fx runs a forward on proxies: ``self.tokens_seen += n`` stored an fx Proxy in the
    user's model in place of the buffer (at the pipeline split and in TP plan inference), and
    ``model.to(device)`` then failed with fx's "symbolically traced variables cannot be used as
    inputs to control flow". The traces put every module back as it was."""
    from plait.parallel.tp_infer import trace_block
    from tests._workers_ckpt_users import MODELS

    model = MODELS["rootstats"]()
    before = dict(model.named_buffers())
    assert additive_modules(model, "blocks") == set()
    for spec in plan_stages(model, Plan(pp=2, microbatches=2))[1]:
        build_stage_module(model, "blocks", spec)
    block = _CountingBlock()
    calls = block.calls
    assert not isinstance(trace_block(block), str)
    assert dict(model.named_buffers()) == before and block.calls is calls
    model.to(torch.float64)  # what failed
    assert model.tokens_seen.dtype == torch.long and block.calls.item() == 0


def test_buffers_a_step_changes_are_named_as_the_model_names_them():
    """The data-parallel warning about buffers a training step changed named a pipeline's
    buffers by the pipelined model's ``stages.0.ema_in``, a name the user's model lacks."""
    from plait.parallel.batchnorm import forward_statistics
    from plait.parallel.layout import Layout, record_layout
    from plait.parallel.pipeline import PipelinedModel
    from tests._workers_ckpt_users import MODELS

    model = MODELS["rootstats"]()
    path, specs = plan_stages(model, Plan(pp=2, microbatches=2))
    stages = [build_stage_module(model, path, s) for s in specs]
    piped = record_layout(PipelinedModel(stages), Layout(applied=("pipeline",),
                                                         stages=tuple(stages)))
    floating = {n for n, b in model.named_buffers() if b.is_floating_point()}
    assert set(forward_statistics(piped)) == floating
    assert {"ema_in", "ema_out", "blocks.3.scale"} <= floating


def test_a_stage_reading_a_module_it_does_not_hold_says_how_to_fix_it():
    """GPT-2's head written as F.linear(h, self.tok.weight): the last stage holds no tok, and
    the error names the module, the attribute and the fix."""

    class ParentTied(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.tok(ids)
            for block in self.blocks:
                h = block(h)
            return torch.nn.functional.linear(h, self.tok.weight)

    model = ParentTied()
    path, specs = plan_stages(model, Plan(pp=2, microbatches=2))
    first, last = (build_stage_module(model, path, s) for s in specs)
    hidden = first(torch.randint(0, 16, (2, 5)))
    with pytest.raises(AttributeError, match=r"tok\.weight: .*must be a module.*"
                                             r"self\.head\.weight = self\.tok\.weight"):
        last(hidden)
    assert not hasattr(last.tok, "weight")


def test_split_balances_costs_and_honours_split_points():
    assert bounds(balanced_partition([1] * 8, 4)) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert balanced_partition([4, 1, 1, 1, 1], 2) == [1, 4]
    assert balanced_partition([1, 1, 1, 1], 2, last_extra=2) == [3, 1]
    model = transformer8()
    plan = Plan(pp=2, microbatches=2, options={"split_points": ["layers.5"]})
    assert [(s.start, s.end) for s in plan_stages(model, plan)[1]] == [(0, 5), (5, 8)]
    plan = Plan(pp=2, microbatches=2, options={"stage_costs": [1, 1, 1, 1, 1, 1, 6, 1]})
    assert [(s.start, s.end) for s in plan_stages(model, plan)[1]] == [(0, 6), (6, 8)]
    path, container = find_blocks(deep_mlp())
    assert path == "" and len(container) == 10


@pytest.mark.parametrize("cfg_kw,pp,v", [({}, 2, 1), ({}, 2, 2), ({"tie_embeddings": True}, 3, 1),
                                         ({"vocab_size": 4096}, 2, 2)])
def test_runtime_builds_the_stages_the_planner_prices(cfg_kw, pp, v):
    """A plan without a given split: the planner prices the split the runtime builds (both
    through plait.partition: parameters balanced, embedding first, head last)."""
    from plait.models.transformer import TransformerConfig
    from plait.planner.cost import Workload, evaluate
    from plait.planner.hardware import load_cluster
    from plait.planner.model_stats import from_transformer_config

    cfg = TransformerConfig(**{"vocab_size": 256, "dim": 32, "n_layers": 7, "n_heads": 4,
                               "max_seq_len": 16, **cfg_kw})
    plan = Plan(pp=pp, microbatches=2 * pp, virtual_stages=v,
                pp_schedule="interleaved_1f1b" if v > 1 else "1f1b")
    _, specs = plan_stages(build(cfg), plan)
    est = evaluate(plan, from_transformer_config(cfg), load_cluster("cpu", devices=pp),
                   Workload(2 * pp, 16))
    assert list(est.stage_layers) == [s.end - s.start for s in specs]


def test_one_schedule_name_map_reaches_torch():
    from torch.distributed.pipelining import schedules as S

    assert set(TORCH_SCHEDULE_NAMES) == set(PP_SCHEDULES)
    assert schedule_class("zbv") is S.ScheduleZBVZeroBubble
    assert schedule_class("1f1b") is S.Schedule1F1B


def test_bad_splits_name_numbers_and_way_out():
    model = build(preset("test"), seed=0)  # 4 blocks
    with pytest.raises(ValueError, match=r"8 stages but layers has only 4 blocks"):
        plan_stages(model, Plan(pp=4, pp_schedule="interleaved_1f1b", virtual_stages=2,
                                microbatches=4))
    with pytest.raises(ValueError, match=r"split point 'layers.9' is not a block"):
        plan_stages(model, Plan(pp=2, microbatches=2, options={"split_points": ["layers.9"]}))
    with pytest.raises(ValueError, match=r"has 2 entries.*2 stages need 1 cuts"):
        plan_stages(model, Plan(pp=2, microbatches=2,
                                options={"split_points": ["layers.1", "layers.2"]}))

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    with pytest.raises(ValueError,
                       match=r"Flat has no nn.ModuleList, nn.Sequential or nn.ModuleDict.*pp=1"):
        plan_stages(Flat(), Plan(pp=2, microbatches=2))
    tied = build(preset("test", tie_embeddings=True), seed=0)
    ties = shared_parameters(tied, *plan_stages(tied, Plan(pp=2, microbatches=2)))
    assert ties == [{0: "tok_embeddings.weight", 1: "output.weight"}]


def test_planner_stage_layers_are_honoured_and_validated():
    """options.pp_stage_layers (the planner's uneven split) sets blocks per stage."""
    model = transformer8()
    plan = Plan(pp=2, microbatches=2, options={"pp_stage_layers": [3, 5]})
    assert [(s.start, s.end) for s in plan_stages(model, plan)[1]] == [(0, 3), (3, 8)]
    plan = Plan(pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2, microbatches=2,
                options={"pp_stage_layers": [1, 2, 2, 3]})
    assert [(s.start, s.end) for s in plan_stages(model, plan)[1]] == [(0, 1), (1, 3), (3, 5),
                                                                      (5, 8)]
    # the even split the planner leaves implicit differs from the parameter-count split here
    assert [(s.start, s.end) for s in plan_stages(model, Plan(pp=2, microbatches=2))[1]] != \
        [(0, 3), (3, 8)]
    for bad, match in [([4, 3], r"summing to the 8 blocks of layers"),
                       ([2, 2, 4], r"has 3 entries; pp=2 x virtual_stages=1 = 2 stages need 2"),
                       ([0, 8], r"pp_stage_layers=\[0, 8\] must hold positive values"),
                       ([2.5, 5.5], r"must be a non-empty list of positive integers")]:
        with pytest.raises(ValueError, match=match):
            plan_stages(model, Plan(pp=2, microbatches=2, options={"pp_stage_layers": bad}))
    with pytest.raises(ValueError, match=r"split_points, pp_stage_layers each fix.*only one"):
        plan_stages(model, Plan(pp=2, microbatches=2, options={"pp_stage_layers": [4, 4],
                                                               "split_points": ["layers.4"]}))


def test_batch_not_divisible_into_microbatches():
    runner = PipelineRunner([], Plan(pp=2, microbatches=4), rank=0)
    batch = (torch.zeros(6, 3), torch.zeros(6, 3))
    with pytest.raises(ValueError, match=r"batch of 6 rows does not split into microbatches=4"
                                         r".*multiple of 4"):
        runner.step(batch, nn.functional.mse_loss, plan=Plan(pp=2, microbatches=4),
                    device=torch.device("cpu"))


# ------------------------------------------------------------------ training = one device
def _assert_ok(result):
    assert result.ok, result.format()
    assert result.max_loss_diff < TOL and result.max_param_diff < TOL


def test_1f1b_pp2_matches_single_device():
    _assert_ok(check("pp=2,schedule=1f1b,mb=4", CheckConfig()))


def test_zero_bubble_on_sequential_mlp_matches_single_device():
    """A plain nn.Sequential (no transformer), split backward (I/W), 4 stages on 2 ranks."""
    cfg = CheckConfig(model_factory=deep_mlp, batch_factory=mlp_batch)
    _assert_ok(check("pp=2,schedule=interleaved_zb,v=2,mb=4", cfg))


def test_pp2_x_dp2_matches_single_device():
    _assert_ok(check("pp=2,dp=2,schedule=1f1b,mb=2", CheckConfig()))


def _frozen_stage_batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from tests._traffic_models import SEQ, VOCAB

    g = torch.Generator().manual_seed(1000 * seed + step)
    tokens = torch.randint(0, VOCAB, (8, SEQ), generator=g)
    return tokens, tokens.roll(-1, 1)


@pytest.mark.parametrize("plan", ["pp=2,dp=2,mb=2", pytest.param(
    "pp=2,dp_shard=2,zero=1,mb=2", marks=pytest.mark.slow)])
def test_a_frozen_first_stage_beside_ddp_matches_single_device(plan):
    """The embedding and the first two of four blocks frozen: under pp=2 the first stage has
    nothing to train, which DDP refuses to wrap; its replicas start equal and train nothing,
    the second stage's gradients are averaged as usual."""
    from tests._traffic_models import MODELS

    cfg = CheckConfig(model_factory=MODELS["frozen_stage"], batch_factory=_frozen_stage_batch,
                      steps=3)
    _assert_ok(check(plan, cfg))


def test_timeline_records_every_action_once_and_draws():
    out = run_distributed(timeline_worker, 2, "gpipe", 1, 4, timeout=120)
    events = out[0]["events"]
    keys = [(e.stage, e.kind, e.microbatch) for e in events]
    assert sorted(keys) == sorted((s, k, mb) for s in (0, 1) for k in "FB" for mb in range(4))
    for e in events:
        assert e.end >= e.start and e.rank == e.stage
    fwd = {(e.stage, e.microbatch): e for e in events if e.kind == "F"}
    for e in events:
        if e.kind == "B":
            assert e.start >= fwd[(e.stage, e.microbatch)].end
    from plait.parallel.timeline import bubble_fraction

    assert 0.0 < bubble_fraction(events) < 1.0
    if out[0]["png"]:
        assert os.path.getsize(out[0]["png"]) > 1000
        os.unlink(out[0]["png"])
    assert math.isnan(out[0]["loss"]) and not math.isnan(out[1]["loss"])  # loss on last stage
    # stage parameter names are the full model's (Sequential positions), split between ranks
    assert set(out[0]["names"]).isdisjoint(out[1]["names"])
    assert sorted(out[0]["names"] + out[1]["names"]) == sorted(n for n, _ in
                                                               deep_mlp().named_parameters())


@pytest.mark.slow
@pytest.mark.parametrize("schedule,v", ALL)
@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_matches_single_device(schedule, pp, v):
    cfg = CheckConfig(model_factory=transformer8) if pp * v > 4 else CheckConfig()
    _assert_ok(check(Plan(pp=pp, pp_schedule=schedule, virtual_stages=v, microbatches=4), cfg))


@pytest.mark.slow
@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("interleaved_1f1b", 2)])
def test_pp2_x_dp2_other_schedules(schedule, v):
    _assert_ok(check(Plan(pp=2, dp_replicate=2, pp_schedule=schedule, virtual_stages=v,
                          microbatches=2), CheckConfig()))


def test_stage_copies_keep_their_own_hooks():
    """Each stage is a shallow copy of the model's root: a hook registered on one copy (FSDP2's
    root hooks, at ZeRO-2/3) stays on it. Shared, every stage's forward would run every copy's
    FSDP2 root hooks, and under two stages per rank one stage's backward would reshard the
    other mid-schedule (ZeRO-2 x ZB-V then ends 5.9e-3 off one device). A hook registered on
    the model before the split still runs on every stage."""
    model = build(preset("test"))
    before: list[str] = []
    model.register_forward_hook(lambda *_: before.append("model"))
    path, specs = plan_stages(model, Plan(pp=2, microbatches=2))
    first, last = (build_stage_module(model, path, spec) for spec in specs)
    before.clear()  # the split runs the model once to find its blocks
    seen: list[str] = []
    first.register_forward_hook(lambda *_: seen.append("first"))
    last.register_forward_pre_hook(lambda *_: seen.append("last"))
    hidden = first(torch.randint(0, 64, (2, 8)))
    last(hidden)
    model(torch.randint(0, 64, (2, 8)))
    assert seen == ["first", "last"]
    assert before == ["model"] * 3


def _schedule_plans(extra: str) -> list[str]:
    """One plan per schedule plait offers, with the virtual stages each needs."""
    v = dict(ALL)
    return [f"pp=2,schedule={s},v={v[s]},{extra}" for s in PP_SCHEDULES]


def _assert_evaluations(got: dict, plans: list[str]) -> None:
    want = evaluate_reference()
    for plan in plans:
        result = got[plan]
        # dropout off inside evaluate though the model was in train mode: one device's loss,
        # the mean over every counted label (not a mean of the microbatches' means)
        assert result["evals"] == pytest.approx([want["evals"][0], *want["evals"][1:] * 2],
                                                rel=1e-6), plan
        # and on again after it, on every stage (the V's last stage on rank 0 included): the
        # next step's loss is not the loss without dropout (which the layouts give within
        # 1e-6, as the evaluations above; how far dropout moves it depends on its masks: 1e-4
        # on some seeds)
        assert result["training"], plan
        assert result["next"] != pytest.approx(want["next"], rel=1e-5), plan


def test_evaluate_under_every_schedule_is_one_devices_loss():
    """``run.evaluate`` runs torch's ``schedule.eval`` under every schedule, the V layout of
    ZB-V (rank 0 holds the first and the last stage) included, before training and after a
    step; a masked loss whose microbatches count 3, 7, 11 and 15 labels gives one device's
    mean (1e-6); dropout is off in it and on again for the next step. One spawn of 2 ranks
    for all six schedules."""
    plans = _schedule_plans("mb=4")
    got = run_distributed(evaluate_under_schedules, 2, plans, timeout=240)
    for rank in got:
        _assert_evaluations(rank, plans)


@pytest.mark.slow
@pytest.mark.parametrize("extra,parts", [("mb=2,grad_accum=2", False), ("mb=4", True)])
def test_evaluate_under_every_schedule_with_accumulation_or_collated_parts(extra, parts):
    """As above, with the evaluation split into grad_accum=2 schedule runs, or its batch given
    as the plan's micro-batches collated one by one (plait.MicroBatches)."""
    plans = _schedule_plans(extra)
    got = run_distributed(evaluate_under_schedules, 2, plans, parts, timeout=240)
    for rank in got:
        _assert_evaluations(rank, plans)


@pytest.mark.slow
def test_evaluate_under_zbv_beside_zero3_or_ddp_is_one_devices_loss():
    """ZB-V's evaluation beside data parallelism at 4 ranks: ZeRO-3 (torch's runtime gathers
    and reshards each stage's units around its forwards) and a replicated copy per stage."""
    plans = ["dp_shard=2,zero=3,pp=2,schedule=zbv,v=2,mb=2", "dp=2,pp=2,schedule=zbv,v=2,mb=2"]
    got = run_distributed(evaluate_under_schedules, 4, plans, timeout=300)
    for rank in got:
        _assert_evaluations(rank, plans)


@pytest.mark.parametrize("text", [
    "dp_shard=2,zero=3,pp=2,schedule=zbv,v=2,mb=2",
    pytest.param("dp_shard=2,zero=2,pp=2,schedule=zbv,v=2,mb=2", marks=pytest.mark.slow),
    pytest.param("dp_shard=2,zero=2,pp=2,schedule=interleaved_zb,v=2,mb=2",
                 marks=pytest.mark.slow),
    pytest.param("dp_shard=2,zero=3,pp=2,schedule=interleaved_zb,v=2,mb=2",
                 marks=pytest.mark.slow),
    # FSDP2 over the cp ranks alone (dp_shard=1)
    pytest.param("cp=2,zero=3,pp=2,schedule=zbv,v=2,mb=2", marks=pytest.mark.slow)])
def test_zero_bubble_with_zero2_or_zero3_matches_single_device(text):
    """torch's split backward finds the parameters by ``submod.parameters()`` at the I and W
    steps; FSDP2 registers the sharded ones whenever a unit is resharded (ZeRO-3 after every
    forward), so a W would find no parameter of the graph and compute no weight gradient
    (6e-3 off one device after three AdamW steps). The stage gathers its units first; FSDP2
    reduce-scatters once, at torch's REDUCE_GRAD step after the last W. fp32 within 1e-5."""
    cfg = CheckConfig(steps=3)
    result = check(text, cfg)
    assert result.ok, result.format()
    assert result.max_loss_diff < 1e-5 and result.max_param_diff < 1e-5, result.format()


@pytest.mark.slow
def test_gpipe_sequential_mlp_pp4():
    cfg = CheckConfig(model_factory=deep_mlp, batch_factory=mlp_batch)
    _assert_ok(check("pp=4,schedule=gpipe,mb=4", cfg))


def test_pp2_x_tp2_vocab_parallel_head_matches_single_device():
    """TP inside stages: the last stage's head keeps vocabulary-sharded logits, so the schedule
    step runs under loss_parallel(); skipped embedding/head stand-ins are left alone by TP.
    SGD keeps the comparison strict (AdamW amplifies 1e-7 gradient differences, see test_tensor)."""
    _assert_ok(check("pp=2,tp=2,schedule=1f1b,mb=2", CheckConfig(optimizer="sgd", steps=2)))


@pytest.mark.slow
@pytest.mark.parametrize("schedule,v,sp", [("1f1b", 1, False), ("interleaved_zb", 2, False),
                                          ("1f1b", 1, True)])
def test_pp2_x_tp2_schedules(schedule, v, sp):
    cfg = CheckConfig(optimizer="sgd", model_factory=transformer8 if v > 1 else None)
    _assert_ok(check(Plan(pp=2, tp=2, sp=sp, pp_schedule=schedule, virtual_stages=v,
                          microbatches=4), cfg))


# ------------------------------------------------------------------ Hugging Face decoders
def test_hf_llama_stages_chain_to_the_full_model():
    from tests._pipeline_models import hf_gpt2, hf_llama

    model = hf_llama()
    path, specs = plan_stages(model, Plan(pp=2, microbatches=2))
    assert path == "hf.model.layers" and [(s.start, s.end) for s in specs] == [(0, 2), (2, 4)]
    first, last = (build_stage_module(model, path, s) for s in specs)
    assert isinstance(last.hf.model.embed_tokens, PipelineSkip)
    assert isinstance(first.hf.lm_head, PipelineSkip) and isinstance(first.hf.model.norm,
                                                                     PipelineSkip)
    tokens = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 8, 64) and hidden.is_floating_point()
        torch.testing.assert_close(last(hidden), model(tokens))
        torch.testing.assert_close(model(tokens), hf_llama()(tokens))  # the original is intact
    # a bare HF model (no wrapper): its first stage hands on a tensor, the last one returns
    # the model's own output (a ModelOutput, which the loss gets as on one device)
    bare = model.hf
    bare_path, bare_specs = plan_stages(bare, Plan(pp=2, microbatches=2))
    assert bare_path == "model.layers"
    first, last = (build_stage_module(bare, bare_path, s) for s in bare_specs)
    with torch.no_grad():
        assert isinstance(first(tokens), torch.Tensor)
        torch.testing.assert_close(last(first(tokens)).logits, bare(tokens).logits)
    # GPT-2: tied wte/lm_head is found on both stages (their gradients are summed, see
    # test_hf_gpt2_tied_pp2_matches_single_device); the later stage's stand-in for the learned
    # position embedding (added to inputs_embeds) adds zero
    tied = hf_gpt2(tie=True)
    ties = shared_parameters(tied, *plan_stages(tied, Plan(pp=2, microbatches=2)))
    assert ties == [{0: "hf.transformer.wte.weight", 1: "hf.lm_head.weight"}]
    gpt2 = hf_gpt2(tie=False)
    path, specs = plan_stages(gpt2, Plan(pp=2, microbatches=2))
    first, last = (build_stage_module(gpt2, path, s) for s in specs)
    assert isinstance(last.hf.transformer.wpe, PipelineZero)
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), gpt2(tokens))


def test_hf_llama_pp2_1f1b_matches_single_device():
    from tests._pipeline_models import hf_llama

    _assert_ok(check("pp=2,schedule=1f1b,mb=4", CheckConfig(model_factory=hf_llama)))


def test_hf_gpt2_tied_pp2_matches_single_device():
    """GPT-2's default tied embedding and head on different stages: the gradient pieces are
    summed between the two stages (SGD: the strict comparison)."""
    from tests._pipeline_models import hf_gpt2

    _assert_ok(check("pp=2,schedule=1f1b,mb=4", CheckConfig(model_factory=hf_gpt2,
                                                            optimizer="sgd", steps=3)))


@pytest.mark.slow  # GPT-2 tied (the harder case) runs by default
def test_hf_gpt2_untied_pp2_matches_single_device():
    from tests._pipeline_models import hf_gpt2_untied

    _assert_ok(check("pp=2,schedule=1f1b,mb=4", CheckConfig(model_factory=hf_gpt2_untied)))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp=2,schedule=interleaved_zb,v=2,mb=4",
                                    "pp=2,tp=2,schedule=1f1b,mb=2"])
def test_hf_llama_other_layouts(layout):
    from tests._pipeline_models import hf_llama

    cfg = CheckConfig(model_factory=hf_llama, optimizer="sgd" if "tp" in layout else "adamw")
    _assert_ok(check(layout, cfg))


def test_a_block_output_added_to_a_parameter_is_not_a_residual():
    """``h = block(h) + self.shift`` (a parameter of the model's own module): the block's
    output is not summed with the running activation, so its stand-in passes the activation
    on; fx and the first step's run agree. Read as a residual in the parent, the split refused
    the model (a change before the blocks beside it)."""
    from tests._workers_ckpt_users import MODELS

    model = MODELS["rootparams"]()
    assert additive_modules(model, "blocks") == set()
    assert additive_by_running(model, "blocks", torch.randint(0, 16, (2, 5)), {}) == set()
