"""A model whose forward takes more than one input (``forward(x, t)``, ``forward(features,
mask)``) laid out without ``example=``: every layout either trains as one device or is
refused before any step in one line naming ``example=``. An inferred tensor-parallel plan the
guessed input cannot run is refused, not used unchecked: one that does not fit the model's
dataflow failed at the first step with torch's "The size of tensor a (8) must match the size
of tensor b (16)", after every parameter was sharded."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.parallel.tensor import tp_refusal
from plait.spawn import run_distributed
from tests import _guess_models as G

FIX = "run.parallelize(model, example=loader.batch(0))"

# (model, plan, fitting, with example=) -> "one device", or a fragment of the refusal.
JOBS: dict[tuple[str, str, bool, bool], str] = {
    ("denoiser", "tp=2", False, False): "plan inferred for Denoiser cannot be checked",
    ("masked", "tp=2", False, False): "plan inferred for MaskedMLP cannot be checked",
    ("masked", "tp=2,sp", True, False): "plan inferred for MaskedMLP cannot be checked",
    ("masked", "tp=2", False, True): "does not fit its dataflow at tp=2",
    ("denoiser", "tp=2", True, True): "one device",
    ("masked", "tp=2", True, True): "one device",
    ("masked", "pp=2", False, False): "one device",
    ("denoiser", "auto", False, False): "one device",
}


def _as_one_device(name: str, fitting: bool, got: dict[str, Any]) -> None:
    want = G.reference(name, fitting)
    assert "losses" in got, got
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6)
    assert got["state"].keys() == want["state"].keys()
    for key, value in want["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_models_of_several_inputs_train_as_one_device_or_are_refused_naming_example() -> None:
    got = run_distributed(G.train, 2, list(JOBS), timeout=300)[0]
    for (job, want), result in zip(JOBS.items(), got, strict=True):
        name, _, fitting, with_example = job
        if want == "one device":
            _as_one_device(name, fitting, result)
            continue
        refused = result.get("refused", "")
        assert want in refused and "\n" not in refused, (job, result)
        assert with_example or FIX in refused, (job, refused)


@pytest.mark.parametrize("name", list(G.MODELS))
def test_the_planner_leaves_out_tensor_parallelism_it_cannot_check(name: str) -> None:
    # plan="auto" asks tp_refusal of each tp it would rank: without the batch the inferred
    # plan is not checked, so tp is left out, said in the refusal's first clause.
    model = G._build(name, False)
    refused = tp_refusal(model, 2, False)
    assert refused is not None and FIX in refused and type(model).__name__ in refused, refused


class _MaskedLM(torch.nn.Module):
    """``forward(input_ids, attention_mask)``, the mask required; with ``counts``, a forward
    that reads its tokens' values (a running count of each token, as some models keep)."""

    def __init__(self, counts: bool = False) -> None:
        super().__init__()
        self.counts = counts
        self.embed = torch.nn.Embedding(11, 8)
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        if self.counts:
            h = h + torch.nn.functional.one_hot(input_ids, 11).sum((0, 1)).float()[:8]
        return self.fc2(torch.relu(self.fc1(h)))


@pytest.mark.parametrize("counts", [False, True])
def test_a_required_attention_mask_is_guessed_beside_the_token_ids(counts: bool) -> None:
    # A forward(input_ids, attention_mask) was guessed token ids alone, and its inferred tp
    # plan refused as unchecked; one that reads its tokens' values (one_hot on fake tensors
    # raises DataDependentOutputException) was guessed them alone too.
    from plait.parallel.tp_example import example_call

    guess = example_call(_MaskedLM(counts))
    assert guess is not None and set(guess.kwargs) == {"input_ids", "attention_mask"}, guess
    ids, mask = guess.kwargs["input_ids"], guess.kwargs["attention_mask"]
    assert mask.shape == ids.shape and bool((mask == 1).all())
