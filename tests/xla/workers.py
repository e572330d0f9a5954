"""The XLA test cases, each run in a fresh process (``python -m tests.xla.workers CASE``).

A process has one XLA runtime: its device count (``CPU_NUM_DEVICES``) and SPMD mode are fixed
when it starts, so the single-device cases and the 4-device SPMD cases run in separate
processes. Each case prints one JSON line (``RESULT {...}``) that the tests read.

The XLA run goes first in every process: the autograd engine sizes its per-device queues at the
first backward pass, and an XLA backward after a CPU one finds no queue for the XLA device.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import plait
from plait.data import TextDataset
from plait.diagnostics.xla import XLADiagnosticError
from plait.models.transformer import build, lm_loss
from plait.parallel.units import canonical_name

SPMD_PLANS = ("dp_replicate=4", "dp_shard=4,zero=3", "tp=4", "dp_shard=2,zero=3,tp=2",
              "dp_replicate=2,dp_shard=2,zero=3")
STEPS = 3


class TwoLayer(nn.Module):
    """A model written for these tests: an MLP regressor with a user TP plan."""

    def __init__(self, width: int = 32, special: bool = False) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.up = nn.Linear(8, width)
        self.down = nn.Linear(width, 4)
        self.special = special

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x))
        if self.special:  # digamma has no XLA lowering: it falls back to the CPU
            h = h + torch.special.digamma(h.abs() + 1.0) * 0.01
        return self.down(h)


class Regression(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x[:, :4] * 2 - self.x[:, 4:]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _canonical(name: str) -> str:
    return name.replace("_orig_module.", "")


def train(accelerator: str, plan: str | None, model: nn.Module, dataset, loss_fn, *,
          batch: int = 8, steps: int = STEPS, batches=None, strict: bool = False,
          held_out=None) -> dict:
    """Train under plait; losses of every step and the final parameters (on the CPU); with
    ``held_out``, its ``run.evaluate`` loss after training."""
    run = plait.init(plan, accelerator=accelerator, quiet=True, log_every=1, strict=strict, seed=0)
    model = run.parallelize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    source = batches if batches is not None else run.loader(dataset, batch_size=batch,
                                                             steps=steps)
    losses, error = [], None
    try:
        for b in source:
            losses.append(float(run.step(model, b, loss_fn, opt)))
    except XLADiagnosticError as exc:
        error = str(exc)
    evaluated = None if held_out is None else float(run.evaluate(model, held_out, loss_fn))
    params = {_canonical(n): p.detach().cpu() for n, p in model.named_parameters()}
    info = run.finish(print_summary=False)
    return {"losses": losses, "params": params, "xla": info.get("xla"), "error": error,
            "evaluated": evaluated}


def _compare(got: dict, ref: dict) -> dict:
    diffs = {n: float((got["params"][n] - p).abs().max()) for n, p in ref["params"].items()}
    return {"losses": got["losses"], "ref_losses": ref["losses"],
            "max_param_diff": max(diffs.values()), "params": len(diffs),
            "missing": sorted(set(ref["params"]) - set(got["params"])),
            "evaluated": got["evaluated"], "ref_evaluated": ref["evaluated"]}


def _text():
    return TextDataset(seq_len=16)


def case_single() -> dict:
    """One XLA device vs eager CPU: the reference transformer and a test-written model."""
    out = {}
    xla = train("xla", None, build("test"), _text(), lm_loss)
    out["transformer"] = _compare(xla, train("cpu", None, build("test"), _text(), lm_loss))
    out["transformer"]["findings"] = xla["xla"]["findings"]
    xla = train("xla", None, TwoLayer(), Regression(), F.mse_loss, steps=6)
    cpu = train("cpu", None, TwoLayer(), Regression(), F.mse_loss, steps=6)
    out["mlp"] = _compare(xla, cpu)
    out["mlp"]["report"] = {k: v for k, v in xla["xla"].items() if k != "per_step"}
    return out


def case_terms_single() -> dict:
    """A loss of two terms (:func:`token_terms`) on one XLA device, with and without
    grad_accum, vs one eager CPU."""
    held = pad([Sentences(8)[i] for i in range(8)])
    xla = {name: train_user("xla", plan, TiedLM, Sentences(), token_terms, collate_fn=pad,
                            held_out=held)
           for name, plan in (("terms", None), ("terms, grad_accum=2", {"grad_accum": 2}))}
    ref = train_user("cpu", None, TiedLM, Sentences(), token_terms, collate_fn=pad,
                     held_out=held)
    return {name: _compare_user(got, ref) for name, got in xla.items()}


def case_diagnostics() -> dict:
    """Each diagnostic firing on a model made to trigger it, on one XLA device."""
    out = {}
    # A DataLoader without drop_last: 20 rows in batches of 8 leave a last batch of 4.
    loader = torch.utils.data.DataLoader(Regression(20), batch_size=8, shuffle=False)
    batches = [b for _ in range(2) for b in loader]
    out["partial"] = train("xla", None, TwoLayer(), None, F.mse_loss, batches=batches)["xla"]
    # The sequence length growing mid-run (steps 4-5): a new shape, not a short batch.
    seqs = [(torch.randn(4, 6 + 2 * (k >= 3), 8), torch.randn(4, 6 + 2 * (k >= 3), 4))
            for k in range(5)]
    out["shape"] = train("xla", None, TwoLayer(), None, F.mse_loss, batches=seqs)["xla"]
    steady = [(torch.randn(4, 6, 8), torch.randn(4, 6, 4)) for _ in range(5)]
    out["steady"] = train("xla", None, TwoLayer(), None, F.mse_loss, batches=steady)["xla"]
    out["fallback"] = train("xla", None, TwoLayer(special=True), Regression(), F.mse_loss,
                            steps=4)["xla"]

    def loss_with_item(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(pred, target)
        if loss.item() > 1e6:  # a host read inside the step
            print("diverged")
        return loss

    out["host_sync"] = train("xla", None, TwoLayer(), Regression(), loss_with_item,
                             steps=4)["xla"]
    strict = train("xla", None, TwoLayer(), Regression(), loss_with_item, steps=4, strict=True)
    out["strict"] = {"error": strict["error"], "steps_run": len(strict["losses"])}
    return out


def case_spmd() -> dict:
    """4 XLA devices under SPMD, one plan at a time, vs the eager CPU reference."""
    runs = {plan: train("xla", plan, build("test"), _text(), lm_loss) for plan in SPMD_PLANS}
    mlp_plan = {"dp_replicate": 2, "tp": 2,
                "options": {"tp_plan": {"up": "colwise", "down": "rowwise"}}}
    held_out = (torch.randn(8, 8, generator=torch.Generator().manual_seed(7)),
                torch.randn(8, 4, generator=torch.Generator().manual_seed(8)))
    mlp = train("xla", mlp_plan, TwoLayer(), Regression(), F.mse_loss, steps=4,
                held_out=held_out)
    ref = train("cpu", None, build("test"), _text(), lm_loss)
    out = {plan: _compare(got, ref) for plan, got in runs.items()}
    out["mlp dp_replicate=2,tp=2"] = _compare(
        mlp, train("cpu", None, TwoLayer(), Regression(), F.mse_loss, steps=4,
                   held_out=held_out))
    return out


def case_all_reduce() -> dict:
    """What ``run.all_reduce`` says under SPMD (4 XLA devices, one process), with ``sliced``
    left out and given: {sliced: the message, or "summed"}."""
    run = plait.init("dp_replicate=4", accelerator="xla", quiet=True)
    said = {}
    for sliced in (None, True, False):
        try:
            run.all_reduce(torch.ones(2), sliced=sliced)
            said[str(sliced)] = "summed"
        except ValueError as exc:
            said[str(sliced)] = str(exc)
    run.finish(print_summary=False)
    return said


# ------------------------------------------------------------------ models users bring
V, S = 32, 8  # vocabulary, longest sequence


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class TiedLM(nn.Module):
    """A language model whose output head is its embedding (one parameter, two names), reading
    an attention mask."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(V, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, V, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) * attention_mask.unsqueeze(-1).to(torch.float32)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Sentences(torch.utils.data.Dataset):
    """Rows of 1..S tokens: a collate_fn pads them (labels -100), so rows count different
    numbers of real tokens and a wrongly normalised loss shows."""

    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, V, (n, S), generator=g)
        self.lens = torch.randint(1, S + 1, (n,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i, :self.lens[i]]


def pad(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    labels = torch.where(mask.bool(), (ids * 7 + 3) % V, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)


def token_loss_shifted(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A causal LM's loss that shifts the labels itself: each row's first label is never read,
    so the mean is over one label fewer per row than the targets count."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


class OwnLossLM(TiedLM):
    """A causal LM that computes its own loss in forward, shifting the labels by one (as Hugging
    Face models do), under a class name plait does not know: ``loss_fn=None``."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = super().forward(input_ids, attention_mask)
        return {"loss": token_loss_shifted(logits, labels), "logits": logits}


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor):
    total = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total, (labels != -100).sum()


def token_terms(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    """A loss of two terms, each over its own count: the cross-entropy over the labelled
    tokens and a z-loss (the squared log-partition, weighted 0.1) over every position,
    padding included."""
    flat, y = logits.reshape(-1, V), labels.reshape(-1)
    ce = F.cross_entropy(flat, y, ignore_index=-100, reduction="sum")
    z = flat.logsumexp(-1).pow(2)
    return {"ce": (ce, (y != -100).sum()), "z": (0.1 * z.sum(), z.numel())}


class LoRALinear(nn.Module):
    def __init__(self, n_in: int, n_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(n_in, n_out)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, n_in) * 0.1)
        self.b = nn.Parameter(torch.randn(n_out, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


class LoRA(nn.Module):
    """Frozen base weights, trainable low-rank adapters (only they go to the optimizer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.layers = nn.ModuleList([LoRALinear(8, 32), LoRALinear(32, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](F.gelu(self.layers[0](x)))


class Normed(nn.Module):
    """BatchNorm's running statistics and an EMA buffer, both updated in forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.fc1 = nn.Linear(8, 32, bias=False)  # BatchNorm follows: a bias has no gradient
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 4)
        self.register_buffer("ema", torch.zeros(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return self.fc2(F.relu(self.bn(h)))


def train_user(accelerator: str, plan, make, dataset, loss_fn, *, steps: int = 4,
               collate_fn=None, held_out=None) -> dict:
    """Train a user's model under plait (only the parameters that require a gradient go to
    the optimizer); every step's loss, ``run.full_state_dict`` (parameters and buffers) after
    training, and ``run.evaluate`` of ``held_out``."""
    run = plait.init(plan, accelerator=accelerator, quiet=True, log_every=1, seed=0)
    model = run.parallelize(make())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = [float(run.step(model, b, loss_fn, opt)) for b in run.loader(
        dataset, batch_size=8, steps=steps, collate_fn=collate_fn)]
    evaluated = None if held_out is None else float(run.evaluate(model, held_out, loss_fn))
    state = run.full_state_dict(model)
    findings = None
    info = run.finish(print_summary=False)
    if accelerator == "xla":
        findings = info["xla"]["findings"]
    return {"losses": losses, "state": state, "evaluated": evaluated, "findings": findings}


def _compare_user(got: dict, ref: dict) -> dict:
    """What the tests check: losses, the evaluated loss, and every tensor of the full state
    (names as the one-device model's ``state_dict``) against the one-CPU run."""
    one_device = ref["state"]
    diffs = {n: float((got["state"][n].float() - t.float()).abs().max())
             for n, t in one_device.items() if n in got["state"]}
    return {"losses": got["losses"], "ref_losses": ref["losses"],
            "evaluated": got["evaluated"], "ref_evaluated": ref["evaluated"],
            "names": sorted(got["state"]), "ref_names": sorted(one_device), "diffs": diffs,
            "findings": got["findings"]}


USER_RUNS = {
    # name: (plan, model, dataset, loss, collate_fn, held out)
    # the loss shifts the labels and grad_accum splits each batch: the micro-batches are
    # weighted by the labels the loss reads, a question plait answers on the device on XLA
    "tied lm, dict batches, masked shifted loss, grad_accum=2": (
        {"dp_shard": 2, "zero": 3, "tp": 2, "grad_accum": 2}, TiedLM, Sentences,
        token_loss_shifted, pad, True),
    # the model's own loss shifts the labels: plait asks its output on the device
    "tied lm, its own shifted loss, grad_accum=2": (
        {"dp_replicate": 2, "dp_shard": 2, "zero": 3, "grad_accum": 2}, OwnLossLM, Sentences,
        None, pad, True),
    "lora, frozen base": ("dp_shard=4,zero=3", LoRA, Regression, F.mse_loss, None, False),
    # each term over its own count: the counts are summed over the global batch on the device
    "tied lm, a loss of two terms, grad_accum=2, fsdp x tp": (
        {"dp_shard": 2, "zero": 3, "tp": 2, "grad_accum": 2}, TiedLM, Sentences, token_terms,
        pad, True),
    "batchnorm and an ema buffer": ("dp_replicate=4", Normed, Regression, F.mse_loss, None,
                                    False),
}
SLOW_USER_RUNS = {
    "tied lm, (sum, count), grad_accum=2, clip": (
        {"dp_replicate": 4, "grad_accum": 2, "grad_clip": 0.05}, TiedLM, Sentences,
        token_loss_sum, pad, True),
    "tied lm, (sum, count), grad_accum=2, clip, fsdp x tp": (
        {"dp_shard": 2, "zero": 3, "tp": 2, "grad_accum": 2, "grad_clip": 0.05}, TiedLM,
        Sentences, token_loss_sum, pad, True),
    "tied lm, a loss of two terms, grad_accum=2": (
        {"dp_replicate": 4, "grad_accum": 2}, TiedLM, Sentences, token_terms, pad, True),
    "batchnorm and an ema buffer, fsdp": ("dp_shard=4,zero=3", Normed, Regression, F.mse_loss,
                                          None, False),
}


def _user_runs(runs: dict) -> dict:
    held = pad([Sentences(8)[i] for i in range(8)])
    xla = {name: train_user("xla", plan, make, data(), loss, collate_fn=collate,
                            held_out=held if with_held else None)
           for name, (plan, make, data, loss, collate, with_held) in runs.items()}
    out = {}
    for name, (plan, make, data, loss, collate, with_held) in runs.items():
        # one device, no accumulation (clipping kept: it is part of what is trained)
        reference = {k: v for k, v in plan.items() if k == "grad_clip"
                     } if isinstance(plan, dict) else None
        ref = train_user("cpu", reference or None, make, data(), loss, collate_fn=collate,
                         held_out=held if with_held else None)
        out[name] = _compare_user(xla[name], ref)
    return out


def _fsdpv2_units(plan: dict) -> list[str] | str:
    """The modules FSDPv2 wraps (the root left out) under ``plan``, or the refusal."""
    run = plait.init(plan, accelerator="xla", quiet=True, seed=0)
    try:
        model = run.parallelize(LoRA())
    except ValueError as exc:
        return str(exc)
    finally:
        run.finish(print_summary=False)
    return sorted(canonical_name(n) for n, m in model.named_modules()
                  if n and type(m).__name__ == "SpmdFullyShardedDataParallel")


def case_users() -> dict:
    """Models users bring, 4 XLA devices under SPMD, each against one CPU; and which modules
    FSDPv2 wraps, by default and with shard_patterns."""
    out = _user_runs(USER_RUNS)
    zero3 = {"dp_shard": 4, "zero": 3}
    out["units"] = {
        "default": _fsdpv2_units(zero3),
        "layers.0": _fsdpv2_units({**zero3, "options": {"shard_patterns": ["layers.0"]}}),
        "nothing.*": _fsdpv2_units({**zero3, "options": {"shard_patterns": ["nothing.*"]}}),
    }
    return out


def case_users_slow() -> dict:
    return _user_runs(SLOW_USER_RUNS)


# ------------------------------------------------------------------ example=
class Conditioned(nn.Module):
    """A model whose forward is not ``forward(input_ids)``: features and a class per row (a
    1-D integer tensor, as a diffusion model's timestep), the class's embedding added to the
    output. The tensor-parallel plan plait infers (``up`` column-parallel, ``down`` row-
    parallel) fits its dataflow."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 4)
        self.label = nn.Embedding(5, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x))) + self.label(t)


class Misfit(Conditioned):
    """The class's embedding added to ``up``'s output instead, which the inferred plan splits
    over tp: the plan does not fit (a forward on the given example shows it)."""

    def __init__(self) -> None:
        super().__init__()
        self.label = nn.Embedding(5, 32)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x) + self.label(t)))


class Labelled(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.t = torch.randint(0, 5, (n,), generator=g)
        self.y = self.x[:, :4] - self.t[:, None] * 0.5

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return (self.x[i], self.t[i]), self.y[i]


def _example_run(accelerator: str, plan, model: nn.Module) -> dict:
    """``model`` laid out with ``example=`` (one batch of the loader's) and trained 4 steps."""
    run = plait.init(plan, accelerator=accelerator, quiet=True, seed=0)
    data = Labelled()
    example = next(iter(run.loader(data, batch_size=8, steps=1, evaluation=True)))
    try:
        model = run.parallelize(model, example=example)
    except ValueError as exc:
        run.finish(print_summary=False)
        return {"refused": str(exc)}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = [float(run.step(model, b, F.mse_loss, opt))
              for b in run.loader(data, batch_size=8, steps=4)]
    state = run.full_state_dict(model)
    info = run.finish(print_summary=False)
    return {"losses": losses, "state": state, "evaluated": None,
            "findings": info["xla"]["findings"] if accelerator == "xla" else None}


def case_example() -> dict:
    """4 XLA devices: ``run.parallelize(model, example=...)`` under tp with a plan plait
    infers, for a model whose forward takes features and a 1-D class tensor, against one
    CPU; and the refusal of a plan that does not fit such a model's dataflow."""
    plan = "dp_replicate=2,tp=2"
    got = _example_run("xla", plan, Conditioned())
    misfit = _example_run("xla", plan, Misfit())
    return {"trained": _compare_user(got, _example_run("cpu", None, Conditioned())),
            "misfit": misfit.get("refused")}


# ------------------------------------------------------------------ checkpoints
class NormedLM(TiedLM):
    """TiedLM with a BatchNorm over the features and a buffer updated in forward: state a
    checkpoint must carry besides the parameters. ``seed`` makes a model whose every value
    differs, for loading into."""

    def __init__(self, seed: int = 3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 0.3)
        self.norm = nn.BatchNorm1d(16)
        self.register_buffer("seen", torch.zeros(V))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.seen.mul_(0.5).add_(F.one_hot(input_ids, V).sum((0, 1)).float())
        h = self.embed(input_ids) * attention_mask.unsqueeze(-1).to(torch.float32)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            h = block(h)
        return self.head(h) + 1e-3 * self.seen


CKPT_STEPS, CKPT_AT = 4, 2


def _ckpt_train(accelerator: str, plan, *, load=None, save=None, seed: int = 3,
                resume=None, stop: int | None = None) -> dict:
    """Steps ``CKPT_AT + 1 .. CKPT_STEPS`` after loading ``load`` into a model that differs in
    every value (``seed``), or steps 1 .. CKPT_STEPS, saving to ``save`` after ``CKPT_AT``;
    every step's loss and the full state (parameters and buffers) at the end. ``resume``: a
    folder for ``init(checkpoint=, every=CKPT_AT)`` (saving, and resuming what it holds);
    ``stop``: end the run after that step."""
    run = plait.init(None if plan == "one device" else plan, accelerator=accelerator,
                     quiet=True, log_every=1, checkpoint=resume,
                     every=CKPT_AT if resume else None, seed=0)
    model = run.parallelize(NormedLM(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = run.steps_done
    if load is not None:
        start = run.load(load, model=model, optimizer=opt)
    losses = []
    for b in run.loader(Sentences(), batch_size=8, steps=CKPT_STEPS, collate_fn=pad):
        losses.append(float(run.step(model, b, token_loss, opt)))
        if save is not None and run.steps_done == CKPT_AT:
            run.save(save)
        if run.steps_done == stop:
            break
    state = run.full_state_dict(model)
    run.finish(print_summary=False)
    return {"start": start, "losses": losses, "state": state}


def _resumed(got: dict, whole: dict) -> dict:
    """What the tests check: a resumed run's losses and final state against the uninterrupted
    one's last steps."""
    return {"start": got["start"], "losses": got["losses"],
            "ref_losses": whole["losses"][got["start"]:],
            "names": sorted(got["state"]), "ref_names": sorted(whole["state"]),
            "max_diff": max(float((got["state"][n].float() - t.float()).abs().max())
                            for n, t in whole["state"].items() if n in got["state"])}


def _ckpt_plans(plans, folder: str) -> dict:
    """Under each plan on XLA: save at step ``CKPT_AT``, resume in a fresh run, against the
    uninterrupted run. Then the checkpoint saved on one CPU (by ``case_checkpoint_cpu``, in
    another process: a CPU backward first leaves no autograd queue for the XLA device) loaded
    under the last plan, and the last plan's checkpoint loaded on one CPU, each against the
    uninterrupted run of where it continues."""
    out, whole = {}, {}
    for plan in plans:
        saved = os.path.join(folder, plan)
        whole[plan] = _ckpt_train("xla", plan, save=saved)
        out[plan] = _resumed(_ckpt_train("xla", plan, load=saved, seed=11), whole[plan])
    last = plans[-1]
    out["cpu -> xla"] = _resumed(_ckpt_train("xla", last, load=os.path.join(folder, "cpu"),
                                             seed=11), whole[last])
    cpu_whole = _ckpt_train("cpu", None)
    out["xla -> cpu"] = _resumed(_ckpt_train("cpu", None, load=os.path.join(folder, last),
                                             seed=11), cpu_whole)
    return out


def case_checkpoint_cpu(folder: str) -> dict:
    """One CPU saves at step ``CKPT_AT`` to ``folder/cpu``, for the XLA cases to load."""
    return {"losses": _ckpt_train("cpu", None, save=os.path.join(folder, "cpu"))["losses"]}


def case_checkpoint_single(folder: str) -> dict:
    # init(checkpoint=): the first run saves at step CKPT_AT (every) and as it finishes, a
    # step later; the second resumes from the newest
    resume = os.path.join(folder, "every")
    _ckpt_train("xla", "one device", resume=resume, stop=CKPT_AT + 1)
    resumed = _resumed(_ckpt_train("xla", "one device", resume=resume, seed=11),
                       _ckpt_train("xla", "one device"))
    resumed["saved"] = sorted(os.listdir(resume))
    out = _ckpt_plans(["one device"], folder)
    out["init(checkpoint=)"] = resumed
    return out


def case_checkpoint_spmd(folder: str) -> dict:
    return _ckpt_plans(["dp_shard=2,zero=3,tp=2"], folder)


def case_checkpoint_spmd_slow(folder: str) -> dict:
    return _ckpt_plans(["dp_replicate=4", "dp_shard=4,zero=3", "tp=4"], folder)


# ------------------------------------------------------------------ preemption (SIGTERM)
PREEMPT_EVERY = 2  # saves during the run, besides the final one


def _preempt_init(plan: str, folder: str | None, async_save: bool) -> plait.Run:
    return plait.init(None if plan == "one device" else plan, accelerator="xla",
                      log_every=1000, checkpoint=folder,
                      every=PREEMPT_EVERY if folder else None, keep=None if folder else 3,
                      async_save=async_save, seed=0)


def _train_to(run: plait.Run, model: nn.Module, steps: int, *, announce: int | None = None,
              opt: torch.optim.Optimizer | None = None, save: str | None = None
              ) -> tuple[list[float], dict]:
    """Steps ``run.steps_done + 1 .. steps``; every step's loss and the full state at the end.
    ``announce``: print ``ready`` after that step (the graphs are compiled by then) and slow
    the steps down, for a SIGTERM to arrive mid-run. ``save``: a folder for a blocking
    ``run.save`` after step ``PREEMPT_EVERY``."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for b in run.loader(Sentences(), batch_size=8, steps=steps, collate_fn=pad):
        losses.append(float(run.step(model, b, token_loss, opt)))
        if save is not None and run.steps_done == PREEMPT_EVERY:
            run.save(save)
        if announce is not None and run.steps_done >= announce:
            if run.steps_done == announce:
                print("ready", flush=True)
            time.sleep(0.05)
    return losses, run.full_state_dict(model)


def case_preempted(folder: str, plan: str, mode: str) -> dict:
    """Trains with ``init(checkpoint=folder, every=2)`` until a SIGTERM stops it (the test
    sends one once ``ready`` is printed, after step 3); ``mode`` "async": ``async_save=True``."""
    run = _preempt_init(plan, folder, mode == "async")
    model = run.parallelize(NormedLM())
    _train_to(run, model, 10_000, announce=3)
    return {"error": "not stopped"}


def case_preempt_resumed(folder: str, plan: str, mode: str) -> dict:
    """After ``case_preempted``: the run resumed from its newest checkpoint (the final one,
    step K) to step K + 2, against the uninterrupted run to K + 2; under "async" also a run
    loaded from the step-2 checkpoint, written in the background while steps 3.. changed the
    weights it was saved from."""
    newest = max(int(p[len("step-"):]) for p in os.listdir(folder) if p.startswith("step-"))
    end = newest + 2
    run = _preempt_init(plan, folder, False)
    model = run.parallelize(NormedLM(seed=11))
    start = run.steps_done
    resumed = _train_to(run, model, end)
    run.finish(print_summary=False)
    run = _preempt_init(plan, None, False)
    blocking = os.path.join(folder, "..", "blocking")
    whole = _train_to(run, run.parallelize(NormedLM()), end, save=blocking)
    run.finish(print_summary=False)
    out = {"newest": newest, "start": start, "resumed": _preempt_compare(resumed, whole, start)}
    if mode == "async":
        # what the background save wrote at step 2 is what a blocking save writes: each
        # tensor's chunks (a device's shard each), not whole tensors
        out["chunks"] = _chunks(os.path.join(folder, f"step-{PREEMPT_EVERY:08d}"))
        out["blocking_chunks"] = _chunks(os.path.join(blocking, f"step-{PREEMPT_EVERY:08d}"))
        run = _preempt_init(plan, None, False)
        model = run.parallelize(NormedLM(seed=11))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        early = run.load(os.path.join(folder, f"step-{PREEMPT_EVERY:08d}"), model=model,
                         optimizer=opt)
        out["early"] = _preempt_compare(_train_to(run, model, end, opt=opt), whole, early)
        out["early_start"] = early
        run.finish(print_summary=False)
    return out


def _chunks(step_dir: str) -> dict[str, list[list[int]]]:
    """{name: the offsets of its chunks} of a checkpoint's tensors, from DCP's metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(step_dir).read_metadata().state_dict_metadata
    return {name: sorted(list(c.offsets) for c in m.chunks) for name, m in meta.items()
            if isinstance(m, TensorStorageMetadata)}


def _preempt_compare(got: tuple[list[float], dict], whole: tuple[list[float], dict],
                     start: int) -> dict:
    (losses, state), (ref_losses, ref_state) = got, whole
    return {"losses": losses, "ref_losses": ref_losses[start:],
            "names": sorted(state) == sorted(ref_state),
            "max_diff": max(float((state[n].float() - t.float()).abs().max())
                            for n, t in ref_state.items())}


def main(case: str, *args: str) -> None:
    result = globals()[f"case_{case}"](*args)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
