"""Plan parsing, serialisation and validation (pure, no process group)."""

import json

import pytest

from plait.plan import MESH_AXES, Plan


@pytest.mark.parametrize("text", [
    "single", "dp=4", "dp=2,tp=2,pp=2,schedule=gpipe,mb=4", "dp_shard=4,zero=3,offload",
    "dp_replicate=2,dp_shard=2,zero=2,mp=bf16,ac=full", "fsdp=2,tp=2,sp",
    "pp=2,schedule=interleaved_1f1b,v=2,mb=4,accum=2,clip=0.5",
])
def test_string_round_trip(text):
    plan = Plan.from_string(text)
    assert Plan.from_string(plan.to_string()) == plan
    assert Plan.from_dict(plan.to_dict()) == plan


def test_dp_alias_follows_zero():
    assert Plan.from_string("dp=4").dp_replicate == 4
    plan = Plan.from_string("dp=4,zero=2")
    assert (plan.dp_shard, plan.dp_replicate, plan.zero) == (4, 1, 2)
    assert Plan.from_string("fsdp=4") == Plan(dp_shard=4, zero=3)


def test_world_size_and_degrees():
    plan = Plan.from_string("dp=2,tp=2,pp=2,mb=2")
    assert plan.world_size == 8
    assert list(plan.degrees()) == list(MESH_AXES)
    plan.validate(8)


def test_world_size_mismatch_names_every_factor():
    with pytest.raises(ValueError) as err:
        Plan.from_string("dp_shard=2,zero=3,tp=3").validate(4)
    msg = str(err.value)
    for part in ("pp(1)", "dp_replicate(1)", "dp_shard(2)", "cp(1)", "tp(3)", "= 6",
                 "world size 4"):
        assert part in msg


@pytest.mark.parametrize("text, fragment", [
    ("zero=3", "needs dp_shard > 1"),
    ("dp_shard=2", "needs a ZeRO stage"),
    ("dp_shard=2,zero=5", "zero=5"),
    ("dp_shard=2,zero=2,offload", "offload=True needs zero=3"),
    ("sp", "needs tp > 1"),
    ("cp=2", "reserved"),
    ("pp=2,schedule=warp", "pp_schedule='warp'"),
    ("pp=4,mb=2", "microbatches=2 < pp=4"),
    ("pp=2,mb=2,v=2", "needs a multi-stage schedule"),
    ("pp=2,mb=2,schedule=interleaved_1f1b", "needs virtual_stages >= 2"),
    ("ac=some", "activation_checkpointing='some'"),
    ("mp=fp64", "mixed_precision='fp64'"),
    ("tp=0", "tp=0 must be a positive integer"),
    ("clip=-1", "grad_clip=-1.0"),
])
def test_invalid_plans_raise_with_the_factor(text, fragment):
    with pytest.raises(ValueError) as err:
        Plan.from_string(text)
    assert fragment in str(err.value)


def test_all_errors_reported_at_once():
    with pytest.raises(ValueError) as err:
        Plan(sp=True, cp=2, mixed_precision="fp64")
    msg = str(err.value)
    assert "sp=True" in msg and "cp=2" in msg and "fp64" in msg


@pytest.mark.parametrize("text, fragment", [
    ("dp=x", "must be an integer"), ("dp2", "cannot parse plan item"),
    ("warp=2", "unknown plan field 'warp'"), ("sp=maybe", "must be true or false"),
])
def test_unparseable_strings(text, fragment):
    with pytest.raises(ValueError) as err:
        Plan.from_string(text)
    assert fragment in str(err.value)


def test_yaml_and_json_files(tmp_path):
    plan = Plan.from_string("dp=2,tp=2,sp,mp=bf16")
    for name in ("p.yaml", "p.json"):
        path = tmp_path / name
        plan.save(path)
        assert Plan.load(path) == plan
    json.loads((tmp_path / "p.json").read_text())
    with pytest.raises(ValueError, match="does not exist"):
        Plan.load(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        Plan.load(tmp_path / "bad.yaml")


def test_describe_is_readable():
    text = Plan.from_string("dp_shard=2,zero=3,tp=2,sp,mp=bf16").describe()
    assert "dp_shard=2 x tp=2" in text and "ZeRO-3" in text and "sequence-parallel" in text
