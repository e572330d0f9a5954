"""The bodies of the CUDA tests (tests/test_cuda.py), written for any device type so that their
logic can be exercised on the CPU too; the tests themselves run them on ``cuda``.

Each worker runs inside ``plait.spawn.run_distributed`` (a one-rank process group: nccl for
cuda, gloo for cpu) and returns plain numbers for the parent to compare.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from plait.data import TextDataset
from plait.data.loader import DistributedLoader
from plait.models.transformer import build, lm_loss, preset

CFG = preset("test", max_seq_len=32)
STEPS, BATCH, SEQ = 3, 4, 32


def _batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = DistributedLoader(TextDataset(seq_len=SEQ), BATCH)
    return [tuple(t.to(device) for t in loader.batch(i)) for i in range(STEPS)]


def _reference(device: torch.device) -> tuple[list[float], torch.nn.Module]:
    """Plain single-device training: the losses every check compares with."""
    model = build(CFG, seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for x, y in _batches(device):
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def placement(rank: int, world: int, device_type: str) -> dict:
    """plait.init picks the local device; parallelize and step keep everything on it."""
    import plait

    run = plait.init(accelerator=device_type, quiet=True, log_every=1, seed=0)
    model = run.parallelize(build(CFG, seed=0).to(run.device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = [run.step(model, b, lm_loss, opt) for b in
              run.loader(TextDataset(seq_len=SEQ), batch_size=BATCH, steps=STEPS)]
    devices = {p.device.type for p in model.parameters()}
    states = {t.device.type for s in opt.state.values() for t in s.values()
              if isinstance(t, torch.Tensor) and t.dim() > 0}
    ref, _ = _reference(run.device)
    info = {"device": str(run.device), "param_devices": sorted(devices),
            "state_devices": sorted(states), "losses": losses, "reference": ref}
    run.close()
    return info


def bf16_autocast(rank: int, world: int, device_type: str) -> dict:
    """mixed_precision=bf16: matmuls in bf16, master weights and gradients in fp32, and a loss
    close to the fp32 run's."""
    import plait

    run = plait.init("mixed_precision=bf16", accelerator=device_type, quiet=True,
                     log_every=1, seed=0)
    model = run.parallelize(build(CFG, seed=0).to(run.device))
    seen: list[torch.dtype] = []
    hook = model.layers[0].attention.q_proj.register_forward_hook(
        lambda m, i, o: seen.append(o.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = [run.step(model, b, lm_loss, opt) for b in
              run.loader(TextDataset(seq_len=SEQ), batch_size=BATCH, steps=STEPS)]
    hook.remove()
    ref, _ = _reference(run.device)
    info = {"matmul_dtypes": sorted({str(d) for d in seen}),
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "losses": losses, "reference": ref}
    run.close()
    return info


def compiled(rank: int, world: int, device_type: str) -> dict:
    """torch.compile of the reference model: same logits and gradients as eager."""
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    eager = build(CFG, seed=0).to(device)
    comp = torch.compile(copy.deepcopy(eager))
    x, y = _batches(device)[0]
    out_e, out_c = eager(x), comp(x)
    lm_loss(out_e, y).backward()
    lm_loss(out_c, y).backward()
    grad_diff = max((a.grad - b.grad).abs().max().item()
                    for a, b in zip(eager.parameters(), comp.parameters(), strict=True))
    return {"logit_diff": (out_e - out_c).abs().max().item(), "grad_diff": grad_diff}


def plan_compile_bf16(rank: int, world: int, device_type: str) -> dict:
    """``compile`` in the plan with bf16 autocast, as bench/mfu.py trains: each block compiled
    after the layout, graphs really built, and the losses of the same plan run eagerly."""
    import plait
    from plait._torch_compat import dynamo_graph_count, reset_dynamo

    def losses(plan: str) -> list[float]:
        run = plait.init(plan, accelerator=device_type, quiet=True, log_every=1, seed=0)
        model = run.parallelize(build(CFG, seed=0).to(run.device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = [float(run.step(model, b, lm_loss, opt)) for b in
               run.loader(TextDataset(seq_len=SEQ), batch_size=BATCH, steps=STEPS)]
        run.close()
        return out

    reset_dynamo()
    compiled_losses = losses("mixed_precision=bf16,compile")
    graphs = dynamo_graph_count()
    return {"losses": compiled_losses, "reference": losses("mixed_precision=bf16"),
            "graphs": graphs}


def fsdp2_one_rank(rank: int, world: int, device_type: str) -> dict:
    """FSDP2 (fully_shard per block, then the root) on a one-rank mesh, trained through plait's
    train_step (gradient sync switch, clipping of DTensor gradients): the same losses as one
    device without it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from plait.plan import Plan
    from plait.train import train_step

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device_type, (1,))
    model = build(CFG, seed=0).to(device)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = Plan()
    losses = [train_step(model, b, lm_loss, opt, plan=plan, device=device).item()
              for b in _batches(device)]
    ref, _ = _reference(device)
    kinds = sorted({type(p).__name__ for p in model.parameters()})
    return {"losses": losses, "reference": ref, "param_types": kinds}


def tp_one_rank(rank: int, world: int, device_type: str) -> dict:
    """plait's tensor-parallel layout (DTensor, vocabulary-parallel loss) on a one-rank tp mesh:
    every parameter a DTensor, the same losses as one device."""
    from plait.mesh import build_mesh
    from plait.parallel.tensor import apply_tensor_parallel
    from plait.plan import Plan
    from plait.train import train_step

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    plan = Plan()
    mesh = build_mesh(plan, device_type, 1)
    model = apply_tensor_parallel(build(CFG, seed=0).to(device), mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = [float(train_step(model, b, lm_loss, opt, plan=plan, device=device))
              for b in _batches(device)]
    ref, _ = _reference(device)
    kinds = sorted({type(p).__name__ for p in model.parameters()})
    return {"losses": losses, "reference": ref, "param_types": kinds}


def ledger_backend(rank: int, world: int, device_type: str) -> dict:
    """The ledger records a collective on this backend with its payload bytes."""
    from plait.comm.ledger import Ledger

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    ledger = Ledger()
    t = torch.ones(1024, device=device)  # 4 KiB
    with ledger:
        dist.all_reduce(t)
        dist.all_reduce(t)
    rows = ledger.report(steps=1).to_dict()["rows"]
    return {"backend": str(dist.get_backend()), "rows": rows}
