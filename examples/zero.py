"""Sharded data parallelism (ZeRO / FSDP2) on the bundled Shakespeare corpus.

    python examples/zero.py                                    # one process, the reference
    plait run --nproc 2 examples/zero.py --plan dp_shard=2,zero=3
    plait run --nproc 2 examples/zero.py --plan dp_shard=2,zero=1        # optimizer state only
    plait run --nproc 2 examples/zero.py --plan dp_shard=2,zero=2,mp=bf16
    plait run --nproc 4 examples/zero.py --plan dp_replicate=2,dp_shard=2,zero=3   # HSDP
    plait run --nproc 2 examples/zero.py --plan dp_shard=2,zero=3,offload,ac=full

(``torchrun --nproc-per-node 2 examples/zero.py --plan ...`` works the same.) The script is
the plain single-device loop; only ``--plan`` changes. At the end every rank's memory is
printed beside the closed form for the plan: watch the model-state row fall from 16Ψ
(DDP) to 16Ψ/d (ZeRO-3), and "gathered" show what ZeRO-2 keeps between forward and backward.
"""

import argparse

import torch

import plait
from plait.data import TextDataset
from plait.models.transformer import build, lm_loss

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)  # --steps 4: the tests' short run
steps = parser.parse_known_args()[0].steps            # (--plan is read by plait.init)
run = plait.init(seed=0, log_every=10)
model = run.parallelize(build("tiny", seed=0))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
for batch in run.loader(TextDataset(seq_len=64), batch_size=16, steps=steps):
    run.step(model, batch, lm_loss, opt)
run.finish()   # run summary, then the per-rank memory table (plait.memory)
