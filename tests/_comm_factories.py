"""``(model, dataset, loss_fn)`` factories for ``plait comm --model pkg.module:function``
(tests/test_comm_factory.py): models written for the tests, not plait's reference transformer,
on token rows drawn per index.

* ``mlp_lm``: tests/_traffic_models.py's stack of pre-norm MLP blocks (embedding, 4 blocks,
  norm, untied head), whose tensor-parallel and data-parallel traffic the ledger predicts
  exactly;
* ``lstm_lm``: tests/_any_models.py's LSTM language model, whose tensor-parallel traffic the
  ledger has no closed form for (its notes say why);
* ``few_rows``: the MLP model on a dataset of 3 rows, fewer than one global batch;
* ``missing_data``: a factory that raises reading a data file that does not exist.
"""

from __future__ import annotations

from typing import Any

import torch

from tests._any_models import LSTMLM, Tokens, next_token
from tests._traffic_models import VOCAB, MLPBlock, StackLM


def mlp_lm() -> tuple[torch.nn.Module, Any, Any]:
    return StackLM(MLPBlock), Tokens(n=64, length=8, vocab=VOCAB), next_token


def lstm_lm() -> tuple[torch.nn.Module, Any, Any]:
    return LSTMLM(vocab=VOCAB), Tokens(n=64, length=8, vocab=VOCAB), next_token


def few_rows() -> tuple[torch.nn.Module, Any, Any]:
    return StackLM(MLPBlock), Tokens(n=3, length=8, vocab=VOCAB), next_token


def missing_data() -> tuple[torch.nn.Module, Any, Any]:
    rows = torch.load("/nonexistent/plait-comm-rows.pt")
    return StackLM(MLPBlock), rows, next_token


def finish_comm(rank: int, world_size: int, plan: str, factory: str, global_batch: int,
                warmup: int, steps: int) -> dict[str, Any]:
    """One rank of the training loop a user writes around a factory, with the ledger on:
    ``run.finish()``'s communication table as data (what ``plait comm --model`` must print)."""
    import importlib

    import plait

    torch.set_num_threads(1)
    run = plait.init(plan, ledger=True, quiet=True, seed=0)
    run.ledger_warmup = warmup
    module, _, name = factory.partition(":")
    torch.manual_seed(run.seed)
    model, dataset, loss_fn = getattr(importlib.import_module(module), name)()
    loader = run.loader(dataset, batch_size=global_batch, steps=warmup + steps)
    model = run.parallelize(model, example=loader.batch(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in loader:
        run.step(model, batch, loss_fn, opt)
    comm: dict[str, Any] = run.finish(print_summary=False)["comm"]
    return comm
