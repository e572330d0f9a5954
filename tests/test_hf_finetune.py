"""A Hugging Face user's fine-tuning loop under plait equals the same loop on one device.

Causal LMs (Llama with rotary positions, its head untied and tied; GPT-2 with learned positions
and its head tied) and a BERT masked LM, built from tiny configs; dict batches from a collate
function (variable lengths padded right or left, ``attention_mask``, labels -100 on padding
and prompts); the model's own loss (``loss_fn=None``) or a hand-written shifted loss on its
outputs; an LR scheduler; gradient accumulation; ``run.evaluate`` on held-out data after every
step. Workers and the one-device loop: tests/_workers_hf.py.

Tolerance: 1e-6 relative on every step's loss and held-out loss, and on every tensor of the
final state 1e-6 relative to the tensor's largest entry (at least 1e-2): fp32 sums in another
order, nothing more. SGD: Adam turns gradient rounding noise (an attention key bias, whose
gradient is zero in exact arithmetic) into steps of +-lr, so it cannot be held to fp32 level;
one device splitting its own batch in two moves GPT-2's key bias by 2e-4 relative after 3 AdamW
steps.
"""

from __future__ import annotations

import importlib.util

import pytest

from plait.spawn import run_distributed
from tests import _workers_hf as W

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install plait[hf])")

REL, FLOOR = 1e-6, 1e-2


def _assert_matches(ref: dict, got: dict) -> None:
    label = (got["plan"], got["model"])
    for what in ("losses", "evals"):
        for step, (a, b) in enumerate(zip(ref[what], got[what], strict=True)):
            assert abs(a - b) <= REL * abs(a), (*label, what, step, a, b)
    for name, want in ref["state"].items():
        assert name in got["state"], (*label, name, sorted(got["state"]))
        if not want.is_floating_point():
            continue
        diff = (got["state"][name] - want).abs().max().item()
        assert diff <= REL * max(want.abs().max().item(), FLOOR), (*label, name, diff)


def _check(world: int, jobs: list, timeout: float) -> None:
    got = run_distributed(W.finetune, world, jobs, timeout=timeout)[0]
    for (_, model, kw), result in zip(jobs, got, strict=True):
        _assert_matches(W.reference(model, kw), result)


def test_data_parallel_tensor_parallel_and_evaluation_between_steps():
    """Replicated data parallelism over tensor-parallel shards (FSDP2's replicate, which keeps
    the gathered weights after a forward) and ZeRO-2 over them: the blocks' norms, which tensor
    parallelism leaves whole, get their gradient in the step after an evaluation too."""
    jobs = [("dp=2,tp=2", "gpt2", {}),
            ("dp_shard=2,zero=2,tp=2", "llama", {"side": "left"})]
    _check(4, jobs, timeout=300)
