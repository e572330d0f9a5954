"""Buffers every pipeline stage holds: which copy a checkpoint and ``run.full_state_dict`` get.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/pipeline_root_buffers.py \
        [--plan pp=2,schedule=gpipe,mb=1] [--reference single] [--steps 4]

Trains ``RootStatsLM`` (tests/_workers_ckpt_users.py: a token count and an EMA of the embedded
features written before the blocks, an EMA of the last block's output written after them, all
buffers of the root module) for ``--steps`` SGD steps in one process under ``--reference`` and
in two under ``--plan``, saving a checkpoint at the end. Prints, per buffer, its norm on one
device and the relative error of the checkpoint's copy (read back with
``plait.checkpoint.export.model_tensors``) and of ``run.full_state_dict``'s. With more than one
microbatch, give ``--reference grad_accum=M``: one device then updates the buffers once per
microbatch too.
"""

from __future__ import annotations

import argparse
import tempfile


def main() -> None:
    from plait.checkpoint.export import model_tensors
    from plait.spawn import run_distributed
    from tests import _workers_ckpt_users as u

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="pp=2,schedule=gpipe,mb=1")
    parser.add_argument("--reference", default="single")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    folder = tempfile.mkdtemp()
    job = dict(model="rootstats", opt="sgd", total=args.steps)
    ref = u.train(args.reference, steps=args.steps, export=True, **job)
    out = run_distributed(u.runs, 2, [dict(plan=args.plan, steps=args.steps, checkpoint=folder,
                                           every=args.steps, export=True, **job)],
                          timeout=600)[0][0]
    saved = model_tensors(folder)[0]
    print(f"{args.plan} against {args.reference}, {args.steps} steps")
    print(f"losses {args.reference}: {ref['losses']}")
    print(f"losses {args.plan}: {out['losses']}")
    for name in ("tokens_seen", "ema_in", "ema_out", "head.weight"):
        want = ref["state"][name].float()

        def err(got, want=want):
            return ((got.float() - want).norm() / want.norm().clamp_min(1e-12)).item()

        print(f"{name:12s} one-device norm {want.norm():8.4g}   checkpoint rel err "
              f"{err(saved[name]):8.3g}   full_state_dict rel err {err(out['state'][name]):8.3g}")


if __name__ == "__main__":
    main()
