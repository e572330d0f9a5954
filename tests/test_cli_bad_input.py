"""Bad command-line input: one line naming the value, exit 2, nothing started.

Each case runs ``plait.cli.main`` in this process: the checks come before any work, so a case
that is not refused would start workers or a long search and fail on time or output."""

import resource
import sys
import time
from pathlib import Path

import pytest
import torch

from plait.cli import main
from plait.outputs import plot_path

PLAN = ["plan", "--model", "llama-7b", "--cluster", "dgx-h100", "--global-batch", "512",
        "--seq", "4096"]
READ_ONLY = "/proc"  # no file can be created there, even by root (chmod means nothing to root)

CASES = [
    (["run", "--rdzv-endpoint", "localhost:99999", "SCRIPT"], "port 99999 is not in 1..65535"),
    (["run", "--log-dir", f"{READ_ONLY}/logs", "SCRIPT"], "is not writable"),
    (["run", "--log-dir", "FILE", "SCRIPT"], "is a file, not a folder"),
    (["run", "-m", "no_such_module_xyz"], "no module named 'no_such_module_xyz'"),
    (["run", "--rdzv-timeout", "0", "SCRIPT"], "--rdzv-timeout 0.0"),
    ([*PLAN, "--pareto", "MISSING/p.png"], "does not exist"),
    ([*PLAN, "--pareto", f"{READ_ONLY}/p.png"], "is not writable"),
    (["comm", "--plan", "dp=2", "--plot", "MISSING/c.png"], "does not exist"),
    (["comm", "--plan", "dp=2", "--plot", f"{READ_ONLY}/c.png"], "is not writable"),
    (["check", "--plan", "dp=2", "--model", "bogus"],
     "--model 'bogus' is not a reference preset (tiny, test, small"),
    (["check", "--plan", "dp=2", "--model", "bogus"], "e.g. --model bogus:build"),
    (["comm", "--plan", "dp=2", "--batch", "0"], "--batch=0 must be >= 1"),
    (["comm", "--plan", "dp=2", "--replica-batch", "0"], "--replica-batch=0 must be >= 1"),
    (["comm", "--plan", "dp=2", "--global-batch", "6", "--batch-size", "3"],
     "--batch-size=3 does not split over 2 data-parallel replica(s): use a multiple of 2, "
     "e.g. --global-batch 2, or --replica-batch N"),
    (["comm", "--plan", "dp=2,grad_accum=2", "--global-batch", "6"],
     "over 2 data-parallel replica(s) x grad_accum=2 = 4: use a multiple of 4"),
    (["comm", "--plan", "pp=2,microbatches=4", "--replica-batch", "6"],
     "--replica-batch=6 does not split into 4 microbatches = 4 micro-batches"),
    (["comm", "--plan", "dp=2", "--seq", "-1"], "--seq=-1"),
    (["check", "--plan", "dp=2", "--timeout", "0"], "--timeout=0.0"),
    (["comm", "--plan", "dp=2", "--timeout", "0"], "--timeout=0.0"),
    (["bench", "comm", "--timeout", "0"], "--timeout=0.0"),
    pytest.param(["bench", "comm", "--backend", "nccl"], "needs one CUDA GPU per rank",
                 marks=pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="has GPUs")),
    ([*PLAN, "--efficiency", "nan"], "efficiency=nan"),
    ([*PLAN, "--efficiency", "inf"], "efficiency=inf"),
    (["schedule", "--pp", "2000", "-m", "4000"], "more than plait schedule draws"),
    (["check", "--plan", "dp=2", "--seq-len", "4096", "--batch-size", "64"],
     "at most --seq 1024 and --global-batch 256"),
    (["check", "--plan", "dp=2", "--model", "examples.your_own_model"],
     "name your factory after a colon, e.g. --model examples.your_own_model:factory"),
    # a factory given as a file path: the dotted name to write instead
    (["check", "--plan", "dp=2", "--model", "models/vit.py:build"],
     "'models/vit.py' is a file path: give the module's dotted name, e.g. --model "
     "models.vit:build"),
    (["check", "--plan", "dp=2", "--model", "./models/vit.py"],
     "'./models/vit.py' is a file path: give the module's dotted name, e.g. --model "
     "models.vit:factory"),
    ([*PLAN[:2], "models/vit.py:build", *PLAN[3:]],
     "'models/vit.py' is a file path: give the module's dotted name, e.g. --model "
     "models.vit:build"),
    ([*PLAN[:2], "models/vit.py", *PLAN[3:]], "e.g. --model models.vit:factory"),
    (["check", "--plan", "dp=2", "--lr", "-1"], "--lr=-1.0 must be a positive"),
    (["check", "--plan", "dp=2", "--tolerance", "-1"],
     "--tolerance=-1.0 must be a finite bound >= 0, e.g. --tolerance 1e-5"),
    (["check", "--plan", "dp=2", "--tolerance", "nan"], "--tolerance=nan must be a finite"),
    (["check", "--plan", "dp=1"], "runs on 1 rank: there is nothing to compare"),
    (["check", "--plan", "dp=2", "--batch-size", "3"],
     "use a multiple of 2, e.g. --global-batch 2"),
    (["check", "--plan", "pp=2,microbatches=4,grad_accum=4"],
     "over 1 data-parallel replica(s) x grad_accum=4 x 4 microbatches = 16"),
    # plait comm takes check's factories and refuses a bad one the same way, before any rank
    (["comm", "--plan", "dp=2", "--model", "mymodels:build"],
     "--model 'mymodels:build': cannot import 'mymodels'"),
    (["comm", "--plan", "dp=2", "--model", "models/vit.py:build"],
     "'models/vit.py' is a file path: give the module's dotted name, e.g. --model "
     "models.vit:build"),
    (["comm", "--plan", "dp=2", "--model", "examples.your_own_model"],
     "name your factory after a colon, e.g. --model examples.your_own_model:factory"),
    (["comm", "--plan", "dp=2", "--model", "tiny2"], "--model 'tiny2' is not a reference preset"),
    (["comm", "--plan", "dp=2", "--model", "examples.your_own_model:nope"],
     "examples.your_own_model has no function 'nope'"),
    (["comm", "--plan", "dp=2", "--model", "examples.your_own_model:factory", "--seq", "8"],
     "with --model examples.your_own_model:factory the sequences are what your dataset "
     "returns: drop --seq"),
    # The script's --plan without a value: one line naming the flag (argparse printed a usage
    # line for "plait [--plan PLAN]", a parser nobody wrote).
    (["run", "--nproc", "2", "SCRIPT", "--plan"],
     "plait run: error: the script's --plan needs a value, e.g. --plan dp=2"),
    (["check", "--plan", "dp=2", "--model", "mymodels:build", "--seq", "8"],
     "drop --seq"),
    # plait demo and plait run's own values, refused before a worker starts
    (["demo", "--steps", "0"], "--steps 0 must be >= 1, e.g. --steps 300"),
    (["demo", "--nproc", "0"], "--nproc 0: need at least 1 process per node"),
    (["demo", "--plan", "dp=2,tp=2"], "= 4 != world size 2"),
    (["run", "--nnodes", "0", "SCRIPT"], "--nnodes 0: need at least 1 node"),
    (["run", "--node-rank", "1", "SCRIPT"], "--node-rank 1 must be in [0, 0]: --nnodes 1 "
                                            "numbers the nodes 0 to 0"),
    (["run", "--max-restarts", "-1", "SCRIPT"], "--max-restarts -1 must be >= 0"),
    (["run", "--nnodes", "2", "SCRIPT"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["run", "--rdzv-endpoint", "nohost", "SCRIPT"],
     "--rdzv-endpoint 'nohost' must be HOST:PORT, e.g. --rdzv-endpoint gpu01:29400"),
    (["run", "--nproc", "2", "SCRIPT", "--accelerator", "nope"], "unknown accelerator 'nope'"),
    (["run", "--nproc", "2", "SCRIPT", "--plan", "tp=2,sp=maybe"], "must be true or false"),
    (["bench", "comm", "--nproc", "1"], "a collective needs at least 2 ranks"),
    (["bench", "comm", "--min-bytes", "1M", "--max-bytes", "1K"], "swap them"),
    (["bench", "comm", "--ops", "all_sum"], "unknown collective 'all_sum'; known: "),
    (["bench", "comm", "--max-bytes", "12Q"], "cannot read size '12Q'"),
    (["schedule", "--pp", "2", "-m", "0"], "microbatches=0 must be a positive integer"),
    ([*PLAN[:3], "--cluster", "nope", *PLAN[5:]], "unknown cluster preset 'nope'; known: "),
    (["export", "MISSING", "--to", "m.safetensors"], "does not exist; expected a folder "
                                                    "written by plait's run.save()"),
]


@pytest.mark.parametrize("argv, fragment", CASES)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, argv, fragment):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("raise SystemExit('the script must not run')\n")
    (tmp_path / "afile").write_text("")
    subs = {"SCRIPT": "train.py", "FILE": "afile", "MISSING": str(tmp_path / "missing")}
    argv = [next((a.replace(k, v) for k, v in subs.items() if a.startswith(k)), a) for a in argv]
    start, cpu = time.monotonic(), _cpu_seconds()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert fragment in err, err
    assert len(err.strip().splitlines()) == 1, err
    # refused up front, not after the work: counted in CPU seconds (this process and the
    # children it reaped), which a loaded machine does not inflate; the wall bound catches a hang
    assert _cpu_seconds() - cpu < 20
    assert time.monotonic() - start < 120


def _cpu_seconds() -> float:
    own, kids = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                      resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def test_plot_into_a_folder_goes_inside_it(tmp_path):
    pytest.importorskip("matplotlib")
    assert plot_path(str(tmp_path), "--pareto", "pareto.png") == str(tmp_path / "pareto.png")
    assert plot_path(str(tmp_path / "x"), "--plot", "comm.png") == str(tmp_path / "x.png")
    assert plot_path(str(tmp_path / "x.svg"), "--plot", "c.png") == str(tmp_path / "x.svg")
    assert not Path(str(tmp_path) + ".png").exists()


def test_errors_raised_in_the_workers_are_one_line_too(tmp_path, capsys, monkeypatch):
    """A factory that raises, or that returns the wrong thing, fails inside the worker
    processes: said as the worker's message on one line, exit 2, not two tracebacks; what a
    factory raised (a data path that does not exist included) names the factory and its line."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_factory adds the directory
    monkeypatch.delitem(sys.modules, "mine", raising=False)  # another test's mine.py
    (tmp_path / "mine.py").write_text(
        "def boom():\n    raise ValueError('no such checkpoint: weights.pt')\n"
        "def two():\n    return 1, 2\n"
        "def missing():\n    return open('no/such/images.pt', 'rb')\n"
        "import torch\n"
        "def tiny():\n    return (torch.nn.Linear(2, 2), [(torch.ones(2), torch.ones(2))] * 4,\n"
        "            torch.nn.functional.mse_loss)\n")
    here = tmp_path / "mine.py"
    for spec, fragment in (("mine:boom", "--model 'mine:boom' raised ValueError: no such "
                                         f"checkpoint: weights.pt ({here} line 2, in boom)"),
                           ("mine:missing", "--model 'mine:missing' raised FileNotFoundError: "
                                            "[Errno 2] No such file or directory: "
                                            f"'no/such/images.pt' ({here} line 6, in missing)"),
                           ("mine:two", "must return (model, dataset, loss_fn)"),
                           ("mine:tiny", "the dataset has 4 items, fewer than one global batch "
                                         "of 8; use --global-batch 4 or less")):
        code = main(["check", "--plan", "dp=2", "--model", spec, "--timeout", "60",
                     "--global-batch", "8"])
        err = capsys.readouterr().err
        assert code == 2, (spec, err)
        assert fragment in err and len(err.strip().splitlines()) == 1, err


_READS_ITS_EMBEDDING = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids) + self.embed.weight.mean(0)  # the weight, not the layer
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, 8), labels.reshape(-1))


def factory():
    ids = torch.randint(0, 8, (16, 6), generator=torch.Generator().manual_seed(0))
    return Net(), [(ids[i], ids[i]) for i in range(16)], loss
"""


def test_a_forward_that_reads_a_split_weight_is_told_which_and_why(tmp_path, capsys,
                                                                   monkeypatch):
    """A forward that reads its tied embedding's weight itself (``self.embed.weight.mean(0)``)
    gets under tp=2 the vocabulary-split DTensor beside plain activations: one line naming the
    split layers and the fix, exit 2, in place of DTensor's "got mixed torch.Tensor and
    DTensor" traceback."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "reads_embed", raising=False)
    (tmp_path / "reads_embed.py").write_text(_READS_ITS_EMBEDDING)
    code = main(["check", "--plan", "tp=2", "--model", "reads_embed:factory", "--steps", "1",
                 "--timeout", "120"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("Net's forward computed with a weight split over tp=2 beside plain tensors "
            "(aten.add.Tensor got a DTensor and a torch.Tensor): the weights of embed, "
            "blocks.*.up, blocks.*.down are DTensors") in err, err
    assert "Call the layer instead (self.embed(ids))" in err, err
    assert err.strip().splitlines()[-1].startswith("plait check: error: Net's forward"), err


def test_a_sequence_tp_does_not_divide_is_refused_under_sp(capsys):
    """tp=2,sp on the reference model with 15 positions: the ranks refuse the batch at the
    model's input with one line, not abort in a collective whose shards differ in size."""
    code = main(["check", "--plan", "tp=2,sp", "--seq-len", "15", "--steps", "1",
                 "--timeout", "120"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("sequence parallelism splits the sequence over tp=2, but the sequence has 15 "
            "positions; use a multiple of 2 or sp=False") in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, fragment", [
    (["schedule", "--schedule", "nope", "--pp", "2", "-m", "4", "--format", "json"],
     "'nope' is not a schedule"),
    (["check", "--plan", "dp=2", "--format=json", "--bogus"], "unknown argument(s) --bogus"),
    ([*PLAN, "--format", "json", "--top", "x"], "--top 'x' is not a whole number; pass one, "
                                                "e.g. --top 5"),
])
def test_argument_errors_answer_in_json_when_json_is_asked(capsys, argv, fragment):
    """An error argparse itself finds (a bad choice, an unknown flag) is a JSON object on
    stdout too, with the message on stderr as always."""
    import json

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert data == {"event": "error", "error": data["error"], "command": argv[0],
                    "exit_code": 2}
    assert fragment in data["error"] and fragment in out.err


def test_a_scripts_format_json_asks_plait_run_too(capsys):
    """The script's --format json (read by plait.init, as --plan) asks plait run for JSON as
    its own --format does, its argument errors included; a script's --format of another value
    is the script's own flag, not read."""
    import json

    with pytest.raises(SystemExit):
        main(["run", "--nproc", "x", "train.py", "--format", "json"])
    out = capsys.readouterr()
    assert json.loads(out.out)["error"].startswith("--nproc 'x' is not a whole number")
    with pytest.raises(SystemExit):
        main(["run", "--nproc", "x", "train.py", "--format", "parquet"])
    out = capsys.readouterr()
    assert out.out == "" and "--nproc" in out.err


@pytest.mark.parametrize("argv, line", [
    ([*PLAN[:5], "--batch", "abc"],
     "plait plan: error: --global-batch 'abc' is not a whole number; pass one, e.g. "
     "--global-batch 8"),
    (["check", "--plan", "dp=2", "--steps", "x"],
     "plait check: error: --steps 'x' is not a whole number; pass one, e.g. --steps 5"),
    (["check", "--plan", "dp=2", "--optimizer", "adam"],
     "plait check: error: --optimizer 'adam' is not one of adamw, sgd; e.g. --optimizer adamw"),
    (["check", "--plan", "dp=2", "--lr", "fast"],
     "plait check: error: --lr 'fast' is not a number; pass one, e.g. --lr 0.001"),
    (["plan", "--top"], "plait plan: error: --top needs a value, e.g. --top 5"),
    (["check"], "plait check: error: --plan is required; `plait check --help` says what it "
                "takes"),
    (["check", "--plan", "dp=2", "--bogus"],
     "plait check: error: unknown argument(s) --bogus; `plait check --help` lists the flags"),
    (["bench", "nccl"], "plait bench: error: 'nccl' is not a command of plait bench (comm); "
                        "`plait bench --help` says what each does"),
    (["chek", "--plan", "dp=2"], "plait: error: 'chek' is not a command of plait (env, run, "
                                 "check, demo, plan, schedule, comm, bench, export, doctor); "
                                 "did you mean 'check'? `plait --help` says what each does"),
])
def test_argparse_errors_are_one_plait_line(capsys, argv, line):
    """What argparse refuses (a value of the wrong type, a choice not offered, a missing value,
    an unknown flag) is one line naming the flag, the value and a value it takes, under the
    canonical spelling of the flag typed: no usage block, exit code 2."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    out = capsys.readouterr()
    assert out.err.strip() == line and out.out == "", out.err


# Every command (`plait --help` lists them) with a flag it does not take and a value of the
# wrong kind: the line names the full command, `plait bench comm` included.
EVERY_COMMAND = [
    (["env", "--bogus"], "env", "unknown argument(s) --bogus; `plait env --help` lists the flags"),
    (["env", "--format", "x"], "env", "--format 'x' is not one of text, table, json"),
    (["run", "--bogus", "train.py"], "run", "unknown argument(s) --bogus"),
    (["run", "--nproc", "x", "train.py"], "run", "--nproc 'x' is not a whole number"),
    (["run"], "run", "script is required; `plait run --help` says what it takes"),
    (["check", "--plan", "dp=2", "--bogus"], "check", "unknown argument(s) --bogus"),
    (["check", "--plan", "dp=2", "--steps", "x"], "check", "--steps 'x' is not a whole number"),
    (["demo", "--bogus"], "demo", "unknown argument(s) --bogus; `plait demo --help`"),
    (["demo", "--steps", "1.5"], "demo", "--steps '1.5' is not a whole number; pass one, e.g. "
                                         "--steps 300"),
    (["plan", "--bogus"], "plan", "unknown argument(s) --bogus; `plait plan --help`"),
    (["plan", "--memory-gb", "lots"], "plan", "--memory-gb 'lots' is not a number"),
    (["schedule", "--bogus"], "schedule", "unknown argument(s) --bogus"),
    (["schedule", "--pp", "x"], "schedule", "--pp 'x' is not a whole number; pass one, e.g. "
                                            "--pp 4"),
    (["comm", "--plan", "dp=2", "--bogus"], "comm", "unknown argument(s) --bogus"),
    (["comm", "--plan", "dp=2", "--replica-batch", "x"], "comm",
     "--replica-batch 'x' is not a whole number"),
    (["comm", "--plan", "dp=2", "--batch", "4", "--replica-batch", "2"], "comm",
     "--replica-batch and --global-batch set the same thing two ways; give one of them"),
    (["bench"], "bench", "a command is required, one of comm; `plait bench --help` says what "
                         "each does"),
    (["bench", "comm", "--bogus"], "bench comm",
     "unknown argument(s) --bogus; `plait bench comm --help` lists the flags"),
    (["bench", "comm", "--nproc", "x"], "bench comm", "--nproc 'x' is not a whole number"),
    (["bench", "comm", "--backend", "mpi"], "bench comm",
     "--backend 'mpi' is not one of gloo, nccl; e.g. --backend gloo"),
    (["export", "ckpt", "--to", "m.safetensors", "--bogus"], "export",
     "unknown argument(s) --bogus; `plait export --help`"),
    (["export", "ckpt"], "export", "--to is required"),
    (["export"], "export", "checkpoint, --to are required"),
    (["doctor", "--bogus"], "doctor", "unknown argument(s) --bogus; `plait doctor --help`"),
    (["doctor", "--format", "x"], "doctor", "--format 'x' is not one of text, table, json"),
    (["bogus"], "", "'bogus' is not a command of plait (env, run, check"),
    # a flag the command does not take is named, also when a command or a script is missing
    (["bench", "--bogus"], "bench", "unknown argument(s) --bogus; a command is required, one "
                                    "of comm"),
    (["bench", "--ops", "all_reduce"], "bench", "unknown argument(s) --ops; the command comes "
                                                "first, one of comm, then its flags"),
    (["run", "--bogus"], "run", "unknown argument(s) --bogus (not flags of plait run; the "
                                "script's own flags go after the script"),
    (["run", "--nproc", "2", "--bogus=3"], "run", "unknown argument(s) --bogus=3"),
    (["run", "--plan", "dp=2", "train.py"], "run",
     "unknown argument(s) --plan (not flags of plait run; the script's own flags go after the "
     "script: `plait run --nproc 2 train.py --plan dp=2`)"),
    (["run", "--format", "yaml", "train.py"], "run", "--format 'yaml' is not one of text, "
                                                     "table, json"),
    (["demo", "--format", "yaml"], "demo", "--format 'yaml' is not one of text, table, json"),
    (["demo", "--plan"], "demo", "--plan needs a value, e.g. --plan dp=2,tp=2"),
    (["check", "--plan"], "check", "--plan needs a value, e.g. --plan dp=2"),
    (["export", "ckpt", "--to"], "export", "--to needs a value, e.g. --to PATH"),
    (["plan", "--dtype", "int8"], "plan", "--dtype 'int8' is not one of bf16, fp16, fp32"),
    (["schedule", "--schedule", "zb"], "schedule", "'zb' is not a schedule"),
]


@pytest.mark.parametrize("argv, command, fragment", EVERY_COMMAND)
def test_every_commands_argparse_errors_name_the_full_command(capsys, argv, command, fragment):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    out = capsys.readouterr()
    prefix = f"plait {command}: error: " if command else "plait: error: "
    assert out.err.startswith(prefix) and fragment in out.err, out.err
    assert len(out.err.strip().splitlines()) == 1 and out.out == "", out.err


@pytest.mark.parametrize("argv, command, error", [
    (["bench", "comm", "--format", "json", "--bogus"], "bench comm",
     "unknown argument(s) --bogus; `plait bench comm --help` lists the flags"),
    (["bench", "comm", "--format", "json", "--nproc", "x"], "bench comm",
     "--nproc 'x' is not a whole number; pass one, e.g. --nproc 2"),
    (["bogus", "--format", "json"], "bogus", "'bogus' is not a command of plait (env, run, "),
    (["run", "--format", "json", "--bogus"], "run", "unknown argument(s) --bogus (not flags "
                                                    "of plait run"),
    (["demo", "--format", "json", "--steps", "x"], "demo", "--steps 'x' is not a whole number"),
])
def test_a_json_error_names_the_command_that_refused(capsys, argv, command, error):
    with pytest.raises(SystemExit):
        main(argv)
    import json

    data = json.loads(capsys.readouterr().out)
    assert data["command"] == command and data["error"].startswith(error), data


def test_a_bad_value_after_a_good_parse_is_still_one_line(capsys):
    """Values of the right type that are out of range are refused after parsing, as before:
    the two kinds of refusal read alike (one line, exit 2)."""
    assert main(["check", "--plan", "dp=2", "--steps", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "plait check: error: --steps=-1 must be >= 1", err


def test_the_failure_line_names_the_nested_command():
    """A worker's failure or a timeout under `plait bench comm` is said as `plait bench comm:
    failed: ...`: the name is the last parser's, the one the arguments went through."""
    from plait.cli import build_parser, command_parsers

    parser = build_parser()
    for argv, prog in ((["bench", "comm"], "plait bench comm"), (["env"], "plait env"),
                       (["comm", "--plan", "dp=2"], "plait comm")):
        assert command_parsers(parser, parser.parse_args(argv))[-1].prog == prog
