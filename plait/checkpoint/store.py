"""Checkpoint folders on disk: naming, atomic publishing, keeping the last K, finding the latest.

A checkpoint folder (``ckpt/``) holds one sub-folder per saved step::

    ckpt/step-00000006/   .metadata  __0_0.distcp  __1_0.distcp  plait.json
    ckpt/step-00000008/   ...

Every rank writes its shards into ``ckpt/.tmp-step-00000008/``; only when DCP has gathered every
rank's results and written ``.metadata`` does rank 0 write ``plait.json`` (with each file's
size) and rename the folder to ``step-00000008``. A rename within one directory is atomic, so a
``step-*`` folder is always complete, and a crash at any point of a save leaves the previous
checkpoints as they were. Old steps are removed by renaming them out of the ``step-*``
namespace first, so a crash while deleting never leaves a half-deleted checkpoint that looks
published.

Nothing here needs a process group: rank 0 calls the writers, every rank may call the readers.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .errors import CheckpointError

MANIFEST = "plait.json"
# Bumped whenever what plait writes changes in a way an older plait could not read.
FORMAT = 1
_STEP = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-step-"
_TRASH_PREFIX = ".trash-"
_EXPECTED = "a folder written by plait's run.save() (plait.json, .metadata and *.distcp files)"


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def temp_dir(folder: Path, step: int) -> Path:
    return folder / f"{_TMP_PREFIX}{step:08d}"


def published(folder: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        match = _STEP.match(child.name)
        if match and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def unfinished(folder: Path) -> list[Path]:
    """Saves that never completed (a crash or kill during a save)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.startswith(_TMP_PREFIX)
                  or (_STEP.match(p.name) and not (p / MANIFEST).is_file()))


def resolve(path: str | Path) -> Path:
    """The step folder to load for ``path``: a step folder itself, or the latest complete one in
    a checkpoint folder. Raises CheckpointError naming the path and what was expected."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; expected {_EXPECTED}, or a "
                              f"folder of step-NNNNNNNN such folders")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a file; expected {_EXPECTED}")
    if (path / MANIFEST).is_file():
        return path
    if path.name.startswith(_TMP_PREFIX) or _STEP.match(path.name):
        raise CheckpointError(f"checkpoint {path} is half-written (a save that did not finish: "
                              f"no {MANIFEST}); load a complete step-NNNNNNNN folder instead")
    found = latest_step(path)
    if found is not None:
        return found[1]
    partial = unfinished(path)
    if partial:
        names = ", ".join(p.name for p in partial)
        raise CheckpointError(f"checkpoint folder {path} holds no complete checkpoint, only "
                              f"half-written saves ({names}); expected a step-NNNNNNNN folder "
                              f"with {MANIFEST}")
    entries = sorted(p.name for p in path.iterdir())
    if not entries:
        raise CheckpointError(f"checkpoint folder {path} is empty; expected step-NNNNNNNN "
                              f"folders written by run.save()")
    raise CheckpointError(f"{path} holds no plait checkpoint (found {', '.join(entries[:5])}"
                          f"{', ...' if len(entries) > 5 else ''}); expected {_EXPECTED}")


def latest_step(folder: str | Path) -> tuple[int, Path] | None:
    """(step, folder) of the newest checkpoint in ``folder``, or None when it has none (it does
    not exist, is empty, or holds only unfinished ``.tmp-step-*`` saves).

    A save publishes its ``step-*`` folder by a rename after writing ``plait.json``, so a
    newest ``step-*`` folder without one was damaged or copied in part: refused, never skipped
    for an older checkpoint (a run would resume from there and later overwrite it)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    steps = sorted((int(m.group(1)), child) for child in folder.iterdir()
                   if (m := _STEP.match(child.name)))
    if not steps:
        return None
    step, newest = steps[-1]
    if not (newest / MANIFEST).is_file():
        older = [p.name for _, p in steps[:-1] if (p / MANIFEST).is_file()]
        instead = f" (then {older[-1]} is the newest)" if older else ""
        raise CheckpointError(f"the newest checkpoint in {folder}, {newest.name}, has no "
                              f"{MANIFEST}: damaged or copied in part (a save writes it before "
                              f"the folder gets its step-* name); plait does not fall back to an "
                              f"older one by itself: remove or restore {newest.name}{instead}, "
                              f"or give another folder")
    return step, newest


def check_writable(folder: str | Path) -> Path:
    """Create ``folder`` if needed and prove a file can be written there, before any training."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} is a file; give a folder path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as exc:
        raise CheckpointError(f"checkpoint folder {folder} is not writable ({exc.strerror}); "
                              f"give a folder this job can write to") from None
    return folder


# ------------------------------------------------------------------------------ writing
def begin(folder: Path, step: int) -> Path:
    """Rank 0, before any rank writes: a clean temporary folder for ``step``'s save."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(folder, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, manifest: dict[str, Any]) -> Path:
    """Rank 0, after every rank's shards and DCP's metadata are written: add the manifest (with
    every file's size, so truncation is detected at load) and rename ``tmp`` into place."""
    manifest = dict(manifest)
    manifest["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    part = tmp / (MANIFEST + ".part")
    with open(part, "w") as f:
        json.dump(manifest, f, indent=1, allow_nan=True)
        f.flush()
        os.fsync(f.fileno())
    os.rename(part, tmp / MANIFEST)
    _fsync_dir(tmp)
    final = tmp.parent / step_name(int(manifest["step"]))
    if final.exists():  # the same step saved again (a run restarted from an older step)
        _remove(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    return final


def _remove(path: Path) -> None:
    trash = path.parent / f"{_TRASH_PREFIX}{path.name}"
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)  # out of the step-* namespace first: never half-deleted in place
    shutil.rmtree(trash)


def prune(folder: Path, keep: int | None) -> list[Path]:
    """Rank 0: delete all but the newest ``keep`` complete checkpoints, and leftover trash."""
    for p in folder.iterdir():
        if p.name.startswith(_TRASH_PREFIX):
            shutil.rmtree(p, ignore_errors=True)
    if keep is None:
        return []
    old = [p for _, p in published(folder)[:-keep]] if keep > 0 else []
    for p in old:
        _remove(p)
    return old


# ------------------------------------------------------------------------------ reading
def read_manifest(step_dir: Path) -> dict[str, Any]:
    """``plait.json`` of a step folder, checked: readable, this format, every file whole."""
    file = step_dir / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: the checkpoint is half-written") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file} cannot be read ({exc}): the file is truncated or "
                              f"corrupt") from None
    if not isinstance(manifest, dict) or "format" not in manifest or "step" not in manifest:
        raise CheckpointError(f"{file} is not a plait checkpoint manifest (no format/step "
                              f"fields)")
    if manifest["format"] != FORMAT:
        from .. import __version__

        raise CheckpointError(f"{step_dir} was written by plait {manifest.get('plait_version')}"
                              f" in checkpoint format {manifest['format']!r}; this plait "
                              f"{__version__} reads format {FORMAT} only: load it with the "
                              f"plait version that wrote it (and export it with plait export)")
    for name, size in (manifest.get("files") or {}).items():
        path = step_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete (expected "
                                  f"{size} bytes)")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(f"{path} is {actual} bytes, expected {size}: the file is "
                                  f"truncated or was modified after the save")
    return manifest


# ------------------------------------------------------------------------------ plain data
def to_plain(value: Any, where: str) -> Any:
    """Encode ``value`` as JSON-safe plain data (tuples, tensors and non-string keys tagged) so
    that ``from_plain`` gives it back exactly; anything else is refused: a checkpoint holds
    tensors and plain data only."""
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [to_plain(v, where) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [to_plain(v, where) for v in value]}
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: to_plain(v, f"{where}.{k}") for k, v in value.items()}
        return {"__dict__": [[to_plain(k, where), to_plain(v, f"{where}.{k}")]
                             for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return {"__tensor__": {"dtype": str(t.dtype).removeprefix("torch."),
                               "shape": list(t.shape),
                               "data": base64.b64encode(t.view(torch.uint8).numpy().tobytes()
                                                        if t.numel() else b"").decode()}}
    try:
        import numpy as np

        if isinstance(value, np.ndarray):
            return {"__ndarray__": {"dtype": str(value.dtype), "shape": list(value.shape),
                                    "data": base64.b64encode(value.tobytes()).decode()}}
        if isinstance(value, np.generic):
            return value.item()
    except ImportError:
        pass
    raise CheckpointError(f"{where} holds a {type(value).__name__}, which a checkpoint cannot "
                          f"store (tensors and plain data only: numbers, strings, lists, dicts)")


def from_plain(value: Any) -> Any:
    """Inverse of :func:`to_plain`."""
    import torch

    if isinstance(value, list):
        return [from_plain(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(from_plain(v) for v in value["__tuple__"])
    if "__bytes__" in value:
        return base64.b64decode(value["__bytes__"])
    if "__dict__" in value:
        return {from_plain(k): from_plain(v) for k, v in value["__dict__"]}
    if "__tensor__" in value:
        spec = value["__tensor__"]
        dtype = getattr(torch, str(spec["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"a stored tensor names dtype {spec['dtype']!r}, not a torch "
                                  f"dtype: the manifest is corrupt")
        raw = bytearray(base64.b64decode(spec["data"]))
        flat = (torch.frombuffer(raw, dtype=torch.uint8) if raw
                else torch.empty(0, dtype=torch.uint8))
        return flat.view(dtype).reshape(spec["shape"]).clone()
    if "__ndarray__" in value:
        import numpy as np

        spec = value["__ndarray__"]
        return np.frombuffer(base64.b64decode(spec["data"]),
                             dtype=np.dtype(spec["dtype"])).reshape(spec["shape"]).copy()
    return {k: from_plain(v) for k, v in value.items()}
