"""``plait export CKPT --to model.safetensors``: a checkpoint as one plain file.

The model's tensors are read from the DCP shards in this one process (DCP's ``no_dist`` load:
no process group, any number of saving ranks), full size, under the user's parameter names,
and written with ``safetensors``, which anything can read without plait or torch.distributed.
``--to DIR`` writes a Hugging Face folder (``model.safetensors`` and ``config.json``) when the
checkpoint is of a Hugging Face model (its config is kept in ``plait.json`` at save time), so
``AutoModelForCausalLM.from_pretrained(DIR)`` loads it. Optimizer state is not exported.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from . import store
from .errors import CheckpointError
from .safe import read_metadata, read_tensors

_MODEL = "model."


def model_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], Path]:
    """(every model tensor at full size, the manifest, the step folder) of a checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    step_dir = store.resolve(path)
    manifest = store.read_manifest(step_dir)
    metadata = read_metadata(step_dir)
    state = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for key, md in metadata.state_dict_metadata.items()
             if key.startswith(_MODEL) and isinstance(md, TensorStorageMetadata)}
    if not state:
        raise CheckpointError(f"checkpoint {step_dir} holds no model tensors")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        read_tensors(step_dir, state, no_dist=True)
    return {k[len(_MODEL):]: v for k, v in state.items()}, manifest, step_dir


def export(path: str | Path, to: str | Path) -> dict[str, Any]:
    """Write the checkpoint's model to ``to`` (a .safetensors file, or a folder for a Hugging
    Face model); returns what was written."""
    to = Path(to)
    hf_dir = to.suffix != ".safetensors"
    target = to / "model.safetensors" if hf_dir else to
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError("plait export writes safetensors: pip install safetensors "
                              "(or plait[hf])") from None
    try:  # the output is checked before any work
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".probe-"):
            pass
    except OSError as exc:
        raise CheckpointError(f"--to {to}: cannot write in {target.parent} ({exc.strerror}); "
                              f"give a .safetensors path or a folder this user can write to"
                              ) from None
    tensors, manifest, step_dir = model_tensors(path)
    config = (manifest.get("model") or {}).get("hf_config")
    if hf_dir and config is None:
        raise CheckpointError(f"--to {to} is a Hugging Face folder, but {step_dir} is not of a "
                              f"Hugging Face model (no config saved); export to a .safetensors "
                              f"file instead, e.g. --to {to}.safetensors")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(target),
                  metadata={"format": "pt", "plait_step": str(manifest["step"])})
        if hf_dir:
            (to / "config.json").write_text(json.dumps(store.from_plain(config), indent=2)
                                            + "\n")
    except OSError as exc:
        raise CheckpointError(f"cannot write {target}: {exc.strerror}") from None
    return {"checkpoint": str(step_dir), "step": manifest["step"], "to": str(target),
            "config": str(to / "config.json") if hf_dir else None, "tensors": len(tensors),
            "parameters": sum(t.numel() for t in tensors.values()),
            "bytes": target.stat().st_size}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint folder (its newest step) or a step folder")
    p.add_argument("--to", required=True,
                   help="model.safetensors, or a folder (Hugging Face models: safetensors and "
                   "config.json)")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text for people, json for programs (default: text)")


def command(args: argparse.Namespace) -> int:
    info = export(args.checkpoint, args.to)
    if args.format == "json":
        print(json.dumps(info, indent=2))
    else:
        print(f"exported {info['checkpoint']} (step {info['step']}): {info['tensors']} tensors, "
              f"{info['parameters']:,} parameters -> {info['to']} ({info['bytes']:,} bytes)"
              + (f" + {info['config']}" if info["config"] else ""), file=sys.stdout)
    return 0
