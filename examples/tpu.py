"""The training script of examples/train.py, on TPUs: PyTorch/XLA (SPMD) or TorchTPU.

On a TPU VM (one host: every chip of the host in one process):

    PJRT_DEVICE=TPU python examples/tpu.py --accelerator xla --plan dp_shard=4,zero=3
    PJRT_DEVICE=TPU python examples/tpu.py --accelerator xla --plan dp_shard=2,zero=3,tp=2

On the XLA CPU device, as the tests run it (four CPU "devices" in one process):

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python examples/tpu.py --accelerator xla \\
        --plan dp_shard=2,zero=3,tp=2 --steps 20

With TorchTPU, one process per chip, the DTensor/FSDP2 layouts as on GPUs (not yet run on a
TPU, see docs/tpu.md):

    plait run --nproc 4 examples/tpu.py --accelerator tpu --plan dp_shard=4,zero=3

``--host-sync`` reads the loss with ``.item()`` inside the step, and ``--ragged`` feeds a short
last batch: the end-of-run XLA diagnostics name both, with the fix; ``--strict`` stops at the
first step that shows one instead.
"""

import argparse

import torch
from torch.utils.data import DataLoader

import plait
from plait.data import TextDataset
from plait.models.transformer import build, lm_loss

parser = argparse.ArgumentParser()
# --plan and --accelerator are read by plait.init() from the command line (a bad value is one
# line and exit status 2); they are declared here for --help.
parser.add_argument("--plan", default=None, help="layout, e.g. dp_shard=4,zero=3")
parser.add_argument("--accelerator", default=None, help="xla (PyTorch/XLA) or tpu (TorchTPU)")
parser.add_argument("--format", default="text")  # json: events, read by plait.init()
parser.add_argument("--model", default="tiny")
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--global-batch", "--batch-size", dest="batch_size", type=int, default=16)
parser.add_argument("--seq", "--seq-len", dest="seq_len", type=int, default=64)
parser.add_argument("--strict", action="store_true", help="raise at the first recompilation, "
                    "CPU fallback or host sync after warm-up (XLA)")
parser.add_argument("--host-sync", action="store_true", help="call .item() inside the step")
parser.add_argument("--ragged", action="store_true", help="a data loader without drop_last")
args = parser.parse_args()

run = plait.init(log_every=10, strict=args.strict)
model = run.parallelize(build(args.model))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
dataset = TextDataset(seq_len=args.seq_len)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(logits, targets)
    if args.host_sync and loss.item() > 100:  # a host read in the step: the graph runs early
        print("loss diverged")
    return loss


if args.ragged:  # 3 batches and a short one per epoch: the short one compiles the step again
    subset = torch.utils.data.Subset(dataset, range(3 * args.batch_size + args.batch_size // 2))
    loader = DataLoader(subset, batch_size=args.batch_size)
    batches = [b for _ in range(-(-args.steps // len(loader))) for b in loader][:args.steps]
    run.total_steps = len(batches)
else:
    batches = run.loader(dataset, batch_size=args.batch_size, steps=args.steps)
for batch in batches:
    run.step(model, batch, loss_fn, opt)
info = run.finish()
if run.is_main:
    print(f"FINAL {info['final_loss']:.6f} on {info['accelerator']}")
