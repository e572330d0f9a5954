"""Plan parsing, serialisation and validation (pure, no process group)."""

import json

import pytest

from plait.plan import MESH_AXES, Plan, PlanOptions


@pytest.mark.parametrize("text", [
    "single", "dp=4", "dp=2,tp=2,pp=2,schedule=gpipe,mb=4", "dp_shard=4,zero=3,offload",
    "dp_replicate=2,dp_shard=2,zero=2,mp=bf16,ac=full", "fsdp=2,tp=2,sp",
    "pp=2,schedule=interleaved_1f1b,v=2,mb=4,accum=2,clip=0.5",
])
def test_string_round_trip(text):
    plan = Plan.from_string(text)
    assert Plan.from_string(plan.to_string()) == plan
    assert Plan.from_dict(plan.to_dict()) == plan


def test_vpp_is_virtual_stages():
    """Megatron's name for the stages per rank is read as plait's."""
    assert Plan.from_string("pp=2,schedule=zbv,vpp=2,mb=2") == \
        Plan.from_string("pp=2,schedule=zbv,virtual_stages=2,mb=2")


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
    ("dp_shard=2,zero=1,tp=2", "zero=1 with tp=2 is not supported"),
    ("sp", "needs tp > 1"),
    ("cp=2,tp=2,zero=1", "zero=1 with tp=2 is not supported"),
    ("cp=2,compile", "cp=2 with compile is not supported"),
    ("pp=2,schedule=warp", "pp_schedule='warp'"),
    ("pp=4,mb=2", "microbatches=2 < pp=4"),
    ("pp=2,mb=2,v=2", "needs a multi-stage schedule"),
    ("pp=2,mb=2,schedule=interleaved_1f1b", "needs virtual_stages >= 2"),
    ("pp=2,mb=5,v=2,schedule=interleaved_1f1b", "microbatches=5 is not a multiple of its 2"),
    ("pp=2,mb=7,v=2,schedule=interleaved_zb", "microbatches=7 is not a multiple of its 3"),
    ("ac=some", "activation_checkpointing='some'"),
    ("mp=fp64", "mixed_precision='fp64'"),
    ("tp=0", "tp=0 must be a positive integer"),
    ("clip=-1", "grad_clip=-1.0"),
])
def test_invalid_plans_raise_with_the_factor(text, fragment):
    with pytest.raises(ValueError) as err:
        Plan.from_string(text)
    assert fragment in str(err.value)


@pytest.mark.parametrize("text", ["cp=2,tp=2,zero=3", "dp_shard=2,cp=2,tp=2,zero=2",
                                  "cp=2,zero=1", "dp_shard=2,cp=2,zero=1", "cp=2,zero=3",
                                  "cp=2,pp=2,mb=2", "cp=2,tp=2,pp=2,mb=2,schedule=gpipe",
                                  "cp=2,pp=2,mb=2,schedule=zbv,v=2",
                                  "cp=2,tp=2,pp=2,mb=2,schedule=zbv,v=2",
                                  "dp=2,cp=2,zero=1,pp=2,mb=2,schedule=interleaved_zb,v=2",
                                  "cp=2,zero=3,pp=2,mb=2,schedule=interleaved_zb,v=2",
                                  "dp_shard=2,cp=2,zero=2,pp=2,mb=2,schedule=zbv,v=2"])
def test_cp_composes_with_zero_and_pp(text):
    """ZeRO shards over dp_shard x cp under context parallelism: cp alone gives it ranks to
    shard over, beside tp (stages 2 and 3) or not; pipelines run cp inside each stage, under
    zero-bubble schedules with data replicas, ZeRO-1/2/3 and tp too."""
    assert Plan.from_string(text).cp == 2


def test_all_errors_reported_at_once():
    with pytest.raises(ValueError) as err:
        Plan(sp=True, cp=2, tp=1, compile=True, mixed_precision="fp64")
    msg = str(err.value)
    assert "sp=True" in msg and "cp=2 with compile" in msg and "fp64" in msg


@pytest.mark.parametrize("text, fragment", [
    ("dp=x", "must be an integer"), ("dp2", "cannot parse plan item"),
    ("warp=2", "unknown plan field 'warp'"), ("sp=maybe", "must be true or false"),
    ("dp=2 tp=2", "plan item 'dp=2tp=2' in 'dp=2 tp=2' holds two '=': separate the items with "
                  "commas, e.g. 'dp=2,tp=2'"),
    ("dp=2;tp=2,pp=2", "separate the items with commas, e.g. 'dp=2,tp=2,pp=2'"),
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


# ------------------------------------------------------------------ options
def test_options_are_typed_and_round_trip(tmp_path):
    plan = Plan(pp=2, microbatches=2, options={"split_points": ["layers.4"],
                                               "shard_patterns": ["layers.*"]})
    assert isinstance(plan.options, PlanOptions)
    assert plan.options.split_points == ("layers.4",)
    assert plan == Plan(pp=2, microbatches=2, options=PlanOptions(
        split_points=("layers.4",), shard_patterns=("layers.*",)))
    assert plan.to_dict()["options"] == {"split_points": ["layers.4"],
                                         "shard_patterns": ["layers.*"]}
    assert Plan().to_dict()["options"] == {}
    tp = Plan(tp=2, options={"tp_plan": {"layers.*.q_proj": "colwise"}, "gloo_all_to_all": False})
    for p in (plan, tp):
        assert Plan.from_dict(p.to_dict()) == p
        for name in ("p.yaml", "p.json"):
            p.save(tmp_path / name)
            assert Plan.load(tmp_path / name) == p


@pytest.mark.parametrize("options, fragment", [
    ({"split_point": ["layers.4"]}, "unknown plan option 'split_point'; did you mean "
                                    "'split_points'?"),
    ({"gloo_all_to_al": False}, "did you mean 'gloo_all_to_all'?"),
    ({"split_points": "layers.4"}, "options.split_points='layers.4' must be a non-empty list"),
    ({"pp_stage_layers": [3, 0]}, "must hold positive values"),
    ({"pp_stage_layers": [3.5, 4.5]}, "list of positive integers"),
    ({"stage_costs": [1, float("nan")]}, "options.stage_costs"),
    ({"pp_blocks": 3}, "options.pp_blocks=3 must be a module name"),
    ({"gloo_all_to_all": "false"}, "options.gloo_all_to_all='false' must be true or false"),
    ({"tp_plan": {"q_proj": "colwize"}}, "unknown tensor-parallel style"),
    ({"tp_plan": ["q_proj"]}, "options.tp_plan=['q_proj'] must be a mapping"),
    ({"split_points": ["layers.4"], "pp_stage_layers": [4, 4]}, "give only one"),
    (5, "options=5 must be a mapping"),
])
def test_bad_options_are_refused_by_name(options, fragment):
    with pytest.raises(ValueError) as err:
        Plan(pp=2, microbatches=2, options=options)
    assert fragment in str(err.value)


def test_pipeline_cuts_must_match_the_stage_count():
    with pytest.raises(ValueError, match=r"pp_stage_layers=\[4, 4\] has 2 entries.*4 stages"):
        Plan(pp=2, microbatches=2, pp_schedule="interleaved_1f1b", virtual_stages=2,
             options={"pp_stage_layers": [4, 4]})
    with pytest.raises(ValueError, match=r"split_points=.* has 2 entries.*need 1 cuts"):
        Plan(pp=2, microbatches=2, options={"split_points": ["layers.2", "layers.4"]})


def test_a_plan_given_other_options_is_the_plan_made_with_them():
    """``Plan.with_options`` (the search's stage split on a plan it priced) equals the plan
    made with those options, and refuses cuts that do not match the stages as making it
    does."""
    fields = dict(pp=2, microbatches=4, pp_schedule="interleaved_1f1b", virtual_stages=2,
                  tp=2, dp_shard=2, zero=3, activation_checkpointing="selective")
    plan = Plan(**fields)
    cuts = PlanOptions(pp_stage_layers=(3, 4, 4, 3))
    given = plan.with_options(cuts)
    assert given == Plan(**fields, options=cuts) and given.to_dict() == \
        Plan(**fields, options=cuts).to_dict()
    assert plan.options == PlanOptions() and given.options is cuts
    with pytest.raises(ValueError, match=r"pp_stage_layers=\[4, 4\] has 2 entries.*4 stages"):
        plan.with_options(PlanOptions(pp_stage_layers=(4, 4)))


# ------------------------------------------------------------------ bad input, one line each
# (source, what the message must name). A source is a plan string, or (file name, content).
BAD_INPUT = [
    (("p.json", '{"tp": 2, "sp": "no"}'), "sp='no' must be true or false"),
    (("p.json", '{"dp_shard": 2, "zero": 3, "offload": "false"}'),
     "offload='false' must be true or false"),
    (("p.yaml", "tp: 2\nsp: 'no'\n"), "sp='no' must be true or false"),
    (("p.json", '{"grad_clip": "1.0"}'), "grad_clip='1.0' must be a number"),
    (("p.yaml", "plan: 5\n"), "'plan' must hold a mapping"),
    (("p.yaml", "5\n"), "must hold a mapping of fields"),
    (("p.yaml", ""), "must hold a mapping of fields"),
    (("p.yaml", "dp: [2\ntp: 2\n"), "is not valid YAML"),
    (("p.yaml", "dp: 2\ndp: 4\n"), "key 'dp' is given twice"),
    (("p.json", '{"dp": 2, "dp": 4}'), "key 'dp' is given twice"),
    (("p.json", '{"dp": 2,'), "is not valid JSON"),
    (("p.json", '{"tp": "2"}'), "tp='2' must be a positive integer"),
    (("p.json", '{"zero": true, "dp_shard": 2}'), "zero=True must be the integer"),
    (("p.json", '{"dp": "2"}'), "dp='2' must be a positive integer"),
    (("p.json", '{"tpp": 2}'), "unknown plan field 'tpp'; did you mean 'tp'?"),
    # One edit from 'dp' and from 'pp': the one with the key's first letter (was 'pp').
    (("p.json", '{"dpp": 2}'), "unknown plan field 'dpp'; did you mean 'dp'?"),
    (("p.yaml", "options: {split_point: [layers.1]}\n"), "did you mean 'split_points'?"),
    (("p.yaml", "pp_schedule: 5\n"), "pp_schedule=5 must be a string"),
    ("clip=nan", "grad_clip=nan must be a finite number"),
    ("clip=inf", "grad_clip=inf must be a finite number"),
    ("clip=-1", "grad_clip=-1.0 must be a finite number >= 0"),
    ("fsdp=2,zero=1", "write dp_shard=2,zero=1"),
    ("fsdp=2,dp_shard=4", "write fsdp=4 alone, or dp_shard=4,zero=3"),
    ("fsdp=2,dp=2", "give one"),
    ("dp=2,dp_shard=2,zero=3", "give dp alone"),
    ("dp=1,dp=2", "dp is given twice"),
    ("clip=1,grad_clip=2", "both set grad_clip"),
    ("foo=bar", "unknown plan field 'foo'"),
    ("options=x", "options cannot be given in a plan string"),
]


def _source(tmp_path, source):
    if isinstance(source, str):
        return source
    name, content = source
    (tmp_path / name).write_text(content)
    return str(tmp_path / name)


@pytest.mark.parametrize("source, fragment", BAD_INPUT, ids=[str(s) for s, _ in BAD_INPUT])
def test_bad_plan_input_is_one_clear_line(tmp_path, source, fragment):
    """Each bad plan is refused with a ValueError: one line, naming the field, value and fix."""
    with pytest.raises(ValueError) as err:
        Plan.load(_source(tmp_path, source))
    msg = str(err.value)
    assert fragment in msg, msg
    assert "\n" not in msg


def test_falsy_words_never_switch_a_feature_on(tmp_path):
    """YAML's own booleans and plan-string words mean what they say."""
    (tmp_path / "p.yaml").write_text("tp: 2\nsp: no\n")
    assert Plan.load(tmp_path / "p.yaml").sp is False
    assert Plan.load("tp=2,sp=no").sp is False and Plan.load("tp=2,sp=off").sp is False
    assert Plan.load("tp=2,sp").sp is True
    assert Plan.load("fsdp=2,zero=3") == Plan(dp_shard=2, zero=3)  # consistent: accepted


def test_pipeline_microbatches_default_to_one_per_stage():
    """1F1B needs a microbatch per stage: a plan without mb gets pp of them, not a refusal."""
    assert Plan.from_string("pp=2").microbatches == 2
    assert Plan.from_string("pp=4,schedule=interleaved_1f1b,v=2").microbatches == 4
    assert Plan.from_string("pp=2,mb=8").microbatches == 8
    assert Plan().microbatches == 1
    with pytest.raises(ValueError, match="microbatches=2 < pp=4"):
        Plan.from_string("pp=4,mb=2")


def test_sync_bn_is_a_plan_flag():
    plan = Plan.from_string("dp=2,sync_bn")
    assert plan.sync_bn and Plan.from_string(plan.to_string()) == plan
    assert "sync-bn" in plan.describe()


def test_find_unused_is_a_plan_flag():
    plan = Plan.from_string("dp=2,find_unused")
    assert plan.find_unused and Plan.from_string(plan.to_string()) == plan
    assert "find-unused" in plan.describe() and not Plan.from_string("dp=2").find_unused
    with pytest.raises(ValueError, match="find_unused='maybe'.*true or false"):
        Plan.from_string("dp=2,find_unused=maybe")
