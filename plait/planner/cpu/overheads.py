"""Host-side costs of a training step that the accelerator model does not see.

On GPUs and TPUs these are hidden: kernels launch asynchronously ahead of the device and fused
or foreach optimizers touch every tensor in a few launches, so every field is 0 on the GPU/TPU
presets. On a CPU, where each plait process is one device and runs its Python, autograd,
DTensor dispatch and FSDP2 hooks on the same core as its matmuls, they are a large share of a
step, and ``plait plan --calibrate`` measures each one (:mod:`plait.planner.cpu.probes`,
:func:`plait.planner.cpu.derive.derive_constants`). ``Constants`` inherits these fields.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a CPU machine's profile states beside the measured constants: every core computes, so no
# collective progresses in the background (no overlap), and the bandwidth it records is the
# achieved bus bandwidth already (link efficiency 1).
CPU_PROFILE = {"overlap": False, "link_efficiency": 1.0}


@dataclass(frozen=True)
class HostOverheads:
    """Seconds per event (and per-byte factors of gloo's collectives); every default neutral:
    0 seconds, factor 1 (accelerators)."""

    # Fixed time per block per microbatch (forward + backward): kernel launches and Python.
    block_overhead_s: float = 0.0
    # Per microbatch, outside the blocks: embedding lookup, final norm, loss, autograd's root
    # (the head's matmul FLOPs are counted separately). Charged on the last pipeline chunk.
    micro_overhead_s: float = 0.0
    # Per parameter tensor per optimizer step: gradient clipping + optimizer + zero_grad, for
    # plain tensors and for DTensors (FSDP2 / TP parameters: every op goes through DTensor's
    # dispatch, and the clip norm through a collective).
    tensor_step_s: float = 0.0
    dtensor_step_s: float = 0.0
    # FSDP2 per unit (a fully_shard-ed block or root) per micro-step beyond its collectives:
    # pre/post forward and backward hooks, copy-in/out of the flat buffers.
    fsdp_unit_s: float = 0.0
    # FSDP2 beyond the modelled collective, per unit: per gradient reduce (the post-backward
    # hook, the reduce-scatter's copy-in and the sharded gradient's write) and, under ZeRO-3,
    # per re-gather in backward (the copy-out into the unsharded parameters).
    fsdp_reduce_s: float = 0.0
    fsdp_regather_s: float = 0.0
    # Tensor parallelism beyond compute / tp and the modelled TP collectives: per block per
    # microbatch (DTensor dispatch and redistribution in the block), and per microbatch outside
    # the blocks (vocabulary-parallel embedding, loss_parallel).
    tp_block_overhead_s: float = 0.0
    tp_micro_overhead_s: float = 0.0
    # Zero-bubble schedules (ZB-V, interleaved ZB) split each backward into torch's
    # stage_backward_input and stage_backward_weight: a Python walk of the autograd graph per
    # call (``zb_call_s`` per chunk per microbatch) and a dearer backward (``zb_backward_factor``:
    # extra fraction of a block's backward FLOP time).
    zb_call_s: float = 0.0
    zb_backward_factor: float = 0.0
    # Per-byte cost of each collective relative to the ring ideal at the all-reduce's measured
    # bus bandwidth (1.0: the ring). gloo has no native reduce-scatter or all-gather into a
    # tensor and torch emulates them with an all-reduce / per-rank copies, about 2.0 per byte;
    # --calibrate measures each from the op itself.
    all_gather_factor: float = 1.0
    reduce_scatter_factor: float = 1.0
    broadcast_factor: float = 1.0
    # Time per call beyond ``latency x ring steps`` (launch, copies, gloo's own work). May be
    # negative down to minus the latency where calls overlap (ZeroRedundancyOptimizer's burst of
    # asynchronous broadcasts). 0 on the GPU presets: NCCL's per-call cost is in the latency.
    all_reduce_call_s: float = 0.0
    all_gather_call_s: float = 0.0
    reduce_scatter_call_s: float = 0.0
    broadcast_call_s: float = 0.0
