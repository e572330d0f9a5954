"""``plait plan``: JSON and table output, a given plan, and bad input (one line, exit 2)."""

import argparse
import json

import pytest

from plait.plan import Plan
from plait.planner import auto_plan
from plait.planner.cli import add_plan_arguments, plan_command


def run_cli(*argv):
    parser = add_plan_arguments(argparse.ArgumentParser())
    return plan_command(parser.parse_args(list(argv)))


def test_model_that_fits_nowhere_is_explained(capsys):
    with pytest.raises(ValueError, match="no layout"):
        auto_plan("gpt-175b", 8, "dgx-a100-80gb", global_batch=8, seq=2048)
    code = run_cli("--model", "gpt-175b", "--cluster", "dgx-a100-80gb", "--devices", "8",
                   "--global-batch", "64", "--seq", "2048")
    out = capsys.readouterr().out
    assert code == 1
    assert "no layout" in out and "smallest cluster that fits" in out


def test_cli_json_has_required_fields(capsys):
    code = run_cli("--model", "llama-8b", "--cluster", "dgx-h100", "--nodes", "2",
                   "--global-batch", "64", "--seq", "2048", "--top", "3", "--format", "json")
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and len(data["plans"]) == 3
    for p in data["plans"]:
        for key in ("layout", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu",
                    "memory_bytes_per_device", "comm_bytes_per_step", "bubble_fraction"):
            assert key in p
        Plan.from_dict(p["layout"]).validate(16)


def test_cli_evaluates_given_plan(capsys):
    code = run_cli("--model", "gpt-145b", "--cluster", "dgx-a100-80gb", "--global-batch", "2304",
                   "--plan", "dp=24,tp=8,pp=8,schedule=interleaved_1f1b,v=2,mb=96,ac=full,mp=bf16")
    out = capsys.readouterr().out
    assert code == 0 and "pp=8 x dp_replicate=24 x tp=8" in out


def test_cli_table_and_pareto(tmp_path, capsys):
    png = tmp_path / "pareto.png"
    code = run_cli("--model", "test", "--cluster", "cpu", "--devices", "4", "--global-batch",
                   "8", "--pareto", str(png))
    out = capsys.readouterr().out
    assert code == 0 and "best:" in out and "limited by" in out and png.stat().st_size > 0


@pytest.mark.parametrize("argv, field", [
    (["--model", "test", "--cluster", "nope", "--global-batch", "8"], "unknown cluster preset"),
    (["--model", "nope", "--cluster", "cpu", "--global-batch", "8"], "unknown model"),
    (["--model", "test", "--cluster", "cpu", "--global-batch", "-4"], "global-batch=-4"),
    (["--model", "test", "--cluster", "cpu", "--global-batch", "0"], "global-batch=0"),
    (["--model", "test", "--cluster", "cpu", "--devices", "0", "--global-batch", "8"], "devices=0"),
    (["--model", "test", "--cluster", "cpu", "--devices", "8", "--global-batch", "7"],
     "global-batch=7"),
    (["--model", "tests._planner_factories:broken", "--cluster", "cpu", "--global-batch", "8",
      "--seq", "16"], "failed to build"),
    (["--model", "no.such.module:f", "--cluster", "cpu", "--global-batch", "8"], "cannot import"),
    # An image dataset and a model with no maximum sequence: what --seq means for it.
    (["--model", "tests._planner_factories:mlp_with_images", "--cluster", "cpu",
      "--global-batch", "8"], "pass the positions each block sees per sample, e.g. --seq 196"),
])
def test_bad_input_names_the_field(argv, field, capsys):
    assert run_cli(*argv) == 2
    assert field in capsys.readouterr().err


def test_a_given_plan_the_batch_does_not_fit_says_the_batch_to_use(capsys):
    """--plan with a global batch the data-parallel degree (or its microbatches) does not
    divide: exit 1, the reason and the batch to give."""
    argv = ["--model", "tiny", "--cluster", "cpu", "--devices", "2", "--seq", "16"]
    assert run_cli(*argv, "--plan", "dp=2", "--global-batch", "3") == 1
    assert ("global batch 3 not divisible by dp=2: use a multiple of 2"
            in capsys.readouterr().out)
    assert run_cli(*argv, "--plan", "pp=2,mb=4", "--global-batch", "6") == 1
    assert ("batch per dp rank 6 not divisible by microbatches x grad_accum = 4: use a global "
            "batch that is a multiple of 4") in capsys.readouterr().out


def test_a_model_without_blocks_gets_data_parallel_layouts_or_the_batch_to_use(capsys):
    """A lone nn.Linear has no stack of blocks: its layouts are data parallel over every device,
    so a global batch the devices do not divide fits nothing, and the message says what to give."""
    argv = ["--model", "tests._planner_factories:no_blocks", "--cluster", "cpu", "--seq", "16"]
    assert run_cli(*argv, "--devices", "4", "--global-batch", "6") == 1
    out = capsys.readouterr().out
    assert "global batch 6 not divisible by dp=4" in out and "a multiple of 4" in out
    assert run_cli(*argv, "--devices", "2", "--global-batch", "8") == 0
    out = capsys.readouterr().out
    assert "data-parallel layouts only" in out and "dp_replicate=2" in out


def test_malformed_cluster_yaml(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("name: x\ndevices_per_node: [1\n")
    assert run_cli("--model", "test", "--cluster", str(bad), "--global-batch", "8") == 2
    assert "not valid YAML" in capsys.readouterr().err
    bad.write_text("name: x\ndevices_per_node: 8\nmemory_gb: -1\npeak_tflops: {bf16: 1}\n"
                   "intra_node_gbps: 1\ninter_node_gbps: 1\n")
    assert run_cli("--model", "test", "--cluster", str(bad), "--global-batch", "8") == 2
    assert "memory_gb" in capsys.readouterr().err
    bad.write_text("name: x\ndevices_per_node: 8\n")
    assert run_cli("--model", "test", "--cluster", str(bad), "--global-batch", "8") == 2
    assert "missing field" in capsys.readouterr().err


def test_malformed_model_files(tmp_path, capsys):
    bad = tmp_path / "m.yaml"
    bad.write_text("dim: 64\nwidth: 3\n")
    assert run_cli("--model", str(bad), "--cluster", "cpu", "--global-batch", "8") == 2
    assert "width" in capsys.readouterr().err
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10}))
    assert run_cli("--model", str(cfg), "--cluster", "cpu", "--global-batch", "8") == 2
    assert "num_hidden_layers" in capsys.readouterr().err
    cfg.write_text(json.dumps({"hidden_size": -64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "vocab_size": 10}))
    assert run_cli("--model", str(cfg), "--cluster", "cpu", "--global-batch", "8") == 2
    assert "hidden_size=-64" in capsys.readouterr().err


def test_every_listed_prediction_states_its_uncertainty(capsys):
    """Each plan carries the step time over its chip's efficiency range and the source of the
    efficiency; a chip no published run was checked on says it is extrapolated."""
    code = run_cli("--model", "llama-8b", "--cluster", "mi300x", "--nodes", "2",
                   "--global-batch", "64", "--seq", "2048", "--top", "3", "--format", "json")
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert code == 0 and len(plans) == 3
    for p in plans:
        fast, slow = p["step_time_range_s"]
        assert fast < p["step_time_s"] < slow
        assert any("extrapolated" in n for n in p["notes"])
    code = run_cli("--model", "llama-8b", "--cluster", "dgx-h100", "--nodes", "2",
                   "--global-batch", "64", "--seq", "2048", "--top", "1", "--efficiency", "0.5",
                   "--format", "json")
    (p,) = json.loads(capsys.readouterr().out)["plans"]
    assert p["step_time_range_s"] is None and any("given" in n for n in p["notes"])


@pytest.mark.parametrize("extra, field", [
    ("{compute_efficiency: fast}", "extra.compute_efficiency='fast'"),
    ("{compute_efficiency: 0.5, compute_efficiency_range: 0.4}", "compute_efficiency_range=0.4"),
    ("{compute_efficiency: 0.5, compute_efficiency_range: [0.6, 0.7]}", "must bracket"),
    ("{overlap: 'yes'}", "extra.overlap='yes'"),
    ("{block_overhead_s: slow}", "extra.block_overhead_s='slow'"),
])
def test_malformed_cluster_extra_fails_in_one_line(tmp_path, capsys, extra, field):
    bad = tmp_path / "c.yaml"
    bad.write_text("name: x\ndevices_per_node: 8\nmemory_gb: 80\npeak_tflops: {bf16: 312}\n"
                   f"intra_node_gbps: 300\ninter_node_gbps: 25\nextra: {extra}\n")
    assert run_cli("--model", "llama-8b", "--cluster", str(bad), "--devices", "8",
                   "--global-batch", "8", "--seq", "2048") == 2
    err = capsys.readouterr().err
    assert field in err and len(err.strip().splitlines()) == 1


def test_a_json_request_gets_its_error_as_json(tmp_path, capsys):
    """--format json: a bad request still prints a JSON object on stdout (and the line on
    stderr), so that a program reading the report can tell why it failed."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10}))
    assert run_cli("--model", str(cfg), "--cluster", "cpu", "--global-batch", "8",
                   "--format", "json") == 2
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert data["exit_code"] == 2 and data["command"] == "plan"
    assert "num_hidden_layers" in data["error"] and "num_hidden_layers" in out.err


def test_a_transformers_model_says_its_sequence_length_and_gpt2_linears_count():
    """A Hugging Face model given as a factory: its config's n_positions is the sequence the
    planner prices (no --seq needed), and GPT-2's Conv1D layers count as its linears."""
    pytest.importorskip("transformers")
    from plait.planner.model_stats import load_model

    stats = load_model("tests._planner_factories:tiny_gpt2")
    assert stats.max_seq == 32 and stats.hidden == 32 and stats.ffn == 128
    assert stats.n_layers == 2 and stats.n_heads == 4 and stats.attention


def test_a_factory_model_is_asked_about_the_layouts_it_would_take(capsys):
    """plait plan --model pkg:factory builds the model on the host and asks it, as plan='auto'
    does: a given plan it refuses exits 1 with the reason, and the search leaves such layouts
    out, saying so."""
    spec = "tests._planner_factories:block_mixing_positions"
    common = ("--model", spec, "--cluster", "cpu", "--devices", "2", "--global-batch", "8",
              "--seq", "8")
    assert run_cli(*common, "--plan", "tp=2,sp=true") == 1
    assert "refuses tp=2,sp=true: no sequence parallelism: blocks.0 does not treat positions" \
        in capsys.readouterr().out
    assert run_cli(*common, "--plan", "tp=2") == 0
    capsys.readouterr()
    assert run_cli(*common, "--top", "40", "--format", "json") == 0
    data = json.loads(capsys.readouterr().out)
    assert not any(p["layout"]["sp"] for p in data["plans"]), [p["plan"] for p in data["plans"]]
    assert any("refused by the model (no sequence parallelism" in line
               for line in data["model_check"]), data["model_check"]


def test_how_many_fit_does_not_depend_on_how_many_are_shown(capsys):
    """The header's "N fit in memory" counts every layout the cost model fits, not the --top
    cut shown below it; a cut says so."""
    common = ("--model", "tests._planner_factories:block_mixing_positions", "--cluster", "cpu",
              "--devices", "4", "--global-batch", "8", "--seq", "8")
    headers, fits = [], []
    for top in ("3", "1000"):
        assert run_cli(*common, "--top", top) == 0
        headers.append(capsys.readouterr().out.splitlines()[0])
        assert run_cli(*common, "--top", top, "--format", "json") == 0
        data = json.loads(capsys.readouterr().out)
        fits.append(data["fit"])
        assert len(data["plans"]) == min(int(top), data["fit"]
                                         - sum(n for k, n in data["rejected"].items()
                                               if k.startswith("refused by")))
    assert fits[0] == fits[1] > 3
    assert headers[0].endswith(f"{fits[0]} fit in memory, the best 3 shown"), headers[0]
    assert headers[1].endswith(f"{fits[0]} fit in memory"), headers[1]


def test_a_learned_position_table_gives_the_sequence_and_the_plan_says_so(capsys):
    """A factory model whose only word on its maximum sequence is a position nn.Embedding
    (``self.pos = nn.Embedding(48, d)``): its rows are the sequence priced without --seq, and
    the header names where the figure came from; two position tables of different sizes say
    nothing for sure, and --seq is asked for."""
    from plait.planner.model_stats import load_model

    stats = load_model("tests._planner_factories:learned_positions")
    assert (stats.max_seq, stats.max_seq_from) == (48, "the 48 rows of its position embedding "
                                                       "pos")
    assert load_model("tests._planner_factories:two_position_tables").max_seq is None
    common = ("--cluster", "cpu", "--devices", "2", "--global-batch", "8")
    assert run_cli("--model", "tests._planner_factories:learned_positions", *common) == 0
    out = capsys.readouterr().out
    assert "global batch 8 x seq 48 (the model's maximum: the 48 rows of its position " \
           "embedding pos)" in out, out
    assert run_cli("--model", "tests._planner_factories:two_position_tables", *common) == 2
    assert "--seq is required" in capsys.readouterr().err


def test_plan_auto_says_it_read_the_position_table():
    """plan='auto' prices the same sequence for the same model and names its source."""
    from plait.auto import AutoRequest, choose
    from tests._planner_factories import learned_positions

    _, why = choose(learned_positions(), AutoRequest(world_size=2, device_type="cpu"))
    assert "seq 48 (the model's maximum: the 48 rows of its position embedding pos)" in why[0]


@pytest.mark.parametrize("factory", ["learned_positions", "with_seeded_data"])
def test_reading_a_factory_on_meta_does_not_import_torch_dynamo(factory):
    """The planner builds a factory's model (and reads its dataset) on the meta device, where
    torch's Python references import torch._dynamo (seconds): an nn.Embedding's ``normal_``
    fill (``learned_positions``), a dataset drawn from its own generator
    (``torch.randn(..., generator=g)``, ``with_seeded_data``). The meta build skips the fills
    and draws without the generator: a meta tensor holds no values. Run in a fresh
    interpreter: this one may hold dynamo already."""
    import subprocess
    import sys

    code = ("import sys; from plait.planner.model_stats import load_model; "
            f"s = load_model('tests._planner_factories:{factory}'); "
            "print(s.num_params, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    from tests._planner_factories import learned_positions

    params = sum(p.numel() for p in learned_positions().parameters())
    assert out.stdout.split() == [str(params), "False"], out.stderr


def test_a_plan_without_tp_or_pp_does_not_import_their_machinery():
    """`plait plan --model pkg:factory --plan dp=2` asks the model about the layout, and a
    layout with neither tensor parallelism nor a pipeline needs neither DTensor (which
    plait.parallel.tensor imports, with FSDP) nor torch.distributed.pipelining."""
    import subprocess
    import sys

    code = ("import sys; from plait.cli import main; "
            "code = main(['plan', '--model', 'tests._planner_factories:learned_positions', "
            "'--cluster', 'cpu', '--global-batch', '8', '--plan', 'dp=2', '--format', 'json']); "
            "print(code, *(m in sys.modules for m in ('torch.distributed.tensor', "
            "'torch.distributed.pipelining', 'plait.parallel.tensor')), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stderr.split()[-4:] == ["0", "False", "False", "False"], out.stderr


@pytest.mark.parametrize("enabled", [True, False])
def test_plan_searches_with_the_collector_off_and_leaves_it_as_it_was(monkeypatch, capsys,
                                                                     enabled):
    """The search runs without Python's cyclic collector (its full collections walk every
    object torch's import left alive); the command leaves the collector as it found it,
    on an error too."""
    import gc

    import plait.planner.cli as cli

    seen = []
    real = cli.search

    def search(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(cli, "search", search)
    (gc.enable if enabled else gc.disable)()
    try:
        assert run_cli("--model", "llama-8b", "--cluster", "dgx-h100", "--nodes", "2",
                       "--global-batch", "64", "--seq", "2048", "--top", "1") == 0
        assert seen == [False] and gc.isenabled() is enabled
        monkeypatch.setattr(cli, "search", lambda *a, **k: (_ for _ in ()).throw(
            ValueError("bad")))
        assert run_cli("--model", "llama-8b", "--cluster", "dgx-h100", "--nodes", "2",
                       "--global-batch", "64", "--seq", "2048") == 2
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
    capsys.readouterr()
