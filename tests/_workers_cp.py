"""Workers for tests/test_context_parallel.py (spawned processes import them from here)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from plait.parallel.context import ContextGroup, cp_attention, shard_sequence
from tests._workers_semantics import FusedAttention


def _qkv(seq: int, heads: int, kv_heads: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, seq, 8, generator=g)
    k = torch.randn(2, kv_heads, seq, 8, generator=g)
    v = torch.randn(2, kv_heads, seq, 8, generator=g)
    return [q, k, v]


def attention_matches(rank: int, world_size: int, seq: int) -> list[dict[str, Any]]:
    """For each case: the largest difference between this rank's attention output and
    gradients (q, k, v) under cp and its slice of one-device SDPA's on the same q/k/v."""
    original = F.scaled_dot_product_attention
    cp = ContextGroup(dist.group.WORLD, rank, world_size)
    pos = cp.positions(seq)
    out = []
    cases = [("causal", 4, 4, dict(is_causal=True)),
             ("full", 4, 4, {}),
             ("gqa_causal", 4, 2, dict(is_causal=True, enable_gqa=True)),
             ("causal_scaled", 4, 4, dict(is_causal=True, scale=0.3))]
    for i, (name, heads, kv_heads, kwargs) in enumerate(cases):
        full = [t.requires_grad_() for t in _qkv(seq, heads, kv_heads, i)]
        weight = torch.randn(2, heads, seq, 8, generator=torch.Generator().manual_seed(99))
        ref = F.scaled_dot_product_attention(*full, **kwargs)
        (ref * weight).sum().backward()
        local = [shard_sequence(t.detach(), pos, dim=2).requires_grad_() for t in full]
        with cp_attention(cp, seq):
            got = F.scaled_dot_product_attention(*local, **kwargs)
            (got * shard_sequence(weight, pos, dim=2)).sum().backward()
        diffs = {"out": (got - shard_sequence(ref.detach(), pos, dim=2)).abs().max().item()}
        for label, a, b in zip("qkv", local, full, strict=True):
            diffs[label] = (a.grad - shard_sequence(b.grad, pos, dim=2)).abs().max().item()
        out.append({"case": name, **diffs,
                    "scale": ref.abs().max().item(), "restored":
                    F.scaled_dot_product_attention is original})
    return out


def attention_refusals(rank: int, world_size: int) -> list[str]:
    """The messages the cp attention raises for what it cannot compute."""
    cp = ContextGroup(dist.group.WORLD, rank, world_size)
    seq = 8
    q, k, v = (shard_sequence(t, cp.positions(seq), dim=2) for t in _qkv(seq, 2, 2, 0))
    messages = []
    for kwargs in (dict(attn_mask=torch.ones(4, 4, dtype=torch.bool)), dict(dropout_p=0.1)):
        try:
            with cp_attention(cp, seq):
                F.scaled_dot_product_attention(q, k, v, **kwargs)
        except ValueError as exc:
            messages.append(str(exc))
    try:
        cp.positions(6)
    except ValueError as exc:
        messages.append(str(exc))
    return messages


# ------------------------------------------------------------------------------ training
VOCAB, WIDTH, SEQ, BATCH, STEPS = 32, 16, 16, 4, 3


class CausalLM(nn.Module):
    """Written for the test: token and learned position embeddings, blocks of grouped-query
    causal self-attention through F.scaled_dot_product_attention(is_causal=True) and an MLP,
    a vocabulary head. Positions come from ``position_ids`` (0..seq-1 when not given)."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, depth: int = 2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, WIDTH // heads
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.qkv = nn.ModuleList(nn.Linear(WIDTH, WIDTH + 2 * kv_heads * self.head_dim)
                                 for _ in range(depth))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                               nn.Linear(2 * WIDTH, WIDTH))
                                 for _ in range(depth))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s).expand(b, -1)
        h = self.tok(input_ids) + self.pos(position_ids)
        kv = self.kv_heads * self.head_dim
        for qkv, mlp in zip(self.qkv, self.mlp, strict=True):
            q, k, v = qkv(h).split([WIDTH, kv, kv], dim=-1)
            q = q.view(b, s, self.heads, -1).transpose(1, 2)
            k = k.view(b, s, self.kv_heads, -1).transpose(1, 2)
            v = v.view(b, s, self.kv_heads, -1).transpose(1, 2)
            a = self.attention(q, k, v)
            h = h + a.transpose(1, 2).reshape(b, s, WIDTH)
            h = h + mlp(h)
        return self.head(h)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class WrittenOutLM(CausalLM):
    """CausalLM with its attention written out (softmax of masked scores, as Hugging Face's
    eager attention computes it), not through F.scaled_dot_product_attention."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        s = q.shape[-2]
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        return scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v


def written_out_lm() -> nn.Module:
    torch.manual_seed(0)
    return WrittenOutLM()


def causal_lm() -> nn.Module:
    torch.manual_seed(0)
    return CausalLM()


def reference_lm() -> nn.Module:
    """plait's reference transformer (rotary positions, GQA, SwiGLU), tiny."""
    from plait.models.transformer import TransformerConfig, build

    return build(TransformerConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4,
                                   n_kv_heads=2, max_seq_len=SEQ), seed=0)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        # no q|k|v bias: the key bias's gradient is zero up to rounding (softmax ignores a
        # constant added to a query's scores), which AdamW would turn into steps of lr either way
        self.attn = FusedAttention(WIDTH, qkv_bias=False)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                 nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm(h))
        return h + self.mlp(h)


class BlockLM(nn.Module):
    """Written for the test, for layouts with tensor parallelism (which lays it out by an
    inferred plan): token and learned position embeddings (positions from ``position_ids``),
    pre-norm blocks of fused-qkv attention and an MLP, a vocabulary head."""

    def __init__(self, depth: int = 2):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], -1)
        h = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def block_lm() -> nn.Module:
    torch.manual_seed(0)
    return BlockLM()


def deep_block_lm() -> nn.Module:
    """Four blocks: two stages per rank at pp=2 (interleaved schedules)."""
    torch.manual_seed(0)
    return BlockLM(depth=4)


class GatedBlock(Block):
    """:class:`Block`, then a branch that runs only when some token of its input is gated,
    adding to the gated tokens alone (a token's result does not depend on which rows or
    positions share its call, so slices and microbatches compute what one device does)."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = super().forward(h)
        if bool(gate.any()):
            h = h + gate.unsqueeze(-1).to(h.dtype) * torch.tanh(self.branch(h))
        return h


class GatedLM(nn.Module):
    """Written for the test: :class:`BlockLM` with four :class:`GatedBlock`, whose branches
    get no gradient on a step, microbatch or slice of the sequence without a gated token."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, gate: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], -1)
        h = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            h = block(h, gate)
        return self.head(h)


def gated_lm() -> nn.Module:
    torch.manual_seed(0)
    return GatedLM()


def gated_batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """:func:`lm_batch` with a per-token gate: step 0 gates two tokens of row 1 (positions 1
    and 3: cp rank 0's slice at cp=2, the first data replica, the first microbatch), step 1
    none (no rank uses a branch), step 2 two of row 3 (positions 6 and 9: cp rank 1's slice,
    the last replica and microbatch). Every gated token has labelled tokens after it."""
    tokens, labels = lm_batch(step)
    gate = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    if step % 3 == 0:
        gate[1, [1, 3]] = True
    elif step % 3 == 2:
        gate[3, [6, 9]] = True
    return {"input_ids": tokens, "gate": gate}, labels


def no_positions_lm() -> nn.Module:
    """A model that numbers positions from its input's length: cp must refuse it."""
    from tests._workers_semantics import MaskedLM

    torch.manual_seed(0)
    return MaskedLM()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the labels that are not -100; labels come shifted in the data."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def shifting_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A loss that shifts itself (logits[:, :-1] against labels[:, 1:]): cp must refuse it."""
    return lm_loss(logits[:, :-1], labels[:, 1:])


def lm_batch(step: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token labels; row i keeps only its first 2 + 3i labels (the rest -100),
    so the two cp ranks' slices (positions 0-3 and 12-15, 4-11 at cp=2) count different
    numbers of tokens, and the data ranks too."""
    g = torch.Generator().manual_seed(200 + step)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
    labels = tokens[:, 1:].clone()
    for i in range(batch):
        labels[i, 2 + 3 * i:] = -100
    return tokens[:, :-1].contiguous(), labels


def reference(factory: Any, batches: list[Any], loss_fn: Any) -> dict[str, Any]:
    from tests._workers_semantics import reference as one_device

    return one_device(factory, batches, loss_fn)


def train(rank: int, world_size: int, jobs: list[Any]) -> list[dict[str, Any]]:
    from tests._workers_semantics import train_jobs

    return train_jobs(rank, world_size, jobs)


# eps 1e-6, not torch's 1e-8: Adam divides each gradient element by its own magnitude, so
# an element whose gradient is near eps turns a 1e-7 rounding difference (fp32 sums in another
# order) into 1e-5 of the weights' scale; at 1e-6 that amplification stays below 1e-6.
ADAM_LR, ADAM_EPS = 1e-3, 1e-6


def reference_adamw(factory: Any, batches: list[Any], loss_fn: Any) -> dict[str, Any]:
    """One device: AdamW on each whole global batch, torch's clipping at 1.0 (run.step's
    default); every step's loss and the parameters after the last."""
    model = factory()
    opt = torch.optim.AdamW(model.parameters(), lr=ADAM_LR, eps=ADAM_EPS, weight_decay=0.1)
    losses = []
    for inputs, labels in batches:
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        loss = loss_fn(out, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses,
            "state": {n: p.detach().clone() for n, p in model.named_parameters()}}


def train_adamw(rank: int, world_size: int, jobs: list[Any]) -> list[dict[str, Any]]:
    """Each (plan, factory, global batches, loss_fn) trained with AdamW through run.step (the
    optimizer made as on one device; under zero=1 run.step shards it); rank 0's full state
    after the last step."""
    from plait.check import _slice
    from plait.runtime import init

    out = []
    for text, factory, batches, loss_fn in jobs:
        run = init(text, quiet=True, log_every=1, seed=0)
        model = run.parallelize(factory())
        opt = torch.optim.AdamW(model.parameters(), lr=ADAM_LR, eps=ADAM_EPS, weight_decay=0.1)
        losses = [float(run.step(model, _slice(b, run.dp_rank, run.dp_size), loss_fn, opt))
                  for b in batches]
        state = run.full_state_dict(model)
        run.close()
        out.append({"plan": text, "losses": losses, "state": state if rank == 0 else None})
    return out


def refusals(rank: int, world_size: int, batches: list[Any], plan: str = "cp=2",
             model: Any = None) -> list[str]:
    """What run.parallelize / run.step refuse under ``plan`` (cp=2), ``model`` (the causal
    LM) standing for a model that takes positions; without a pipeline, attention written
    out too (a pipeline stage may hold no attention, so its stages do not ask)."""
    from plait.runtime import init

    model = model or causal_lm
    out = []
    for factory, loss_fn, batch in ((no_positions_lm, lm_loss, batches[0]),
                                     (model, shifting_loss, batches[0]),
                                     (model, lm_loss, (batches[0][0][:, :6],
                                                       batches[0][1][:, :6])),
                                     (model, lm_loss, (batches[0][0], batches[0][1][:, 0])),
                                     *([(written_out_lm, lm_loss, batches[0])]
                                       if "pp" not in plan else [])):
        run = init(plan, quiet=True, seed=0)
        try:
            model = run.parallelize(factory())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            run.step(model, batch, loss_fn, opt)
            out.append("")
        except ValueError as exc:
            out.append(str(exc))
        run.close()
    return out


def ledger_axes(rank: int, world_size: int, batches: list[Any], plan: str = "cp=2",
                factory: Any = None) -> dict[str, Any]:
    """The ledger's entries by "axis/op" for the second step of ``factory``'s model (the
    causal LM) under ``plan``."""
    from plait.comm.ledger import Ledger
    from plait.runtime import init

    # desync_check off: the watchdog's step-start all-gather runs on a group of the same
    # ranks, which a user's own Ledger would count on the cp axis too
    run = init(plan, quiet=True, desync_check=False, seed=0)
    model = run.parallelize((factory or causal_lm)())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run.step(model, batches[0], lm_loss, opt)  # DDP's first step sets up its buckets
    with Ledger(run.mesh) as ledger:
        run.step(model, batches[1], lm_loss, opt)
    run.close()
    return {f"{e['axis']}/{e['op']}": e for e in ledger.local_entries()}


def hf_llama(attn: str = "sdpa") -> nn.Module:
    """A tiny Hugging Face Llama built from a config (no download), SDPA attention (or
    ``attn``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=SEQ, attn_implementation=attn)
    return LlamaForCausalLM(cfg)


def logits_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """lm_loss on a Hugging Face output's logits (labels come shifted in the data)."""
    return lm_loss(out.logits, labels)


def evaluate(rank: int, world_size: int, batches: list[Any], plan: str = "cp=2",
             factory: Any = None) -> float:
    """run.evaluate of ``factory``'s model (the causal LM) on the first batch under
    ``plan``."""
    from plait.runtime import init

    run = init(plan, quiet=True, seed=0)
    model = run.parallelize((factory or causal_lm)())
    loss = float(run.evaluate(model, batches[0], lm_loss))
    run.close()
    return loss


def response_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels on the last 4 positions only (a prompt masked out, the response counted): at
    cp=2 rank 1 (positions 4-11) holds no counted token at all."""
    tokens, labels = lm_batch(step)
    labels = tokens.roll(-1, dims=1)
    labels[:, :SEQ - 4] = -100
    return tokens, labels


# ------------------------------------------------------------------------------ checkpoints
def checkpoints(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Checkpoints under cp=2 (plait's test transformer on TextDataset, AdamW and an LR
    scheduler): exact resume (stopped at step 6 of 12, resumed), and moves cp=2 -> ZeRO-3
    over 2, ZeRO-3 -> cp=2 and one process (``root/single``, saved beforehand) -> cp=2.
    Returns the resume's (uninterrupted, resumed) losses and each move's losses of steps 4-6."""
    from tests import _workers_checkpoint as ck

    base = root + "/"
    out: dict[str, Any] = {"resume": ck.exact_resume(rank, world_size, ["cp=2"],
                                                     base + "resume")["cp=2"]}
    out["cp=2 (saved)"] = ck.save_under(rank, world_size, "cp=2", base + "cp2")
    out["cp=2 -> dp_shard=2,zero=3"] = ck.continue_under(rank, world_size,
                                                         "dp_shard=2,zero=3", base + "cp2")
    ck.save_under(rank, world_size, "dp_shard=2,zero=3", base + "z3")
    out["dp_shard=2,zero=3 -> cp=2"] = ck.continue_under(rank, world_size, "cp=2", base + "z3")
    out["one process -> cp=2"] = ck.continue_under(rank, world_size, "cp=2", base + "single")
    return out


def checkpoints_tp(rank: int, world_size: int, root: str, plan: str = "cp=2,tp=2"
                   ) -> dict[str, Any]:
    """At world 4, ``plan`` (cp=2 with tp=2 or pp=2): exact resume (the
    step-6 checkpoint of an uninterrupted run loaded), its step-3 checkpoint saved to
    ``root/cptp``, and one process's (``root/single``) continued under it."""
    from tests import _workers_checkpoint as ck

    return {"resume": ck.exact_resume(rank, world_size, [plan], root + "/resume",
                                      stop=False)[plan],
            f"{plan} (saved)": ck.save_under(rank, world_size, plan, root + "/cptp"),
            f"one process -> {plan}": ck.continue_under(rank, world_size, plan,
                                                         root + "/single")}


def checkpoints_zero1(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """At world 2, cp=2 under ZeRO-1 (the optimizer state partitioned over the cp ranks):
    exact resume, its step-3 checkpoint saved to ``root/cpz1`` and continued under ZeRO-3
    over 2, and one process's (``root/single``) continued under it."""
    from tests import _workers_checkpoint as ck

    plan, base = "cp=2,zero=1", root + "/"
    out: dict[str, Any] = {"resume": ck.exact_resume(rank, world_size, [plan],
                                                     base + "resume")[plan]}
    out[f"{plan} (saved)"] = ck.save_under(rank, world_size, plan, base + "cpz1")
    out[f"{plan} -> dp_shard=2,zero=3"] = ck.continue_under(rank, world_size,
                                                            "dp_shard=2,zero=3", base + "cpz1")
    out[f"one process -> {plan}"] = ck.continue_under(rank, world_size, plan, base + "single")
    return out


# ------------------------------------------------------------------ held-out counts under cp
HELD = 8


def held_set(factory: Any = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Held-out rows for token accuracy: lm_batch's rows (their -100 tails of different
    lengths), with the label at every other position set to the untrained model's own
    prediction (``factory``'s, the causal LM's by default), so that each rank's slice counts
    a different, nonzero number of hits."""
    tokens, labels = lm_batch(50, HELD)
    with torch.no_grad():
        guess = (factory or causal_lm)()(tokens).argmax(-1)
    labels[:, ::2] = torch.where(labels[:, ::2] == -100, labels[:, ::2], guess[:, ::2])
    return list(zip(tokens, labels, strict=True))


def token_counts(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(correct tokens, tokens) over the labels that are not -100."""
    kept = labels != -100
    hits = (logits.argmax(-1) == labels) & kept
    return torch.stack([hits.sum(), kept.sum()]).float()


HELD_MODELS = {"causal": causal_lm, "block": block_lm}


def held_counts_reference(name: str) -> dict[str, Any]:
    """One device: the held-out loss, (correct tokens, tokens) and the rows of the whole set,
    for the model ``HELD_MODELS`` names."""
    tokens, labels = (torch.stack(t) for t in zip(*held_set(), strict=True))
    with torch.no_grad():
        logits = HELD_MODELS[name]()(tokens)
    return {"val": float(lm_loss(logits, labels)), "tokens": token_counts(logits, labels),
            "rows": float(len(labels))}


def held_counts(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> dict[str, Any]:
    """Per plan, a one-device metric loop ported as it is: (correct tokens, tokens) counted in
    the loss function given to run.evaluate (each cp rank's slice) and summed with
    run.all_reduce(sliced=True); the rows counted there too (every cp rank sees every row of
    its replica) and summed with sliced=False; the same token counts from model(x) on the
    loader's rows, summed with sliced=False (not under a pipeline, whose model runs only
    through its schedule); and what run.all_reduce says without sliced. ``jobs``: (plan, the
    model HELD_MODELS names)."""
    from plait.runtime import init

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for plan, name in jobs:
        run = init(plan, seed=0, quiet=True)
        try:
            out[plan] = _held_counts_run(run, HELD_MODELS[name]())
        finally:
            run.close()
    return out


def _held_counts_run(run: Any, model: nn.Module) -> dict[str, Any]:
    model = run.parallelize(model)
    held = next(iter(run.loader(held_set(), batch_size=HELD, steps=1, evaluation=True)))
    counts, rows = torch.zeros(2), torch.zeros(())

    def scored(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        counts.add_(token_counts(logits, labels).cpu())
        rows.add_(len(labels))
        return lm_loss(logits, labels)

    # The first call with a new loss function on sequence labels runs it once more (the
    # first labels set to -100: whether it leaves them out, under any plan), so the counts
    # are taken from the second call on, as a loop zeroing them before each call does.
    run.evaluate(model, held, scored)
    counts.zero_()
    rows.zero_()
    got: dict[str, Any] = {"val": float(run.evaluate(model, held, scored))}
    got["tokens"] = run.all_reduce(counts, sliced=True)
    got["rows"] = float(run.all_reduce(rows, sliced=False))
    if run.plan.pp == 1:
        tokens, labels = held
        with torch.no_grad():
            logits = model(tokens.to(run.device))
        got["outputs"] = run.all_reduce(token_counts(logits, labels.to(run.device)),
                                        sliced=False)
    try:
        run.all_reduce(counts)
        got["refused"] = ""
    except ValueError as exc:
        got["refused"] = str(exc)
    return got


def whole(logits: Any) -> torch.Tensor:
    """The logits whole on this rank: a vocabulary-parallel head's (a DTensor split over tp on
    the vocabulary) gathered, a plain tensor as it is; what a metric other than the loss reads
    (``argmax`` over the vocabulary, compared with plain labels)."""
    from torch.distributed.tensor import DTensor

    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def held_counts_tp_reference() -> dict[str, Any]:
    """One device, on :class:`BlockLM` over the held-out set: the loss, (correct tokens,
    tokens), the positive logits, the loss of :func:`shifting_loss`, and the loss after one
    SGD step on the set (lr 0.1, clipped at 1.0: run.step's default)."""
    tokens, labels = (torch.stack(t) for t in zip(*held_set(block_lm), strict=True))
    model = block_lm()
    with torch.no_grad():
        logits = model(tokens)
    got = {"val": float(lm_loss(logits, labels)), "tokens": token_counts(logits, labels),
           "positive": float((logits > 0).sum()), "shifted": float(shifting_loss(logits, labels))}
    trained = reference(block_lm, [(tokens, labels)], lm_loss)["state"]
    model.load_state_dict(trained)
    with torch.no_grad():
        got["after"] = float(lm_loss(model(tokens), labels))  # after one SGD step
    return got


def held_counts_tp(rank: int, world_size: int, plans: list[str]) -> dict[str, Any]:
    """Per plan (tensor parallelism with cp or data ranks), a one-device metric loop on
    :class:`BlockLM`, whose inferred tp plan makes the head vocabulary-parallel: the loss
    through run.evaluate; (correct tokens, tokens) counted in its loss function from the
    logits made whole, and the positive logits counted on the vocabulary-split DTensor itself
    (a sum over a split dim: partial over tp), each summed with run.all_reduce(sliced=True);
    the same two counts from model(x) on the loader's rows, summed with sliced=False; and
    run.evaluate with :func:`shifting_loss` (its loss, or what it says under cp); then one
    run.step on the set with an SGD optimizer built after those evaluations (lr 0.1), and
    the held-out loss after it."""
    from plait.runtime import init

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for plan in plans:
        run = init(plan, seed=0, quiet=True)
        try:
            out[plan] = _held_counts_tp_run(run, run.parallelize(block_lm()))
        finally:
            run.close()
    return out


def _held_counts_tp_run(run: Any, model: nn.Module) -> dict[str, Any]:
    held = next(iter(run.loader(held_set(block_lm), batch_size=HELD, steps=1,
                                evaluation=True)))
    counts = torch.zeros(2)
    positive: list[Any] = []

    def scored(logits: Any, labels: torch.Tensor) -> torch.Tensor:
        counts.add_(token_counts(whole(logits), labels).cpu())
        positive.append((logits > 0).sum())
        return lm_loss(logits, labels)

    run.evaluate(model, held, scored)  # the first call's label check runs the loss twice
    counts.zero_()
    positive.clear()
    got: dict[str, Any] = {"val": float(run.evaluate(model, held, scored)),
                           "sharded": type(positive[0]).__name__ == "DTensor"}
    got["tokens"] = run.all_reduce(counts, sliced=True)
    summed = run.all_reduce(positive[0], sliced=True)
    got["positive"], got["positive_type"] = float(summed), type(summed).__name__
    tokens, labels = held
    with torch.no_grad():
        logits = model(tokens.to(run.device))
    got["outputs"] = run.all_reduce(token_counts(whole(logits), labels.to(run.device)),
                                    sliced=False)
    got["outputs_positive"] = float(run.all_reduce((logits > 0).sum(), sliced=False))
    try:
        got["shifted"] = float(run.evaluate(model, held, shifting_loss))
    except ValueError as exc:
        got["shifted"] = str(exc)

    def counted_on_split_logits(logits: Any, labels: torch.Tensor) -> torch.Tensor:
        counts.add_(token_counts(logits, labels))  # the DTensor compared with plain labels
        return lm_loss(logits, labels)

    try:
        run.evaluate(model, held, counted_on_split_logits)
        got["split_refused"] = ""
    except RuntimeError as exc:
        got["split_refused"] = str(exc)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built after run.evaluate
    try:
        got["stepped"] = float(run.step(model, held, lm_loss, opt))
        got["after"] = float(run.evaluate(model, held, lm_loss))
    except ValueError as exc:
        got["stepped"] = got["after"] = str(exc)
    return got
