"""Tensor and sequence parallelism (Megatron-style) through DTensor on the mesh's ``tp`` axis.

``apply_tensor_parallel(module, mesh, plan)`` takes a layer plan (data, see
``plait.parallel.tp_plans``) and turns each entry into one of torch's ``ParallelStyle`` objects,
applied with ``parallelize_module`` on ``mesh["tp"]``. Where the plan comes from, first match wins:

1. ``plan.options.tp_plan`` — the user's {glob: style} for any model;
2. plait's plan for the reference transformer;
3. a Hugging Face model: plait's plan for GPT-2 (Conv1D, fused qkv) and for BERT's layout
   (BERT, RoBERTa, ELECTRA, ...), else the ``base_model_tp_plan`` that transformers itself
   declares, translated style by style;
4. otherwise a plan inferred from the module structure (``plait.parallel.tp_infer``), printed on
   rank 0 so the user can check and save it, or a ValueError where inference cannot decide.

What it sends, per transformer layer and micro-batch (b, s, h = batch, sequence, hidden):

* TP: forward one all-reduce of b·s·h after attention's output projection and one after the MLP's
  down projection (Megatron's *g*); backward one all-reduce of b·s·h at each region's input (*f*):
  4 all-reduces in all. The ``region`` style makes q/k/v (and gate/up) share a single *f*.
* TP+SP: each all-reduce becomes an all-gather (region input) plus a reduce-scatter (row-parallel
  output) of the same bytes, and activations between regions (norms, dropout, residual) shrink by
  ``tp``. Extra small collectives: every sequence-parallel norm's weight gradient is a partial
  sum over sequence shards and is all-reduced (h elements each).

Own code beside torch's styles (and why): torch's Colwise/RowwiseParallel accept nn.Linear and
nn.Embedding only, so ``_Colwise``/``_Rowwise`` add HF's Conv1D (weight stored (in, out)) and
fused q|k|v packs (``_StridedShard``); ``PrepareModuleInput`` needs to know whether an input is
positional or keyword (HF layers pass ``hidden_states=`` by keyword), so ``_Region`` takes the
first tensor input either way.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.utils.parametrize import is_parametrized

from .._torch_compat import (
    async_collective_tensor,
    is_split,
    outside_selective_checkpoint,
    strided_shard,
    tp_style_bases,
)
from ..mesh import Mesh
from ..plan import Plan
from .hf import transformers_class
from .layout import Layout, record_layout
from .pipeline_split import STAND_INS, receive_sequence_shards
from .tp_example import Example
from .tp_kv import GROUP_ATTRS, KV_COUNT_ATTRS, KVHeads, local_attrs, owner_head_dim, owners
from .tp_kv import replicated_kv as find_replicated_kv
from .tp_lora import LORA_STYLES, expand, low_rank_parts, sp_sums
from .tp_plans import (
    COLWISE,
    LINEAR_STYLES,
    STYLES,
    TPPlan,
    glob_regex,
    shipped_plan,
    under,
)
from .units import sparse_embeddings

tp_style_bases()  # the styles below override private members: fail clearly if torch changed them

# How a layout tells the user something: a Run's say() (a JSON event under format="json").
Say = Callable[[str], None]


# ------------------------------------------------------------------------------------ styles
def _conv1d_type() -> type | None:
    return transformers_class("pytorch_utils", "Conv1D")


def _is_conv1d(module: nn.Module) -> bool:
    conv = _conv1d_type()
    return conv is not None and isinstance(module, conv)


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _linear_dims(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear or Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return cast(int, module.nx), cast(int, module.nf)  # HF Conv1D's sizes


class _Colwise(ColwiseParallel):
    """ColwiseParallel for Linear, HF Conv1D and fused packs of ``pack`` equal outputs."""

    def __init__(self, *, pack: int = 1, **kwargs: Any):
        super().__init__(**kwargs)
        self.pack = pack

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        conv = _is_conv1d(module)
        for pname, param in list(module.named_parameters(recurse=False)):
            dim = 1 if conv and pname == "weight" else 0  # Conv1D weight is (in, out)
            # _StridedShard(dim, 3): split into q|k|v first, then each third over tp, so rank r
            # holds [q_r, k_r, v_r] and full_tensor() still returns the unpermuted weight.
            placement = Shard(dim) if self.pack == 1 else strided_shard(dim, self.pack)
            if self.pack > 1 and param.ndim == 1:
                # A fused bias stays whole on every rank (:func:`_packed_forward` takes this
                # rank's [q_r, k_r, v_r] of it): FSDP2 shards a parameter's dim 0 again, and
                # no placement describes that shard of a strided one (its full_tensor(), and
                # the offsets a checkpoint stores, would put rows in the wrong places).
                placement = Replicate()
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Embedding) and self.pack == 1:
            return super()._apply(module, device_mesh)
        output_fn = partial(self._prepare_output_fn, self.output_layouts, self.use_local_output)
        if self.pack > 1:
            output_fn = partial(_packed_output, self.pack)
            if getattr(module, "bias", None) is not None:
                module.forward = partial(_packed_forward, module, self.pack)
        return distribute_module(
            module, device_mesh, lambda n, m, d: self._partition(n, m, d) if m is module else None,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            output_fn)


def _packed_forward(module: nn.Module, pack: int, x: torch.Tensor) -> torch.Tensor:
    """A fused layer's forward with its whole (replicated) bias cut to this rank's
    ``[q_r, k_r, v_r]`` by a redistribute, whose backward all-gathers the bias gradient: every
    rank's copy gets the whole gradient, as a replicated parameter needs."""
    weight, bias = cast(torch.Tensor, module.weight), cast("torch.Tensor | None", module.bias)
    if isinstance(bias, DTensor) and not any(is_split(p) for p in bias.placements):
        bias = bias.redistribute(placements=[strided_shard(0, pack)])
    if _is_conv1d(module):  # HF Conv1D: weight (in, out), as its own forward computes it
        # (and it always has a bias)
        out = torch.addmm(cast(torch.Tensor, bias), x.reshape(-1, x.shape[-1]), weight)
        return out.view(*x.shape[:-1], out.shape[-1])
    return F.linear(x, weight, bias)


def _packed_output(pack: int, mod: nn.Module, outputs: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    """Local [q_r, k_r, v_r] of a fused layer (a plain Shard(-1) would mix q with k)."""
    want = (strided_shard(outputs.ndim - 1, pack),)
    if outputs.placements != want:
        outputs = outputs.redistribute(placements=want)
    return outputs.to_local()


class _Rowwise(RowwiseParallel):
    """RowwiseParallel for Linear, Embedding and HF Conv1D; its local output is not a view
    (:class:`_ToLocal`)."""

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module,
                           outputs: DTensor, device_mesh: DeviceMesh) -> torch.Tensor:
        outputs = RowwiseParallel._prepare_output_fn(output_layouts, False, mod, outputs,
                                                     device_mesh)
        return _ToLocal.apply(outputs) if use_local_output else outputs

    def _partition_conv1d(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if module is not self._target:
            return
        weight, bias = cast(torch.Tensor, module.weight), cast("torch.Tensor | None", module.bias)
        module.register_parameter("weight", nn.Parameter(distribute_tensor(
            weight, mesh, [Shard(0)], src_data_rank=self.src_data_rank),
            requires_grad=weight.requires_grad))
        if bias is not None:
            module.register_parameter("bias", nn.Parameter(distribute_tensor(
                bias, mesh, [Replicate()], src_data_rank=self.src_data_rank),
                requires_grad=bias.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not _is_conv1d(module):
            return super()._apply(module, device_mesh)
        self._target = module
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, self._partition_conv1d,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            # torch types output_fn as returning None; distribute_module uses what it returns
            partial(self._prepare_output_fn, self.output_layouts,  # type: ignore[arg-type]
                    self.use_local_output))


class _Region(ParallelStyle):
    """Make a block's first tensor input one replicated DTensor (all-gathered from sequence
    shards under SP). Every colwise layer inside then reads the same DTensor, so their input
    gradients are summed as partial DTensors and all-reduced once, at this boundary."""

    def __init__(self, input_layout: Any):
        super().__init__()
        self.input_layout = input_layout

    def _convert(self, t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if not isinstance(t, DTensor):
            t = DTensor.from_local(t, mesh, (self.input_layout,), run_check=False)
        if t.placements != (Replicate(),):
            t = t.redistribute(placements=(Replicate(),))
        return t

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args and isinstance(args[0], torch.Tensor):
                return (self._convert(args[0], device_mesh), *args[1:]), kwargs
            key = "hidden_states" if "hidden_states" in kwargs else next(
                (k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
            if key is None:
                raise ValueError(f"tensor-parallel region {type(mod).__name__} got no tensor "
                                 f"input to replicate")
            return args, {**kwargs, key: self._convert(kwargs[key], device_mesh)}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class _ReplicatedKV(ParallelStyle):
    """A k or v projection with fewer heads than tp (``plait.parallel.tp_kv``): its weights
    become replicated DTensors (whole, the same on every rank) and its forward computes the
    rows of the one head this rank's query heads read.

    Own code, not torch's: no ParallelStyle computes part of a replicated weight. The input is
    handed in as a local tensor whose gradient is a Partial DTensor (as a column-parallel
    layer's is), so it joins the region's one backward all-reduce; the weights' local
    gradient, nonzero on this rank's head only, is summed over tp (:class:`_SumGradToLocal`).
    """

    def __init__(self, kv: KVHeads, input_layout: Any = Replicate()):  # noqa: B008 - immutable
        super().__init__()
        self.kv, self.input_layout = kv, input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, device_mesh, [Replicate()]),
                requires_grad=param.requires_grad))
        rows = self.kv.rows(device_mesh.get_local_rank(), device_mesh.size())
        module.forward = partial(_replicated_kv_forward, module, device_mesh, rows,
                                 self.input_layout)
        return module


def _replicated_kv_forward(module: nn.Module, mesh: DeviceMesh, rows: slice, layout: Any,
                           x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, DTensor):  # whole, or this rank's sequence shard under SP
        x = DTensor.from_local(x, mesh, [layout], run_check=False)
    if x.placements != (Replicate(),):
        x = x.redistribute(placements=[Replicate()])
    local = x.to_local(grad_placements=[Partial()])

    def mine(p: torch.Tensor) -> torch.Tensor:
        if isinstance(p, DTensor) and p.device_mesh == mesh:
            p = _SumGradToLocal.apply(p)
        return p[rows]
    weight, bias = cast(torch.Tensor, module.weight), cast("torch.Tensor | None", module.bias)
    return F.linear(local, mine(weight), None if bias is None else mine(bias))


def make_style(style: str, module: nn.Module, name: str, *, sp: bool,
               sharded_edges: bool = True, kv: KVHeads | None = None,
               gather_input: bool = False) -> ParallelStyle | None:
    """The torch ParallelStyle for a plan entry (None: nothing to do for this entry).

    ``sharded_edges=False`` (SP inside a block stack only): the vocabulary embedding's output
    and the head's input stay whole sequences; :func:`shard_sequence_in_blocks` splits and
    gathers at the stack's ends instead. ``gather_input`` (SP): a column-parallel layer no
    ``region`` holds receives sequence shards and all-gathers them itself."""
    seq = Shard(1)
    between = seq if sp else Replicate()  # layout of activations between TP regions
    edge = between if sharded_edges else Replicate()
    kind = type(module).__name__
    if style in LINEAR_STYLES and not (
            _is_linear(module) or (style != "colwise_qkv" and isinstance(module, nn.Embedding))):
        raise ValueError(f"tensor-parallel style {style!r} on {name!r} needs a Linear "
                         f"(or HF Conv1D / Embedding) module, got {kind}")
    if style == "vocab_embedding" and not isinstance(module, nn.Embedding):
        raise ValueError(f"style 'vocab_embedding' on {name!r} needs nn.Embedding, got {kind}")
    if style == "vocab_head" and not _is_linear(module):
        raise ValueError(f"style 'vocab_head' on {name!r} needs a Linear module, got {kind}")
    entry = seq if gather_input else Replicate()  # what a column-parallel layer receives
    if style == "colwise":
        return _Colwise(input_layouts=entry)
    if style == "colwise_qkv":
        return _Colwise(pack=3, input_layouts=entry)
    if style == "rowwise":
        return _Rowwise(output_layouts=between)
    if style == "colwise_gather":
        return _Colwise(input_layouts=between, output_layouts=Replicate())
    if style == "rowwise_split":
        return _Rowwise(input_layouts=Replicate(), output_layouts=between)
    if style == "replicated_kv":
        if kv is None or not isinstance(module, nn.Linear):
            raise ValueError(f"tensor-parallel style 'replicated_kv' on {name!r} needs an "
                             f"nn.Linear k or v projection with fewer heads than tp, beside a "
                             f"larger colwise query projection in a module that stores its "
                             f"head_dim or head count; got {kind}")
        return _ReplicatedKV(kv, entry)
    if style == "grad_allreduce":
        return None  # replicated like every unnamed module; replicate_rest sums its gradients
    if style == "vocab_embedding":
        return _Rowwise(input_layouts=Replicate(), output_layouts=edge)
    if style == "vocab_head":
        # Logits stay a DTensor sharded on the vocabulary: the loss runs under loss_parallel().
        return _Colwise(input_layouts=edge, output_layouts=Shard(-1), use_local_output=False)
    if style == "region":
        return _Region(between)
    if style == "sequence_parallel":
        return SequenceParallel(use_local_output=True) if sp else None
    raise ValueError(f"unknown tensor-parallel style {style!r} for {name!r}; styles are "
                     f"{', '.join(STYLES)}")


# ------------------------------------------------------------------------------ plan matching
def match_plan(module: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """{module name: style} for every module a glob matches; every glob must match something."""
    names = [n for n, _ in module.named_modules() if n]
    matched: dict[str, str] = {}
    unmatched = []
    for glob, style in styles.items():
        regex = glob_regex(glob)
        hits = [n for n in names if regex.match(n)]
        if not hits:
            unmatched.append(glob)
        for n in hits:
            if n in matched and matched[n] != style:
                raise ValueError(f"module {n!r} matches two tensor-parallel styles, "
                                 f"{matched[n]!r} and {style!r} (glob {glob!r})")
            matched[n] = style
    if unmatched:
        sample = ", ".join(names[:8])
        raise ValueError(f"tensor-parallel plan pattern(s) {unmatched} match no module of "
                         f"{type(module).__name__} (its modules are named like: {sample}, ...)")
    # A LoRA layer where the plan names a linear (PEFT wraps q_proj in place): its base and
    # low-rank path get the styles that split it as one (plait.parallel.tp_lora).
    for name, style in list(matched.items()):
        parts = low_rank_parts(module.get_submodule(name)) if style in LORA_STYLES else None
        if parts is not None:
            del matched[name]
            for part, part_style in expand(style, parts).items():  # type: ignore[union-attr]
                matched.setdefault(f"{name}.{part}", part_style)
    return matched


def resolve_plan(module: nn.Module, plan: Plan, say: Say | None = None,
                 example: Example | None = None) -> TPPlan:
    """Which layer plan to use for ``module`` (see the module docstring for the order); an
    inferred one is told to the user through ``say`` (default: stderr, rank 0) and checked on
    ``example`` (the user's input; guessed without one)."""
    user = plan.options.tp_plan
    if user is not None:
        return user if isinstance(user, TPPlan) else TPPlan.from_option(user)
    shipped = shipped_plan(module)
    return shipped if shipped is not None else _inferred_plan(module, plan.tp, plan.sp, say,
                                                              example)


def tp_refusal(module: nn.Module, tp: int, sp: bool, example: Example | None = None
               ) -> str | None:
    """Why ``module`` cannot take tensor parallelism at ``tp`` (with sequence parallelism if
    ``sp``), or None; what :func:`apply_tensor_parallel` would refuse, asked before anything
    is laid out (the planner asks it about the layouts it would pick). Prints nothing and
    leaves the module as it was: its buffers (a BatchNorm's running statistics) and the RNG
    are restored after the forwards an inferred plan's checks run. A model on the meta device
    cannot be run: None, and the checks run when it is laid out. ``example``: the user's
    input the checks run on (guessed without one)."""
    from .tp_infer import infer_plan, verify_plan

    if any(p.is_meta for p in module.parameters()):
        return None
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    try:
        with torch.random.fork_rng(devices=[]):
            shipped = shipped_plan(module)
            plan = shipped if shipped is not None else verify_plan(
                module, infer_plan(module, example), tp, sp, example)
    except ValueError as exc:
        return str(exc).split("; ")[0]
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    if sp and not plan.supports_sp:
        return "no sequence parallelism: " + (plan.sp_refused or f"its plan ({plan.source}) "
                                              f"has no sequence-parallel layout")
    return None


def _inferred_plan(module: nn.Module, tp: int, sp: bool = False,
                   say: Say | None = None, example: Example | None = None) -> TPPlan:
    """A plan inferred from ``module``'s structure, checked, and told to the user (``say``;
    default: printed on rank 0's stderr), who can copy it into ``options.tp_plan``."""
    from .tp_infer import format_plan, infer_plan, verify_plan

    inferred = verify_plan(module, infer_plan(module, example), tp, sp, example)
    (say or _print0)(format_plan(inferred, module))
    return inferred


def _on_stage(module: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """``styles`` without the patterns that name only modules inside a pipeline stand-in
    (``blocks.2.mlp.up`` on a stage that holds blocks 0 and 1)."""
    stand_ins = [n for n, m in module.named_modules() if isinstance(m, STAND_INS)]
    if not stand_ins:
        return styles
    names = [n for n, _ in module.named_modules() if n]

    def elsewhere(glob: str) -> bool:
        parts = glob.split(".")
        return not any(glob_regex(glob).match(n) for n in names) and any(
            glob_regex(".".join(parts[:k])).match(s) for s in stand_ins
            for k in range(1, len(parts)))
    return {g: style for g, style in styles.items() if not elsewhere(g)}


def plan_for_stages(model: nn.Module, plan: Plan, say: Say | None = None,
                    example: Example | None = None) -> Plan:
    """The plan the pipeline stages of ``model`` apply tensor parallelism with: a layer plan
    that is inferred is inferred once, on the whole model, and handed to every stage as
    ``options.tp_plan``; the blocks fx cannot trace are recorded, and the plan checked, by
    running the model's forward on ``example`` (the user's; else a guessed input), which a
    later stage's forward (it takes hidden states) cannot do."""
    if plan.tp == 1 or plan.options.tp_plan is not None or shipped_plan(model) is not None:
        return plan
    return plan.replace(options=plan.options.replace(
        tp_plan=_inferred_plan(model, plan.tp, plan.sp, say, example)))


def _print0(text: str) -> None:
    """A notice on rank 0, on stderr: a report's stdout (``--format json``) stays clean. A
    ``Run`` passes its own ``say`` instead, which writes a ``message`` event under
    ``format="json"``."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text, file=sys.stderr, flush=True)


def _collapse(texts: list[str]) -> list[str]:
    """``texts`` that each start with a module name, those that differ only in the indices of
    that name said once with ``*`` (``model.layers.*.self_attn.k_proj ...``, not one per
    layer); a text alone in its group keeps its name."""
    from .tp_infer import _glob_levels

    groups: dict[str, list[str]] = {}
    for text in texts:
        name, sep, rest = text.partition(" ")
        groups.setdefault(_glob_levels(name)[0] + sep + rest, []).append(text)
    return [key if len(same) > 1 else same[0] for key, same in groups.items()]


def kv_layers(module: nn.Module, matched: dict[str, str], tp: int,
              say: Say | None = None) -> dict[str, KVHeads]:
    """The k/v projections of ``matched`` whose heads are replicated (``plait.parallel.tp_kv``):
    the ``colwise`` ones with fewer heads than tp, switched to ``replicated_kv`` in ``matched``
    (printed on rank 0), and those the plan itself names ``replicated_kv``."""
    as_colwise = {n: "colwise" if s == "replicated_kv" else s for n, s in matched.items()}
    kv = find_replicated_kv(module, as_colwise, tp)
    switched = sorted(_collapse([n for n in kv if matched[n] == "colwise"]))
    for name in kv:
        matched[name] = "replicated_kv"
    if switched:
        heads = sorted({h.heads for h in kv.values()})
        count = f"{' or '.join(map(str, heads))} kv head{'s' if heads[-1] > 1 else ''}"
        (say or _print0)(f"plait: {', '.join(switched)}: {count}, fewer than tp={tp}, kept "
                         f"whole on every rank (replicated_kv); each rank computes the kv head "
                         f"its query heads read, and their gradients are summed over tp")
    return kv


# ------------------------------------------------------------------------------- validation
def validate(module: nn.Module, tp_plan: TPPlan, matched: dict[str, str], tp: int) -> list[str]:
    """Raise ValueError naming every module/size tp does not divide, and the tp values that
    fit; return notes to print."""
    errors, notes = _size_errors(module, tp_plan, matched, tp)
    if errors:
        plain = {n: "colwise" if s == "replicated_kv" else s for n, s in matched.items()}
        ok = [d for d in range(1, 65) if not _size_errors(
            module, tp_plan, {**plain, **dict.fromkeys(find_replicated_kv(module, plain, d),
                                                       "replicated_kv")}, d)[0]]
        hint = f"; tp values that fit every size: {ok}" if ok[1:] else ""
        # One line per kind of block: model.layers.*.self_attn.k_proj, not one per layer.
        said = _collapse(errors)
        raise ValueError(f"cannot apply tensor parallelism tp={tp} to "
                         f"{type(module).__name__} ({tp_plan.source}): " + "; ".join(said) + hint)
    return notes


def _size_errors(module: nn.Module, tp_plan: TPPlan, matched: dict[str, str], tp: int
                 ) -> tuple[list[str], list[str]]:
    """(what tp does not divide, by name; notes to print) for ``matched`` at ``tp``."""
    errors, notes = [], []
    kv_whole = "replicated_kv" in matched.values()

    def fits(label: str, value: int, d: int) -> bool:
        # kv heads fewer than tp are replicated (tp a multiple of them); more are split.
        return value % d == 0 or (label.rpartition(".")[2] in KV_COUNT_ATTRS and d % value == 0)

    for label, value in tp_plan.sizes.items():
        if value % tp and not (kv_whole and fits(label, value, tp)):
            errors.append(f"{label}={value} is not divisible by tp={tp}")
    for name, style in matched.items():
        sub = module.get_submodule(name)
        if style == "region" and not any(
                n.startswith(name + ".") and s in COLWISE for n, s in matched.items()):
            errors.append(f"{name} (region) holds no column-parallel layer (colwise, "
                          f"colwise_qkv, colwise_gather): a region shares one replicated input "
                          f"among them; drop the entry, the module then runs replicated")
            continue
        if is_parametrized(sub):
            errors.append(
                f"{name} ({style}) is parametrized "
                f"({', '.join(cast(nn.ModuleDict, sub.parametrizations))}: "
                f"weight_norm or spectral_norm compute its weight from other tensors), which "
                f"torch's tensor-parallel styles cannot shard; leave it out of the plan (it "
                f"then runs replicated) or remove the parametrization first "
                f"(torch.nn.utils.parametrize.remove_parametrizations)")
            continue
        if style in LINEAR_STYLES and _is_linear(sub):
            fan_in, fan_out = _linear_dims(sub)
            if style in ("rowwise", "rowwise_split"):
                if fan_in % tp:
                    errors.append(f"{name} ({style}): in_features={fan_in} is not divisible "
                                  f"by tp={tp}")
                continue
            parts = 3 if style == "colwise_qkv" else 1
            # Gathered outputs are whole again: no head is split, only the features.
            head_dim = _head_dim(module, name) if style != "colwise_gather" else None
            unit = parts * tp * (head_dim or 1)
            if fan_out % unit:
                heads = fan_out // parts // head_dim if head_dim else 0
                what = f"{heads} head{'s' * (heads != 1)} of {head_dim}" if head_dim and \
                    fan_out % (parts * head_dim) == 0 else f"out_features={fan_out}"
                errors.append(f"{name} ({style}): {what} cannot split evenly over tp={tp}"
                              + (" (each rank needs whole heads)" if head_dim else ""))
        elif style in ("vocab_embedding", "vocab_head"):
            vocab = sub.num_embeddings if isinstance(sub, nn.Embedding) else _linear_dims(sub)[1]
            if vocab % tp:
                padded = -(-vocab // tp) * tp
                notes.append(f"plait: vocabulary of {name} ({vocab}) is not divisible by tp={tp}; "
                             f"it is padded to {padded} for sharding (shards of {padded // tp} "
                             f"rows, the last {vocab - (tp - 1) * (padded // tp)}; DTensor pads "
                             f"the short shard in collectives)")
    return errors, notes


def _head_dim(root: nn.Module, name: str) -> int | None:
    """head_dim of the attention module holding ``name`` (if it declares one)."""
    parent = name.rpartition(".")[0]
    if parent and low_rank_parts(root.get_submodule(parent)) is not None:
        parent = parent.rpartition(".")[0]  # a LoRA layer's base: the attention holds it
    return owner_head_dim(root.get_submodule(parent)) if parent else None


# ------------------------------------------------------------------------------- the function
def apply_tensor_parallel(module: nn.Module, mesh: Mesh, plan: Plan,
                          say: Say | None = None, example: Example | None = None) -> nn.Module:
    """Shard ``module`` over ``mesh["tp"]`` according to its layer plan; returns it (in place).
    What the user should know (an inferred plan, k/v heads kept whole, a plan's notes) is told
    through ``say`` (default: rank 0's stderr).

    After this every parameter is a DTensor on the tp mesh (unsplit ones ``Replicate``), so a
    plain ``torch.optim.AdamW(model.parameters())`` (foreach) and gradient clipping work, and
    FSDP2 can shard the result over the data axes. The module's recorded
    :class:`~plait.parallel.layout.Layout` says whether the head is vocabulary-parallel
    (``loss_parallel``): the train step then computes the loss, and its backward, inside
    ``torch.distributed.tensor.parallel.loss_parallel()``. ``example``: the user's input an
    inferred plan is checked on (:func:`plait.parallel.tp_example.from_batch`).
    """
    sparse = sparse_embeddings(module)
    if sparse:  # before any mesh is read: the backward would fail on every rank
        raise ValueError(
            f"tp={plan.tp} makes every parameter of {type(module).__name__} a DTensor (those it "
            f"does not split replicated), and {sparse} gives sparse gradients (sparse=True), "
            f"which a DTensor cannot carry (torch: \"Could not run 'aten::view' with "
            f"arguments from the 'SparseCPU' backend\"); use sparse=False under tp, or keep "
            f"sparse=True with dp_replicate=N or dp_shard=N,zero=1")
    tp_mesh = mesh["tp"] if isinstance(mesh, Mesh) else mesh
    tp = tp_mesh.size()
    tp_plan = resolve_plan(module, plan, say, example)
    # torch's styles register new Parameters, trainable whatever the old ones were
    # (SequenceParallel's norms): frozen weights (a LoRA model's base) stay frozen.
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    if plan.sp and not tp_plan.supports_sp:
        why = f": {tp_plan.sp_refused}" if tp_plan.sp_refused else ""
        raise ValueError(f"sp=True: the tensor-parallel plan for {type(module).__name__} "
                         f"({tp_plan.source}) has no sequence-parallel layout{why}; use "
                         f"sp=False, or pass options.tp_plan with 'region' and "
                         f"'sequence_parallel' entries")
    # Pipeline stages keep a parameter-free stand-in where another stage owns a module: what
    # the plan names inside one (a block's linears) is not on this stage.
    matched = {name: style for name, style in match_plan(
                   module, _on_stage(module, tp_plan.styles)).items()
               if not isinstance(module.get_submodule(name), STAND_INS)}
    ties = _tied_groups(module)
    matched.update(_tied_heads(module, ties, matched))
    kv = kv_layers(module, matched, tp, say)
    for note in validate(module, tp_plan, matched, tp):
        (say or _print0)(note)
    sharded_edges = not tp_plan.sp_blocks
    regions = [n for n, s in matched.items() if s == "region"]
    for name, style in matched.items():
        sub = module.get_submodule(name)
        # Under SP a column-parallel layer whose input no region gathers gathers its own.
        alone = plan.sp and not any(name.startswith(r + ".") for r in regions)
        parallel_style = make_style(style, sub, name, sp=plan.sp, sharded_edges=sharded_edges,
                                    kv=kv.get(name), gather_input=alone)
        if parallel_style is not None:
            parallelize_module(sub, tp_mesh, parallel_style)
    if plan.sp and tp_plan.sp_blocks:
        # Each stack splits its own sequence at its first block and gathers it after its last:
        # an encoder's output reaches the decoder's cross-attention whole.
        for stack in tp_plan.sp_stacks:
            shard_sequence_in_blocks(module, stack, tp_mesh)
    elif plan.sp:
        for name, style in matched.items():
            if style == "vocab_embedding":
                _refuse_uneven_sequence(module.get_submodule(name), tp)
    _divide_attrs(module, tp_plan.divide_attrs, tp, keep=set(owners(kv)))
    _drop_head_outputs(module, tp_plan.head_outputs)
    for owner, heads in owners(kv).items():
        sub = module.get_submodule(owner)
        for attr, value in local_attrs(sub, heads, tp).items():
            setattr(sub, attr, value)
    _retie(ties)
    summed = {id(p) for name, style in matched.items() if style == "grad_allreduce"
              for p in module.get_submodule(name).parameters()}
    if plan.sp:
        lora_summed, whole = sp_sums(module, matched, regions)
        summed |= {id(p) for name in lora_summed
                   for p in module.get_submodule(name).parameters()}
    if plan.sp and tp_plan.sp_summed:
        # Between its regions an inferred plan's block stack runs on sequence shards: what
        # no entry names (norms, a layer-scale) gets one rank's positions' gradient.
        summed |= {id(p) for name, sub in module.named_modules()
                   if name and any(under(name, stack) for stack in tp_plan.sp_stacks)
                   and name not in whole
                   for p in sub.parameters(recurse=False) if not isinstance(p, DTensor)}
    replicate_rest(module, tp_mesh, summed)
    for name, p in module.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    _reduce_partial_grads_in_backward(module)
    return record_layout(module, Layout(applied=("tensor_parallel",),
                                        loss_parallel="vocab_head" in matched.values()))


def _sequence_refusal(positions: int, tp: int, at: str = "") -> str:
    """``at``: the block whose input is split (a model with several stacks runs a sequence
    of its own in each: an image tower's patches, a text tower's tokens)."""
    where = f" at {at}" if at else ""
    return (f"sequence parallelism splits the sequence over tp={tp}, but the sequence has "
            f"{positions} positions{where}; use a multiple of {tp} or sp=False")


def _refuse_uneven_sequence(embedding: nn.Module, tp: int) -> None:
    """SP from the embedding's output on (the sharded edges of a shipped plan): a sequence
    that tp does not divide is refused at the embedding's input (token ids, batch first), on
    every tp rank alike (they get the same batch), before the collective that would split it
    into shards of different sizes (gloo aborts the process there). Later pipeline stages
    hold no embedding: what they receive is already a shard."""
    def check(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)),
                     None)
        if first is not None and first.ndim >= 2 and first.shape[1] % tp:
            raise ValueError(_sequence_refusal(first.shape[1], tp))

    embedding.register_forward_pre_hook(check, with_kwargs=True)


def shard_sequence_in_blocks(module: nn.Module, blocks_glob: str, mesh: DeviceMesh) -> None:
    """SP inside a stack of blocks: the first block's input is cut to this rank's sequence
    shard (no communication; backward all-gathers the gradient) and the last block's output is
    all-gathered (backward keeps this rank's shard of the gradient). Hugging Face models
    compute positions, masks and rotary tables from the sequence length around the stack, so
    the sequence must be whole there. A pipeline stage without blocks has nothing to do.

    On a pipeline stage the cut and the gather are at the stack's own ends only: a stage whose
    blocks end before the stack's last hands on its shard as it is (the next stage's first
    block takes a shard), and a stage after the first receives one
    (:func:`~plait.parallel.pipeline_split.receive_sequence_shards`): each stage sends 1/tp of
    the sequence, and no gather and cut runs at the boundary."""
    regex = glob_regex(blocks_glob)
    stack = [(n, m) for n, m in module.named_modules() if n and regex.match(n)]
    # A pipeline stage's own blocks: those of other stages are stand-ins here.
    own = [i for i, (_, m) in enumerate(stack) if not isinstance(m, STAND_INS)]
    if not own:
        return
    (first_name, first), last = stack[own[0]], stack[own[-1]][1]
    tp = mesh.size()
    # The stand-in after this stage's blocks is the one that reads what the stage hands on
    # when the stack is the pipeline's block sequence (HandedOn); a stack of other blocks
    # (nested inside the pipeline's) keeps its gather, and the stage then sends it whole.
    after = stack[own[-1] + 1][1] if own[-1] + 1 < len(stack) else None
    hands_on_shard = isinstance(after, STAND_INS) and after._handed_on is not None
    receives_shard = own[0] > 0 and receive_sequence_shards(
        module, first_name, lambda shard: shard.new_zeros(
            (shard.shape[0], shard.shape[1] * tp, *shard.shape[2:])))

    def to_shard(t: torch.Tensor) -> torch.Tensor:
        if t.shape[1] % tp:
            raise ValueError(_sequence_refusal(t.shape[1], tp, first_name))
        return DTensor.from_local(t, mesh, [Replicate()], run_check=False).redistribute(
            placements=[Shard(1)]).to_local()

    def to_whole(t: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(t, mesh, [Shard(1)], run_check=False).redistribute(
            placements=[Replicate()]).to_local()

    def split_input(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args and isinstance(args[0], torch.Tensor):
            return (to_shard(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": to_shard(kwargs["hidden_states"])}

    def gather_output(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return to_whole(out)
        return (to_whole(out[0]), *out[1:])

    if not receives_shard:
        first.register_forward_pre_hook(split_input, with_kwargs=True)
    if not hands_on_shard:
        last.register_forward_hook(gather_output, with_kwargs=True)


def _drop_head_outputs(module: nn.Module, head_outputs: dict[str, tuple[int, ...]]) -> None:
    """Blocks whose output tuple holds a map per head at these positions (eager attention's
    weights) return None there: each rank computes its own heads' maps only, and None is what
    a block computing attention with a fused kernel returns (a Hugging Face model then leaves
    them out of ``output_attentions``), where the rank's heads would pass for all of them."""
    for name, sub in module.named_modules():
        positions = next((v for g, v in head_outputs.items() if glob_regex(g).match(name)), ())
        if not name or not positions:
            continue

        def drop(mod: nn.Module, args: tuple, output: Any, at: tuple[int, ...] = positions
                 ) -> Any:
            if not isinstance(output, tuple) or len(output) <= max(at):
                return None
            return tuple(None if i in at else v for i, v in enumerate(output))
        sub.register_forward_hook(drop)


def _divide_attrs(module: nn.Module, divide: dict[str, tuple[str, ...]], tp: int,
                  keep: set[str] | frozenset[str] = frozenset()) -> None:
    """Divide the plan's ``divide_attrs`` by tp; in the attention modules ``keep`` names (kv
    heads replicated) the kv-head count and group size are left to :func:`local_attrs`."""
    if not divide:
        return
    for name, _attrs in match_plan(module, _on_stage(module, dict.fromkeys(divide, "divide"))
                                   ).items():
        sub = module.get_submodule(name)
        for glob, names in divide.items():
            if not glob_regex(glob).match(name):
                continue
            for attr in names:
                if name in keep and attr in KV_COUNT_ATTRS + GROUP_ATTRS:
                    continue
                value = getattr(sub, attr, None)
                if not isinstance(value, int) or value % tp:
                    raise ValueError(f"{name}.{attr}={value!r} must be an int divisible by tp={tp}")
                setattr(sub, attr, value // tp)


def _tied_groups(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Parameters shared by several modules (tied embedding and head), as (module, name) lists."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, sub in module.named_modules(remove_duplicate=False):
        for pname, p in sub.named_parameters(recurse=False):
            group = owners.setdefault(id(p), [])
            if not any(m is sub and n == pname for m, n in group):
                group.append((sub, pname))
    return [g for g in owners.values() if len(g) > 1]


def _tied_heads(module: nn.Module, groups: list[list[tuple[nn.Module, str]]],
                matched: dict[str, str]) -> dict[str, str]:
    """{name: "vocab_head"} for each Linear the plan leaves out whose weight is tied to a
    ``vocab_embedding`` (a masked-LM head, ``cls.predictions.decoder`` or RoBERTa's
    ``lm_head.decoder``): sharing the embedding's rows, it must be split like them."""
    names = {id(m): n for n, m in module.named_modules() if n}
    out = {}
    for group in groups:
        styles = {matched.get(names.get(id(m), "")) for m, _ in group}
        if "vocab_embedding" not in styles:
            continue
        for m, _ in group:
            name = names.get(id(m))
            if name is not None and name not in matched and _is_linear(m):
                out[name] = "vocab_head"
    return out


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Styles register new Parameters per module; share one DTensor again across a tie."""
    for group in groups:
        params = [getattr(m, n) for m, n in group]
        dts = [p for p in params if isinstance(p, DTensor)]
        if not dts:
            continue
        keep = dts[0]
        for p in dts[1:]:
            if p.placements != keep.placements:
                raise ValueError(f"tied parameter shared by {[type(m).__name__ for m, _ in group]}"
                                 f" gets two layouts, {keep.placements} and {p.placements}; give "
                                 f"both modules matching styles (vocab_embedding + vocab_head)")
        for m, n in group:  # keep is what a style registered: an nn.Parameter
            m.register_parameter(n, cast(nn.Parameter, keep))


def replicate_rest(module: nn.Module, mesh: DeviceMesh,
                   summed: set[int] | frozenset[int] = frozenset()) -> None:
    """Turn every parameter still a plain tensor into a ``Replicate`` DTensor on ``mesh``.

    Why: foreach optimizers and ``clip_grad_norm_`` reject a mix of DTensor and plain tensors
    (``aten._foreach_lerp_.Scalar got mixed torch.Tensor and DTensor``). The owning modules'
    own buffers become replicated DTensors too, so that everything such a module owns has
    one kind. No communication: every TP rank computes the same values and gradients for
    these modules.

    In forward (:func:`_compute_locally`) they compute on plain tensors: parameters and
    buffers are swapped for their local tensors for the call (``to_local`` is differentiable,
    so gradients reach the DTensor parameters). A forward written for one device then works as
    written: a root module that adds its own position table to what its embedding returns,
    one that builds ``torch.arange``, a BatchNorm updating running statistics, a head that
    multiplies by the embedding's weight (``F.linear(h, self.tok.weight)``). The swap is made
    when ``module`` (the model or pipeline stage) is called, for every replicated tensor that
    is whole on this rank then, and when each module above them is called, for the ones FSDP2
    gathers only then (its pre-forward hook is prepended, so it runs first). Only a call that
    receives a DTensor (inside a TP region) computes on DTensors instead, its plain inputs
    wrapped as replicated and its outputs handed back local.

    ``summed``: ids of parameters of modules applied to each rank's share of a TP region
    (style ``grad_allreduce``): computed on the local shard, their gradient covers this rank's
    heads only, so the swap sums it over ``mesh`` in backward (:class:`_SumGradToLocal`).
    """
    done: dict[int, nn.Parameter] = {}
    owned: dict[str, list[tuple[dict, str, bool]]] = {}
    for name, sub in list(module.named_modules()):
        plain = [(n, p) for n, p in sub.named_parameters(recurse=False)
                 if not isinstance(p, DTensor)]
        if not plain:
            continue
        for pname, p in plain:
            if id(p) not in done:
                done[id(p)] = nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()],
                                                              run_check=False),
                                           requires_grad=p.requires_grad)
            sub.register_parameter(pname, done[id(p)])
        buffers = [n for n, b in sub.named_buffers(recurse=False)
                   if b is not None and not isinstance(b, DTensor)]
        for bname in buffers:
            persistent = bname not in sub._non_persistent_buffers_set
            sub.register_buffer(bname, DTensor.from_local(sub._buffers[bname], mesh,
                                                          [Replicate()], run_check=False),
                                persistent=persistent)
        owned[name] = [(sub._parameters, n, id(p) in summed) for n, p in plain] + [
            (sub._buffers, n, False) for n in buffers]
    if not owned:
        return
    # Each module's hooks swap its whole subtree: a forward may read a child's weight without
    # calling the child (nn.MultiheadAttention reads ``self.out_proj.weight``), and FSDP2
    # gathers the child's parameters with the parent's unit. Modules that own none of them
    # only swap (a call with DTensor inputs is left to the owners below). Each entry carries
    # the modules between the hooked module and the owner (see _compute_locally: a tensor
    # inside an FSDP2 unit below is swapped by that unit's own call).
    for name, sub in module.named_modules():
        if name:
            below = [(*e, _chain(module, name, n)) for n, own in owned.items()
                     if n == name or n.startswith(name + ".") for e in own]
            if below:
                _compute_locally(sub, mesh, below, on_dtensors=name in owned)
    _compute_locally(module, mesh, [(*e, _chain(module, "", n)) for n, own in owned.items()
                                    for e in own], prepend=True)


def _chain(root: nn.Module, above: str, owner: str) -> tuple[nn.Module, ...]:
    """The modules of ``root`` below ``above`` (a module name, "" for ``root``) down to
    ``owner`` (inclusive): ``above.a``, ``above.a.b``, ..., ``owner``."""
    rest = owner[len(above):].lstrip(".") if above else owner
    parts = rest.split(".") if rest else []
    prefix = [above] if above else []
    return tuple(root.get_submodule(".".join(prefix + parts[:i + 1]))
                 for i in range(len(parts)))


_outside_selective_checkpoint = outside_selective_checkpoint()
_ASYNC_COLLECTIVE_TENSOR = async_collective_tensor()


def _compute_locally(module: nn.Module, mesh: DeviceMesh,
                     entries: list[tuple[dict, str, bool, tuple[nn.Module, ...]]], *,
                     prepend: bool = False, on_dtensors: bool = True) -> None:
    """Hooks that run ``module``'s forward with the tensors ``entries`` name (a registry,
    ``_parameters`` or ``_buffers``, a name in it, whether its gradient is summed over
    ``mesh``, and the modules from below ``module`` down to the registry's owner) swapped for
    their local tensors when they are replicated DTensors on ``mesh`` (not while FSDP2 holds
    them sharded), restored afterwards, also when the forward raises; or, when a DTensor comes
    in, on DTensors with local outputs (``on_dtensors``; otherwise such a call is left as it
    is). Entries are names, not tensors: FSDP2 registers a new unsharded parameter under the
    same name each time it gathers one.

    A tensor of an FSDP2 unit below ``module`` is left to that unit's own call, also when it
    is whole already (a forward without backward, an evaluation, leaves units that do not
    reshard after forward gathered: ZeRO-2, replicated DP over TP). Swapped here, before the
    unit's pre-forward hook registers its post-backward hook, its gradient would be
    accumulated after that hook has reduced the unit's gradients: never reduced, the sharded
    parameter would have none, and the optimizer would skip it that step."""
    calls: list[tuple[bool, list[tuple[dict, str, Any, Any]]]] = []

    def enter(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if _holds_dtensor((args, kwargs)):
            wrapped = []
            if on_dtensors:
                # A module above swapped them for local tensors (its call had plain inputs);
                # this call computes on DTensors (a LoRA layer's A reads a region's input), so
                # they go back in as replicated DTensors for it, differentiably.
                for registry, name, *_ in entries:
                    t = registry.get(name)
                    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                        registry[name] = d = DTensor.from_local(t, mesh, [Replicate()],
                                                                run_check=False)
                        wrapped.append((registry, name, t, d))
            calls.append((True, wrapped))
            return _inputs_to_replicate(mesh, mod, args, kwargs) if on_dtensors else None
        saved = []
        # Out of sight of a selective checkpoint (ac=op): in forward the model's call swaps a
        # block's tensors before the block's checkpointed region runs, in the recompute only
        # the block's own call does, inside it; counted, those ops would make the recompute's
        # op count differ from the forward's, and backward fail ("aten.view.default
        # invocation index 7 ... not found in storage": a pre-norm block under tp=2,ac=op).
        with _outside_selective_checkpoint():
            for registry, name, summed, inner in entries:
                t = registry.get(name)
                if (isinstance(t, DTensor) and t.device_mesh == mesh
                        and not any(isinstance(m, FSDPModule) for m in inner)):
                    registry[name] = local = (_SumGradToLocal.apply(t) if summed
                                              else t.to_local())
                    saved.append((registry, name, t, local))
        calls.append((False, saved))
        return None

    def leave(mod: nn.Module, args: tuple, output: Any) -> Any:
        on_dtensor_call, saved = calls.pop()
        if on_dtensor_call:
            for registry, name, local, wrapped in reversed(saved):
                if registry.get(name) is wrapped:
                    registry[name] = local
            return _outputs_to_local(mod, args, output) if on_dtensors else None
        for registry, name, t, local in reversed(saved):
            if registry.get(name) is local:  # not re-registered meanwhile (by FSDP2)
                registry[name] = t
        return None

    module.register_forward_pre_hook(enter, with_kwargs=True, prepend=prepend)
    module.register_forward_hook(leave, always_call=True, prepend=not prepend)


def _holds_dtensor(value: Any) -> bool:
    found = False

    def see(t: torch.Tensor) -> torch.Tensor:
        nonlocal found
        found = found or isinstance(t, DTensor)
        return t
    _map_tensors(value, see)
    return found


def _reduce_partial_grads_in_backward(module: nn.Module) -> None:
    """Replicated weights used on sequence shards (SP norms) get *partial* gradients, and DTensor
    leaves them Partial in ``.grad``: every later op on them (clip norm, each optimizer op) would
    then all-reduce again, at a moment nobody expects. Reduce each once, in backward, instead.

    A vocabulary-parallel embedding's gradient comes out of DTensor's embedding backward
    *replicated*, every rank holding the whole vocabulary's (a 128k x 4096 fp32 table is 2 GiB
    per rank); it is cut to this rank's rows in backward, which needs no communication."""
    for p in module.parameters():
        if not (isinstance(p, DTensor) and p.requires_grad):
            continue
        if all(isinstance(pl, Replicate) for pl in p.placements):
            p.register_hook(_replicate_grad)
        else:
            p.register_hook(partial(_grad_like, p.placements))


def _grad_like(placements: tuple, grad: torch.Tensor) -> torch.Tensor:
    """A replicated gradient of a sharded parameter cut to this rank's shard (a copy, so the
    whole gradient is freed); any other gradient is left as it comes."""
    if isinstance(grad, DTensor) and grad.placements != placements and all(
            isinstance(pl, Replicate) for pl in grad.placements):
        local = grad.redistribute(placements=placements)
        return DTensor.from_local(local.to_local().clone(), local.device_mesh, placements,
                                  run_check=False, shape=local.shape, stride=local.stride())
    return grad


def _replicate_grad(grad: torch.Tensor) -> torch.Tensor:
    if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
        return grad.redistribute(placements=[Replicate()] * len(grad.placements))
    return grad


def _map_tensors(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, dict) and type(value) is dict:
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _inputs_to_replicate(mesh: DeviceMesh, mod: nn.Module, args: tuple, kwargs: dict
                         ) -> tuple[tuple, dict]:
    def wrap(t: torch.Tensor) -> torch.Tensor:
        return t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, [Replicate()],
                                                                    run_check=False)
    return _map_tensors(args, wrap), _map_tensors(kwargs, wrap)


def _outputs_to_local(mod: nn.Module, args: tuple, output: Any) -> Any:
    def unwrap(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, DTensor):
            return t
        if t.placements != (Replicate(),):
            t = t.redistribute(placements=[Replicate()])
        return _ToLocal.apply(t)
    return _map_tensors(output, unwrap)


class _ToLocal(torch.autograd.Function):
    """``DTensor.to_local``, returning a tensor that is not a view.

    Why not ``to_local``: it returns ``local.view_as(local)``, and when that is what a module
    wrapped by FSDP2 returns (a block whose last layer is row-parallel, a replicated
    classification head, under dp x tp), FSDP2 warns on every forward that an in-place op on
    the view would skip its backward hook. The local tensor belongs to this DTensor alone, so
    a detached alias is as safe and is not a view. The gradient goes back as ``to_local``'s
    does: the local gradient laid out as the DTensor was.
    """

    @staticmethod
    def forward(ctx: Any, t: DTensor) -> torch.Tensor:
        local = t.to_local()
        if isinstance(local, _ASYNC_COLLECTIVE_TENSOR):
            # An asynchronous redistribute's tensor (a row-parallel layer's all-reduce or
            # reduce-scatter) waited here: a block compiled by hand that takes it would build no
            # gradient for it (see ``plait.parallel.compile``).
            local = local.wait()
        ctx.spec = (t.device_mesh, t.placements, t.shape, t.stride(), local.stride())
        return local.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> DTensor:
        mesh, placements, shape, stride, local_stride = ctx.spec
        if grad.stride() != local_stride:
            # The DTensor below is declared with the forward's global stride, which describes
            # the forward's local layout: a gradient laid out otherwise (a transposed use of
            # the output, BatchNorm over features) is copied into that layout, or a view taken
            # of it in the layer's backward fails ("view size is not compatible ...").
            grad = grad.new_empty_strided(grad.shape, local_stride).copy_(grad)
        return DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape,
                                  stride=stride)


class _SumGradToLocal(_ToLocal):
    """:class:`_ToLocal` of a replicated DTensor whose local use sees this rank's shard only (a
    per-head norm inside a TP region): backward sums the gradient over the DTensor's mesh, so
    every rank's copy gets the whole gradient and the copies stay equal. The sum is done here,
    not left to a Partial placement, because FSDP2 reads the local gradient of the parameter
    it gathered and would drop a pending reduction."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> DTensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.spec[0].get_group())
        return _ToLocal.backward(ctx, grad)
