"""What `plait plan --model pkg:factory` pays for the forward pass on fake tensors that reads the
dtypes of a block's tensor-parallel collectives and what a checkpointed block replays
(plait/planner/tp_trace.py), on a 7B Llama (Hugging Face LlamaForCausalLM at Llama 2 7B's
sizes, built on the meta device: nothing is allocated).

    python bench/planner_trace_cost.py [--repeat 3]

Each command runs as its own process (``python -m plait plan ...``), as a user runs it; wall
time, the median of ``--repeat`` runs. The trace is needed only where its answer can differ from
fp32 without checkpointing: a 16-bit dtype, or checkpointing under tensor parallelism.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bench.planner_trace_cost:llama_7b"
COMMON = ["--model", MODEL, "--cluster", "dgx-h100", "--devices", "8", "--global-batch", "8",
          "--seq", "2048"]
COMMANDS = {
    "fp32, given plan, no checkpointing": COMMON + ["--dtype", "fp32", "--plan",
                                                    "dp_shard=8,zero=3"],
    "fp32, given plan tp=2, no checkpointing": COMMON + ["--dtype", "fp32", "--plan",
                                                         "dp_shard=4,tp=2,sp=true,zero=3"],
    "fp32, search": COMMON + ["--dtype", "fp32"],
    "bf16, given plan tp=2 (trace needed)": COMMON + ["--dtype", "bf16", "--plan",
                                                      "dp_shard=4,tp=2,sp=true,zero=3"],
}


def llama_7b():
    """Llama 2 7B's shapes (32 blocks of width 4096, 32 heads, ffn 11008, vocab 32000)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096))


def _run(root: Path, argv: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=str(root))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "plait", "plan", *argv], env=env, cwd=root,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--root", type=Path, action="append", default=None,
                        help="a checkout whose plait is timed (repeatable: an export of another "
                        "commit, to compare; runs alternate between them); its bench/ must "
                        "hold this script. Default: this one")
    parser.add_argument("--commands", type=int, default=len(COMMANDS),
                        help="time the first N commands only")
    args = parser.parse_args()
    roots = [r.resolve() for r in (args.root or [ROOT])]
    print(f"{'command':<42} {'root':<28} {'median s':>9}  runs")
    for name, argv in list(COMMANDS.items())[:args.commands]:
        times: dict[Path, list[float]] = {r: [] for r in roots}
        for _ in range(args.repeat):
            for root in roots:
                times[root].append(_run(root, argv))
        for root in roots:
            print(f"{name:<42} {str(root)[-28:]:<28} {statistics.median(times[root]):>9.2f}  "
                  + " ".join(f"{t:.2f}" for t in times[root]), flush=True)
    print("e.g. plait plan " + " ".join(COMMANDS["fp32, given plan, no checkpointing"]))


if __name__ == "__main__":
    main()
