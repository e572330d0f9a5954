"""Two more models of kinds plait's own are not, as a newcomer brings them: a tiny object
detector in the torchvision style (``forward(images, targets)``, ``targets`` a list of one dict
per image with a variable number of boxes; a dict of losses in training, detections in eval)
and a graph network (message passing with ``index_add_`` over ``edge_index``) trained on
mini-batches of small graphs collated as PyTorch Geometric does (node features concatenated,
``edge_index`` offset per graph, a ``batch`` vector from node to graph, one target per graph).
Neither depends on torchvision or torch_geometric. Each factory returns
``(model, dataset, loss_fn, collate_fn)``, as ``plait check --model`` takes it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

SIZE, CELL, CLASSES = 16, 4, 3  # 16x16 images, a 4x4 grid of cells, three kinds of object


class TinyDetector(nn.Module):
    """A conv backbone down to a grid of cells and a head that gives every cell class logits
    (background first) and a box. Training matches each box to the cell its centre falls in:
    cross-entropy over the cells of each image and a smooth-L1 box loss over its boxes, each
    averaged per image and then over the images (torchvision's ``forward(images, targets)``
    returning a dict of losses). Eval mode returns one dict of detections per image."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Conv2d(16, CLASSES + 1 + 4, 1)

    def forward(self, images: Any, targets: list[dict[str, torch.Tensor]] | None = None
                ) -> Any:
        if isinstance(images, (list, tuple)):
            images = torch.stack(list(images))
        out = self.head(self.backbone(images)).flatten(2).transpose(1, 2)  # (B, cells, C+5)
        logits, deltas = out[..., :CLASSES + 1], out[..., CLASSES + 1:]
        if not self.training:
            return [_detections(lg, dl) for lg, dl in zip(logits, deltas, strict=True)]
        if targets is None:
            raise ValueError("TinyDetector in training mode needs targets")
        cls, box = [], []
        # zip without strict, as torchvision's models write it: targets cut apart from their
        # images would train on fewer images, silently
        for lg, dl, t in zip(logits, deltas, targets):  # noqa: B905
            cells, goal = _match(t["boxes"])
            want = torch.zeros(lg.shape[0], dtype=torch.long)
            want[cells] = t["labels"] + 1
            cls.append(F.cross_entropy(lg, want))
            box.append(F.smooth_l1_loss(dl[cells], goal))
        return {"loss_classifier": torch.stack(cls).mean(), "loss_box_reg": torch.stack(box).mean()}


def _match(boxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cell each box's centre falls in, and the box relative to that cell (in cells)."""
    grid = SIZE // CELL
    centre = (boxes[:, :2] + boxes[:, 2:]) / 2
    ij = (centre / CELL).long().clamp(0, grid - 1)
    cells = ij[:, 1] * grid + ij[:, 0]
    goal = torch.cat([centre / CELL - ij - 0.5, (boxes[:, 2:] - boxes[:, :2]) / CELL], dim=1)
    return cells, goal


def _detections(logits: torch.Tensor, deltas: torch.Tensor) -> dict[str, torch.Tensor]:
    grid = SIZE // CELL
    score, label = logits.softmax(-1).max(-1)
    keep = (label > 0).nonzero().squeeze(-1)
    ij = torch.stack([keep % grid, keep // grid], dim=1).float()
    centre = (ij + 0.5 + deltas[keep, :2]) * CELL
    half = deltas[keep, 2:] * CELL / 2
    return {"boxes": torch.cat([centre - half, centre + half], dim=1),
            "scores": score[keep], "labels": label[keep] - 1}


class Shapes(Dataset):
    """16x16 RGB images holding 1 to 3 filled squares of three colours (the class) on noise
    (``per_image``: that many in every image); the target is a dict of their boxes (x0, y0, x1, y1
    in pixels) and labels."""

    def __init__(self, n: int = 32, seed: int = 0, per_image: int | None = None):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            image = torch.rand(3, SIZE, SIZE, generator=g) * 0.2
            k = int(torch.randint(1, 4, (), generator=g)) if per_image is None else per_image
            labels = torch.randint(0, CLASSES, (k,), generator=g)
            xy = torch.randint(0, SIZE - 5, (k, 2), generator=g)
            side = torch.randint(3, 6, (k, 1), generator=g)
            boxes = torch.cat([xy, xy + side], dim=1).float()
            for (x0, y0, x1, y1), c in zip(boxes.long().tolist(), labels.tolist(), strict=True):
                image[c, y0:y1, x0:x1] = 1.0
            self.items.append((image, {"boxes": boxes, "labels": labels}))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        image, target = self.items[i]
        return {"images": image, "targets": target}


def collate_detection(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The images stacked, the targets a list of one dict per image (they cannot stack)."""
    return {"images": torch.stack([it["images"] for it in items]),
            "targets": [it["targets"] for it in items]}


def detector() -> tuple[nn.Module, Dataset, Any, Any]:
    """The detector computes its own losses: ``loss_fn=None``."""
    torch.manual_seed(0)
    return TinyDetector(), Shapes(), None, collate_detection


def detector_four_boxes() -> tuple[nn.Module, Dataset, Any, Any]:
    """:func:`detector` on images that each hold four boxes: a replica's batch of four images
    is then four rows in every tensor, the targets' boxes included."""
    torch.manual_seed(0)
    return TinyDetector(), Shapes(per_image=4), None, collate_detection


FEATURES, HIDDEN = 4, 16


class MessagePassing(nn.Module):
    """h + relu(W_self h + mean over in-edges of W_nb h[src]), by ``index_add_`` over the
    edges' destinations."""

    def __init__(self, d: int = HIDDEN):
        super().__init__()
        self.self_lin, self.nb_lin = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, h: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        agg = torch.zeros_like(h).index_add_(0, dst, self.nb_lin(h)[src])
        deg = torch.zeros(h.shape[0], dtype=h.dtype).index_add_(
            0, dst, torch.ones(dst.shape[0], dtype=h.dtype)).clamp(min=1)
        return h + F.relu(self.self_lin(h) + agg / deg[:, None])


class GraphNet(nn.Module):
    """Node features in, a stack of message-passing layers, a mean over each graph's nodes
    (``batch`` maps node to graph, as PyG's ``global_mean_pool``), one value per graph."""

    def __init__(self, layers: int = 4):
        super().__init__()
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.layers = nn.ModuleList(MessagePassing() for _ in range(layers))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor
                ) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h, edge_index)
        graphs = int(batch.max()) + 1
        pooled = torch.zeros(graphs, h.shape[1], dtype=h.dtype).index_add_(0, batch, h)
        sizes = torch.zeros(graphs, dtype=h.dtype).index_add_(
            0, batch, torch.ones_like(batch, dtype=h.dtype))
        return self.head(pooled / sizes[:, None]).squeeze(-1)


class Molecules(Dataset):
    """Small graphs of 3 to 8 nodes (a ring and a few chords, both directions); the target
    is a smooth function of the node features and the size."""

    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            k = int(torch.randint(3, 9, (), generator=g))
            x = torch.randn(k, FEATURES, generator=g)
            ring = torch.stack([torch.arange(k), (torch.arange(k) + 1) % k])
            chords = torch.randint(0, k, (2, int(torch.randint(0, 3, (), generator=g))),
                                   generator=g)
            one_way = torch.cat([ring, chords], dim=1)
            edges = torch.cat([one_way, one_way.flip(0)], dim=1)
            y = torch.tanh(x[:, 0].mean() + 0.1 * k)
            self.items.append({"x": x, "edge_index": edges, "y": y})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def collate_graphs(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """PyG's mini-batch: one disjoint graph of all the nodes, edge indices offset by the nodes
    before them, ``batch`` the graph of each node, one target per graph."""
    sizes = [it["x"].shape[0] for it in items]
    offsets = torch.tensor([0] + sizes[:-1]).cumsum(0)
    return {"x": torch.cat([it["x"] for it in items]),
            "edge_index": torch.cat([it["edge_index"] + int(o)
                                     for it, o in zip(items, offsets, strict=True)], dim=1),
            "batch": torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)]),
            "labels": torch.stack([it["y"] for it in items])}


def graph_loss(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pred, y)


def graph_net() -> tuple[nn.Module, Dataset, Any, Any]:
    torch.manual_seed(0)
    return GraphNet(), Molecules(), graph_loss, collate_graphs


STEPS, BATCH = 3, 8


def _factory(name: str) -> tuple[nn.Module, Dataset, Any, Any]:
    factories = {"detector": detector, "detector_four_boxes": detector_four_boxes,
                 "graph_net": graph_net}
    return factories[name]()


def train(rank: int, world_size: int, name: str, plan: str, evaluate: bool = False
          ) -> dict[str, Any]:
    """AdamW for STEPS steps on the factory ``name`` under ``plan``, batches from
    ``run.loader`` with its collate_fn: the losses and the full state on rank 0, or the
    refusal's message."""
    from plait.runtime import init

    run = init(plan, quiet=True, seed=0)
    model, data, loss_fn, collate = _factory(name)
    loader = run.loader(data, batch_size=BATCH, steps=STEPS, collate_fn=collate)
    try:
        model = run.parallelize(model, example=loader.batch(0))
    except ValueError as exc:
        run.close()
        return {"refused": str(exc)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [float(run.step(model, batch, loss_fn, opt)) for batch in loader]
    evaluated = [float(run.evaluate(model, batch, loss_fn))
                 for batch in run.loader(data, batch_size=BATCH, steps=1, evaluation=True,
                                         collate_fn=collate) if evaluate]
    state = run.full_state_dict(model)
    run.close()
    return {"losses": losses, "evaluated": evaluated, "state": state if rank == 0 else None}


def reference(name: str, evaluate: bool = False) -> dict[str, Any]:
    """The same AdamW steps with torch alone on one device: each global batch (the loader's
    order) collated whole, the loss the model or loss_fn gives (a detector's dict summed),
    torch's clipping at 1.0 (plait's default); ``evaluate``: then the loss of the first
    global batch in eval mode (a loss_fn's model only)."""
    from plait.data.loader import DistributedLoader

    model, data, loss_fn, collate = _factory(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    order = DistributedLoader(data, BATCH)
    losses = []
    for step in range(STEPS):
        batch = collate([data[int(i)] for i in order.global_indices(step)])
        if loss_fn is None:
            loss = sum(model(**batch).values())
        else:
            labels = batch.pop("labels")
            loss = loss_fn(model(**batch), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    evaluated = []
    if evaluate:  # the trained model's loss on the first global batch (an evaluation loader's)
        model.eval()
        with torch.no_grad():
            batch = collate([data[int(i)] for i in order.global_indices(0)])
            labels = batch.pop("labels")
            evaluated.append(loss_fn(model(**batch), labels).item())
    return {"losses": losses, "evaluated": evaluated, "state": model.state_dict()}
