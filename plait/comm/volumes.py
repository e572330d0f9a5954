"""Closed-form communication volumes: the one place plait says how many bytes a collective moves.

Shared by the planner (predictions), the ledger (measured records are converted with the same
factors) and the reports, so "predicted" and "measured" can only differ because the traffic
differs, never because two formulas disagree.

Convention, used everywhere in plait:

* ``payload`` is the size in bytes of the tensor the collective is called on, as the caller sees
  it: the buffer for all-reduce/broadcast/reduce, the *full* (gathered) output for all-gather,
  the *full* input for reduce-scatter, the whole input for all-to-all, the message for send/recv.
* ``wire`` bytes per rank are what a bandwidth-optimal (ring) algorithm sends out of each rank:
  ``payload * bus_factor(op, n)``, with the factors nccl-tests uses for bus bandwidth —
  all-reduce ``2(n-1)/n``, all-gather / reduce-scatter / all-to-all ``(n-1)/n``, broadcast /
  reduce / send-recv ``1``.

Backends may move more than this (gloo has no native reduce-scatter and runs it as a full
all-reduce); reports say so next to the figure rather than change the convention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Canonical collective names (the ledger and the planner use exactly these).
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce",
       "send_recv")

_DTYPE_BYTES = {"fp32": 4, "float32": 4, "tf32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2,
                "float16": 2, "fp8": 1, "int8": 1, "int64": 8}


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element of ``dtype`` (a torch dtype or a short name like "bf16")."""
    if not isinstance(dtype, str):
        # A torch dtype: torch is imported already by whoever made it.
        import torch

        if isinstance(dtype, torch.dtype):
            return torch.empty((), dtype=dtype).element_size()
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


def bus_factor(op: str, n: int) -> float:
    """Bytes a ring algorithm sends per rank, per byte of payload, on ``n`` ranks."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    if n < 1:
        raise ValueError(f"group size n={n} must be >= 1")
    if n == 1:
        return 0.0 if op != "send_recv" else 1.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def wire_bytes(op: str, payload: float, n: int) -> float:
    """Bytes sent per rank by one ``op`` of ``payload`` bytes on ``n`` ranks (ring)."""
    return payload * bus_factor(op, n)


def fsdp_shard_rows(rows: int, shards: int) -> int:
    """Rows of dim 0 each of ``shards`` ranks holds of a parameter FSDP2 shards, padding
    included: FSDP2 (``fully_shard``) cuts dim 0 with ``torch.chunk`` and pads every shard to
    the first, the largest, so each holds ``ceil(rows / shards)`` rows and its all-gather and
    reduce-scatter move ``shards`` times that (51 rows at dp_shard=2 or 4 move as 52)."""
    return -(-rows // shards)


def fsdp_padded_numel(shape: tuple[int, ...], shards: int) -> int:
    """Elements FSDP2 gathers and reduce-scatters for a parameter of ``shape`` sharded over
    ``shards`` ranks: dim 0 rounded up to a multiple of ``shards`` (:func:`fsdp_shard_rows`)."""
    if not shape:  # a 0-d tensor has no dim 0 to cut: its one element
        return 1
    rest = 1
    for n in shape[1:]:
        rest *= n
    return fsdp_shard_rows(shape[0], shards) * shards * rest


# =============================================================================================
# Per-strategy closed forms: the bytes one training step moves, per rank, per mesh axis.
#
# These are what plait's runtime sends (so the ledger can put its measurement beside them):
#
# * DDP: one all-reduce of every gradient per *optimizer* step (no sync while accumulating),
#   in the reduce dtype (fp32 by default: plait reduces gradients in fp32 under bf16 too).
# * ZeRO-1 and ZeRO-2 (FSDP2 with ``reshard_after_forward=False`` / sharded optimizer): one
#   reduce-scatter of the gradients per optimizer step, then one all-gather of the updated
#   parameters (in the parameter dtype) so every rank holds the full model for the next step.
#   Stages 1 and 2 differ in memory, not in bytes.
# * ZeRO-3 (FSDP2 ``fully_shard``): per micro-step, one all-gather of the parameters (compute
#   dtype) before forward and again before backward (the forward copy was freed), plus one
#   reduce-scatter of the gradients per optimizer step.
# * TP (Megatron f/g operators): per layer and microbatch, 2 all-reduces of the b*s*h activation
#   in forward (after attention and MLP) and 2 in backward; a fully recomputed layer repeats its
#   2 forward ones. With sequence parallelism each all-reduce becomes an all-gather plus a
#   reduce-scatter of the same full size: the same wire bytes, twice the calls.
# * CP (all-gather context parallelism, plait.parallel.context): per attention layer and
#   micro-step, the keys and values are all-gathered over the cp group in forward (again for
#   each recomputed layer) and their gradients reduce-scattered in backward; each call's
#   payload is the whole sequence's K (or V): batch*seq*kv_dim elements.
# * PP: per microbatch and stage boundary, the b*s*h activation goes forward and its gradient
#   comes back; an interleaved schedule with v stages per rank crosses v times more boundaries.
#
# Every function takes plain numbers and returns ``Traffic`` records; ``payload`` is the total
# over the step (calls x bytes per call), ``wire`` follows the bus-factor convention above.
# =============================================================================================

from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402


@dataclass(frozen=True)
class Traffic:
    """One kind of collective traffic in a step, as one rank sees it.

    ``payload`` is summed over ``calls`` (bytes per call = payload / calls); ``group`` is the
    number of ranks taking part. ``wire`` is what a ring algorithm sends out of this rank.
    """

    axis: str            # mesh axis: "dp_replicate", "dp_shard", "dp", "tp", "pp"
    op: str              # one of OPS
    payload: float       # bytes, summed over the calls of one step
    calls: int           # number of collective calls in one step
    group: int           # ranks in the group
    what: str = ""       # "grads", "params", "activations", ...
    # False where ``calls`` is an estimate the runtime may not match (DDP's bucket count for
    # gradients over more than one bucket whose tensor sizes are not known): the ledger shows
    # no expected call count for it.
    calls_known: bool = True

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown collective {self.op!r}; known: {', '.join(OPS)}")
        if self.payload < 0 or self.calls < 0 or self.group < 1:
            raise ValueError(f"invalid Traffic: payload={self.payload}, calls={self.calls}, "
                             f"group={self.group} (need payload, calls >= 0 and group >= 1)")

    @property
    def wire(self) -> float:
        return wire_bytes(self.op, self.payload, self.group)

    def times(self, k: int) -> Traffic:
        """This traffic ``k`` times over (payload and calls), every other field kept. Built
        by the constructor, beside the fields: the planner's search calls it thousands of
        times, and ``dataclasses.replace`` costs several times the constructor."""
        return Traffic(axis=self.axis, op=self.op, payload=self.payload * k,
                       calls=self.calls * k, group=self.group, what=self.what,
                       calls_known=self.calls_known)


def _positive(**values: float) -> None:
    for name, value in values.items():
        if value is None or value < 1:
            raise ValueError(f"{name}={value!r} must be >= 1")


DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb


def ddp_traffic(params: float, dp: int, grad_dtype: str | torch.dtype = "fp32", *,
                axis: str = "dp_replicate", bucket_bytes: float = DDP_BUCKET_BYTES
                ) -> list[Traffic]:
    """DDP: all-reduce of ``params`` gradients once per optimizer step over ``dp`` ranks.

    ``params`` is the number of parameters this rank holds (after TP/PP splitting). ``calls`` is
    the number of DDP buckets (25 MiB by default), which only matters for latency.
    """
    _positive(params=params, dp=dp)
    if dp == 1:
        return []
    payload = float(params) * dtype_bytes(grad_dtype)
    calls = max(1, int(-(-payload // bucket_bytes)))
    # one bucket is certain; past that the count depends on the tensors' sizes and order
    # (ddp_bucket_calls), unknown here
    return [Traffic(axis, "all_reduce", payload, calls, dp, "grads",
                    calls_known=payload <= bucket_bytes)]


def ddp_bucket_calls(tensor_bytes: Sequence[tuple[str, float]], bucket_bytes: float) -> int:
    """All-reduces DDP issues for gradients of these ``(dtype, bytes)`` tensors, given in the
    order the backward pass makes them ready.

    DDP (``bucket_cap_mb`` given, as plait gives it) puts every gradient in one bucket for the
    first step, then rebuilds its buckets in the order the gradients became ready: per dtype,
    tensors are added to a bucket until it holds ``bucket_bytes`` or more, which closes it (so
    a bucket can exceed the cap by its last tensor). Under ``find_unused_parameters`` it fills
    them so from the start, in the parameters' order, and never rebuilds. Only with
    ``bucket_cap_mb`` left at torch's default is the first bucket smaller
    (``_DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB); plait never leaves it so.
    ``plait.parallel.pipeline.average_in_buckets`` fills its buckets the same way."""
    calls = 0
    held: dict[str, float] = {}
    for dtype, size in tensor_bytes:
        held[dtype] = held.get(dtype, 0.0) + size
        if held[dtype] >= bucket_bytes:
            calls += 1
            held[dtype] = 0.0
    return calls + sum(1 for v in held.values() if v > 0)


def ddp_bucket_calls_any_order(tensor_bytes: Sequence[tuple[str, float]],
                               bucket_bytes: float) -> int | None:
    """:func:`ddp_bucket_calls` where the order the gradients become ready is not known: the
    count where every order gives the same one (per dtype, all but the smallest tensor stay
    under the cap, so no bucket closes before the last tensor: one bucket per dtype), else
    None."""
    total: dict[str, float] = {}
    least: dict[str, float] = {}
    for dtype, size in tensor_bytes:
        total[dtype] = total.get(dtype, 0.0) + size
        least[dtype] = min(least.get(dtype, size), size)
    if all(total[d] - least[d] < bucket_bytes for d in total):
        return sum(1 for v in total.values() if v > 0)
    return None


def zero_traffic(params: int, dp_shard: int, stage: int, *,
                 param_dtype: str | torch.dtype = "fp32",
                 grad_dtype: str | torch.dtype = "fp32", micro_steps: int = 1,
                 axis: str = "dp_shard", units: int = 1, root_params: int = 0
                 ) -> list[Traffic]:
    """ZeRO-1/2/3 over ``dp_shard`` ranks for one optimizer step of ``micro_steps`` micro-steps.

    ``param_dtype`` is the dtype parameters are gathered in (the compute dtype under mixed
    precision); ``units`` is the number of FSDP units (wrapped blocks), one call each.
    ``root_params`` (ZeRO-3): parameters of FSDP2's root unit (embeddings, final norm, head),
    which it keeps gathered from forward to backward: gathered once per micro-step, not twice.
    """
    _positive(params=params, dp_shard=dp_shard, micro_steps=micro_steps, units=units)
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage={stage!r} must be 1, 2 or 3")
    if dp_shard == 1:
        return []
    grads = float(params) * dtype_bytes(grad_dtype)
    weights = float(params) * dtype_bytes(param_dtype)
    out = [Traffic(axis, "reduce_scatter", grads, units, dp_shard, "grads")]
    if stage in (1, 2):
        out.append(Traffic(axis, "all_gather", weights, units, dp_shard, "params"))
    else:
        gathers = 2 * micro_steps  # forward and backward, every micro-step
        root = float(min(root_params, params)) * dtype_bytes(param_dtype) * micro_steps
        out.append(Traffic(axis, "all_gather", weights * gathers - root,
                           units * gathers - (micro_steps if root_params else 0), dp_shard,
                           "params"))
    return out


def tp_traffic(batch: int, seq: int, hidden: int, layers: int, tp: int,
               dtype: str | torch.dtype = "fp32", *, sp: bool = False, microbatches: int = 1,
               recomputed_layers: int = 0, axis: str = "tp") -> list[Traffic]:
    """Megatron TP on ``layers`` blocks of this rank, ``microbatches`` microbatches of ``batch``.

    4 all-reduces of ``batch*seq*hidden`` elements per layer and microbatch (2 forward, 2
    backward), plus 2 per recomputed layer. ``sp=True``: an all-gather plus a reduce-scatter of
    the same full size in place of each all-reduce (same wire bytes).
    """
    _positive(batch=batch, seq=seq, hidden=hidden, layers=layers, tp=tp,
              microbatches=microbatches)
    if not 0 <= recomputed_layers <= layers:
        raise ValueError(f"recomputed_layers={recomputed_layers} must be in [0, layers={layers}]")
    if tp == 1:
        return []
    per = float(batch) * seq * hidden * dtype_bytes(dtype)
    n = (4 * layers + 2 * recomputed_layers) * microbatches
    if not sp:
        return [Traffic(axis, "all_reduce", per * n, n, tp, "activations")]
    return [Traffic(axis, "all_gather", per * n, n, tp, "activations"),
            Traffic(axis, "reduce_scatter", per * n, n, tp, "activations")]


def cp_traffic(batch: int, seq: int, kv_dim: int, layers: int, cp: int,
               dtype: str | torch.dtype = "fp32", *, micro_steps: int = 1,
               recomputed_layers: int = 0, axis: str = "cp",
               element_bytes: float | None = None) -> list[Traffic]:
    """All-gather context parallelism on ``layers`` attention layers, ``micro_steps`` micro-steps
    of ``batch`` rows of ``seq`` tokens (the whole sequence, before the split), keys and values
    of ``kv_dim`` = kv_heads x head_dim features each.

    Per layer and micro-step: 2 all-gathers (K and V) in forward, 2 more per recomputed layer,
    and 2 reduce-scatters of their gradients in backward, each of ``batch*seq*kv_dim``
    elements (the gathered size). Per rank on the wire: ``(cp-1)/cp`` of that per call.
    ``element_bytes``: the mean bytes of a key's and a value's element where they differ
    (fp32 keys out of a rotary embedding beside bf16 values: 3); else ``dtype``'s.
    """
    _positive(batch=batch, seq=seq, kv_dim=kv_dim, layers=layers, cp=cp,
              micro_steps=micro_steps)
    if not 0 <= recomputed_layers <= layers:
        raise ValueError(f"recomputed_layers={recomputed_layers} must be in [0, layers={layers}]")
    if cp == 1:
        return []
    per = float(batch) * seq * kv_dim * (element_bytes or dtype_bytes(dtype))
    gathers = 2 * (layers + recomputed_layers) * micro_steps
    scatters = 2 * layers * micro_steps
    return [Traffic(axis, "all_gather", per * gathers, gathers, cp, "keys, values"),
            Traffic(axis, "reduce_scatter", per * scatters, scatters, cp, "key, value grads")]


def pp_traffic(batch: int, seq: int, hidden: int, pp: int, dtype: str | torch.dtype = "fp32",
               *, microbatches: int = 1, virtual_stages: int = 1, stage: int | None = None,
               tp: int = 1, sp: bool = False, axis: str = "pp") -> list[Traffic]:
    """Pipeline point-to-point bytes *sent* by pipeline rank ``stage`` in one step.

    Each boundary between consecutive model chunks carries the ``batch*seq*hidden`` activation
    forward and its gradient backward, once per microbatch. With ``virtual_stages=v`` the model
    has ``pp*v`` chunks placed round-robin, so rank r sends forward from each chunk but the very
    last and backward from each chunk but the very first. ``stage=None`` gives the busiest rank
    (an interior one: ``2*m*v`` messages). With ``sp`` the message is the TP shard (``/tp``).
    """
    _positive(batch=batch, seq=seq, hidden=hidden, pp=pp, microbatches=microbatches,
              virtual_stages=virtual_stages, tp=tp)
    if pp == 1:
        return []
    if stage is not None and not 0 <= stage < pp:
        raise ValueError(f"stage={stage} must be in [0, pp={pp})")
    per = float(batch) * seq * hidden * dtype_bytes(dtype) / (tp if sp else 1)
    v, m = virtual_stages, microbatches
    if stage is None:
        fwd = bwd = v
    else:
        fwd = v - (1 if stage == pp - 1 else 0)
        bwd = v - (1 if stage == 0 else 0)
    out = []
    if fwd:
        out.append(Traffic(axis, "send_recv", per * fwd * m, fwd * m, 2, "activations"))
    if bwd:
        out.append(Traffic(axis, "send_recv", per * bwd * m, bwd * m, 2, "activation grads"))
    return out


def by_axis(traffic: list[Traffic], kind: str = "wire") -> dict[str, float]:
    """Sum ``wire`` (or ``payload``) bytes per mesh axis."""
    if kind not in ("wire", "payload"):
        raise ValueError(f"kind={kind!r} must be 'wire' or 'payload'")
    out: dict[str, float] = {}
    for t in traffic:
        out[t.axis] = out.get(t.axis, 0.0) + getattr(t, kind)
    return out
