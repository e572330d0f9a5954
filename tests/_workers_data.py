"""What each rank's loader hands the training loop (spawned processes import this module): a
map-style dataset of variable-length sequences whose items carry their own index, collated into
dict batches padded to the longest row, trained by a Hugging Face style model (its own loss).
Each rank returns the indices, tensors and losses of every step, so that a test puts the data
replicas' rows side by side with one device's."""

from __future__ import annotations

import os
import warnings
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from tests._workers_semantics import SEQ, VOCAB, WithLoss, masked_lm, mlm_loss

ITEMS, BATCH, LR = 22, 8, 0.05  # 2 global batches an epoch, 6 items left over


class Numbered(Dataset):
    """Item i: 2 to SEQ tokens and labels drawn from i alone (some labels -100), its index,
    and where it was loaded (worker id, -1 in the main process; the process id)."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)
        n = 2 + i % (SEQ - 1)
        tokens = torch.randint(0, VOCAB, (n,), generator=g)
        labels = torch.randint(0, VOCAB, (n,), generator=g)
        labels[torch.rand(n, generator=g) < 0.3] = -100
        info = get_worker_info()
        return {"input_ids": tokens, "labels": labels, "id": torch.tensor(i),
                "worker": torch.tensor(-1 if info is None else info.id),
                "pid": torch.tensor(os.getpid())}


class Blocks(IterableDataset):
    """A generator of token blocks written for the test: ``Numbered``'s items 0 to ``items``-1
    in order, one pass per ``iter``. ``noise``: each block also gets a mask drawn from the
    global generators (torch, ``random``, NumPy) as it is generated, randomness of the stream
    itself."""

    def __init__(self, items: int = ITEMS, noise: bool = False):
        self.items, self.noise = items, noise

    def __iter__(self):
        return self._items(0)

    def _items(self, start: int):
        data = Numbered()
        for p in range(start, self.items):
            item = data[p]
            if self.noise:
                import random

                import numpy as np

                item["input_ids"] = (item["input_ids"] + torch.randint(0, 3, (1,))
                                     + random.randrange(3) + int(np.random.randint(3))) % VOCAB
            yield item


class SeekableBlocks(Blocks):
    """``Blocks`` with plait's seek protocol: ``iter_from(p)`` starts at item p. It counts the
    items its iterators produced and the positions it was asked to start at (in the process
    that reads it)."""

    def __init__(self, items: int = ITEMS, noise: bool = False):
        super().__init__(items, noise)
        self.produced = 0
        self.starts: list[int] = []

    def _items(self, start: int):
        self.starts.append(start)
        for item in super()._items(start):
            self.produced += 1
            yield item

    def iter_from(self, position: int):
        return self._items(position)


class OwnGenerator(Dataset):
    """``Numbered`` with a random mask drawn from a generator the dataset holds
    (``self.g``), made once (``per_item=False``: plait does not reseed it) or made again in
    each ``dataset[i]`` from the seed plait gives the item (``per_item=True``).
    ``draws=False``: the generator only drew in ``__init__`` (a fixed split) and loading
    draws nothing. ``draws_from=n``: it draws only from its n-th load on (an augmentation
    switched on in a later epoch)."""

    def __init__(self, per_item: bool = False, draws: bool = True, draws_from: int = 0):
        self.g = torch.Generator().manual_seed(7)
        self.split = torch.randperm(ITEMS, generator=self.g)
        self.per_item, self.draws, self.draws_from = per_item, draws, draws_from
        self.loaded = 0

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = Numbered()[i]
        self.loaded += 1
        if self.draws and self.loaded > self.draws_from:
            if self.per_item:
                self.g = torch.Generator().manual_seed(torch.initial_seed())
            keep = torch.rand(len(item["input_ids"]), generator=self.g) < 0.5
            item["input_ids"] = torch.where(keep, item["input_ids"], 0)
        return item


class OwnGeneratorBlocks(Blocks):
    """``Blocks`` shifting each block by a draw of a generator it holds."""

    def __init__(self):
        super().__init__()
        self.g = torch.Generator().manual_seed(7)

    def _items(self, start: int):
        for item in super()._items(start):
            item["input_ids"] = (item["input_ids"]
                                 + torch.randint(0, 3, (1,), generator=self.g)) % VOCAB
            yield item


class Augmented(Dataset):
    """``Numbered`` with a random crop and a random mask drawn in ``dataset[i]`` from the global
    generators, as an augmentation does (torch, ``random`` and NumPy)."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        import random

        import numpy as np

        item = Numbered()[i]
        keep = 1 + random.randrange(len(item["input_ids"]))
        flip = torch.rand(keep) < 0.5
        shift = int(np.random.randint(1, 4))
        item["input_ids"] = torch.where(flip, 0, item["input_ids"][:keep] + shift) % VOCAB
        item["labels"] = item["labels"][:keep]
        return item


def pad(items: list[dict[str, torch.Tensor]], length: int | None = None
        ) -> dict[str, torch.Tensor]:
    """A dict batch padded to ``length`` or to this list's longest row (-100: not a label)."""
    n = length or max(len(it["input_ids"]) for it in items)
    return {"input_ids": torch.stack([F.pad(it["input_ids"], (0, n - len(it["input_ids"])))
                                      for it in items]),
            "labels": torch.stack([F.pad(it["labels"], (0, n - len(it["labels"])), value=-100)
                                   for it in items]),
            **{k: torch.stack([it[k] for it in items]) for k in ("id", "worker", "pid")}}


class EpochBlocks(Blocks):
    """``Blocks`` in an order drawn from its epoch, which ``set_epoch`` sets (as ``datasets``'
    shuffled streams do): without it every epoch has epoch 0's order."""

    def __init__(self):
        super().__init__()
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _items(self, start: int):
        data = Numbered()
        order = torch.randperm(self.items, generator=torch.Generator().manual_seed(self.epoch))
        for p in order[start:].tolist():
            yield data[p]


def hf_numbered() -> Any:
    """``Numbered`` as a ``datasets.Dataset`` in torch format (columns from a dict)."""
    import datasets

    items = [Numbered()[i] for i in range(ITEMS)]
    columns = {k: [it[k].tolist() for it in items] for k in ("input_ids", "labels", "id")}
    columns["worker"], columns["pid"] = [-1] * ITEMS, [0] * ITEMS
    return datasets.Dataset.from_dict(columns).with_format("torch")


def hf_stream() -> Any:
    """``hf_numbered`` as ``datasets``' ``IterableDataset`` (2 shards, in order)."""
    return hf_numbered().to_iterable_dataset(num_shards=2)


DATA = {"numbered": Numbered, "blocks": Blocks, "augmented": Augmented, "hf": hf_numbered,
        "hf_stream": hf_stream}


def masking_pad(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``pad`` to SEQ, then a masked-LM collator's random masking: 30% of the tokens, drawn
    from torch's global generator, become token 1."""
    batch = pad(items, SEQ)
    batch["input_ids"] = batch["input_ids"].masked_fill(torch.rand(batch["input_ids"].shape)
                                                        < 0.3, 1)
    return batch


def trace(rank: int, world_size: int, plan: str, steps: int | None = None, *,
          epochs: int = 1, length: int | None = None, data: str = "numbered",
          loader_each_epoch: bool = False, checkpoint: str | None = None,
          stop_after: int | None = None, **loader_args: Any) -> dict[str, Any]:
    """``steps`` steps over ``run.loader(DATA[data](), BATCH, ...)`` (``steps=None``: that
    loader iterated ``epochs`` times, an epoch each; ``loader_each_epoch``: a new loader each
    epoch): this rank's data rank, and per step the indices of its rows, its input tensor, the
    loss, where the rows were loaded; and the model's full state at the end. ``checkpoint``:
    resume from that folder if it holds a checkpoint; ``stop_after``: save there and stop once
    the run has done that many steps."""
    import plait

    run = plait.init(plan, quiet=True, checkpoint=checkpoint, seed=0)
    model = run.parallelize(WithLoss(masked_lm()))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, Any] = {"dp_rank": run.dp_rank, "ids": [], "inputs": [], "losses": [],
                           "workers": [], "pids": []}
    dataset = DATA[data]()
    if data == "blocks":
        try:
            run.loader(dataset, BATCH, shuffle=True)
        except ValueError as exc:
            out["refused"] = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def make() -> Any:
            return run.loader(dataset, BATCH, steps=steps,
                              collate_fn=partial(pad, length=length), **loader_args)

        loader = make()
        for epoch in range(epochs):
            if loader_each_epoch and epoch:
                loader = make()
            for batch in loader:
                out["ids"].append(batch.pop("id").tolist())
                out["workers"].append(batch.pop("worker").tolist())
                out["pids"].append(batch.pop("pid").tolist())
                out["inputs"].append(batch["input_ids"].clone())
                out["losses"].append(float(run.step(model, batch, None, opt)))
                if stop_after is not None and run.steps_done == stop_after:
                    break
            if stop_after is not None and run.steps_done == stop_after:
                run.save()
                break
    out["warnings"] = [str(w.message) for w in caught]
    out["state"] = run.full_state_dict(model)
    run.close()
    return out


def own_sampler(rank: int, world_size: int, plan: str, sampler_args: dict[str, str]
                ) -> list[float]:
    """Two steps over the script's own DataLoader with a ``DistributedSampler`` given
    ``sampler_args`` ({"num_replicas": "dp_size", "rank": "dp_rank"} names run attributes; {}
    leaves torch's defaults, the world size and global rank)."""
    from torch.utils.data import DataLoader, DistributedSampler

    import plait

    run = plait.init(plan, quiet=True, seed=0)
    model = run.parallelize(WithLoss(masked_lm()))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = Numbered()
    sampler = DistributedSampler(data, shuffle=False,
                                 **{k: getattr(run, v) for k, v in sampler_args.items()})
    losses = []
    for _, batch in zip(range(2), DataLoader(data, batch_size=BATCH // run.dp_size,
                                             sampler=sampler,
                                             collate_fn=partial(pad, length=SEQ)), strict=False):
        inputs = {k: batch[k] for k in ("input_ids", "labels")}
        losses.append(float(run.step(model, inputs, None, opt)))
    run.close()
    return losses


def check_batches(rank: int, world_size: int, batches: list[Any], dp_ranks: list[int]
                  ) -> list[str]:
    """plait's first-step batch check on ``batches[rank]``, this rank in data replica
    ``dp_ranks[rank]`` (the others its tensor-parallel peers): the warnings it raised."""
    from plait.data.replicas import check_rank_batches

    dp = len(set(dp_ranks))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_rank_batches(batches[rank], dp_ranks[rank], dp, {"tp": world_size // dp},
                           torch.device("cpu"))
    return [str(w.message) for w in caught]


def one_device_run(batches: list[list[int]], data: Dataset | None = None
                   ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """No plait, one process: SGD on each global batch (rows by index into ``data``, default
    ``Numbered``), the model's own loss; the losses and the parameters at the end."""
    data, model = data or Numbered(), WithLoss(masked_lm())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in batches:
        batch = pad([data[i] for i in ids])
        loss = mlm_loss(model.inner(batch["input_ids"]), batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def one_device_losses(batches: list[list[int]]) -> list[float]:
    return one_device_run(batches)[0]


if __name__ == "__main__":
    # One rank of a job started as plain processes (tests._ranks.run_ranks): loader workers
    # are child processes, which plait.spawn's daemonic ranks may not start.
    import json
    import sys

    folder, plan, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.save(trace(rank, world, plan, **args), os.path.join(folder, f"{rank}.pt"))
