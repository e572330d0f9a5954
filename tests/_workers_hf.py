"""A Hugging Face user's fine-tuning loop, under plait and on one device (spawned processes
import this module; tests/test_hf_finetune.py compares the two).

The data is what a tokenizer and a collate function give: token sequences of different lengths,
padded on the right or the left to the longest row of the batch (or to a fixed length, which a
pipeline and sequence parallelism need), an ``attention_mask``, and ``labels`` that are -100 on
the padding and on each row's prompt (a masked-LM variant labels every third answer token and
replaces it by the mask token). The models are built from tiny configs (no download). The loop
is the one the docs give: ``run.loader(dataset, batch_size, collate_fn=...)``,
``run.step(model, batch, loss_fn, opt, scheduler)`` with the model's own loss
(``loss_fn=None``) or a loss on its outputs, ``run.evaluate`` on held-out data after every
step, ``run.full_state_dict`` at the end.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, BATCH, STEPS, LR = 64, 8, 2, 0.1
PAD, MASK = 0, 1  # token ids the data never draws otherwise


def dataset(n: int = 32, seed: int = 0, longest: int = 12) -> list[dict[str, Any]]:
    """Token sequences of 4..``longest`` tokens, each with a prompt of 1..len-2 tokens."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        length = int(torch.randint(4, longest + 1, (1,), generator=g))
        prompt = int(torch.randint(1, length - 1, (1,), generator=g))
        items.append({"ids": torch.randint(2, VOCAB, (length,), generator=g), "prompt": prompt})
    return items


def collate(items: list[dict[str, Any]], side: str = "right", fixed: int | None = None,
            mlm: bool = False, positions: bool = False, classes: int = 0
            ) -> dict[str, torch.Tensor]:
    """Pad to the longest row (or ``fixed``) on ``side``; labels -100 on the padding and the
    prompt (causal LM), or on every token but every third answer token (masked LM, whose
    input has the mask token there), or one class per row (``classes`` > 0: the sum of its
    tokens modulo ``classes``). ``positions``: ``position_ids`` counted from each row's
    first token (what makes left padding of any length give the same positions)."""
    n = fixed or max(len(it["ids"]) for it in items)
    ids = torch.full((len(items), n), PAD, dtype=torch.long)
    mask = torch.zeros(len(items), n, dtype=torch.long)
    labels = torch.full((len(items), n), -100, dtype=torch.long)
    for r, it in enumerate(items):
        length = len(it["ids"])
        cols = slice(0, length) if side == "right" else slice(n - length, n)
        tokens, lab = it["ids"].clone(), it["ids"].clone()
        if mlm:
            picked = torch.zeros(length, dtype=torch.bool)
            picked[it["prompt"]::3] = True
            lab[~picked] = -100
            tokens[picked] = MASK
        else:
            lab[:it["prompt"]] = -100
        ids[r, cols], mask[r, cols], labels[r, cols] = tokens, 1, lab
    if classes:
        labels = torch.tensor([int(it["ids"].sum()) % classes for it in items])
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if positions:
        batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return batch


def llama(tie: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tie, pad_token_id=PAD, bos_token_id=2, eos_token_id=3))


def llama_tied() -> nn.Module:
    return llama(tie=True)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=PAD, bos_token_id=2, eos_token_id=3))


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=PAD))


def llama_classifier() -> nn.Module:
    """Llama with a 3-way sequence-classification head: it pools the logits at each row's last
    token that is not ``pad_token_id``, found in ``input_ids``."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    return LlamaForSequenceClassification(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, num_labels=3,
        pad_token_id=PAD, bos_token_id=2, eos_token_id=3))


def gemma3_classifier() -> nn.Module:
    """Gemma 3's image-and-text sequence classifier, text only: its forward hands the call on
    to transformers' shared classifier forward, which pools at each row's last token that is
    not the text config's ``pad_token_id`` (the outer config has none of its own)."""
    from transformers import (
        Gemma3Config,
        Gemma3ForSequenceClassification,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    torch.manual_seed(0)
    text = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
        sliding_window=4, pad_token_id=PAD, bos_token_id=2, eos_token_id=3)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, image_size=8, patch_size=4)
    return Gemma3ForSequenceClassification(Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, num_labels=3,
        image_token_id=VOCAB - 1, boi_token_id=VOCAB - 2, eoi_token_id=VOCAB - 3))


def qwen3_5_classifier() -> nn.Module:
    """Qwen 3.5's image-and-text sequence classifier (a linear-attention layer and a full
    attention layer), text only: like Gemma 3's, it pools through the shared forward by the
    text config's ``pad_token_id``."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForSequenceClassification,
        Qwen3_5TextConfig,
        Qwen3_5VisionConfig,
    )

    torch.manual_seed(0)
    text = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"],
        pad_token_id=PAD, bos_token_id=2, eos_token_id=3)
    vision = Qwen3_5VisionConfig(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                 patch_size=2, out_hidden_size=32, num_position_embeddings=16)
    return Qwen3_5ForSequenceClassification(Qwen3_5Config(
        text_config=text, vision_config=vision, num_labels=3))


def own_classifier() -> nn.Module:
    """A sequence classifier written for the test on a Llama base: its pooling helper reads the
    pad token from an attribute of its own, so neither its forward's source nor its config
    names ``pad_token_id`` beside ``input_ids``."""
    from transformers import LlamaConfig, LlamaModel, LlamaPreTrainedModel
    from transformers.modeling_outputs import SequenceClassifierOutput

    def last_real(tokens: torch.Tensor, pad: int) -> torch.Tensor:
        positions = torch.arange(tokens.shape[-1], device=tokens.device)
        return (positions * (tokens != pad)).argmax(-1)

    class OwnClassifier(LlamaPreTrainedModel):
        def __init__(self, config: LlamaConfig) -> None:
            super().__init__(config)
            self.model = LlamaModel(config)
            self.head = nn.Linear(config.hidden_size, 3)
            self.pad = PAD
            self.post_init()

        def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None,
                    labels=None, **kwargs):
            hidden = self.model(input_ids, attention_mask=attention_mask,
                                inputs_embeds=inputs_embeds, **kwargs).last_hidden_state
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            last = last_real(input_ids, self.pad) if input_ids is not None else -1
            logits = self.head(hidden[rows, last])
            loss = None if labels is None else F.cross_entropy(logits, labels)
            return SequenceClassifierOutput(loss=loss, logits=logits)

    torch.manual_seed(0)
    return OwnClassifier(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        bos_token_id=2, eos_token_id=3))


def llama_checkpointed(reentrant: bool = False) -> nn.Module:
    """Llama with transformers' gradient checkpointing turned on by the user before plait
    (and ``use_cache`` left on in its config)."""
    net = llama()
    net.config.use_cache = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the method's newer name is 5.x only
        net.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return net


MODELS = {"llama": llama, "llama_tied": llama_tied, "gpt2": gpt2, "bert": bert,
          "llama_classifier": llama_classifier, "llama_checkpointed": llama_checkpointed,
          "gemma3_classifier": gemma3_classifier, "qwen3_5_classifier": qwen3_5_classifier,
          "own_classifier": own_classifier}


def shifted_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss written by hand on the model's outputs (a lambda in a user's loop)."""
    logits = out.logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           labels[:, 1:].reshape(-1))


LOSSES = {"own": None, "shifted": shifted_loss}


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Warm-up over two steps, then decay: every step has another learning rate."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2) * 0.8 ** s)


def _collate(kw: dict[str, Any]) -> Any:
    return partial(collate, side=kw.get("side", "right"), fixed=kw.get("fixed"),
                   mlm=kw.get("mlm", False), positions=kw.get("positions", False),
                   classes=kw.get("classes", 0))


def _loss(model: nn.Module, batch: dict[str, torch.Tensor], loss: str) -> torch.Tensor:
    if loss == "own":
        return model(**batch).loss
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return LOSSES[loss](model(**inputs), batch["labels"])


def reference(model: str, kw: dict[str, Any]) -> dict[str, Any]:
    """One device, no plait: the same global batches (the loader's draw for one replica),
    forward on the whole batch, torch's clipping at 1.0, SGD and the scheduler; the held-out
    loss in eval mode under no_grad after every step."""
    from plait.data.loader import DistributedLoader

    net = MODELS[model]()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    sched = schedule(opt)
    col, loss = _collate(kw), kw.get("loss", "own")
    held = next(iter(DistributedLoader(dataset(16, seed=1), BATCH, steps=1, collate_fn=col)))
    losses, evals = [], []
    for batch in DistributedLoader(dataset(), BATCH, steps=kw.get("steps", STEPS),
                                   collate_fn=col):
        value = _loss(net, batch, loss)
        value.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(value.detach()))
        net.eval()
        with torch.no_grad():
            evals.append(float(_loss(net, held, loss)))
        net.train()
    return {"losses": losses, "evals": evals, "model": net,
            "state": {k: v.detach().clone() for k, v in net.state_dict().items()}}


def finetune(rank: int, world_size: int, jobs: list[tuple[str, str, dict[str, Any]]]
             ) -> list[dict[str, Any]]:
    """Each (plan, model name, options) trained as the user's loop does under plait, in one
    process group; per job the step losses, the held-out losses, rank 0's full state and the
    warnings."""
    from plait.runtime import init

    out = []
    for plan, model, kw in jobs:
        col, loss_fn = _collate(kw), LOSSES[kw.get("loss", "own")]
        run = init(plan, quiet=True, log_every=1000, seed=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            net = run.parallelize(MODELS[model]())
            opt = torch.optim.SGD(net.parameters(), lr=LR)
            sched = schedule(opt)
            losses, evals = [], []
            for batch in run.loader(dataset(), BATCH, steps=kw.get("steps", STEPS),
                                    collate_fn=col):
                losses.append(float(run.step(net, batch, loss_fn, opt, sched)))
                held = run.loader(dataset(16, seed=1), BATCH, steps=1, evaluation=True,
                                  collate_fn=col)
                evals.append(float(run.evaluate(net, next(iter(held)), loss_fn)))
        state = run.full_state_dict(net)
        saved = str(run.save(kw["save"])) if "save" in kw else None
        generated = None
        if kw.get("generate"):  # the documented way: a one-device copy of the trained model
            single = MODELS[model]()
            single.load_state_dict(state)
            generated = generate(single)
        run.close()
        out.append({"plan": plan, "model": model, "losses": losses, "evals": evals,
                    "state": state if rank == 0 else None, "saved": saved,
                    "generated": generated, "warnings": [str(w.message) for w in caught]})
    return out


def generate(model: nn.Module) -> list[list[int]]:
    """Greedy continuation of two left-padded prompts of different lengths."""
    ids = torch.tensor([[PAD, PAD, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = (ids != PAD).long()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         pad_token_id=PAD)
    return out.tolist()
