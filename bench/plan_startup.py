"""Where `plait plan --model pkg:factory` spends its time before the search, side by side.

Each figure is the median of ``--repeats`` fresh interpreters (imports are once per process),
CPU seconds (user + system: steadier than wall time on a shared machine) and wall seconds:

* the parser: every command's arguments (importing each command's module, ``plait export``'s
  torch.distributed.checkpoint among them) vs only ``plait plan``'s, as ``plait.cli.main``
  builds it;
* the model read on the meta device: a plain ``torch.device("meta")`` build vs the planner's,
  which skips the random fills (``nn.Embedding``'s ``normal_``) whose meta form imports
  torch._dynamo;
* a seeded dataset read on the meta device (``torch.randn(..., generator=g)``, whose meta
  form with a generator imports torch._dynamo too): plain vs the planner's, which draws
  without the generator there;
* the modules the layout check of a plan without tensor parallelism needs: the layer-plan
  lookup beside plait.parallel.tensor (DTensor, FSDP), which it imported before;
* the whole command, with the "priced in" and "reading the model" figures it prints.

    python bench/plan_startup.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = "plan_startup:model"  # this file, imported by the child processes as a factory


def model():  # type: ignore[no-untyped-def]
    """A ~270K-parameter GPT-style model: token and position nn.Embedding tables."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):  # type: ignore[no-untyped-def]
            return x + self.mlp(x + self.attn(x, x, x, need_weights=False)[0])

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(256, 64)
            self.pos = nn.Embedding(512, 64)
            self.blocks = nn.ModuleList(Block(64) for _ in range(4))
            self.head = nn.Linear(64, 256)

        def forward(self, idx):  # type: ignore[no-untyped-def]
            import torch

            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return Model()


def seeded():  # type: ignore[no-untyped-def]
    """A synthetic dataset drawn from its own generator, as a factory's dataset often is."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randn(512, 16, 8, generator=g), torch.randint(0, 4, (512, 16), generator=g)


CASES = {
    "parser, every command": "import plait.cli as c; c.build_parser()",
    "parser, plan only": "import plait.cli as c; c.build_parser('plan')",
    "meta build, plain": "import torch, plan_startup as m\nwith torch.device('meta'): m.model()",
    "meta build, fills skipped": "import torch, plan_startup as m\n"
                                 "from plait.planner.model_stats import _values_skipped\n"
                                 "with torch.device('meta'), _values_skipped(): m.model()",
    "seeded data on meta, plain": "import torch, plan_startup as m\n"
                                  "with torch.device('meta'): m.seeded()",
    "seeded data, draws unseeded": "import torch, plan_startup as m\n"
                                   "from plait.planner.model_stats import _values_skipped\n"
                                   "with torch.device('meta'), _values_skipped(): m.seeded()",
    "plait.parallel.tensor": "import plait.parallel.tensor",
    "layer-plan lookup alone": "import plait.auto, plait.parallel.tp_plans, "
                               "plait.parallel.tp_infer, plait.planner.tp_block",
    "import torch alone": "import torch",
}


def timed(argv: list[str]) -> tuple[float, float, str]:
    """(CPU seconds, wall seconds, stdout) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    env = {"PYTHONPATH": f"{ROOT}:{Path(__file__).parent}", "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, out.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'case':<28} {'cpu s':>7} {'wall s':>7}   (median of {args.repeats} processes)")
    for name, code in CASES.items():
        runs = [timed([sys.executable, "-c", code]) for _ in range(args.repeats)]
        print(f"{name:<28} {statistics.median(r[0] for r in runs):7.2f} "
              f"{statistics.median(r[1] for r in runs):7.2f}")
    command = [sys.executable, "-m", "plait", "plan", "--model", SPEC, "--cluster", "cpu",
               "--devices", "4", "--global-batch", "8"]
    runs = [timed(command) for _ in range(args.repeats)]
    said = re.search(r"priced in ([\d.]+)s \(after ([\d.]+)s reading the model\)", runs[0][2])
    print(f"{'plait plan (whole command)':<28} {statistics.median(r[0] for r in runs):7.2f} "
          f"{statistics.median(r[1] for r in runs):7.2f}   it prints: priced in "
          f"{said.group(1) if said else '?'}s after {said.group(2) if said else '?'}s reading "
          f"the model")
    print("  " + " ".join(command[2:]))
    # one given layout without tp or pp: the model is asked about neither
    command = [*command[:8], "--global-batch", "8", "--plan", "dp=4"]
    runs = [timed(command) for _ in range(args.repeats)]
    print(f"{'plait plan --plan dp=4':<28} {statistics.median(r[0] for r in runs):7.2f} "
          f"{statistics.median(r[1] for r in runs):7.2f}")
    print("  " + " ".join(command[2:]))


if __name__ == "__main__":
    main()
