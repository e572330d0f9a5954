"""`plait check` and `plait plan` on models a user brings (``--model pkg.module:factory``):
what a FAIL says, and what a bad factory or model is told.

The factories are written into a temporary folder, as a user's own module sits in their
project; each case runs ``plait.cli.main`` in this process, as the command line does."""

import json
import sys

import pytest
import torch.nn as nn

from plait.cli import main

MODELS = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def loss(out, y):
    return F.cross_entropy(out.reshape(-1, 3), y.reshape(-1))


def net(p=0.0):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(p), nn.Linear(16, 3))


def dropout():
    return net(0.3), Rows(), loss


def swapped():
    return Rows(), net(), loss


def loss_by_name():
    return net(), Rows(), "cross_entropy"


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(Rows()[i] for i in range(16))


def streamed():
    return net(), Stream(), loss


def crashes():
    raise RuntimeError("weights file missing\\nlooked in ./weights and ~/.cache")


class Branches(nn.Module):
    # A branch per batch, by the sign of its first row: the data ranks take different ones
    # (rows 0-1 of each global batch of 4 are positive, rows 2-3 negative).

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x):
        return (self.a if x[0, 0, 0] > 0 else self.b)(x)


class Signs(Rows):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x.abs() * (1 if i % 4 < 2 else -1), y


def branches():
    return Branches(), Signs(), loss


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.n, self.a, self.b = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.b(F.gelu(self.a(self.n(x))))


class WideVocab(nn.Module):
    # The embedding and head hold 97% of the parameters: a pipeline stage's own blocks are a
    # small share of it, beside stand-ins for the other stage's
    def __init__(self, vocab=3000, d=16, n=4):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def wide_vocab():
    ids = torch.randint(0, 3000, (16, 9), generator=torch.Generator().manual_seed(0))
    return WideVocab(), [(r[:-1], r[1:]) for r in ids], lambda out, y: F.cross_entropy(
        out.reshape(-1, out.shape[-1]), y.reshape(-1))
'''


@pytest.fixture
def mine(tmp_path, monkeypatch):
    """``mine.py`` in a fresh directory, imported afresh: ``plait check`` imports the factory
    in this process too, and another test's ``mine`` must not be the one found."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_factory adds the directory
    sys.modules.pop("mine", None)
    (tmp_path / "mine.py").write_text(MODELS)
    yield tmp_path
    sys.modules.pop("mine", None)


def test_a_dropout_model_fails_and_the_report_says_why(mine, capsys):
    """Dropout draws other masks on each data rank than one device draws over the whole batch:
    the FAIL is honest, and the report names the dropout and what to check instead (before:
    the numbers only, which read as a broken layout)."""
    code = main(["check", "--plan", "dp=2", "--model", "mine:dropout", "--steps", "2",
                 "--format", "json", "--timeout", "120"])
    result = json.loads(capsys.readouterr().out)
    assert code == 1 and not result["ok"]
    assert result["random"] == ["1 (Dropout p=0.3)"], result
    assert "draws random numbers while training (1 (Dropout p=0.3))" in result["hint"]
    assert "set dropout to 0 in your factory for the check" in result["hint"]


def test_random_modules_names_dropout_kept_as_a_number():
    """nn.MultiheadAttention (and Hugging Face attentions) keep their dropout as a float."""
    from plait.check import random_modules

    model = nn.Sequential(nn.MultiheadAttention(8, 2, dropout=0.1), nn.Dropout(0.0))
    assert random_modules(model) == ["0.dropout=0.1"]



@pytest.mark.parametrize("spec, fragment", [
    ("mine:swapped", "in that order, got (Rows, Sequential, function): the first item must be "
                     "the nn.Module"),
    ("mine:loss_by_name", "loss_fn is str 'cross_entropy', not a function"),
    ("mine:streamed", "the dataset (Stream) has no len() and dataset[i]"),
])
def test_a_factory_that_returns_the_wrong_parts_is_told_which(mine, capsys, spec, fragment):
    """Each part of (model, dataset, loss_fn) is checked by name (before: "got tuple", "'str'
    object is not callable", "object of type 'Stream' has no len()")."""
    code = main(["check", "--plan", "dp=2", "--model", spec, "--timeout", "60"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert fragment in err and len(err.strip().splitlines()) == 1, err


def test_a_crashing_factory_shows_its_traceback_once_and_one_line(mine, capsys):
    """A factory (or model) that raises an error other than bad input shows the rank's
    traceback once, then one line, and a JSON answer when asked (before: the parent's frames
    around the worker's traceback, printed twice, and nothing on stdout)."""
    code = main(["check", "--plan", "dp=2", "--model", "mine:crashes", "--timeout", "60",
                 "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert json.loads(out)["error"].startswith(
        "failed: rank 0 (RuntimeError: weights file missing)"), out
    assert err.count('mine.py", line') == 1 and err.count("Traceback") == 1, err
    assert err.strip().splitlines()[-1] == ("plait check: failed: rank 0 (RuntimeError: "
                                            "weights file missing); its traceback is above"), err


def test_a_model_tp_cannot_infer_is_told_the_plan_file_that_gives_its_layer_plan():
    """The CLI takes no options in a plan string: the refusal says how to give a layer plan
    there (a plan file), not only Plan(options=...), which a command-line user cannot pass."""
    from plait.parallel.tp_infer import infer_plan

    convnet = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    with pytest.raises(ValueError, match=r"a plan file \(--plan plan.yaml\) holding tp: 2 and "
                                         r"options: \{tp_plan: \{module glob: style\}\}"):
        infer_plan(convnet)


def test_parameters_a_rank_leaves_without_gradients_are_told_find_unused(mine, capsys):
    """Under dp=2 each rank's forward takes another branch: DDP stops at the next step with
    torch's advice to pass find_unused_parameters=True to DDP, which a plait user cannot do.
    Said as plait's fix, the plan's find_unused, with the parameters named."""
    code = main(["check", "--plan", "dp=2", "--model", "mine:branches", "--steps", "2",
                 "--batch-size", "4", "--timeout", "120"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("parameters of Branches (a.weight, a.bias) got no gradient on this rank" in err
            or "parameters of Branches (b.weight, b.bias) got no gradient on this rank" in err), err
    assert "add find_unused to the plan (e.g. 'dp_replicate=2,find_unused')" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_activation_checkpointing_in_a_pipeline_stage_of_a_wide_vocabulary(mine, capsys):
    """Each pipeline stage checkpoints its own blocks, which sit beside stand-ins for the other
    stage's and weigh 3% of a model whose embedding and head hold the rest: a stack all the
    same, not the small mixed container (a U-Net's timestep MLP) checkpointing refuses."""
    code = main(["check", "--plan", "pp=2,microbatches=2,activation_checkpointing=full",
                 "--model", "mine:wide_vocab", "--steps", "2", "--timeout", "120"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "PASS" in out, out
