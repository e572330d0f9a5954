"""Wall and CPU seconds of `plait` commands that need no model built, each in a fresh
interpreter, and whether torch was imported: `plait --help` and every command's `--help`,
`plait plan --model <preset>` (a search, a given --plan, a model that fits nowhere, --pareto),
`plait schedule`, and `plait export` (refusing a checkpoint that is not there; exporting a small
one, which needs torch and torch.distributed.checkpoint, and nothing of plait's training side).

With ``--base DIR`` (another checkout of plait) each command runs alternately from this tree
and from DIR, so that both see the same machine load; the load average is printed before and
after. CPU is user + system of the child (steadier than wall time on a shared machine).

    python bench/cli_startup.py [--repeats 5] [--base /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "--help": ["--help"],
    **{f"{name} --help": [*name.split(), "--help"] for name in (
        "env", "run", "check", "demo", "plan", "schedule", "comm", "bench comm", "export",
        "doctor")},
    "schedule 1f1b": ["schedule", "--schedule", "1f1b", "--pp", "4", "-m", "8"],
    "plan llama-70b (search)": ["plan", "--model", "llama-70b", "--cluster", "dgx-h100",
                                "--nodes", "8", "--global-batch", "512", "--seq", "4096"],
    "plan llama-8b --plan": ["plan", "--model", "llama-8b", "--cluster", "dgx-h100",
                             "--global-batch", "64", "--seq", "2048",
                             "--plan", "dp_shard=8,zero=3,mp=bf16,accum=2"],
    "plan llama-70b, fits nowhere": ["plan", "--model", "llama-70b", "--cluster", "dgx-h100",
                                     "--devices", "1", "--global-batch", "8", "--seq", "4096"],
    "plan llama-8b --pareto": ["plan", "--model", "llama-8b", "--cluster", "dgx-h100",
                               "--nodes", "2", "--global-batch", "256", "--seq", "4096",
                               "--pareto", "{tmp}/pareto.png"],
    "export, no such checkpoint": ["export", "{tmp}/missing", "--to", "{tmp}/m.safetensors"],
    "export a small checkpoint": ["export", "{tmp}/ckpt", "--to", "{tmp}/m.safetensors"],
}

# A one-process checkpoint of a small model (two linear layers, AdamW state) to export.
SAVE = ("import sys, torch, plait\n"
        "run = plait.init('single', quiet=True, seed=0)\n"
        "model = run.parallelize(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),"
        " torch.nn.Linear(256, 64)))\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        "model(torch.randn(8, 64)).square().mean().backward()\n"
        "opt.step()\n"
        "run.save(sys.argv[1], model=model, optimizer=opt)\n"
        "run.close()\n")

PROBE = ("import sys, plait.cli\n"
         "try:\n    plait.cli.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
         "print('torch' in sys.modules, file=sys.stderr)")


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}


def _run(tree: Path, argv: list[str]) -> tuple[float, float]:
    """(wall, cpu) seconds of ``python -m plait argv`` from ``tree``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "plait", *argv], env=_env(tree), cwd=tree,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _imports_torch(tree: Path, argv: list[str]) -> bool:
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], env=_env(tree), cwd=tree,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         check=False)
    return out.stderr.strip().splitlines()[-1] == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--base", type=Path, help="another plait checkout to compare against")
    args = parser.parse_args()
    trees = {"this": ROOT, **({"base": args.base.resolve()} if args.base else {})}
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-c", SAVE, f"{tmp}/ckpt"], env=_env(ROOT), cwd=ROOT,
                       check=True)
        commands = {k: [a.format(tmp=tmp) for a in v] for k, v in COMMANDS.items()}
        times: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(args.repeats):
            for name, argv in commands.items():
                for tree_name, tree in trees.items():
                    times.setdefault((name, tree_name), []).append(_run(tree, argv))
        torch_in = {(name, t): _imports_torch(tree, argv) for name, argv in commands.items()
                    for t, tree in trees.items()}
    print(f"load average after: {os.getloadavg()}")
    print(f"{'command':32} {'tree':5} {'wall s':>7} {'cpu s':>7}  torch  (median of "
          f"{args.repeats})")
    for (name, tree_name), runs in times.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"{name:32} {tree_name:5} {wall:7.2f} {cpu:7.2f}  {torch_in[name, tree_name]}")


if __name__ == "__main__":
    main()
