"""The ``Layout`` record: what ``parallelize`` did to a model, in the order it did it.

The train step, ``plait.check`` and the memory tracker read this record instead of inspecting the
model, so a wrong record silently changes what they do; each plan's record is checked here on
real processes.
"""

from __future__ import annotations

import torch.nn as nn

from plait.mesh import build_mesh
from plait.models.transformer import build
from plait.parallel.layout import Layout, layout_of, local_modules, record_layout
from plait.parallelize import parallelize
from plait.plan import Plan
from plait.spawn import run_distributed

PLANS = {
    "dp=2": ("ddp",),
    "zero=3,dp_shard=2": ("zero",),
    "tp=2,ac=full": ("tensor_parallel", "activation_checkpointing"),
    "pp=2,mb=2": ("pipeline",),
}


def _layouts(rank: int, world_size: int) -> dict[str, tuple]:
    import torch

    out = {}
    for text in PLANS:
        plan = Plan.from_string(text)
        model = build("test", seed=0)
        laid = parallelize(model, build_mesh(plan, "cpu", world_size), plan,
                           device=torch.device("cpu"))
        layout = layout_of(laid)
        names = sorted({n for m in local_modules(laid) for n, _ in m.named_parameters()})
        out[text] = (layout.applied, len(layout.stages), layout.pipeline is not None,
                     layout.loss_parallel, names[:1], len(names))
    return out


def test_layout_records_what_ran_in_order():
    results = run_distributed(_layouts, 2, timeout=180)
    for rank, got in enumerate(results):
        for text, applied in PLANS.items():
            rec_applied, n_stages, has_runner, _, _, n_names = got[text]
            assert rec_applied == applied, (rank, text, rec_applied)
            assert (n_stages > 0) == has_runner == (text.startswith("pp")), (rank, text)
            assert n_names > 0
    # the two pipeline ranks hold different blocks; together they hold the whole model
    full = {n for n, _ in build("test", seed=0).named_parameters()}
    assert results[0]["pp=2,mb=2"][5] + results[1]["pp=2,mb=2"][5] >= len(full)


def _mesh_slices(rank: int, world_size: int) -> tuple[bool, bool, bool, list[int]]:
    import torch.distributed as dist

    mesh = build_mesh(Plan.from_string("pp=2"), "cpu", world_size)
    pp = mesh["pp"]
    return (mesh["pp"] is pp, mesh["dp_shard", "tp"] is mesh["dp_shard", "tp"],
            mesh["dp"] is mesh["dp"], [pp.size(), pp.get_local_rank(),
                                       len(dist.get_process_group_ranks(pp.get_group()))])


def test_mesh_slices_are_built_once():
    """The train step asks for mesh["pp"] every step: the same slice each time, not a new
    DeviceMesh (whose construction costs about a millisecond), with the same ranks."""
    for rank, (pp, pair, dp, shape) in enumerate(run_distributed(_mesh_slices, 2, timeout=120)):
        assert pp and pair and dp, rank
        assert shape == [2, rank, 2]


def test_layout_of_untouched_model_is_empty_and_record_replaces():
    model = nn.Linear(2, 2)
    assert layout_of(model) == Layout()
    assert local_modules(model) == [model]
    record_layout(model, Layout(applied=("ddp",)))
    record_layout(model, Layout(applied=("zero",)))
    assert layout_of(model).applied == ("zero",)
    # the record is not a submodule or parameter: state_dict and parameters are unchanged
    assert list(model.state_dict()) == ["weight", "bias"]


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


def test_a_tie_survives_a_device_whose_tensors_cannot_swap_storage():
    """``Module.to`` gives each module a new Parameter where the CPU tensor and the device's
    cannot share an implementation (XLA, meta, PrivateUse1 devices such as TorchTPU's): a tied
    head would train as a second weight. parallelize puts the tie back (meta stands in here)."""
    import torch

    model = parallelize(_TiedLM(), None, Plan(), device=torch.device("meta"))
    assert model.head.weight is model.embed.weight
    assert len(list(model.parameters())) == 1
