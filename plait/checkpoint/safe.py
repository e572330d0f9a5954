"""Reading a checkpoint without running code from it.

A checkpoint is tensors plus plain data, and loading one must never execute anything the file
says. Two places in ``torch.distributed.checkpoint`` (DCP) would: ``FileSystemReader`` reads the
``.metadata`` file with ``pickle.load``, and ``DefaultLoadPlanner.load_bytes`` reads non-tensor
values with ``torch.load(weights_only=False)``. Here the metadata goes through an unpickler that
admits only DCP's own metadata classes (and the torch types they hold: sizes, dtypes, layouts),
and non-tensor values through ``torch.load(weights_only=True)``. Tensor data itself is read by
DCP with ``weights_only=True`` already. Everything plait adds (step, plan, optimizer
settings, scheduler, loader position, random states) lives in ``plait.json``, read with
``json``, which cannot run code either.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from .errors import CheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: set[tuple[str, str]] = {
    *((_DCP_METADATA, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"),
    *(("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None),
                                                           torch.dtype)),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other global (a function to call, a class to build) is
    refused before it is looked up, so a crafted payload never runs."""

    def __init__(self, file: Any, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise CheckpointError(f"{self.path} refers to {module}.{name}, which is not "
                                  f"checkpoint data: refusing to load it (a checkpoint holds "
                                  f"tensors and plain data only); this file was not written by "
                                  f"plait or has been tampered with")
        return super().find_class(module, name)


def read_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint folder ``path``, read without running code."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f, file).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: the checkpoint is half-written; expected "
                              f"the metadata file every complete save has") from None
    except Exception as exc:  # noqa: BLE001 - EOF, bad opcodes...: a truncated or corrupt file
        raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {exc}): the file "
                              f"is truncated or corrupt") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: per-rank metadata files are not supported")
        metadata = read_metadata(Path(self.path))
        from torch.distributed.checkpoint.metadata import StorageMeta

        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


def read_tensors(step_dir: Path, state: dict[str, Any], *, no_dist: bool = False,
                 planner: Any = None) -> None:
    """Fill ``state`` in place from the checkpoint folder ``step_dir`` with DCP, safely.

    ``planner``: a load planner that reads non-tensor values safely too (PyTorch/XLA's, see
    :mod:`plait.checkpoint.xla`); default :class:`SafeLoadPlanner`.

    DCP reports any rank's failure as a ``CheckpointException`` (a BaseException carrying each
    rank's exception); it becomes one CheckpointError: ours as raised (a refused value), any
    other as the file being unreadable."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=SafeReader(step_dir), planner=planner or SafeLoadPlanner(),
                 no_dist=no_dist)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - see the docstring
        failures = getattr(exc, "failures", None) or {}
        cause = next(iter(failures.values()))[0] if failures else exc
        if isinstance(cause, CheckpointError):
            raise CheckpointError(str(cause)) from None
        first = str(cause).splitlines()[0] if str(cause) else ""
        raise CheckpointError(f"checkpoint {step_dir} cannot be read ({type(cause).__name__}: "
                              f"{first}): a file is corrupt or holds other values") from None


def load_plain(read_item: ReadItem, value: io.BytesIO) -> Any:
    """A checkpoint's non-tensor value (step, loader position, random states) read with
    ``weights_only=True``: plain data only, no code run from the file."""
    try:
        return torch.load(value, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch's refusal or a corrupt value alike
        raise CheckpointError(f"checkpoint value {read_item.dest_index.fqn!r} is not plain "
                              f"data ({exc.__class__.__name__}); refusing to load it") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = load_plain(read_item, value)
        if self.flatten_state_dict:
            from .._torch_compat import dcp_set_element

            path = self.mappings[read_item.dest_index.fqn]
            dcp_set_element()(self.original_state_dict, path, obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
