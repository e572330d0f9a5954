"""Workers for tests/test_gloo_collectives.py (module level: spawned processes import them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ReduceOp

from plait.comm.ledger import Ledger
from plait.parallel.gloo_collectives import GlooAllGather, GlooReduceScatter

# op name -> (op as FSDP2 passes it, how torch's gloo reduce-scatter computes the reference)
OPS: dict[str, Any] = {
    "sum": ReduceOp.SUM,
    "avg": ReduceOp.AVG,
    "premul_sum": ReduceOp.PREMUL_SUM(0.25),  # what FSDP2 passes for a custom divide factor
    "max": ReduceOp.MAX,
    "min": ReduceOp.MIN,
    "product": ReduceOp.PRODUCT,
}


def _input(rank: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _torch_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op_name: str,
                          group: Any) -> None:
    """torch's own gloo reduce-scatter; gloo refuses PREMUL_SUM, so that one is SUM x factor."""
    if op_name == "premul_sum":
        dist.reduce_scatter_single(out, inp, op=ReduceOp.SUM, group=group)
        out.mul_(OPS[op_name].factor)
    else:
        dist.reduce_scatter_single(out, inp, op=OPS[op_name], group=group)


def compare_with_torch(rank: int, world: int, cases: list[tuple[int, str, str]],
                       subgroups: bool = False) -> list[dict[str, Any]]:
    """For each (elements per rank, dtype, op): max |custom - torch| for RS and AG.

    ``subgroups``: run inside groups of 2 ranks ({0,1}, {2,3}, ...) instead of the world, so
    group ranks differ from global ranks.
    """
    group = None
    if subgroups:
        groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        group = groups[rank // 2]
    n = dist.get_world_size(group)
    rs, ag = GlooReduceScatter(), GlooAllGather()
    out = []
    for salt, (k, dtype_name, op_name) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        inp = _input(rank, n * k, dtype, salt)
        if op_name == "product":  # keep products of n values near 1
            inp = 1 + 0.1 * inp
        mine = rs.allocate((k,), dtype=dtype, device=inp.device)
        work = rs(mine, inp.clone(), group or dist.group.WORLD, OPS[op_name])
        ref = torch.empty(k, dtype=dtype)
        _torch_reduce_scatter(ref, inp.clone(), op_name, group)
        shard = _input(rank, k, dtype, salt + 100)
        gathered = ag.allocate((n * k,), dtype=dtype, device=shard.device)
        gathered.fill_(float("nan"))
        gathered.narrow(0, dist.get_rank(group) * k, k).copy_(shard)  # as FSDP2's copy-in
        ag_work = ag(gathered, gathered.narrow(0, dist.get_rank(group) * k, k),
                     group or dist.group.WORLD, async_op=True)
        ag_work.wait()
        separate = torch.full((n * k,), float("nan"), dtype=dtype)
        ag(separate, shard.clone(), group or dist.group.WORLD)  # input not inside the output
        ag_ref = torch.empty(n * k, dtype=dtype)
        dist.all_gather_single(ag_ref, shard, group=group)
        out.append({"case": (k, dtype_name, op_name), "rs_returned": work,
                    "rs_diff": (mine.float() - ref.float()).abs().max().item() if k else 0.0,
                    "rs_scale": ref.float().abs().max().item() if k else 0.0,
                    "ag_equal": torch.equal(gathered, ag_ref) and torch.equal(separate, ag_ref)})
    return out


def ledger_entries(rank: int, world: int, k: int) -> list[dict[str, Any]]:
    """One custom reduce-scatter and one custom all-gather inside a ledger."""
    ledger = Ledger()
    inp = torch.ones(world * k)
    with ledger:
        GlooReduceScatter()(torch.empty(k), inp, dist.group.WORLD, ReduceOp.AVG)
        GlooAllGather()(torch.empty(world * k), torch.ones(k), dist.group.WORLD)
    return [{key: v for key, v in e.items() if key != "time_s"} for e in ledger.local_entries()]


def refused(rank: int, world: int) -> list[str]:
    """The errors for an unsupported op, an async reduce-scatter and mismatched sizes."""
    msgs = []
    rs = GlooReduceScatter()
    for call in (lambda: rs(torch.empty(2), torch.ones(2 * world), dist.group.WORLD,
                            ReduceOp.BAND),
                 lambda: rs(torch.empty(2), torch.ones(2 * world), dist.group.WORLD,
                            ReduceOp.SUM, async_op=True),
                 lambda: rs(torch.empty(2), torch.ones(3), dist.group.WORLD, ReduceOp.SUM),
                 lambda: GlooAllGather()(torch.empty(3), torch.ones(2), dist.group.WORLD)):
        try:
            call()
            msgs.append("")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def installed_comms(rank: int, world: int, plan: Any) -> list[str]:
    """Class names of the reduce-scatter / all-gather the FSDP2 modules of a model use."""
    from plait.models.transformer import build
    from plait.runtime import init

    run = init(plan, quiet=True, seed=0)
    model = run.parallelize(build("test"))
    names = set()
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        for group in state()._fsdp_param_groups:
            names.add(type(group._reduce_scatter_comm).__name__)
            names.add(type(group._all_gather_comm).__name__)
    run.close()
    return sorted(names)


class OddMLP(nn.Module):
    """Widths that no group size divides: FSDP2 pads every shard."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 13)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 13))
                                    for _ in range(3))
        self.out = nn.Linear(13, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def odd_mlp() -> nn.Module:
    return OddMLP()


def odd_batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
