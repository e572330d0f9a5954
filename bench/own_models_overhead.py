"""plait's step beside hand-written PyTorch on models users bring (not the reference model).

Four models written for the bench, each with what plait adds checks or bookkeeping for:

* ``tied_lm``: a token LM whose head is its embedding (one tied weight), trained on dict
  batches (``{"input_ids", "labels"}``) with a masked loss (a third of the labels -100, the
  rows keeping different numbers: the global mean needs the global count);
* ``lora``: a LoRA-like MLP classifier, frozen base weights with trainable rank-8 adapters;
* ``convnet``: a small ConvNet with BatchNorm (per-rank statistics under both: raw DDP and
  plait without ``sync_bn`` train the same thing);
* ``gpt2``: a tiny Hugging Face GPT-2 built from a config (no download), its own ``output.loss``
  (``loss_fn=None`` in plait).

Each (model, layout) is trained by each contestant from one seed: laid out by hand with
torch's own building blocks (``DistributedDataParallel``; ``fully_shard`` on each block then
the root; ``parallelize_module`` with the same styles as plait's ``options.tp_plan``;
``torch.distributed.pipelining``'s ``PipelineStage`` and ``Schedule1F1B`` cut at the same
block), and by ``run.parallelize`` with the matching plan (``dp=N``, ``dp_shard=N,zero=3``,
``tp=N``, ``pp=N,schedule=1f1b,mb=4``). Both train on the same batches with AdamW and gradient
clipping at 1.0 (plait's default), on the global mean loss (the raw loop all-reduces the
masked count itself, as a correct hand-written loop must). The global loss after the last step
of each must agree: the two trained the same model.

Each contestant's run is a job of its own (``--nproc`` processes, gloo on 127.0.0.1, started by
``plait.spawn.run_distributed``): a process holding a plait Run has a hook in front of every
collective, which a raw step must not pay. A round is one job of each, raw first in odd rounds
and plait first in even ones; each step is timed from a barrier to its end on every rank, a
step's time being its slowest rank's, and a job's figure is its median step. Per round the
ratio is plait's over raw's; the figure to judge is the median of those ratios.

    PYTHONPATH=. python bench/own_models_overhead.py [--rounds 8] [--steps 12]
        [--models tied_lm,lora] [--layouts ddp,zero3] [--profile cprofile]
    PYTHONPATH=. python bench/own_models_overhead.py --smoke   # one job, 3 steps; no timing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_anchors import _ratio_range

# ------------------------------------------------------------------ the models

VOCAB, SEQ, LM_BATCH = 1024, 64, 16


class TiedLM(nn.Module):
    """Token and position embeddings, residual MLP blocks, a head that is the embedding."""

    def __init__(self, vocab: int = VOCAB, width: int = 128, depth: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(SEQ, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)  # logits of a sane size through the tie

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


def masked_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the labels that are not -100."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def lm_batch(step: int) -> dict[str, torch.Tensor]:
    """Row i keeps about (i + 1) / rows of its labels: data ranks count different numbers."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (LM_BATCH, SEQ), generator=g)
    keep = torch.rand(LM_BATCH, SEQ, generator=g) < (
        torch.arange(1, LM_BATCH + 1).float() / LM_BATCH)[:, None]
    labels = torch.where(keep, torch.roll(tokens, -1, dims=1), torch.full_like(tokens, -100))
    return {"input_ids": tokens, "labels": labels}


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update (B starts at zero, as LoRA's)."""

    def __init__(self, width: int, rank: int = 8):
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, width) / width)
        self.lora_b = nn.Parameter(torch.zeros(width, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()) + x


class LoRAClassifier(nn.Module):
    def __init__(self, features: int = 256, width: int = 512, depth: int = 4, classes: int = 16):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.inp.requires_grad_(False)
        self.blocks = nn.Sequential(*(LoRALinear(width) for _ in range(depth)))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


def rows_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(64, 256, generator=g), torch.randint(0, 16, (64,), generator=g)


class ConvNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout),
                                 nn.ReLU(), nn.MaxPool2d(2))

        self.features = nn.Sequential(block(3, 32), block(32, 64), block(64, 64))
        self.head = nn.Linear(64 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def image_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()  # its notes on the config, once per process
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0, loss_type="ForCausalLM")
    return GPT2LMHeadModel(cfg)


def gpt2_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4000 + step)
    tokens = torch.randint(0, VOCAB, (8, SEQ), generator=g)
    return {"input_ids": tokens, "labels": tokens.clone()}


@dataclass(frozen=True)
class ModelSpec:
    build: Callable[[], nn.Module]
    batch: Callable[[int], Any]  # step -> the global batch
    loss_fn: Callable[[Any, Any], torch.Tensor] | None  # plait's; None: the model's output.loss
    blocks: str  # the attribute path of the repeated blocks (fully_shard units, pipeline cut)
    masked: bool = False  # a mean over a count that differs between ranks


MODELS: dict[str, ModelSpec] = {
    "tied_lm": ModelSpec(TiedLM, lm_batch, masked_loss, "blocks", masked=True),
    "lora": ModelSpec(LoRAClassifier, rows_batch, F.cross_entropy, "blocks"),
    "convnet": ModelSpec(ConvNet, image_batch, F.cross_entropy, "features"),
    "gpt2": ModelSpec(tiny_gpt2, gpt2_batch, None, "transformer.h"),
}
# The layouts each model is run under; tp and pp where the raw version is short to write.
LAYOUTS: dict[str, tuple[str, ...]] = {
    "tied_lm": ("ddp", "zero3", "tp"),
    "lora": ("ddp", "zero3", "pp"),
    "convnet": ("ddp", "zero3"),
    "gpt2": ("ddp", "zero3"),
}
TP_STYLES = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}  # tied_lm under tp
MICROBATCHES = 4


def plait_plan(layout: str, world: int) -> Any:
    from plait.plan import Plan

    if layout == "ddp":
        return Plan.from_string(f"dp={world}")
    if layout == "zero3":
        return Plan.from_string(f"dp_shard={world},zero=3")
    if layout == "tp":
        return Plan.from_dict({"tp": world, "options": {"tp_plan": TP_STYLES}})
    # The same cut as the raw pipeline's: the second half of the blocks on the last stage.
    return Plan.from_dict({"pp": world, "pp_schedule": "1f1b", "microbatches": MICROBATCHES,
                           "options": {"split_points": ["blocks.2"]}})


def built(spec: ModelSpec) -> nn.Module:
    torch.manual_seed(0)
    return spec.build()


def _get(module: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _rows(batch: Any, rank: int, world: int) -> Any:
    """This data rank's rows of a global batch."""
    if isinstance(batch, torch.Tensor):
        n = batch.shape[0] // world
        return batch[rank * n:(rank + 1) * n]
    if isinstance(batch, dict):
        return {k: _rows(v, rank, world) for k, v in batch.items()}
    return type(batch)(_rows(v, rank, world) for v in batch)


# ------------------------------------------------------------------ raw PyTorch, by hand

class RawDataParallel:
    """DDP or FSDP2 laid out by hand; a step is what a careful user writes: the masked loss
    divided by the global count (all-reduced), backward, clip, step."""

    def __init__(self, spec: ModelSpec, layout: str, rank: int, world: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.spec, self.rank, self.world = spec, rank, world
        model = built(spec)
        if layout == "ddp":
            model = DDP(model)
        else:
            mesh = init_device_mesh("cpu", (world,))
            for block in _get(model, spec.blocks):
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-3)

    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = _rows(self.spec.batch(step), self.rank, self.world)
        if self.spec.loss_fn is None:
            loss = self.model(**batch).loss
            weight = torch.ones(())
        elif isinstance(batch, dict):
            labels = batch["labels"]
            # The global count, all-reduced while the forward runs (the labels are known).
            weight = (labels != -100).sum().float()
            count = weight.clone()
            counted = dist.all_reduce(count, async_op=True)
            logits = self.model(input_ids=batch["input_ids"])
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                    reduction="sum")
            counted.wait()
            # DDP and FSDP average the ranks' gradients: times world, over the global count.
            loss = total * self.world / count.clamp_min(1)
        else:
            x, y = batch
            loss = self.spec.loss_fn(self.model(x), y)
            weight = torch.ones(())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        value = (total if self.spec.masked else loss * weight).detach()
        return value, weight

    def global_loss(self, last: tuple[torch.Tensor, torch.Tensor]) -> float:
        pair = torch.stack([last[0].float(), last[1].float()])
        dist.all_reduce(pair)
        return float(pair[0] / pair[1])


class RawTensorParallel:
    """``parallelize_module`` with the same styles as plait's ``options.tp_plan``."""

    def __init__(self, spec: ModelSpec, rank: int, world: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        self.spec = spec
        model = built(spec)
        mesh = init_device_mesh("cpu", (world,))
        plan: dict[str, Any] = {}
        for i in range(len(_get(model, spec.blocks))):
            plan[f"{spec.blocks}.{i}.up"] = ColwiseParallel()
            plan[f"{spec.blocks}.{i}.down"] = RowwiseParallel()
        self.model = parallelize_module(model, mesh, plan)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-3)

    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.spec.batch(step)
        loss = masked_loss(self.model(input_ids=batch["input_ids"]), batch["labels"])
        loss.backward()
        # clip_grad_norm_ refuses a mix of DTensor (split) and plain (replicated) gradients:
        # the norm of each kind, then together.
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.params if p.grad is not None]
        split = [g for g in grads if isinstance(g, DTensor)]
        whole = [g for g in grads if not isinstance(g, DTensor)]
        norm = torch.nn.utils.get_total_norm(split).full_tensor().pow(2)
        norm = (norm + torch.nn.utils.get_total_norm(whole).pow(2)).sqrt()
        torch.nn.utils.clip_grads_with_norm_(split, 1.0, norm)
        torch.nn.utils.clip_grads_with_norm_(whole, 1.0, norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach(), torch.ones(())

    def global_loss(self, last: tuple[torch.Tensor, torch.Tensor]) -> float:
        return float(last[0])


class RawPipeline:
    """The blocks cut in two halves by hand (input layer with the first, head with the second),
    ``PipelineStage`` + ``Schedule1F1B``; the gradient norm summed over the stages to clip."""

    def __init__(self, spec: ModelSpec, rank: int, world: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        if world != 2:
            raise ValueError(f"the raw pipeline is written for 2 stages, not {world}")
        self.spec, self.rank = spec, rank
        model = built(spec)
        blocks = list(_get(model, spec.blocks))
        half = len(blocks) // 2
        self.module = (nn.Sequential(model.inp, *blocks[:half]) if rank == 0
                       else nn.Sequential(*blocks[half:], model.head))
        stage = PipelineStage(self.module, rank, world, torch.device("cpu"))
        self.schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=spec.loss_fn)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-3)

    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.spec.batch(step)
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(x)
        else:
            self.schedule.step(target=y, losses=losses)
        grads = [p.grad for p in self.params if p.grad is not None]
        squared = torch.nn.utils.get_total_norm(grads).pow(2)
        dist.all_reduce(squared)
        torch.nn.utils.clip_grads_with_norm_(self.params, 1.0, squared.sqrt())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        value = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        return value, torch.ones(())

    def global_loss(self, last: tuple[torch.Tensor, torch.Tensor]) -> float:
        value = last[0].clone()
        dist.broadcast(value, src=1)  # the last stage holds the loss
        return float(value)


def raw_contestant(spec: ModelSpec, layout: str, rank: int, world: int) -> Any:
    if layout in ("ddp", "zero3"):
        return RawDataParallel(spec, layout, rank, world)
    if layout == "tp":
        return RawTensorParallel(spec, rank, world)
    return RawPipeline(spec, rank, world)


class PlaitContestant:
    def __init__(self, spec: ModelSpec, layout: str, rank: int, world: int,
                 init: dict[str, Any] | None = None):
        import plait

        self.spec = spec
        self.run = plait.init(plait_plan(layout, world), quiet=True, log_every=10**9,
                              **(init or {}))
        self.model = self.run.parallelize(built(spec))
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                     lr=1e-3)
        self.dp_rank, self.dp_size = self.run.dp_rank, self.run.dp_size

    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = _rows(self.spec.batch(step), self.dp_rank, self.dp_size)
        return self.run.step(self.model, batch, self.spec.loss_fn, self.opt), torch.ones(())

    def global_loss(self, last: tuple[torch.Tensor, torch.Tensor]) -> float:
        return float(last[0])  # run.step's loss is already the global batch's


# ------------------------------------------------------------------ the job

def job(rank: int, world: int, cases: list[tuple[str, str]], names: list[str], steps: int,
        warmup: int, profile: str | None = None, init: dict[str, Any] | None = None
        ) -> list[dict[str, Any]]:
    """Each case in turn, each of ``names`` ("raw", "plait") trained ``warmup`` + ``steps``
    steps from the seed: this rank's time of each timed step and each one's final loss.

    The timed runs give each contestant a job of its own (a process with a plait Run in it
    installs a hook in front of every collective, which a raw step must not pay); ``--smoke``
    runs both, and every case, in one job."""
    warnings.filterwarnings("ignore")  # plait's BatchNorm note: both train per-rank statistics
    out = []
    for model, layout in cases:
        spec = MODELS[model]
        times: dict[str, list[float]] = {}
        losses: dict[str, float] = {}
        for name in names:
            who = (PlaitContestant(spec, layout, rank, world, init) if name == "plait"
                   else raw_contestant(spec, layout, rank, world))
            times[name], losses[name] = _train(who, name, steps, warmup, profile, rank == 0)
            if name == "plait":
                who.run.close()
        out.append({"times": times, "losses": losses})
    return out


def job_together(rank: int, world: int, case: tuple[str, str], rounds: int, steps: int,
                 warmup: int, init: dict[str, Any] | None = None) -> dict[str, Any]:
    """``--together``: both contestants in these processes, ``rounds`` rounds of ``steps``
    steps of each (raw first in odd rounds): this rank's step times per round, and the losses.
    The raw steps then pay plait's hook in front of each collective too."""
    warnings.filterwarnings("ignore")
    spec = MODELS[case[0]]
    who = {"raw": raw_contestant(spec, case[1], rank, world),
           "plait": PlaitContestant(spec, case[1], rank, world, init)}
    state: dict[str, Any] = {n: {"done": 0, "last": None} for n in who}

    def one(name: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        state[name]["last"] = who[name].step(state[name]["done"])
        elapsed = time.perf_counter() - start
        state[name]["done"] += 1
        return elapsed

    for name in who:
        for _ in range(warmup):
            one(name)
    times: dict[str, list[list[float]]] = {"raw": [], "plait": []}
    for r in range(rounds):
        for name in ("raw", "plait") if r % 2 == 0 else ("plait", "raw"):
            times[name].append([one(name) for _ in range(steps)])
    losses = {n: c.global_loss(state[n]["last"]) for n, c in who.items()}
    who["plait"].run.close()
    return {"times": times, "losses": losses}


def _train(who: Any, name: str, steps: int, warmup: int, profile: str | None, show: bool
           ) -> tuple[list[float], float]:
    """``warmup`` + ``steps`` steps from the first batch: the timed steps' times and the
    global loss after the last; then ``steps`` more profiled, with ``profile``."""
    state: dict[str, Any] = {"done": 0, "last": None}

    def one() -> float:
        dist.barrier()
        start = time.perf_counter()
        state["last"] = who.step(state["done"])
        elapsed = time.perf_counter() - start
        state["done"] += 1
        return elapsed

    for _ in range(warmup):
        one()
    times = [one() for _ in range(steps)]
    loss = who.global_loss(state["last"])
    if profile:
        _profile(name, one, profile, steps, show)
    return times, loss


def _profile(name: str, one: Callable[[], float], kind: str, steps: int, show: bool) -> None:
    """``steps`` more steps, profiled (cProfile or torch.profiler); rank 0 prints the top."""
    if kind.startswith("cprofile"):
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            one()
        prof.disable()
        text = io.StringIO()
        order = "tottime" if kind == "cprofile-self" else "cumulative"
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(50)
        table = text.getvalue()
    else:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as tprof:
            for _ in range(steps):
                one()
        table = tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    if show:
        print(f"==== {name}: {kind}, {steps} steps\n{table}", flush=True)


def slowest_rank_median(ranks: list[list[float]]) -> float:
    """The median step, a step's time being its slowest rank's."""
    return statistics.median(max(ts) for ts in zip(*ranks, strict=True))


def main(argv: list[str] | None = None) -> int:
    from plait.spawn import run_distributed

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--layouts", default="ddp,zero3,tp,pp",
                   help="run each model under those of these it has (tp: tied_lm, pp: lora)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=12, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first, in each job")
    p.add_argument("--profile", choices=["cprofile", "cprofile-self", "torch"], default=None,
                   help="in the first round, rank 0 profiles --steps more steps of each "
                        "(cProfile by cumulative or own time, or torch.profiler)")
    p.add_argument("--smoke", action="store_true",
                   help="both contestants and every case in one job, 2 steps after 1 warm-up: "
                        "the losses agree; the times mean nothing")
    p.add_argument("--together", action="store_true",
                   help="both contestants in one job per case, alternating every --steps "
                        "steps (steadier on a busy machine; the raw steps then pay plait's "
                        "per-collective hook too)")
    p.add_argument("--no-desync-check", action="store_true",
                   help="plait.init(desync_check=False): plait without the watchdog's "
                        "step-start all-gather, to see what it costs")
    p.add_argument("--json", action="store_true", help="one JSON line per case as well")
    a = p.parse_args(argv)
    init = {"desync_check": not a.no_desync_check}
    if a.smoke:
        a.rounds, a.steps, a.warmup = 1, 2, 1
    layouts = a.layouts.split(",")
    cases = [(m, lay) for m in a.models.split(",") for lay in LAYOUTS[m] if lay in layouts]
    load = os.getloadavg()
    started = time.perf_counter()
    how = ("both contestants in one job per case, a round " f"{a.steps} steps of each"
           if a.together else f"a round one job of each contestant, {a.steps} timed steps")
    print(f"own models: {a.nproc} processes (gloo, 1 thread each), {a.rounds} rounds per case, "
          f"{how} (raw first in odd rounds, plait first in even ones) after {a.warmup} "
          f"untimed; load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
          flush=True)
    print(f"{'model':<8} {'layout':<6} {'raw ms':>8} {'plait ms':>9} {'raw st/s':>9} "
          f"{'plait st/s':>10} {'plait/raw':>10} {'(rounds)':>11}  {'raw loss':>9} "
          f"{'plait loss':>10}", flush=True)
    worst = 0.0

    def ran(group: list[tuple[str, str]], names: list[str], profile: str | None
            ) -> list[list[dict[str, Any]]]:
        return run_distributed(job, a.nproc, group, names, a.steps, a.warmup, profile, init,
                               timeout=1800, env={"OMP_NUM_THREADS": "1"})

    def show(case: tuple[str, str], medians: dict[str, list[float]],
             losses: dict[str, float]) -> float:
        """Print the case's line; return the relative difference of the losses."""
        ratios = [pl / rw for pl, rw in zip(medians["plait"], medians["raw"], strict=True)]
        raw_s, plait_s = statistics.median(medians["raw"]), statistics.median(medians["plait"])
        raw_loss, plait_loss = losses["raw"], losses["plait"]
        print(f"{case[0]:<8} {case[1]:<6} {1e3 * raw_s:>8.2f} {1e3 * plait_s:>9.2f} "
              f"{1 / raw_s:>9.1f} {1 / plait_s:>10.1f} {statistics.median(ratios):>10.3f} "
              f"{_ratio_range(ratios):>11}  {raw_loss:>9.5f} {plait_loss:>10.5f}", flush=True)
        if a.json:
            print(json.dumps({"model": case[0], "layout": case[1], "raw_s": raw_s,
                              "plait_s": plait_s, "ratios": ratios, "losses": losses}),
                  flush=True)
        return abs(plait_loss - raw_loss) / abs(raw_loss)

    if a.smoke:
        ranks = ran(cases, ["raw", "plait"], a.profile)
        for i, case in enumerate(cases):
            worst = max(worst, show(case, {n: [slowest_rank_median([r[i]["times"][n]
                                                                    for r in ranks])]
                                           for n in ("raw", "plait")}, ranks[0][i]["losses"]))
    for case in cases if a.together and not a.smoke else []:
        ranks = run_distributed(job_together, a.nproc, case, a.rounds, a.steps, a.warmup, init,
                                timeout=1800, env={"OMP_NUM_THREADS": "1"})
        worst = max(worst, show(case, {n: [slowest_rank_median([rk["times"][n][r]
                                                                for rk in ranks])
                                           for r in range(a.rounds)] for n in ("raw", "plait")},
                                ranks[0]["losses"]))
    for case in [] if a.smoke or a.together else cases:
        medians: dict[str, list[float]] = {"raw": [], "plait": []}
        losses: dict[str, float] = {}
        for r in range(a.rounds):
            for name in ("raw", "plait") if r % 2 == 0 else ("plait", "raw"):
                ranks = ran([case], [name], a.profile if r == 0 else None)
                medians[name].append(slowest_rank_median([rk[0]["times"][name]
                                                          for rk in ranks]))
                losses[name] = ranks[0][0]["losses"][name]
        worst = max(worst, show(case, medians, losses))
    load = os.getloadavg()
    print(f"(ms: median over rounds of each round's median step, a step timed on its slowest "
          f"rank; plait/raw: median of the per-round ratios, min..max beside it; losses: the "
          f"global batch's after the last timed step; largest relative loss difference "
          f"{worst:.1e}; load average at end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
