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
        fields.update(microbatches=per_rank,
                      pp_schedule="interleaved_1f1b" if v > 1 else "1f1b", virtual_stages=v)
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
