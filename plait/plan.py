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
import difflib
import json
import math
import re
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
PRECISIONS = ("fp32", "bf16", "fp16")

# Short names accepted in plan strings, mapped to fields.
_ALIASES = {
    "schedule": "pp_schedule",
    "mb": "microbatches",
    "v": "virtual_stages",
    "vpp": "virtual_stages",  # Megatron's "virtual pipeline" size
    "ac": "activation_checkpointing",
    "mp": "mixed_precision",
    "precision": "mixed_precision",
    "accum": "grad_accum",
    "clip": "grad_clip",
}
# Shorthands that expand to several fields (see Plan.from_dict).
_SHORTHANDS = ("dp", "fsdp")


def _did_you_mean(key: Any, known: list[str] | tuple[str, ...] | set[str]) -> str:
    """The closest known name; on a tie ('dpp' is one edit from 'dp' and from 'pp') the ones
    that start with the key's first letter (rarely the mistyped one), else all of them."""
    lower = str(key).lower()
    if lower in known:
        return f"did you mean {lower!r}? "
    close = difflib.get_close_matches(lower, sorted(known), n=3)
    if not close:
        return ""
    best = difflib.SequenceMatcher(None, lower, close[0]).ratio()
    tied = [k for k in close if difflib.SequenceMatcher(None, lower, k).ratio() == best]
    tied = [k for k in tied if k[0] == lower[0]] or tied
    return f"did you mean {' or '.join(repr(k) for k in tied)}? "


def rounds_error(schedule: str, pp: int, microbatches: int) -> str:
    """Why ``microbatches`` cannot run under an interleaved schedule (torch's interleaved 1F1B
    and interleaved zero-bubble run them in ``max(1, m // pp)`` rounds of equal size, and
    raise mid-step otherwise), or "" when they can. Shared by :meth:`Plan.validate` and the
    pipeline's own check, so a plan is refused when it is made, not at its first step."""
    if schedule not in ("interleaved_1f1b", "interleaved_zb") or pp < 1 or microbatches < pp:
        return ""
    rounds = max(1, microbatches // pp)
    if microbatches % rounds == 0:
        return ""
    good = [m for m in range(pp, 4 * pp + 1) if m % max(1, m // pp) == 0]
    return (f"schedule {schedule!r} runs microbatches in rounds of pp={pp}: microbatches="
            f"{microbatches} is not a multiple of its {rounds} rounds; use e.g. microbatches "
            f"in {good[:6]}")

@dataclass(frozen=True)
class PlanOptions:
    """Strategy-specific settings that only some layouts read. All default to "not given".

    Sequences are stored as tuples (a Plan is immutable); lists are accepted and converted.
    """

    # The user's tensor-parallel layer plan, {module-name glob: style} or {"styles": {...},
    # "divide_attrs": {...}} (see plait.parallel.tp_plans); None uses the shipped or inferred one.
    tp_plan: Mapping[str, Any] | None = None
    # Pipeline cuts by name: each entry names the first block of a stage (e.g. "layers.4").
    split_points: tuple[str, ...] | None = None
    # Pipeline cuts by cost: one relative cost per block; stages get equal total cost.
    stage_costs: tuple[float, ...] | None = None
    # Pipeline cuts by count: blocks per stage, in global stage order (the planner writes this).
    pp_stage_layers: tuple[int, ...] | None = None
    # Dotted name of the block sequence to split into pipeline stages (found when None).
    pp_blocks: str | None = None
    # fnmatch globs over module names that FSDP2 shards as units (the repeated blocks when None).
    shard_patterns: tuple[str, ...] | None = None
    # fnmatch globs over module names that activation checkpointing wraps (the repeated blocks
    # when None): a model without a stack of blocks (a U-Net's residual blocks, 'down.*', 'mid').
    checkpoint_patterns: tuple[str, ...] | None = None
    # On gloo, run FSDP2's all-gather/reduce-scatter as all-to-alls (faster there); False keeps
    # FSDP2's own collectives.
    gloo_all_to_all: bool = True

    def __post_init__(self) -> None:
        errors: list[str] = []
        if isinstance(self.tp_plan, Mapping):
            from .parallel.tp_plans import TPPlan  # style names live there (imports torch)

            try:
                TPPlan.from_option(self.tp_plan)
            except ValueError as exc:
                errors.append(str(exc))
        elif self.tp_plan is not None and not hasattr(self.tp_plan, "styles"):  # a TPPlan
            errors.append(f"options.tp_plan={self.tp_plan!r} must be a mapping of module-name "
                          f"glob to style, e.g. {{'layers.*.q_proj': 'colwise'}}")
        for name, kind, example in (("split_points", str, "['layers.4']"),
                                    ("shard_patterns", str, "['layers.*']"),
                                    ("checkpoint_patterns", str, "['down.*', 'mid']"),
                                    ("pp_stage_layers", int, "[3, 5]"),
                                    ("stage_costs", float, "[1.0, 1.0, 2.0]")):
            value = getattr(self, name)
            if value is None:
                continue
            items = list(value) if isinstance(value, (list, tuple)) else None
            if items is None or not items or not all(_is_kind(v, kind) for v in items):
                what = {str: "names", int: "positive integers", float: "positive numbers"}[kind]
                errors.append(f"options.{name}={value!r} must be a non-empty list of {what}, "
                              f"e.g. {example}")
                continue
            if kind is not str and min(items) <= 0:
                errors.append(f"options.{name}={value!r} must hold positive values only")
                continue
            object.__setattr__(self, name, tuple(items))
        if self.pp_blocks is not None and not isinstance(self.pp_blocks, str):
            errors.append(f"options.pp_blocks={self.pp_blocks!r} must be a module name, "
                          f"e.g. 'layers'")
        if not isinstance(self.gloo_all_to_all, bool):
            errors.append(f"options.gloo_all_to_all={self.gloo_all_to_all!r} must be true or "
                          f"false (a boolean, not a string)")
        cuts = [n for n in ("split_points", "stage_costs", "pp_stage_layers")
                if getattr(self, n) is not None]
        if len(cuts) > 1:
            errors.append(f"options {', '.join(cuts)} each fix the pipeline cuts; give only one")
        if errors:
            raise ValueError("invalid plan options: " + "; ".join(errors))

    @classmethod
    def from_dict(cls, data: Any) -> PlanOptions:
        if isinstance(data, PlanOptions):
            return data
        if not isinstance(data, Mapping):
            raise ValueError(f"options={data!r} must be a mapping of option names to values, "
                             f"e.g. {{'split_points': ['layers.4']}}")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                raise ValueError(f"unknown plan option {key!r}; {_did_you_mean(key, names)}"
                                 f"options are {', '.join(names)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """The options that differ from the defaults, as plain lists/dicts (YAML/JSON-safe)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if isinstance(value, tuple):
                value = list(value)
            elif f.name == "tp_plan":
                value = value.to_dict() if hasattr(value, "to_dict") else dict(value)
            out[f.name] = value
        return out

    def replace(self, **changes: Any) -> PlanOptions:
        return dataclasses.replace(self, **changes)


def _is_kind(value: Any, kind: type) -> bool:
    if kind is str:
        return isinstance(value, str) and bool(value)
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, int)
    return isinstance(value, (int, float)) and math.isfinite(value)


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
    # Context parallelism: each sequence is split over cp ranks (head and tail chunks), which
    # all-gather keys and values for attention (plait.parallel.context). Composes with
    # dp_replicate and dp_shard (FSDP then shards over dp_shard x cp) and with tp (zero=0), not pp.
    cp: int = 1
    # Pipeline parallelism: stages, schedule, microbatches per step, stages per rank.
    # microbatches=0 (the default) means one per pipeline rank (``pp``): the fewest that keep
    # every stage busy in 1F1B's steady state; more shrink the bubble, fewer are refused.
    pp: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int = 0
    virtual_stages: int = 1
    # Activation checkpointing: none, full (every block), selective (every k-th block), op
    # (torch's selective-checkpoint policy: keep matmul outputs, recompute the cheap ops).
    activation_checkpointing: str = "none"
    checkpoint_every: int = 2
    # Compute dtype. bf16 and fp16 keep fp32 master weights and reduce gradients in fp32;
    # fp16 (GPUs without bf16: T4, V100) also scales the loss dynamically (plait.loss_scale).
    mixed_precision: str = "fp32"
    # Micro-steps accumulated per optimizer step (no gradient sync until the last one).
    grad_accum: int = 1
    # Clip the global gradient norm to this value; None or 0 disables clipping.
    grad_clip: float | None = 1.0
    # BatchNorm statistics over the data axes (the global batch) instead of each rank's share.
    sync_bn: bool = False
    # Parameters a step may leave without a gradient on some ranks (a branch taken for some
    # batches only, an auxiliary head): DDP finds them each step, FSDP2 reduces zeros for them.
    # Without it, ranks that disagree run mismatched collectives.
    find_unused: bool = False
    # torch.compile each repeated block's forward after the layout (``plait.parallel.compile``).
    compile: bool = False
    # Strategy-specific settings (a user TP plan, pipeline cuts, FSDP units); a dict is accepted
    # and checked key by key.
    options: PlanOptions = field(default_factory=PlanOptions)

    def __post_init__(self) -> None:
        if self.microbatches == 0:  # the default: resolved here, so every reader sees a count
            pp = self.pp if isinstance(self.pp, int) and self.pp > 1 else 1
            object.__setattr__(self, "microbatches", pp)
        if not isinstance(self.options, PlanOptions):
            object.__setattr__(self, "options", PlanOptions.from_dict(self.options))
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
        errors = self._type_errors()
        if errors:  # the rest assumes every field has its type
            raise ValueError("invalid plan: " + "; ".join(errors))
        if self.zero not in (0, 1, 2, 3):
            errors.append(f"zero={self.zero!r} must be 0, 1, 2 or 3")
        elif self.zero > 0 and self.dp_shard == 1 and self.cp == 1:
            # under cp the cp ranks hold the same parameters: ZeRO shards over dp_shard x cp
            errors.append(f"zero={self.zero} needs dp_shard > 1 (the axis it shards over); "
                          f"e.g. 'dp_shard=2,zero={self.zero}'")
        elif self.zero == 0 and self.dp_shard > 1:
            errors.append(f"dp_shard={self.dp_shard} needs a ZeRO stage: add zero=1, 2 or 3")
        if self.zero == 1 and self.tp > 1:
            errors.append(f"zero=1 with tp={self.tp} is not supported: ZeRO-1 is DDP plus a "
                          f"sharded optimizer, and DDP cannot bucket the DTensor parameters TP "
                          f"creates; use zero=2 or zero=3 with tp")
        if self.offload and self.zero != 3:
            errors.append(f"offload=True needs zero=3 (got zero={self.zero})")
        if self.sp and self.tp == 1:
            errors.append("sp=True (sequence parallel) needs tp > 1")
        if self.cp > 1:
            errors.extend(self._cp_errors())
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
            if self.microbatches < self.pp and self.pp_schedule != "gpipe":
                errors.append(f"microbatches={self.microbatches} < pp={self.pp}: "
                              f"{self.pp_schedule} needs at least one microbatch per stage "
                              f"(use microbatches>={self.pp})")
            elif rounds := rounds_error(self.pp_schedule, self.pp, self.microbatches):
                errors.append(rounds)
        if self.activation_checkpointing not in CHECKPOINTING:
            errors.append(f"activation_checkpointing={self.activation_checkpointing!r} is not one "
                          f"of {', '.join(CHECKPOINTING)}")
        if self.mixed_precision not in PRECISIONS:
            errors.append(f"mixed_precision={self.mixed_precision!r} is not one of "
                          f"{', '.join(PRECISIONS)}")
        if self.grad_clip is not None and not (math.isfinite(self.grad_clip)
                                               and self.grad_clip >= 0):
            errors.append(f"grad_clip={self.grad_clip} must be a finite number >= 0 "
                          f"(0 or none disables clipping)")
        errors += self._cut_errors()
        if world_size is not None and self.world_size != world_size:
            product = " * ".join(f"{a}({getattr(self, a)})" for a in MESH_AXES)
            errors.append(f"{product} = {self.world_size} != world size {world_size}; "
                          f"make the degrees multiply to {world_size}")
        if errors:
            raise ValueError("invalid plan: " + "; ".join(errors))
        return self

    def _cut_errors(self) -> list[str]:
        """What the options' pipeline cuts get wrong about this plan's stages: the one rule
        of :meth:`validate` that reads the options."""
        cuts = self.options.split_points or self.options.pp_stage_layers
        if self.pp == 1 or cuts is None:
            return []
        stages = self.pp * self.virtual_stages
        want = stages - 1 if self.options.split_points else stages
        if len(cuts) == want:
            return []
        name = "split_points" if self.options.split_points else "pp_stage_layers"
        return [f"options.{name}={list(cuts)} has {len(cuts)} entries; pp={self.pp} "
                f"x virtual_stages={self.virtual_stages} = {stages} stages need "
                f"{want}" + (" cuts" if name == "split_points" else
                             " block counts, one per stage")]

    def with_options(self, options: PlanOptions) -> Plan:
        """This plan with ``options`` in place of its own, checked by the rules that read
        the options and no others: the rest of this plan was checked when it was made (the
        planner's search gives each pipelined layout it keeps the stage split it priced,
        thousands in one search, without checking every field again)."""
        new = object.__new__(Plan)  # a copy, not made again: made, it would be checked again
        new.__dict__.update(vars(self), options=PlanOptions.from_dict(options))
        errors = new._cut_errors()
        if errors:
            raise ValueError("invalid plan: " + "; ".join(errors))
        return new

    def _cp_errors(self) -> list[str]:
        """What context parallelism does not compose with (plait.parallel.context)."""
        errors = []
        if self.compile:
            errors.append(f"cp={self.cp} with compile is not supported: the cp attention "
                          f"issues its all-gather from Python inside each block's forward; "
                          f"drop compile")
        return errors

    def _type_errors(self) -> list[str]:
        """A field of the wrong type (a JSON/YAML "no" where a boolean belongs) is refused, never
        read by truthiness: ``"sp": "no"`` would otherwise switch sequence parallelism on."""
        errors = []
        for name in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "microbatches",
                     "virtual_stages", "grad_accum", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                errors.append(f"{name}={value!r} must be a positive integer, e.g. {name}=2")
        if not isinstance(self.zero, int) or isinstance(self.zero, bool):
            errors.append(f"zero={self.zero!r} must be the integer 0, 1, 2 or 3")
        for name in ("sp", "offload", "sync_bn", "find_unused", "compile"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                errors.append(f"{name}={value!r} must be true or false (a boolean, not "
                              f"{type(value).__name__}), e.g. {name}: false")
        for name in ("pp_schedule", "activation_checkpointing", "mixed_precision"):
            value = getattr(self, name)
            if not isinstance(value, str):
                errors.append(f"{name}={value!r} must be a string, e.g. "
                              f"{name}: {getattr(Plan, name)}")
        clip = self.grad_clip
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))):
            errors.append(f"grad_clip={clip!r} must be a number (write grad_clip: 1.0, without "
                          f"quotes), or none to disable clipping")
        return errors

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["options"] = self.options.to_dict()
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
        if self.sync_bn:
            extras.append("sync-bn")
        if self.find_unused:
            extras.append("find-unused")
        if self.compile:
            extras.append("compiled")
        return (axes or "single device") + (f" ({', '.join(extras)})" if extras else "")

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Fields by name or short alias (``mb``, ``clip`` ...), plus two shorthands: ``dp=N`` is
        ``dp_replicate=N`` without ZeRO and ``dp_shard=N`` with it; ``fsdp=N`` is
        ``dp_shard=N,zero=3``. A shorthand never overrides a field given explicitly: a
        contradiction is refused, naming what to write instead."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a plan must be a mapping of fields, e.g. {{'dp_replicate': 2}}; "
                             f"got {data!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        given: dict[str, Any] = {}  # field -> the key the user wrote, to name duplicates
        shorthand: dict[str, Any] = {}
        for key, value in data.items():
            if key in _SHORTHANDS:
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"{key}={value!r} must be a positive integer, e.g. {key}=2")
                shorthand[key] = value
                continue
            name = _ALIASES.get(key, key)
            if name not in names:
                known = sorted(names | set(_ALIASES) | set(_SHORTHANDS))
                raise ValueError(f"unknown plan field {key!r}; {_did_you_mean(key, known)}"
                                 f"known fields: {', '.join(sorted(names | set(_SHORTHANDS)))}")
            if name in kwargs:
                raise ValueError(f"{given[name]}={kwargs[name]!r} and {key}={value!r} both set "
                                 f"{name}; give it once")
            kwargs[name], given[name] = value, key
        fsdp, dp = shorthand.get("fsdp"), shorthand.get("dp")
        if fsdp is not None and dp is not None:
            raise ValueError(f"dp={dp} and fsdp={fsdp} both set the data-parallel degree; give "
                             f"one (for HSDP write dp_replicate=R,dp_shard=S,zero=3)")
        if fsdp is not None:
            fixes = {"zero": f"write dp_shard={fsdp},zero={kwargs.get('zero')!r} for that "
                             f"ZeRO stage, or fsdp={fsdp} alone for ZeRO-3",
                     "dp_shard": f"write fsdp={kwargs.get('dp_shard')!r} alone, or "
                                 f"dp_shard={kwargs.get('dp_shard')!r},zero=3"}
            for name, want in (("zero", 3), ("dp_shard", fsdp)):
                if name in kwargs and kwargs[name] != want:
                    raise ValueError(f"fsdp={fsdp} means dp_shard={fsdp},zero=3, but "
                                     f"{given[name]}={kwargs[name]!r} was also given: "
                                     f"{fixes[name]}")
            kwargs["dp_shard"], kwargs["zero"] = fsdp, 3
        if dp is not None:
            target = "dp_shard" if kwargs.get("zero", 0) else "dp_replicate"
            for name in ("dp_replicate", "dp_shard"):
                if name in kwargs:
                    raise ValueError(
                        f"dp={dp} and {given[name]}={kwargs[name]!r} both set data-parallel "
                        f"degrees (dp means {target} here); give dp alone, or dp_replicate and "
                        f"dp_shard explicitly")
            kwargs[target] = dp
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
                if item not in _BOOL_FIELDS:
                    raise ValueError(f"cannot parse plan item {item!r} in {text!r}: expected "
                                     f"key=value, e.g. 'dp=2,tp=2,pp=2'")
                key, value = item, True
            else:
                key, raw = item.split("=", 1)
                if "=" in raw:  # "dp=2 tp=2", "dp=2;tp=2": items run together
                    commas = re.sub(r"(?<=[^,=\s])[\s;:]+(?=[A-Za-z_])", ",", text)
                    raise ValueError(f"plan item {item!r} in {text!r} holds two '=': separate "
                                     f"the items with commas, e.g. {commas!r}")
                value = _parse_value(key, raw, text)
            if key in data:
                raise ValueError(f"{key} is given twice in {text!r} ({key}={data[key]!r} and "
                                 f"{key}={value!r}); give it once")
            data[key] = value
        return cls.from_dict(data)

    @classmethod
    def load(cls, source: Plan | str | Path | Mapping[str, Any] | None) -> Plan:
        """Accept a Plan, a dict, a plan string, or a path to a .yaml/.yml/.json file.

        Every problem is a ValueError with one line (the CLI prints it and exits 2)."""
        if source is None:
            return cls()
        if isinstance(source, Plan):
            return source
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        if not isinstance(source, (str, Path)):
            raise ValueError(f"plan={source!r} must be a Plan, a mapping, a plan string such as "
                             f"'dp=2,tp=2' or a .yaml/.json path")
        path = Path(str(source))
        if path.suffix not in (".yaml", ".yml", ".json"):
            return cls.from_string(str(source))
        data = _read_plan_file(path)
        if isinstance(data, Mapping) and "plan" in data:
            data = data["plan"]
            if not isinstance(data, Mapping):
                raise ValueError(f"plan file {str(path)!r}: 'plan' must hold a mapping of fields "
                                 f"(e.g. 'plan: {{dp_replicate: 2}}'), not {data!r}")
        if not isinstance(data, Mapping):
            raise ValueError(f"plan file {str(path)!r} must hold a mapping of fields (e.g. "
                             f"'dp_replicate: 2'), not {data!r}")
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"plan file {str(path)!r}: {exc}") from None

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.suffix == ".json":
            path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        else:
            import yaml
            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def reduces_after_schedule(plan: Plan) -> bool:
    """Whether the stages' data and cp ranks average their gradients after the schedule
    (``PipelineRunner.sync_data_gradients`` in :mod:`plait.parallel.pipeline`), not in DDP or
    FSDP2's replicate, once per optimizer step: a
    zero-bubble schedule with data replicas or cp ranks, at zero=0 or 1. ZeRO-1 shards only
    the optimizer state, which ``ZeroRedundancyOptimizer`` does without DDP. Under ZeRO-2/3
    FSDP2 reduce-scatters the gradients itself, once per schedule at torch's REDUCE_GRAD
    step after the stage's last weight-gradient step (``TimedStage`` in
    :mod:`plait.parallel.pipeline` keeps its units gathered for the split backward). The
    communication ledger and the planner price it from here too."""
    return (plan.pp > 1 and plan.pp_schedule in ZERO_BUBBLE_SCHEDULES
            and (plan.dp > 1 or plan.cp > 1) and plan.zero <= 1)


def _yaml_loader() -> Any:
    """A yaml SafeLoader that refuses a key given twice (PyYAML would keep the last one)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice; give it once",
                        key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return Loader


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} is given twice ({out[key]!r} and {value!r}); "
                             f"give it once")
        out[key] = value
    return out


def _read_plan_file(path: Path) -> Any:
    """The parsed content of a .yaml/.yml/.json plan file; one-line ValueErrors for a missing,
    unreadable or malformed file, or a key given twice."""
    where = f"plan file {str(path)!r}"
    if not path.exists():
        raise ValueError(f"{where} does not exist")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where} cannot be read: {exc}") from None
    if path.suffix == ".json":
        try:
            return json.loads(text, object_pairs_hook=_unique_pairs)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc.msg} at line {exc.lineno}, "
                             f"column {exc.colno}") from None
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())  # a SafeLoader: plain data only
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{where} is not valid YAML: {problem}{at}") from None


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True,
               "false": False, "0": False, "no": False, "off": False}
_STRING_FIELDS = {"pp_schedule", "schedule", "activation_checkpointing", "ac", "mixed_precision",
                  "mp", "precision"}
_BOOL_FIELDS = {"sp", "offload", "sync_bn", "find_unused", "compile"}
_FLOAT_FIELDS = {"grad_clip", "clip"}
_FIELD_NAMES = {f.name for f in dataclasses.fields(Plan)}


def _parse_value(key: str, raw: str, text: str) -> Any:
    if key == "options":
        raise ValueError(f"options cannot be given in a plan string ({text!r}); put them in a "
                         f"YAML/JSON plan file or pass Plan(options=...)")
    if _ALIASES.get(key, key) not in _FIELD_NAMES and key not in _SHORTHANDS:
        return raw  # from_dict names the unknown key
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
