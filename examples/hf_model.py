"""A Hugging Face model under plait, in the Hugging Face batch convention.

Each batch is one dict, ``{"input_ids": ..., "labels": ...}``, and the model computes its own
loss (``run.step(model, batch, None, opt)`` uses ``output.loss``). Each row counts the labels
of a random-length prefix only (the rest is labelled -100, as padding is), so every rank and
micro-batch counts a different number of tokens; plait all-reduces that count once per step,
and the loss is the mean over the global batch's counted tokens, as one device computes it.
The model is GPT-2 built from a config (no download), its embedding tied to its head as GPT-2
ships.

    plait run --nproc 2 examples/hf_model.py --plan dp=2
    plait run --nproc 2 examples/hf_model.py --plan tp=2,sp        # tensor + sequence parallel
    plait run --nproc 2 examples/hf_model.py --plan dp_shard=2,zero=3,grad_accum=2
    plait run --nproc 2 examples/hf_model.py --plan pp=2   # labels go to the last stage

``factory()`` is what ``plait check`` trains (the loss is None: the model's own):

    plait check --plan dp=2 --model examples.hf_model:factory
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import Dataset

import plait
from plait.data import TextDataset

SEQ = 64


class PaddedText(Dataset):
    """Bundled text in rows of SEQ tokens, each counting only a random-length prefix: the
    labels after it are -100, as a padded row's are (the tokens stay text; causal attention
    never lets the counted positions see them)."""

    def __init__(self, seed: int = 0):
        self.text = TextDataset(seq_len=SEQ)
        self.lengths = torch.randint(SEQ // 4, SEQ + 1, (len(self.text),),
                                     generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.text)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens, _ = self.text[i]
        labels = tokens.clone()
        labels[int(self.lengths[i]):] = -100  # not counted by the loss
        return {"input_ids": tokens, "labels": labels}


def build_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # Byte-level vocabulary: GPT-2's special token (50256) becomes byte 0.
    cfg = GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    # transformers picks the loss by class name; "GPT2LMHeadModel" names none, so say it.
    model.loss_type = "ForCausalLM"
    return model


def factory() -> tuple[torch.nn.Module, Dataset, None]:
    """What `plait check --model examples.hf_model:factory` trains; None: the model's loss."""
    return build_gpt2(), PaddedText(), None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", "--batch-size", dest="batch_size", type=int, default=16)
    parser.add_argument("--plan", default=None)  # read by plait.init()
    parser.add_argument("--accelerator", default=None)  # read by plait.init()
    parser.add_argument("--format", default="text")  # json: events, read by plait.init()
    args = parser.parse_args()

    run = plait.init(log_every=20)
    model, dataset, _ = factory()
    model = run.parallelize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for batch in run.loader(dataset, batch_size=args.batch_size, steps=args.steps):
        loss = run.step(model, batch, None, opt)  # None: the model's own output.loss
        first = float(loss) if first is None else first
    run.print(f"loss {first:.3f} -> {float(loss):.3f} (mean over the real tokens of each "
              f"global batch)")
    # Held-out text: its loss under the same layout (eval mode, no gradients), then generation
    # on one device from the gathered weights (every rank gathers; rank 0 generates).
    held_out = run.loader(PaddedText(seed=1), batch_size=args.batch_size, steps=1,
                          evaluation=True)
    run.print(f"held-out loss {float(run.evaluate(model, next(iter(held_out)))):.3f}")
    single = build_gpt2()
    single.load_state_dict(run.full_state_dict(model))
    if run.is_main:
        prompt = torch.tensor([list(b"The ")])
        out = single.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
        run.print("generated:", bytes(out[0].tolist()).decode("latin-1"))
    run.finish()


if __name__ == "__main__":
    main()
