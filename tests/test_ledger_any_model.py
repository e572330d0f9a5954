"""The ledger's expected column for models other than plait's reference transformer: under
DDP, ZeRO-1/2/3 and HSDP the closed form (``plait.comm.held``) is read off the laid-out model,
and every measured row matches it exactly (ratio 1.000 per axis and op).

The models (tests/_workers_ledger_any.py) each carry what the closed form must not assume away:
a tied embedding and head (one parameter under two names), frozen parameters (FSDP2 gathers
them, nobody reduces them; ZeRO-1's optimizer, given them, broadcasts them), sizes FSDP2 pads
(a vocabulary of 51, a Linear with 7 outputs), buffers (DDP broadcasts them every step), blocks
in a container not called ``layers``, and tiny Hugging Face models built from a config.
"""

from __future__ import annotations

import pytest

from plait.comm.held import HeldModel, ShardUnit, held_traffic
from plait.comm.predict import NO_EXPECTED_NOTE, by_axis_op
from plait.plan import Plan
from plait.spawn import run_distributed
from tests import _workers_ledger_any as W

AR, AG, RS, BC = "all_reduce", "all_gather", "reduce_scatter", "broadcast"


def _check(comm: dict, want: set[tuple[str, str]], world: int) -> None:
    """Every row measured on every rank, predicted, at ratio exactly 1; the rows are ``want``
    (a predicted row nobody measured would be a row with no ranks and ratio 0)."""
    rows = {(r["axis"], r["op"]): r for r in comm["rows"]}
    assert set(rows) == want, sorted(rows)
    for key, r in rows.items():
        assert r["ranks"] == world, (key, r)
        assert r["expected_bytes"], (key, r)
        assert r["ratio"] == pytest.approx(1.0, abs=1e-12), (key, r["payload_bytes"],
                                                               r["expected_bytes"])
        assert r["count"] == r["expected_calls"], (key, r["count"], r["expected_calls"])
    assert not any("no 'expected' column" in n for n in comm["notes"]), comm["notes"]


DDP = {("dp_replicate", AR), ("dp_replicate", BC)}     # gradients; buffers
ZERO1 = {("dp_shard", AR), ("dp_shard", BC)}           # gradients; parameters and buffers
FSDP = {("dp_shard", AG), ("dp_shard", RS)}
CLIP = {("dp_shard", AR)}                              # per-tensor gradient norms

# (plan, models, the rows every model of the case produces)
CASES = [
    ("dp=2", ["tied", "lora", "llama"], DDP),
    ("dp_shard=2,zero=1", ["tied", "lora"], ZERO1),
    ("dp_shard=2,zero=2,grad_accum=2", ["tied", "lora"], FSDP | CLIP),
    ("dp_shard=2,zero=3,mixed_precision=bf16,grad_clip=0", ["tied", "lora", "gpt2"], FSDP),
    ("dp_replicate=2,dp_shard=2,zero=3", ["tied", "lora"],
     FSDP | CLIP | {("dp_replicate", AR)}),
]
SLOW_CASES = [
    ("dp_shard=2,zero=3", ["tied", "lora", "gpt2", "llama"], FSDP | CLIP),
    ("dp=2,grad_accum=2", ["tied", "lora"], DDP),
    ("dp_shard=4,zero=3,grad_accum=2", ["tied", "lora"], FSDP | CLIP),
    ("dp_replicate=2,dp_shard=2,zero=2,mixed_precision=bf16", ["tied", "lora"],
     FSDP | CLIP | {("dp_replicate", AR)}),
    ("dp_replicate=2,dp_shard=2,zero=1", ["tied", "lora"], {("dp", AR), ("dp", BC),
                                                            ("dp_shard", BC)}),
    # context parallelism: the cp ranks reduce gradients with the data ranks (DDP over
    # dp x cp with the rotary buffers it broadcasts; FSDP2 over dp_shard x cp); K and V of
    # the kv heads all-gathered on cp, their gradients reduce-scattered
    ("dp=2,cp=2", ["llama"], {("dp_cp", AR), ("dp_cp", BC), ("cp", AG), ("cp", RS)}),
    ("dp_shard=2,zero=3,cp=2", ["llama"], {("dp_shard_cp", AG), ("dp_shard_cp", RS),
                                           ("dp_shard_cp", AR), ("cp", AG), ("cp", RS)}),
    # FSDP2's bf16 parameters: the rotary tables, and so the keys, are bf16 too
    ("dp_shard=2,zero=3,cp=2,mixed_precision=bf16,grad_clip=0", ["llama"],
     {("dp_shard_cp", AG), ("dp_shard_cp", RS), ("cp", AG), ("cp", RS)}),
]


@pytest.mark.parametrize("plan,models,rows", CASES + [
    pytest.param(*case, marks=pytest.mark.slow) for case in SLOW_CASES],
    ids=[c[0] for c in CASES + SLOW_CASES])
def test_any_model_matches_its_closed_form(plan, models, rows):
    world = Plan.from_string(plan).world_size
    comms = run_distributed(W.ledger_runs, world, plan, models, timeout=240)[0]
    for name in models:
        _check(comms[name]["comm"], rows, world)


def test_held_traffic_counts_each_collective_once():
    """The closed form by hand: ZeRO-3 gathers a resharded unit twice per micro-step and the
    root once; HSDP all-reduces the shard; a unit with nothing to train reduces nothing."""
    units = (ShardUnit(gather_bytes=100, reduce_bytes=60, shards=2, regathered=True),
             ShardUnit(gather_bytes=40, reduce_bytes=0, shards=2, regathered=False))
    held = HeldModel(grad_bytes=60, update_bytes=80, buffer_bytes=8, grad_tensors=3,
                     units=units)
    plan = Plan.from_string("dp_replicate=2,dp_shard=2,zero=3,grad_accum=2")
    assert by_axis_op(held_traffic(plan, held)) == {
        ("dp_shard", AG): 100 * 4 + 40 * 2, ("dp_shard", RS): 60,
        ("dp_replicate", AR): 30, ("dp_shard", AR): 3 * 4}
    assert by_axis_op(held_traffic(Plan.from_string("dp=2,grad_accum=2"), held)) == {
        ("dp_replicate", AR): 60, ("dp_replicate", BC): 8}
    with pytest.raises(ValueError, match="activations"):
        held_traffic(Plan.from_string("tp=2"), held)
    assert "plait plan --model pkg.mod:factory --plan <plan>" in NO_EXPECTED_NOTE
