"""`plait check` under AdamW on tensors whose gradient is zero in exact arithmetic.

An attention key bias gets a gradient that cancels exactly (softmax ignores a shift shared by
every key), so fp32 leaves rounding noise of 1e-11 of a real gradient; AdamW turns that noise
into steps of the noise's sign, differently on each layout. The check judges such a tensor by
how far AdamW's steps can take two runs apart, and requires the layout's gradient of it to be
noise too. Stock BERT and ViT (Hugging Face, built from a config) pass with AdamW; a layout
bug (gradients summed over the data ranks instead of averaged) fails, and says the gradients
differ."""

import json
import sys

import pytest
import torch

from plait.check import adam_reach, compare
from plait.cli import main
from plait.plan import Plan

pytest.importorskip("transformers")

MODELS = '''
import torch
from torch.utils.data import Dataset


class Tokens(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 128, (16,), generator=g),
                "labels": torch.randint(0, 3, (), generator=g)}


class Images(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"pixel_values": torch.randn(3, 16, 16, generator=g),
                "labels": torch.randint(0, 3, (), generator=g)}


def bert():
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg), Tokens(), None


def vit():
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, num_labels=3,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(cfg), Images(), None


def bert_summed():
    """BERT under a layout bug: each rank's gradients are scaled as if one rank's were the
    global mean, so the data ranks' gradients add up instead of averaging."""
    import torch.distributed as dist
    import plait.train

    if dist.is_initialized() and dist.get_world_size() > 1:
        scale = plait.train.scale_gradients
        plait.train.scale_gradients = lambda params, factor: scale(params, factor * 2)
    return bert()
'''


@pytest.fixture
def hf(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    sys.modules.pop("hfmodels", None)
    (tmp_path / "hfmodels.py").write_text(MODELS)
    yield tmp_path
    sys.modules.pop("hfmodels", None)


def _check(capsys, plan: str, model: str) -> tuple[int, dict]:
    code = main(["check", "--plan", plan, "--model", f"hfmodels:{model}", "--steps", "3",
                 "--batch-size", "4", "--timeout", "200", "--format", "json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_stock_bert_passes_tp2_with_adamw(hf, capsys):
    """tp=2 rounds the key bias's cancelling sum differently from one device: its noise
    gradients differ, AdamW steps them apart, and the displacement rule failed it."""
    code, got = _check(capsys, "tp=2", "bert")
    assert code == 0 and got["ok"], got
    assert got["noise_gradients"] == [f"bert.encoder.layer.{i}.attention.self.key.bias"
                                      for i in range(2)], got
    assert 0 < got["max_noise_rel"] <= 1 and not got["real_gradient"], got
    assert got["max_grad_rel"] < 1e-4, got


@pytest.mark.slow
def test_summed_gradients_fail_with_adamw_and_say_so(hf, capsys):
    code, got = _check(capsys, "dp=2", "bert_summed")
    assert code == 1 and not got["ok"], got
    assert got["max_grad_rel"] > 0.5, got
    assert got["hint"].startswith("the gradients differ before the optimizer step"), got


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["dp_shard=2,zero=3", "pp=2"])
def test_stock_vit_and_bert_pass_with_adamw(hf, capsys, plan):
    """ViT's key biases under ZeRO-3 (its noise differs from one device's); BERT cut into two
    pipeline stages (each stage records its own gradients; the check pools them)."""
    code, got = _check(capsys, plan, "vit" if "zero" in plan else "bert")
    assert code == 0 and got["ok"], got
    assert len(got["noise_gradients"]) == 2, got


def _sides(b_par: torch.Tensor, b_norm_par: float) -> tuple[dict, dict]:
    """A reference where ``w`` has a real gradient and ``b`` rounding noise, and a layout's
    run that matches ``w`` and holds ``b_par`` after a gradient of norm ``b_norm_par``."""
    w0, b0 = torch.full((64, 64), 0.02), torch.zeros(64)
    reference = {"state": {"w": w0 - 1e-3, "b": b0 + 3e-4}, "initial": {"w": w0, "b": b0},
                 "losses": [1.0], "grad_norms": {"w": [1.0], "b": [1e-12]}}
    parallel = {"state": {"w": w0 - 1e-3, "b": b_par}, "losses": [1.0],
                "grad_norms": {"w": [1.0], "b": [b_norm_par]}}
    return reference, parallel


def test_a_noise_gradient_tensor_is_held_to_adamws_reach():
    plan = Plan.from_string("dp=2")
    reach = adam_reach(1e-3, 1)
    assert reach == pytest.approx(2e-3)
    # Noise on both sides, AdamW's first steps of opposite signs: a full 2 x lr apart.
    noise = compare(plan, *_sides(torch.full((64,), -1e-3 + 3e-4), 1e-12), 1, None, "adamw")
    assert noise.ok and noise.noise_gradients == ["b"], noise.format()
    assert "held to the 2.0e-03 per entry" in noise.format()
    # Without gradients recorded, the displacement rule fails it (what the check did before).
    reference, parallel = _sides(torch.full((64,), -1e-3 + 3e-4), 1e-12)
    del reference["grad_norms"], parallel["grad_norms"]
    assert not compare(plan, reference, parallel, 1, None, "adamw").ok
    # Farther apart than any noise can take them: FAIL, named.
    far = compare(plan, *_sides(torch.full((64,), 5e-3), 1e-12), 1, None, "adamw")
    assert not far.ok and far.worst_noise == "b" and far.max_noise_rel > 1, far.format()
    # The layout gives it a real gradient (above GRAD_NOISE of the model's per entry): FAIL.
    real = compare(plan, *_sides(torch.full((64,), 3e-4), 1e-3), 1, None, "adamw")
    assert not real.ok and real.real_gradient == ["b"], real.format()
    assert "the layout gives b a gradient where one device's is zero" in real.format()
    # SGD's update is linear in the gradient: the displacement rule holds, no exception.
    sgd = compare(plan, *_sides(torch.full((64,), -1e-3 + 3e-4), 1e-12), 1, None, "sgd")
    assert not sgd.ok and not sgd.noise_gradients


def test_adam_reach_bounds_adamw_on_noise():
    """Two real AdamW runs on gradients of pure noise (any sign, any size, each run its own)
    end no farther apart, per entry, than adam_reach says, and the first step reaches it."""
    steps, lr = 5, 1e-3
    g = torch.Generator().manual_seed(0)
    params = [torch.zeros(4096, requires_grad=True) for _ in range(2)]
    opts = [torch.optim.AdamW([p], lr=lr, weight_decay=0.0, eps=1e-30) for p in params]
    for _ in range(steps):
        for p, opt in zip(params, opts, strict=True):
            size = 10.0 ** torch.randint(-12, -6, (4096,), generator=g)
            p.grad = torch.randn(4096, generator=g) * size
            opt.step()
    apart = (params[0] - params[1]).abs().max().item()
    assert 0.5 * adam_reach(lr, steps) < apart <= adam_reach(lr, steps) * (1 + 1e-6)
    assert adam_reach(lr, steps) / (2 * lr * steps) == pytest.approx(1.0, abs=0.01)


def test_a_fail_whose_gradients_differ_says_so_not_noise():
    """Where the gradients themselves differ before the step, the hint says the layout
    computes other gradients (not that AdamW may have scaled noise up)."""
    plan = Plan.from_string("dp=2")
    w0 = torch.full((64, 64), 0.02)
    reference = {"state": {"w": w0 - 1e-3}, "initial": {"w": w0}, "losses": [1.0],
                 "grad_norms": {"w": [1.0]}}
    parallel = {"state": {"w": w0 - 1.1e-3}, "losses": [1.0], "grad_norms": {"w": [2.0]}}
    summed = compare(plan, reference, parallel, 1, None, "adamw")
    assert not summed.ok and summed.max_grad_rel == pytest.approx(1.0), summed.format()
    assert summed.hint.startswith("the gradients differ before the optimizer step (w: "), summed
    parallel["grad_norms"] = {"w": [1.0 + 1e-6]}
    noisy = compare(plan, reference, parallel, 1, None, "adamw")
    assert "rerun with --optimizer sgd" in noisy.hint, noisy.format()
