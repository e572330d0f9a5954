"""Searches whose every result is fingerprinted: the ranked plans (all that fit), their step
times, memory and traffic to full float precision, and what the search rejected. The stored
fingerprints (tests/data/planner_fingerprints.json) were computed by the search before its
caches existed; ``python -m tests._planner_fingerprint`` writes them again."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

STORED = Path(__file__).parent / "data" / "planner_fingerprints.json"


def _built(overrides: dict[str, Any], frozen: int = 0) -> Any:
    """plait's reference transformer on the meta device, read module by module (rows, tied
    weights, FSDP2's padding), its first ``frozen`` blocks and embedding frozen; what its
    block is measured to save beyond the formula's count (plait.planner.saved) left out, as
    when the fingerprints were stored: they fix the search, not the activation formula."""
    import dataclasses

    import torch

    from plait.models.transformer import Transformer, preset
    from plait.planner.model_stats import from_module

    with torch.device("meta"):
        model = Transformer(preset("test", **overrides))
    if frozen:
        model.tok_embeddings.requires_grad_(False)
        for block in list(model.layers)[:frozen]:
            block.requires_grad_(False)
    return dataclasses.replace(from_module(model), saved_extra=(0.0, 0.0), saved_scores=None)


def _moe() -> Any:
    from plait.planner.model_stats import from_hf_config

    return from_hf_config({"model_type": "mixtral", "hidden_size": 1024,
                           "intermediate_size": 2048, "num_hidden_layers": 8,
                           "num_attention_heads": 16, "num_key_value_heads": 4,
                           "vocab_size": 32000, "num_local_experts": 8,
                           "num_experts_per_tok": 2, "max_position_embeddings": 4096})


def cases() -> dict[str, Callable[[], Any]]:
    """name -> a function that runs the search (top=0: every layout that fits)."""
    from plait.models.transformer import preset
    from plait.planner import constants_for
    from plait.planner.cost import Workload
    from plait.planner.hardware import load_cluster
    from plait.planner.model_stats import load_model
    from plait.planner.search import search

    def on(model: Any, preset_name: str, devices: int, work: Any, **kw: Any) -> Callable[[], Any]:
        def run() -> Any:
            cluster = load_cluster(preset_name, devices=devices)
            return search(load_model(model() if callable(model) else model), cluster, work,
                          top=0, constants=constants_for(cluster), **kw)
        return run

    return {
        "llama-8b/dgx-h100x32": on("llama-8b", "dgx-h100", 32, Workload(128, 4096)),
        "mqa-1b/dgx-a100-40gbx16": on(lambda: preset("llama-1b", n_kv_heads=1),
                                      "dgx-a100-40gb", 16, Workload(64, 4096)),
        "mixtral-ish/h200x16": on(_moe, "h200", 16, Workload(64, 2048)),
        "built-tied/cpux8": on(lambda: _built({"vocab_size": 50257, "tie_embeddings": True}),
                               "cpu", 8, Workload(16, 64)),
        "built-frozen/cpux8": on(lambda: _built({"vocab_size": 50257}, frozen=1),
                                 "cpu", 8, Workload(16, 64),
                                 layout_check=lambda p: None),
    }


def fingerprint(result: Any) -> dict[str, Any]:
    """What a search found, to full float precision: a digest of every ranked estimate's whole
    record, and the first few in the open (to read a difference)."""
    whole = [e.to_dict() for e in result.ranked]
    digest = hashlib.sha256(json.dumps(whole, sort_keys=True).encode()).hexdigest()
    closest = result.closest.to_dict() if result.closest else None
    return {"digest": digest, "ranked": len(whole), "evaluated": result.evaluated,
            "fit": result.fit, "rejected": dict(sorted(result.rejected.items())),
            "closest": closest and [closest["plan"], closest["memory_bytes_per_device"]],
            "top": [[d["plan"], d["step_time_s"], d["memory_bytes_per_device"]]
                    for d in whole[:5]]}


def main() -> None:
    out = {name: fingerprint(run()) for name, run in cases().items()}
    STORED.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {STORED}")


if __name__ == "__main__":
    main()
