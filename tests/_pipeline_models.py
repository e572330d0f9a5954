"""Models and batches for the pipeline tests (module level: spawned workers import them)."""

import torch
import torch.nn as nn

from plait.models.transformer import build, preset


def transformer8():
    """The reference "test" transformer with 8 blocks (pp=4 x 2 virtual stages needs 8)."""
    return build(preset("test", n_layers=8), seed=0)


def deep_mlp():
    """A plain Sequential MLP: 8 Linear+Tanh blocks between an input and an output layer."""
    torch.manual_seed(0)
    layers = [nn.Linear(12, 32)]
    for _ in range(8):
        layers += [nn.Sequential(nn.Linear(32, 32), nn.Tanh())]
    layers.append(nn.Linear(32, 3))
    return nn.Sequential(*layers)


def mlp_batch(step, seed):
    g = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randn(16, 12, generator=g), torch.randn(16, 3, generator=g)


def timeline_worker(rank, world_size, schedule, v, m):
    """Run one recorded pipeline step of the deep MLP; return all events and a PNG path."""
    import tempfile

    from plait.parallel.layout import layout_of, local_modules
    from plait.parallel.timeline import plot
    from plait.plan import Plan
    from plait.runtime import init

    plan = Plan(pp=world_size, pp_schedule=schedule, virtual_stages=v, microbatches=m)
    run = init(plan, quiet=True)
    model = run.parallelize(deep_mlp())
    pipe = layout_of(model).pipeline
    x, y = mlp_batch(0, 0)
    with pipe.timeline.record():
        loss = pipe.step((x, y), torch.nn.functional.mse_loss, plan=plan, device=run.device)
    events = pipe.timeline.gather()
    png = None
    if rank == 0:
        png = plot(events, tempfile.mkstemp(suffix=".png")[1])
    names = sorted(n for s in local_modules(model) for n, _ in s.named_parameters())
    run.close()
    return {"events": events, "png": png, "loss": float(loss[0] / loss[1]), "names": names}


class LogitsOf(nn.Module):
    """A Hugging Face causal LM whose forward returns the logits tensor (the check harness's
    loss, and a pipeline's last stage, take a tensor); the pipeline finds ``hf.model.layers``."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, x):
        return self.hf(x).logits


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LogitsOf(LlamaForCausalLM(cfg))


def hf_gpt2(tie=True):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=256, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return LogitsOf(GPT2LMHeadModel(cfg))


def hf_gpt2_untied():
    return hf_gpt2(tie=False)
