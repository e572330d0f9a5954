"""When the runtime saves and what it resumes from: ``plait.init(checkpoint=, every=, keep=)``.

Checked in ``plait.init`` before the process group exists, so a bad setting or an unwritable
folder stops the job before any training: ``every`` and ``keep`` must be positive, the folder
must be writable, and a folder that already holds something must hold plait checkpoints (the
newest is resumed, after its manifest and files are verified). An empty or new folder starts
at step 0, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import store
from .api import PendingSave
from .errors import CheckpointError


def _positive(name: str, value: Any, meaning: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{name}={value!r} must be a whole number >= 1 ({meaning}), or "
                              f"None")
    return value


@dataclass
class Checkpointing:
    """Where checkpoints go, how often, how many are kept, and what the run resumes from."""

    folder: Path
    every: int | None = None      # save every N optimizer steps; None: at finish() and run.save()
    keep: int | None = 3          # newest checkpoints kept; None keeps all
    async_save: bool = False      # write in the background (DCP async_save on a gloo group)
    resume_path: Path | None = None  # the newest complete checkpoint found at init
    resume_step: int = 0
    resume_loader: dict[str, Any] | None = None  # its loader position (a stream's epoch)
    resumed: bool = False         # its state has been loaded into the model
    weights_in: Any = None        # the model its weights went into at run.parallelize
    weights_state: Any = None     # its tensors' (id, version) then: unchanged, no re-read
    last_saved: int | None = None
    pending: PendingSave | None = None
    group: Any = None             # the gloo group async saves run their collectives on
    note: str = ""                # what init found, printed by rank 0

    @classmethod
    def configure(cls, folder: str | Path, every: int | None, keep: int | None,
                  async_save: bool) -> Checkpointing:
        every = _positive("every", every, "save every N steps")
        keep = _positive("keep", keep, "how many checkpoints to keep")
        path = store.check_writable(folder)
        found = store.latest_step(path)
        partial = store.unfinished(path)
        if found is None:
            others = sorted(p.name for p in path.iterdir() if not p.name.startswith(".")
                            and p not in partial)
            if others:
                raise CheckpointError(f"checkpoint folder {path} holds files that are not plait "
                                      f"checkpoints ({', '.join(others[:5])}); give an empty or "
                                      f"new folder")
            note = f"checkpoints: {path} has none yet, starting at step 0"
            if partial:
                note += (f" (an unfinished save is ignored: "
                         f"{', '.join(p.name for p in partial)})")
            return cls(path, every, keep, bool(async_save), note=note)
        step, step_dir = found
        manifest = store.read_manifest(step_dir)  # verified now: a broken newest one stops here
        note = f"checkpoints: resuming from {step_dir} (step {step})"
        if partial:
            note += f" (an unfinished save is ignored: {', '.join(p.name for p in partial)})"
        return cls(path, every, keep, bool(async_save), resume_path=step_dir,
                   resume_step=int(manifest["step"]), last_saved=int(manifest["step"]),
                   resume_loader=store.from_plain(manifest.get("loader")), note=note)

    def due(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0 and step != self.last_saved
