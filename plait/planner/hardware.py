"""Cluster descriptions for the planner: a catalog of presets, YAML files, and calibration.

A cluster is data: nodes x devices per node, memory, peak FLOP/s per dtype, and two bandwidth
tiers (inside a node, between nodes) with a latency each. That is all the cost model needs to
place the mesh axes: tp innermost (inside a node when it fits), then dp_shard, dp_replicate, pp.

Bandwidths are per device and per direction, in the units vendors print (GB/s); a collective's
time is ``latency * steps + wire_bytes / bandwidth`` with the wire-byte convention of
:mod:`plait.comm.volumes`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRESET_DIR = Path(__file__).parent / "presets"
GB = 1e9

_REQUIRED = ("name", "devices_per_node", "memory_gb", "peak_tflops", "intra_node_gbps",
             "inter_node_gbps")


@dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster. Bandwidths in bytes/s per device per direction, times in s."""

    name: str
    device: str
    nodes: int
    devices_per_node: int
    memory_bytes: float
    peak_flops: Mapping[str, float]
    intra_bw: float
    inter_bw: float
    intra_latency: float = 10e-6
    inter_latency: float = 20e-6
    hbm_bw: float = 1e12
    reserve_bytes: float = 0.0
    # Devices that can compute at full speed at once on one node (CPU: cores); None = all.
    compute_units: int | None = None
    source: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    # Devices in one whole node when this cluster was cut down to part of a node (``--devices
    # 1`` of an 8-GPU preset); growing it again adds whole nodes of this size. None = as listed.
    full_node: int | None = None
    # Host time per aten op (s): dispatch, and on an accelerator the kernel launch, whatever
    # the op's size. On a CPU it adds to the op's arithmetic (the host is the device); an
    # accelerator's host launches ahead of it, so a step is the longer of the two
    # (:attr:`ops_in_line`). Priced for models without blocks (plait.planner.whole_model).
    op_latency: float = 0.0

    @property
    def ops_in_line(self) -> bool:
        """Whether the host's per-op time adds to the compute (a CPU computes on the host that
        dispatches) rather than hiding under it (an accelerator runs asynchronously)."""
        return self.device.lower() == "cpu"

    def __post_init__(self) -> None:
        errors = []
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                errors.append(f"{name}={value!r} must be a positive integer")
        for name in ("memory_bytes", "intra_bw", "inter_bw", "hbm_bw"):
            if not getattr(self, name) > 0:
                errors.append(f"{name}={getattr(self, name)!r} must be > 0")
        for name in ("intra_latency", "inter_latency", "reserve_bytes", "op_latency"):
            if getattr(self, name) < 0:
                errors.append(f"{name}={getattr(self, name)!r} must be >= 0")
        if not self.peak_flops or any(not v > 0 for v in self.peak_flops.values()):
            errors.append(f"peak_flops={dict(self.peak_flops)!r} needs at least one dtype with a "
                          f"positive FLOP/s figure")
        if self.reserve_bytes >= self.memory_bytes:
            errors.append(f"reserve_bytes={self.reserve_bytes} leaves no memory of "
                          f"memory_bytes={self.memory_bytes}")
        if self.compute_units is not None and self.compute_units < 1:
            errors.append(f"compute_units={self.compute_units!r} must be >= 1")
        if errors:
            raise ValueError(f"invalid cluster {self.name!r}: " + "; ".join(errors))

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for the compute dtype (fp32 falls back to tf32 when listed). fp16 only
        where the chip lists it: TPUs have no fp16 matmul units (bf16 is their 16-bit type)."""
        for key in ((dtype, "tf32") if dtype == "fp32" else (dtype, "fp16")):
            if key in self.peak_flops:
                return float(self.peak_flops[key])
        if dtype == "fp16":
            raise ValueError(f"fp16: {self.device} (cluster {self.name!r}) lists no fp16 peak "
                             f"(has {', '.join(self.peak_flops)}); TPUs and CPUs train in bf16, "
                             f"not fp16: use --dtype bf16 (mixed_precision=bf16), which needs "
                             f"no loss scaling")
        raise ValueError(f"cluster {self.name!r} lists no peak FLOP/s for dtype {dtype!r} "
                         f"(has {', '.join(self.peak_flops)})")

    def with_world(self, devices: int) -> Cluster:
        """This cluster resized to ``devices`` devices (whole nodes, or part of one). A cluster
        already cut to part of a node grows back in whole nodes of the original size."""
        if not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices={devices!r} must be a positive integer")
        node = self.full_node or self.devices_per_node
        if devices <= node:
            return dataclasses.replace(self, nodes=1, devices_per_node=devices,
                                       full_node=node if devices < node else None)
        if devices % node:
            raise ValueError(f"devices={devices} is not a whole number of {self.name} nodes of "
                             f"{node}; use a multiple of {node}")
        return dataclasses.replace(self, nodes=devices // node, devices_per_node=node,
                                   full_node=None)

    def with_nodes(self, nodes: int) -> Cluster:
        if not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes={nodes!r} must be a positive integer")
        return dataclasses.replace(self, nodes=nodes)

    def with_memory(self, memory_bytes: float) -> Cluster:
        return dataclasses.replace(self, memory_bytes=float(memory_bytes))

    def to_yaml_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "device": self.device, "devices_per_node": self.devices_per_node,
               "nodes": self.nodes, "memory_gb": self.memory_bytes / GB,
               "peak_tflops": {k: v / 1e12 for k, v in self.peak_flops.items()},
               "intra_node_gbps": self.intra_bw / GB, "inter_node_gbps": self.inter_bw / GB,
               "intra_node_latency_us": self.intra_latency * 1e6,
               "inter_node_latency_us": self.inter_latency * 1e6,
               "hbm_gbps": self.hbm_bw / GB, "reserve_gb": self.reserve_bytes / GB,
               "op_latency_us": self.op_latency * 1e6}
        if self.compute_units is not None:
            out["compute_units"] = self.compute_units
        if self.extra:
            out["extra"] = dict(self.extra)
        return out


def presets() -> list[str]:
    """Names of the catalog presets."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _number(data: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    value = data.get(key, default)
    if value is None:
        raise ValueError(f"{where}: missing field {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: field {key}={value!r} must be a number")
    return float(value)


def cluster_from_dict(data: Mapping[str, Any], where: str = "cluster") -> Cluster:
    """Build a Cluster from the YAML schema (GB, GB/s, TFLOP/s, microseconds)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)} "
                         f"(required: {', '.join(_REQUIRED)})")
    peak = data["peak_tflops"]
    if not isinstance(peak, Mapping) or not peak:
        raise ValueError(f"{where}: field peak_tflops must map dtype -> TFLOP/s, "
                         "e.g. {bf16: 312}")
    peak_flops = {}
    for dtype, value in peak.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{where}: field peak_tflops.{dtype}={value!r} must be a positive "
                             f"number")
        peak_flops[str(dtype)] = float(value) * 1e12
    dpn = data["devices_per_node"]
    nodes = data.get("nodes", 1)
    for key, value in (("devices_per_node", dpn), ("nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: field {key}={value!r} must be a positive integer")
    units = data.get("compute_units")
    if units is not None and (isinstance(units, bool) or not isinstance(units, int) or units < 1):
        raise ValueError(f"{where}: field compute_units={units!r} must be a positive integer")
    fields: dict[str, Any] = {}
    for key, yaml_key, scale, default in (
            ("memory_bytes", "memory_gb", GB, None),
            ("intra_bw", "intra_node_gbps", GB, None),
            ("inter_bw", "inter_node_gbps", GB, None),
            ("intra_latency", "intra_node_latency_us", 1e-6, 10),
            ("inter_latency", "inter_node_latency_us", 1e-6, 20),
            ("hbm_bw", "hbm_gbps", GB, 1000),
            ("reserve_bytes", "reserve_gb", GB, 0),
            ("op_latency", "op_latency_us", 1e-6, 0)):
        value = _number(data, yaml_key, where, default)
        if value < 0 or (default is None and value == 0):
            raise ValueError(f"{where}: field {yaml_key}={value:g} must be "
                             f"{'> 0' if default is None else '>= 0'}")
        fields[key] = value * scale
    return Cluster(name=str(data["name"]), device=str(data.get("device", data["name"])),
                   nodes=nodes, devices_per_node=dpn, peak_flops=peak_flops,
                   compute_units=units, source=where, extra=dict(data.get("extra", {})),
                   **fields)


def load_cluster(spec: str | Path | Cluster | Mapping[str, Any], *, nodes: int | None = None,
                 devices: int | None = None) -> Cluster:
    """A catalog preset name, a YAML path, a dict or a Cluster; optionally resized."""
    if isinstance(spec, Cluster):
        cluster = spec
    elif isinstance(spec, Mapping):
        cluster = cluster_from_dict(spec)
    else:
        text = str(spec)
        path = Path(text)
        if path.suffix in (".yaml", ".yml") or path.exists():
            if not path.exists():
                raise ValueError(f"cluster file {text!r} does not exist")
            import yaml
            try:
                data = yaml.safe_load(path.read_text())
            except yaml.YAMLError as exc:
                raise ValueError(f"cluster file {text!r} is not valid YAML: {exc}") from None
            cluster = cluster_from_dict(data, where=f"cluster file {text!r}")
        else:
            preset_path = PRESET_DIR / f"{text}.yaml"
            if not preset_path.exists():
                raise ValueError(f"unknown cluster preset {text!r}; known: {', '.join(presets())}"
                                 f" (or give a path to a cluster YAML)")
            import yaml
            cluster = cluster_from_dict(yaml.safe_load(preset_path.read_text()),
                                        where=f"preset {text!r}")
    if nodes is not None and devices is not None:
        raise ValueError("give either nodes or devices, not both")
    if nodes is not None:
        cluster = cluster.with_nodes(nodes)
    if devices is not None:
        cluster = cluster.with_world(devices)
    return cluster


def save_cluster(cluster: Cluster, path: str | Path) -> Path:
    import yaml
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cluster.to_yaml_dict(), sort_keys=False))
    return path
