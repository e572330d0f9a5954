"""Several models trained together, as a user brings them: knowledge distillation (a frozen
teacher, loaded weights, ``eval()``, ``requires_grad_(False)``, called under
``torch.no_grad()``, and a trainable student; KL on soft targets plus cross-entropy on the
labels), a GAN (generator and discriminator, two optimizers, the discriminator's step on real
and detached fake rows, then the generator's through the discriminator) and an EMA copy of a
trained model. Each ``train_*`` runs the loop through plait under a plan; each ``*_reference``
is the same loop in plain torch on one device (the same global batches, clipping at 1.0 as
``run.step`` does)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

FEAT, CLASSES, NOISE, DATA = 16, 8, 8, 4
STEPS, BATCH, TEMP = 3, 16, 2.0
# The GAN's gradient norms are 0.16-0.55 over its first steps: clipped at 0.3, some steps of
# each model are clipped and some are not (``clip=0.3`` in the plan, each model's own norm).
GAN_CLIP = 0.3


class Block(nn.Module):
    """A residual MLP block: what tensor parallelism splits and a pipeline cuts between."""

    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(h)))


class Net(nn.Module):
    """Features in, a stack of blocks, ``out`` values per row."""

    def __init__(self, inp: int, width: int, out: int, blocks: int = 2):
        super().__init__()
        self.inp = nn.Linear(inp, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def teacher_weights() -> dict[str, torch.Tensor]:
    """The teacher's trained weights, as a file would hold them (seeded, not trained here)."""
    torch.manual_seed(1)
    return Net(FEAT, 32, CLASSES).state_dict()


def frozen_teacher() -> nn.Module:
    teacher = Net(FEAT, 32, CLASSES)
    teacher.load_state_dict(teacher_weights())
    teacher.eval()
    return teacher.requires_grad_(False)


def student() -> nn.Module:
    torch.manual_seed(0)
    return Net(FEAT, 16, CLASSES)


class Blobs(Dataset):
    """Features around one centre per class, and the class."""

    def __init__(self, n: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        centres = 2 * torch.randn(CLASSES, FEAT, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)
        self.x = centres[self.y] + torch.randn(n, FEAT, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def kd_loss(logits: torch.Tensor, targets: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Hinton's distillation loss: KL between the softened teacher and student, scaled by
    T^2, plus cross-entropy on the labels; both means over the rows."""
    labels, teacher_logits = targets
    soft = F.kl_div(F.log_softmax(logits / TEMP, -1), F.log_softmax(teacher_logits / TEMP, -1),
                    log_target=True, reduction="batchmean") * TEMP ** 2
    return soft + F.cross_entropy(logits, labels)


def ce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def _global_batches(data: Dataset, steps: int, first: int = 0) -> list[Any]:
    """The global batches ``run.loader`` hands out at steps ``first`` .. ``first + steps - 1``,
    whole, as one device loads them."""
    from torch.utils.data import default_collate

    from plait.data.loader import DistributedLoader

    order = DistributedLoader(data, BATCH)
    return [default_collate([data[int(i)] for i in order.global_indices(step)])
            for step in range(first, first + steps)]


def distill_reference(steps: int = STEPS) -> dict[str, Any]:
    """Distillation on one device with torch alone."""
    data = Blobs()
    teacher, model = frozen_teacher(), student()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _global_batches(data, steps):
        with torch.no_grad():
            t = teacher(x)
        loss = kd_loss(model(x), (y, t))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        x, y = _global_batches(data, 1)[0]
        evaluated = ce_loss(model(x), y).item()
    return {"losses": losses, "evaluated": evaluated, "state": model.state_dict()}


def train_distill(rank: int, world_size: int, plan: str, steps: int = STEPS,
                  ledger: bool = False, whole: bool = False) -> dict[str, Any]:
    """Distillation through plait: the student and the teacher each laid out by
    ``run.parallelize`` (the teacher second; ``whole``: the teacher only moved to the device,
    as under a pipeline), the teacher's logits computed in the loop and handed to
    ``run.step`` beside the labels. With ``ledger``, the summary too."""
    from plait.runtime import init

    run = init(plan, quiet=True, ledger=ledger, seed=0)
    model = run.parallelize(student())
    teacher = frozen_teacher().to(run.device) if whole else run.parallelize(frozen_teacher())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in run.loader(Blobs(), batch_size=BATCH, steps=steps):
        with torch.no_grad():
            t = teacher(x.to(run.device))
        losses.append(float(run.step(model, (x, (y, t)), kd_loss, opt)))
    x, y = next(iter(run.loader(Blobs(), batch_size=BATCH, steps=1, evaluation=True)))
    evaluated = float(run.evaluate(model, (x, y), ce_loss))
    state = run.full_state_dict(model)
    summary = run.finish(print_summary=False) if ledger else None
    run.close()
    return {"losses": losses, "evaluated": evaluated, "state": state if rank == 0 else None,
            "summary": summary}


# ---------------------------------------------------------------------------------- a GAN
def generator() -> nn.Module:
    torch.manual_seed(2)
    return Net(NOISE, 16, DATA)


def discriminator() -> nn.Module:
    torch.manual_seed(3)
    return Net(DATA, 16, 1)


class Ring(Dataset):
    """Real points on a noisy ring in the first two of ``DATA`` dimensions, each with the noise
    the generator turns into its fake counterpart: the noise is data, drawn per item, so every
    layout feeds the generator the noise one device does."""

    def __init__(self, n: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        angle = 2 * torch.pi * torch.rand(n, generator=g)
        self.real = 0.1 * torch.randn(n, DATA, generator=g)
        self.real[:, 0] += angle.cos()
        self.real[:, 1] += angle.sin()
        self.z = torch.randn(n, NOISE, generator=g)

    def __len__(self) -> int:
        return len(self.real)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.real[i], self.z[i]


def bce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits.squeeze(-1), labels)


def _d_batch(real: torch.Tensor, fake: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The discriminator's rows: real ones labelled 1, the detached fakes 0."""
    labels = torch.cat([torch.ones(len(real)), torch.zeros(len(fake))]).to(real.device)
    return torch.cat([real, fake]), labels


def gan_reference(steps: int = STEPS, clip: float = GAN_CLIP) -> dict[str, Any]:
    """The GAN on one device with torch alone: per step the discriminator's update on real
    and detached fake rows, then the generator's through the discriminator."""
    gen, disc = generator(), discriminator()
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2, betas=(0.5, 0.999))
    d_losses, g_losses = [], []
    for real, z in _global_batches(Ring(), steps):
        opt_d.zero_grad()
        fake = gen(z)
        x, labels = _d_batch(real, fake.detach())
        d_loss = bce(disc(x), labels)
        d_loss.backward()
        torch.nn.utils.clip_grad_norm_(disc.parameters(), clip)
        opt_d.step()
        opt_g.zero_grad()
        g_loss = bce(disc(fake), torch.ones(len(fake)))
        g_loss.backward()
        torch.nn.utils.clip_grad_norm_(gen.parameters(), clip)
        opt_g.step()
        d_losses.append(d_loss.item())
        g_losses.append(g_loss.item())
    return {"d_losses": d_losses, "g_losses": g_losses, "gen": gen.state_dict(),
            "disc": disc.state_dict()}


def train_gan(rank: int, world_size: int, plan: str, steps: int = STEPS,
              folder: str | None = None, resume: bool = False, ledger: bool = False,
              checkpoint: str | None = None) -> dict[str, Any]:
    """The GAN through plait (``clip=GAN_CLIP`` added to ``plan``): both models laid out, two
    ``run.step`` calls per batch (the discriminator's on real and detached fake rows, the
    generator's with a loss that scores its output with the discriminator). ``folder``: save
    each model with its optimizer in a folder of its own after the last step, or (``resume``)
    load both first and train the steps after the saved one. Returns the losses, both models'
    states, the step count, the summary (``ledger``) and rank 0's progress lines."""
    import io

    from plait.progress import Progress
    from plait.runtime import init

    # plan="auto" takes no other item: its clip is the default, 1.0
    run = init(plan if plan == "auto" else ",".join(p for p in (plan, f"clip={GAN_CLIP}") if p),
               quiet=True, ledger=ledger, checkpoint=checkpoint, seed=0)
    lines = io.StringIO()
    run.progress = Progress(enabled=rank == 0, log_every=1, stream=lines)
    gen = run.parallelize(generator())
    disc = run.parallelize(discriminator())
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2, betas=(0.5, 0.999))
    if resume:
        run.load(f"{folder}/gen", model=gen, optimizer=opt_g)
        run.load(f"{folder}/disc", model=disc, optimizer=opt_d)

    def g_loss(fake: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
        return bce(disc(fake), ones)

    d_losses, g_losses = [], []
    for real, z in run.loader(Ring(), batch_size=BATCH, steps=steps):
        real, z = real.to(run.device), z.to(run.device)
        with torch.no_grad():
            fake = gen(z)
        d_losses.append(float(run.step(disc, _d_batch(real, fake), bce, opt_d)))
        g_losses.append(float(run.step(gen, (z, torch.ones(len(z))), g_loss, opt_g)))
    if folder is not None and not resume:
        run.save(f"{folder}/gen", model=gen, optimizer=opt_g)
        run.save(f"{folder}/disc", model=disc, optimizer=opt_d)
    out = {"d_losses": d_losses, "g_losses": g_losses, "gen": run.full_state_dict(gen),
           "disc": run.full_state_dict(disc), "steps_done": run.steps_done,
           "progress": lines.getvalue().splitlines(), "plan": run.plan.to_string()}
    summary = run.finish(print_summary=False) if ledger else None
    run.close()
    return {**out, "summary": summary} if rank == 0 else {}


# ---------------------------------------------------------------------------------- EMA
DECAY = 0.5


def ema_update(ema: nn.Module, model: nn.Module, decay: float = DECAY) -> None:
    """Move each of ``ema``'s parameters toward ``model``'s: both laid out alike, so each
    pair is the same shard or the same whole tensor."""
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters(), strict=True):
            e.lerp_(p, 1 - decay)


def ema_reference(steps: int = STEPS) -> dict[str, Any]:
    """The student trained on the labels alone, its EMA updated after each optimizer step and
    evaluated, on one device with torch alone."""
    model = student()
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    data = Blobs()
    for x, y in _global_batches(data, steps):
        loss = ce_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ema_update(ema, model)
        losses.append(loss.item())
    with torch.no_grad():
        x, y = _global_batches(data, 1)[0]
        evaluated = ce_loss(ema(x), y).item()
    return {"losses": losses, "evaluated": evaluated, "ema": ema.state_dict()}


def train_ema(rank: int, world_size: int, plan: str, steps: int = STEPS) -> dict[str, Any]:
    """The same through plait: the copy taken before ``run.parallelize`` (which lays the model
    out in place) and laid out itself, frozen, so that its parameters are laid out as the
    model's; evaluated with ``run.evaluate``."""
    from plait.runtime import init

    run = init(plan, quiet=True, seed=0)
    raw = student()
    ema = copy.deepcopy(raw).requires_grad_(False)
    model = run.parallelize(raw)
    ema = run.parallelize(ema)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in run.loader(Blobs(), batch_size=BATCH, steps=steps):
        losses.append(float(run.step(model, batch, ce_loss, opt)))
        ema_update(ema, model)
    batch = next(iter(run.loader(Blobs(), batch_size=BATCH, steps=1, evaluation=True)))
    evaluated = float(run.evaluate(ema, batch, ce_loss))
    state = run.full_state_dict(ema)
    run.close()
    return {"losses": losses, "evaluated": evaluated, "ema": state if rank == 0 else None}


class Distill(nn.Module):
    """The student beside its frozen teacher, as one module for ``plait check``: the forward
    gives the student's logits and the teacher's, computed without a graph."""

    def __init__(self) -> None:
        super().__init__()
        self.student = student()
        self.teacher = frozen_teacher()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            t = self.teacher(x)
        return self.student(x), t


def distill_pair_loss(out: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor
                      ) -> torch.Tensor:
    logits, teacher_logits = out
    return kd_loss(logits, (labels, teacher_logits))


def distill_factory() -> tuple[nn.Module, Dataset, Any]:
    """Distillation for ``plait check``: the pair as one module, the blob data, the loss."""
    return Distill(), Blobs(), distill_pair_loss


def two_critics(rank: int, world_size: int, plan: str, built_first: bool
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]]:
    """Two critics of one class laid out one after the other, each built just before its
    ``run.parallelize`` call, or (``built_first``) both before the first: the weights each
    started from, and plait's warnings."""
    import warnings

    from plait.runtime import init

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run = init(plan, quiet=True, seed=0)
        if built_first:
            q1, q2 = Net(DATA, 8, 1), Net(DATA, 8, 1)
            q1, q2 = run.parallelize(q1), run.parallelize(q2)
        else:
            q1 = run.parallelize(Net(DATA, 8, 1))
            q2 = run.parallelize(Net(DATA, 8, 1))
        one, two = run.full_state_dict(q1), run.full_state_dict(q2)
        run.close()
    return one, two, [str(w.message) for w in said if str(w.message).startswith("plait:")]


def two_critics_reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The two critics on one device, built one after the other from seed 0's stream."""
    torch.manual_seed(0)
    one, two = Net(DATA, 8, 1), Net(DATA, 8, 1)
    return one.state_dict(), two.state_dict()


def noise_in_the_loop(rank: int, world_size: int, plan: str) -> list[str]:
    """The GAN with its noise drawn in the loop (``torch.randn``), as one device would: plait's
    warnings."""
    import warnings

    from plait.runtime import init

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run = init(plan, quiet=True, seed=0)
        gen = run.parallelize(generator())
        disc = run.parallelize(discriminator())
        opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2)
        opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2)
        for real, _ in run.loader(Ring(), batch_size=BATCH, steps=1):
            z = torch.randn(len(real), NOISE)
            with torch.no_grad():
                fake = gen(z)
            run.step(disc, _d_batch(real, fake), bce, opt_d)
            run.step(gen, (z, torch.ones(len(z))), lambda f, y: bce(disc(f), y), opt_g)
        run.close()
    return [str(w.message) for w in said if str(w.message).startswith("plait:")]


def swapped_optimizers(rank: int, world_size: int, plan: str) -> str:
    """The discriminator stepped with the generator's optimizer: plait's refusal."""
    from plait.runtime import init

    run = init(plan, quiet=True, seed=0)
    gen = run.parallelize(generator())
    disc = run.parallelize(discriminator())
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2)
    try:
        for real, z in run.loader(Ring(), batch_size=BATCH, steps=1):
            with torch.no_grad():
                fake = gen(z.to(run.device))
            run.step(disc, _d_batch(real.to(run.device), fake), bce, opt_g)
    except ValueError as exc:
        return str(exc)
    finally:
        run.close()
    return ""


def one_after_another(rank: int, world_size: int, plan: str) -> dict[str, Any]:
    """Two models trained one after the other in one run (``STEPS`` batches each, a fresh
    loader each): the step count after each and rank 0's progress lines."""
    import io

    from plait.progress import Progress
    from plait.runtime import init

    run = init(plan, quiet=True, seed=0)
    lines = io.StringIO()
    run.progress = Progress(enabled=rank == 0, log_every=1, stream=lines)
    done = []
    for _ in range(2):
        model = run.parallelize(Net(DATA, 8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for real, _z in run.loader(Ring(), batch_size=BATCH, steps=STEPS, start_step=0):
            run.step(model, (real, real.sum(1, keepdim=True)), F.mse_loss, opt)
        done.append(run.steps_done)
    run.close()
    return {"steps_done": done, "progress": lines.getvalue().splitlines()}


# ---------------------------------------------------------------------------------- a WGAN
# The critic's updates per generator update, and the bound its weights are clipped to after
# each (the original WGAN's Lipschitz constraint, no gradient penalty).
N_CRITIC, WEIGHT_CLIP = 3, 0.1
# Both optimizers are SGD: the critic's head's bias has a gradient of exactly 0 on one device
# (as many real rows as fakes, signs -1 and +1), a rounding error's size once summed over
# ranks, which RMSprop (WGAN's usual one) divides by its own size into a full-size update.


def critic_loss(scores: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The critic's Wasserstein estimate to minimise: its mean score on the fakes (sign +1)
    less its mean on the real rows (sign -1), as a mean over the rows."""
    return (scores.squeeze(-1) * signs).mean()


def _c_batch(real: torch.Tensor, fake: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    signs = torch.cat([-torch.ones(len(real)), torch.ones(len(fake))]).to(real.device)
    return torch.cat([real, fake]), signs


def clip_weights(critic: nn.Module) -> None:
    with torch.no_grad():
        for p in critic.parameters():
            p.clamp_(-WEIGHT_CLIP, WEIGHT_CLIP)


def wgan_reference(steps: int = STEPS, clip: float = GAN_CLIP) -> dict[str, Any]:
    """The WGAN on one device with torch alone: per batch ``N_CRITIC`` critic updates on it
    (the generator's fakes made once, the generator unchanged meanwhile), each followed by
    the weight clipping, then one generator update scored by the critic."""
    gen, critic = generator(), discriminator()
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(critic.parameters(), lr=0.05)
    c_losses, g_losses = [], []
    for real, z in _global_batches(Ring(), steps):
        with torch.no_grad():
            fake = gen(z)
        for _ in range(N_CRITIC):
            opt_c.zero_grad()
            loss = critic_loss(critic(torch.cat([real, fake])), _c_batch(real, fake)[1])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(critic.parameters(), clip)
            opt_c.step()
            clip_weights(critic)
            c_losses.append(loss.item())
        opt_g.zero_grad()
        g_loss = -critic(gen(z)).mean()
        g_loss.backward()
        torch.nn.utils.clip_grad_norm_(gen.parameters(), clip)
        opt_g.step()
        g_losses.append(g_loss.item())
    return {"c_losses": c_losses, "g_losses": g_losses, "gen": gen.state_dict(),
            "critic": critic.state_dict()}


def train_wgan(rank: int, world_size: int, plan: str, steps: int = STEPS,
               folder: str | None = None, ledger: bool = False,
               tensorboard: str | None = None) -> dict[str, Any]:
    """The WGAN through plait (``clip=GAN_CLIP`` added to ``plan``): per batch ``N_CRITIC``
    ``run.step(critic, ..., inner=True)`` calls on it, each followed by the weight clipping,
    then the generator's ``run.step``. ``folder``: save the generator there after the last
    step. Returns the losses, both models' states, the step count, rank 0's progress lines,
    the saved step folders and ``run.finish()``'s summary."""
    import io
    from pathlib import Path

    from plait.progress import Progress
    from plait.runtime import init

    run = init(",".join(p for p in (plan, f"clip={GAN_CLIP}") if p), quiet=True,
               ledger=ledger, seed=0)
    lines = io.StringIO()
    run.progress = Progress(enabled=rank == 0, log_every=1, stream=lines,
                            tensorboard=tensorboard)
    critic = run.parallelize(discriminator())
    gen = run.parallelize(generator())
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(critic.parameters(), lr=0.05)

    def g_loss(fake: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return -critic(fake).mean()

    c_losses, g_losses, counts = [], [], []
    for real, z in run.loader(Ring(), batch_size=BATCH, steps=steps):
        real, z = real.to(run.device), z.to(run.device)
        with torch.no_grad():
            fake = gen(z)
        for _ in range(N_CRITIC):
            c_losses.append(float(run.step(critic, _c_batch(real, fake), critic_loss, opt_c,
                                           inner=True)))
            clip_weights(critic)
            counts.append(run.steps_done)
        g_losses.append(float(run.step(gen, (z, torch.ones(len(z))), g_loss, opt_g)))
        counts.append(run.steps_done)
    saved: list[str] = []
    if folder is not None:
        run.save(f"{folder}/gen", model=gen, optimizer=opt_g)
        saved = sorted(p.name for p in Path(folder, "gen").iterdir())
    out = {"c_losses": c_losses, "g_losses": g_losses, "gen": run.full_state_dict(gen),
           "critic": run.full_state_dict(critic), "steps_done": counts, "saved": saved,
           "progress": lines.getvalue().splitlines()}
    summary = run.finish(print_summary=False)
    return {**out, "summary": summary} if rank == 0 else {}


def wgan_drawn_reference(steps: int = STEPS, clip: float = GAN_CLIP) -> dict[str, Any]:
    """The WGAN on one device with each critic update on a batch of its own: ``N_CRITIC``
    batches per generator update, which takes the last one's noise."""
    gen, critic = generator(), discriminator()
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(critic.parameters(), lr=0.05)
    batches = iter(_global_batches(Ring(), steps * N_CRITIC))
    c_losses, g_losses = [], []
    for _ in range(steps):
        for _ in range(N_CRITIC):
            real, z = next(batches)
            with torch.no_grad():
                fake = gen(z)
            opt_c.zero_grad()
            loss = critic_loss(critic(torch.cat([real, fake])), _c_batch(real, fake)[1])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(critic.parameters(), clip)
            opt_c.step()
            clip_weights(critic)
            c_losses.append(loss.item())
        opt_g.zero_grad()
        g_loss = -critic(gen(z)).mean()
        g_loss.backward()
        torch.nn.utils.clip_grad_norm_(gen.parameters(), clip)
        opt_g.step()
        g_losses.append(g_loss.item())
    return {"c_losses": c_losses, "g_losses": g_losses, "gen": gen.state_dict(),
            "critic": critic.state_dict()}


def train_wgan_drawn(rank: int, world_size: int, plan: str, inner: bool,
                     steps: int = STEPS) -> dict[str, Any]:
    """The same through plait, the batches drawn from one ``run.loader`` of ``steps *
    N_CRITIC`` batches inside the loop; the critic's calls with or without ``inner=True``.
    Returns the losses, both states, ``steps_done`` after the loop and the progress lines,
    or plait's refusal."""
    import io

    from plait.progress import Progress
    from plait.runtime import init

    run = init(",".join(p for p in (plan, f"clip={GAN_CLIP}") if p), quiet=True, seed=0)
    lines = io.StringIO()
    run.progress = Progress(enabled=rank == 0, log_every=1, stream=lines)
    critic = run.parallelize(discriminator())
    gen = run.parallelize(generator())
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(critic.parameters(), lr=0.05)

    def g_loss(fake: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return -critic(fake).mean()

    batches = iter(run.loader(Ring(), batch_size=BATCH, steps=steps * N_CRITIC))
    c_losses, g_losses = [], []
    try:
        for _ in range(steps):
            for _ in range(N_CRITIC):
                real, z = next(batches)
                real, z = real.to(run.device), z.to(run.device)
                with torch.no_grad():
                    fake = gen(z)
                c_losses.append(float(run.step(critic, _c_batch(real, fake), critic_loss,
                                               opt_c, inner=inner)))
                clip_weights(critic)
            g_losses.append(float(run.step(gen, (z, torch.ones(len(z))), g_loss, opt_g)))
    except ValueError as exc:
        run.close()
        return {"refused": str(exc)}
    out = {"c_losses": c_losses, "g_losses": g_losses, "gen": run.full_state_dict(gen),
           "critic": run.full_state_dict(critic), "steps_done": run.steps_done,
           "progress": lines.getvalue().splitlines()}
    run.close()
    return out if rank == 0 else {}


def inner_one_model(rank: int, world_size: int, plan: str, steps: int = 4) -> dict[str, Any]:
    """One model updated 3 times per batch (two ``inner=True`` calls, then one without), under
    the ledger: the summary's communication figures."""
    from plait.runtime import init

    run = init(plan, quiet=True, ledger=True, seed=0)
    model = run.parallelize(discriminator())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for real, _z in run.loader(Ring(), batch_size=BATCH, steps=steps):
        batch = (real.to(run.device), real.sum(1, keepdim=True).to(run.device))
        for inner in (True, True, False):
            run.step(model, batch, F.mse_loss, opt, inner=inner)
    done = run.steps_done
    summary = run.finish(print_summary=False)
    return {"steps_done": done, "comm": summary["comm"]}
