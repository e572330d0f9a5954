"""How long the planner's search takes, in CPU seconds of this process (the fastest of a few
runs), on a few models and clusters; with ``--against DIR`` the same searches run on the
plait package under DIR too (an older checkout: ``git archive <rev> plait | tar -x -C DIR``),
in a child process, and the ratio is printed. Each search's ranked plans are compared too
(plan, step time and memory of every layout that fits): a faster search must find the same.

    python bench/planner_speed.py [--against DIR] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CASES = [("llama-70b", "dgx-h100", 64, 128, 4096),
         ("llama-8b", "dgx-h100", 64, 256, 4096),
         ("llama-13b", "dgx-a100-40gb", 32, 128, 4096),
         ("gpt-175b", "dgx-a100-80gb", 1024, 1536, 2048)]


def run(repeat: int) -> dict[str, dict]:
    """name -> {"seconds": fastest CPU seconds, "evaluated": n, "ranked": [...]}."""
    from plait.planner.cost import Workload
    from plait.planner.hardware import load_cluster
    from plait.planner.model_stats import load_model
    from plait.planner.search import search

    out = {}
    for model, preset, devices, batch, seq in CASES:
        m, c = load_model(model), load_cluster(preset, devices=devices)
        best = float("inf")
        for _ in range(repeat):
            start = time.process_time()
            r = search(m, c, Workload(batch, seq), top=0)
            best = min(best, time.process_time() - start)
        out[f"{model} on {devices} x {preset}, batch {batch} x {seq}"] = {
            "seconds": best, "evaluated": r.evaluated,
            "ranked": [[e.plan.to_string(), e.step_time_s, e.memory_bytes_per_device]
                       for e in r.ranked]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="a directory holding another plait package")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the child's output
    args = ap.parse_args()
    if args.json:
        print(json.dumps(run(args.repeat)))
        return
    # "this" is the checkout the script sits in, not whichever plait the environment installs
    # (an editable install of another worktree would be timed instead); the child imports
    # --against's through PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    other = None
    if args.against:
        env = dict(os.environ, PYTHONPATH=str(Path(args.against).resolve()))
        child = subprocess.run([sys.executable, __file__, "--json", "--repeat",
                                str(args.repeat)], env=env, capture_output=True, text=True,
                               check=True)
        other = json.loads(child.stdout)
    here = run(args.repeat)
    import plait

    print(f"this: {Path(plait.__file__).parent}" +
          (f"; other: {Path(args.against).resolve() / 'plait'}" if other else ""))
    print(f"{'search':58s} {'layouts':>8s} {'this s':>8s}" +
          (f" {'other s':>8s} {'speed-up':>8s}  same" if other else ""))
    for name, got in here.items():
        line = f"{name:58s} {got['evaluated']:8d} {got['seconds']:8.3f}"
        if other:
            was = other[name]
            same = was["ranked"] == got["ranked"] and was["evaluated"] == got["evaluated"]
            line += f" {was['seconds']:8.3f} {was['seconds'] / got['seconds']:7.2f}x  {same}"
        print(line)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
