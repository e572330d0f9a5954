"""Every private PyTorch API plait uses, in one place.

plait builds on torch's public pieces (DeviceMesh, DTensor, ``parallelize_module``, FSDP2
``fully_shard``, ``torch.distributed.pipelining``). Where they fall short it reaches into names
torch does not promise to keep: a leading underscore, a ``_private`` module, or a method of a
public class that plait overrides. Each such name is reached through one function below, whose
docstring says what it is, why plait needs it, and which torch versions it was checked on. When a
torch release moves or drops one, the function raises :class:`TorchCompatError` naming the
symbol, the installed torch and the versions plait was checked on, instead of an AttributeError
deep inside a worker. ``tests/test_torch_compat.py`` resolves every name on the installed torch.

Names that are optional (plait has a slower fallback) return None when missing.

Not routed here: ``nn.Module``'s own registries (``_modules``, ``_parameters``, ``_buffers``,
``_non_persistent_buffers_set``), which the pipeline splitter and the checkpoint's stage merge
read and shallow-copy; every torch release since 1.0 has them and torch's own code relies on
them. Nor the names in the checkpoint metadata unpickler's allow-list
(plait/checkpoint/safe.py): they are data compared against a pickle's globals, so a renamed one
makes loading refuse the file with a clear error rather than fail obscurely.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    # Classes the functions below return at run time, named for the type checker only: a class
    # built on one needs a static base, an isinstance test a static type.
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.fsdp._fully_shard import _fsdp_api

    FSDPAllGather = _fsdp_api.AllGather
    FSDPReduceScatter = _fsdp_api.ReduceScatter

# The oldest torch plait allows (pyproject: torch>=2.9). Importing this module on an older one
# raises TorchCompatError.
TORCH_FLOOR = (2, 9)
# torch releases the private names below were checked on (tests/test_torch_compat.py).
CHECKED_ON = ("2.9", "2.13")


class TorchCompatError(ImportError):
    """A private torch name plait needs is missing or changed in the installed torch."""


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch, e.g. (2, 13) for ``2.13.0+cpu``."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_torch_version() -> None:
    """Refuse a torch older than :data:`TORCH_FLOOR` with one line saying what to install."""
    if torch_version() < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise TorchCompatError(f"plait needs torch>={floor}, found torch {torch.__version__}; "
                               f"upgrade it: pip install 'torch>={floor}'")


def _missing(symbol: str, detail: str = "") -> TorchCompatError:
    return TorchCompatError(
        f"plait needs the private torch API {symbol}, which torch {torch.__version__} "
        f"{detail or 'does not have'} (plait was checked on torch {', '.join(CHECKED_ON)}); "
        f"install one of those versions, or report this with your torch version")


def _resolve(module: str, name: str, *, required: bool = True) -> Any:
    """``module.name`` (name may be dotted), or TorchCompatError (None when not required)."""
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError):
        if not required:
            return None
        raise _missing(f"{module}.{name}") from None


def _require_members(cls: type, names: tuple[str, ...]) -> type:
    missing = [n for n in names if not hasattr(cls, n)]
    if missing:
        raise _missing(f"{cls.__module__}.{cls.__qualname__}.{missing[0]}",
                       "does not define (plait overrides or calls it)")
    return cls


check_torch_version()


# ------------------------------------------------------------------------------- device mesh
def flatten_mesh(mesh: Any, name: str) -> Any:
    """``DeviceMesh._flatten(name)``: one mesh dimension made of several adjacent ones.

    Why: DP over ``dp_replicate x dp_shard`` and the clip-norm reduction over ``dp_shard x tp``
    need a single group spanning two mesh axes, registered on the root mesh so that DTensor and
    FSDP2 find it by name (torchtitan does the same). torch has no public form of it.
    Checked on torch 2.13.
    """
    fn = getattr(mesh, "_flatten", None)
    if fn is None:
        raise _missing("torch.distributed.device_mesh.DeviceMesh._flatten")
    return fn(name)


# ----------------------------------------------------------------------------- DTensor / TP
def strided_shard(dim: int, split_factor: int) -> Any:
    """``torch.distributed.tensor.placement_types._StridedShard(dim, split_factor=k)``.

    A placement that splits ``dim`` into ``k`` equal parts first and shards each part over the
    mesh. Why: a fused q|k|v (or gate|up) weight under TP must give rank r ``[q_r, k_r, v_r]``,
    not a contiguous slice across q and k, and ``full_tensor()`` must still return the unpermuted
    weight. Checked on torch 2.13 (keyword ``split_factor``).
    """
    return _resolve("torch.distributed.tensor.placement_types", "_StridedShard")(
        dim, split_factor=split_factor)


def is_split(placement: Any) -> bool:
    """Whether a DTensor placement splits the tensor over its mesh dimension: ``Shard``, and
    ``_StridedShard`` too, whose ``is_shard()`` is False on torch 2.13 (it is no longer a
    ``Shard`` subclass there)."""
    return bool(placement.is_shard()) or type(placement).__name__ == "_StridedShard"


def is_strided(placement: Any) -> bool:
    """Whether a DTensor placement is a ``_StridedShard`` (:func:`strided_shard`)."""
    return type(placement).__name__ == "_StridedShard"


# The private members of torch's ParallelStyle classes that plait's styles override or call.
_STYLE_MEMBERS = ("_apply", "_prepare_input_fn", "_prepare_output_fn")
_STYLE_ATTRS = ("input_layouts", "output_layouts", "use_local_output", "src_data_rank")


def tp_style_bases() -> tuple[type, type, type]:
    """``ParallelStyle``, ``ColwiseParallel``, ``RowwiseParallel``, checked for the private
    members plait's subclasses rely on.

    Why: plait's column/row styles also split Hugging Face ``Conv1D`` layers and fused q|k|v
    packs, which torch's styles do not; they override ``_apply`` (the method every
    ``ParallelStyle`` implements) and reuse ``_prepare_input_fn`` / ``_prepare_output_fn`` and the
    layout attributes set in ``__init__``. Checked on torch 2.13.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    _require_members(ParallelStyle, ("_apply",))
    for cls in (ColwiseParallel, RowwiseParallel):
        _require_members(cls, _STYLE_MEMBERS)
        style = cls()
        wanted = _STYLE_ATTRS + (("desired_input_layouts",) if cls is ColwiseParallel else ())
        missing = [a for a in wanted if not hasattr(style, a)]
        if missing:
            raise _missing(f"{cls.__module__}.{cls.__qualname__}().{missing[0]}",
                           "does not set (plait's styles read it)")
    return ParallelStyle, ColwiseParallel, RowwiseParallel


# ----------------------------------------------------------------------------------- FSDP2
def fsdp_comm_protocol() -> tuple[type, type] | None:
    """``AllGather`` and ``ReduceScatter`` from ``torch.distributed.fsdp._fully_shard._fsdp_api``
    (None when this torch has no such protocol).

    The ``Comm`` protocol (``allocate`` + ``__call__``) that ``FSDPModule.set_custom_all_gather``
    / ``set_custom_reduce_scatter`` accept. Why: on gloo plait replaces FSDP2's collectives with
    all-to-alls over pooled buffers (plait/parallel/gloo_collectives.py), about 4x faster there;
    without the protocol FSDP2 keeps its own. Checked on torch 2.13.
    """
    module = "torch.distributed.fsdp._fully_shard._fsdp_api"
    all_gather = _resolve(module, "AllGather", required=False)
    reduce_scatter = _resolve(module, "ReduceScatter", required=False)
    if all_gather is None or reduce_scatter is None:
        return None
    return all_gather, reduce_scatter


def storage_use_count() -> Callable[[torch.Tensor], int] | None:
    """How many references a tensor's storage has: ``torch._C._storage_Use_Count`` of
    ``untyped_storage()._cdata`` (None when this torch has no such function).

    Why: plait's buffer pool for FSDP2's collectives (plait/parallel/gloo_collectives.py) hands
    a buffer out again only when nothing else (FSDP2's views, an in-flight gloo work) still
    holds its storage; without the count it allocates every time. Checked on torch 2.13.
    """
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return lambda t: count(t.untyped_storage()._cdata)


# -------------------------------------------------------------------- activation checkpointing
def checkpoint_wrapper_api() -> tuple[Callable[..., Any], Any, type]:
    """``checkpoint_wrapper``, ``CheckpointImpl`` and ``CheckpointWrapper`` from
    ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``.

    Why: the wrapper torchtitan and FSDP2 use for per-block activation checkpointing; it composes
    with ``fully_shard`` and keeps the wrapped module's state-dict names (minus one prefix).
    ``torch.utils.checkpoint`` alone would need a forward rewrite per model. Checked on torch
    2.13.
    """
    module = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
    return (_resolve(module, "checkpoint_wrapper"), _resolve(module, "CheckpointImpl"),
            _resolve(module, "CheckpointWrapper"))


def outside_selective_checkpoint() -> Callable[[], Any]:
    """A context manager factory: inside it, the dispatch modes of a selective checkpoint
    (``torch.utils.checkpoint``'s ``_CachingTorchDispatchMode`` in forward,
    ``_CachedTorchDispatchMode`` in the recompute) are popped off the dispatch-mode stack while
    they are on top of it, and pushed back on exit.

    Why: selective checkpointing matches each op of the recompute to the forward's call of that
    op by counting calls per op; bookkeeping that runs in one pass and not the other (tensor
    parallelism's swap of replicated parameters for their local tensors) must not be counted,
    or the recompute fails with "invocation index N encountered during backward but not found
    in storage". Checked on torch 2.13."""
    import contextlib

    checkpoint = importlib.import_module("torch.utils.checkpoint")
    stack = _resolve("torch.utils._python_dispatch", "_get_current_dispatch_mode_stack")
    pop = _resolve("torch.utils._python_dispatch", "_pop_mode_temporarily")
    kinds = tuple(getattr(checkpoint, n) for n in ("_CachingTorchDispatchMode",
                                                   "_CachedTorchDispatchMode")
                  if hasattr(checkpoint, n))

    @contextlib.contextmanager
    def outside() -> Any:
        with contextlib.ExitStack() as popped:
            modes = stack()
            while modes and isinstance(modes[-1], kinds):
                popped.enter_context(pop())
                modes = stack()
            yield
    return outside


def sdpa_ops() -> set[Any]:
    """The ``aten._scaled_dot_product_*_attention`` overloads this torch registers.

    Why: op-level checkpointing keeps the outputs of matmuls and attention and recomputes the
    rest; attention reaches autograd as one of these private aten ops (which one depends on the
    device and the kernel picked). Missing ones are skipped. Checked on torch 2.13.
    """
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    ops = (getattr(torch.ops.aten, n, None) for n in names)
    return {op.default for op in ops if op is not None}


def fake_tensor_mode() -> type:
    """``torch._subclasses.fake_tensor.FakeTensorMode``: tensors with shapes and dtypes but no
    memory or compute.

    Why: an inferred tensor-parallel plan is checked by running one forward of the model on fake
    tensors with every matched linear computing its rank's share; a misplaced split fails there,
    before anything is sharded. Checked on torch 2.13.
    """
    return _resolve("torch._subclasses.fake_tensor", "FakeTensorMode")


def is_fake(t: Any) -> bool:
    """``torch._subclasses.fake_tensor.is_fake(t)``: whether ``t`` is a fake tensor (shapes,
    no data), however it is wrapped.

    Why: ``run.all_gather`` called inside a fake-tensor forward (plait's checks of a layout run
    the model on fake tensors) returns the gathered shape without communicating. Checked on
    torch 2.13.
    """
    return bool(_resolve("torch._subclasses.fake_tensor", "is_fake")(t))


def fsdp_replicate() -> Callable[..., Any] | None:
    """``torch.distributed._composable.replicate_with_fsdp.replicate`` (None when missing):
    data parallelism built on FSDP2 with every parameter replicated.

    Why: context parallelism with tensor parallelism replicates the TP shards over the
    flattened data x cp mesh; DDP cannot take DTensor parameters (its broadcast of the module
    states has no DTensor rule). Checked on torch 2.13.
    """
    return _resolve("torch.distributed._composable.replicate_with_fsdp", "replicate",
                    required=False)


# ------------------------------------------------------------------------------ checkpoints
def dcp_set_element() -> Callable[..., Any]:
    """``torch.distributed.checkpoint._traverse.set_element(root, path, value)``: put a value
    back at its place in a nested state dict, as DCP's flattening mapping names it.

    Why: plait's safe load planner reads non-tensor values with ``weights_only=True`` and must
    then store them where DCP's own ``DefaultLoadPlanner.load_bytes`` would. Checked on torch
    2.13.
    """
    return _resolve("torch.distributed.checkpoint._traverse", "set_element")


# -------------------------------------------------------------------------------- pipelining
def pytree() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``torch.utils._pytree.tree_flatten`` and ``tree_unflatten``.

    Why: a pipeline's last stage must hand torch's ``PipelineStage`` tensors only, while models
    return tuples, dicts or Hugging Face ``ModelOutput``s; torch's pytree knows all of these
    (transformers registers ``ModelOutput`` with it) and has no public module on torch 2.9-2.13.
    """
    return (_resolve("torch.utils._pytree", "tree_flatten"),
            _resolve("torch.utils._pytree", "tree_unflatten"))


def pipeline_stage_base() -> type:
    """``torch.distributed.pipelining.PipelineStage``, checked for ``_prepare_forward_infra``.

    Why: plait's stage overrides that private method to run torch's shape inference under DDP's
    ``no_sync`` (otherwise the DDP reducer is armed for a backward that never comes and the
    second step fails in ``Reducer._rebuild_buckets``). Checked on torch 2.13.
    """
    from torch.distributed.pipelining import PipelineStage

    return _require_members(PipelineStage, ("_prepare_forward_infra",))


def stage_backward_split() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """``stage_backward_input`` and ``stage_backward_weight`` from
    ``torch.distributed.pipelining._backward`` (None when missing).

    Why: the planner's calibration times a block's input-gradient and weight-gradient backward
    separately, with the functions the zero-bubble schedules run; a pipeline stage runs the
    weight step of parameters read at several depths itself, with the graph kept
    (``plait.parallel.pipeline.TimedStage``). Checked on torch 2.13.
    """
    module = "torch.distributed.pipelining._backward"
    first = _resolve(module, "stage_backward_input", required=False)
    second = _resolve(module, "stage_backward_weight", required=False)
    return None if first is None or second is None else (first, second)


def own_hook_registries(clone: torch.nn.Module, module: torch.nn.Module) -> None:
    """Give ``clone`` (a ``copy.copy`` of ``module``) its own copies of the module's hook
    registries (``_forward_hooks``, ``_forward_pre_hooks``, their ``_with_kwargs`` and
    ``_always_called`` companions, the backward and state-dict hooks): the hooks registered so
    far still run on the clone, and a hook registered later on one of them stays on it.

    Why: a shallow copy shares these dicts, so ``fully_shard`` on one pipeline stage's copy of
    the model's root would register its root hooks on every copy: under two stages per rank
    (ZB-V, interleaved schedules) each stage's forward would run both stages' FSDP2 root
    hooks, and one stage's backward would fire the other's pre-backward and final callback,
    resharding (and at its sync setting reduce-scattering) it mid-schedule. ``nn.Module``
    has no public way to copy a module without its children. Checked on torch 2.13.
    """
    for name, value in vars(module).items():
        if "hook" in name and isinstance(value, dict):
            clone.__dict__[name] = type(value)(value)


def is_view(t: torch.Tensor) -> bool:
    """``Tensor._is_view()``: whether ``t`` is a view of another tensor's storage.

    Why: torch's split backward (zero-bubble schedules) frees stage outputs with ``detach_()``,
    which views refuse; a Hugging Face stage output that is a view is copied first. Checked on
    torch 2.13.
    """
    fn = getattr(t, "_is_view", None)
    if fn is None:
        raise _missing("torch.Tensor._is_view")
    return bool(fn())


# ------------------------------------------------------------------- dispatcher (the ledger)
def c10d_op(name: str) -> Any:
    """``torch.ops.c10d.<name>.default``: the dispatcher op behind a process-group collective.

    Why: the communication ledger registers a ``BackendSelect`` kernel on these ops, so it sees
    every collective (DDP, FSDP2, DTensor's functional collectives, pipelining's send/recv) with
    its process group, whatever issued it. The op names are internal. Checked on torch 2.13.
    """
    op = getattr(getattr(torch.ops.c10d, name, None), "default", None)
    if op is None:
        raise _missing(f"torch.ops.c10d.{name}.default")
    return op


def keyset_after_backend_select() -> Any:
    """``torch._C._dispatch_keyset_full_after(DispatchKey.BackendSelect)``.

    Why: the ledger's kernel runs at ``BackendSelect`` and hands the call on to the next kernel;
    this key set masks its own key out of the redispatch. Checked on torch 2.13.
    """
    after = getattr(torch._C, "_dispatch_keyset_full_after", None)
    key = getattr(getattr(torch._C, "DispatchKey", None), "BackendSelect", None)
    if after is None or key is None:
        raise _missing("torch._C._dispatch_keyset_full_after(DispatchKey.BackendSelect)")
    return after(key)


def redispatch_boxed(op: Any) -> Callable[..., Any]:
    """``OpOverload._handle.redispatch_boxed``: call ``op``'s next kernel below a key set.

    Why: the ledger's kernel must forward each collective at the cost of one call (it wraps
    every collective of every step); ``OpOverload.redispatch`` adds a Python frame.
    Checked on torch 2.13.
    """
    fn = getattr(getattr(op, "_handle", None), "redispatch_boxed", None)
    if fn is None:
        raise _missing("torch._ops.OpOverload._handle.redispatch_boxed")
    return fn


def destroy_library(lib: Any) -> None:
    """``torch.library.Library._destroy()``: unregister the kernels a Library registered.

    Why: the ledger removes its kernels when no ledger is active, so a run without one pays
    nothing; torch only does it when the Library object is garbage-collected. Checked on
    torch 2.13.
    """
    fn = getattr(lib, "_destroy", None)
    if fn is None:
        raise _missing("torch.library.Library._destroy")
    fn()


def dispatch_has_kernel(op_name: str, key: str) -> bool:
    """``torch._C._dispatch_has_kernel_for_dispatch_key``: whether ``op_name`` has a kernel
    registered at dispatch key ``key`` (the tests check the ledger leaves none behind).
    Checked on torch 2.13."""
    fn = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if fn is None:
        raise _missing("torch._C._dispatch_has_kernel_for_dispatch_key")
    return bool(fn(op_name, key))


def resolve_process_group(name: str) -> Any:
    """``torch.distributed.distributed_c10d._resolve_process_group(name)``: the group a
    functional collective names by string.

    Why: DTensor's functional collectives pass their group as a name; the ledger maps it back
    to the group's ranks to say which mesh axis the bytes crossed. Checked on torch 2.13.
    """
    return _resolve("torch.distributed.distributed_c10d", "_resolve_process_group")(name)


# ------------------------------------------------------------------- tests and benchmarks
def functional_collectives() -> Any:
    """The module ``torch.distributed._functional_collectives`` (the traceable collectives
    DTensor issues); tests and benchmarks call it to check that the ledger sees them.
    Checked on torch 2.13."""
    try:
        return importlib.import_module("torch.distributed._functional_collectives")
    except ImportError:
        raise _missing("torch.distributed._functional_collectives") from None


def torch_dispatch_mode() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``, the base of a mode that sees every
    aten op; bench/tp_collectives.py counts DTensor's collectives with one (torch's
    ``CommDebugMode`` trips over modules with keyword forward pre-hooks), and the planner
    counts the ops a step dispatches with one (``plait.planner.op_count``: torch has no public
    op counter; ``FlopCounterMode`` sees only ops with a FLOP formula). Checked on torch
    2.13."""
    return _resolve("torch.utils._python_dispatch", "TorchDispatchMode")


def async_collective_tensor() -> type[AsyncCollectiveTensor]:
    """``torch.distributed._functional_collectives.AsyncCollectiveTensor``: the local tensor of
    an asynchronous redistribute (a row-parallel layer's all-reduce or reduce-scatter) before it
    is waited. plait waits it where a compiled block would take it as an input (its gradient
    would be lost, see ``plait.parallel.compile``). Checked on torch 2.13."""
    return _resolve("torch.distributed._functional_collectives", "AsyncCollectiveTensor")


def tree_map_only() -> Callable[..., Any]:
    """``torch.utils._pytree.tree_map_only``: apply a function to the tensors of one type in
    nested arguments (a block's args and kwargs). Checked on torch 2.13."""
    return _resolve("torch.utils._pytree", "tree_map_only")


def meta_nonzero_patch() -> Callable[[], Any] | None:
    """A context in which ``torch.nonzero`` (and so ``torch.where(mask)``, boolean indexing)
    runs on meta tensors, returning every index as if no element were zero; None when this
    torch lacks the switch (``torch.fx.experimental._config.meta_nonzero_assume_all_nonzero``).

    Why: a mixture-of-experts layer gathers each expert's tokens with ``torch.where``, whose
    output size depends on the data, so a meta-device forward of such a model fails without it.
    plait's meta forwards ask only which tensors an output is computed from, which taking every
    index cannot hide. Checked on torch 2.13."""
    config = _resolve("torch.fx.experimental._config", "patch", required=False)
    flag = _resolve("torch.fx.experimental._config", "meta_nonzero_assume_all_nonzero",
                    required=False)
    if config is None or flag is None:
        return None
    return lambda: config(meta_nonzero_assume_all_nonzero=True)


def compiled_module_class() -> type:
    """``torch._dynamo.eval_frame.OptimizedModule``, the wrapper ``torch.compile(module)``
    returns (its ``_orig_mod`` is the module). ``run.parallelize`` lays out the module inside
    it and compiles its blocks instead; ``run.step`` refuses one around a laid-out model.
    Checked on torch 2.13."""
    return _resolve("torch._dynamo.eval_frame", "OptimizedModule")


def dynamo_graph_count() -> int:
    """How many distinct graphs torch.compile has built in this process
    (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``): tests read it to show that
    compiled blocks really ran compiled. Checked on torch 2.13."""
    counters = _resolve("torch._dynamo.utils", "counters")
    return int(counters["stats"]["unique_graphs"])


def dynamo_frames() -> tuple[int, int]:
    """How many frames torch.compile was asked to compile in this process, and how many of them
    it compiled (``torch._dynamo.utils.counters["frames"]``): more asked than graphs built is a
    recompile, fewer compiled than asked a frame that failed. Checked on torch 2.13."""
    frames = _resolve("torch._dynamo.utils", "counters")["frames"]
    return int(frames["total"]), int(frames["ok"])


def inductor_cache_hits() -> int:
    """How many graphs inductor took from its FX graph cache in this process
    (``torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]``): a warm compile.
    Checked on torch 2.13."""
    return int(_resolve("torch._dynamo.utils", "counters")["inductor"]["fxgraph_cache_hit"])


def compile_seconds() -> float:
    """Seconds torch.compile spent in this process compiling frames and their backwards
    (``torch._dynamo.utils.calculate_time_spent()["total_wall_time"]``): what
    ``bench/compile_cost.py`` reports per rank. Checked on torch 2.13."""
    return float(_resolve("torch._dynamo.utils", "calculate_time_spent")()
                 .get("total_wall_time", 0.0))


def xla_set_element() -> Any:
    """``torch_xla.experimental.distributed_checkpoint._helpers.set_element``: puts a loaded
    value at a dotted path of a state dict, as torch_xla's own load planner does.

    Why: plait's XLA load planner (``plait.checkpoint.xla``) reads non-tensor values itself
    (without running code from the file) and stores them where torch_xla's would. Checked on
    torch_xla 2.9."""
    return _resolve("torch_xla.experimental.distributed_checkpoint._helpers", "set_element")


def xla_sharded_cpu_state_dict() -> Any:
    """``torch_xla.experimental.distributed_checkpoint._helpers._sharded_cpu_state_dict``: a
    state dict with every XLA tensor copied to host memory, a sharded one as the shards this
    host holds with their offsets (``_CpuShards``, which torch_xla's ``SPMDSavePlanner`` plans
    and writes like the device tensor it came from).

    Why: a background save on XLA (``plait.checkpoint.xla.save_in_background``) must not read
    the device while the next step runs; this is the copy torch_xla's own
    ``CheckpointManager.save_async`` makes before it hands the write to a thread. Checked on
    torch_xla 2.9."""
    return _resolve("torch_xla.experimental.distributed_checkpoint._helpers",
                    "_sharded_cpu_state_dict")


def reset_dynamo() -> None:
    """``torch._dynamo.reset()``: forget compiled code and counters (tests, one per job).
    Checked on torch 2.13."""
    _resolve("torch._dynamo", "reset")()


def fsdp_param_groups(module: Any, dtypes: bool = True) -> list[Any]:
    """The parameter groups (``FSDPParamGroup``) of an ``FSDPModule`` (none for a unit without
    parameters of its own), each checked for the members the ledger's closed form reads.

    Why: ``plait.comm.held`` predicts the bytes of FSDP2's all-gathers and reduce-scatters from
    what FSDP2 itself laid out, not from a re-derivation: a group's ``fsdp_params`` (each with
    ``padded_sharded_param_size``, dim 0 padded to a multiple of the shard count, the size
    FSDP2's flat buffers use; ``sharded_param``; ``orig_dtype``, ``param_dtype`` and
    ``reduce_dtype``, the dtypes it gathers and reduces in), its ``mesh_info``
    (``shard_mesh_size``; none in torch's FSDP2-based ``replicate``, whose ``DDPMeshInfo``
    shards nothing) and ``post_forward_mesh_info`` (None when the unit stays gathered
    from forward to backward). Reached through ``FSDPModule._get_fsdp_state()``; torch 2.13
    keeps a list ``_fsdp_param_groups`` (one per mesh), earlier releases one
    ``_fsdp_param_group``. ``dtypes=False``: the sizes alone, which FSDP2 sets in
    ``fully_shard`` (the dtypes only at its first forward).
    Checked on torch 2.13."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        raise _missing("torch.distributed.fsdp.FSDPModule._get_fsdp_state")
    state = get_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        if not hasattr(state, "_fsdp_param_group"):
            raise _missing("torch.distributed.fsdp FSDPState._fsdp_param_group")
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    for group in groups:
        _require_attrs(group, "FSDPParamGroup", ("fsdp_params", "mesh_info",
                                                 "post_forward_mesh_info"))
        if type(group.mesh_info).__name__ != "DDPMeshInfo":  # replicate's: no shard dim
            _require_attrs(group.mesh_info, "FSDPMeshInfo", ("shard_mesh_size",))
        for param in group.fsdp_params:
            _require_attrs(param, "FSDPParam", ("padded_sharded_param_size", "sharded_param")
                           + (("orig_dtype", "param_dtype", "reduce_dtype") if dtypes else ()))
    return list(groups)


def _require_attrs(obj: Any, owner: str, names: tuple[str, ...]) -> None:
    """Instance attributes ``_require_members`` cannot see on the class."""
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise _missing(f"torch.distributed.fsdp {owner}.{missing[0]}")


# Every resolver that takes no argument, for tests/test_torch_compat.py. Each returns the private
# name(s) or None for an optional one this torch lacks.
RESOLVERS: tuple[Callable[[], Any], ...] = (
    tp_style_bases, fake_tensor_mode, fsdp_comm_protocol, storage_use_count,
    checkpoint_wrapper_api, outside_selective_checkpoint, sdpa_ops, dcp_set_element,
    pipeline_stage_base,
    stage_backward_split, keyset_after_backend_select, functional_collectives,
    torch_dispatch_mode, compiled_module_class, async_collective_tensor, tree_map_only,
    meta_nonzero_patch, fsdp_replicate,
)
