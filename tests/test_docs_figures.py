"""The figures of the pages' worked examples are what plait's own formulas give.

Each page works an example by hand (llama-7b's bytes per step and memory per rank under its
layout, the reference models' measured traffic). These tests recompute every such figure from
the page's own inputs with the functions plait prices and checks runs with
(``plait.comm.volumes``, ``plait.comm.predict``, ``plait.memory.closed_form``,
``plait.parallel.schedules``, the planner) and require the page to print it, so a page cannot
drift from the code, nor the code from the page. They run nothing distributed: about a second
in all, most of it the planner's search.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from plait.comm.predict import predict
from plait.comm.volumes import (
    Traffic,
    cp_traffic,
    ddp_traffic,
    pp_traffic,
    tp_traffic,
    zero_traffic,
)
from plait.memory import closed_form
from plait.models.transformer import preset
from plait.parallel.schedules import theoretical_bubble
from plait.plan import Plan
from plait.planner.cli import add_plan_arguments, plan_command
from plait.planner.cost import evaluate
from plait.planner.published import NARAYANAN_2021, megatron_flops, row_setup

DOCS = Path(__file__).resolve().parents[1] / "docs"
PSI_7B = 6_738_415_616  # the pages' llama-7b (Ψ = 6.74·10⁹): the preset's parameters
ADAM = 8            # bytes of AdamW state per fp32 parameter
GB, GiB, MiB, KiB = 1e9, 2.0**30, 2.0**20, 2.0**10


def worked_example(page: str) -> str:
    """The paragraph (and its list) that opens with ``**Worked example.**`` on ``page``, its
    lines joined."""
    text = (DOCS / page).read_text()
    start = text.index("**Worked example.**")
    end = text.find("\n## ", start)
    return " ".join(text[start:end if end > 0 else None].split())


def says(text: str, figure: str, where: str) -> None:
    shown = text if len(text) < 800 else "(the page)"
    assert figure in text, f"{where} should say {figure!r} (plait's formula); it says: {shown}"


def wire(traffic: list[Traffic]) -> float:
    return sum(t.wire for t in traffic)


def params(name: str) -> int:
    return preset(name).num_params()  # the built model's sum of numel, in closed form


def root_params(name: str) -> int:
    """FSDP2's root unit of the reference transformer: the embedding, the head, the final
    norm (what the blocks leave)."""
    cfg = preset(name)
    return 2 * cfg.vocab_size * cfg.dim + cfg.dim


def test_the_pages_llama_7b_is_the_preset():
    assert params("llama-7b") == PSI_7B
    cfg = preset("llama-7b")
    assert (cfg.n_layers, cfg.dim, cfg.vocab_size) == (32, 4096, 32000)
    assert root_params("llama-7b") == 262_148_096


def test_data_parallel_worked_example():
    text = worked_example("data_parallel.md")
    says(text, f"{wire(ddp_traffic(PSI_7B, 8)) / GB:.1f} GB", "data_parallel.md: DDP's bytes")
    ddp = closed_form(Plan(dp_replicate=8), PSI_7B, ADAM).model_state
    zero3 = closed_form(Plan(dp_shard=8, zero=3), PSI_7B, ADAM).model_state
    assert ddp is not None and zero3 is not None
    says(text, f"{ddp / GB:.0f} GB", "data_parallel.md: DDP's model state")
    says(text, f"{zero3 / GB:.1f} GB per rank at d = 8 with ZeRO-3", "data_parallel.md")
    tiny = params("tiny")
    says(text, f"Ψ = {tiny / 1e6:.2f}·10⁶", "data_parallel.md: the tiny model")
    sent = wire(ddp_traffic(tiny, 2))
    says(text, f"{sent / 1e6:.1f} MB per step", "data_parallel.md: the tiny model's bytes")
    says(text, f"{sent / MiB:.2f} MiB", "data_parallel.md: the tiny model's ledger")


def test_zero_worked_example():
    text = worked_example("zero.md")
    psi, root = PSI_7B, root_params("llama-7b")
    zero1 = closed_form(Plan(dp_shard=8, zero=1), psi, ADAM).model_state
    zero3 = closed_form(Plan(dp_shard=8, zero=3), psi, ADAM).model_state
    assert zero1 is not None and zero3 is not None
    says(text, f"{zero1 / GB:.1f} GB", "zero.md: ZeRO-1's model state")
    says(text, f"{zero3 / GB:.1f} GB", "zero.md: ZeRO-3's model state")
    sent = {zero: wire(predict(Plan(dp_shard=8, zero=zero), preset("llama-7b"), 1, 4096))
            for zero in (1, 3)}
    says(text, f"DDP sends 2 · 7/8 · 4Ψ ≈ {wire(ddp_traffic(psi, 8)) / GB:.1f} GB", "zero.md")
    says(text, f"4Ψ ≈ {sent[1] / GB:.1f} GB", "zero.md: ZeRO-1's bytes")
    says(text, f"{root:,}", "zero.md: the root unit")
    says(text, f"{sent[3] / GB:.1f} GB", "zero.md: ZeRO-3's bytes")
    assert sent[3] == wire(zero_traffic(psi, 8, 3, root_params=root, units=33))


def test_zero_page_test_model_figures():
    """The ledger's figures zero.md quotes for the `test` model are zero_traffic's, the
    expected column those rows were measured against."""
    text = " ".join((DOCS / "zero.md").read_text().split())
    psi, root = params("test"), root_params("test")
    says(text, f"Ψ = {psi:,}, Ψ_r = 2 · 256 · 64 + 64 = {root:,}; 4Ψ = {4 * psi / KiB:.2f} KiB",
         "zero.md")
    scatter, gather2 = zero_traffic(psi, 2, 2, units=5)
    gather3 = zero_traffic(psi, 2, 3, units=5, root_params=root)[1]
    assert (gather2.calls, gather3.calls) == (5, 9)
    says(text, f"`reduce_scatter` 5 calls (4 blocks + root) {scatter.wire / KiB:.2f} KiB",
         "zero.md: ZeRO-2's reduce-scatter")
    says(text, f"`all_gather` 5 calls {gather2.wire / KiB:.2f} KiB", "zero.md: ZeRO-2's gathers")
    says(text, f"`all_gather` 9 calls (4 blocks twice, the root once), payload "
         f"{gather3.payload / MiB:.2f} MiB = 4(2Ψ - Ψ_r) = {gather3.payload / KiB:,.2f} KiB, "
         f"wire {gather3.wire / KiB:.2f} KiB: {(gather3.wire + scatter.wire) / KiB:.2f} KiB",
         "zero.md: ZeRO-3's gathers")
    accum = zero_traffic(psi, 2, 3, units=5, root_params=root, micro_steps=2)[1]
    says(text, f"gathers in {accum.calls} calls, payload {accum.payload / MiB:.2f} MiB",
         "zero.md: ZeRO-3 at grad_accum=2")


def test_tensor_parallel_worked_example():
    text = worked_example("tensor_parallel.md")
    (rows,) = tp_traffic(1, 4096, 4096, 32, 8, "bf16")
    says(text, f"= {rows.payload / rows.calls / MiB:.0f} MiB", "tensor_parallel.md: one call")
    says(text, f"give {rows.calls} per microbatch", "tensor_parallel.md: the calls")
    says(text, f"{rows.wire / GB:.1f} GB", "tensor_parallel.md: the bytes")
    state = closed_form(Plan(), PSI_7B // 8, ADAM).model_state
    assert state is not None
    says(text, f"{state / GB:.1f} GB", "tensor_parallel.md: model state")


def test_pipeline_worked_example():
    text = worked_example("pipeline.md")
    forward, backward = pp_traffic(1, 4096, 4096, 4, "bf16", microbatches=8, stage=1)
    assert forward.payload == backward.payload
    says(text, f"{forward.payload / GB:.2f} GB", "pipeline.md: one boundary's bytes")
    state = closed_form(Plan(), PSI_7B // 4, ADAM).model_state
    assert state is not None
    says(text, f"{state / GB:.0f} GB", "pipeline.md: model state")
    bubble = theoretical_bubble("1f1b", 4, 8)
    says(text, f"3/11 ≈ {bubble:.0%}", "pipeline.md: the 1F1B bubble")


def test_pipeline_boundary_example():
    text = " ".join((DOCS / "pipeline.md").read_text().split())
    (forward,) = pp_traffic(8, 64, 128, 2, "fp32", stage=0)  # stage 0 sends no gradient
    says(text, f"8 x 64 x 128 x 4 = {forward.payload / KiB:.0f} KiB", "pipeline.md")
    (measured,) = pp_traffic(2, 128, 128, 2, "fp32", microbatches=2, stage=0)  # 4 rows in 2
    assert measured.payload == forward.payload
    interleaved = pp_traffic(2, 128, 128, 2, "fp32", microbatches=2, virtual_stages=2, stage=0)
    says(text, f"sends {wire(interleaved) / KiB:.0f} KiB per rank (3 boundaries", "pipeline.md")


def test_nd_parallel_worked_example():
    text = worked_example("nd_parallel.md")
    t = p = d = 2
    state = closed_form(Plan(dp_shard=d, zero=3), PSI_7B // (t * p), ADAM).model_state
    assert state is not None
    says(text, f"{state / GB:.1f} GB", "nd_parallel.md: model state")
    tp = wire(tp_traffic(1, 4096, 4096, 32 // p, t, "bf16", microbatches=8))
    says(text, f"{tp / GB:.1f} GB", "nd_parallel.md: tp's bytes")
    shard = wire(zero_traffic(PSI_7B // (t * p), d, 3))
    says(text, f"{shard / GB:.1f} GB", "nd_parallel.md: dp_shard's bytes")
    (forward,) = pp_traffic(1, 4096, 4096, p, "bf16", microbatches=8, stage=0)
    says(text, f"{forward.payload / GB:.2f} GB", "nd_parallel.md: pp's bytes")


def test_nd_parallel_tiny_figures():
    """The rows by hand, then plait.comm.predict, which the ledger measured at ratio 1.000."""
    text = " ".join((DOCS / "nd_parallel.md").read_text().split())
    psi = params("tiny")
    says(text, f"Ψ = {psi:,}, L = 4, h = 128", "nd_parallel.md")
    row_tp = wire(tp_traffic(4, 128, 128, 4, 2))
    row_shard = wire(zero_traffic(psi // 2, 2, 3))
    plan = Plan(dp_shard=2, zero=3, tp=2)
    traffic = predict(plan, preset("tiny"), batch=4, seq=128)
    tp = sum(t.wire for t in traffic if t.axis == "tp")
    shard = sum(t.wire for t in traffic if t.axis == "dp_shard")
    says(text, f"`tp` {row_tp / MiB:.0f} MiB by the row, {tp / MiB:.2f} MiB with the ends",
         "nd_parallel.md: tp")
    says(text, f"`dp_shard` {row_shard / MiB:.2f} MiB by the row, {shard / MiB:.2f} MiB less "
         "the root's", "nd_parallel.md: dp_shard")


def test_context_parallel_worked_example():
    text = worked_example("context_parallel.md")
    gathers, _ = cp_traffic(1, 32768, 1024, 32, 8, "bf16")
    says(text, f"= {gathers.payload / gathers.calls / MiB:.0f} MiB buffer; {gathers.calls} of "
         f"them in forward is {gathers.payload / GiB:.0f} GiB", "context_parallel.md")
    says(text, f"**{gathers.wire / GiB:.1f} GiB**", "context_parallel.md: the bytes sent")
    saved = 2 * 32768 * 1024 * 2  # the K and V one layer saves, gathered
    says(text, f"{saved / MiB:.0f} MiB of gathered K/V per layer ({32 * saved / GiB:.0f} GiB",
         "context_parallel.md")
    says(text, f"a {32768 // 8 * 32768 / MiB:.0f} MiB mask", "context_parallel.md: the mask")


# -- the worked example of communication.md: its table is plait.comm.predict's -----------------

LAYOUTS = {  # the table's first column: (plan, pipeline stage)
    "DDP over 64": (Plan(dp_replicate=64, mixed_precision="bf16"), None),
    "ZeRO-1 over 64": (Plan(dp_shard=64, zero=1, mixed_precision="bf16"), None),
    "ZeRO-2 over 64": (Plan(dp_shard=64, zero=2, mixed_precision="bf16"), None),
    "ZeRO-3 over 64": (Plan(dp_shard=64, zero=3, mixed_precision="bf16"), None),
    "TP 8 (in a node) × ZeRO-3 8": (Plan(tp=8, dp_shard=8, zero=3, mixed_precision="bf16"), None),
    "TP 8 + SP × ZeRO-3 8": (Plan(tp=8, sp=True, dp_shard=8, zero=3, mixed_precision="bf16"),
                             None),
    "PP 4 × TP 8 × DP 2, 8 microbatches: stage 1 (interior)":
        (Plan(pp=4, tp=8, dp_replicate=2, microbatches=8, mixed_precision="bf16"), 1),
    "same, stage 0 (embedding)":
        (Plan(pp=4, tp=8, dp_replicate=2, microbatches=8, mixed_precision="bf16"), 0),
}


def communication_table() -> dict[str, list[list[str]]]:
    """The worked example's rows by layout: [axis, what, payload, wire] each."""
    text = (DOCS / "communication.md").read_text()
    section = text[text.index("### Worked example"):]
    out: dict[str, list[list[str]]] = {}
    name = ""
    for line in section[section.index("\n|"):].splitlines()[3:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = cells[0] or name
        out.setdefault(name, []).append(cells[1:])
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_communication_worked_example_is_predicts(name):
    plan, stage = LAYOUTS[name]
    rows = communication_table()[name]
    traffic = predict(plan, preset("llama-7b"), batch=plan.microbatches, seq=4096, stage=stage)
    for t in traffic:
        payload, sent = f"{t.payload / GiB:.3f}", f"{t.wire / GiB:.3f}"
        if payload == "0.000":  # the rows the page leaves out
            continue
        mine = [r for r in rows if r[0] == t.axis and (t.op in r[1] or r[1].startswith("as "))
                and payload in r[2] and sent in r[3]]
        assert mine, (f"communication.md, {name}: no {t.axis} {t.op} row of {payload} / "
                      f"{sent} GiB ({t.what}); the page has {rows}")
        # where the page counts the calls, it counts predict's
        what = mine[0][1]
        if t.op != "broadcast" and re.search(r"\(\d|\d (units|calls|buckets)", what):
            assert re.search(rf"\b{t.calls:,}\b", what), \
                f"communication.md, {name}: {t.axis} {t.op} makes {t.calls} calls: {what!r}"
    total = f"{wire(traffic) / GiB:.2f}"
    assert any(total in r[3] for r in rows), \
        f"communication.md, {name}: the total is {total} GiB; the page has {rows}"


# -- the planner's output as the pages quote it ------------------------------------------------

def test_planner_page_quotes_plait_plan(capsys):
    """planner.md's example of the winner's explanation is what ``plait plan`` prints, and
    context_parallel.md's account of the same search gives its figures in its units."""
    parser = add_plan_arguments(argparse.ArgumentParser())
    args = ["--model", "llama-8b", "--cluster", "dgx-h100", "--devices", "8",
            "--global-batch", "8", "--seq", "131072"]
    text = (DOCS / "planner.md").read_text()
    says(text, f"(`plait plan {' '.join(args)}`", "planner.md: the command")
    assert plan_command(parser.parse_args(args)) == 0
    out = capsys.readouterr().out
    block = text[text.index("```text\nbest: "):]
    for line in block[len("```text\n"):block.index("```\n", 8)].splitlines():
        assert line in out, f"planner.md quotes {line!r}; plait plan prints:\n{out}"
    cp = " ".join((DOCS / "context_parallel.md").read_text().split())
    best = next(line for line in out.splitlines() if line.startswith("1 "))
    step = re.search(r"\)\s+([\d.]+)\s", best)
    cp_bytes = re.search(r"cp:([\d.]+)GiB", best)
    tp_bytes = re.search(r"0 vs ([\d.e+]+) GB per rank", out)
    assert step and cp_bytes and tp_bytes, out
    gib = float(cp_bytes.group(1))
    says(cp, f"`cp=8,zero=3` with full checkpointing ({step.group(1)} s per step)",
         "context_parallel.md")
    says(cp, f"{float(tp_bytes.group(1)):,.0f} GB per rank per step, where cp's move "
         f"{gib * GiB / GB:.0f} GB ({gib:.0f} GiB) of keys and values", "context_parallel.md")


def test_zero_page_memory_table_is_the_closed_form():
    """zero.md's table for the `test` model (what `run.finish()` prints beside the measured
    bytes, which tests/test_zero.py holds to it) is ``closed_form``'s, to the page's digits."""
    text = (DOCS / "zero.md").read_text()
    psi, root = params("test"), root_params("test")
    plans = {"DDP (`dp=2`)": Plan(dp_replicate=2), "ZeRO-1": Plan(dp_shard=2, zero=1),
             "ZeRO-2": Plan(dp_shard=2, zero=2), "ZeRO-3 (+offload)": Plan(dp_shard=2, zero=3)}
    for name, plan in plans.items():
        row = re.search(rf"^\| {re.escape(name)} +\|(.*)\|$", text, re.M)
        assert row, f"zero.md has no memory row {name!r}"
        cells = [c.strip() for c in row.group(1).split("|")]
        form = closed_form(plan, psi, ADAM, root_psi=root)
        gathered = form.gathered if plan.zero != 1 else 0.0
        assert form.optimizer is not None and form.model_state is not None
        mine = [f"{x / MiB:.2f} MiB" for x in
                (form.params, form.grads, form.optimizer, form.model_state)]
        assert cells[:4] == mine, f"zero.md, {name}: {cells[:4]}; closed_form gives {mine}"
        assert cells[4].startswith("0" if not gathered else f"{gathered / MiB:.2f} MiB"), \
            f"zero.md, {name}: gathered {cells[4]!r}; closed_form gives {gathered} bytes"


def test_tensor_parallel_collectives_table():
    """tensor_parallel.md's per-micro-batch table for the `test` model (4 layers, h=64,
    b=4, s=16, tp=2): tp_traffic's blocks plus the two ends, each call b·s·h fp32."""
    text = (DOCS / "tensor_parallel.md").read_text()
    cfg = preset("test")
    (blocks,) = tp_traffic(4, 16, cfg.dim, cfg.n_layers, 2)
    calls, each = blocks.calls + 2, blocks.payload / blocks.calls
    per_pass = calls // 2
    says(text, f"| tp=2 | {per_pass} all-reduce fwd + {per_pass} bwd = {calls} "
         f"(= 4 x {cfg.n_layers} layers + 2) | {calls} x {each / KiB:.0f} KiB |",
         "tensor_parallel.md: tp=2")
    norms = 2 * cfg.n_layers + 1
    says(text, f"| tp=2,sp=true | {per_pass} all-gather + {per_pass} reduce-scatter fwd, the same "
         f"bwd, + {norms} all-reduce (norm weights) = {2 * calls + norms} | {2 * calls} x "
         f"{each / KiB:.0f} KiB (logical) + {norms} x {cfg.dim * 4} B |",
         "tensor_parallel.md: tp=2,sp")


def test_context_parallel_bench_breakdown():
    """context_parallel.md's breakdown of what a cp=2 rank saves beyond a dp=2 one on
    bench/cp_long_seq.py's model (4 blocks, kv = 2 heads x 32, 2 sequences, fp32): the page's
    closed-form rows, which the bench prints beside what it measures."""
    text = " ".join((DOCS / "context_parallel.md").read_text().split())
    layers, kv, rows, e, cp = 4, 2 * 32, 2, 4, 2

    def mask(s: int) -> float:  # the fp32 additive copy SDPA keeps, per layer
        return 4.0 * layers * (s // cp) * s

    def kv_saved(s: int, b: int) -> float:  # K and V of b whole sequences, per layer
        return 2.0 * layers * b * s * kv * e

    s = 4096
    gathered, own = kv_saved(s, rows), kv_saved(s, rows // 2)
    says(text, f"the {(gathered - own + mask(s)) / MiB:.0f} MiB beyond dp=2 are the gathered K "
         f"and V ({gathered / MiB:.0f} MiB, where dp=2 keeps {own / MiB:.0f} MiB of its own) and "
         f"the per-layer fp32 masks ({mask(s) / MiB:.0f} MiB)", "context_parallel.md")
    ratios = [mask(n) / (kv_saved(n, rows) - kv_saved(n, rows // 2)) for n in (512, 1024, 4096)]
    assert ratios[0] == 2, ratios  # "twice"
    says(text, f"{ratios[1]:.0f} times at 1,024 and {ratios[2]:.0f} times at 4,096",
         "context_parallel.md: the mask against the K/V")
    says(text, f"twice the K/V cp adds at 512 tokens per sequence ({mask(512) / MiB:.0f} and "
         f"{(kv_saved(512, rows) - kv_saved(512, rows // 2)) / MiB:.0f} MiB", "context_parallel.md")


def test_planner_page_prices_the_145b_row_as_plait_plan(capsys):
    """planner.md's account of its third command: the TFLOP/s columns `plait plan --plan`
    prints for Megatron's 145.6B row, and the figure its table gives by the paper's formula."""
    text = " ".join((DOCS / "planner.md").read_text().split())
    parser = add_plan_arguments(argparse.ArgumentParser())
    args = ["--model", "gpt-145b", "--cluster", "dgx-a100-80gb", "--global-batch", "2304",
            "--plan", "dp=24,tp=8,pp=8,schedule=interleaved_1f1b,v=2,mb=96,ac=full,mp=bf16"]
    says(text, " ".join(args[:6]), "planner.md: the third command")
    assert plan_command(parser.parse_args(args)) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("1 "))
    tflops, with_recompute = re.split(r"\s{2,}", row)[4:6]
    says(text, f"({tflops} for the model, {with_recompute} with recomputation)", "planner.md")
    paper = next(r for r in NARAYANAN_2021 if r.params_b == 145.6)
    model, cluster, work, plan = row_setup(paper)
    step = evaluate(plan, model, cluster, work).step_time_s
    formula = megatron_flops(paper.batch, 2048, paper.layers, paper.hidden, 51200) / step \
        / paper.gpus / 1e12
    says(text, f"which gives {formula:.1f} for the same layout", "planner.md")
    says(text, f"| **{formula:.1f}** |", "planner.md: the 145.6B row of the table")


def test_data_parallel_page_compares_bytes_as_predict_does():
    """data_parallel.md's "does not always send the fewest bytes": llama-7b on 64 GPUs under
    mp=bf16, as communication.md's worked example prices it."""
    text = " ".join((DOCS / "data_parallel.md").read_text().split())
    sent = [wire(predict(plan, preset("llama-7b"), 1, 4096)) / GiB for plan in (
        Plan(dp_shard=64, zero=2, mixed_precision="bf16"),
        Plan(dp_shard=64, zero=3, mixed_precision="bf16"),
        Plan(dp_replicate=64, mixed_precision="bf16"))]
    assert sent[0] < sent[2] and sent[1] < sent[2]
    says(text, f"they send {sent[0]:.2f} and {sent[1]:.2f} GiB per GPU per step against DDP's "
         f"{sent[2]:.2f}", "data_parallel.md: when to use it")


def test_zero_page_bench_closed_forms():
    """zero.md's bench table (bench/zero_memory.py: the reference transformer at dim 1024 x 6
    layers, 2 ranks): Ψ and the closed-form column are closed_form's for that model."""
    from plait.models.transformer import TransformerConfig
    text = " ".join((DOCS / "zero.md").read_text().split())
    psi = TransformerConfig(dim=1024, n_layers=6, n_heads=16, max_seq_len=32).num_params()
    says(text, f"Ψ = {psi / 1e6:.1f}M ({4 * psi / MiB:.0f} MiB fp32)", "zero.md: the bench model")
    plans = {"DDP": Plan(dp_replicate=2), "ZeRO-1": Plan(dp_shard=2, zero=1),
             "ZeRO-2": Plan(dp_shard=2, zero=2), "ZeRO-3": Plan(dp_shard=2, zero=3)}
    for name, plan in plans.items():
        state = closed_form(plan, psi, ADAM).model_state
        assert state is not None
        row = re.search(rf"\| {name} +\| +[\d,]+ MiB \| +([\d,]+) MiB \|", text)
        mine = f"{state / MiB:,.0f}"
        assert row and row.group(1) == mine, \
            f"zero.md's bench row {name}: {row and row.group(1)} MiB; closed_form gives {mine}"
