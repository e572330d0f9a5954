"""Pipeline parallelism, part 1: where to cut a model and what each stage keeps.

The model is taken as it is: no LayerSpec rewrite, no tracing. plait finds the sequence of
blocks (the ``nn.ModuleList`` / ``nn.Sequential`` holding most of the parameters, e.g.
``model.layers``), cuts it into ``pp x virtual_stages`` contiguous stages, and builds for each
stage this rank owns a *stage module*: a shallow copy of the model in which

* blocks of other stages are replaced by ``PipelineSkip`` (a parameter-free pass-through), so the
  kept blocks keep their canonical names (``layers.3.attention.q_proj.weight``) for checkpoints,
  TP plans and ``plait check``;
* modules the forward calls before the block sequence (embeddings) stay on the first stage only,
  those it calls after it (final norm, head) on the last stage only, whatever order the model
  registers them in (seen in one fake-tensor forward; registration order where none runs);
  elsewhere they are skipped too. Modules without parameters (activations, rotary tables) stay
  everywhere, and so do the loss modules a skipped module holds (:func:`keep_loss_modules`).

The model's own ``forward`` then runs unchanged on each stage: a skipped embedding (or vision
stem) passes the previous stage's hidden states through, skipped blocks do nothing. Its first
argument is what the stages chain; its other arguments (an attention mask) reach every stage by
keyword, so each block gets them as on one device. A stage without the last block sends on
what reaches the stand-in of the block after its own (:func:`hand_on`): the input that block
takes on one device, whatever the forward then does (pooling, the head, extra outputs); the
next stage feeds exactly that to the block (:func:`_feed_first_block`), whatever the forward
did to it on the way (an activation or a scale after the embedding, an activation between
blocks: done once, on the stage that computed it). The last stage returns whatever the model
returns. This works for any forward that chains its modules (the
reference transformer, a Sequential MLP or CNN); models whose forward feeds a module something
other than the running activation (HF models' position embeddings and masks) need an adapter
(:mod:`plait.parallel.pipeline_hf`).

Stages are cut by parameter count (embedding on the first stage and head on the last count
too), or by per-block costs (``options.stage_costs``), or at user-named split points
(``options.split_points = ("layers.4", "layers.8")``: a stage starts at each name, and the
container they name is the block sequence, whichever holds the most parameters), or
by blocks per stage (``options.pp_stage_layers = (3, 5)``, what the planner emits when
its cost-balanced split is uneven).

This part is pure module surgery (no process group): the stage runtime in
:mod:`plait.parallel.pipeline` turns the stage modules into torch ``PipelineStage``s.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.nn.modules.loss import _Loss

from .._torch_compat import is_view, own_hook_registries
from ..partition import balanced_partition, even_split
from ..partition import bounds as block_bounds
from ..plan import Plan
from .fx_trace import trace_kept
from .pipeline_chain import chain_break, meta_replica, unchained_message
from .pipeline_hf import adapt_hf_forward, hf_added_embeddings, is_hf_model
from .units import not_a_stack

if TYPE_CHECKING:
    from .tp_example import Example

Containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
BlockSequence = nn.ModuleList | nn.Sequential | nn.ModuleDict


def _carried(args: tuple, kwargs: dict[str, Any]) -> Any:
    """The running activation a stand-in receives: its first positional input, or the
    ``inputs_embeds`` keyword (Hugging Face models call their embedding module with keywords
    only: BERT's ``self.embeddings(input_ids=None, inputs_embeds=h, ...)``)."""
    if args and args[0] is not None:
        return args[0]
    # DistilBERT calls its embeddings positionally, (input_ids=None, inputs_embeds=h).
    later = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if later is not None:
        return later
    if kwargs.get("inputs_embeds") is not None:
        return kwargs["inputs_embeds"]
    raise TypeError("a pipeline stand-in was called without a positional input or "
                    "inputs_embeds; keywords: " + ", ".join(sorted(kwargs)))


class StageOutputError(ValueError):
    """A stage whose forward never reached the point where its hidden state is read."""


class HandedOn:
    """The running activation where a stage without the last block ends: the input of the
    stand-in for the sequence's last block (reset per stage forward). It is what the next
    stage's first own block must receive: later blocks pass it through (or add zero to it),
    and what the forward does after the blocks (pooling, slicing, the head) belongs to the
    last stage."""

    def __init__(self) -> None:
        self.last: Any = None
        self.stop = False  # end the forward once ``last`` is set (a stage before the last)
        # Modules placed on the last stage (called after the blocks) whose stand-ins this
        # stage's forward called on its way to the blocks (reset per stage forward).
        self.early: list[str] = []


class _HandedOnReached(BaseException):
    """Ends a stage's forward at the first block after its own, once it holds what the stage
    hands on: what the forward computes after that (later blocks' stand-ins, the head, a
    gain on the logits) would be dropped, and may not even run on the stand-ins' outputs
    (``self.out(h) * self.gain`` with the head a pass-through). A BaseException, so that the
    error notes that wrap the forward (``except Exception``) let it through."""


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


class Settings:
    """The plain settings (flags, sizes, names) of a module another stage owns, and of its
    children, kept by its stand-in: a forward may read them from a module it does not call
    (torch's ``nn.TransformerEncoder`` reads ``self.layers[0].self_attn.batch_first`` on
    every stage). Reading a tensor, or calling a child, names the module and the fix."""

    __slots__ = ("_at", "_owner", "_values", "_children", "_tensors")

    def __init__(self, module: nn.Module, name: str, owner: str = ""):
        self._at = name
        self._owner = owner or name  # the module the stage does not hold
        self._values = {k: v for k, v in vars(module).items()
                        if isinstance(v, _PLAIN) or (isinstance(v, tuple)
                                                     and all(isinstance(x, _PLAIN) for x in v))}
        self._children = {k: Settings(c, f"{name}.{k}", self._owner)
                          for k, c in module._modules.items() if c is not None}
        self._tensors = {n for n, _ in module.named_parameters(recurse=False)} | {
            n for n, _ in module.named_buffers(recurse=False)}

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") or attr in Settings.__slots__:  # copy, pickle: not settings
            raise AttributeError(attr)
        if attr in self._values:
            return self._values[attr]
        if attr in self._children:
            return self._children[attr]
        owner = self._owner
        if attr in self._tensors:
            raise AttributeError(
                f"{self._at}.{attr}: this pipeline stage does not hold {owner} (another stage "
                f"owns it), and the forward reads its {attr!r} here. Keep such reads inside the "
                f"module that owns the tensor; a head that multiplies by the embedding's weight "
                f"must be a module for a pipeline to give the last stage a copy: an nn.Linear "
                f"whose weight is tied (self.head.weight = self.tok.weight); or run with pp=1")
        raise AttributeError(
            f"{self._at}.{attr}: this pipeline stage does not hold {owner} (another stage owns "
            f"it), and the forward reads {attr!r} from it here; a stage can read another "
            f"stage's settings, not its other attributes: read it from a module every stage "
            f"holds, or run with pp=1")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"{self._at} is called on a pipeline stage that does not hold it (another stage "
            f"owns it): a forward may call only the modules of its blocks' stages, or run "
            f"with pp=1")


class StandIn(nn.Module):
    """A parameter-free module in place of one another stage owns; the one for the sequence's
    last block also reads what the stage hands on (its ``handed_on``). The owned module's
    plain settings stay readable (:class:`Settings`)."""

    def __init__(self, handed_on: HandedOn | None = None, name: str = "",
                 settings: Settings | None = None, returns_tuple: int = 0):
        super().__init__()
        self._handed_on = handed_on
        self._name = name
        self._settings = settings
        self._tuple = returns_tuple  # the owned module returns (hidden, ...) of this length

    def _shaped(self, x: Any) -> Any:
        """``x`` as the owned module returns its output: alone, or first of a tuple."""
        return (x, *[None] * (self._tuple - 1)) if self._tuple else x

    def __getattr__(self, attr: str) -> Any:
        try:
            return super().__getattr__(attr)
        except AttributeError:
            settings = self.__dict__.get("_settings")
            if settings is None or attr.startswith("__"):
                raise
            return getattr(settings, attr)

    def _receive(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        x = _carried(args, kwargs)
        if self._handed_on is not None:
            self._handed_on.last = x
            if self._handed_on.stop:
                raise _HandedOnReached
        return x


class PipelineZero(StandIn):
    """Stands in for a module another stage owns whose output the forward *adds* to the running
    activation (an HF position embedding added to ``inputs_embeds``, a second embedding, a
    block whose residual is in the parent's forward): the hidden states received already
    contain its contribution, so here it adds zero."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._shaped(torch.zeros((), device=self._receive(args, kwargs).device))


class PipelineSkip(StandIn):
    """Stands in for a module another stage owns: returns its first input unchanged."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._shaped(self._receive(args, kwargs))


def keep_loss_modules(stand_in: nn.Module, owned: nn.Module, name: str) -> None:
    """Give ``stand_in`` the loss modules (``torch.nn`` losses) ``owned`` holds, under their
    one-device names: a model may keep its loss (a class-weighted ``nn.CrossEntropyLoss``)
    in a module another stage owns (its stem, a block) and call it after the blocks, on the
    last stage, which then holds it, moves it to its device with the stage and finds its
    class weights (:func:`plait.mean_probe.weighted_module_count`). A loss module has no
    parameters: nothing is trained twice. Modules between ``owned`` and a loss module are
    stand-ins too, except containers (``nn.ModuleDict``, ``nn.ModuleList``,
    ``nn.Sequential``), which stay containers of the same keys so that the forward can index
    them (``self.stem.losses["ce"]``); their other entries are stand-ins."""
    for key, child in owned.named_children():
        if isinstance(child, _Loss):
            stand_in._modules[key] = child  # add_module would find the Settings entry
        elif child is not None and any(isinstance(m, _Loss) for m in child.modules()):
            stand_in._modules[key] = _loss_holder(child, f"{name}.{key}")


# Containers a forward indexes; the order matters: nn.Sequential is not a ModuleList.
_CONTAINERS: tuple[type[nn.Module], ...] = (nn.ModuleDict, nn.ModuleList, nn.Sequential)


def _loss_holder(child: nn.Module, at: str) -> nn.Module:
    """What stands in for ``child``, a module another stage owns that holds a loss module:
    a container of ``child``'s kind and keys for a container (a loss entry kept, an entry
    holding one recursed into, any other a stand-in), else a stand-in keeping its losses."""
    kind = next((k for k in _CONTAINERS if isinstance(child, k)), None)
    if kind is None:
        inner = PipelineSkip(None, at, Settings(child, at), _returns_tuple(child))
        keep_loss_modules(inner, child, at)
        return inner
    box = kind()
    for key, entry in child._modules.items():
        where = f"{at}.{key}"
        if entry is None or isinstance(entry, _Loss):
            box._modules[key] = entry
        elif any(isinstance(m, _Loss) for m in entry.modules()):
            box._modules[key] = _loss_holder(entry, where)
        else:
            box._modules[key] = PipelineSkip(None, where, Settings(entry, where),
                                             _returns_tuple(entry))
    return box


def _returns_tuple(module: nn.Module) -> int:
    """The length of the tuple ``module`` returns where it is known without running it: 2 for
    torch's recurrent layers, ``(output, h_n)`` (an LSTM's ``h_n`` is itself a pair); else 0.
    A stand-in for an LSTM before the blocks must return a pair too: ``h, _ = self.rnn(x)``
    would otherwise unpack the hidden states it passes on along the batch dimension (an error
    for most batch sizes; for a microbatch of two rows the unpacking succeeds and the blocks
    run on one row)."""
    return 2 if isinstance(module, nn.RNNBase) else 0


# The stand-ins for modules another stage owns. Later composition steps leave them alone: a
# tensor-parallel layer plan's "output: vocab_head" still names one on stages without the head.
STAND_INS = (PipelineSkip, PipelineZero)

# ----------------------------------------------------------------------------- splitting
@dataclass(frozen=True)
class StageSpec:
    """Global stage ``index`` holds blocks ``start`` .. ``end - 1`` of the block sequence."""

    index: int
    start: int
    end: int
    num_stages: int
    # The modules beside the blocks, on the path to them, that the forward calls after the
    # blocks (a final norm, the head), by name: they stay on the last stage, the others on the
    # first. None: taken from the order the model registers them in.
    after: frozenset[str] | None = None
    # The length of the tuple a block returns (transformers' Falcon and BLOOM layers return
    # (hidden states, ...) and the caller takes [0]), 0 when it returns the hidden states: a
    # block's stand-in returns the same shape of value.
    block_tuple: int = 0
    # Whether one meta-device forward at the split saw every block fed by the one before
    # (:mod:`plait.parallel.pipeline_chain`); if not, the first step asks on its real inputs.
    chained: bool = False
    # Whether every stage runs on its rank's context-parallel slice of each sequence (cp > 1):
    # the position ids it is given are then the slice's global ones, not packed sequences.
    context_parallel: bool = False

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def find_blocks(model: nn.Module, name: str | None = None) -> tuple[str, BlockSequence]:
    """The block sequence: ``name`` if given, else the ModuleList/Sequential/ModuleDict with >= 2
    children
    holding the most parameters (the shallowest on ties; the model itself if it is one)."""
    if name is not None:
        try:
            container = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"options.pp_blocks={name!r} is not a submodule of "
                             f"{type(model).__name__}") from None
        if not isinstance(container, Containers):
            raise ValueError(f"options.pp_blocks={name!r} is a {type(container).__name__}, "
                             f"not an nn.ModuleList, nn.Sequential or nn.ModuleDict of blocks")
        return name, container
    best: tuple[int, int, str, BlockSequence] | None = None
    for mod_name, module in model.named_modules():
        if isinstance(module, Containers) and len(module) >= 2:
            n_params = sum(p.numel() for p in module.parameters())
            key = (n_params, -mod_name.count(".") - (mod_name != ""))
            if best is None or key > best[:2]:
                best = (*key, mod_name, module)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList, nn.Sequential or "
                         f"nn.ModuleDict of blocks to split into pipeline stages; put the "
                         f"repeated blocks in one (e.g. self.layers = nn.ModuleList(...)), name "
                         f"it with options.pp_blocks, or run with pp=1")
    return best[2], best[3]


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _side_modules(model: nn.Module, path: str, called_after: frozenset[str] | None = None,
                  prefix: str = "") -> tuple[list[nn.Module], list[nn.Module]]:
    """Modules beside the block sequence along its path from the root, called before / after
    it: those ``called_after`` names (``prefix`` + their name in ``model``) come after, or,
    when it is None, those registered after it."""
    before: list[nn.Module] = []
    after: list[nn.Module] = []
    module = model
    parts = path.split(".") if path else []
    for depth, part in enumerate(parts):
        seen = False
        for child_name, child in module.named_children():
            if child_name == part:
                seen = True
            elif child is not None:
                name = ".".join(p for p in (prefix, *parts[:depth], child_name) if p)
                later = seen if called_after is None else name in called_after
                (after if later else before).append(child)
        module = getattr(module, part)
    return before, after


def observe_forward(model: nn.Module, path: str, given: Example | None = None
                    ) -> tuple[frozenset[str] | None, int]:
    """What one fake-tensor forward (no memory, no compute) of ``model`` on ``given`` (the
    user's input, :func:`plait.parallel.tp_example.from_batch`) or a guessed input
    shows about the blocks at ``path``: the names of the modules beside the block sequence (on
    the path to it) that the forward calls after the blocks, and the length of the tuple a
    block returns (0: not a tuple). A model may register its final norm and head before its
    blocks (OPT's decoder does): the order of calls, not of registration, says which stage owns
    them. A module the forward does not call goes by registration order; when no input can be
    guessed or the forward does not run on it, all do (None), and blocks return tensors."""
    from .tp_example import example_input, run_on
    from .tp_record import fake_forward

    parts = path.split(".") if path else []
    example = (given if given is not None else example_input(model)) if parts else None
    if example is None:
        return None, 0
    first: dict[str, int] = {}
    returned: list[Any] = []
    handles = []

    def seen_first(names: tuple[str, ...]) -> None:
        for n in names:
            first.setdefault(n, len(first))

    module = model
    for depth, part in enumerate(parts):
        for key, child in module.named_children():
            name = ".".join([*parts[:depth], key])
            handles.append(child.register_forward_pre_hook(
                lambda m, a, names=(name,): seen_first(names)))
        module = getattr(module, part)
    # A ModuleList is never called itself: its first block's call is when the path is entered.
    path_names = tuple(".".join(parts[:d + 1]) for d in range(len(parts)))
    for block in module.children():
        handles.append(block.register_forward_pre_hook(
            lambda m, a: seen_first(path_names)))
        handles.append(block.register_forward_hook(lambda m, a, out: returned.append(out)))
    try:
        with fake_forward(model):
            run_on(model, example)
    except Exception:  # noqa: BLE001 - not runnable on the guess: registration order
        return None, 0
    finally:
        for h in handles:
            h.remove()
    block_tuple = len(returned[0]) if returned and isinstance(returned[0], tuple) else 0
    after = set()
    module = model
    for depth, part in enumerate(parts):
        blocks = ".".join(parts[:depth + 1])
        seen = False
        for key in module._modules:
            name = ".".join([*parts[:depth], key])
            if key == part:
                seen = True
            elif (first[name] > first[blocks] if name in first and blocks in first else seen):
                after.add(name)
        module = getattr(module, part)
    return frozenset(after), block_tuple


def plan_stages(model: nn.Module, plan: Plan,
                chains: dict[str, tuple[str, str] | bool | None] | None = None,
                example: Example | None = None) -> tuple[str, list[StageSpec]]:
    """Where to cut: the block sequence's name and every global stage's block range.
    ``chains`` keeps what :func:`_unchained` found per block sequence, for a caller that asks
    about several plans of one model (the planner). ``example``: the user's input the checks
    that run the model run on (:func:`plait.parallel.tp_example.from_batch`), else a guess."""
    n_stages = plan.pp * plan.virtual_stages
    named = _blocks_name(model, plan)
    path, container = find_blocks(model, named)
    n_blocks = len(container)
    where = f"{path or type(model).__name__}"
    if named is None:
        _refuse_small_mixed(model, path, container, plan)
    uncallable = [(k, m) for k, m in container.named_children()
                  if isinstance(m, (nn.ModuleDict, nn.ModuleList))]
    if uncallable:
        first = f"{path}.{uncallable[0][0]}" if path else uncallable[0][0]
        raise ValueError(f"the blocks of {where} are {type(uncallable[0][1]).__name__}s, which the "
                         f"forward indexes ({first}[...]) instead of calling: a pipeline stage "
                         f"stands in for whole blocks it does not hold, so each block must be a "
                         f"module with a forward (a class whose forward calls its parts); or "
                         f"run with pp=1")
    if chains is not None and path in chains:
        chain = chains[path]
    else:
        chain = _unchained(model, path, example)
        if chains is not None:
            chains[path] = chain
    if isinstance(chain, tuple):
        raise ValueError(unchained_message(type(model).__name__, where, chain))
    called, block_tuple = observe_forward(model, path, example)
    if n_stages > n_blocks:
        raise ValueError(f"pp={plan.pp} x virtual_stages={plan.virtual_stages} = {n_stages} "
                         f"stages but {where} has only {n_blocks} blocks; use at most "
                         f"{n_blocks} stages (lower pp or virtual_stages) or a deeper model")
    # Plan validation allows at most one of these, with one entry per stage (or cut).
    split_points = plan.options.split_points
    stage_costs = plan.options.stage_costs
    stage_layers = plan.options.pp_stage_layers
    if stage_layers is not None:
        bounds = _bounds_from_layers(stage_layers, n_stages, n_blocks, plan, where)
    elif split_points is not None:
        names = [f"{path}.{k}" if path else k for k in container._modules]
        starts = []
        for point in split_points:
            if point not in names:
                raise ValueError(f"split point {point!r} is not a block of {where}; blocks are "
                                 f"{names[0]} .. {names[-1]}")
            starts.append(names.index(point))
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise ValueError(f"split_points={list(split_points)} must be increasing and start "
                             f"after {names[0]} (each names the first block of a stage)")
        edges = [0, *starts, n_blocks]
        bounds = list(zip(edges[:-1], edges[1:], strict=True))
    else:
        if stage_costs is not None:
            if len(stage_costs) != n_blocks:
                raise ValueError(f"stage_costs has {len(stage_costs)} entries but {where} has "
                                 f"{n_blocks} blocks; give one cost per block")
            costs = [float(c) for c in stage_costs]
            first_extra = last_extra = 0.0
        else:
            costs = [float(_param_count(b)) for b in container._modules.values() if b is not None]
            before, after = _side_modules(model, path, called)
            first_extra = float(sum(_param_count(m) for m in before))
            last_extra = float(sum(_param_count(m) for m in after))
        bounds = block_bounds(balanced_partition(costs, n_stages, first_extra=first_extra,
                                                 last_extra=last_extra))
    return path, [StageSpec(k, i, j, n_stages, called, block_tuple, chain is True)
                  for k, (i, j) in enumerate(bounds)]


def _refuse_small_mixed(model: nn.Module, path: str, container: nn.Module, plan: Plan) -> None:
    """Refuse the container plait found by itself when it is no sequence of blocks
    (:func:`plait.parallel.units.not_a_stack`: a U-Net's timestep MLP, a recommender's bottom
    MLP). Cut there, the later stage runs the rest of the forward on the hidden states in
    place of the model's input and fails deep in it. A stack of one kind of block, or a
    container holding most of the model (a CNN's nn.Sequential of layers), is cut as before."""
    why = not_a_stack(model, [(f"{path}.{k}" if path else k, m)
                              for k, m in container.named_children()])
    if why is None:
        return
    name = type(model).__name__
    raise ValueError(
        f"pp={plan.pp} would cut {name} at {why}, each feeding the next. Name the blocks with "
        f"options.pp_blocks (or split_points), or train {name} without a pipeline: dp=N, or "
        f"dp_shard=N,zero=3 to shard its state")


def _unchained(model: nn.Module, path: str, given: Example | None = None
               ) -> tuple[str, str] | bool | None:
    """Two consecutive blocks at ``path`` of which the second is not fed by the first, seen in
    one meta-device forward on ``given`` (the user's input) or a guessed input
    (:func:`~plait.parallel.pipeline_chain.chain_break`); True when every block was seen fed
    by the one before; None when it cannot tell (no input can be guessed): the first step
    then asks on the real inputs."""
    found = meta_call(model, given)
    return None if found is None else chain_break(found[0], path, found[1], found[2])


def meta_call(model: nn.Module, given: Example | None
              ) -> tuple[nn.Module, Any, dict[str, Any]] | None:
    """``(a meta-device replica of model, its first input, its keyword inputs)`` on the meta
    device, for the pipeline's meta-device checks (``replica(x, **kwargs)``): from ``given``
    (the user's input) or a guessed one; None where there is neither or no replica."""
    from .tp_example import Example, example_input, first_and_keywords

    if given is None:
        with torch.random.fork_rng(devices=[]):  # the guess draws token ids: keep the RNG
            guess = example_input(model)
        given = None if guess is None else Example((guess,))
    call = None if given is None else first_and_keywords(model, given.to("meta"))
    replica = meta_replica(model) if call is not None else None
    if call is None or replica is None:
        return None
    return replica, call[0], call[1]


def _blocks_name(model: nn.Module, plan: Plan) -> str | None:
    """The block sequence the plan names: ``options.pp_blocks``, else the container the split
    points name blocks of (``split_points=["blocks.2"]`` -> ``blocks``), else None (the
    largest container is taken)."""
    points = plan.options.split_points
    if plan.options.pp_blocks is not None or not points:
        return plan.options.pp_blocks
    parents = sorted({p.rpartition(".")[0] for p in points})
    if len(parents) > 1:
        raise ValueError(f"split_points={list(points)} name blocks of different containers "
                         f"({', '.join(parents)}); every split point names the first block of "
                         f"a stage in one nn.ModuleList, nn.Sequential or nn.ModuleDict")
    parent = parents[0]
    where = parent or type(model).__name__
    try:
        container = model.get_submodule(parent)
    except AttributeError:
        raise ValueError(f"split point {points[0]!r}: {where} is not a submodule of "
                         f"{type(model).__name__}; name the first block of a stage by its "
                         f"module name (e.g. layers.4, as in model.named_modules())") from None
    if not isinstance(container, Containers):
        raise ValueError(f"split point {points[0]!r}: {where} is a "
                         f"{type(container).__name__}, not an nn.ModuleList, nn.Sequential "
                         f"or nn.ModuleDict of blocks; name the first block of a stage inside "
                         f"the model's block sequence (e.g. layers.4)")
    return parent


def _bounds_from_layers(stage_layers: Any, n_stages: int, n_blocks: int, plan: Plan,
                       where: str) -> list[tuple[int, int]]:
    """Block ranges from ``options.pp_stage_layers``: blocks per model chunk, in global stage
    order (the planner writes it when its cost-balanced split is not the even one, so the
    runtime builds exactly the layout that was priced)."""
    try:
        counts = [int(c) for c in stage_layers]
        exact = all(int(c) == c for c in stage_layers)
    except (TypeError, ValueError):
        counts, exact = [], False
    if not exact or len(counts) != n_stages or sum(counts) != n_blocks or min(counts) < 1:
        raise ValueError(f"options.pp_stage_layers={stage_layers!r} must list {n_stages} "
                         f"positive whole block counts (pp={plan.pp} x virtual_stages="
                         f"{plan.virtual_stages}), one per stage in stage order, summing to the "
                         f"{n_blocks} blocks of {where}; e.g. "
                         f"{even_split(n_blocks, n_stages)}")
    return block_bounds(counts)


def additive_modules(model: nn.Module, path: str) -> set[str] | None:
    """Modules whose output the model's forward *adds* to the running activation, so that on a
    stage that does not own them they must contribute zero, not pass their input on: a block
    whose residual lives in the parent (``h = h + block(h)``), or a second embedding summed
    with the first (``tok(ids) + pos(positions)``). Found by tracing the module that holds the
    block sequence with torch.fx, blocks and side modules as leaves. None when fx cannot trace
    that forward (data-dependent branches; Hugging Face models, whose adapter handles them):
    :func:`additive_by_running` then checks the first step's forward instead."""
    import operator

    import torch.fx as fx

    parent, parent_name, leaves = _parent_and_leaves(model, path)

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return qualname in leaves or super().is_leaf_module(m, qualname)

    try:
        graph = trace_kept(Tracer(), parent)
    except Exception:  # noqa: BLE001 - untraceable forward: checked at the first step
        return None
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    adds = (operator.add, operator.iadd, torch.add)
    out = set()
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in leaves:
            continue
        carrier = bool(node.args) and node.args[0] in inputs[:1]  # reads the model input
        for value, whole_rule in _read_from(node):
            for user in value.users:
                if user.op in ("call_function", "call_method") and (
                        user.target in adds or user.target in ("add", "add_")):
                    others = [a for a in user.args if a is not value]
                    # Added to a parameter or buffer of the model only (a shift the forward
                    # adds after each block), the output is not summed with the running
                    # activation: a stand-in that passes its input on keeps the stages' chain.
                    summed = [a for a in others if isinstance(a, fx.Node)
                              and a.op != "get_attr"]
                    if (node.args and node.args[0] in others) or (
                            whole_rule and not carrier and summed):
                        prefix = f"{parent_name}." if parent_name else ""
                        out.add(prefix + str(node.target))
    return _with_aliases(parent, parent_name, leaves, out)


def _read_from(node: Any) -> list[tuple[Any, bool]]:
    """The fx values that carry what the module called at ``node`` returns, each with whether
    the whole additivity rule applies to it: the output itself by the whole rule; its first
    item (a block that returns ``(hidden states, ...)``, read as ``layer(h)[0]``) or an item
    read by key or attribute (``out["h"]``, ``out.last_hidden_state``) only when added to the
    module's own input (``h = h + layer(h)[0]``): a recurrent layer's ``(output, state)``
    before the blocks is the running activation the blocks' outputs are added to, and other
    fields of a block's output (an auxiliary loss summed over the blocks) are added to each
    other, not to the hidden states."""
    import operator

    found = [(node, True)]
    for user in node.users:
        if user.op != "call_function" or len(user.args) < 2 or user.args[0] is not node:
            continue
        key = user.args[1]
        if (user.target is operator.getitem and key == 0 and not isinstance(key, bool)) or (
                user.target in (operator.getitem, getattr) and isinstance(key, str)):
            found.append((user, False))
    return found


def _parent_and_leaves(model: nn.Module, path: str) -> tuple[nn.Module, str, set[str]]:
    """The module whose forward calls the block sequence at ``path``, its name, and its
    leaves for the additivity rule: the blocks and its other children, named in it."""
    parts = path.split(".") if path else []
    parent_name = ".".join(parts[:-1])
    parent = model.get_submodule(parent_name) if parent_name else model
    container = parent.get_submodule(parts[-1]) if parts else parent
    leaves = {f"{parts[-1]}.{k}" if parts else k for k in container._modules}
    return parent, parent_name, leaves | {n for n, m in parent.named_children()
                                          if m is not container}


def _with_aliases(parent: nn.Module, parent_name: str, leaves: set[str], found: set[str]
                  ) -> set[str]:
    """``found`` plus every other name of the same modules: a block applied several times
    (ALBERT's one layer, ``nn.ModuleList([block] * 4)``) is one module under several names,
    and fx (and a hook) sees its calls under one of them."""
    prefix = f"{parent_name}." if parent_name else ""
    ids = {id(parent.get_submodule(n.removeprefix(prefix))) for n in found}
    return found | {prefix + n for n in leaves if id(parent.get_submodule(n)) in ids}


_ADDS = (torch.add, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.__add__,
         torch.Tensor.__radd__, torch.Tensor.__iadd__)


def _returned(out: Any) -> list[tuple[torch.Tensor, bool]]:
    """The tensors of a module's output that :func:`additive_by_running` watches, each with
    whether the whole additivity rule applies (as :func:`_read_from` for fx): the output by
    the whole rule; the first item of a tuple or list and the tensors of a mapping or a
    dataclass (a ``ModelOutput``'s ``last_hidden_state``, read by key, index or attribute, is
    the same tensor) only when added to the module's own input."""
    if isinstance(out, torch.Tensor):
        return [(out, True)]
    if isinstance(out, (tuple, list)):
        return [(out[0], False)] if out and isinstance(out[0], torch.Tensor) else []
    if isinstance(out, Mapping):
        values: list[Any] = list(out.values())
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        values = [getattr(out, f.name) for f in dataclasses.fields(out)]
    else:
        return []
    return [(v, False) for v in values if isinstance(v, torch.Tensor)]


def additive_by_running(model: nn.Module, path: str, first: Any, kwargs: dict[str, Any]
                        ) -> set[str]:
    """What :func:`additive_modules` finds, found by running ``model``'s forward once on
    ``first`` and ``kwargs`` (meta tensors: no memory, no compute) and watching every addition
    (a ``TorchFunctionMode``) for one that takes a block's or side module's output. The same
    rule: a module whose output is added to its own input, or added to an activation (not
    only to the model's parameters and buffers) when the module does not read the model's
    input, is additive. For forwards fx cannot trace; one
    that does not run at all yields nothing. ``first`` None: the inputs are all keywords."""
    from torch.overrides import TorchFunctionMode

    parent, parent_name, leaves = _parent_and_leaves(model, path)
    prefix = f"{parent_name}." if parent_name else ""
    # id(output) -> (name, the module's input, whether that input is the parent's own input,
    # whether the whole rule applies: :func:`_returned`); the tensors are kept alive, so their
    # ids are not reused while the forward runs.
    outputs: dict[int, tuple[str, Any, bool, bool]] = {}
    kept: list[Any] = []
    found: set[str] = set()
    state = {id(t) for t in (*model.parameters(), *model.buffers())}
    entry: list[Any] = [None]  # the parent's first input, as fx's first placeholder
    # Calls of leaves under way: additions inside a block (its own residual, reading the
    # previous block's output) are not the parent's, as fx, keeping the leaves whole, sees.
    inside = [0]

    def enter(module: nn.Module, args: tuple) -> None:
        entry[0] = args[0] if args else None

    def begin(module: nn.Module, args: tuple) -> None:
        inside[0] += 1

    def record(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kw: dict, out: Any) -> None:
            inside[0] -= 1
            x = args[0] if args else None
            for value, whole_rule in _returned(out):
                outputs[id(value)] = (name, x, x is not None and x is entry[0], whole_rule)
                kept.append(value)
        return hook

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                               kw: dict | None = None) -> Any:
            if func in _ADDS and not inside[0]:
                operands = [a for a in (*args[:2], (kw or {}).get("other"))
                            if isinstance(a, torch.Tensor)]
                for a in operands:
                    if id(a) not in outputs:
                        continue
                    name, x, carrier, whole_rule = outputs[id(a)]
                    summed = [o for o in operands if o is not a and id(o) not in state]
                    if (whole_rule and not carrier and summed) or any(
                            o is x for o in operands if o is not a):
                        found.add(prefix + name)
            return func(*args, **(kw or {}))

    handles = [parent.get_submodule(n).register_forward_hook(record(n), with_kwargs=True,
                                                             always_call=True)
               for n in leaves]
    handles += [parent.get_submodule(n).register_forward_pre_hook(begin) for n in leaves]
    handles.append(parent.register_forward_pre_hook(enter))
    try:
        with torch.no_grad(), Watch():
            model(*(() if first is None else (first,)), **kwargs)
    except Exception:  # noqa: BLE001 - not runnable on meta: left to the real run
        return set()
    finally:
        for h in handles:
            h.remove()
    return _with_aliases(parent, parent_name, leaves, found)


def add_zero_stand_ins(stages: list[nn.Module], names: set[str]) -> None:
    """In each laid-out stage module, the pass-through stand-ins for ``names`` (modules whose
    output the forward adds to the running activation, found at the first step by
    :func:`additive_by_running`) become stand-ins that add zero. Parameter-free modules, so
    DDP, FSDP2 and the optimizer are not affected."""
    from .units import canonical_name

    for stage in stages:
        for name, m in list(stage.named_modules()):
            if isinstance(m, PipelineSkip) and canonical_name(name) in names:
                parent_name, _, key = name.rpartition(".")
                parent = stage.get_submodule(parent_name) if parent_name else stage
                parent._modules[key] = PipelineZero(m._handed_on, m._name, m._settings,
                                                     m._tuple)


def held_on_path(model: nn.Module, path: str) -> list[str]:
    """The parameters held directly (not by a submodule) by ``model`` or a module on the path
    to its blocks, by name: every stage shares them (see :func:`build_stage_module`)."""
    parts = path.split(".") if path else []
    held = []
    for depth in range(len(parts)):
        prefix = ".".join(parts[:depth])
        module = model.get_submodule(prefix) if prefix else model
        held += [f"{prefix}.{n}".lstrip(".") for n, _ in module.named_parameters(recurse=False)]
    return held


def build_stage_module(model: nn.Module, path: str, spec: StageSpec) -> nn.Module:
    """A shallow copy of ``model`` holding only stage ``spec``'s modules (names unchanged).

    Its forward is the model's own; on a stage without the last block it returns the hidden
    state to send on (:func:`hand_on`), on the last stage whatever the model returns."""
    parts = path.split(".") if path else []
    zero = additive_modules(model, path) or set()
    handed_on = HandedOn()

    hf_done = False
    added: set[int] = set()  # HF position embeddings: their skip adds zero

    def rebuild(module: nn.Module, depth: int) -> nn.Module:
        nonlocal hf_done
        clone = copy.copy(module)
        clone._modules = dict(module._modules)  # own registry; children shared, not copied
        own_hook_registries(clone, module)  # FSDP2's root hooks on one stage stay on it
        if not hf_done and is_hf_model(module):
            hf_done = True  # the outermost HF model on the path is the one that gets called
            before, _ = _side_modules(module, ".".join(parts[depth:]), spec.after,
                                      prefix=".".join(parts[:depth]))
            added.update(id(m) for m in hf_added_embeddings(module, before,
                                                            ".".join(parts[depth:])))
            adapt_hf_forward(clone, spec, is_root=depth == 0)
        if depth == len(parts):  # the block sequence
            for idx, (key, block) in enumerate(module._modules.items()):
                if not spec.start <= idx < spec.end:
                    name = f"{path}.{key}" if path else key
                    # The stand-in of the first block after this stage's reads what the
                    # stage hands on: the input that block takes on one device.
                    reads = handed_on if idx == spec.end else None
                    stand_in = PipelineZero if name in zero else PipelineSkip
                    settings = None if block is None else Settings(block, name)
                    skipped = stand_in(reads, name, settings, spec.block_tuple)
                    if block is not None:
                        keep_loss_modules(skipped, block, name)
                    clone._modules[key] = skipped
            return clone
        # Parameters held directly by a module on the path (a ``logit_scale`` or a gate the
        # forward uses before, between or after the blocks) stay on every stage: the clone
        # shares the module's parameter registry. Only the uses that reach what the stage
        # hands on (or the loss, on the last) get a gradient: a use before the blocks is
        # replaced on later stages by what they receive (_feed_first_block), and a stage before
        # the last ends its forward at the first block after its own (_HandedOnReached), so a
        # use after that is not computed there. So each stage's gradient is its own share, and
        # shared_parameters ties the copies like an embedding tied to the head: their
        # gradients are summed over the stages, the one-device gradient.
        seen = False
        for key, child in module._modules.items():
            if key == parts[depth] and child is not None:
                seen = True
                clone._modules[key] = rebuild(child, depth + 1)
            elif child is not None and _param_count(child) > 0:
                name = ".".join([*parts[:depth], key])
                later = seen if spec.after is None else name in spec.after
                keep = spec.is_last if later else spec.is_first
                if not keep:
                    stand_in = (PipelineZero if id(child) in added or name in zero
                                else PipelineSkip)
                    replaced = stand_in(None, name, Settings(child, name),
                                        _returns_tuple(child))
                    keep_loss_modules(replaced, child, name)
                    if later:  # a stage before the last stops at its blocks' end, so a call
                        # of this stand-in there is the forward calling it before the blocks
                        replaced.register_forward_pre_hook(
                            lambda *_, n=name: handed_on.early.append(n))
                    clone._modules[key] = replaced
        return clone

    stage = rebuild(model, 0)
    keys = list(_container(model, path)._modules)
    if not spec.is_first:
        _feed_first_block(stage, path, keys[spec.start], zero, type(model).__name__, spec)
    if spec.is_last:
        # Whether the stage's forward got past its blocks, for an error raised after them.
        _container(stage, path).get_submodule(keys[-1]).register_forward_hook(
            lambda *_: setattr(handed_on, "last", True))
    hint = _few_in_blocks(model, path)
    _explain_after_blocks(stage, type(model).__name__, spec, handed_on,
                          [f"{path}.{k}".lstrip(".") for k in keys], hint)
    if not spec.is_last:
        forward = stage.forward  # the model's, or the HF adapter's
        next_block = f"{path}.{keys[spec.end]}".lstrip(".")

        def send_on(*args: Any, **kwargs: Any) -> torch.Tensor:
            handed_on.last = None
            handed_on.early = []
            # Labels go to the model on the last stage only (a model given labels computes its
            # loss from its output, here the hidden states).
            kwargs.pop("labels", None)
            handed_on.stop = True
            try:
                forward(*args, **kwargs)
            except _HandedOnReached:
                pass
            except Exception as exc:
                if handed_on.early:
                    raise RuntimeError(_called_early(type(model).__name__, handed_on.early,
                                                     path, spec, exc)) from exc
                raise
            finally:
                handed_on.stop = False
            return hand_on(handed_on.last, type(model).__name__, next_block, spec)

        stage.forward = send_on
    if not spec.is_first:
        _explain_failures(stage, type(model).__name__, spec, handed_on, hint)
    return stage


def _few_in_blocks(model: nn.Module, path: str) -> str:
    """A sentence for a stage's failure note when the sequence of blocks cut into stages holds
    under half the model's parameters: then it is likely not the model's chain of blocks but
    the largest container plait found (a U-Net's timestep MLP, a recommender's bottom MLP),
    and the rest of the forward reads inputs a later stage does not have; "" otherwise."""
    held = _param_count(_container(model, path))
    total = _param_count(model)
    if not total or held >= total / 2:
        return ""
    return (f" The blocks cut into stages are {path or type(model).__name__}, which hold "
            f"{held:,} of its {total:,} parameters ({held / total:.1%}): if that is not "
            f"{type(model).__name__}'s "
            f"sequence of blocks, each feeding the next, name the right one with "
            f"options.pp_blocks; a model without one (a U-Net, whose skips cross its levels) "
            f"trains with dp=N, or dp_shard=N,zero=3 to shard its state")


def _called_early(model_name: str, names: list[str], path: str, spec: StageSpec,
                  exc: Exception) -> str:
    """Why a stage before the last failed when its forward called, before the blocks, a module
    plait placed on the last stage: that module's stand-in returned its input unchanged, and
    the forward failed on it. Placed by the order of calls when one forward on a guessed input
    ran, else by the order of registration (no input could be guessed)."""
    shown = ", ".join(f"`{n}`" for n in dict.fromkeys(names))
    how = ("the forward called it after the blocks on a guessed input"
           if spec.after is not None else
           f"it is registered after `{path}` in __init__, and no input could be guessed "
           f"to see the order of calls")
    return (f"pipeline: {model_name}'s forward calls {shown} before the blocks in `{path}`, "
            f"but plait placed it on the last stage ({how}); on stage {spec.index} it is a "
            f"stand-in that passes its input on, and the forward failed on that: "
            f"{type(exc).__name__}: {exc}. Fix: call it after the blocks (nothing changes on "
            f"one device): a pipeline hands on only the blocks' running activation, so a "
            f"module whose output the last stage uses runs there, after the blocks")


# The attribute of a stage module (after the first) holding its :class:`_Fed`.
_FED = "_plait_fed"


class _Fed:
    """What :func:`_feed_first_block` keeps between calls: the block it feeds, the tensor the
    stage received (set for the length of one forward), whether the first real forward was
    checked, and ``whole``: under sequence parallelism (:func:`receive_sequence_shards`) the
    whole-sequence tensor the forward runs on in place of the shard received."""

    __slots__ = ("block", "received", "checked", "whole")

    def __init__(self, block: str) -> None:
        self.block = block
        self.received: torch.Tensor | None = None
        self.checked = False
        self.whole: Callable[[torch.Tensor], torch.Tensor] | None = None


def receive_sequence_shards(stage: nn.Module, first_block: str,
                            whole: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Have ``stage`` (after the first) receive its rank's sequence shard and feed it to its
    first block ``first_block`` as it is; True when that block is the one the stage feeds.

    Under sequence parallelism the hidden states between blocks are split along the sequence
    over the tp ranks, so a stage can hand on its shard (1/tp of the bytes) rather than gather
    the whole sequence to send it and cut it again on the next stage. The next stage's forward
    still runs from its start, where a model computes positions, causal masks and rotary tables
    from its input's sequence length: it gets ``whole(shard)``, a tensor of the whole
    sequence's shape, and its first block the shard received."""
    fed = stage.__dict__.get(_FED)
    if not isinstance(fed, _Fed) or fed.block != first_block:
        return False
    fed.whole = whole
    return True


def _feed_first_block(stage: nn.Module, path: str, key: str, additive: set[str],
                      model_name: str, spec: StageSpec) -> None:
    """On a stage after the first, the stage's first own block takes the tensor the previous
    stage sent, whatever the model's forward did to it on the way there.

    Why: the forward runs from its start on every stage, so what it does to the running activation
    before the blocks (an activation or dropout after the embedding, a scale such as
    ``embed(x) * sqrt(d)``, Gemma's normaliser, a transpose of a patch grid) or between them
    (``h = act(block(h))``) would run again on hidden states that already went through it: a
    scale applied twice trains another model with no error. The previous stage sends what its
    next block takes on one device (the input of that block's stand-in), so that is exactly
    what this block must get. A forward pre-hook, put on the module in the block's place at
    each call (the activation-checkpointing wrapper, when there is one, so that recomputation
    sees the same input) and first among its hooks (before FSDP2 casts the inputs), swaps it in.

    Refused: a forward that changes the hidden states before this block and also adds the
    block's output to them (a residual in the parent's forward, ``h = h + block(h)``); the
    residual would read the changed tensor, and only moving the change (or the residual)
    makes it right."""
    name = f"{path}.{key}".lstrip(".")
    fed = _Fed(name)
    stage.__dict__[_FED] = fed
    forward = stage.forward

    def feed(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        # Its first call in this forward only: one module may be every block (a block shared
        # across depths, as ALBERT's), and only the first call takes what was received.
        received, fed.received = fed.received, None
        x = args[0] if args else kwargs.get("hidden_states")
        if received is None or x is received or not isinstance(x, torch.Tensor):
            return None
        # All zeros: torch's shape inference (plait's stage hands it zeros), where a scale or
        # an activation that maps zero to zero hides the change; the first microbatch shows it.
        # Skipped where the forward ran on a whole-sequence stand-in for a shard received
        # (receive_sequence_shards): nothing it did to that tells what it does to real states.
        if (not fed.checked and fed.whole is None and not (x.is_meta or received.is_meta)
                and bool(received.any())):
            fed.checked = True
            # nan_to_num: the first call can receive a buffer not yet written (NaN in it).
            same = x.shape == received.shape and bool(torch.equal(x.nan_to_num(),
                                                                  received.nan_to_num()))
            if not same and name in additive:
                raise ValueError(
                    f"{model_name}'s forward changes the hidden states on their way to {name} "
                    f"(the first block of pipeline stage {spec.index}) and adds {name}'s output "
                    f"to them (a residual outside the block): on this stage the change would "
                    f"run again on hidden states stage {spec.index - 1} already changed. Move "
                    f"the change into the embedding module (or the block before), or the "
                    f"residual into the block; or run with pp=1")
        if args:
            return (received, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": received}

    def fed_forward(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else kwargs.get("inputs_embeds")
        if not isinstance(first, torch.Tensor):
            return forward(*args, **kwargs)
        occupant = _container(stage, path).get_submodule(key)
        handle = occupant.register_forward_pre_hook(feed, prepend=True, with_kwargs=True)
        fed.received = first
        if fed.whole is not None:
            stand_in = fed.whole(first)
            if args:
                args = (stand_in, *args[1:])
            else:
                kwargs = {**kwargs, "inputs_embeds": stand_in}
        try:
            return forward(*args, **kwargs)
        finally:
            fed.received = None
            handle.remove()

    stage.forward = fed_forward


def _explain_after_blocks(stage: nn.Module, model_name: str, spec: StageSpec,
                          handed_on: HandedOn, blocks: list[str], hint: str = "") -> None:
    """An error raised by the forward's code after its last block gets a note: on a pipeline
    stage the blocks other stages hold are stand-ins that compute nothing, so an output that
    forward gathers from every block (a mixture-of-experts balance loss each block keeps or
    returns) cannot be computed there, and the error it raises (``None`` added to a tensor, a
    stand-in's attribute) does not say so."""
    forward = stage.forward

    def explained(*args: Any, **kwargs: Any) -> Any:
        handed_on.last = None
        try:
            return forward(*args, **kwargs)
        except Exception as exc:
            if handed_on.last is not None and hasattr(exc, "add_note"):
                own = blocks[spec.start:spec.end]
                others = [b for b in blocks if b not in own]
                exc.add_note(
                    f"plait: {model_name}'s forward failed after its last block, on pipeline "
                    f"stage {spec.index}, which holds {_span(own)}; {_span(others)} are held by "
                    f"other stages and stand in here without computing anything, so what they "
                    f"leave or return is missing. An output gathered from every block (such as "
                    f"a mixture-of-experts balance loss) cannot be computed on one stage under "
                    f"a pipeline: run with pp=1 (zero=3 or tp split the model instead), or "
                    f"leave that output out of the forward when pp > 1." + hint)
            raise

    stage.forward = explained


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def _explain_failures(stage: nn.Module, model_name: str, spec: StageSpec,
                      handed_on: HandedOn, hint: str = "") -> None:
    """An error raised by the forward of a stage after the first gets a note saying what that
    forward received: the user's forward runs there on hidden states, not on the model input,
    and a forward that reads its input beyond passing it to the first module (``if ids[0, 0]
    == bos``, a mask computed from the ids) fails with an error that does not say so."""
    forward = stage.forward

    def explained(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except Exception as exc:
            first = args[0] if args else None
            got = (f"a {tuple(first.shape)} {first.dtype} tensor"
                   if isinstance(first, torch.Tensor) else type(first).__name__)
            if handed_on.last is None and hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(
                    f"plait: pipeline stage {spec.index} runs {model_name}'s forward with the "
                    f"hidden states stage {spec.index - 1} sent ({got}) as its first argument, "
                    f"in place of the model input. A forward that reads that argument other "
                    f"than by passing it to its first module fails here: compute such values "
                    f"from the input outside the model and pass them by keyword (keywords "
                    f"reach every stage), or run with pp=1." + hint)
            raise

    stage.forward = explained


def _container(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def hand_on(hidden: Any, model_name: str, next_block: str, spec: StageSpec) -> torch.Tensor:
    """The tensor a stage without the last block sends to the next stage: the input of the
    stand-in of the first block after its own (:class:`HandedOn`), which the next stage feeds
    to that block. The forward ends there, so whatever it does after that (later blocks, a
    final norm and head; pooling, flattening, slicing a token; extra outputs) is not computed
    on this stage: later stages do it on the real hidden states. A view is copied: torch's
    split backward frees stage outputs with ``detach_()``, which views refuse. A strided
    tensor (a block whose residual reads a transposed input) is made dense: torch allocates
    the receive buffer for its gradient with the same strides, and gloo refuses a
    non-contiguous buffer ("input tensor has to be contiguous")."""
    if not isinstance(hidden, torch.Tensor):
        raise StageOutputError(
            f"{model_name}'s forward did not call its block {next_block} on pipeline "
            f"stage {spec.index} (stochastic depth, a loop over part of the blocks, or blocks "
            f"that are alternatives rather than steps, such as experts that routing skips), so "
            f"plait cannot tell what to send to stage {spec.index + 1}: call every block on "
            f"every step, name the container of the model's layers with options.pp_blocks, "
            f"or run with pp=1")
    if not hidden.is_contiguous():
        return hidden.contiguous()  # a dense copy, not a view
    return hidden.clone() if is_view(hidden) else hidden


def shared_parameters(model: nn.Module, path: str, specs: list[StageSpec]
                      ) -> list[dict[int, str]]:
    """Parameters that several stages hold (tied weights: an input embedding that is also the
    output head), each as {stage index: the parameter's name in that stage}."""
    owners: dict[int, dict[int, str]] = {}
    for spec in specs:
        stage = build_stage_module(model, path, spec)
        for name, p in stage.named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), {}).setdefault(spec.index, name)
    return [names for names in owners.values() if len(names) > 1]
