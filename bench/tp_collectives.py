"""Count the collectives one training step issues under TP and TP+SP (reference model).

    PYTHONPATH=. python bench/tp_collectives.py [--tp 2] [--preset test]

Counts the functional collectives DTensor issues (a small TorchDispatchMode: torch's
CommDebugMode trips over modules with keyword forward pre-hooks) around forward + loss + backward
of one micro-batch, with the payload bytes of each kind (logical bytes of the call; gloo runs a
reduce-scatter as a full all-reduce, so it moves more than that on CPU).
"""

from __future__ import annotations

import argparse
import json


def worker(rank: int, world_size: int, plan_string: str, preset: str, batch: int, seq: int
           ) -> dict:
    from collections import Counter

    import torch

    from plait._torch_compat import torch_dispatch_mode

    TorchDispatchMode = torch_dispatch_mode()

    class CountCollectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts, self.bytes = Counter(), Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name().split("::")[-1].split(".")[0]
            if (func.namespace == "_c10d_functional" and not name.startswith("wait")
                    and not name.startswith("_wrap")) or func.namespace == "c10d":
                self.counts[name] += 1
                t = args[0]
                if isinstance(t, torch.Tensor):
                    self.bytes[name] += t.numel() * t.element_size()
            return func(*args, **(kwargs or {}))

    import plait
    from plait.models.transformer import build, lm_loss
    from plait.train import _forward_loss, loss_context

    torch.set_num_threads(1)
    run = plait.init(plan_string, seed=0, quiet=True)
    model = run.parallelize(build(preset, seed=0))
    tokens = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    mode = CountCollectives()
    with loss_context(model), mode:
        loss = _forward_loss(model, (tokens[:, :-1], tokens[:, 1:]), lm_loss)
        fwd = dict(mode.counts)
        loss.backward()
        bwd_total = dict(mode.counts)
    bwd = {k: v - fwd.get(k, 0) for k, v in bwd_total.items() if v - fwd.get(k, 0)}
    counts = {"forward": fwd, "backward": bwd, "bytes": dict(mode.bytes)}
    run.close()
    return counts


def main() -> None:
    from plait.models.transformer import preset as get_preset
    from plait.spawn import run_distributed

    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--preset", default="test")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16)
    args = ap.parse_args()
    layers = get_preset(args.preset).n_layers
    for sp in (False, True):
        plan = f"tp={args.tp}" + (",sp=true" if sp else "")
        counts = run_distributed(worker, args.tp, plan, args.preset, args.batch, args.seq,
                                 timeout=300)[0]
        total = sum(sum(counts[k].values()) for k in ("forward", "backward"))
        print(f"{plan} ({layers} layers): {total} collectives per micro-batch "
              f"(forward+backward): {json.dumps(counts)}")


if __name__ == "__main__":
    main()
