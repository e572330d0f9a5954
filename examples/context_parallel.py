"""Context parallelism: each rank holds a slice of every sequence, on the bundled Shakespeare
corpus.

    python examples/context_parallel.py                              # one process, the reference
    plait run --nproc 2 examples/context_parallel.py --plan cp=2
    plait run --nproc 4 examples/context_parallel.py --plan dp_shard=2,zero=3,cp=2
    plait run --nproc 4 examples/context_parallel.py --plan dp=2,cp=2

The script is the plain single-device loop; only ``--plan`` changes. Under cp=2 each rank runs
the model on 128 of every 256-token sequence (chunks 0 and 3 of 4 on rank 0, 1 and 2 on rank
1), all-gathers keys and values for attention, and the loss printed is the token mean over
whole sequences, as one device computes it. plait's reference transformer takes the slice's
global positions as ``position_ids`` for its rotary embeddings; see docs/context_parallel.md.
"""

import argparse

import torch

import plait
from plait.data import TextDataset
from plait.models.transformer import TransformerConfig, build, lm_loss

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)  # --steps 3: the tests' short run
steps = parser.parse_known_args()[0].steps            # (--plan is read by plait.init)
SEQ = 256
run = plait.init(seed=0, log_every=10)
cfg = TransformerConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
model = run.parallelize(build(cfg, seed=0))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
cp = run.plan.cp
run.print(f"cp={cp}: each rank holds {SEQ // cp} of every {SEQ}-token sequence")
for batch in run.loader(TextDataset(seq_len=SEQ), batch_size=4, steps=steps):
    run.step(model, batch, lm_loss, opt)
run.finish()
