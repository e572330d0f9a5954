"""Models and batches for the pipeline tests (module level: spawned workers import them)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

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
    run = init(plan, quiet=True, seed=0)
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


# ---------------------------------------------------------------- models people have (pp=2)
# Dict batches in the Hugging Face convention, keyword inputs every stage needs, extra
# outputs, pre-block modules that are more than a token embedding. Each is compared with
# ``reference_loop`` (a plain one-process loop) by tests/test_pipeline_models.py.
SEQ, VOCAB, WIDTH, ROWS, STEPS, LR = 8, 32, 16, 8, 3, 0.1


class MixBlock(nn.Module):
    """A residual MLP plus the mean of the *unmasked* positions (so the mask changes the
    result on every block, and a stage that did not get the mask would train differently)."""

    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(),
                                 nn.Linear(2 * width, width))
        self.mix = nn.Linear(width, width)

    def forward(self, h, attention_mask=None):
        m = torch.ones(h.shape[:2]) if attention_mask is None else attention_mask.float()
        m = m.unsqueeze(-1)
        pooled = (h * m).sum(1) / m.sum(1).clamp_min(1)
        return h + self.mlp(h) + self.mix(pooled).unsqueeze(1)


class MaskedMixer(nn.Module):
    """``forward(input_ids, attention_mask=None)`` -> ``(logits, aux)`` or a dict of both;
    ``aux`` is each token's mean squared final hidden state, which the loss adds."""

    def __init__(self, returns: str = "tuple"):
        super().__init__()
        self.returns = returns
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(MixBlock() for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        h = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            h = block(h, attention_mask)
        logits, aux = self.head(h), h.pow(2).mean(-1)
        return {"logits": logits, "aux": aux} if self.returns == "dict" else (logits, aux)


def mixer_tuple():
    torch.manual_seed(0)
    return MaskedMixer("tuple")


def mixer_dict():
    torch.manual_seed(0)
    return MaskedMixer("dict")


class ChangedOnTheWay(MaskedMixer):
    """A forward that changes the running activation outside its blocks, three ways a stage
    after the first would change again what it received: ``"module"``, a parameter-free module
    after the embedding (an activation); ``"scale"``, an operation in the forward (the
    embedding scaled by sqrt(width)); ``"between"``, an activation after each block in the
    forward's loop. ``"residual"``: the scale, and each block's output added in the forward (a
    residual outside the block), which a pipeline refuses."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.act = nn.Tanh()
        if how == "residual":  # blocks that return their branch only
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))
                for _ in range(4))

    def forward(self, input_ids, attention_mask=None):
        h = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        if self.how == "module":
            h = self.act(h)
        if self.how in ("scale", "residual"):
            h = h * WIDTH ** 0.5
        for block in self.blocks:
            if self.how == "residual":
                h = h + block(h)
            else:
                h = block(h, attention_mask)
            if self.how == "between":
                h = self.act(h)
        return self.head(h), h.pow(2).mean(-1)


def changed_on_the_way(how):
    torch.manual_seed(0)
    return ChangedOnTheWay(how)


def mixer_loss(out, labels):
    """(sum, count): cross-entropy of the counted tokens plus 0.1 x their ``aux``."""
    logits, aux = (out["logits"], out["aux"]) if isinstance(out, dict) else out
    counted = labels != -100
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                         reduction="sum")
    return ce + 0.1 * (aux * counted).sum(), counted.sum()


def padded_batch(step, vocab=VOCAB, token_types=False):
    """A dict batch: rows of 2..SEQ real tokens, left-padded (attention_mask 0, label -100);
    labels are the next token (already shifted), so the loss reads logits and labels as is."""
    g = torch.Generator().manual_seed(600 + step)
    ids = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=g)
    lengths = torch.randint(2, SEQ + 1, (ROWS,), generator=g)
    mask = (torch.arange(SEQ) >= SEQ - lengths[:, None]).long()
    labels = ids[:, 1:].masked_fill(mask == 0, -100)
    batch = {"input_ids": ids[:, :-1].masked_fill(mask == 0, 0), "attention_mask": mask,
             "labels": labels}
    if token_types:
        batch["token_type_ids"] = (torch.arange(SEQ) >= SEQ // 2).long().expand(ROWS, -1)
    return batch


def logits_loss(out, labels):
    """Mean cross-entropy over the labels that are not -100, read from ``out.logits``."""
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1))


def gpt2_lm():
    """Hugging Face GPT-2 itself (returns a ModelOutput), tied embeddings, from a tiny config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def gpt2_lm_untied():
    """GPT-2 with its head untied (schedules that put the first and last stage on one rank
    refuse a weight tied across them)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, tie_word_embeddings=False)
    return GPT2LMHeadModel(cfg)


def bert_mlm(tie=True):
    """Hugging Face BERT for masked LM: its ``embeddings`` (word + position + token type +
    LayerNorm + dropout) before the layers, the head tied to the word embedding. Dropout 0:
    random masks differ between layouts."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=SEQ,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     tie_word_embeddings=tie)
    return BertForMaskedLM(cfg)


def bert_mlm_untied():
    return bert_mlm(tie=False)


def bert_batch(step):
    return padded_batch(step, token_types=True)


class ConvBlock(nn.Module):
    def __init__(self, ch: int = 8):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(ch, ch, 3, padding=1), nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(torch.relu(self.conv1(x)))


class SmallConvNet(nn.Module):
    """A vision model: a conv stem (3 -> ``stem_ch`` channels, stride 2), residual conv blocks,
    a head (pool, flatten, linear). ``stem_ch=192`` gives the stem more parameters than the
    blocks, so the largest-container rule picks the stem: split points name the blocks."""

    def __init__(self, stem_ch: int = 8, batchnorm: bool = False, pooled: bool = False):
        super().__init__()
        self.pooled = pooled
        norm = [nn.BatchNorm2d(stem_ch)] if batchnorm else []
        self.stem = nn.Sequential(nn.Conv2d(3, stem_ch, 3, stride=2, padding=1), *norm,
                                  nn.ReLU(), nn.Conv2d(stem_ch, 8, 1))
        self.blocks = nn.Sequential(*[ConvBlock() for _ in range(4)])
        if pooled:  # as torchvision's ResNet: a pooling module, then the classifier
            self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(8, 5)
        else:
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))

    def forward(self, x):
        x = self.blocks(self.stem(x))
        if self.pooled:  # the pooling has no parameters: it runs on every stage
            return self.fc(torch.flatten(self.pool(x), 1)) / 2
        return self.head(x)


def convnet():
    torch.manual_seed(0)
    return SmallConvNet()


def convnet_pooled():
    """Pools and flattens (parameter-free, so on every stage) before its classifier, and
    scales the logits after it: a stage without the head still sends the feature maps."""
    torch.manual_seed(0)
    return SmallConvNet(pooled=True)


def convnet_wide_stem():
    torch.manual_seed(0)
    return SmallConvNet(stem_ch=192)


def image_batch(step):
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(ROWS, 3, 8, 8, generator=g), torch.randint(0, 5, (ROWS,), generator=g)


def reference_loop(factory, batches, loss_fn, clip=1.0):
    """A plain one-process loop (SGD, torch's clipping) over whole batches, in the train step's
    batch conventions: ``(inputs, targets)``, or a dict whose ``labels`` go to ``loss_fn`` (or,
    with ``loss_fn=None``, to the model, which returns ``.loss``); a ``(sum, count)`` loss is
    divided out."""
    model = factory()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        if isinstance(batch, dict) and loss_fn is None:
            loss = model(**batch).loss
        else:
            if isinstance(batch, dict):
                inputs, targets = {k: v for k, v in batch.items() if k != "labels"}, \
                    batch["labels"]
                out = model(**inputs)
            else:
                inputs, targets = batch
                out = model(inputs)
            loss = loss_fn(out, targets)
            if isinstance(loss, tuple):
                loss = loss[0] / loss[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "state": state}


class SkipsLastBlock(nn.Module):
    """A forward that loops over all blocks but the last: on a stage without the last block,
    what to send on cannot be told, so plait refuses to split it."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(MixBlock() for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        h = self.tok(input_ids)
        for block in self.blocks[:-1]:
            h = block(h, attention_mask)
        return self.head(h), h.mean()


def skips_last_block():
    torch.manual_seed(0)
    return SkipsLastBlock()


def refusal_worker(rank, world_size):
    """pp=2 on SkipsLastBlock: every rank gets the one-line refusal on its first step."""
    from plait.runtime import init

    run = init("pp=2,mb=2", quiet=True, seed=0)
    model = run.parallelize(skips_last_block())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    try:
        run.step(model, padded_batch(0), mixer_loss, opt)
        message = None
    except ValueError as exc:
        message = str(exc)
    run.close()
    return message


def batchnorm_warnings(rank, world_size, plans):
    """The warnings ``run.parallelize`` gives, per plan, for a ConvNet with BatchNorm."""
    import warnings

    from plait.runtime import init

    out = []
    for text in plans:
        run = init(text, quiet=True, seed=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run.parallelize(SmallConvNet(batchnorm=True))
        run.close()
        out.append([str(w.message) for w in caught if "BatchNorm" in str(w.message)])
    return out


class DenseMoE(nn.Module):
    """One mixture-of-experts layer and no stack of layers: the experts list is the model's
    largest container, and every expert reads the same input (a softmax-weighted sum), so the
    experts are alternatives, not steps. Cut through them, a pipeline would compute another
    model without any error. ``forward(x, temperature)`` takes a second input that plait cannot
    guess, so only the first step's real inputs show how the blocks are fed."""

    def __init__(self, needs_temperature: bool = False):
        super().__init__()
        self.needs_temperature = needs_temperature
        self.inp = nn.Linear(8, WIDTH)
        self.router = nn.Linear(WIDTH, 4)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(4))
        self.head = nn.Linear(WIDTH, 6)

    def forward(self, x, temperature=None):
        if self.needs_temperature and temperature is None:
            raise TypeError("DenseMoE(needs_temperature=True) needs a temperature")
        h = self.inp(x)
        gate = (self.router(h) / (1.0 if temperature is None else temperature)).softmax(-1)
        mixed = sum(gate[..., e:e + 1] * expert(h) for e, expert in enumerate(self.experts))
        return self.head(h + mixed)


def dense_moe():
    torch.manual_seed(0)
    return DenseMoE()


class ChainedByTheParent(nn.Module):
    """Blocks that do form a chain, fed in the ways a check of the chain must not mistake for
    alternatives: the residual in the parent (``h = h + block(h)``), a frozen embedding (no
    autograd history before the first block), a block run inside a reentrant checkpoint (its
    output hides how it was computed) and one whose input is detached."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.tok.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                                    for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        from torch.utils.checkpoint import checkpoint

        h = self.tok(input_ids)
        h = h + self.blocks[0](h)
        h = h + checkpoint(self.blocks[1], h, use_reentrant=True)
        h = self.blocks[2](h).detach()
        return self.head(h + self.blocks[3](h))


def chained_by_the_parent():
    torch.manual_seed(0)
    return ChainedByTheParent()



class InputLog(nn.Module):
    """Passes its input on and keeps, for each call on a real device, the sum of its absolute
    values (meta-device calls, plait's own checks, are not kept)."""

    def __init__(self):
        super().__init__()
        self.seen: list[float] = []

    def forward(self, x):
        if x.device.type != "meta":
            self.seen.append(float(x.detach().abs().sum()))
        return x


def logged_mlp():
    """deep_mlp with an InputLog at the front of every hidden block."""
    torch.manual_seed(0)
    layers = [nn.Linear(12, 32)]
    for _ in range(8):
        layers += [nn.Sequential(InputLog(), nn.Linear(32, 32), nn.Tanh())]
    layers.append(nn.Linear(32, 3))
    return nn.Sequential(*layers)


def first_inputs_seen(rank, world_size, plan, batches, loss_fn):
    """Train logged_mlp; return the losses and, for the first block this rank holds, what its
    InputLog kept."""
    from plait.runtime import init

    run = init(plan, quiet=True, log_every=1, seed=0)
    model = run.parallelize(logged_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = [float(run.step(model, batch, loss_fn, opt)) for batch in batches]
    logs = [m for m in model.modules() if isinstance(m, InputLog)]
    run.close()
    return {"losses": losses, "seen": logs[0].seen}


class ScaledMLP(nn.Module):
    """Blocks under a model that holds parameters of its own: a scale used before the blocks
    and after the head, a shift added before the blocks and after every block. Under a
    pipeline, each stage's uses give part of their gradient."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(8))
        self.out = nn.Linear(32, 3)
        self.scale = nn.Parameter(torch.tensor([1.5]))  # (1,): FSDP2 refuses a 0-dim one
        self.shift = nn.Parameter(torch.full((32,), 0.1))

    def forward(self, x):
        h = self.inp(x) * self.scale + self.shift
        for block in self.blocks:
            h = torch.tanh(block(h)) + self.shift
        return self.out(h) * self.scale


def scaled_mlp():
    torch.manual_seed(0)
    return ScaledMLP()


class HeadGainMLP(nn.Module):
    """Blocks under a model whose own parameter, a gain on the output, is read after the
    blocks only: under a pipeline every stage holds it and only the last one uses it."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.out = nn.Linear(32, 3)
        self.gain = nn.Parameter(torch.full((3,), 1.5))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.out(h) * self.gain


def head_gain_mlp():
    torch.manual_seed(0)
    return HeadGainMLP()


class SpareMLP(ScaledMLP):
    """ScaledMLP with a parameter of its own that its forward never reads: one device leaves
    it without a gradient, so AdamW leaves it as it is (no weight decay either)."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Parameter(torch.ones(4))


def spare_mlp():
    torch.manual_seed(0)
    return SpareMLP()


class DropoutTagger(nn.Module):
    """A token tagger with dropout in every block, so that every pipeline stage holds one (the
    last stage of a V layout, on rank 0, included): embedding, 4 residual blocks, head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Dropout(0.5),
                          nn.Linear(2 * WIDTH, WIDTH)) for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def dropout_tagger():
    torch.manual_seed(0)
    return DropoutTagger()


def masked_ce(logits, labels):
    """Mean cross-entropy over the labels that are not -100."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def counted_batch(step):
    """Tokens and labels where row i counts i + 1 labels (-100 elsewhere): a pipeline's
    microbatches of 2 rows count 3, 7, 11 and 15, so a mean of their means is not the mean."""
    g = torch.Generator().manual_seed(800 + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = torch.full_like(ids, -100)
    for i in range(ROWS):
        keep = torch.randperm(SEQ, generator=g)[:i + 1]
        labels[i, keep] = torch.randint(0, VOCAB, (len(keep),), generator=g)
    return ids, labels


def evaluate_reference():
    """One device, dropout off throughout: the held-out batch's loss before and after one step
    (SGD, clipping at 1.0) on batch 0, and batch 1's loss after that step."""
    model = dropout_tagger().eval()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    held, (x, y), (x1, y1) = counted_batch(9), counted_batch(0), counted_batch(1)
    with torch.no_grad():
        before = float(masked_ce(model(held[0]), held[1]))
    masked_ce(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    with torch.no_grad():
        return {"evals": [before, float(masked_ce(model(held[0]), held[1]))],
                "next": float(masked_ce(model(x1), y1))}


def evaluate_under_schedules(rank, world_size, plans, parts=False):
    """Per plan, in one process group after another: ``run.evaluate`` of the held-out batch
    before training and twice after one step taken with dropout off (``model.eval()``), each
    called with the model in train mode; whether every module is in train mode after it; and
    the loss of the next step, which trains with dropout on. ``parts``: the held-out batch
    comes as the plan's micro-batches collated one by one (``plait.MicroBatches``). Each data
    replica takes its share of every batch's rows."""
    from plait import MicroBatches
    from plait.parallel.layout import local_modules
    from plait.runtime import init

    def rows(batch, start, count):
        return batch[0][start:start + count], batch[1][start:start + count]

    out = {}
    for text in plans:
        run = init(text, quiet=True, seed=0)
        model = run.parallelize(dropout_tagger())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        share = ROWS // run.dp_size
        start = run.dp_rank * share
        held = rows(counted_batch(9), start, share)
        if parts:
            n = run.plan.microbatches * run.plan.grad_accum
            held = MicroBatches([rows(held, i * (share // n), share // n) for i in range(n)])
        evals = [float(run.evaluate(model, held, masked_ce))]
        model.eval()
        run.step(model, rows(counted_batch(0), start, share), masked_ce, opt)
        model.train()
        evals += [float(run.evaluate(model, held, masked_ce)) for _ in range(2)]
        modules = [model, *local_modules(model)]
        training = all(m.training for top in modules for m in top.modules())
        nxt = float(run.step(model, rows(counted_batch(1), start, share), masked_ce, opt))
        run.close()
        out[text] = {"evals": evals, "training": training, "next": nxt}
    return out
