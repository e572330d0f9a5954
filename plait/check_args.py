"""``plait check``'s command line, in a module of its own that imports no torch: the CLI builds
every subcommand's parser at start, and ``plait run`` must not pay for torch's import there."""

from __future__ import annotations

import argparse

from .outputs import add_format


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True,
                        help="layout to check, e.g. dp=2 or dp=2,tp=2 (world size = product)")
    parser.add_argument("--model", default="test",
                        help="your model as pkg.module:function returning (model, dataset, "
                        "loss_fn), or a reference-model preset (default: test)")
    parser.add_argument("--steps", type=int, default=5, metavar="N",
                        help="optimizer steps, on each side (default: 5)")
    parser.add_argument("--global-batch", "--batch-size", "--batch", dest="batch_size",
                        metavar="N", type=int, default=8,
                        help="sequences per optimizer step (default: 8; also spelt "
                        "--batch-size, --batch)")
    parser.add_argument("--seq", "--seq-len", dest="seq_len", metavar="N", type=int,
                        default=None, help="tokens per sequence of a reference preset's batches "
                        "(default: 16); with your own factory, its dataset decides (also spelt "
                        "--seq-len)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="optimizer both runs use (default: adamw)")
    parser.add_argument("--lr", type=float, default=1e-3, metavar="LR",
                        help="learning rate both runs use (default: 1e-3)")
    parser.add_argument("--tolerance", type=float, default=None, metavar="BOUND",
                        help="an absolute bound on loss and parameter differences; default: "
                        "the optimizer's relative bounds (sgd: loss 1e-5, parameters 1e-4 of "
                        "their displacement; adamw: 1e-5 and 1e-3; wider under "
                        "mixed_precision=bf16 or fp16, whose rounding is coarser)")
    parser.add_argument("--timeout", type=float, default=300, metavar="SECONDS",
                        help="seconds before a hang fails (default: 300)")
    add_format(parser)
