"""An encoder-decoder whose source and target differ in length (64 source tokens beside 16
target ones, 24 beside 40): a decoder block's cross-attention reads the source, so its key and
value projections run on the source's tokens and its scores are (target x source). The
planner prices each block as torch runs it: its forward FLOPs are what
``torch.utils.flop_counter.FlopCounterMode`` counts in one decoder block and one encoder
block, and the bytes it saves for backward are, within 5%, the distinct storages
``torch.autograd.graph.saved_tensors_hooks`` sees one block's forward save (the source the
decoder's blocks all read counted once, beside the block). Read on the encoder-decoder written
for the test (its feed-forward plain or gated) and Hugging Face T5 (its norms Python ops) and
T5 v1.1 (a gated feed-forward whose tanh GELU is Python ops too, saving four tensors besides
its output, measured on the activation module).
``plait plan --model`` reads the two lengths off the dataset's first sample (the source's
``input_ids``, the target's ``labels`` the model shifts into its decoder's input).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

from plait.planner.cost import Constants
from plait.planner.memory import activation_bytes_per_block, side_input_bytes
from plait.planner.model_stats import ModelStats, load_model
from tests import _workers_tp_encdec as T

SHAPES = [(2, 64, 16), (4, 24, 40)]  # (rows, source tokens, target tokens)
BLOCKS = ["encoder.block.1", "decoder.block.1"]  # a block of each stack after the first
SAVED_TOL = 0.05


def _eager(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """Hugging Face T5 whose attention is written as matmuls and a softmax (``eager``): the
    scores it saves are the ones the formula prices without flash attention, and its matmuls
    are ones FlopCounterMode counts (it counts no CPU scaled_dot_product_attention)."""
    def build() -> nn.Module:
        model = factory()
        model.set_attn_implementation("eager")
        return model
    return build


# (name, the model torch runs, the model the planner reads: the same shapes)
MODELS: list[tuple[str, Callable[[], nn.Module], Callable[[], nn.Module]]] = [
    ("written_for_the_test", T.seq2seq, T.seq2seq),
    ("written_gated", T.gated_seq2seq, T.gated_seq2seq),
    ("hf_t5", _eager(T.hf_t5), _eager(T.hf_t5)),
    ("hf_t5_gated", _eager(T.hf_t5_gated), _eager(T.hf_t5_gated)),
]


def _per_block(model: nn.Module, inputs: dict[str, torch.Tensor]
               ) -> tuple[dict[str, int], dict[str, int], int]:
    """In one forward of ``model`` on ``inputs``: the forward FLOPs torch counts in each of
    :data:`BLOCKS`, the bytes of the distinct storages (parameters aside) each saves for
    backward, and of those the decoder block's, the bytes of the encoder's output (what
    every decoder block's cross-attention reads)."""
    from torch.utils.flop_counter import FlopCounterMode

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside: list[str] = []
    saved: dict[str, dict[int, int]] = {name: {} for name in BLOCKS}
    counters = {name: FlopCounterMode(display=False) for name in BLOCKS}
    memory: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if inside and storage.data_ptr() not in params:
            saved[inside[-1]][storage.data_ptr()] = storage.nbytes()
        return t

    def enter(name: str) -> Any:
        def hook(*_: Any) -> None:
            inside.append(name)
            counters[name].__enter__()
        return hook

    def leave(name: str) -> Any:
        def hook(*_: Any) -> None:
            counters[name].__exit__(None, None, None)
            inside.pop()
        return hook

    handles = [h for name in BLOCKS for h in (
        model.get_submodule(name).register_forward_pre_hook(enter(name)),
        model.get_submodule(name).register_forward_hook(leave(name)))]
    handles.append(model.get_submodule("encoder").register_forward_hook(
        lambda _m, _a, out: memory.append(
            (out if isinstance(out, torch.Tensor) else out[0]).untyped_storage().data_ptr())))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    shared = saved["decoder.block.1"].get(memory[0], 0)
    return ({n: c.get_total_flops() for n, c in counters.items()},
            {n: sum(s.values()) for n, s in saved.items()}, shared)


def _priced(stats: ModelStats, rows: int, src: int, tgt: int) -> tuple[dict[str, float],
                                                                       dict[str, float], float]:
    """The planner's forward FLOPs and saved bytes of a block of each stack (fp32, one
    device, scores materialised), and the source's bytes the decoder's blocks share."""
    encoder = stats.stack_block(stats.more_stacks[0])
    c = Constants(flash_attention=False)
    flops = {"encoder.block.1": encoder.block_flops_per_token(src, tgt) * rows * src,
             "decoder.block.1": stats.block_flops_per_token(tgt, src) * rows * tgt}
    saved = {"encoder.block.1": activation_bytes_per_block(encoder, rows, src, 1, False, 4, c,
                                                           side_seq=tgt),
             "decoder.block.1": activation_bytes_per_block(stats, rows, tgt, 1, False, 4, c,
                                                           side_seq=src)}
    return flops, saved, side_input_bytes(stats, rows, src, 4)


@pytest.mark.parametrize("name,runs,reads", MODELS, ids=[m[0] for m in MODELS])
def test_each_block_is_priced_as_torch_runs_it_at_unequal_lengths(name: str, runs: Any,
                                                                  reads: Any) -> None:
    """FLOPs equal to what torch counts, saved bytes within 5%, in a decoder block (self-
    and cross-attention) and an encoder block, at two (rows, source, target) shapes; the
    source the decoder's blocks read is one tensor of rows x source x width."""
    stats = load_model(reads())
    assert stats.stack_first == "decoder.block.0", stats.stack_first
    assert (stats.attentions, stats.cross_attentions) == (2, 1), stats
    model = runs()
    model.train()
    for rows, src, tgt in SHAPES:
        g = torch.Generator().manual_seed(rows * src + tgt)
        counted, saved, shared = _per_block(model, {
            "input_ids": torch.randint(4, 32, (rows, src), generator=g),
            "decoder_input_ids": torch.randint(4, 32, (rows, tgt), generator=g)})
        flops, priced, side = _priced(stats, rows, src, tgt)
        assert shared == side == rows * src * stats.hidden * 4, (name, shared, side)
        for block in BLOCKS:
            assert flops[block] == counted[block], (name, rows, src, tgt, block, flops,
                                                    counted)
            want = saved[block] - (shared if block.startswith("decoder") else 0)
            assert priced[block] == pytest.approx(want, rel=SAVED_TOL), (
                name, rows, src, tgt, block, priced[block], want)


def test_a_steps_model_flops_count_the_decoders_cross_attention_on_the_source() -> None:
    """``evaluate`` on one device: the model FLOPs behind its TFLOP/s are three times the
    forward FLOPs torch counts in every block of both stacks and in the head, the decoder on
    16 target tokens reading 64 source ones."""
    from torch.utils.flop_counter import FlopCounterMode

    from plait.plan import Plan
    from plait.planner import constants_for
    from plait.planner.cost import Workload, evaluate
    from plait.planner.hardware import load_cluster

    rows, src, tgt = 4, 64, 16
    model = T.seq2seq()
    stats = load_model(T.seq2seq())
    g = torch.Generator().manual_seed(0)
    source = torch.randint(4, 32, (rows, src), generator=g)
    target = torch.randint(4, 32, (rows, tgt), generator=g)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=source, decoder_input_ids=target)
    cluster = load_cluster("cpu", devices=1)
    est = evaluate(Plan.from_string("dp=1"), stats, cluster,
                   Workload(rows, tgt, stack_seqs=(("encoder.block.0", src),)),
                   constants_for(cluster))
    priced = est.tflops_per_device * est.step_time_s * 1e12
    assert priced == pytest.approx(3 * counter.get_total_flops(), rel=1e-9), (
        priced, 3 * counter.get_total_flops())


def _plan(capsys: Any, *more: str) -> dict[str, Any]:
    from plait.planner.cli import add_plan_arguments, plan_command

    parser = add_plan_arguments(argparse.ArgumentParser())
    assert plan_command(parser.parse_args([
        "--model", "tests._workers_encdec:t5", "--cluster", "cpu", "--devices", "2",
        "--global-batch", "8", "--plan", "tp=2,sp", "--format", "json", *more])) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_plait_plan_reads_each_stacks_length_off_the_dataset(capsys: Any) -> None:
    """T5's dataset holds 8 source ids and 6 labels per sample: ``plait plan --model``
    prices the decoder on 6 tokens and the encoder on 8 (its tp rows those of ``--seq 6
    --stack-seq encoder.block.0=8``)."""
    read = _plan(capsys)
    assert (read["seq"], read["seq_from"], read["stack_seqs"]) == (
        6, "dataset", {"encoder.block.0": 8}), read
    given = _plan(capsys, "--seq", "6", "--stack-seq", "encoder.block.0=8")
    assert read["plans"][0]["traffic"] == given["plans"][0]["traffic"]


def test_the_python_api_reads_each_stacks_length_off_the_users_batch() -> None:
    """``evaluate_plan(..., example=batch)`` on the encoder-decoder written for the test, its
    batch of 64 source and 16 target tokens: the step priced as with ``seq=16,
    stack_seqs={"encoder.block.0": 64}``, not as both at one length; ``seq`` alone prices both
    stacks at it; a block that starts no further stack is refused naming those that do."""
    from plait.planner import evaluate_plan

    g = torch.Generator().manual_seed(0)
    batch = ({"input_ids": torch.randint(0, T.VOCAB, (T.BATCH, 64), generator=g),
              "decoder_input_ids": torch.randint(0, T.VOCAB, (T.BATCH, 16), generator=g)},
             torch.randint(0, T.VOCAB, (T.BATCH, 16), generator=g))

    def priced(**how: Any) -> tuple[float, float]:
        est = evaluate_plan("tp=2,sp", T.seq2seq(), global_batch=T.BATCH, **how)
        return est.step_time_s, est.memory_breakdown["activations"]

    read = priced(example=batch)
    assert read == priced(seq=16, stack_seqs={"encoder.block.0": 64}), read
    assert read != priced(seq=16), read
    with pytest.raises(ValueError, match=r"stack_seqs=\{'decoder.block.0': 64\}: "
                       r"decoder.block.0 is not the first block of a further stack of "
                       r"RelBiasSeq2Seq \(its further stacks start at encoder.block.0\)"):
        priced(seq=16, stack_seqs={"decoder.block.0": 64})


def _saved_per_row(model: nn.Module, blocks: list[nn.Module], rows: int, src: int, tgt: int,
                   bf16: bool, *, without_source: bool) -> float:
    """Bytes of the distinct storages (parameters aside; the encoder's output too with
    ``without_source``) that ``blocks`` save for backward per row: a forward on ``2 * rows``
    rows less one on ``rows``, so what a forward saves once whatever its rows (autocast's bf16
    copies of the weights) cancels; under CPU bf16 autocast with ``bf16``."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def one(n: int) -> int:
        saved: dict[int, int] = {}
        inside: list[bool] = []
        memory: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if inside and t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        def source(_m: Any, _a: Any, out: Any) -> None:
            first = out if isinstance(out, torch.Tensor) else out[0]
            memory.append(first.untyped_storage().data_ptr())

        handles = [h for b in blocks for h in (
            b.register_forward_pre_hook(lambda *_: inside.append(True)),
            b.register_forward_hook(lambda *_: inside.pop() and None))]
        if without_source:
            handles.append(model.get_submodule("encoder").register_forward_hook(source))
        g = torch.Generator().manual_seed(n * src + tgt)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(input_ids=torch.randint(4, 32, (n, src), generator=g),
                      decoder_input_ids=torch.randint(4, 32, (n, tgt), generator=g))
        finally:
            for h in handles:
                h.remove()
        return sum(v for k, v in saved.items() if k not in memory)

    return (one(2 * rows) - one(rows)) / rows


@pytest.mark.parametrize("name,factory", [("written_for_the_test", T.seq2seq),
                                          ("hf_t5", _eager(T.hf_t5)), ("hf_t5_sdpa", T.hf_t5)])
def test_a_decoder_block_saves_what_it_is_priced_at_in_fp32_and_under_autocast(
        name: str, factory: Any) -> None:
    """The decoder block is measured on two lengths of the source its cross-attention reads
    (:mod:`plait.planner.saved`), so what grows with the source (its keys and values,
    autocast's cast of the source per key and value projection, the cross-attention's
    scores) is priced on the source's tokens and the rest on the target's: the bytes it
    saves per row equal torch's at (source, target) = (64, 16) and (24, 40), fp32 and under
    CPU bf16 autocast, eager attention and SDPA's (whose kernel saves its own tensors); an
    encoder block, measured on its own, likewise."""
    model, stats = factory(), load_model(factory())
    model.train()
    c = Constants(flash_attention=False)
    encoder = stats.stack_block(stats.more_stacks[0])
    ratios = {}
    for _, src, tgt in SHAPES:
        for bf16, size in ((False, 4), (True, 2)):
            priced = {"decoder.block.1": activation_bytes_per_block(
                          stats, 1, tgt, 1, False, size, c, side_seq=src),
                      "encoder.block.1": activation_bytes_per_block(
                          encoder, 1, src, 1, False, size, c, side_seq=tgt)}
            for block, price in priced.items():
                ratios[(block, src, tgt, size)] = round(
                    price / _saved_per_row(model, [model.get_submodule(block)], 2, src, tgt,
                                           bf16, without_source=True), 4)
    assert set(ratios.values()) == {1.0}, (name, ratios)


@pytest.mark.parametrize("name,factory", [("written_for_the_test", T.seq2seq),
                                          ("hf_t5", _eager(T.hf_t5))])
def test_the_decoder_stack_saves_what_it_is_priced_at_with_the_source_it_reads(
        name: str, factory: Any) -> None:
    """All the decoder's blocks together save, per row, their blocks' price plus the source
    they read (:func:`side_input_bytes`): in fp32 the encoder's output itself, once; under
    CPU bf16 autocast only autocast's casts of it, which each block's measured price holds,
    so nothing more."""
    model, stats = factory(), load_model(factory())
    model.train()
    c = Constants(flash_attention=False)
    ratios = {}
    for _, src, tgt in SHAPES:
        for bf16, size in ((False, 4), (True, 2)):
            price = stats.n_layers * activation_bytes_per_block(
                stats, 1, tgt, 1, False, size, c, side_seq=src) + side_input_bytes(
                stats, 1, src, size)
            ratios[(src, tgt, size)] = round(
                price / _saved_per_row(model, list(model.get_submodule("decoder.block")), 2,
                                       src, tgt, bf16, without_source=False), 4)
    assert set(ratios.values()) == {1.0}, (name, ratios)
