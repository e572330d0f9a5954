"""N-D parallelism: data x tensor (x pipeline) parallel on one named device mesh.

    plait run --nproc 4 examples/nd_parallel.py                           # dp_shard=2,zero=3,tp=2
    plait run --nproc 4 examples/nd_parallel.py --plan dp=2,tp=2          # DDP-style replicas x TP
    plait run --nproc 8 examples/nd_parallel.py \
        --plan pp=2,dp_shard=2,zero=3,tp=2,mb=4
    plait run --nproc 4 examples/nd_parallel.py --steps 4      # a short run

Every plan becomes one mesh with the axes ``pp, dp_replicate, dp_shard, cp, tp`` (outermost
first). Ranks that differ only in their ``tp`` coordinate share one copy of each layer, split by
columns and rows; ranks that differ in a data coordinate see different rows of the global batch;
ranks that differ in ``pp`` hold different layers. The script prints which ranks share each axis,
trains, and prints the communication ledger: the bytes each axis carried, per collective, beside
the closed form. TP traffic (activations, every layer) stays on the innermost axis, the one you
would put inside a node; data-parallel traffic (gradients, once per step) crosses the outer one.
"""

import argparse

import torch
import torch.distributed as dist

import plait
from plait.data import TextDataset
from plait.models.transformer import build, lm_loss, preset
from plait.plan import MESH_AXES

DEFAULT_PLAN = "dp_shard=2,zero=3,tp=2"


def groups(run: plait.Run, axis: str) -> list[list[int]]:
    """The rank groups along ``axis``: every set of ranks that differ only in that coordinate."""
    mine = dist.get_process_group_ranks(run.mesh[axis].get_group())
    everyone: list[list[int]] = [[] for _ in range(run.world_size)]
    dist.all_gather_object(everyone, mine)
    return sorted({tuple(g) for g in everyone})  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", default=DEFAULT_PLAN)
    parser.add_argument("--accelerator", default=None)  # read by plait.init()
    parser.add_argument("--format", default="text")  # json: events, read by plait.init()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = plait.init(args.plan, log_every=10, ledger=True)
    run.print(f"plan {run.plan.to_string()}: {run.plan.describe()}")
    for axis in MESH_AXES:
        if run.mesh.size(axis) > 1:
            run.print(f"  {axis:<13} size {run.mesh.size(axis)}: groups {groups(run, axis)}")

    cfg = preset("tiny", n_layers=4)  # 4 heads, 4 blocks: splits over tp=2/4 and pp=2/4
    model = run.parallelize(build(cfg, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in run.loader(TextDataset(seq_len=64), batch_size=8, steps=args.steps):
        run.step(model, batch, lm_loss, opt)
    run.finish()  # summary, then the ledger: bytes per mesh axis and collective


if __name__ == "__main__":
    main()
