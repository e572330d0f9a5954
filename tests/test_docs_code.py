"""Every code block a page gives runs as written: users copy them.

Each fenced ``python`` block of README.md and docs/*.md runs, and each ``bash``/``sh``/``console``
line that calls ``plait``, ``python`` or ``make``. A block may lean on the names a page takes as
the reader's own (``MyModel``, ``dataset``, ``loss_fn``, the ``run`` and ``model`` of the script
it sits in): the block runs after a stand-in for each name it uses and does not define
(``STAND_INS``, the smallest thing that is such a name), so a block that calls plait wrongly
fails here. ``<!-- docs-code: nproc=N -->`` above a block runs it on N ranks (a pipeline
fragment); the pages need this marker rarely. A ``--8<--`` block is an example file, run by the
page's command that names it.

Short form: ``steps=N`` in a block becomes ``steps=2``; a command's ``--steps``, ``--rounds``,
``--repeat`` and ``--stop-at`` take small values (``SHORT_FLAGS``), and a script that takes
``--steps`` gets ``--steps 3``; the model is the tiny reference one, the ranks those the command
gives. A YAML block that opens with ``# plan.yaml, for `COMMAND``` is written out and COMMAND
run. Python blocks that do not train run by default (ranks forked from plait.spawn's server,
which imported torch once: about a second each), the rest and the commands under ``-m slow``
as real processes, except the few in ``CHEAP``. Commands this machine cannot run (a TPU,
torch-xla, a network install, the reader's own package) are in ``SKIPPED`` with the reason.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from plait.spawn import run_distributed

from ._workers_docs import run_block

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"bash", "sh", "console", "shell"}
FENCE = re.compile(r"^([ \t]*)```[ \t]*([\w+-]*)[^\n]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*docs-code:\s*nproc=(\d+)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str       # README.md or docs/x.md
    line: int       # the fence's line
    lang: str
    code: str       # the body, its list indentation removed
    nproc: int      # ranks it runs on (a marker above the fence; default 1)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> list[Block]:
    out = []
    for path in PAGES:
        text = path.read_text()
        for match in FENCE.finditer(text):
            indent, lang, body = match.groups()
            line = text.count("\n", 0, match.start()) + 1
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.search(before)
            code = "\n".join(s[len(indent):] if s.startswith(indent) else s
                             for s in body.splitlines()) + "\n"
            out.append(Block(str(path.relative_to(ROOT)), line, lang, code,
                             int(marker.group(1)) if marker else 1))
    return out


# -- python blocks ---------------------------------------------------------------------------

# What a page takes as the reader's own, in the order they depend on each other: each is the
# smallest thing that fits (the tiny reference model on Shakespeare). A block gets only the
# names it uses and does not define, and what those need.
STAND_INS: dict[str, str] = {
    "torch": "import torch",
    "nn": "from torch import nn",
    "F": "import torch.nn.functional as F",
    "plait": "import plait",
    "cfg": "from plait.models.transformer import preset\ncfg = preset('tiny')",
    # The reader's model: the tiny reference transformer, with a greedy generate of its own.
    "MyModel": "from plait.models.transformer import Transformer\n"
               "class MyModel(Transformer):\n"
               "    def __init__(self, config=cfg):\n"
               "        super().__init__(config)\n"
               "    def generate(self, ids, max_new_tokens):\n"
               "        for _ in range(max_new_tokens):\n"
               "            ids = torch.cat([ids, self(ids)[:, -1:].argmax(-1)], dim=1)\n"
               "        return ids",
    "build_model": "def build_model():\n    return MyModel(cfg)",
    "prompt": "prompt = torch.tensor([list(b'ROMEO:')])",
    "dataset": "from plait.data import TextDataset\n"
               "dataset = torch.utils.data.Subset(TextDataset(seq_len=32), range(256))",
    "val_set": "from plait.data import TextDataset\n"
               "val_set = torch.utils.data.Subset(TextDataset(seq_len=32), range(256, 288))",
    "loss_fn": "from plait.models.transformer import lm_loss as loss_fn",
    "run": "run = plait.init()",
    "rank": "rank = run.rank",
    "plan": "plan = run.plan",
    "mesh": "mesh = run.mesh",
    "model": "model = run.parallelize(MyModel(cfg))",
    "opt": "opt = torch.optim.AdamW(model.parameters(), lr=3e-4)",
    "scheduler": "scheduler = torch.optim.lr_scheduler.ConstantLR(opt)",
    "epochs": "epochs = 1",
    "batch_size": "batch_size = 8",
    "seq": "seq = 32",
    "loader": "loader = run.loader(dataset, batch_size=batch_size, steps=2)",
    "train_step": "def train_step(batch):\n    return run.step(model, batch, loss_fn, opt)",
}
# Files a block reads, made in its folder first (the reader's own data).
FILES: dict[str, str] = {
    "tokens.pt": "from plait.data import TextDataset\n"
                 "torch.save(TextDataset(seq_len=32).tokens[:20_000].clone(), 'tokens.pt')",
}
# The short form: the same calls, fewer steps.
SHORT = [(re.compile(r"\bsteps=[\d_]+"), "steps=2"), (re.compile(r"\bstep == \d+"), "step == 2")]


def _free_names(code: str) -> set[str]:
    """Names ``code`` reads that it never binds (assignment, def, class, import, argument)."""
    tree = ast.parse(code)
    read, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
    return read - bound - set(dir(builtins))


def program(code: str) -> str:
    """``code`` in its short form, after the stand-ins for the names it takes as given."""
    for pattern, short in SHORT:
        code = pattern.sub(short, code)
    wanted, todo = set(), _free_names(code)
    while todo:
        name = todo.pop()
        if name in STAND_INS and name not in wanted:
            wanted.add(name)
            todo |= _free_names(STAND_INS[name])
    unknown = _free_names(code) - set(STAND_INS)
    assert not unknown, f"the block uses {sorted(unknown)}, defined neither in it nor in STAND_INS"
    prelude = [STAND_INS[name] for name in STAND_INS if name in wanted]
    files = [make for name, make in FILES.items() if name in code]
    if files and "torch" not in wanted:
        prelude.insert(0, STAND_INS["torch"])
    return "\n".join([*prelude, *files, code])


# A block that trains (or plans a large cluster) takes seconds on a shared CPU: it runs under
# -m slow, except README's, the script every reader starts from.
TRAINS = re.compile(r"\.step\(|\.backward\(|plan_model\(|auto_plan\(|run\.loader\(")
PYTHON = [b for b in blocks() if b.lang == "python" and not b.code.startswith("--8<--")]


def _cost(block: Block, cheap: bool) -> object:
    return block if cheap else pytest.param(block, marks=pytest.mark.slow)


@pytest.mark.parametrize("block", [
    _cost(b, b.page == "README.md" or not TRAINS.search(program(b.code))) for b in PYTHON],
    ids=[b.where for b in PYTHON])
def test_python_block_runs(block, tmp_path):
    run_distributed(run_block, block.nproc, program(block.code), block.where, str(tmp_path),
                    timeout=300)


# -- commands --------------------------------------------------------------------------------

# Commands this machine cannot run, each with why (a pattern on the command as written).
SKIPPED: list[tuple[str, str]] = [
    (r"^make (demo|test)\b", "creates .venv with pip (a network install); what it then runs, "
                              "`plait demo` and the suite, runs here (tests/test_cli*.py)"),
    (r"^make bench-env|^\.venv-bench/", "installs HF Accelerate and Lightning Fabric (network)"),
    (r"^pip install", "a network install"),
    (r"^export ", "sets a variable for the lines after it (the TPU page's, skipped with them)"),
    (r"mypkg\.models|my-cluster\.yaml", "the reader's own package and cluster file"),
    (r"--accelerator (xla|tpu)\b", "needs a TPU or torch-xla (.venv-xla: `make test-xla` runs "
                                   "examples/tpu.py on the XLA CPU device)"),
]
# Files a command names that are the reader's own, made in its folder first.
COMMAND_FILES: dict[str, str] = {
    "meta-llama/config.json": '{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": '
                              '32, "num_attention_heads": 32, "num_key_value_heads": 8, '
                              '"intermediate_size": 14336, "vocab_size": 128256, '
                              '"max_position_embeddings": 8192}',
}
# The commands the default run takes (seconds each); the others run under -m slow.
CHEAP = {"plait env"}
# Flags whose value the short form replaces, and the scripts' --steps when a script takes one.
SHORT_FLAGS = {"--steps": "3", "--rounds": "1", "--repeat": "1", "--reps": "1",
               "--stop-at": "2"}
PROGRAMS = {"plait", "python", "make"}


@dataclass(frozen=True)
class Command:
    block: Block
    text: str                    # as the page writes it (continuations joined)
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]
    stdout: str | None           # a `> file` redirection
    file: tuple[str, str] | None = None  # (name, text): a plan file the page gives with it

    @property
    def skipped(self) -> str | None:
        return next((why for pattern, why in SKIPPED if re.search(pattern, self.text)), None)


# A YAML block that opens with `# plan.yaml, for `plait run ... --plan plan.yaml`` is a file and
# the command that reads it.
PLAN_FILE = re.compile(r"# (\S+\.ya?ml), for `([^`]+)`")


def commands() -> list[Command]:
    out = []
    for block in blocks():
        named = PLAN_FILE.match(block.code) if block.lang == "yaml" else None
        if named:
            out.append(Command(block, named.group(2), (), tuple(shlex.split(named.group(2))),
                               None, (named.group(1), block.code)))
        if block.lang not in SHELLS:
            continue
        for line in block.code.replace("\\\n", " ").splitlines():
            text = re.sub(r"\s+#.*", "", line).strip()
            if not text:
                continue
            words = shlex.split(re.sub(r"\s\[[^\]]*\]", "", text))  # drop [--optional parts]
            env = []
            while words and re.match(r"^[A-Z_]+=", words[0]):
                env.append(tuple(words.pop(0).split("=", 1)))
            stdout = None
            if ">" in words:
                at = words.index(">")
                stdout, words = words[at + 1], words[:at]
            if words and (words[0] in PROGRAMS or words[0].endswith("/python")
                          or words[0] in ("pip", "export")):
                out.append(Command(block, text, tuple(env), tuple(words), stdout))
    return out


def _script_of(block: Block) -> str:
    """The ``train.py`` a command runs: the page's last python block above it that starts a run,
    else README's (the script every page's ``train.py`` refers to)."""
    def starts_run(b: Block) -> bool:
        return "plait.init(" in b.code and b.nproc == 1

    above = [b for b in PYTHON if b.page == block.page and b.line < block.line and starts_run(b)]
    readme = [b for b in PYTHON if b.page == "README.md" and starts_run(b)]
    return program((above or readme)[-1].code)


def _short(argv: tuple[str, ...], folder: Path) -> list[str]:
    """The command's short form: fewer steps, rounds and repeats; python and plait as this
    interpreter."""
    words = list(argv)
    for i, word in enumerate(words[:-1]):
        if word in SHORT_FLAGS:
            words[i + 1] = SHORT_FLAGS[word]
    script = next((w for w in words if w.endswith(".py")), None)
    takes_steps = (words[:2] == ["plait", "check"]
                   or (script is not None and (folder / script).exists()
                       and '"--steps"' in (folder / script).read_text()))
    if takes_steps and "--steps" not in words:
        words += ["--steps", SHORT_FLAGS["--steps"]]
    if words[0] == "plait":
        return [sys.executable, "-m", "plait.cli", *words[1:]]
    return [sys.executable, *words[1:]]


def _run_commands(chosen: list[Command], folder: Path) -> None:
    (folder / "examples").symlink_to(ROOT / "examples")
    (folder / "bench").symlink_to(ROOT / "bench")
    for name, text in COMMAND_FILES.items():
        if any(name in command.argv for command in chosen):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
    for command in chosen:
        if command.file:
            (folder / command.file[0]).write_text(command.file[1])
        if "train.py" in command.argv and not (folder / "train.py").exists():
            # seeded, so that a command's run is the same every time (the script would
            # otherwise draw a new seed, and data order, per run, as on one device)
            (folder / "train.py").write_text("import torch\ntorch.manual_seed(0)\n"
                                             + _script_of(command.block))
        env = {**os.environ, **dict(command.env), "PYTHONPATH": str(ROOT)}
        done = subprocess.run(_short(command.argv, folder), cwd=folder, env=env, text=True,
                              capture_output=True, timeout=600)
        assert done.returncode == 0, (f"{command.block.where}: {command.text}\n"
                                      + done.stdout[-3000:] + done.stderr[-3000:])
        if command.stdout:
            (folder / command.stdout).write_text(done.stdout)
            if command.stdout.endswith(".jsonl"):  # JSON Lines: every line strict JSON
                [json.loads(line) for line in done.stdout.splitlines()]


COMMANDS = commands()
BY_BLOCK: dict[Block, list[Command]] = {}
for _command in COMMANDS:
    if not _command.skipped:
        BY_BLOCK.setdefault(_command.block, []).append(_command)


@pytest.mark.parametrize("block", [
    _cost(b, all(c.text in CHEAP for c in cs)) for b, cs in BY_BLOCK.items()],
    ids=[b.where for b in BY_BLOCK])
def test_commands_run(block, tmp_path):
    """A block's commands in order, in one folder (a later one may resume an earlier one's
    checkpoint)."""
    _run_commands(BY_BLOCK[block], tmp_path)


def test_what_is_skipped_is_said():
    """Every command is run or skipped with a reason; the list stays small and names no
    command the pages dropped."""
    skipped = [c for c in COMMANDS if c.skipped]
    assert len(skipped) <= 16, [c.text for c in skipped]
    for pattern, _ in SKIPPED:
        assert any(re.search(pattern, c.text) for c in COMMANDS), f"{pattern} skips nothing"


def test_every_example_a_page_embeds_is_run_by_a_command_on_it():
    """A ``--8<-- "examples/x.py"`` block is the example itself: a command on the same page
    runs it (or is in SKIPPED, with why), so the code the reader sees is the code that ran."""
    for block in blocks():
        embedded = re.match(r'--8<-- "(examples/[\w.]+)"', block.code)
        if embedded:
            assert any(embedded.group(1) in c.argv for c in COMMANDS
                       if c.block.page == block.page), block.where


def _streams() -> list[Block]:
    return [b for b in PYTHON if re.search(r"^\s+def iter_from\(", b.code, re.M)]


@pytest.mark.parametrize("block", _streams(), ids=[b.where for b in _streams()])
def test_a_stream_a_page_defines_resumes(block, tmp_path, monkeypatch):
    """A dataset class a page gives with ``iter_from(position)`` (the seek protocol: plait calls
    it on resume and for each data replica but the first) yields from there what a pass from
    the start yields, and nothing past the end: the block's own first call of the class builds
    it."""
    tree = ast.parse(block.code)
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    name = next(c.name for c in classes if any(
        isinstance(f, ast.FunctionDef) and f.name == "iter_from" for f in c.body))
    call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name) and node.func.id == name)
    code = ast.unparse(ast.Module(body=classes, type_ignores=[]))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(program(f"{code}\ndataset = {ast.unparse(call)}"), namespace)
    dataset = namespace["dataset"]
    whole = list(iter(dataset))
    assert len(whole) > 3
    for position in (0, 3, len(whole) - 1, len(whole), len(whole) + 5):
        again = list(dataset.iter_from(position))
        assert len(again) == max(len(whole) - position, 0), (block.where, position)
        for (x, y), (wx, wy) in zip(again, whole[position:], strict=True):
            assert torch.equal(x, wx) and torch.equal(y, wy)
