"""Measured vs predicted collectives for tensor, sequence and pipeline parallelism on models
written for the test (tests/_traffic_models.py), not plait's reference transformer.

For each layout and model: a few real steps on gloo with the comm ledger on (bytes and calls
per step of the busiest rank, per axis and op), beside the planner's traffic for the same model
and plan, priced the way ``plait plan --model pkg.mod:factory --plan <plan>`` prices it
(``load_model`` on the module, ``evaluate``, the busiest rank's ``Estimate.traffic``).

    PYTHONPATH=$PWD python bench/traffic_own_models.py [--layouts tp=2 ...] [--models mlp ...]
        [--out bench/results/traffic_tp_pp_own_models.txt]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = ["tp=2", "tp=2,sp=1", "pp=2,microbatches=2", "pp=2,pp_schedule=interleaved_1f1b,"
           "virtual_stages=2,microbatches=2", "dp=2,tp=2", "pp=2,tp=2,microbatches=2"]
MODELS = ["mlp", "attention", "gqa", "mqa", "tied", "lora", "gpt2", "llama"]


def compare(layouts: list[str], models: list[str]) -> tuple[list[str], int]:
    """Table lines, and how many (layout, model, axis, op) rows differ."""
    from plait.plan import Plan
    from plait.spawn import run_distributed
    from tests._traffic_models import ledger_rows, measured_rows, planner_rows

    lines = [f"{'layout':44} {'model':9} {'axis':12} {'op':14} {'meas. bytes':>12} "
             f"{'pred. bytes':>12} {'ratio':>6} {'meas. calls':>11} {'pred. calls':>11}"]
    bad = 0
    for plan in layouts:
        try:
            world = Plan.from_string(plan).world_size
            runs = run_distributed(ledger_rows, world, plan, models, timeout=600)[0]
        except Exception as exc:  # noqa: BLE001 - a layout that fails is a row of the table
            lines.append(f"{plan:44} failed: {str(exc).strip().splitlines()[-1]}")
            bad += 1
            continue
        for name in models:
            comm = runs[name]["comm"]
            measured = measured_rows(comm)
            pred = planner_rows(name, plan, runs[name]["global_batch"])
            for key in sorted(set(measured) | set(pred)):
                mb, mc = measured.get(key, (0.0, 0.0))
                pb, pc = pred.get(key, (0.0, 0.0))
                ratio = f"{pb / mb:6.3f}" if mb else "   -  "
                same = abs(mb - pb) <= 1e-6 * max(mb, 1) and abs(mc - pc) < 1e-6
                bad += not same
                lines.append(f"{plan:44} {name:9} {key[0]:12} {key[1]:14} {mb:12.0f} {pb:12.0f} "
                             f"{ratio} {mc:11.1f} {pc:11.1f}{'' if same else '  <-'}")
    return lines, bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines, bad = compare(args.layouts, args.models)
    lines.append(f"{bad} rows differ (bytes or calls), marked <-")
    text = "\n".join(lines)
    print(text)
    if args.out:
        command = "PYTHONPATH=$PWD python bench/traffic_own_models.py " + " ".join(sys.argv[1:])
        Path(args.out).write_text(f"# {command}\n{text}\n")


if __name__ == "__main__":
    main()
