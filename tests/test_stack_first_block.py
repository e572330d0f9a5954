"""A stack whose first block holds parameters the later blocks lack (T5's relative position
bias: block 0 of each stack computes it, every later block reuses it) is read by the planner
as one stack of alike blocks plus those parameters, where they live: in block 0, split per
head as the inferred layer plan splits them (column-parallel on the table's head columns).

Read on an encoder-decoder written for the test (``RelBiasSeq2Seq``), Hugging Face T5 and
T5's encoder alone; ``plait plan`` then ranks tensor-parallel layouts of T5; the ledger's
expected column (the planner's stats) equals what it measures, bytes and calls, under dp,
ZeRO-3, tp and tp with sequence parallelism (the default run: T5 under tp=2,sp and the model
written for the test under tp=2; every pair: slow). Each stack's blocks are priced by their
own shape: a decoder block's and an encoder block's forward FLOPs are what torch counts in
them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

from plait.planner.fsdp_rows import Rows
from plait.planner.model_stats import load_model
from plait.spawn import run_distributed
from tests import _workers_encdec as E
from tests import _workers_tp_encdec as T


def _t5_encoder() -> nn.Module:
    return E.t5_encoder()[0]


# factory, the main stack's first block, its blocks, the further stacks (first block, blocks),
# the relative bias table (buckets, heads), the vocabulary embedding's elements
READS: list[tuple[Callable[[], nn.Module], str, int, list[tuple[str, int]], tuple[int, int],
                  int]] = [
    (T.seq2seq, "decoder.block.0", 2, [("encoder.block.0", 2)], (T.BUCKETS, T.HEADS),
     T.VOCAB * T.WIDTH),
    (T.hf_t5, "decoder.block.0", 2, [("encoder.block.0", 2)], (8, 4), 64 * 32),
    (_t5_encoder, "encoder.block.0", 4, [], (8, 4), 64 * 32),
]


@pytest.mark.parametrize("factory,first,layers,more,table,embed", READS,
                         ids=["written_for_the_test", "hf_t5", "hf_t5_encoder"])
def test_a_first_block_holding_a_bias_reads_as_one_stack(factory: Any, first: str,
                                                         layers: int, more: list,
                                                         table: tuple[int, int],
                                                         embed: int) -> None:
    """Every block of each stack is read, from block 0 (T5's encoder alone: 4 blocks, not the
    3 alike ones after the first); block 0's parameters are a later block's plus the bias
    table, split on its head columns; the model's parameters are counted once each (the
    embedding three modules share, once; a table inside a block, as the block's)."""
    with torch.device("meta"):
        model = factory()
        stats = load_model(model)
    assert (stats.stack_first, stats.n_layers) == (first, layers), stats
    assert [(m.first, m.n_layers) for m in stats.more_stacks] == more, stats.more_stacks
    assert stats.rows is not None
    lead, later = list(stats.rows.stack[0]), list(stats.rows.stack[1])
    for row in later:
        lead.remove(row)
    assert lead == [Rows(table, 1, True)], lead
    assert stats.num_params == sum(p.numel() for p in model.parameters())
    assert (stats.embed_params, stats.embed_tensors) == (embed, 1)
    assert stats.tp_refuses(2) == "", stats.tp_refuses(2)


def _plan(capsys: Any, *more: str) -> dict[str, Any]:
    from plait.planner.cli import add_plan_arguments, plan_command

    parser = add_plan_arguments(argparse.ArgumentParser())
    assert plan_command(parser.parse_args([
        "--model", "tests._workers_encdec:t5", "--cluster", "cpu", "--devices", "2",
        "--global-batch", "8", "--top", "40", "--format", "json", *more])) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_plait_plan_ranks_tensor_parallel_layouts_of_t5(capsys: Any) -> None:
    """``plait plan --model tests._workers_encdec:t5`` searches tp=2 (with and without SP)
    beside the data-parallel layouts, each priced with tp traffic; pipelines stay refused."""
    out = _plan(capsys)
    tp = [(p["layout"]["sp"], {t["axis"] for t in p["traffic"]}) for p in out["plans"]
          if p["layout"]["tp"] == 2]
    assert {sp for sp, _ in tp} == {False, True}, out["plans"]
    assert all(axes == {"tp"} for _, axes in tp), tp
    assert all("pipeline" in r for r in out["rejected"]), out["rejected"]


def _assert_as_measured(comm: dict[str, Any], plan: str, name: str) -> None:
    """Every row predicted, at ratio 1 and the calls measured."""
    assert not any("no 'expected' column" in n for n in comm["notes"]), (plan, name,
                                                                         comm["notes"])
    assert comm["rows"], (plan, name)
    for r in comm["rows"]:
        assert r["expected_bytes"], (plan, name, r)
        assert r["ratio"] == pytest.approx(1.0, abs=1e-12), (plan, name, r)
        assert r["count"] == r["expected_calls"], (plan, name, r)


PLANS = ["dp=2", "dp_shard=2,zero=3", "tp=2", "tp=2,sp"]
MODELS = ["hf_t5", "hf_t5_gated", "seq2seq"]
DEFAULT = [("tp=2,sp", "hf_t5")]


@pytest.mark.parametrize("jobs", [DEFAULT, pytest.param(
    [(p, n) for n in MODELS for p in PLANS if (p, n) not in DEFAULT],
    marks=pytest.mark.slow)], ids=["default", "every_plan"])
def test_the_ledger_prices_t5_as_it_measures(jobs: list[tuple[str, str]]) -> None:
    """T5, T5 v1.1 (gated feed-forward, untied head) and the encoder-decoder written for the
    test, 2 gloo ranks: the ledger's expected column equals its measured bytes and calls on
    every row (the tp rows were not predicted while the planner read no stack of T5)."""
    got = run_distributed(T.ledger, 2, jobs, timeout=600)[0]
    for (plan, name), comm in zip(jobs, got, strict=True):
        _assert_as_measured(comm, plan, name)


def _forward_flops(model: nn.Module, blocks: list[str], call: Callable[[], Any]
                   ) -> dict[str, int]:
    """The forward FLOPs torch counts (``FlopCounterMode``: matmuls) inside each block of
    ``blocks`` while ``call`` runs the model."""
    from torch.utils.flop_counter import FlopCounterMode

    counters = {name: FlopCounterMode(display=False) for name in blocks}

    def enter(counter: FlopCounterMode) -> Any:
        return lambda *_: None if counter.__enter__() is None else None

    def leave(counter: FlopCounterMode) -> Any:
        return lambda *_: counter.__exit__(None, None, None) and None

    for name, counter in counters.items():
        module = model.get_submodule(name)
        module.register_forward_pre_hook(enter(counter))
        module.register_forward_hook(leave(counter))
    with torch.no_grad():
        call()
    return {name: c.get_total_flops() for name, c in counters.items()}


@pytest.mark.parametrize("factory", [T.seq2seq, T.gated_seq2seq], ids=["plain", "gated"])
def test_each_stacks_blocks_are_priced_by_their_own_shape(factory: Any) -> None:
    """The encoder-decoder written for the test (its feed-forward plain or gated): a decoder
    block (self- and cross-attention, 2 attention layers) and an encoder block (self-attention
    only) each priced at the forward FLOPs torch counts in it, on a source
    and a target of 6 tokens; the encoder's saved activations are less than a decoder
    block's. (Priced as the decoder's, the encoder's FLOPs were the decoder's matmuls, and
    both counted one attention layer's scores.)"""
    from plait.planner.cost import Constants
    from plait.planner.memory import activation_bytes_per_block

    model = factory()
    stats = load_model(model)
    encoder = stats.stack_block(stats.more_stacks[0])
    assert (stats.attentions, encoder.attentions) == (2, 1)
    rows, seq = 2, 6
    ids = torch.randint(4, 32, (rows, seq), generator=torch.Generator().manual_seed(0))
    counted = _forward_flops(model, ["encoder.block.1", "decoder.block.1"],
                             lambda: model(input_ids=ids, decoder_input_ids=ids))
    assert counted["decoder.block.1"] == stats.block_flops_per_token(seq) * rows * seq
    assert counted["encoder.block.1"] == encoder.block_flops_per_token(seq) * rows * seq
    c = Constants()
    assert activation_bytes_per_block(encoder, rows, seq, 1, False, 4, c) < \
        activation_bytes_per_block(stats, rows, seq, 1, False, 4, c)
