"""The planner's price of one block against torch's own counters, on models written the way
users write them (tests/_planner_idioms.py: functional activations, SwiGLU, a Python RMSNorm,
rotary embeddings, ALiBi, a ViT's conv stem, a tied head, dropout on the attention
probabilities, a gated MLP with biases, an encoder-decoder ``enc_dec`` whose decoder blocks
read the encoder's output), and on tiny Hugging Face transformers models built from configs
(tests/_planner_hf.py, rows ``hf_*``: Llama and Qwen2, GPT-2 and BERT in eager and SDPA
attention, T5's encoder, and T5 whose decoder blocks read the encoder's output).

    python bench/planner_idioms.py [--seq 16] [--out bench/results/planner_idioms_cpu.txt]

For each model, its second block (``blocks.1``; ``model.layers.1``, ...): forward FLOPs
(the planner's ``block_flops_per_token`` x tokens against
``torch.utils.flop_counter.FlopCounterMode``), and bytes saved for backward per row of
``seq`` tokens (``plait.planner.memory.activation_bytes_per_block`` at one
device, scores materialised, against the distinct non-parameter storages
``torch.autograd.graph.saved_tensors_hooks`` sees, taken as the difference between a forward
on 4 rows and one on 2 rows, so what is saved once whatever the batch, autocast's bf16 weight
copies, cancels; a decoder block's storage of the encoder output it reads left out: one
tensor for all the stack's blocks, priced once beside them by
``plait.planner.memory.side_input_bytes``), in fp32 and under CPU bf16 autocast; the "dflt"
columns price them with
the constants ``plait plan`` uses (flash attention: no scores unless the block is measured
to save them, as these blocks' matmul attention does). Also the whole forward's FLOPs
(the main stack's blocks, a further stack's, and what runs outside them) against the
counter's. Ratio = planner / torch (FLOPs:
``FlopCounterMode`` with CPU's flash attention counted by torch's own formula). ``sdpa``'s
fp32/bf16 columns price the (seq x seq) scores the formula assumes without flash attention,
which CPU's flash kernel does not save.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from plait.planner.cost import Constants
from plait.planner.memory import activation_bytes_per_block
from plait.planner.model_stats import load_model
from tests import _planner_hf as H
from tests import _planner_idioms as I


def row(name: str, seq: int) -> dict[str, float]:
    if name in H.MODELS:
        factory, block = H.MODELS[name]

        def batch(rows: int) -> Any:
            return H.batch(rows, seq)
    else:
        factory, block = I.MODELS[name][0], "blocks.1"

        def batch(rows: int) -> Any:
            return I.batch(name, rows, seq)
    torch.manual_seed(0)
    model = factory()
    stats = load_model(factory())
    c = Constants(flash_attention=False)
    side = stats.cross_attentions > 0  # the encoder's output it reads: priced once, aside
    out: dict[str, float] = {}
    flops, _ = I.measured_block(model, batch(2), block)
    out["flops"] = stats.block_flops_per_token(seq) * 2 * seq / flops
    counter: Any = I.flop_counter()
    with counter:
        I.run(model, batch(2))
    whole = (stats.n_layers * stats.block_flops_per_token(seq)
             + stats.head_flops_per_token(seq)) * 2 * seq + stats.more_stacks_flops(2, seq, {})
    out["whole_flops"] = whole / counter.get_total_flops()
    for label, bf16, size in (("fp32", False, 4), ("bf16", True, 2)):
        two = I.measured_block(model, batch(2), block, bf16, side)[1]
        four = I.measured_block(model, batch(4), block, bf16, side)[1]
        per_row = (four - two) / 2
        out[label] = activation_bytes_per_block(stats, 1, seq, 1, False, size, c) / per_row
        out[label + "_plan"] = activation_bytes_per_block(stats, 1, seq, 1, False, size,
                                                          Constants()) / per_row
        out[label + "_bytes"] = per_row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    lines = [f"planner / torch, second block, seq {args.seq} (saved bytes per row)",
             f"{'model':16} {'flops':>7} {'whole':>7} {'fp32':>7} {'bf16':>7}"
             f" {'fp32 dflt':>9} {'bf16 dflt':>9} {'fp32 B/row':>11} {'bf16 B/row':>11}"]
    for name in [*I.MODELS, *H.MODELS]:
        r = row(name, args.seq)
        lines.append(f"{name:16} {r['flops']:7.3f} {r['whole_flops']:7.3f} {r['fp32']:7.3f}"
                     f" {r['bf16']:7.3f} {r['fp32_plan']:9.3f} {r['bf16_plan']:9.3f}"
                     f" {r['fp32_bytes']:11.0f} {r['bf16_bytes']:11.0f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
