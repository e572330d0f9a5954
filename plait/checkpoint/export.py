"""``plait export CKPT --to model.safetensors``: a checkpoint as one plain file.

The model's tensors are read from the DCP shards in this one process (DCP's ``no_dist`` load:
no process group, any number of saving ranks), full size, under the user's parameter names,
and written with ``safetensors``, which anything can read without plait or torch.distributed.
``--to DIR`` writes a Hugging Face folder (``model.safetensors`` and ``config.json``) when the
checkpoint is of a Hugging Face model (its config is kept in ``plait.json`` at save time), so
``AutoModelForCausalLM.from_pretrained(DIR)`` loads it. Optimizer state is not exported.

torch, DCP and safetensors' torch half are imported by the functions that read and write
tensors, not with this module: ``plait export --help`` and every refusal (no safetensors, a
missing checkpoint or output folder, a file folder for a model without a Hugging Face config)
answer without them, in a fraction of a second instead of the seconds their import costs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import shutil
import stat
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..outputs import add_format, writable_folder
from . import store
from .errors import CheckpointError

if TYPE_CHECKING:
    import torch

_MODEL = "model."


def model_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], Path]:
    """(every model tensor at full size, the manifest, the step folder) of a checkpoint."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .safe import read_metadata, read_tensors

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
    Face model); returns what was written. Every refusal comes before a tensor is read (the
    minutes a large checkpoint takes) or anything is created."""
    to = Path(to)
    hf_dir = to.suffix != ".safetensors"
    target = to / "model.safetensors" if hf_dir else to
    if importlib.util.find_spec("safetensors") is None:
        raise CheckpointError("plait export writes safetensors: pip install safetensors "
                              "(or plait[hf])")
    _check_output(to, hf_dir)
    step_dir = store.resolve(path)
    config = (store.read_manifest(step_dir).get("model") or {}).get("hf_config")
    if hf_dir and config is None:
        raise CheckpointError(f"--to {to} is a Hugging Face folder, but {step_dir} is not of a "
                              f"Hugging Face model (no config saved); export to a .safetensors "
                              f"file instead, e.g. --to {to}.safetensors")
    tensors, manifest, step_dir = model_tensors(step_dir)
    from safetensors.torch import save_file

    made = hf_dir and not to.exists()
    try:
        if made:
            to.mkdir()
        _write_atomically(target, lambda tmp: save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(tmp),
            metadata={"format": "pt", "plait_step": str(manifest["step"])}))
        if hf_dir:
            text = json.dumps(store.from_plain(config), indent=2) + "\n"
            _write_atomically(to / "config.json", lambda tmp: tmp.write_text(text))
    except OSError as exc:
        if made:  # the folder this call created goes with the failed write
            shutil.rmtree(to, ignore_errors=True)
        raise CheckpointError(f"cannot write {target}: {exc.strerror}") from None
    return {"checkpoint": str(step_dir), "step": manifest["step"], "to": str(target),
            "config": str(to / "config.json") if hf_dir else None, "tensors": len(tensors),
            # Every number written: parameters and persistent buffers, and a tied weight once
            # under each of its names (the file holds no ties), so not the model's parameter
            # count.
            "values": sum(t.numel() for t in tensors.values()),
            "bytes": target.stat().st_size}


def _check_output(to: Path, hf_dir: bool) -> None:
    """Refuse, in --plot's words, a ``--to`` whose folder is missing, a file or not writable:
    a Hugging Face folder may be new (its parent must exist), a file's folder must exist."""
    folder = to if hf_dir and to.exists() else to.parent
    try:
        writable_folder(folder, f"--to {to}")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def _write_atomically(target: Path, write: Callable[[Path], object]) -> None:
    """``write`` a temporary file beside ``target``, then rename it over ``target``: a failed or
    killed export leaves no partial file. The file gets the mode a plain new file gets here
    (0o666 less the umask), not the 0600 of safetensors' own temporary file: it is meant to be
    shared."""
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint folder (its newest step) or a step folder")
    p.add_argument("--to", required=True, metavar="PATH",
                   help="model.safetensors, or a folder (Hugging Face models: safetensors and "
                   "config.json)")
    add_format(p)


def command(args: argparse.Namespace) -> int:
    info = export(args.checkpoint, args.to)
    if args.format == "json":
        print(json.dumps(info, indent=2))
    else:
        print(f"exported {info['checkpoint']} (step {info['step']}): {info['tensors']} tensors, "
              f"{info['values']:,} values -> {info['to']} ({info['bytes']:,} bytes)"
              + (f" + {info['config']}" if info["config"] else ""), file=sys.stdout)
    return 0
