"""What the planner needs of a model without a stack of repeated matmul blocks, measured.

A ConvNet, a U-Net or an LSTM language model has nothing tensor parallelism splits (plait's
layer plans split nn.Linear layers) and, often, nothing a pipeline can cut (skips that cross
every block, a forward that takes the whole dict batch). What such a model can run is data
parallelism: DDP, ZeRO-1/2/3 and HSDP, with sync_bn where it has BatchNorm, and activation
checkpointing of the blocks plait wraps. Pricing those needs no per-block formula, only facts
of the model, each measured here rather than assumed:

* parameters and buffers, and the FSDP2 units plait shards the model into
  (:func:`plait.parallel.units.select_units`, the same call the runtime makes);
* the FLOPs of one forward, counted by ``torch.utils.flop_counter.FlopCounterMode`` on fake
  tensors (convolutions, matmuls); recurrent layers, which torch runs as one fused op that the
  counter does not see, add ``gates x hidden x (input + hidden) x 2`` per timestep and layer;
* the bytes autograd saves for backward (``saved_tensors_hooks`` over the same fake forward),
  per sample: the forward runs at one and two samples and the difference is taken, so what
  is saved once per step whatever the batch (a weight's transposed view) cancels;
* the channels of each BatchNorm layer, whose statistics ``sync_bn`` all-reduces.

The data-parallel traffic of a layout is the ledger's own formula
(:func:`plait.comm.held.held_traffic`, one home for it): this module only fills the
``HeldModel`` the ledger would read off the laid-out model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .._torch_compat import tree_map_only
from ..comm.held import HeldModel, ShardUnit, held_traffic
from ..comm.volumes import (
    DDP_BUCKET_BYTES,
    Traffic,
    ddp_bucket_calls,
    ddp_bucket_calls_any_order,
)
from ..parallel.tp_example import Example, tensors_in
from ..plan import Plan
from .compute import core_share
from .hardware import Cluster
from .op_count import update_cost
from .traffic import act_dtype_bytes, axis_stride, collective_time

if TYPE_CHECKING:
    # the model's forward + backward timed on this machine at a number of rows
    from .model_timing import ModelTimer as Timer

_RNN_GATES = {nn.LSTM: 4, nn.GRU: 3, nn.RNN: 1}
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
          nn.ConvTranspose3d)


@dataclass(frozen=True)
class Unit:
    """One FSDP2 unit: the shapes of its trainable parameters; ``root``: the model's own group
    (what no block holds), which ZeRO-3 keeps gathered from forward to backward."""

    shapes: tuple[tuple[int, ...], ...]
    root: bool = False


@dataclass(frozen=True)
class Block:
    """A block activation checkpointing wraps: forward FLOPs and saved bytes per sample, and
    the bytes of its input per sample (what checkpointing keeps)."""

    name: str
    flops: float
    saved: float
    input_bytes: float
    ops: int = 0               # aten ops of its forward (what a replay runs again)


@dataclass(frozen=True)
class WholeModel:
    """A model as data parallelism sees it; per-sample figures are of one sample's forward."""

    name: str
    params: int                 # trainable parameter elements
    param_tensors: int          # trainable parameter tensors
    frozen_params: int          # parameter elements that do not train
    buffer_bytes: int           # what DDP broadcasts before a step's first forward
    units: tuple[Unit, ...]     # FSDP2's units, the root last
    flops_per_sample: float     # one forward
    saved_per_sample: float     # bytes autograd keeps for backward
    sample_shape: tuple[int, ...]
    sample_from: str            # "dataset" or "guessed"
    positions: int = 1          # tokens per sample (a sequence model's length; 1 for an image)
    batchnorm: tuple[tuple[str, int], ...] = ()   # (name, channels) per BatchNorm layer
    blocks: tuple[Block, ...] = ()                # what activation checkpointing wraps
    grad_sizes: tuple[int, ...] = ()              # elements per trainable tensor, in order
    # The order the backward makes those gradients ready in (indices into grad_sizes), which
    # DDP's rebuilt buckets follow (:func:`ready_order`); None: the pass could not show it
    grad_order: tuple[int, ...] | None = None
    kinds: tuple[str, ...] = ()                   # "convolutions", "recurrent layers"
    notes: tuple[str, ...] = ()
    # aten ops one forward and its backward dispatch (plait.planner.op_count), whatever the
    # batch; plait's update: ops per parameter tensor and per update
    forward_ops: int = 0
    backward_ops: int = 0
    update_ops_per_tensor: int = 0
    update_ops_fixed: int = 0
    buffer_dtypes: tuple[tuple[str, int], ...] = ()  # (dtype, bytes) of the buffers, per dtype

    @property
    def num_params(self) -> int:
        return self.params + self.frozen_params


# --------------------------------------------------------------------------- measurement
@dataclass(frozen=True)
class Forward:
    """What one forward on a batch measured: FLOPs, bytes saved for backward, per block
    [FLOPs, saved, input bytes, ops], and the aten ops of the forward and of its backward."""

    flops: float
    saved: float
    per_block: dict[str, list[float]]
    forward_ops: int
    backward_ops: int


@dataclass(frozen=True)
class Collated:
    """One dataset item and the factory's ``collate_fn`` (the fourth item of ``(model,
    dataset, loss_fn, collate_fn)``): a batch of ``n`` is ``collate_fn([item] * n)``, whose
    tensors need not have one row per item (an EmbeddingBag's flat ids and offsets)."""

    item: Any
    collate_fn: Callable[[list[Any]], Any]
    rows: int = 1  # rows one item holds: a user's example is one batch of several

    def batch(self, n: int) -> Any:
        out = self.collate_fn([self.item] * n)
        return out[0] if isinstance(out, (tuple, list)) and out else out


def sample_of(built: Any) -> tuple[Any, str] | None:
    """One model input of a ``(model, dataset, loss_fn)`` factory's dataset: a tuple's first
    item, a dict whole (:class:`Collated` where the factory gives a collate_fn too); None
    without a dataset."""
    if not isinstance(built, (tuple, list)) or len(built) < 2:
        return None
    try:
        item = built[1][0]
    except Exception:  # noqa: BLE001 - a dataset that cannot be read says nothing
        return None
    if len(built) == 4 and callable(built[3]):
        return Collated(item, built[3]), "dataset"
    x = item[0] if isinstance(item, (tuple, list)) and item else item
    return x, "dataset"


def example_of(built: Any, model: nn.Module) -> Example | None:
    """A factory's first dataset sample as a batch of one, the forward's arguments as
    ``run.step`` passes them (:func:`plait.parallel.tp_example.from_batch`): what ``plait
    plan --model`` runs the model's forward passes on, as ``run.parallelize(model,
    example=batch)`` does. None without a dataset, or where its tensors have no values (built
    on the meta device) or the sample is neither a tensor nor a dict."""
    from ..parallel.tp_example import from_batch

    got = sample_of(built)
    if got is None:
        return None
    sample = got[0]
    try:
        batch = sample.batch(1) if isinstance(sample, Collated) else (
            _real_batch(sample, 1) if isinstance(sample, (torch.Tensor, dict)) else None)
    except Exception:  # noqa: BLE001 - a collate that fails says nothing here
        return None
    if batch is None or any(t.is_meta for t in tensors_in(batch)):
        return None
    return from_batch(model, (batch, None))


def _as_fake(x: Any) -> Any:
    """A collated batch's tensors as empty ones of their shapes (fake under a fake mode)."""
    if isinstance(x, Example):
        return Example(_as_fake(x.args), _as_fake(x.kwargs))
    if isinstance(x, torch.Tensor):
        return torch.zeros(x.shape, dtype=x.dtype)
    if isinstance(x, dict):
        return {k: _as_fake(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_as_fake(v) for v in x)
    return x


def model_call(model: nn.Module, state: dict[str, torch.Tensor], x: Any) -> Any:
    """``model`` on ``x`` with ``state`` as its tensors, called as ``run.step`` calls it: a
    dict batch's entries by name (all but a ``labels`` the forward does not take) unless the
    forward takes the dict whole (:func:`plait.dict_batch.whole_dict_parameter`)."""
    from torch.func import functional_call

    from ..dict_batch import signature_of, whole_dict_parameter

    if isinstance(x, Example):  # a user's example: the forward's arguments as run.step passes
        return functional_call(model, state, x.args, x.kwargs)
    if isinstance(x, dict):
        signature = signature_of(model.forward)
        if signature is not None and whole_dict_parameter(signature, x) is None:
            params = signature.parameters
            takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
            kwargs = {k: v for k, v in x.items() if takes_any or k != "labels" or k in params}
            return functional_call(model, state, (), kwargs)
    return functional_call(model, state, (x,))


def _batched(x: Any, n: int) -> Any:
    """``n`` copies of one sample along a new batch dim, as fake tensors."""
    if isinstance(x, Collated):  # collated by the caller, outside the fake mode
        raise TypeError("collate a Collated sample outside the fake mode: its items are real")
    if isinstance(x, torch.Tensor):
        return torch.zeros((n, *x.shape), dtype=x.dtype)
    if isinstance(x, dict):
        return {k: _batched(v, n) for k, v in x.items()}
    return x


def _real_batch(x: Any, n: int) -> Any:
    """``n`` copies of one real sample along a new batch dim."""
    if isinstance(x, Collated):
        return x.batch(n)
    if isinstance(x, torch.Tensor):
        return x.unsqueeze(0).expand(n, *x.shape).clone()
    if isinstance(x, dict):
        return {k: _real_batch(v, n) for k, v in x.items()}
    return x


def _rnn_flops(module: nn.Module, x: Any) -> float:
    """Forward FLOPs of a recurrent layer on input ``x``: per timestep, layer and direction,
    the input and hidden matmuls of every gate (torch's fused RNN op is not counted by
    FlopCounterMode)."""
    gates = next((g for kind, g in _RNN_GATES.items() if isinstance(module, kind)), 0)
    data = x.data if isinstance(x, nn.utils.rnn.PackedSequence) else x
    if not isinstance(data, torch.Tensor) or not gates:
        return 0.0
    steps = data.shape[0] if data.dim() == 2 else data.shape[0] * data.shape[1]
    h = int(getattr(module, "hidden_size"))  # noqa: B009 - typed as a Module attribute
    proj = int(getattr(module, "proj_size", 0)) or h
    dirs = 2 if getattr(module, "bidirectional") else 1  # noqa: B009
    total = 0.0
    for layer in range(int(getattr(module, "num_layers"))):  # noqa: B009
        inp = int(getattr(module, "input_size")) if layer == 0 else proj * dirs  # noqa: B009
        total += dirs * 2.0 * gates * h * (inp + proj) + (dirs * 2.0 * h * proj if proj != h
                                                           else 0.0)
    return total * steps


@contextmanager
def _hooks(model: nn.Module, blocks: list[tuple[str, nn.Module]], counter: Any,
           saved: list[float], per_block: dict[str, list[float]], ops: Any) -> Iterator[None]:
    """Recurrent layers add their FLOPs; each block records FLOPs, saved bytes and ops (of
    the op counter ``ops``) inside it."""
    handles = []
    rnn_kinds = tuple(_RNN_GATES)
    before: dict[int, int] = {}

    def rnn_pre(m: nn.Module, args: tuple) -> None:
        before[id(m)] = counter.get_total_flops()

    def rnn_post(m: nn.Module, args: tuple, out: Any) -> None:
        inside = counter.get_total_flops() - before[id(m)]
        extra = _rnn_flops(m, args[0] if args else None) - inside
        if extra > 0:  # counted as the matmuls they are
            counter.flop_counts["Global"][torch.ops.aten.mm.default] += int(extra)

    def block_pre(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple) -> None:
            x = args[0] if args else None
            size = float(x.numel() * x.element_size()) if isinstance(x, torch.Tensor) else 0.0
            per_block[name] = [counter.get_total_flops(), saved[0], size, ops.ops]
        return hook

    def block_post(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: tuple, _out: Any) -> None:
            start = per_block[name]
            per_block[name] = [counter.get_total_flops() - start[0], saved[0] - start[1],
                               start[2], ops.ops - start[3]]
        return hook

    try:
        for m in model.modules():
            if isinstance(m, rnn_kinds):
                handles.append(m.register_forward_pre_hook(rnn_pre))
                handles.append(m.register_forward_hook(rnn_post))
        for name, block in blocks:
            handles.append(block.register_forward_pre_hook(block_pre(name)))
            handles.append(block.register_forward_hook(block_post(name)))
        yield
    finally:
        for h in handles:
            h.remove()


def _forward(model: nn.Module, sample: Any, n: int, blocks: list[tuple[str, nn.Module]],
             fake: bool = True) -> Forward:
    """One forward on ``n`` samples and its backward (of the sum of the output: a loss's few
    ops), on fake tensors (``fake``), else on the model's own (a forward whose shapes depend
    on values, such as ``pack_padded_sequence``'s, runs only on real ones)."""
    from torch.utils.flop_counter import FlopCounterMode

    from .._torch_compat import fake_tensor_mode
    from .op_count import op_counter

    saved = [0.0]
    kept: list[torch.Tensor] = []  # held so that ids stay unique while the pass runs
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in seen:
            seen.add(id(t))
            kept.append(t)
            saved[0] += t.numel() * t.element_size()
        return t

    per_block: dict[str, list[float]] = {}
    forward_ops, backward_ops = op_counter(), op_counter()
    # A collate runs on the real items, before the fake mode (which refuses real inputs).
    collated = sample.batch(n) if isinstance(sample, Collated) else None
    with fake_tensor_mode()() if fake else contextlib.nullcontext():
        state: dict[str, torch.Tensor] = {
            k: torch.empty(p.shape, dtype=p.dtype).requires_grad_(p.requires_grad)
            for k, p in model.named_parameters()} if fake else dict(model.named_parameters())
        state.update({k: torch.empty(b.shape, dtype=b.dtype) if fake else b.clone()
                      for k, b in model.named_buffers()})
        x = (_as_fake(collated) if fake else collated) if collated is not None else (
            _batched(sample, n) if fake else _real_batch(sample, n))
        counter = FlopCounterMode(display=False)
        with counter, _hooks(model, blocks, counter, saved, per_block, forward_ops), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), forward_ops:
            out = model_call(model, state, x)
        flops = float(counter.get_total_flops())
        leaves = _floats(out)
        if leaves:
            with backward_ops:
                leaves[0].sum().backward()
        if not fake:
            model.zero_grad(set_to_none=True)
    return Forward(flops, saved[0], per_block, int(forward_ops.ops), int(backward_ops.ops))


def _floats(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a forward's output that carry a gradient (a tensor, or
    inside tuples, lists and dicts, a Hugging Face output included)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() and out.requires_grad else []
    if isinstance(out, dict):
        return [t for v in out.values() for t in _floats(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _floats(v)]
    return []


def ready_order(model: nn.Module, sample: Any) -> tuple[int, ...] | None:
    """The order the backward pass makes the gradients of ``model``'s trainable parameters
    ready in (indices into them, each tensor once, in ``model.parameters()`` order): a forward
    and backward with a post-accumulate-grad hook on each, the hook DDP's reducer records its
    rebuilt buckets' order from (``plait.comm.ready_order``). The pass runs on fake tensors,
    or where it cannot (a forward whose shapes depend on values) on one real sample with
    copies of the parameters, the model's own left untouched. The backward starts from the
    sum of every floating-point output, as a loss over them would. None where neither pass
    runs or one leaves a parameter without a gradient."""
    for fake in (True, False):
        if not fake and any(p.is_meta for p in model.parameters()):
            return None
        try:
            return _ready_pass(model, sample, fake)
        except Exception:  # noqa: BLE001 - a pass that does not run says nothing
            continue
    return None


def _ready_pass(model: nn.Module, sample: Any, fake: bool) -> tuple[int, ...] | None:
    """:func:`ready_order`'s pass on fake tensors (``fake``) or on copies of the real ones."""

    from .._torch_compat import fake_tensor_mode

    trainable = {id(p): i for i, p in enumerate(
        {id(p): p for p in model.parameters() if p.requires_grad}.values())}
    order: list[int] = []
    collated = sample.batch(1) if isinstance(sample, Collated) else None
    with fake_tensor_mode()() if fake else contextlib.nullcontext():
        state: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            leaf = (torch.empty(p.shape, dtype=p.dtype) if fake else p.detach().clone()
                    ).requires_grad_(p.requires_grad)
            if id(p) in trainable:
                index = trainable[id(p)]
                leaf.register_post_accumulate_grad_hook(lambda _t, i=index: order.append(i))
            state[name] = leaf
        state.update({k: torch.empty(b.shape, dtype=b.dtype) if fake else b.clone()
                      for k, b in model.named_buffers()})
        x = (_as_fake(collated) if fake else collated) if collated is not None else (
            _batched(sample, 1) if fake else _real_batch(sample, 1))
        outs = _floats(model_call(model, state, x))
        if not outs:
            return None
        torch.autograd.backward([t.sum() for t in outs])
    return tuple(order) if sorted(order) == list(range(len(trainable))) else None


def measure(model: nn.Module, sample: Any, *, name: str = "", sample_from: str = "dataset",
            positions: int = 1) -> WholeModel:
    """The facts of ``model`` on inputs like ``sample`` (one sample, without a batch dim)."""
    from ..parallel.units import not_a_stack, repeated_blocks, select_units

    label = name or type(model).__name__
    blocks = [(n, b) for n, b in repeated_blocks(model)
              if not isinstance(b, (nn.ModuleDict, nn.ModuleList))]
    if not_a_stack(model, blocks) is not None:
        # activation checkpointing refuses such a container (a U-Net's timestep MLP): no
        # checkpointed layout is priced for the model
        blocks = []
    real = not any(p.is_meta for p in model.parameters())
    try:
        try:
            one = _forward(model, sample, 1, blocks)
            two = _forward(model, sample, 2, blocks)
        except Exception:
            if not real:
                raise
            one = _forward(model, sample, 1, blocks, fake=False)
            two = _forward(model, sample, 2, blocks, fake=False)
    except Exception as exc:  # noqa: BLE001 - say which input did not run
        shape = tuple(sample.shape) if isinstance(sample, torch.Tensor) else type(sample).__name__
        raise ValueError(f"{label}: one forward on a {sample_from} sample {shape} did not run on "
                         f"fake tensors ({type(exc).__name__}: {exc}); the planner measures a "
                         f"model without blocks by running it: give --model a factory that "
                         f"returns (model, dataset, loss_fn), or from Python pass one batch as "
                         f"run.step takes it as example=") from None
    trainable = [p for p in model.parameters() if p.requires_grad]
    per_tensor, fixed = update_cost()
    unit_modules = select_units(model)
    in_units = {id(p) for _, m in unit_modules for p in m.parameters()}
    units = [Unit(tuple(tuple(p.shape) for p in m.parameters() if p.requires_grad))
             for _, m in unit_modules]
    units.append(Unit(tuple(tuple(p.shape) for p in trainable if id(p) not in in_units),
                      root=True))
    # A given example holds several rows: its batches of 1 and 2 are of that many and twice.
    rows = sample.rows if isinstance(sample, Collated) else 1
    per_block = [Block(n, (two.per_block[n][0] - one.per_block[n][0]) / rows,
                       (two.per_block[n][1] - one.per_block[n][1]) / rows,
                       (two.per_block[n][2] - one.per_block[n][2]) / rows,
                       int(one.per_block[n][3]))
                 for n, _ in blocks if n in one.per_block]
    kinds = []
    if any(isinstance(m, _CONVS) for m in model.modules()):
        kinds.append("convolutions")
    if any(isinstance(m, tuple(_RNN_GATES)) for m in model.modules()):
        kinds.append("recurrent layers")
    bn_kinds = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    bns = tuple((n, int(m.num_features)) for n, m in model.named_modules()
                if isinstance(m, bn_kinds))
    shape = tuple(sample.shape) if isinstance(sample, torch.Tensor) else ()
    dtypes: dict[str, int] = {}
    for b in {id(b): b for b in model.buffers()}.values():
        dtypes[str(b.dtype)] = dtypes.get(str(b.dtype), 0) + b.numel() * b.element_size()
    return WholeModel(
        name=label, params=sum(p.numel() for p in trainable),
        param_tensors=len({id(p) for p in trainable}),
        grad_sizes=tuple({id(p): p.numel() for p in trainable}.values()),
        grad_order=ready_order(model, sample),
        frozen_params=sum(p.numel() for p in model.parameters() if not p.requires_grad),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        buffer_dtypes=tuple(dtypes.items()),
        units=tuple(u for u in units if u.shapes),
        flops_per_sample=(two.flops - one.flops) / rows,
        saved_per_sample=max(0.0, two.saved - one.saved) / rows, sample_shape=shape,
        sample_from=sample_from, positions=positions, batchnorm=bns, blocks=tuple(per_block),
        kinds=tuple(kinds), forward_ops=one.forward_ops, backward_ops=one.backward_ops,
        update_ops_per_tensor=per_tensor, update_ops_fixed=fixed)


# ------------------------------------------------------------------------------- pricing
def _padded(shape: tuple[int, ...], shards: int) -> int:
    """Elements FSDP2 moves for a parameter of ``shape`` over ``shards`` ranks: dim 0 cut by
    ``torch.chunk`` and every piece padded to the first's size."""
    if not shape:
        return shards
    rest = math.prod(shape[1:])
    return math.ceil(shape[0] / shards) * shards * rest


def held(model: WholeModel, plan: Plan, bucket_bytes: float = DDP_BUCKET_BYTES) -> HeldModel:
    """The ``HeldModel`` the ledger reads off ``model`` laid out under ``plan``, with DDP's
    buckets of ``bucket_bytes``."""
    S = plan.dp_shard
    gather = act_dtype_bytes(plan.mixed_precision) if plan.mixed_precision != "fp32" else 4
    units: tuple[ShardUnit, ...] = ()
    if plan.zero >= 2:
        units = tuple(ShardUnit(gather_bytes=sum(_padded(s, S) for s in u.shapes) * gather,
                                reduce_bytes=sum(_padded(s, S) for s in u.shapes) * 4,
                                shards=S, regathered=plan.zero == 3 and not u.root)
                      for u in model.units)
    # DDP's buckets filled in the order the backward makes gradients ready, the ledger's
    # count (None where that order is not known and matters); ZeroRedundancyOptimizer
    # broadcasts each tensor it updates
    sizes = [("fp32", 4.0 * n) for n in model.grad_sizes]
    grad_calls: int | None = 1
    if model.grad_order is not None and model.grad_sizes:
        grad_calls = ddp_bucket_calls([sizes[i] for i in model.grad_order], bucket_bytes)
    elif model.grad_sizes:
        grad_calls = ddp_bucket_calls_any_order(sizes, bucket_bytes)
    # DDP broadcasts its buffers coalesced per dtype (BatchNorm's fp32 statistics, its int64
    # batch count): one call each while a dtype's buffers fit one broadcast bucket (torch's
    # default, 250 MiB), as the ledger counts them (plait.comm.held.held_model)
    buffer_calls = len(model.buffer_dtypes) if model.buffer_dtypes and all(
        size <= 250 * 2**20 for _, size in model.buffer_dtypes) else None
    return HeldModel(buffer_calls=buffer_calls if model.buffer_dtypes else 1,
                     grad_bytes=4 * model.params, update_bytes=4 * model.params,
                     buffer_bytes=model.buffer_bytes if plan.zero <= 1 else 0,
                     grad_tensors=model.param_tensors, units=units, grad_calls=grad_calls,
                     update_tensors=max(1, model.param_tensors),
                     sync_bn_features=tuple(c for _, c in model.batchnorm)
                     if plan.sync_bn else ())


def _time(t: Traffic, plan: Plan, cluster: Cluster, c: Any) -> float:
    """Seconds of one kind of traffic (its calls are the ledger's: DDP's buckets, :func:`held`)."""
    axis = t.axis if t.axis in ("dp_replicate", "dp_shard", "dp") else "dp"
    return collective_time(t, cluster, axis_stride(plan, axis), c)


@dataclass
class Priced:
    """What :func:`evaluate` found, in the fields :class:`plait.planner.cost.Estimate` has."""

    step: float
    memory: float
    compute_from: str = ""      # where the forward + backward time came from
    memory_breakdown: dict[str, float] = field(default_factory=dict)
    time_breakdown: dict[str, float] = field(default_factory=dict)
    traffic: list[Traffic] = field(default_factory=list)


def host_time(ops: float, cluster: Cluster) -> float:
    """Seconds the host spends dispatching ``ops`` aten ops on ``cluster``'s device (processes
    that outnumber the cores share them, as their arithmetic does)."""
    return ops * cluster.op_latency / core_share(cluster)


def price(model: WholeModel, plan: Plan, cluster: Cluster, global_batch: int, c: Any,
          timer: Timer | None = None) -> Priced:
    """Step time, memory per rank and traffic of ``plan`` (data parallelism, ``grad_accum``
    micro-steps of ``global_batch / dp / grad_accum`` rows each). ``timer``: the model's
    forward + backward timed on this machine at a number of rows
    (:class:`plait.planner.model_timing.ModelTimer`), used in place of its FLOPs and ops where
    it answers; only for a cluster that is this machine."""
    dp, S, zero, accum = plan.dp, plan.dp_shard, plan.zero, plan.grad_accum
    b = global_batch // dp
    rows = b // accum  # per micro-step
    rate = cluster.peak(plan.mixed_precision) * c.compute_efficiency * core_share(cluster)
    full = plan.activation_checkpointing == "full" and model.blocks
    replay = sum(k.flops for k in model.blocks) if full else 0.0
    replay_ops = sum(k.ops for k in model.blocks) if full else 0
    timed = timer(rows) if timer is not None and plan.mixed_precision == "fp32" else None
    if timed is not None:
        # The model's own forward + backward timed on this machine at the rows of a
        # micro-step (plait.planner.model_timing), its ops' host time included; a forward
        # replayed by checkpointing costs the timed forward's share of the blocks' FLOPs.
        # Ranks that outnumber the cores share them, as FLOPs do.
        share = core_share(cluster)
        replayed = timed.forward_s * replay / model.flops_per_sample \
            if model.flops_per_sample else 0.0
        arithmetic = (timed.seconds + replayed) / share
        recompute = replayed / share
        dispatch = 0.0
        micro = arithmetic
        compute_from = timed.says()
    else:
        # Each micro-step: the FLOPs at the achieved rate, and the host's time per aten op
        # (the forward's, the backward's, a replayed forward's). On a CPU the host is the
        # device: the two add. An accelerator's host launches ahead of it: the longer of the
        # two.
        arithmetic = (3 * model.flops_per_sample + replay) * rows / rate
        recompute = replay * rows / rate
        dispatch = host_time(model.forward_ops + model.backward_ops + replay_ops, cluster)
        micro = arithmetic + dispatch if cluster.ops_in_line else max(arithmetic, dispatch)
        compute_from = (f"FLOPs at efficiency {c.compute_efficiency:.2f} of "
                        f"{cluster.peak(plan.mixed_precision) / 1e9:.4g} GFLOP/s"
                        + (f" + {model.forward_ops + model.backward_ops + replay_ops} aten "
                           f"ops at {cluster.op_latency * 1e6:.3g} us" if cluster.op_latency
                           else ""))
    compute = micro * accum
    traffic = held_traffic(plan, held(model, plan, c.bucket_bytes))
    times = {t.what: 0.0 for t in traffic}
    for t in traffic:
        times[t.what] += _time(t, plan, cluster, c)
    grads = times.get("grads", 0.0)
    gathers = times.get("params", 0.0) + times.get("params (ZeroRedundancyOptimizer)", 0.0)
    # Where a collective can run beside compute (GPUs), the gradient reduction hides under
    # the last micro-step's backward (2/3 of its compute; the others do not reduce) and
    # ZeRO-3's gathers under the forwards; on a CPU whose processes hold every core nothing
    # runs beside them (Constants.overlap).
    exposed_grads = max(0.0, grads - micro * 2 / 3) if c.overlap else grads
    exposed_gathers = max(0.0, gathers - compute / 3) if c.overlap and zero >= 2 else gathers
    sync_bn = times.get("sync_bn statistics", 0.0)  # inside forward and backward: never hidden
    other = sum(v for k, v in times.items()
                if k not in ("grads", "params", "params (ZeroRedundancyOptimizer)",
                             "sync_bn statistics"))
    # FSDP2's host cost per unit beyond its collectives (a calibrated CPU profile's
    # fsdp_unit_s per unit and micro-step, fsdp_reduce_s per reducing unit once a step,
    # fsdp_regather_s per ZeRO-3 block gathered again in each micro-step's backward; 0 on the
    # accelerator presets), as the block cost model charges them (plait.planner.pipeline,
    # plait.planner.traffic)
    fsdp_host = 0.0
    if zero >= 2 and S > 1:
        blocks = sum(1 for u in model.units if not u.root)
        fsdp_host = (c.fsdp_unit_s * len(model.units)
                     + (c.fsdp_regather_s * blocks if zero == 3 else 0.0)) * accum \
            + c.fsdp_reduce_s * len(model.units)
    owned = model.params / (S if zero >= 1 else 1)
    # The update's host time per parameter tensor: a calibrated CPU profile's clip + AdamW
    # measured per tensor (plain or DTensor), else its aten ops (one loop over the tensors, as
    # torch's AdamW runs on a CPU) at the device's per-op time. On an accelerator torch's
    # AdamW runs foreach (a few launches for all tensors) under its memory-bound time: 0.
    per_tensor = c.dtensor_step_s if zero >= 2 else c.tensor_step_s
    timed_update = timer is not None and timed is not None and zero == 0
    if timed_update:
        # DDP's update is the plain one over every tensor: timed on this machine with the
        # forward + backward (its memory traffic included); ZeRO's sharded ones are priced
        # per tensor as below
        update_host = timer.update() / core_share(cluster) if timer is not None else 0.0
    elif per_tensor:
        update_host = model.param_tensors * per_tensor
    elif cluster.ops_in_line:
        update_host = host_time(model.update_ops_fixed
                                + model.update_ops_per_tensor * model.param_tensors, cluster)
    else:
        update_host = 0.0
    optimizer = update_host if timed_update else owned * 16 * 2 / cluster.hbm_bw + update_host
    step = compute + fsdp_host + exposed_grads + exposed_gathers + sync_bn + other + optimizer

    P = model.params
    ab = act_dtype_bytes(plan.mixed_precision)
    params = 4 * (P + model.frozen_params) / (S if zero >= 2 else 1)
    grad_bytes = 4 * P / (S if zero >= 2 else 1)
    optim = 8 * P / (S if zero >= 1 else 1)
    largest = max((sum(_padded(s, S) for s in u.shapes) for u in model.units if not u.root),
                  default=0)
    copy = 0.0
    if zero == 2:
        copy = (P + model.frozen_params) * (ab if plan.mixed_precision != "fp32" else 4)
    elif zero == 3:
        root = sum(_padded(s, S) for u in model.units if u.root for s in u.shapes)
        copy = (2 * largest + root) * (ab if plan.mixed_precision != "fp32" else 4)
    elif plan.mixed_precision != "fp32":
        copy = 2 * (P + model.frozen_params)
    saved = model.saved_per_sample
    if full:
        inside = sum(k.saved for k in model.blocks)
        kept = sum(k.input_bytes for k in model.blocks)
        saved = saved - inside + kept + max(k.saved for k in model.blocks)
    acts = saved * rows
    # DDP's buckets: a copy of the gradients, at most two buckets' worth in flight
    buckets = min(2 * c.bucket_bytes, 4.0 * P) if dp > 1 and zero <= 1 else 0.0
    memory = params + grad_bytes + optim + copy + acts + buckets + model.buffer_bytes + \
        cluster.reserve_bytes
    return Priced(
        step=step, memory=memory,
        memory_breakdown={"params": params, "grads": grad_bytes, "optimizer": optim,
                          "compute_copy": copy, "activations": acts, "buffers": buckets,
                          "model_buffers": float(model.buffer_bytes),
                          "reserve": cluster.reserve_bytes},
        compute_from=compute_from,
        time_breakdown={"compute": compute, "recompute": recompute * accum,
                        "dispatch": dispatch * accum, "fsdp_host": fsdp_host,
                        "dp_grad_total": grads, "dp_grad_exposed": exposed_grads,
                        "param_gather": gathers, "param_gather_exposed": exposed_gathers,
                        "sync_bn": sync_bn, "buffers_broadcast": other,
                        "optimizer": optimizer},
        traffic=traffic)


def layouts(model: WholeModel, cluster: Cluster, global_batch: int,
            dtype: str) -> Iterator[list[Plan]]:
    """Data-parallel layouts over every device, each as a list tried in order until one fits:
    DDP, ZeRO-1/2/3 over all ranks, HSDP (ZeRO-3 inside a node, replicated across), with
    sync_bn where the model has BatchNorm; within each, no checkpointing, then full where the
    model has blocks to wrap, then the same at grad_accum 2, 4, ... while each rank's rows
    split evenly. grad_accum is not tried for a model with BatchNorm: each micro-step would
    normalise its own rows, which is not what one device trains on the whole batch."""
    world = cluster.world_size
    splits = [(world, 1, 0)]
    if world > 1:
        splits += [(1, world, z) for z in (1, 2, 3)]
        inner = cluster.devices_per_node
        if 1 < inner < world and world % inner == 0:
            splits.append((world // inner, inner, 3))
    acs = ("none", "full") if model.blocks else ("none",)
    sync = bool(model.batchnorm) and world > 1
    for R, S, zero in splits:
        rows = global_batch // (R * S)
        accums = [1]
        while not model.batchnorm and rows and rows % (accums[-1] * 2) == 0:
            accums.append(accums[-1] * 2)
        yield [Plan(dp_replicate=R, dp_shard=S, zero=zero, sync_bn=sync, grad_accum=accum,
                    mixed_precision=dtype, activation_checkpointing=ac)
               for accum in accums for ac in acs]


def estimate(model: WholeModel, plan: Plan, cluster: Cluster, global_batch: int, c: Any,
             timer: Timer | None = None) -> Any:
    """The :class:`plait.planner.cost.Estimate` of ``plan`` (infeasible, with a reason, where
    the batch does not split or the memory does not fit); ``timer`` as :func:`price` takes."""
    from .cost import Estimate

    est = Estimate(plan=plan, feasible=False)
    if plan.world_size != cluster.world_size:
        est.reason = f"plan uses {plan.world_size} devices, cluster has {cluster.world_size}"
        return est
    if plan.tp > 1 or plan.pp > 1 or plan.cp > 1:
        est.reason = (f"{model.name} is priced for data parallelism only (tp, pp and cp move "
                      f"activations between the pieces of blocks it has none of)")
        return est
    if global_batch % plan.dp:
        est.reason = (f"global batch {global_batch} not divisible by dp={plan.dp} (a model "
                      f"without a stack of blocks trains data parallel over all "
                      f"{cluster.world_size} devices): give a global batch that is a multiple "
                      f"of {plan.dp}, or --devices that divides {global_batch}")
        return est
    if global_batch % (plan.dp * plan.grad_accum):
        est.reason = (f"global batch {global_batch} not divisible by dp={plan.dp} x "
                      f"grad_accum={plan.grad_accum}: each rank's {global_batch // plan.dp} "
                      f"rows do not split into {plan.grad_accum} equal micro-steps; give a "
                      f"global batch that is a multiple of {plan.dp * plan.grad_accum}, or "
                      f"another grad_accum")
        return est
    got = price(model, plan, cluster, global_batch, c, timer)
    est.compute_from = got.compute_from
    est.microbatch_size = global_batch // plan.dp // plan.grad_accum
    est.step_time_s = got.step
    est.memory_bytes_per_device = got.memory
    est.memory_breakdown = got.memory_breakdown
    est.time_breakdown = got.time_breakdown
    est.traffic = got.traffic
    world = cluster.world_size
    flops = 3 * model.flops_per_sample * global_batch
    est.tokens_per_s = global_batch * model.positions / est.step_time_s
    est.tflops_per_device = flops / est.step_time_s / world / 1e12
    replayed = sum(k.flops for k in model.blocks) * global_batch \
        if plan.activation_checkpointing == "full" else 0.0
    est.tflops_per_device_hw = (flops + replayed) / est.step_time_s / world / 1e12
    est.mfu = flops / est.step_time_s / world / (cluster.peak(plan.mixed_precision)
                                                  * core_share(cluster))
    est.notes.append(f"compute at batch {est.microbatch_size}: {got.compute_from}")
    if timer is not None and plan.zero == 0 and got.compute_from.startswith("measured"):
        est.notes.append(f"update (clip, AdamW over {model.param_tensors} tensors): measured "
                         f"on this machine, {got.time_breakdown['optimizer'] * 1e3:.3g} ms")
    if timer is not None and est.microbatch_size in timer.skipped:
        est.notes.append(timer.skipped[est.microbatch_size])
    est.notes.append(f"{model.name}: measured on a {model.sample_from} sample "
                     f"{model.sample_shape or '(dict)'}: {model.flops_per_sample / 1e6:.3g} "
                     f"MFLOP forward and {model.saved_per_sample / 2**10:.3g} KiB saved for "
                     f"backward per sample; {model.forward_ops} aten ops forward and "
                     f"{model.backward_ops} backward per micro-step at "
                     f"{cluster.op_latency * 1e6:.3g} us each on {cluster.name}")
    if model.batchnorm and plan.dp > 1 and not plan.sync_bn:
        est.notes.append(f"BatchNorm {model.batchnorm[0][0]} normalises each rank's rows with "
                         f"their own statistics: add sync_bn to train what one device trains "
                         f"(priced: '{plan.replace(sync_bn=True).to_string()}')")
    if model.batchnorm and plan.grad_accum > 1:
        est.notes.append(f"BatchNorm {model.batchnorm[0][0]} normalises each micro-step's "
                         f"{est.microbatch_size * (plan.dp if plan.sync_bn else 1)} rows with "
                         f"their own statistics under grad_accum={plan.grad_accum}, not the "
                         f"step's {global_batch}")
    if plan.sync_bn:
        est.notes.append(f"sync_bn: 4 fp32 all-reduces per micro-step for each of the "
                         f"{len(model.batchnorm)} BatchNorm layers, as plait's own sync_bn "
                         f"issues them off CUDA; on CUDA torch's SyncBatchNorm gathers the "
                         f"statistics instead, priced here the same")
    if got.memory > cluster.memory_bytes:
        est.reason = (f"needs {got.memory / 2**30:.1f} GiB per device (of which activations "
                      f"{got.memory_breakdown['activations'] / 2**30:.1f} GiB), has "
                      f"{cluster.memory_bytes / 2**30:.1f} GiB")
        return est
    est.feasible = True
    return est


# ------------------------------------------------------------------------ sources, search
# The largest model measured on real tensors where a forward cannot run on fake ones (shapes
# that depend on values, as pack_padded_sequence's): fp32, 1.2 GB on the host.
REAL_LIMIT = 300_000_000


def _guessed(model: nn.Module) -> Any:
    from ..parallel.tp_example import example_input

    x = example_input(model)
    if x is None:
        raise ValueError(f"{type(model).__name__}: no input can be guessed for it (no "
                         f"nn.Embedding, Linear or convolution first); give --model a factory "
                         f"that returns (model, dataset, loss_fn), whose first sample the "
                         f"planner measures the model on, or from Python pass one batch as "
                         f"run.step takes it as example=")
    return x[0]


def from_factory(spec: str) -> tuple[WholeModel, nn.Module]:
    """Measure ``"package.module:function"``: built with its parameters on the meta device
    (nothing allocated), run on its dataset's first sample (a guessed input without one). A
    forward that runs only on real tensors is run on a host copy, up to ``REAL_LIMIT``
    parameters. Returns the facts and the module they were read from."""
    from .model_stats import _build, _model_of, _sample_seq

    built = _build(spec, "meta", parameters_only=True)
    model = _model_of(built, spec)
    got = sample_of(built)
    sample, source = got if got is not None else (_guessed(model), "guessed")
    positions = (_sample_seq(built[1]) if isinstance(built, (tuple, list)) and len(built) > 1
                 else None) or 1
    try:
        return measure(model, sample, name=spec, sample_from=source,
                       positions=positions), model
    except ValueError:
        if sum(p.numel() for p in model.parameters()) > REAL_LIMIT:
            raise
    built = _build(spec, "cpu")
    model = _model_of(built, spec)
    return measure(model, sample, name=spec, sample_from=source, positions=positions), model


def from_module(model: nn.Module, example: Example | None = None) -> WholeModel:
    """Measure an ``nn.Module`` on ``example`` (the user's batch, ``run.parallelize(model,
    example=batch)``: no dataset is known when the model is laid out), else on a guessed
    input."""
    if example is None:
        return measure(model, _guessed(model), name=type(model).__name__,
                       sample_from="guessed")
    return measure(model, from_example(example), name=type(model).__name__,
                   sample_from="given example")


def from_example(example: Example) -> Collated:
    """``example`` (one batch of the forward's arguments) as a sample the measurement batches:
    ``n`` of it is each tensor repeated ``n`` times along its first dimension (a flat index
    list and its offsets too: their shapes, not their values, are what a fake-tensor forward
    reads), and the figures per sample are divided by the example's rows (the first
    dimension of its first tensor)."""
    first = next((t for t in (*example.args, *example.kwargs.values())
                  if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    rows = int(first.shape[0]) if first is not None and first.shape[0] > 0 else 1
    return Collated(example, _repeated, rows=rows)


def _repeated(items: list[Example]) -> Example:
    n, one = len(items), items[0]

    def rep(v: torch.Tensor) -> torch.Tensor:
        return torch.cat([v] * n) if n > 1 and v.dim() > 0 else v
    tree_map = tree_map_only()
    return Example(tree_map(torch.Tensor, rep, one.args), tree_map(torch.Tensor, rep, one.kwargs))


def excluded(model: WholeModel, check: Callable[[Plan], str | None] | None,
             module: nn.Module | None = None) -> dict[str, str]:
    """Why tensor and pipeline parallelism are not searched for ``model``: what tensor
    parallelism's plan inference says of ``module``'s layers (which it names), and what the
    model itself refuses of a two-stage pipeline (``check``: :func:`plait.auto.layout_check` of
    the module, which sees skips across blocks, a whole-dict forward, BatchNorm cut into
    microbatches, no container of blocks)."""
    what = " and ".join(model.kinds) or "layers"
    tp = (f"{model.name}'s {what} are not split by tensor parallelism (plait's layer plans "
          f"split the nn.Linear layers of repeated blocks)")
    if module is not None:
        from ..parallel.tp_infer import infer_plan

        try:
            infer_plan(module)
        except ValueError as exc:
            text = str(exc)
            start = text.find("; its ")
            if start >= 0:
                tp = text[start + 2:].split(": train it")[0]
    out = {"tp": tp}
    pp = check(Plan(pp=2, microbatches=2)) if check is not None else None
    out["pp"] = pp or (f"{model.name} has no stack of repeated matmul blocks whose stages the "
                       f"planner prices; a pipeline is tried by hand with --plan pp=N")
    return out


def rank(model: WholeModel, cluster: Cluster, global_batch: int, *, dtype: str, c: Any,
         top: int = 10, timer: Timer | None = None) -> Any:
    """Every data-parallel layout of ``model`` (:func:`layouts`) ranked by predicted step time
    (ties: less memory), as a :class:`plait.planner.search.SearchResult`; ``timer`` as
    :func:`price` takes."""
    import time

    from .search import SearchResult

    start = time.perf_counter()
    feasible: list[Any] = []
    rejected: dict[str, int] = {}
    closest: Any = None
    evaluated = 0
    for group in layouts(model, cluster, global_batch, dtype):
        for plan in group:
            est = estimate(model, plan, cluster, global_batch, c, timer)
            evaluated += 1
            if est.feasible:
                feasible.append(est)
                break
            kind = "out of memory" if "GiB" in est.reason else est.reason
            rejected[kind] = rejected.get(kind, 0) + 1
            if est.memory_bytes_per_device and (
                    closest is None
                    or est.memory_bytes_per_device < closest.memory_bytes_per_device):
                closest = est
    feasible.sort(key=lambda e: (round(e.step_time_s, 12), round(e.memory_bytes_per_device),
                                 e.plan.to_string()))
    return SearchResult(ranked=feasible[:max(top, 1)] if top else feasible, evaluated=evaluated,
                        seconds=time.perf_counter() - start, rejected=rejected, closest=closest,
                        fit=len(feasible))


def explain(ranked: list[Any]) -> list[str]:
    """A few lines on where the best layout's step goes and what each other one adds."""
    if not ranked:
        return []
    best = ranked[0]
    tb = best.time_breakdown
    comm = tb["dp_grad_exposed"] + tb["param_gather_exposed"] + tb["buffers_broadcast"]
    where = (best.compute_from if best.compute_from.startswith("measured") else
             f"host time of its aten ops {tb['dispatch'] * 1e3:.3g} ms")
    out = [f"{best.plan.describe()}: step {best.step_time_s * 1e3:.3g} ms = compute "
           f"{tb['compute'] * 1e3:.3g} ms ({where}, recompute "
           f"{tb['recompute'] * 1e3:.3g}) + exposed "
           f"data-parallel traffic {comm * 1e3:.3g} ms + sync_bn {tb['sync_bn'] * 1e3:.3g} ms "
           f"+ optimizer {tb['optimizer'] * 1e3:.3g} ms; "
           f"{best.memory_bytes_per_device / 2**20:,.1f} MiB per rank"]
    for other in ranked[1:4]:
        slower = other.step_time_s / best.step_time_s - 1
        saved = best.memory_bytes_per_device - other.memory_bytes_per_device
        out.append(f"  beats {other.plan.describe()} by {slower:.1%}"
                   + (f" (which holds {saved / 2**20:,.1f} MiB less per rank)" if saved > 0
                      else ""))
    return out


def nothing_fits(result: Any) -> str:
    """Why no data-parallel layout runs (a :func:`rank` result): the one nearest to fitting."""
    near = result.closest
    why = ", ".join(f"{k} ({n})" for k, n in sorted(result.rejected.items()))
    return ("no data-parallel layout fits: " + why
            + (f"; nearest: {near.plan.to_string()} {near.reason}" if near else ""))
