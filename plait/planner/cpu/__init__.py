"""What the cost model needs only where processes share CPU cores (plait's CPU + gloo runs).

On GPUs and TPUs every device computes on its own and collectives run beside compute; on a CPU
machine each plait process is one device, several of them share the cores, and a collective
takes a core from compute. Everything specific to that lives here, so the accelerator model in
:mod:`plait.planner.cost` reads without it:

* :mod:`.overheads`: every constant ``--calibrate`` measures on a CPU machine (host-side
  seconds per event, gloo's per-op byte factors and per-call costs) and what a CPU profile
  states beside them (``CPU_PROFILE``: no overlap, link efficiency 1): their one home, neutral
  on accelerators;
* :mod:`.sharing`: pipeline stages idle in their bubble hand their core to busy ones (a
  schedule simulation with shared cores);
* :mod:`.probes`: ``plait plan --calibrate`` on a CPU machine: times matmuls, a block, the
  collectives and the per-tensor / per-unit costs of a real step on real processes;
* :mod:`.derive`: the pure arithmetic turning those timings into cost-model constants;
* :mod:`.measured`: stored measurements of whole layouts repriced with the current cost model
  (predicted vs measured, rank correlation, where the planner's pick lands).
"""
