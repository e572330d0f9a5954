"""Tensor (and sequence) parallelism on the reference transformer, on the bundled corpus.

    plait run --nproc 2 examples/tensor_parallel.py --plan tp=2
    plait run --nproc 2 examples/tensor_parallel.py --plan tp=2,sp=true
    plait run --nproc 4 examples/tensor_parallel.py --plan dp=2,tp=2
    python examples/tensor_parallel.py            # one device, same training

The training loop is the plain one: plait.init reads the plan, run.parallelize shards attention
heads, MLP columns/rows, the embedding and the head over the tp axis (a layer plan you can print:
plait.parallel.tp_plans.REFERENCE_STYLES), and run.step computes the loss under torch's
loss_parallel() so the full-vocabulary logits never exist on one rank. A plain AdamW works: every
parameter is a DTensor after TP.
"""

import argparse

import torch

import plait
from plait.data import TextDataset
from plait.models.transformer import build, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)  # --steps 4: the tests' short run
    steps = parser.parse_known_args()[0].steps            # (--plan is read by plait.init)
    torch.set_num_threads(1)
    run = plait.init(log_every=10)
    model = run.parallelize(build("tiny", seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in run.loader(TextDataset(seq_len=64), batch_size=8, steps=steps):
        run.step(model, batch, lm_loss, opt)
    run.finish()


if __name__ == "__main__":
    main()
