"""The Plan: one typed, validated, serialisable description of a parallel layout.

A Plan is data. The same object comes from a string (``"dp=2,tp=2,pp=2"``), a dict, a YAML/JSON
file, or the automatic planner, and the runtime, the mesh builder, the planner and the
communication formulas all read it. Validation raises ``ValueError`` naming every factor, so a
layout that cannot run is refused before any worker starts.

Degrees multiply to the world size, in mesh order (outermost first)::

    pp * dp_replicate * dp_shard * cp * tp == world_size

``tp`` is innermost so that tensor-parallel ranks are neighbours (same node, fastest links);
``pp`` is outermost since its point-to-point traffic is the lightest.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Order of the named mesh axes, outermost first. The mesh builder and the planner share it.
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv")
# Schedules that run more than one stage per rank (virtual stages).
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv")
# Schedules that split the backward into an input-gradient and a later weight-gradient pass.
# DDP and FSDP2 synchronise gradients when the backward pass ends, before those weight gradients
# exist, so with data parallelism they train a different model (measured: loss off by 6e-2
# after 5 steps); plait refuses that combination rather than train it wrongly.
ZERO_BUBBLE_SCHEDULES = ("interleaved_zb", "zbv")
CHECKPOINTING = ("none", "full", "selective", "op")
PRECISIONS = ("fp32", "bf16")

# Short names accepted in plan strings, mapped to fields.
_ALIASES = {
    "schedule": "pp_schedule",
    "mb": "microbatches",
    "v": "virtual_stages",
    "ac": "activation_checkpointing",
    "mp": "mixed_precision",
    "precision": "mixed_precision",
    "accum": "grad_accum",
    "clip": "grad_clip",
}


@dataclass(frozen=True)
class Plan:
    """A parallel layout. Every field has a default that means "off"."""

    # Data parallelism. Ranks along dp_replicate hold full replicas (DDP, or the replicate half of
    # HSDP); ranks along dp_shard split the model state between them (ZeRO / FSDP).
    dp_replicate: int = 1
    dp_shard: int = 1
    # ZeRO stage over the dp_shard axis: 1 shards optimizer state, 2 also gradients, 3 also
    # parameters. 0 (no sharding) is only valid with dp_shard == 1.
    zero: int = 0
    # Move ZeRO-3 parameters and optimizer state to CPU memory between uses.
    offload: bool = False
    # Tensor parallelism (Megatron-style column/row split) and its sequence-parallel variant,
    # which also shards norms/dropout activations along the sequence between TP regions.
    tp: int = 1
    sp: bool = False
    # Context parallelism: reserved, must be 1 for now (the axis exists so plans stay stable).
    cp: int = 1
    # Pipeline parallelism: stages, schedule, microbatches per step, stages per rank.
    pp: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    # Activation checkpointing: none, full (every block), selective (every k-th block), op
    # (torch's selective-checkpoint policy: keep matmul outputs, recompute the cheap ops).
    activation_checkpointing: str = "none"
    checkpoint_every: int = 2
    # Compute dtype. bf16 keeps fp32 master weights and reduces gradients in fp32.
    mixed_precision: str = "fp32"
    # Micro-steps accumulated per optimizer step (no gradient sync until the last one).
    grad_accum: int = 1
    # Clip the global gradient norm to this value; None or 0 disables clipping.
    grad_clip: float | None = 1.0
    # Extra, strategy-specific options (e.g. {"tp_plan": {...}}, {"shard_patterns": [...]}).
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ degrees
    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    def degrees(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    # ------------------------------------------------------------------ validation
    def validate(self, world_size: int | None = None) -> Plan:
        """Raise ValueError listing every problem; return self when the plan is sound."""
        errors: list[str] = []
        for name in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "microbatches",
                     "virtual_stages", "grad_accum", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                errors.append(f"{name}={value!r} must be a positive integer")
        if errors:  # the rest assumes integers
            raise ValueError("invalid plan: " + "; ".join(errors))
        if self.zero not in (0, 1, 2, 3):
            errors.append(f"zero={self.zero!r} must be 0, 1, 2 or 3")
        elif self.zero > 0 and self.dp_shard == 1:
            errors.append(f"zero={self.zero} needs dp_shard > 1 (the axis it shards over); "
                          f"e.g. 'dp_shard=2,zero={self.zero}'")
        elif self.zero == 0 and self.dp_shard > 1:
            errors.append(f"dp_shard={self.dp_shard} needs a ZeRO stage: add zero=1, 2 or 3")
        if self.offload and self.zero != 3:
            errors.append(f"offload=True needs zero=3 (got zero={self.zero})")
        if self.sp and self.tp == 1:
            errors.append("sp=True (sequence parallel) needs tp > 1")
        if self.cp != 1:
            errors.append(f"cp={self.cp}: context parallelism is reserved and must be 1")
        if self.pp_schedule not in PP_SCHEDULES:
            errors.append(f"pp_schedule={self.pp_schedule!r} is not one of "
                          f"{', '.join(PP_SCHEDULES)}")
        elif self.pp > 1:
            if self.virtual_stages > 1 and self.pp_schedule not in MULTI_STAGE_SCHEDULES:
                errors.append(f"virtual_stages={self.virtual_stages} needs a multi-stage schedule "
                              f"({', '.join(MULTI_STAGE_SCHEDULES)}), not {self.pp_schedule!r}")
            if self.pp_schedule == "zbv" and self.virtual_stages != 2:
                errors.append(f"pp_schedule='zbv' runs exactly 2 stages per rank "
                              f"(virtual_stages={self.virtual_stages})")
            if self.pp_schedule in MULTI_STAGE_SCHEDULES and self.virtual_stages < 2:
                errors.append(f"pp_schedule={self.pp_schedule!r} needs virtual_stages >= 2")
            if self.pp_schedule in ZERO_BUBBLE_SCHEDULES and self.dp > 1:
                errors.append(f"pp_schedule={self.pp_schedule!r} with data parallelism "
                              f"(dp_replicate*dp_shard={self.dp}) is not supported: gradients "
                              f"would be synchronised before the deferred weight gradients "
                              f"exist; use interleaved_1f1b or 1f1b with dp, or dp=1")
            if self.microbatches < self.pp and self.pp_schedule != "gpipe":
                errors.append(f"microbatches={self.microbatches} < pp={self.pp}: "
                              f"{self.pp_schedule} needs at least one microbatch per stage "
                              f"(use microbatches>={self.pp})")
        if self.activation_checkpointing not in CHECKPOINTING:
            errors.append(f"activation_checkpointing={self.activation_checkpointing!r} is not one "
                          f"of {', '.join(CHECKPOINTING)}")
        if self.mixed_precision not in PRECISIONS:
            errors.append(f"mixed_precision={self.mixed_precision!r} is not one of "
                          f"{', '.join(PRECISIONS)}")
        if self.grad_clip is not None and self.grad_clip < 0:
            errors.append(f"grad_clip={self.grad_clip} must be >= 0 (0 or None disables it)")
        if world_size is not None and self.world_size != world_size:
            product = " * ".join(f"{a}({getattr(self, a)})" for a in MESH_AXES)
            errors.append(f"{product} = {self.world_size} != world size {world_size}; "
                          f"make the degrees multiply to {world_size}")
        if errors:
            raise ValueError("invalid plan: " + "; ".join(errors))
        return self

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["options"] = dict(self.options)
        return out

    def to_string(self) -> str:
        """Compact form listing the fields that differ from the defaults."""
        default = Plan()
        parts = []
        for f in dataclasses.fields(self):
            if f.name == "options":
                continue
            value = getattr(self, f.name)
            if value != getattr(default, f.name):
                parts.append(f"{f.name}={_format_value(value)}")
        return ",".join(parts) or "single"

    def describe(self) -> str:
        """One line for humans: the degrees and what is switched on."""
        axes = " x ".join(f"{a}={getattr(self, a)}" for a in MESH_AXES if getattr(self, a) > 1)
        extras = []
        if self.zero:
            extras.append(f"ZeRO-{self.zero}" + (" +offload" if self.offload else ""))
        if self.sp:
            extras.append("sequence-parallel")
        if self.pp > 1:
            extras.append(f"{self.pp_schedule} m={self.microbatches}"
                          + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.activation_checkpointing != "none":
            extras.append(f"checkpointing={self.activation_checkpointing}")
        if self.mixed_precision != "fp32":
            extras.append(self.mixed_precision)
        if self.grad_accum > 1:
            extras.append(f"accum={self.grad_accum}")
        return (axes or "single device") + (f" ({', '.join(extras)})" if extras else "")

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        data = dict(data)
        # Convenience keys: dp means "replicate" without ZeRO and "shard" with it; fsdp=N means
        # dp_shard=N with ZeRO-3.
        kwargs: dict[str, Any] = {}
        names = {f.name for f in dataclasses.fields(cls)}
        dp = data.pop("dp", None)
        fsdp = data.pop("fsdp", None)
        for key, value in data.items():
            name = _ALIASES.get(key, key)
            if name not in names:
                raise ValueError(f"unknown plan field {key!r}; known fields: "
                                 f"{', '.join(sorted(names | {'dp', 'fsdp'}))}")
            kwargs[name] = value
        if fsdp is not None:
            kwargs.setdefault("dp_shard", int(fsdp))
            kwargs.setdefault("zero", 3)
        if dp is not None:
            if kwargs.get("zero", 0):
                kwargs.setdefault("dp_shard", int(dp))
            else:
                kwargs.setdefault("dp_replicate", int(dp))
        return cls(**kwargs)

    @classmethod
    def from_string(cls, text: str) -> Plan:
        """Parse ``"dp=2,tp=2,pp=2,schedule=1f1b,mb=4"``; ``"single"`` or ``""`` is one device."""
        text = text.strip()
        if text in ("", "single", "none"):
            return cls()
        data: dict[str, Any] = {}
        for item in text.replace(" ", "").split(","):
            if not item:
                continue
            if "=" not in item:
                if item in ("sp", "offload"):
                    data[item] = True
                    continue
                raise ValueError(f"cannot parse plan item {item!r} in {text!r}: expected "
                                 f"key=value, e.g. 'dp=2,tp=2,pp=2'")
            key, raw = item.split("=", 1)
            data[key] = _parse_value(key, raw, text)
        return cls.from_dict(data)

    @classmethod
    def load(cls, source: Plan | str | Path | Mapping[str, Any] | None) -> Plan:
        """Accept a Plan, a dict, a plan string, or a path to a .yaml/.yml/.json file."""
        if source is None:
            return cls()
        if isinstance(source, Plan):
            return source
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        path = Path(str(source))
        if path.suffix in (".yaml", ".yml", ".json"):
            if not path.exists():
                raise ValueError(f"plan file {str(path)!r} does not exist")
            text = path.read_text()
            if path.suffix == ".json":
                data = json.loads(text)
            else:
                import yaml
                data = yaml.safe_load(text)
            if not isinstance(data, Mapping):
                raise ValueError(f"plan file {str(path)!r} must hold a mapping of fields")
            return cls.from_dict(data.get("plan", data))
        return cls.from_string(str(source))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.suffix == ".json":
            path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        else:
            import yaml
            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True,
               "false": False, "0": False, "no": False, "off": False}
_STRING_FIELDS = {"pp_schedule", "schedule", "activation_checkpointing", "ac", "mixed_precision",
                  "mp", "precision"}
_BOOL_FIELDS = {"sp", "offload"}
_FLOAT_FIELDS = {"grad_clip", "clip"}


def _parse_value(key: str, raw: str, text: str) -> Any:
    if key in _STRING_FIELDS:
        return raw.lower()
    if key in _BOOL_FIELDS:
        if raw.lower() not in _BOOL_WORDS:
            raise ValueError(f"{key}={raw!r} in {text!r} must be true or false")
        return _BOOL_WORDS[raw.lower()]
    if key in _FLOAT_FIELDS:
        if raw.lower() in ("none", "off"):
            return None
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{key}={raw!r} in {text!r} must be a number") from None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r} in {text!r} must be an integer, e.g. '{key}=2'") from None
