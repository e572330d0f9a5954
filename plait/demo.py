"""The demo job: the tiny reference transformer learns Shakespeare, byte by byte.

Run it as ``plait demo`` (2 processes on CPU), or directly under any launcher:
``plait run --nproc 4 -m plait.demo --plan dp=2,tp=2``. It prints the plan, progress, the final
loss next to the corpus's unigram entropy (the loss of a model that ignores context: beating it
means the model learned from context) and the throughput.
"""

from __future__ import annotations

import argparse

import torch

import plait
from plait.data import TextDataset, load_corpus, unigram_entropy
from plait.models.transformer import build, lm_loss, preset
from plait.parallel.layout import layout_of


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="plait.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default=None, help="layout, e.g. dp=2 or dp=2,tp=2 (default: DP "
                   "over every rank)")
    p.add_argument("--model", default="tiny", help="reference-model preset (default: tiny)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    p.add_argument("--global-batch", "--batch-size", "--batch", dest="batch_size",
                   metavar="N", type=int,
                   default=32, help="sequences per optimizer step (default: 32; also spelt "
                   "--batch-size, --batch)")
    p.add_argument("--seq", "--seq-len", dest="seq_len", metavar="N", type=int, default=128,
                   help="tokens per sequence (default: 128; also spelt --seq-len)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--format", choices=("text", "table", "json"), default="text",
                   help="text for people, json for programs: JSON Lines on stdout, one event "
                   "per line (default: text)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    run = plait.init(args.plan, seed=args.seed, log_every=args.log_every, ledger=True,
                     format=args.format)
    cfg = preset(args.model, max_seq_len=max(args.seq_len, preset(args.model).max_seq_len))
    # The layout in words, and the string that reproduces it where the words differ from it.
    text, words = run.plan.to_string(), run.plan.describe()
    if run.format != "json":  # in JSON, plait.init's own "plan" event says it
        run.print(f"plan: {words}" + (f"  [{text}]" if text != words else "") + f" on "
                  f"{run.world_size} process(es), {run.accelerator.name}/"
                  f"{run.accelerator.backend}")
    run.say(f"model: {args.model} ({cfg.num_params() / 1e6:.2f}M parameters), "
            f"global batch {args.batch_size} x {args.seq_len} tokens, {args.steps} steps",
            "model", model=args.model, parameters=cfg.num_params(),
            global_batch=args.batch_size, seq=args.seq_len, steps=args.steps)
    corpus = load_corpus()
    entropy = unigram_entropy(corpus)
    model = run.parallelize(build(cfg, seed=args.seed))
    steps_run = layout_of(model).applied
    run.say(f"layout: {' -> '.join(steps_run) if steps_run else 'one device, unchanged'}",
            "layout", applied=list(steps_run))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps,
                                                pct_start=0.1)
    dataset = TextDataset(seq_len=args.seq_len, split="train")
    for batch in run.loader(dataset, batch_size=args.batch_size, steps=args.steps):
        run.step(model, batch, lm_loss, opt)
        sched.step()
    info = run.finish()
    final = info["final_loss"]
    if final is not None:
        side = "below" if final <= entropy else "above"
        run.say(f"unigram entropy {entropy:.4f} nats/token (a context-free model's loss); "
                f"final loss {final:.4f} is {abs(entropy - final):.4f} {side} it", "result",
                final_loss=final, unigram_entropy=entropy, below_entropy=final <= entropy)
    return info


if __name__ == "__main__":
    main()
