"""plait beside raw PyTorch, Hugging Face Accelerate and Lightning Fabric, in one run.

Every contestant trains the same model (plait's reference transformer) on the same bundled
corpus with the same global batch, optimizer (AdamW), gradient clipping (1.0) and process count,
each a training script in ``bench/anchors/`` started by torchrun. Runs are interleaved
(A B C ..., then the same contestants in another order, seeded) and repeated so that machine
noise, a job's place in the round and the job before it hit every contestant alike. For each
it prints the median step time, tokens/s, peak memory per rank and the loss after the last step,
each beside raw PyTorch (raw DDP for data-parallel contestants, raw FSDP2 for sharded ones) as
min..max of the per-repetition ratios. Then the lines of user code each library changes to go
from the one-device script (``anchors/single.py``) to DDP, FSDP and a pipeline.

The anchors live in their own environment (``make bench-env`` -> ``.venv-bench``), never in
plait's dependencies; ``accelerate launch --cpu`` is not used because it starts one process.

    make bench-env && .venv-bench/bin/python bench/vs_anchors.py [--reps 5] [--model tiny]
    .venv-bench/bin/python bench/vs_anchors.py --smoke       # one repetition, tiny model

``--smoke`` proves that every script trains (the pipelines too) and measures nothing: its jobs
start from one launcher process (``anchors/_smoke_launch.py``) so that it takes seconds, not
minutes.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANCHORS = ROOT / "bench" / "anchors"
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
BENCH_STAMP = ROOT / ".venv-bench" / ".installed"  # written last by `make bench-env`


@dataclass(frozen=True)
class Contestant:
    name: str
    script: str
    baseline: str  # the raw-PyTorch contestant its ratios are taken against
    args: tuple[str, ...] = ()


CONTESTANTS = [
    Contestant("torch DDP", "torch_ddp.py", "torch DDP"),
    Contestant("Accelerate DDP", "accelerate_ddp.py", "torch DDP"),
    Contestant("Fabric DDP", "fabric_ddp.py", "torch DDP"),
    Contestant("plait DDP", "plait_train.py", "torch DDP", ("--plan", "dp={world}")),
    Contestant("torch FSDP2", "torch_fsdp2.py", "torch FSDP2"),
    Contestant("Accelerate FSDP", "accelerate_fsdp.py", "torch FSDP2"),
    Contestant("Fabric FSDP", "fabric_fsdp.py", "torch FSDP2"),
    Contestant("plait ZeRO-3", "plait_train.py", "torch FSDP2",
               ("--plan", "dp_shard={world},zero=3")),
]
# Run once in --smoke only, to prove the pipeline scripts counted below actually train.
PIPELINES = [
    Contestant("torch pipeline", "torch_pipeline.py", "torch pipeline"),
    Contestant("plait pipeline", "plait_train.py", "torch pipeline",
               ("--plan", "pp={world},schedule=1f1b,mb=4")),
]

# (target, contestant, relation, other, factor): contestant's step time <= factor x other's,
# or its tokens/s >= factor x other's.
TARGETS = [
    ("step", "plait DDP", "<=", "torch DDP", 1.02),
    ("step", "plait ZeRO-3", "<=", "torch FSDP2", 1.0),
    ("tokens/s", "plait DDP", ">=", "Accelerate DDP", 1.0),
    ("tokens/s", "plait DDP", ">=", "Fabric DDP", 1.0),
    ("tokens/s", "plait ZeRO-3", ">=", "Accelerate FSDP", 1.0),
    ("tokens/s", "plait ZeRO-3", ">=", "Fabric FSDP", 1.0),
]

# Lines of user code: the one-device script -> each library's script for each layout.
# None: the library cannot do it (the reason is printed).
LINE_SCRIPTS: dict[str, dict[str, str | None]] = {
    "raw PyTorch": {"DDP": "torch_ddp.py", "FSDP": "torch_fsdp2.py",
                    "pipeline": "torch_pipeline.py"},
    "Accelerate": {"DDP": "accelerate_ddp.py", "FSDP": "accelerate_fsdp.py", "pipeline": None},
    "Fabric": {"DDP": "fabric_ddp.py", "FSDP": "fabric_fsdp.py", "pipeline": None},
    "plait": {"DDP": "plait_train.py", "FSDP": "plait_train.py", "pipeline": "plait_train.py"},
}
NOT_POSSIBLE = {
    "Accelerate": "not possible (prepare_pippy is inference only)",
    "Fabric": "not possible (no pipeline strategy)",
}


def code_lines(path: Path) -> list[str]:
    """The script's statements: no docstring, comments or blank lines."""
    import ast
    import io
    import tokenize

    text = path.read_text()
    tree = ast.parse(text)
    skip: set[int] = set()
    if tree.body and isinstance(tree.body[0], ast.Expr) and \
            isinstance(getattr(tree.body[0], "value", None), ast.Constant):
        skip.update(range(tree.body[0].lineno, tree.body[0].end_lineno + 1))
    comment_only = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                    if tok.type == tokenize.COMMENT and tok.line.strip().startswith("#")}
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if i in skip or i in comment_only or not line.strip():
            continue
        out.append(line.split("  #")[0].rstrip())
    return out


def lines_changed(a: list[str], b: list[str]) -> int:
    """Lines added, removed or rewritten: a rewritten line counts once, not twice."""
    n = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag != "equal":
            n += max(i2 - i1, j2 - j1)
    return n


def lines_table() -> dict[str, dict[str, int | str]]:
    base = code_lines(ANCHORS / "single.py")
    table: dict[str, dict[str, int | str]] = {}
    for lib, layouts in LINE_SCRIPTS.items():
        table[lib] = {}
        for layout, script in layouts.items():
            table[lib][layout] = (NOT_POSSIBLE[lib] if script is None
                                  else lines_changed(base, code_lines(ANCHORS / script)))
    return table


def run_one(c: Contestant, python: Path, nproc: int, shape: list[str], timeout: float) -> dict:
    """One torchrun job; its rank 0 writes the figures (see anchors/common.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        extra = [arg.format(world=nproc) for arg in c.args]
        cmd = [str(python), "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(ANCHORS / c.script), *shape, *extra,
               "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONPATH": str(ROOT)}
        proc = _run_session(cmd, timeout=timeout, env=env)
        if out.exists():
            figures = json.loads(out.read_text())
            # Rank 0 writes only after every rank's figures arrived, so the run is complete.
            # A rank that then dies at exit (gloo tearing down a pair whose peer already left,
            # SIGABRT) is counted, not hidden.
            figures["exit_code"] = proc.returncode
            return figures
        text = (proc.stdout + proc.stderr).strip().splitlines()
        # torchrun's closing summary hides the cause: show the ranks' own error lines too.
        errors = [ln for ln in text if "Error" in ln or "error:" in ln][:10]
        raise RuntimeError(f"{c.name} ({c.script}) failed, exit {proc.returncode}:\n"
                           + "\n".join(errors + ["..."] + text[-10:]))


def _run_session(cmd: list[str], timeout: float, env: dict[str, str]
                 ) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own; past ``timeout`` the whole session is killed (the
    launcher and the ranks it forked, which would otherwise outlive it holding the output pipes)
    and the error says how far it got."""
    import signal

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        done = [json.loads(ln)["name"] for ln in out.splitlines() if ln.startswith('{"name"')]
        raise RuntimeError(f"{' '.join(cmd[:2])} still running after {timeout:g} s (jobs "
                           f"finished: {', '.join(done) or 'none'}); killed") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_smoke(contestants: list[Contestant], python: Path, nproc: int, shape: list[str],
              timeout: float) -> dict[str, dict]:
    """Every contestant once, from one launcher process (``anchors/_smoke_launch.py``: torch and
    the libraries imported once, each job's ranks forked by torchelastic)."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = {c.name: Path(tmp) / f"{i}.json" for i, c in enumerate(contestants)}
        jobs = [{"name": c.name, "script": str(ANCHORS / c.script),
                 "argv": [*shape, *(arg.format(world=nproc) for arg in c.args),
                          "--out", str(outs[c.name])]} for c in contestants]
        spec = Path(tmp) / "jobs.json"
        spec.write_text(json.dumps(jobs))
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONPATH": str(ROOT)}
        proc = _run_session([str(python), str(ANCHORS / "_smoke_launch.py"), str(nproc),
                             str(spec)], timeout=timeout, env=env)
        results = {}
        for line in proc.stdout.splitlines():
            if line.startswith('{"name"'):
                r = json.loads(line)
                results[r["name"]] = r
        figures = {}
        for c in contestants:
            r = results.get(c.name)
            if r is None or not r["ok"] or not outs[c.name].exists():
                why = r["error"] if r else "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
                raise RuntimeError(f"{c.name} ({c.script}) failed under --smoke:\n{why}")
            figures[c.name] = {**json.loads(outs[c.name].read_text()), "exit_code": 0}
        return figures


def _ratio_range(values: list[float]) -> str:
    return f"{min(values):.2f}..{max(values):.2f}" if values else "-"


def summarize(runs: dict[str, list[dict]], contestants: list[Contestant]) -> list[dict]:
    """Medians per contestant and its per-repetition ratios to its raw-PyTorch baseline."""
    rows = []
    for c in contestants:
        mine, base = runs[c.name], runs[c.baseline]
        pairs = list(zip(mine, base, strict=True))  # repetition k of both ran in the same round
        peak = [max(r["peak_bytes_per_rank"]) for r in mine]
        losses = [r["final_loss"] for r in mine if r["final_loss"] is not None]
        rows.append({
            "name": c.name, "baseline": c.baseline, "reps": len(mine),
            "step_s": statistics.median(r["step_s"] for r in mine),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
            "peak_bytes": statistics.median(peak),
            "final_loss": statistics.median(losses) if losses else None,
            "step_ratio": [m["step_s"] / b["step_s"] for m, b in pairs],
            "tokens_ratio": [m["tokens_per_s"] / b["tokens_per_s"] for m, b in pairs],
            "peak_ratio": [max(m["peak_bytes_per_rank"]) / max(b["peak_bytes_per_rank"])
                           for m, b in pairs if max(b["peak_bytes_per_rank"]) > 0],
            "loss_ratio": [m["final_loss"] / b["final_loss"] for m, b in pairs
                           if m["final_loss"] and b["final_loss"]],
            "memory_kind": mine[0]["memory_kind"],
            "exits_after_figures": sum(1 for r in mine if r.get("exit_code")),
        })
    return rows


def check_targets(runs: dict[str, list[dict]]) -> list[dict]:
    """Each target on the median of its per-repetition ratios (paired within a round)."""
    out = []
    for metric, who, rel, other, factor in TARGETS:
        if who not in runs or other not in runs:
            continue
        key = "step_s" if metric == "step" else "tokens_per_s"
        ratios = [m[key] / o[key] for m, o in zip(runs[who], runs[other], strict=True)]
        ratio = statistics.median(ratios)
        met = ratio <= factor if rel == "<=" else ratio >= factor
        out.append({"target": f"{who} {metric} {rel} {factor:g} x {other}", "ratio": ratio,
                    "ratios": ratios, "met": met})
    return out


def format_report(rows: list[dict], targets: list[dict], lines: dict, header: str) -> str:
    out = [header, ""]
    out.append(f"{'':<16} {'ms/step':>8} {'tokens/s':>9} {'peak MiB/rank':>13} "
               f"{'final loss':>10} | {'ratios to':<21} {'step':>10} {'tokens/s':>10} "
               f"{'memory':>10} {'loss':>10}")
    for r in rows:
        loss = f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "-"
        out.append(f"{r['name']:<16} {1000 * r['step_s']:>8.1f} {r['tokens_per_s']:>9,.0f} "
                   f"{r['peak_bytes'] / 2**20:>13,.0f} {loss:>10} | {r['baseline']:<21} "
                   f"{_ratio_range(r['step_ratio']):>10} {_ratio_range(r['tokens_ratio']):>10} "
                   f"{_ratio_range(r['peak_ratio']):>10} {_ratio_range(r['loss_ratio']):>10}")
    out.append(f"(medians over repetitions; ratios min..max over repetitions, each taken against "
               f"the baseline of the same round; memory: {rows[0]['memory_kind']})")
    for r in rows:
        if r["exits_after_figures"]:
            out.append(f"  {r['name']}: {r['exits_after_figures']} run(s) exited non-zero after "
                       f"every rank had reported (a rank aborted in teardown)")
    if targets:
        out += ["", "targets (median of the per-round ratios):"]
        for t in targets:
            out.append(f"  {'met ' if t['met'] else 'MISS'}  {t['target']:<48} "
                       f"{t['ratio']:.3f}  (rounds {_ratio_range(t['ratios'])})")
    out += ["", "lines of user code changed from the one-device script (bench/anchors/single.py):"]
    layouts = ["DDP", "FSDP", "pipeline"]
    out.append(f"{'':<12} " + " ".join(f"{x:>10}" for x in layouts))
    for lib, row in lines.items():
        cells = [str(row[x]) if isinstance(row[x], int) else "n/a*" for x in layouts]
        out.append(f"{lib:<12} " + " ".join(f"{c:>10}" for c in cells))
    for lib, why in NOT_POSSIBLE.items():
        out.append(f"  * {lib} pipeline: {why}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--model", default="tiny", help="plait.models.transformer preset")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10, help="steps per run not timed")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--smoke", action="store_true",
                   help="one repetition of a few steps (the pipelines too): proves every script "
                        "runs, measures nothing")
    p.add_argument("--python", default=str(BENCH_PYTHON),
                   help="the interpreter with the anchors installed (make bench-env)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per torchrun job")
    p.add_argument("--only", default=None,
                   help="comma-separated contestants to run, e.g. 'torch DDP,Fabric DDP,plait "
                        "DDP' (each one's raw-PyTorch baseline is added)")
    p.add_argument("--save", default=None, help="also write the report and JSON here (stem)")
    p.add_argument("--format", choices=["table", "json"], default="table")
    a = p.parse_args(argv)
    contestants = CONTESTANTS + (PIPELINES if a.smoke else [])
    if a.only:
        names = {n.strip() for n in a.only.split(",")}
        unknown = names - {c.name for c in contestants}
        if unknown:
            print(f"vs_anchors: --only {', '.join(sorted(unknown))}: no such contestant; "
                  f"contestants are {', '.join(c.name for c in contestants)}", file=sys.stderr)
            return 2
        names |= {c.baseline for c in contestants if c.name in names}
        contestants = [c for c in contestants if c.name in names]
    python = Path(a.python)
    if not python.exists() or (python == BENCH_PYTHON and not BENCH_STAMP.exists()):
        print(f"vs_anchors: skipped: {python} is missing or half-built; run `make bench-env` to "
              f"install Accelerate and Lightning beside plait")
        return 0
    if a.smoke:
        a.reps, a.steps, a.warmup, a.batch, a.seq, a.model = 1, 4, 1, 4, 32, "tiny"
    shape = ["--model", a.model, "--steps", str(a.steps), "--warmup", str(a.warmup),
             "--batch", str(a.batch), "--seq", str(a.seq)]
    runs: dict[str, list[dict]] = {c.name: [] for c in contestants}
    started = time.perf_counter()
    if a.smoke:
        for name, r in run_smoke(contestants, python, a.nproc, shape, a.timeout).items():
            runs[name].append(r)
    for rep in range(0 if a.smoke else a.reps):
        # Every round runs each contestant once, the first in the listed order, the others in
        # an order of their own (seeded): a job's place in the round, and the job before it
        # (one that leaves the machine busy as it exits), then fall on every contestant alike.
        order = list(contestants)
        if rep:
            random.Random(rep).shuffle(order)
        for c in order:
            runs[c.name].append(run_one(c, python, a.nproc, shape, a.timeout))
            if a.format == "table":
                r = runs[c.name][-1]
                print(f"  round {rep + 1}/{a.reps} {c.name:<16} {1000 * r['step_s']:8.1f} ms/step",
                      file=sys.stderr, flush=True)
    rows = summarize(runs, contestants)
    targets = [] if a.smoke else check_targets(runs)
    lines = lines_table()
    launcher = "torchelastic, ranks forked" if a.smoke else "torchrun"
    header = (f"vs anchors: {a.model} model, {a.nproc} processes ({launcher}), global batch "
              f"{a.batch} x {a.seq} tokens, AdamW, clip 1.0, {a.steps} steps per run "
              f"({a.warmup} untimed), {a.reps} interleaved repetitions, "
              f"{time.perf_counter() - started:.0f} s")
    report = format_report(rows, targets, lines, header)
    data = {"header": header, "rows": rows, "targets": targets, "lines_changed": lines,
            "runs": runs}
    print(json.dumps(data, indent=2) if a.format == "json" else report)
    if a.save:
        Path(a.save + ".txt").write_text(report + "\n")
        Path(a.save + ".json").write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
