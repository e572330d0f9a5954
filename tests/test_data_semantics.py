"""What the loader hands each rank, against one device running the same script: the global batch
(``batch_size`` is the job's, split over the data replicas only), the items an epoch leaves
over, the per-epoch order, tensor- and pipeline-parallel peers holding the same batch, loader
workers, and a script's own DataLoader. Real processes on gloo, each run under a timeout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plait.spawn import WorkerError, run_distributed
from tests import _workers_data as D

REL = 1e-6


def _global_batches(ranks: list[dict]) -> list[list[int]]:
    """Each step's global batch as the data replicas hold it: their rows, in data-rank order
    (one rank per replica; its peers are checked to hold the same)."""
    by_replica: dict[int, dict] = {}
    for r in ranks:
        peer = by_replica.setdefault(r["dp_rank"], r)
        assert peer["ids"] == r["ids"], "ranks of one data replica got other rows"
        for a, b in zip(peer["inputs"], r["inputs"], strict=True):
            assert a.equal(b), "ranks of one data replica got other tensors"
    steps = len(ranks[0]["ids"])
    return [sum((by_replica[d]["ids"][s] for d in sorted(by_replica)), []) for s in range(steps)]


@pytest.mark.parametrize("plan,peers", [("tp=2", "tensor-parallel"),
                                        pytest.param("pp=2,mb=2", "pipeline",
                                                     marks=pytest.mark.slow)])
def test_peers_of_one_replica_loading_other_rows_are_refused(plan, peers):
    """A DistributedSampler left at torch's defaults splits the data over the world, so the
    tensor-parallel (or pipeline) peers of one replica train on other rows than each other:
    TP then sums partial products of different inputs, a pipeline scores one row's outputs
    against another's labels, and nothing fails. The first step refuses it on every rank;
    the sampler over the data ranks is accepted (both ranks report one loss)."""
    with pytest.raises(WorkerError, match=rf"the 2 ranks of data replica 0 \(ranks \[0, 1\], "
                                          rf"its {peers} peers\) got different batches at the "
                                          rf"first step.*over all 2 ranks, not the 1 data "
                                          rf"replica: give it num_replicas=run\.dp_size, "
                                          rf"rank=run\.dp_rank"):
        run_distributed(D.own_sampler, 2, plan, {}, timeout=120)
    right = {"num_replicas": "dp_size", "rank": "dp_rank"}
    losses = run_distributed(D.own_sampler, 2, plan, right, timeout=120)
    assert losses[0] == losses[1]


def test_the_batch_check_compares_peers_and_replicas_alike():
    """Peers holding one batch pass, NaN (missing values) included; peers holding batches that
    differ in one value, or only in the order of their rows, are refused; replicas holding the
    same rows are warned about (world 4: 2 replicas of 2 tensor-parallel ranks)."""
    import torch

    x = torch.arange(12.0).reshape(4, 3)
    x[1, 2] = float("nan")
    swapped, nudged = x[[1, 0, 2, 3]], x.clone()
    nudged[3, 0] += 1
    y = x + 100
    assert run_distributed(D.check_batches, 4, [(x, 1), (x, 1), (y, 2), (y, 2)], [0, 0, 1, 1],
                           timeout=60) == [[]] * 4
    for other in (swapped, nudged):
        with pytest.raises(WorkerError, match=r"the 2 ranks of data replica 1 \(ranks \[2, 3\], "
                                              r"its tensor-parallel peers\) got different"):
            run_distributed(D.check_batches, 4, [x, x, y, other], [0, 0, 1, 1], timeout=60)
    warned = run_distributed(D.check_batches, 4, [x] * 4, [0, 0, 1, 1], timeout=60)
    assert ["the 2 data replicas got the same batch" in w for w in warned[0]] == [True]
    assert warned[1:] == [[]] * 3  # rank 0 only


STEPS = 5  # epochs 0 and 1 whole (2 global batches of 8 out of 22 items), then half of epoch 2


@pytest.fixture(scope="module")
def one_device() -> tuple[list[list[int]], list[float]]:
    """The script on one device: its global batches (checked to be whole epochs of distinct
    items in a new order each epoch) and its losses (checked against a plain torch loop)."""
    one = run_distributed(D.trace, 1, "single", STEPS, timeout=120)
    want = _global_batches(one)
    epochs = [sum(want[e * 2:e * 2 + 2], []) for e in range(2)]
    for ids in epochs:
        assert len(ids) == len(set(ids)) == 2 * D.BATCH and set(ids) <= set(range(D.ITEMS))
    assert epochs[0] != epochs[1]
    assert all(len(ids) == D.BATCH for ids in want)
    plain = D.one_device_losses(want)
    for a, b in zip(plain, one[0]["losses"], strict=True):
        assert abs(a - b) <= REL * abs(a), (plain, one[0]["losses"])
    return want, plain


@pytest.mark.parametrize("plan,length", [("dp=2,accum=2", None), ("tp=2", None),
                                         pytest.param("pp=2,mb=2", 8, marks=pytest.mark.slow)])
def test_every_layout_trains_one_devices_global_batches(one_device, plan, length):
    """``batch_size`` is the global batch: one device takes all of it, dp=2 (with gradient
    accumulation) splits it between the replicas in order, tensor- and pipeline-parallel peers
    hold the same rows (dict batches of variable-length rows padded by the user's collate_fn;
    a pipeline's to one length). Each epoch draws 16 distinct items of 22 and leaves 6 over,
    in a new order each epoch: no item counts twice in an epoch. The losses are one device's
    (the same script, and a plain torch loop over the same rows)."""
    want, plain = one_device
    ranks = run_distributed(D.trace, 2, plan, STEPS, length=length, timeout=120)
    assert _global_batches(ranks) == want
    for r in ranks:
        assert all(abs(a - b) <= REL * abs(a)
                   for a, b in zip(plain, r["losses"], strict=True)), r["losses"]


def test_loader_workers_hand_out_the_same_batches(tmp_path):
    """num_workers=2 with persistent workers and pin_memory (left off on CPU, silently) under
    dp=2, the loader iterated once per epoch: the rows are loaded in the workers, the same
    workers both epochs, and the global batches and losses are one device's. The ranks are
    plain processes (as under torchrun): a daemonic process may not start loader workers."""
    import json

    import torch

    from plait.data import DistributedLoader
    from tests._ranks import run_ranks

    order = DistributedLoader(D.Numbered(), D.BATCH)
    want = [order.rows(step) for step in range(2 * order.batches_per_epoch)]
    plain = D.one_device_losses(want)
    args = {"steps": None, "epochs": 2, "num_workers": 2, "persistent_workers": True,
            "pin_memory": True}
    ended = run_ranks(Path(D.__file__), str(tmp_path), "dp=2", json.dumps(args), timeout=120)
    assert [e.code for e in ended] == [0, 0], [e.stderr[-2000:] for e in ended]
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert _global_batches(ranks) == want
    for r in ranks:
        assert {w for step in r["workers"] for w in step} == {0, 1}
        half = len(r["pids"]) // 2
        assert ({p for step in r["pids"][:half] for p in step}
                == {p for step in r["pids"][half:] for p in step})  # persistent
        assert all(abs(a - b) <= REL * abs(a) for a, b in zip(plain, r["losses"], strict=True))
        assert not [w for w in r["warnings"] if "pin" in w], r["warnings"]


@pytest.mark.parametrize("persistent", [False, True])
def test_a_loader_with_workers_resumes_at_the_next_batch_it_did_not_hand_out(persistent):
    """The workers fetch batches ahead; the position counts those handed out. A pass stopped
    after 3 steps continues at step 4, in a new loader (a resume) or the same one (persistent
    workers drop what they fetched ahead)."""
    from plait.data import DistributedLoader

    def ids(batches):
        return [b["id"].tolist() for b in batches]

    def make(**kw):
        return DistributedLoader(D.Numbered(), D.BATCH, dp_rank=1, dp_size=2, steps=6,
                                 collate_fn=D.pad, **kw)

    whole = ids(make())
    loader = make(num_workers=2, persistent_workers=persistent)
    first = ids(b for _, b in zip(range(3), loader, strict=False))
    assert first == whole[:3] and loader.state_dict()["step"] == 3
    resumed = make(num_workers=2)
    resumed.load_state_dict(loader.state_dict())
    assert ids(resumed) == whole[3:]
    assert ids(loader) == whole[3:]  # the same loader, iterated again


def test_items_a_loader_in_order_never_draws_are_named():
    """Without shuffling, the items after the last whole global batch are never drawn, in any
    epoch: 22 items, batches of 8, items 16 to 21. A shuffled loader (other epochs draw them)
    or a batch size that divides the dataset says nothing."""
    from plait.data import DistributedLoader

    with pytest.warns(UserWarning, match=r"shuffle=False and 22 items make 2 global batches of "
                                         r"8: the last 6 items \(indices 16 to 21\) are never "
                                         r"drawn.*batch_size that divides 22, or shuffle=True"):
        loader = DistributedLoader(list(range(22)), 8, shuffle=False)
    drawn = {int(i) for step in range(4) for i in loader.global_indices(step)}
    assert drawn == set(range(16))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DistributedLoader(list(range(22)), 8)
        DistributedLoader(list(range(24)), 8, shuffle=False)


def test_bad_worker_settings_are_refused():
    """Out of range, contradictory, or workers in a process that may not start any (plait.spawn's
    ranks are daemonic: torch's own message there is an AssertionError about daemonic
    processes)."""
    from plait.data import DistributedLoader

    with pytest.raises(WorkerError, match=r"num_workers=2 starts loader worker processes, which "
                                          r"this process may not: it is daemonic .* Use "
                                          r"num_workers=0 here, or start the ranks with plait "
                                          r"run or torchrun"):
        run_distributed(D.trace, 1, "single", 1, num_workers=2, timeout=60)

    with pytest.raises(ValueError, match="num_workers=-1 must be >= 0"):
        DistributedLoader(list(range(8)), 4, num_workers=-1)
    with pytest.raises(ValueError, match="persistent_workers=True .* give num_workers > 0"):
        DistributedLoader(list(range(8)), 4, persistent_workers=True)


@pytest.fixture(scope="module")
def stream_one_device() -> dict:
    """A generator of token blocks (22 items, batches of 8) on one device, a new loader for
    each of 2 epochs: its global batches are the stream's first 16 items in order, each epoch
    (the 6 that do not fill a batch dropped), and a plain torch loop over them gives its
    losses and parameters."""
    one = run_distributed(D.trace, 1, "single", None, data="blocks", epochs=2,
                          loader_each_epoch=True, timeout=120)
    want = _global_batches(one)
    assert want == [list(range(8)), list(range(8, 16))] * 2
    assert one[0]["refused"].startswith("shuffle=True: dataset Blocks is a stream, read in its "
                                        "own order; shuffle it in the stream")
    losses, state = D.one_device_run(want)
    _assert_trains(one[0]["losses"], one[0]["state"], losses, state)
    return {"batches": want, "losses": losses, "state": state}


def _assert_trains(got_losses: list[float], got_state: dict, losses: list[float],
                   state: dict) -> None:
    """A rank's losses and final parameters are one device's."""
    assert all(abs(a - b) <= REL * abs(a)
               for a, b in zip(losses, got_losses, strict=True)), (losses, got_losses)
    for name, want in state.items():
        assert (got_state[name] - want).abs().max() <= 1e-6, name


@pytest.mark.parametrize("plan,length", [("dp=2", None), ("tp=2", None),
                                         pytest.param("pp=2,mb=2", 8, marks=pytest.mark.slow)])
def test_a_stream_trains_one_devices_global_batches(stream_one_device, plan, length):
    """An IterableDataset under dp=2 (each replica its consecutive rows of each global batch),
    tensor- and pipeline-parallel peers (the same rows): the global batches, losses and
    parameters of one device. At dp=2 replica 0's rows of a third batch exist (items 16 to
    19) but the batch is not whole: both replicas end each epoch after 2 steps (one taking a
    third step would wait in its gradient all-reduce until the timeout)."""
    ranks = run_distributed(D.trace, 2, plan, None, data="blocks", epochs=2,
                            loader_each_epoch=True, length=length, timeout=120)
    assert _global_batches(ranks) == stream_one_device["batches"]
    for r in ranks:
        _assert_trains(r["losses"], r["state"], stream_one_device["losses"],
                       stream_one_device["state"])


def test_a_stream_resumes_from_a_checkpoint_under_another_data_parallel_size(
        stream_one_device, tmp_path):
    """Saved at step 3 under dp=2 (in the second epoch, which began at step 2). Resumed under
    tp=2 (one data replica), steps 3 and 4 train one device's batches (the second epoch's
    second, the third epoch's first) and the parameters end as one device's; resumed under
    dp=2, the losses and parameters are bitwise those of the dp=2 run that did not stop."""
    import shutil

    folder = tmp_path / "ckpt"
    first = run_distributed(D.trace, 2, "dp=2", 5, data="blocks", checkpoint=str(folder),
                            stop_after=3, timeout=120)
    assert [len(r["ids"]) for r in first] == [3, 3]
    shutil.copytree(folder, tmp_path / "same")
    resumed = run_distributed(D.trace, 2, "tp=2", 5, data="blocks", checkpoint=str(folder),
                              timeout=120)
    want = stream_one_device["batches"] + stream_one_device["batches"][:1]
    assert _global_batches(resumed) == want[3:5]
    losses, state = D.one_device_run(want)
    for r in resumed:
        _assert_trains(r["losses"], r["state"], losses[3:], state)
    again = run_distributed(D.trace, 2, "dp=2", 5, data="blocks",
                            checkpoint=str(tmp_path / "same"), timeout=120)
    whole = run_distributed(D.trace, 2, "dp=2", 5, data="blocks", timeout=120)
    for a, b in zip(again, whole, strict=True):
        assert a["ids"] == b["ids"][3:] and a["losses"] == b["losses"][3:]
        assert all(torch.equal(a["state"][n], t) for n, t in b["state"].items())
