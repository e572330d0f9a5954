"""Checkpoints of a PyTorch/XLA SPMD run, in the format every other layout writes.

Under SPMD one process holds each tensor at its global shape, split over the devices by a
sharding annotation. torch_xla's DCP planners (``SPMDSavePlanner`` / ``SPMDLoadPlanner``, in
``torch_xla.experimental.distributed_checkpoint``) turn such a tensor into the chunks its
devices hold, each at its offset in the global tensor: the same ``.metadata`` and ``.distcp``
files a DTensor shard makes, so a checkpoint saved on XLA loads on a CPU or GPU job (under any
plan) and the reverse. What differs from the other layouts, and is done here:

* **Names.** FSDPv2 wraps each unit in a module that keeps the user's one as
  ``_orig_module``, and ``get_state_dict`` does not know that wrapper: :func:`user_name` drops
  it, so the file holds the user's parameter names (``blocks.0.fc1.weight``).
* **Loading in place.** ``SPMDLoadPlanner`` writes each chunk into the device shard it belongs
  to; it reads non-tensor values with ``torch.load``, which here goes through
  ``weights_only=True`` as every other plait load does (:func:`load_planner`).
* **Random state.** torch_xla keeps its generator's state as one integer per device
  (``xm.get_rng_state``), not in ``torch.get_device_module``.
* **Saving in the background** (``async_save``). DCP's own ``async_save`` stages a state dict
  for CPU and CUDA tensors: with XLA tensors its write fails (torch 2.9: "Attempted to access
  the data pointer on an invalid python storage"), and its staging allocates every tensor at
  its global size, sharding lost. Instead each host copies the shards it holds
  (:func:`save_in_background`), as torch_xla's ``CheckpointManager`` does, and a thread writes
  them with the same planner as a blocking save.
"""

from __future__ import annotations

import io
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

#: the attribute FSDPv2 keeps the wrapped module under
_WRAPPER = "_orig_module"


def user_name(name: str) -> str:
    """``name`` without FSDPv2's wrapper parts (whole dotted parts only)."""
    return ".".join(part for part in name.split(".") if part != _WRAPPER)


def is_xla(device: torch.device | None) -> bool:
    return device is not None and device.type == "xla"


def save_planner() -> Any:
    """A ``SPMDSavePlanner`` that writes each chunk of a tensor once.

    A tensor split over some mesh axes and replicated over others (a bias under
    ``dp_shard=2,zero=3,tp=2``: split on ``fsdp``, whole on each ``tp`` device) has two local
    shards at each offset, and ``SPMDSavePlanner`` plans a write for each; with torch 2.9 the
    tensor is then missing from the checkpoint's metadata altogether (so it would not load
    anywhere). Keeping the first write at each offset stores every value once."""
    import dataclasses

    from torch.distributed.checkpoint.planner import WriteItemType
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    class OnceSPMDSavePlanner(SPMDSavePlanner):
        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            seen, items = set(), []
            for item in plan.items:
                where = (item.index.fqn, tuple(item.index.offset or ()))
                if item.type == WriteItemType.SHARD and where in seen:
                    continue
                seen.add(where)
                items.append(item)
            return dataclasses.replace(plan, items=items)

    return OnceSPMDSavePlanner()


def save_in_background(state: dict[str, Any], writer: Any, group: Any) -> Future[Any]:
    """Copy ``state``'s tensors to host memory now, then write them in a thread; returns the
    write's future (``result()`` raises what the write raised).

    The copy is what training waits for: once it returns, the next step may change every
    device tensor without touching what is written. Each sharded tensor comes over as the
    shards this host holds, at their offsets, so the files are those a blocking save writes
    and the host never holds more than its share. ``group``: a gloo process group used only
    by checkpoints, so that the write's collectives (DCP's plan exchange between hosts) run
    beside training's. Call after :func:`materialize`."""
    import torch.distributed.checkpoint as dcp

    from .._torch_compat import xla_sharded_cpu_state_dict

    host = xla_sharded_cpu_state_dict()(_own_host_tensors(state))
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-xla-save")
    try:
        return pool.submit(dcp.save, host, storage_writer=writer, planner=save_planner(),
                           process_group=group)
    finally:
        pool.shutdown(wait=False)  # the thread ends with the write


def _own_host_tensors(value: Any) -> Any:
    """``value`` with its CPU tensors cloned. torch_xla's host copy hands a tensor that is
    already on the host back sharing its memory, and some change in place at the next step (an
    optimizer's step count: AdamW's ``step`` is a CPU tensor beside XLA parameters), so the
    write would store a later step's count with this step's weights."""
    if isinstance(value, torch.Tensor):
        return value if is_xla(value.device) else value.detach().clone()
    if isinstance(value, dict):
        return {k: _own_host_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_own_host_tensors(v) for v in value)
    return value


def load_planner() -> Any:
    """A ``SPMDLoadPlanner`` that reads non-tensor values without running code from the file."""
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    from .._torch_compat import xla_set_element
    from .safe import load_plain

    set_element = xla_set_element()

    class SafeSPMDLoadPlanner(SPMDLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = load_plain(read_item, value)
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)

    return SafeSPMDLoadPlanner()


def materialize() -> None:
    """Run what is pending on the device, so that every tensor a save reads (or a load wrote
    into) holds its value and its sharding, and the next step's graph starts clean."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    xm.wait_device_ops()


def rng_state() -> int:
    import torch_xla.core.xla_model as xm

    return int(xm.get_rng_state())


def set_rng_state(seed: int) -> None:
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(int(seed))
