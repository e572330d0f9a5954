"""Module-level model factories and workers for tests/test_tensor_parallel.py (spawned processes
must be able to import them)."""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB = 255  # not divisible by 2: exercises vocabulary padding


class LogitsOnly(nn.Module):
    """HF causal-LM -> plain logits, so the default cross-entropy loss applies."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits


def gpt2_factory() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return LogitsOnly(GPT2LMHeadModel(cfg))


def llama_factory() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=32, attn_implementation="sdpa")
    return LogitsOnly(LlamaForCausalLM(cfg))


def token_batches(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    tokens = torch.randint(0, VOCAB, (4, 17), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ------------------------------------------------------------------------------ per-layer cases
LAYER_CASES = ("linear_colwise", "linear_rowwise", "conv1d_colwise", "conv1d_rowwise",
               "conv1d_qkv", "vocab_embedding", "vocab_head_loss", "sp_norm", "region_mlp")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def layer_worker(rank: int, world_size: int, case: str) -> dict[str, float]:
    """One parallel layer against the same layer unsharded: outputs, input and weight grads."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from transformers.pytorch_utils import Conv1D

    from plait.parallel.tensor import make_style

    torch.set_num_threads(1)
    tp = world_size
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    h, f, b, s, vocab = 16, 32, 2, 8, 37
    x = torch.randn(b, s, h)
    style, sp = {"linear_colwise": "colwise", "linear_rowwise": "rowwise",
                 "conv1d_colwise": "colwise", "conv1d_rowwise": "rowwise",
                 "conv1d_qkv": "colwise_qkv", "vocab_embedding": "vocab_embedding",
                 "vocab_head_loss": "vocab_head", "sp_norm": "sequence_parallel",
                 "region_mlp": None}[case], case == "sp_norm"
    if case.startswith("linear"):
        ref = nn.Linear(h, f) if case.endswith("colwise") else nn.Linear(f, h)
    elif case == "conv1d_qkv":
        ref = Conv1D(3 * f, h)
    elif case.startswith("conv1d"):
        ref = Conv1D(f, h) if case.endswith("colwise") else Conv1D(h, f)
    elif case == "vocab_embedding":
        ref = nn.Embedding(vocab, h)
    elif case == "vocab_head_loss":
        ref = nn.Linear(h, vocab, bias=False)
    elif case == "sp_norm":
        ref = nn.RMSNorm(h)
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
    else:  # a whole MLP: region + colwise up + rowwise down, one backward all-reduce
        ref = nn.Sequential(nn.Linear(h, f), nn.GELU(), nn.Linear(f, h))
    par = copy.deepcopy(ref)
    if case == "region_mlp":
        for name, st in (("", "region"), ("0", "colwise"), ("2", "rowwise")):
            target = par.get_submodule(name) if name else par
            parallelize_module(target, mesh, make_style(st, target, name or "mlp", sp=False))
    else:
        parallelize_module(par, mesh, make_style(style, par, case, sp=sp))

    def shard(t: torch.Tensor, dim: int, pack: int = 1) -> torch.Tensor:
        parts = t.chunk(pack, dim=dim)
        return torch.cat([p.chunk(tp, dim=dim)[rank] for p in parts], dim=dim)

    out: dict[str, float] = {}
    if case == "vocab_embedding":
        idx = torch.randint(0, vocab, (b, s))
        y_ref, y = ref(idx), par(idx)
        g = torch.randn_like(y_ref)
        (y_ref * g).sum().backward()
        (y * g).sum().backward()
        out["output"] = _rel(y, y_ref)
        out["weight_grad"] = _rel(_full(par.weight.grad), ref.weight.grad)
        return out
    if case == "vocab_head_loss":
        targets = torch.randint(0, vocab, (b, s))
        xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        loss_ref = nn.functional.cross_entropy(ref(xr).reshape(-1, vocab), targets.reshape(-1))
        loss_ref.backward()
        with loss_parallel():
            logits = par(xp)
            out["logits_local_fraction"] = logits.to_local().shape[-1] / vocab
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
            loss.backward()
        out["output"] = _rel(_full(loss), loss_ref)
        out["input_grad"] = _rel(xp.grad, xr.grad)
        out["weight_grad"] = _rel(_full(par.weight.grad), ref.weight.grad)
        return out
    col = case in ("linear_colwise", "conv1d_colwise", "conv1d_qkv")
    if case == "sp_norm":
        xr = x.clone().requires_grad_()
        xp = shard(x, 1).clone().requires_grad_()
    elif col or case == "region_mlp":
        xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    else:  # row-parallel: each rank holds its slice of the input features
        x = torch.randn(b, s, f)
        xr = x.clone().requires_grad_()
        xp = shard(x, -1).clone().requires_grad_()
    y_ref, y = ref(xr), par(xp)
    g = torch.randn_like(y_ref)
    if col:
        pack = 3 if case == "conv1d_qkv" else 1
        expected, g_local = shard(y_ref, -1, pack), shard(g, -1, pack)
    elif case == "sp_norm":
        expected, g_local = shard(y_ref, 1), shard(g, 1)
    else:
        expected, g_local = y_ref, g
    (y_ref * g).sum().backward()
    (y * g_local).sum().backward()
    out["output"] = _rel(y, expected)
    xgrad_expected = xr.grad if col or case == "region_mlp" else (
        shard(xr.grad, 1) if case == "sp_norm" else shard(xr.grad, -1))
    out["input_grad"] = _rel(xp.grad, xgrad_expected)
    for name, p in ref.named_parameters():
        out[f"{name}_grad"] = _rel(_full(par.get_parameter(name).grad), p.grad)
    dist.barrier()
    return out


def layers_worker(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    """Every per-layer case in one process group (one spawn instead of nine)."""
    return {case: layer_worker(rank, world_size, case) for case in LAYER_CASES}


# ------------------------------------------------------------------------ inference test model
class CustomAttention(nn.Module):
    def __init__(self, dim: int = 32, n_heads: int = 4):
        super().__init__()
        self.n_heads = n_heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (lin(x).view(b, t, self.n_heads, -1).transpose(1, 2)
                   for lin in (self.wq, self.wk, self.wv))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))


class CustomMLP(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class CustomBlock(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), CustomAttention(dim)
        self.ln2, self.mlp = nn.LayerNorm(dim), CustomMLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CustomLM(nn.Module):
    """A model plait ships no plan for: names and reshapes of its own."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(CustomBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def custom_factory() -> nn.Module:
    return CustomLM()


# ------------------------------------------------------------------- foreach optimizer + clip
def foreach_adamw_worker(rank: int, world_size: int, plan_string: str) -> dict:
    """Reference model under TP with a plain foreach AdamW (whose kernels reject a mix of DTensor
    and plain parameters) and gradient clipping: every parameter must be a DTensor, and the step
    must run."""
    from torch.distributed.tensor import DTensor

    import plait
    from plait.models.transformer import build, lm_loss

    torch.set_num_threads(1)
    run = plait.init(plan_string, seed=0, quiet=True, log_every=1)
    model = run.parallelize(build("test", seed=0))
    kinds = {type(p).__name__ for p in model.parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 17), generator=gen)
    losses = [float(run.step(model, (tokens[:, :-1], tokens[:, 1:]), lm_loss, opt))
              for _ in range(2)]
    all_dtensor = all(isinstance(p, DTensor) for p in model.parameters())
    run.close()
    return {"kinds": sorted(kinds), "all_dtensor": all_dtensor, "losses": losses}


# ------------------------------------------------------------- SP across a pipeline boundary
def sp_stage_worker(rank: int, world_size: int, models: list[str]) -> dict[str, dict]:
    """Both stages of a pp=2 split of each named tests/_traffic_models.py model, laid out for
    tp=2,sp=1 in this process and chained by hand (stage 0's output fed to stage 1, as the
    schedule sends it): per model the shape stage 0 hands on, how far it is from this rank's
    half of the hidden states one device feeds the next stage's first block, and how far the
    logits, the loss and every gradient are from one device's."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from plait.parallel.pipeline_split import build_stage_module, plan_stages
    from plait.parallel.tensor import apply_tensor_parallel, plan_for_stages
    from plait.plan import Plan
    from plait.runtime import init
    from tests import _traffic_models as T

    torch.set_num_threads(1)
    out: dict[str, dict] = {}
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, T.VOCAB, (T.BATCH, T.SEQ), generator=gen)
    labels = tokens.roll(-1, 1)
    for name in models:
        run = init("tp=2,sp=1", quiet=True, seed=0)
        try:
            # eval: no dropout (GPT-2's), so one device draws nothing the stages do not
            ref, model = T.MODELS[name]().eval(), T.MODELS[name]().eval()
            path, specs = plan_stages(model, Plan.from_string("pp=2,microbatches=2"))
            plan = plan_for_stages(model, run.plan)
            stages = [apply_tensor_parallel(build_stage_module(model, path, s), run.mesh, plan)
                      for s in specs]
            fed: list[torch.Tensor] = []
            block = ref.get_submodule(f"{path}.{specs[1].start}".lstrip("."))
            hook = block.register_forward_pre_hook(lambda m, a, fed=fed: fed.append(a[0].detach()))
            want = ref(tokens)
            hook.remove()
            torch.nn.functional.cross_entropy(want.reshape(-1, T.VOCAB),
                                              labels.reshape(-1)).backward()
            sent = stages[0](tokens)
            logits = stages[1](sent)
            with loss_parallel():
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, T.VOCAB),
                                                         labels.reshape(-1))
                loss.backward()
            whole = logits.full_tensor() if isinstance(logits, DTensor) else logits
            half = fed[0].chunk(2, dim=1)[rank]
            # A weight tied across the stages (GPT-2's embedding and head) is one copy per
            # stage, each with its stage's share of the gradient: the pipeline sums them.
            # Keyed by the one-device parameter (a tied one has two names there).
            summed: dict[str, torch.Tensor] = {}
            first = {id(p): n for n, p in reversed(list(
                ref.named_parameters(remove_duplicate=False)))}
            seen: set[int] = set()
            for stage in stages:
                for n, p in stage.named_parameters(remove_duplicate=False):
                    if id(p) in seen or p.grad is None:
                        continue
                    seen.add(id(p))
                    key = first[id(ref.get_parameter(n))]
                    g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    summed[key] = summed[key] + g if key in summed else g
            grads = {n: _rel(g, ref.get_parameter(n).grad) for n, g in summed.items()}
            out[name] = {"sent": tuple(sent.shape), "whole": tuple(fed[0].shape),
                         "sent_diff": _rel(sent, half) if sent.shape == half.shape else 1.0,
                         "logits": _rel(whole, want), "grads": grads,
                         "params": len(list(ref.parameters()))}
        finally:
            run.close()
    return out


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1))


def _token_steps(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from tests import _traffic_models as T

    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, T.VOCAB, (T.BATCH, T.SEQ), generator=gen)
        out.append((tokens, tokens.roll(-1, 1)))
    return out


def adamw_one_device(name: str, steps: int) -> dict:
    """tests/_traffic_models.py's model ``name`` trained on one device: AdamW, torch's clipping
    at 1.0 (plait's default), on :func:`_token_steps`; the loss of each step and the state."""
    from tests import _traffic_models as T

    model = T.MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    losses = []
    for tokens, labels in _token_steps(steps):
        loss = _lm_loss(model(tokens), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": {k: v.detach().clone()
                                        for k, v in model.state_dict().items()}}


def adamw_layout(rank: int, world_size: int, plan: str, models: list[str], steps: int
                 ) -> dict[str, dict]:
    """Each named model trained under ``plan`` as :func:`adamw_one_device` trains it, with the
    ledger on after the first step: per model the losses, the whole state (rank 0) and the
    ledger's rows."""
    from plait.runtime import init
    from tests import _traffic_models as T

    torch.set_num_threads(1)
    out = {}
    for name in models:
        run = init(plan, quiet=True, ledger=True, seed=0)
        run.ledger_warmup = 1
        try:
            model = run.parallelize(T.MODELS[name]())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
            losses = [float(run.step(model, batch, _lm_loss, opt))
                      for batch in _token_steps(steps)]
            comm = run.summary()["comm"]
            state = run.full_state_dict(model)
            out[name] = {"losses": losses, "state": state if rank == 0 else None,
                         "comm": comm}
        finally:
            run.close()
    return out
