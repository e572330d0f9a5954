"""Published training throughput the planner is checked against (not fitted per row).

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), Table 1: GPT models, seq 2048, vocab 51,200, DGX A100 (80 GB) nodes of 8,
NVLink + 8 x 200 Gb/s HDR InfiniBand, mixed precision, full activation recomputation, the
interleaved schedule and the scatter/gather optimisation. TFLOP/s per GPU counted with
``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` per step.

What the table does not print and plait assumes (stated in docs/planner.md): microbatch size 1,
v = the smallest divisor > 1 of the blocks per stage (2 where it divides), gradients all-reduced
in 16-bit, no overlap of that all-reduce in their system is *not* assumed (plait's model applies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SEQ = 2048
VOCAB = 51200


@dataclass(frozen=True)
class MegatronRow:
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float  # achieved per GPU, their formula

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def name(self) -> str:
        return f"GPT {self.params_b}B, {self.gpus} A100"

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """The published speed as tokens per second per GPU (their TFLOP/s, their FLOP count)."""
        flops = megatron_flops(self.batch, SEQ, self.layers, self.hidden, VOCAB)
        return self.batch * SEQ * self.tflops * 1e12 / flops


NARAYANAN_2021 = (
    MegatronRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    MegatronRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    MegatronRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    MegatronRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    MegatronRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    MegatronRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    MegatronRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    MegatronRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    MegatronRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    MegatronRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs per step as Narayanan et al. 2021 count them (with full recomputation)."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden)
                                                      + vocab / (16 * layers * hidden))


def row_setup(row: MegatronRow):
    """(ModelStats, Cluster, Workload, Plan) for a table row, at the paper's layout."""
    from plait.models.transformer import TransformerConfig
    from plait.partition import even_split
    from plait.plan import Plan

    from .cost import Workload
    from .hardware import load_cluster
    from .model_stats import from_transformer_config

    cfg = TransformerConfig(vocab_size=VOCAB, dim=row.hidden, n_layers=row.layers,
                            n_heads=row.heads, max_seq_len=SEQ, mlp="gelu", norm="layernorm")
    model = from_transformer_config(cfg, name=f"gpt-{row.params_b}b")
    cluster = load_cluster("dgx-a100-80gb", devices=row.gpus)
    work = Workload(row.batch, SEQ, grad_reduce_dtype="bf16", pp_scatter_gather=True)
    per_rank = row.batch // row.dp
    fields = dict(tp=row.tp, pp=row.pp, dp_replicate=row.dp, mixed_precision="bf16",
                  activation_checkpointing="full")
    if row.pp > 1:
        per_stage = row.layers // row.pp
        v = next((d for d in range(2, per_stage + 1) if per_stage % d == 0), 1)
        # Megatron-LM splits the blocks evenly over the model chunks
        fields.update(microbatches=per_rank,
                      pp_schedule="interleaved_1f1b" if v > 1 else "1f1b", virtual_stages=v,
                      options={"pp_stage_layers": even_split(row.layers, row.pp * v)})
    else:
        fields.update(grad_accum=per_rank)  # microbatch size 1
    return model, cluster, work, Plan(**fields)


# ------------------------------------------------------------------------------------------
# Published runs beyond Megatron's table, priced at their published layout. ``fitted``: a
# figure a constant was fitted on (the chip's compute efficiency); every other one is held out
# (nothing was tuned to it). Throughput is tokens per second per GPU, as the source prints it.
TORCHTITAN = ("torchtitan docs/performance.md (PyTorch, FSDP2 eager, bf16 with fp32 gradient "
              "reduction, seq 8192)")


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    model: str                # a preset name, or "llama-405b" (built here)
    cluster: str
    devices: int
    memory_gb: float          # the GPUs' memory in the published system
    global_batch: int
    seq: int
    layout: str               # a Plan string
    tokens_per_s_per_gpu: float
    fitted: bool = False


PUBLISHED_RUNS = (
    PublishedRun("Llama 3 8B, 64 A100, FSDP", TORCHTITAN + ", Llama 3 table: 64 A100 80GB",
                 "llama-8b", "dgx-a100-80gb", 64, 80, 64, 8192,
                 "dp_shard=64,zero=3,ac=selective,mp=bf16", 2904),
    PublishedRun("Llama 3 70B, 64 A100, FSDP", TORCHTITAN + ", Llama 3 table: 64 A100 80GB",
                 "llama-70b", "dgx-a100-80gb", 64, 80, 64, 8192,
                 "dp_shard=64,zero=3,ac=full,mp=bf16", 331),
    PublishedRun("Llama 3.1 8B, 8 H100, FSDP", TORCHTITAN + ", table 1: 8 H100 96GB, 500 W",
                 "llama-8b", "dgx-h100", 8, 96, 16, 8192,
                 "dp_shard=8,zero=3,ac=selective,mp=bf16", 5762, fitted=True),
    PublishedRun("Llama 3.1 405B, 128 H100, FSDP x TP", TORCHTITAN +
                 ", Llama 3.1 405B table: 128 H100 94GB, TP 8",
                 "llama-405b", "dgx-h100", 128, 94, 32, 8192,
                 "dp_shard=16,tp=8,sp=true,zero=3,ac=full,mp=bf16", 109),
)


def run_setup(run: PublishedRun):
    """(ModelStats, Cluster, Workload, Plan) of a published run, at its published layout."""
    from plait.models.transformer import TransformerConfig
    from plait.plan import Plan

    from .cost import Workload
    from .hardware import load_cluster
    from .model_stats import from_transformer_config, load_model

    if run.model == "llama-405b":
        model = from_transformer_config(TransformerConfig(
            vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
            ffn_dim=53248, max_seq_len=8192, mlp="swiglu", norm="rmsnorm"), name=run.model)
    else:
        model = load_model(run.model)
    cluster = load_cluster(run.cluster, devices=run.devices).with_memory(run.memory_gb * 1e9)
    return model, cluster, Workload(run.global_batch, run.seq), Plan.from_string(run.layout)


# ------------------------------------------------------------------------------------------
# The planner's pick for a published model, cluster and batch may be predicted faster than the
# publication only where a published run achieved that speed: the same model, cluster and
# batch at ``tokens_per_s_per_gpu``, or the same chip at a hardware FLOP utilization (FLOPs
# executed, recomputation included, over the datasheet peak) ``hfu`` at least the pick's.
@dataclass(frozen=True)
class AchievedRun:
    name: str
    source: str
    cluster: str              # the preset of its chip
    hfu: float | None = None
    tokens_per_s_per_gpu: float | None = None


LLAMA2_13B_NO_AC = AchievedRun(
    "Llama 2 13B, 64 A100, FSDP2, no recomputation",
    "torchtitan docs/performance.md, Llama 2 table: 64 A100 80GB, local batch 2 x 4096, "
    "2,162 tokens/s per GPU, MFU 61.1% (= HFU: nothing recomputed)", "dgx-a100-80gb", hfu=0.611)
GPT3_175B = AchievedRun(
    "GPT-3 175B, 64 A100, TP 8 x PP 8, SP + selective recomputation",
    "Korthikanti et al. 2022, table 5: HFU 52.8%", "dgx-a100-80gb", hfu=0.528)
MTNLG_530B = AchievedRun(
    "GPT 530B, 280 A100, TP 8 x PP 35, SP + selective recomputation",
    "Korthikanti et al. 2022, table 5: HFU 57.0% (MFU 54.2% with 8-way data parallelism on "
    "2,240 GPUs)", "dgx-a100-80gb", hfu=0.570)
GPT_1T = AchievedRun(
    "GPT 1T, 512 A100, TP 8 x PP 64, SP + selective recomputation",
    "Korthikanti et al. 2022, table 5: HFU 57.0%", "dgx-a100-80gb", hfu=0.570)
LLAMA31_8B_COMPILE = AchievedRun(
    "Llama 3.1 8B, 8 H100, FSDP2 + torch.compile",
    "torchtitan docs/performance.md, table 1: same model, GPUs and batch, 6,667 tokens/s per GPU",
    "dgx-h100", tokens_per_s_per_gpu=6667)

PICK_ACHIEVED_BY = {
    "GPT 1.7B, 32 A100": LLAMA2_13B_NO_AC,
    "GPT 3.6B, 64 A100": LLAMA2_13B_NO_AC,
    "GPT 7.5B, 128 A100": LLAMA2_13B_NO_AC,
    "GPT 18.4B, 256 A100": LLAMA2_13B_NO_AC,
    "GPT 39.1B, 512 A100": LLAMA2_13B_NO_AC,
    "GPT 76.1B, 1024 A100": LLAMA2_13B_NO_AC,
    "GPT 145.6B, 1536 A100": GPT3_175B,
    "GPT 310.1B, 1920 A100": GPT3_175B,
    "GPT 529.6B, 2520 A100": MTNLG_530B,
    "GPT 1008.0B, 3072 A100": GPT_1T,
    "Llama 3 8B, 64 A100, FSDP": LLAMA2_13B_NO_AC,
    "Llama 3.1 8B, 8 H100, FSDP": LLAMA31_8B_COMPILE,
}


@dataclass(frozen=True)
class PublishedCase:
    """One published model, cluster and batch, ready to price."""

    name: str
    cluster_preset: str
    devices: int
    tokens_per_s_per_gpu: float
    setup: Any                # (ModelStats, Cluster, Workload, Plan)


def published_cases() -> list[PublishedCase]:
    """Megatron's table rows and the published runs, each at its published layout."""
    cases = [PublishedCase(r.name, "dgx-a100-80gb", r.gpus, r.tokens_per_s_per_gpu,
                           row_setup(r)) for r in NARAYANAN_2021]
    cases += [PublishedCase(r.name, r.cluster, r.devices, r.tokens_per_s_per_gpu, run_setup(r))
              for r in PUBLISHED_RUNS]
    return cases


@dataclass
class PickCheck:
    """The planner's pick for a published case beside the publication."""

    case: PublishedCase
    pick: Any                 # Estimate (None: nothing fits)
    tokens_per_s_per_gpu: float
    hfu: float                # predicted: hardware FLOPs per second over the datasheet peak
    achieved: AchievedRun | None
    # the publication's HFU: its speed x the FLOPs per token its layout executes (recomputation
    # included, plait's count) over the datasheet peak
    published_hfu: float

    @property
    def work_ratio(self) -> float:
        """How much of the pick's speed-up is work it skips (recomputation): the published
        layout's FLOPs per token over the pick's. speed-up = work_ratio x hfu/published_hfu."""
        return self.tokens_per_s_per_gpu / self.case.tokens_per_s_per_gpu / (
            self.hfu / self.published_hfu) if self.hfu else 0.0

    @property
    def faster(self) -> bool:
        return self.tokens_per_s_per_gpu > self.case.tokens_per_s_per_gpu

    def problem(self) -> str:
        """Why the rule does not hold ("" when it does): a pick faster than the publication
        needs a named run that achieved its speed."""
        if not self.faster:
            return ""
        run = self.achieved
        if run is None:
            return (f"{self.case.name}: pick {self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU "
                    f"> published {self.case.tokens_per_s_per_gpu:,.0f}, no published run named")
        if run.cluster != self.case.cluster_preset:
            return (f"{self.case.name}: {run.name} ran on {run.cluster}, not "
                    f"{self.case.cluster_preset}")
        if run.tokens_per_s_per_gpu is not None and \
                self.tokens_per_s_per_gpu > run.tokens_per_s_per_gpu:
            return (f"{self.case.name}: pick {self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU "
                    f"> {run.name}'s {run.tokens_per_s_per_gpu:,.0f}")
        if run.hfu is not None and self.hfu > run.hfu:
            return f"{self.case.name}: pick's HFU {self.hfu:.1%} > {run.name}'s {run.hfu:.1%}"
        return ""


def check_pick(case: PublishedCase) -> PickCheck:
    """Search the case's model, cluster and batch with the cluster's constants."""
    from . import constants_for
    from .cost import evaluate
    from .search import search

    model, cluster, work, plan = case.setup
    k = constants_for(cluster)
    pick = search(model, cluster, work, top=1, constants=k).best
    tps = pick.tokens_per_s / case.devices if pick else 0.0
    hfu = pick.tflops_per_device_hw * 1e12 / cluster.peak(pick.plan.mixed_precision) \
        if pick else 0.0
    paper = evaluate(plan, model, cluster, work, k)
    flops_per_token = paper.tflops_per_device_hw * 1e12 * case.devices / paper.tokens_per_s
    published_hfu = case.tokens_per_s_per_gpu * flops_per_token / cluster.peak(
        plan.mixed_precision)
    return PickCheck(case, pick, tps, hfu, PICK_ACHIEVED_BY.get(case.name), published_hfu)
