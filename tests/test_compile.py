"""torch.compile with plait: a model compiled on one device (``torch.compile(model)`` before
``run.parallelize``, or ``compile`` in the plan) trains what the eager one-device loop trains,
its blocks compiled after the layout; a torch.compile of the laid-out model is refused with the
fix.

The models are the masked LM of the semantics tests (rows counting 1 to 8 labels) and, for
tensor parallelism, plait's reference transformer, whose vocabulary-parallel embedding runs
eager before the first compiled block and gets its gradient back through it. Tolerance:
1e-5 relative per step and on the final parameters (inductor's kernels round differently
from eager's; a wrong gradient is orders of magnitude more, see tests/test_semantics.py).
"""

from __future__ import annotations

import pytest

from plait.plan import Plan
from plait.spawn import run_distributed
from tests import _workers_compile as C
from tests import _workers_semantics as W

REL = 1e-5


@pytest.fixture(scope="module")
def data():
    batches = [W.mlm_batch(s) for s in range(W.STEPS)]
    return batches, W.reference(W.masked_lm, batches, W.mlm_loss)


def _assert_matches(ref: dict, got: dict) -> None:
    assert got["losses"] == pytest.approx(ref["losses"], rel=REL), got["plan"]
    for name, want in ref["state"].items():
        diff = (got["state"][name] - want).abs().max().item()
        assert diff <= REL * max(want.abs().max().item(), 1e-2), (got["plan"], name, diff)


def test_a_compiled_model_trains_the_one_device_model_under_dp(data):
    batches, ref = data
    got = run_distributed(C.train_compiled, 2, "dp=2", C.compiled_masked_lm, batches,
                          timeout=300)[0]
    assert got["plan"] == "dp_replicate=2,compile=true"
    assert got["graphs"] >= 1  # the blocks did run compiled
    _assert_matches(ref, got)
    assert "torch.compile(...) of the model run.parallelize returned" in got["refused"]


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["dp_shard=2,zero=3,compile", "pp=2,compile",
                                  "dp=2,ac=full,compile"])
def test_compile_in_the_plan_trains_the_one_device_model(data, plan):
    batches, ref = data
    got = run_distributed(C.train_compiled, 2, plan, W.masked_lm, batches, timeout=400)[0]
    assert got["graphs"] >= 1
    _assert_matches(ref, got)


def test_the_pipeline_split_check_runs_on_a_copy_of_the_eager_blocks():
    """At the first step the pipeline runs a meta-device copy of the model to find the
    residuals of a forward torch.fx cannot trace (a later stage's stand-in for an earlier block
    must then add zero, not pass the hidden states on). Under compile the copy's blocks are
    eager: were they the laid-out blocks' compiled forwards (bound to the real blocks), the
    copy would run real blocks on meta tensors, fail (no residual found: the stand-ins pass on
    what they get) and leave torch.compile a failed frame at the whole batch's shape, after
    which the microbatches compile with a dynamic batch size."""
    batch = W.mlm_batch(0)
    got = run_distributed(C.first_step_check, 2, "pp=2,compile", C.untraced_residual_lm,
                          batch, timeout=120)
    for rank in got:
        assert rank["found"] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "pos"]
        assert rank["frames"] == (0, 0)  # nothing compiled before the first real microbatch


@pytest.mark.slow
@pytest.mark.parametrize(("plan", "factory"), [
    ("pp=2,microbatches=4,compile", W.masked_lm),
    ("pp=2,microbatches=4,compile", C.untraced_residual_lm),
    ("pp=2,microbatches=4,ac=full,compile", W.masked_lm),  # the compiled forward run again
])
def test_each_pipeline_stage_compiles_its_block_once(data, plan, factory):
    """Every stage compiles its block before torch's schedule starts the shape inference that
    runs through the sends (so the stages compile at once, not one after another), and every
    microbatch then runs that graph: one frame asked, one compiled, one graph on each rank (a
    recompile, e.g. for a dynamic batch size or another grad mode, or a frame that failed
    would ask for more)."""
    batches, _ = data
    ref = W.reference(factory, batches, W.mlm_loss)
    got = run_distributed(C.train_pipeline_compiled, 2, plan, factory, batches, timeout=400)
    for rank in got:
        assert rank["at_inference"] == (1, 1), rank
        assert (rank["graphs"], rank["frames"]) == (1, (1, 1)), rank
    got[0]["plan"] = plan
    _assert_matches(ref, got[0])


@pytest.mark.slow
def test_the_stages_compile_ahead_under_autocast(data):
    """Under bf16 autocast the stages compile ahead in the autocast the schedule runs in: the
    microbatches reuse the graph (a graph built outside it would be recompiled), and the losses
    are the fp32 one-device losses within bf16's rounding."""
    batches, ref = data
    got = run_distributed(C.train_pipeline_compiled, 2, "pp=2,microbatches=4,mp=bf16,compile",
                          W.masked_lm, batches, timeout=400)
    for rank in got:
        assert rank["at_inference"] == (1, 1), rank
        assert (rank["graphs"], rank["frames"]) == (1, (1, 1)), rank
    assert got[0]["losses"] == pytest.approx(ref["losses"], rel=2e-2)


@pytest.mark.slow
def test_compiling_the_stages_ahead_leaves_batchnorm_and_buffers_as_one_device_has_them():
    """Blocks with a BatchNorm and a buffer counting their calls, both written in the compiled
    forward: the stages' compile run before the first step writes neither, so the running
    statistics and counts after 2 steps are one device's (microbatch by microbatch, eager),
    and so are the losses and parameters."""
    batches = [W.mlm_batch(s) for s in range(2)]
    ref = C.microbatched_reference(C.batchnorm_block_lm, batches, 4)
    got = run_distributed(C.train_pipeline_compiled, 2, "pp=2,microbatches=4,compile",
                          C.batchnorm_block_lm, batches, timeout=400)
    for rank in got:
        assert rank["at_inference"] == (1, 1), rank
        assert (rank["graphs"], rank["frames"]) == (1, (1, 1)), rank
    got[0]["plan"] = "pp=2,microbatches=4,compile"
    assert ref["state"]["blocks.0.calls"] == 2 * 4
    _assert_matches(ref, got[0])


def test_a_stage_run_ahead_of_the_schedule_leaves_the_model_and_the_rng_as_they_were():
    """What runs each stage once before the first step (for torch.compile to build its graphs
    on every rank at once): on one process and without compile, the parameters, their
    gradients, the buffers (BatchNorm's running statistics, a count) and the RNG (dropout)
    are as they were before, and the hidden states it made for a later stage have the shapes
    the schedule will hand over."""
    import torch

    from plait.parallel.pipeline import _buffers_kept
    from plait.parallel.pipeline_split import build_stage_module, plan_stages
    from plait.parallel.pipeline_warmup import first_microbatch, stage_input_finder, warm_stages

    model = C.BatchNormBlockLM(dropout=0.5)
    path, specs = plan_stages(model, Plan.load("pp=2,microbatches=4"))
    tokens, _ = W.mlm_batch(0)
    find = stage_input_finder(model, path, specs)
    assert find is not None
    first, kwargs = first_microbatch(tokens, {}, 2)
    metas = find(first, kwargs, True)
    assert [(m[0].shape, m[0].dtype, m[0].requires_grad) for m in metas] == [
        ((2, W.SEQ), torch.int64, False), ((2, W.SEQ, W.WIDTH), torch.float32, True)]
    stages = [(i, build_stage_module(model, path, s)) for i, s in enumerate(specs)]
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    for train in (True, False):
        warm_stages(stages, find(first, kwargs, train), first, kwargs, train=train,
                    device=torch.device("cpu"), buffers_kept=_buffers_kept)
        assert torch.equal(torch.get_rng_state(), rng)
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, grads[n]), n


@pytest.fixture(scope="module")
def lm_data():
    batches = [W.token_batch(s) for s in range(3)]
    return batches, W.reference(W.reference_lm, batches, W.mlm_loss)


@pytest.mark.slow  # compile under DDP runs in the default suite; here tp, for minutes on 2 cores
def test_compile_with_tensor_parallelism_trains_the_one_device_model(lm_data):
    """The blocks' input is the embedding's all-reduced output, an asynchronous collective's
    tensor; its gradient must reach the embedding (a compiled block would hand back none, and
    the embedding would stop training, were the collective not waited before the call)."""
    batches, ref = lm_data
    got = run_distributed(C.train_compiled, 2, "tp=2,compile", W.reference_lm, batches,
                          timeout=400)[0]
    assert got["graphs"] >= 1
    _assert_matches(ref, got)


@pytest.mark.slow
@pytest.mark.parametrize(("plan", "factory", "world"), [
    ("tp=2,sp=true,compile", W.reference_lm, 2),  # the embedding's output reduce-scattered
    ("tp=2", C.compiled_reference_lm, 2),  # torch.compile(model) handed to run.parallelize
    ("dp_shard=2,zero=3,tp=2,compile", W.reference_lm, 4),
])
def test_compile_with_tensor_parallelism_in_more_layouts(lm_data, plan, factory, world):
    batches, ref = lm_data
    got = run_distributed(C.train_compiled, world, plan, factory, batches, timeout=600)[0]
    assert got["plan"].endswith("compile=true")
    assert got["graphs"] >= 1
    _assert_matches(ref, got)


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["tp=2", "tp=2,sp=true"])
def test_blocks_compiled_by_hand_after_the_tensor_parallel_layout(lm_data, plan):
    """A user who compiles each block of the laid-out model: the row-parallel embedding's
    local output is a waited tensor, so its gradient comes back through the compiled block."""
    batches, ref = lm_data
    got = run_distributed(C.train_compiled, 2, plan, W.reference_lm, batches, True,
                          timeout=400)[0]
    assert got["graphs"] >= 1
    _assert_matches(ref, got)


def test_a_compiled_block_hands_back_the_gradient_of_an_async_collectives_tensor():
    """The mechanism of the tensor-parallel cases in one process: a block's input that is an
    ``AsyncCollectiveTensor`` (what an eager layer's asynchronous redistribute hands on, the
    autograd edge on the wrapper, none on its inner tensor) gets its gradient back through the
    compiled block. torch 2.13 alone traces it as needing none (the backward fails here, the
    gradient is lost inside a model). AOTAutograd is where it happens, so its eager backend
    shows it without inductor's compile time."""
    import torch

    from plait._torch_compat import async_collective_tensor
    from plait.parallel.compile import _wait_collectives

    AsyncCollectiveTensor = async_collective_tensor()

    class AsyncOut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return AsyncCollectiveTensor(x.clone())

        @staticmethod
        def backward(ctx, grad):
            return grad

    torch.manual_seed(0)
    block = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    block(x).pow(2).sum().backward()
    want, x.grad = x.grad, None
    block.forward = _wait_collectives(torch.compile(block.forward, backend="aot_eager"))
    block(AsyncOut.apply(x)).pow(2).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, want)


def test_compile_is_parsed():
    assert Plan.load("dp=2,compile").compile is True
    assert Plan.load("dp=2,compile=false").compile is False
    assert "compiled" in Plan.load("dp=2,compile").describe()
    assert Plan.load("tp=2,sp=true,compile").compile is True
