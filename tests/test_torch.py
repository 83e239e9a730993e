"""``asynchdf5.torch``: the datasets with PyTorch's DataLoader and torchdata's StatefulDataLoader.

The rows encode their global index (``label == i``, ``data == [10 i, 10 i + 1]``), so every
batch is checked for alignment and every epoch for exactly-once from the tensors alone. Worker
processes are real (forked; spawned in one slow test, which ``nox -s integration`` runs). Real
``torchrun`` runs are in ``test_torchrun``.
"""

from __future__ import annotations

import gc
import importlib
import pickle
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import asynchdf5._sizing
import asynchdf5.torch
import asynchdf5.torch._dataset
from asynchdf5 import ConfigurationError, StateError
from asynchdf5.torch import HDF5IterableDataset, MemoryIterableDataset

from ._fake_cupy import FakeCupy
from ._files import check_exactly_once, rows, write_source
from ._interrupts import sweep, traced
from ._leaks import assert_released, snapshot

pytestmark = [
    pytest.mark.timeout(60),
    # 3 workers on a 2-core machine: torch suggests fewer; the tests want 3 all the same.
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

SIZES = (250, 13, 337)  # three files: shards and batches cut across them
N = sum(SIZES)
BATCH = 32

Dataset = HDF5IterableDataset | MemoryIterableDataset
Tensors = dict[str, torch.Tensor]


@pytest.fixture(params=["memory", "hdf5"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    src, _ = write_source(tmp_path / "data", SIZES)
    return src


_made: list[Dataset] = []


@pytest.fixture(autouse=True)
def close_datasets() -> Iterator[None]:
    """Close every dataset a test made (before the leak check), whatever happened."""
    yield
    while _made:
        _made.pop().close()


def make(kind: str, source: Path, **kw: Any) -> Dataset:
    """A dataset over the same samples, from memory or from the files."""
    kw.setdefault("batch_size", BATCH)
    kw.setdefault("indices", True)
    ds: Dataset
    if kind == "memory":
        ds = MemoryIterableDataset(rows(0, N), **kw)
    else:
        ds = HDF5IterableDataset(source, **kw)
    _made.append(ds)
    return ds


def check(batch: Tensors) -> list[int]:
    """One batch: tensors, aligned rows; its indices."""
    idx, data, label = batch["indices"], batch["data"], batch["label"]
    assert isinstance(data, torch.Tensor) and data.dtype == torch.float32
    assert idx.dtype == label.dtype == torch.int64
    assert torch.equal(label, idx)
    assert torch.equal(data[:, 0], (idx * 10).float())
    assert torch.equal(data[:, 1], (idx * 10 + 1).float())
    return [int(i) for i in idx]


def epoch(loader: Iterable[Tensors]) -> list[Tensors]:
    return list(loader)


def indices(batches: Iterable[Tensors]) -> list[list[int]]:
    return [check(b) for b in batches]


def exactly_once(batches: Iterable[Tensors]) -> None:
    seen = np.concatenate([np.asarray(i, np.int64) for i in indices(batches)])
    np.testing.assert_array_equal(np.sort(seen), np.arange(N))


def same(a: list[Tensors], b: list[Tensors]) -> None:
    """The same batches: indices and bytes."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


# --- the module --------------------------------------------------------------------------------


def test_import_without_torch_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # what an absent module looks like
    monkeypatch.delitem(sys.modules, "asynchdf5.torch")
    with pytest.raises(ImportError, match=r'pip install "\.\[torch\]" in the asynchdf5 checkout'):
        importlib.import_module("asynchdf5.torch")


def test_the_checked_loader_without_torchdata_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)
    monkeypatch.delitem(sys.modules, "asynchdf5.torch._loader", raising=False)
    with pytest.raises(ImportError, match=r"needs torchdata.*\.\[torch\]"):
        asynchdf5.torch.StatefulDataLoader  # noqa: B018


def test_importing_asynchdf5_never_imports_torch() -> None:
    code = "import sys, asynchdf5; print('torch' in sys.modules, 'asynchdf5.torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_public_names() -> None:
    assert asynchdf5.torch.__all__ == [
        "HDF5IterableDataset",
        "MemoryIterableDataset",
        "StatefulDataLoader",
    ]
    assert issubclass(asynchdf5.torch.StatefulDataLoader, StatefulDataLoader)
    assert issubclass(HDF5IterableDataset, torch.utils.data.IterableDataset)
    assert issubclass(MemoryIterableDataset, torch.utils.data.IterableDataset)


# --- DataLoader --------------------------------------------------------------------------------


def interleaved(plan: list[list[int]], workers: int) -> list[list[int]]:
    """The DataLoader's round robin over ``workers`` workers, each serving a contiguous run of
    ``plan`` (the first ``len % workers`` runs one batch longer)."""
    q, r = divmod(len(plan), workers)
    runs, start = [], 0
    for w in range(workers):
        runs.append(plan[start : start + q + (w < r)])
        start += q + (w < r)
    return [run[i] for i in range(q + 1) for run in runs if i < len(run)]


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_dataloader_serves_every_sample_once_per_epoch(
    kind: str, source: Path, workers: int
) -> None:
    """600 samples in batches of 32: 19 batches with any number of workers, the DataLoader's
    only (the dataset is not told): the workers serve contiguous runs of the rank's batches,
    interleaved by the round robin, and len(loader) says 19."""
    plain = make(kind, source, shuffle=True, seed=1)
    plans = [indices(epoch(DataLoader(plain, batch_size=None))) for _ in range(2)]
    ds = make(kind, source, shuffle=True, seed=1)
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    assert len(ds) == len(loader) == 19
    orders = []
    for e in range(2):
        assert ds.epoch == e
        got = epoch(loader)
        assert len(got) == 19
        exactly_once(got)
        orders.append(indices(got))
        assert orders[-1] == interleaved(plans[e], max(workers, 1))
    assert orders[0] != orders[1]  # each epoch its own order
    assert ds.epoch == 2
    ds.close()


def test_a_loader_with_more_workers_goes_on_with_the_next_epoch(source: Path) -> None:
    """Two epochs with 2 workers, then a loader with 3 over the same dataset: its third worker
    (an id the first loader had not) serves the same epoch as the other two."""
    plain = make("memory", source, shuffle=True, seed=13)
    plans = [indices(epoch(DataLoader(plain, batch_size=None))) for _ in range(3)]
    ds = make("memory", source, shuffle=True, seed=13)
    two = DataLoader(ds, batch_size=None, num_workers=2)
    assert [indices(epoch(two)) for _ in range(2)] == [interleaved(p, 2) for p in plans[:2]]
    assert indices(epoch(DataLoader(ds, batch_size=None, num_workers=3))) == interleaved(
        plans[2], 3
    )


def test_unshuffled_batches_come_in_source_order(source: Path) -> None:
    with make("hdf5", source) as ds:
        got = np.concatenate([np.asarray(i) for i in indices(DataLoader(ds, batch_size=None))])
    np.testing.assert_array_equal(got, np.arange(N))


def test_batches_without_indices_hold_the_tops(source: Path) -> None:
    with make("hdf5", source, indices=False) as ds:
        batch = next(iter(DataLoader(ds, batch_size=None)))
    assert set(batch) == {"data", "label"}
    assert batch["data"].shape == (BATCH, 2)


@pytest.mark.parametrize("persistent", [False, True])
def test_epochs_advance_and_set_epoch_with_workers(
    kind: str, source: Path, persistent: bool
) -> None:
    """Fresh workers every epoch (or persistent ones) go on with the next epoch, and
    set_epoch in the main process reaches them."""

    def loader(ds: Dataset) -> DataLoader[Tensors]:
        return DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)

    a = make(kind, source, shuffle=True, seed=3)
    la = loader(a)
    first = [indices(epoch(la)) for _ in range(3)]
    assert a.epoch == 3
    assert len({str(e) for e in first}) == 3
    a.set_epoch(1)
    assert a.epoch == 1
    assert indices(epoch(la)) == first[1]
    assert indices(epoch(la)) == first[2]
    del la

    b = make(kind, source, shuffle=True, seed=3)
    b.set_epoch(2)
    assert indices(epoch(loader(b))) == first[2]


def test_set_epoch_without_workers(kind: str, source: Path) -> None:
    a = make(kind, source, shuffle=True, seed=3)
    b = make(kind, source, shuffle=True, seed=3)
    with a, b:
        loader = DataLoader(a, batch_size=None)
        first = [indices(epoch(loader)) for _ in range(3)]
        b.set_epoch(2)
        assert b.epoch == 2
        assert indices(epoch(DataLoader(b, batch_size=None))) == first[2]
        # An epoch left suspended (its iterator still referenced) is abandoned.
        it = iter(loader)
        next(it)
        a.set_epoch(1)
        assert indices(epoch(loader)) == first[1]
        with pytest.raises(StopIteration):
            next(it)


def test_a_new_iteration_abandons_a_suspended_one(source: Path) -> None:
    """As with a layer, leaving an epoch early: the next iteration is the next epoch."""
    a = make("hdf5", source, shuffle=True, seed=4)
    b = make("hdf5", source, shuffle=True, seed=4)
    with a, b:
        full = [indices(epoch(DataLoader(b, batch_size=None))) for _ in range(2)]
        loader = DataLoader(a, batch_size=None)
        it = iter(loader)
        assert check(next(it)) == full[0][0]
        assert indices(epoch(loader)) == full[1]


def test_workers_under_an_initialised_process_group(tmp_path: Path) -> None:
    """Forked workers inherit the initialised group (its rank and world size) and still serve
    their own shares of it; with shuffle=True and seed=None the workers agree on the seed."""
    store = dist.FileStore(str(tmp_path / "store"), 1)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ds = MemoryIterableDataset(rows(0, N), batch_size=BATCH, shuffle=True, indices=True)
        assert (ds.rank, ds.world_size) == (0, 1)
        exactly_once(epoch(DataLoader(ds, batch_size=None, num_workers=2)))
    finally:
        dist.destroy_process_group()
    del store
    gc.collect()


@pytest.fixture(scope="module")
def resource_tracker() -> None:
    """multiprocessing's resource tracker, which spawning starts once per process and keeps
    (with a pipe to it): started before the leak check's snapshot of open descriptors."""
    import multiprocessing.resource_tracker

    multiprocessing.resource_tracker.ensure_running()


@pytest.mark.slow
@pytest.mark.integration  # two interpreters start and import torch: in nox -s integration
def test_spawned_workers(resource_tracker: None, source: Path) -> None:
    """The "spawn" start method: the dataset is pickled to the workers, the next epoch is
    shared through shared memory all the same."""
    ds = make("hdf5", source, shuffle=True, seed=5)
    loader = DataLoader(
        ds, batch_size=None, num_workers=2, multiprocessing_context="spawn", persistent_workers=True
    )
    first = epoch(loader)
    exactly_once(first)
    second = epoch(loader)
    exactly_once(second)
    assert indices(first) != indices(second)
    assert ds.epoch == 2


# --- tensors -----------------------------------------------------------------------------------


def test_tensors_share_the_batch_memory() -> None:
    """Zero-copy: each tensor is the array the layer made (here, what a transformer returned)."""
    made: list[tuple[int, int]] = []

    def record(x: np.ndarray) -> np.ndarray:
        made.append((x.ctypes.data, x.nbytes))
        return x

    ds = MemoryIterableDataset(rows(0, N), batch_size=BATCH, transformers=[("data", record)])
    with ds:
        batches = epoch(DataLoader(ds, batch_size=None))
    # (the layer goes on gathering the next epoch's first batches meanwhile)
    assert [(b["data"].data_ptr(), b["data"].nbytes) for b in batches] == made[: len(batches)]


@pytest.mark.parametrize("workers", [0, 2])
def test_kept_tensors_are_never_overwritten(kind: str, source: Path, workers: int) -> None:
    """A training loop may keep batches: the layer reuses a buffer only once no tensor refers
    to it (small batches, a short prefetch: buffers would come round again many times)."""
    ds = make(kind, source, batch_size=8, prefetch=2, shuffle=True, seed=6)
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    kept = [epoch(loader) for _ in range(3)]
    for got in kept:
        exactly_once(got)  # checks every kept tensor's values against its indices
    ds.close()


def test_conversion_copies_only_what_torch_cannot_share() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = asynchdf5.torch._dataset.as_tensor(a)
    assert t.data_ptr() == a.ctypes.data
    readonly = a.copy()
    readonly.flags.writeable = False
    for odd in (readonly, a[::-1], np.broadcast_to(a[0], (3, 4))):
        t = asynchdf5.torch._dataset.as_tensor(odd)  # no warning, no error: a copy
        assert torch.equal(t, torch.from_numpy(np.array(odd)))


# --- resume ------------------------------------------------------------------------------------


def stateful(kind: str, source: Path, workers: int, **kw: Any) -> StatefulDataLoader:
    ds = make(kind, source, shuffle=True, seed=7)
    return StatefulDataLoader(ds, batch_size=None, num_workers=workers, **kw)


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_stateful_dataloader_resumes_mid_epoch_exactly(
    kind: str, source: Path, workers: int
) -> None:
    """torchdata's pattern: the state taken in the loop after batch k, then the job dies; a new
    loader over a new dataset continues with batch k + 1, the same bytes, and the next epoch
    is the uninterrupted run's (k = 0, 7 and 18, against one uninterrupted run)."""
    whole = stateful(kind, source, workers)
    reference = [epoch(whole), epoch(whole)]

    for k in (0, 7, 18):
        first = stateful(kind, source, workers)
        for i, _ in enumerate(first):
            if i == k:
                state = first.state_dict()
                break
        del first

        again = stateful(kind, source, workers)
        again.load_state_dict(state)
        same(epoch(again), reference[0][k + 1 :])
        same(epoch(again), reference[1])


@pytest.mark.parametrize(("workers", "every"), [(0, 1), (2, 1), (2, 3)])
def test_stateful_dataloader_state_taken_while_the_run_goes_on(
    kind: str, source: Path, workers: int, every: int
) -> None:
    """The other pattern: ``next()`` k times, the state, and the same loop goes on unchanged;
    with ``snapshot_every_n_steps`` > 1 the loader replays the batches since its snapshot."""
    whole = stateful(kind, source, workers)
    reference = epoch(whole)

    run = stateful(kind, source, workers, snapshot_every_n_steps=every)
    it = iter(run)
    got = [next(it) for _ in range(8)]
    state = run.state_dict()
    got += list(it)
    same(got, reference)  # taking the state changed nothing

    again = stateful(kind, source, workers, snapshot_every_n_steps=every)
    again.load_state_dict(state)
    same(epoch(again), reference[8:])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("when", ["after the last batch", "after the epoch"])
def test_stateful_dataloader_state_at_the_end_of_an_epoch(
    source: Path, workers: int, when: str
) -> None:
    """A state taken after the last batch (before the loop asked for more), or after the loop
    ended: the resumed loader has nothing left of that epoch, then the next epoch whole."""
    whole = stateful("hdf5", source, workers)
    reference = [epoch(whole), epoch(whole)]

    run = stateful("hdf5", source, workers)
    it = iter(run)
    for _ in range(len(reference[0])):
        next(it)
    if when == "after the epoch":
        with pytest.raises(StopIteration):
            next(it)
    state = run.state_dict()
    del it, run

    again = stateful("hdf5", source, workers)
    again.load_state_dict(state)
    rest = epoch(again)
    if rest:  # the "after the epoch" state: the loader goes straight to the next epoch
        same(rest, reference[1])
    else:
        same(epoch(again), reference[1])


def test_dataset_state_with_a_plain_dataloader(kind: str, source: Path) -> None:
    """num_workers=0: the dataset's own state, saved as JSON, resumes a plain DataLoader."""
    import json

    a = make(kind, source, shuffle=True, seed=8)
    loader = DataLoader(a, batch_size=None)
    reference = epoch(loader)
    assert a.state_dict()["epoch"] == 1
    b = make(kind, source, shuffle=True, seed=8)
    it = iter(DataLoader(b, batch_size=None))
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(b.state_dict()))
    assert (state["epoch"], state["batches"]) == (0, 5)

    c = make(kind, source, shuffle=True, seed=8)
    c.load_state_dict(state)
    assert len(c) == len(reference)  # the epoch's, as StatefulDataLoader counts (5 are done)
    same(epoch(DataLoader(c, batch_size=None)), reference[5:])
    for ds in (a, b, c):
        ds.close()


def test_seed_none_takes_the_saved_seed(source: Path) -> None:
    a = make("hdf5", source, shuffle=True)  # seed=None: drawn
    reference = epoch(DataLoader(a, batch_size=None))
    a.set_epoch(0)
    it = iter(DataLoader(a, batch_size=None))
    next(it)
    state = a.state_dict()
    del it
    b = make("hdf5", source, shuffle=True)
    assert b.seed != a.seed
    b.load_state_dict(state)
    assert b.seed == a.seed
    same(epoch(DataLoader(b, batch_size=None)), reference[1:])
    a.close()
    b.close()


# --- copies, closing ---------------------------------------------------------------------------


def test_pickled_dataset_goes_on_from_the_next_epoch(
    source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy (here pickled, after the working directory changed: the paths were resolved at
    construction) builds its own layer and serves what the original serves next."""
    monkeypatch.chdir(source.parent)
    ds = HDF5IterableDataset("train.txt", batch_size=BATCH, shuffle=True, seed=9, indices=True)
    monkeypatch.chdir(source.parent.parent)
    loader = DataLoader(ds, batch_size=None)
    epoch(loader)  # the original's layer is open now
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.epoch == 1
    theirs = epoch(DataLoader(copy, batch_size=None))
    same(epoch(loader), theirs)
    copy.close()
    ds.close()


def test_close_releases_everything_and_the_next_epoch_reopens(source: Path) -> None:
    reference = make("hdf5", source, shuffle=True, seed=10)
    with reference:
        ref = [epoch(DataLoader(reference, batch_size=None)) for _ in range(2)]
    before = snapshot()
    ds = make("hdf5", source, shuffle=True, seed=10)
    loader = DataLoader(ds, batch_size=None)
    it = iter(loader)
    next(it)  # the pipeline runs now, in the middle of an epoch
    ds.close()
    assert_released(before)
    with pytest.raises(StopIteration):  # the abandoned epoch's iterator is over
        next(it)
    same(epoch(loader), ref[1])  # reopened: the epoch after the abandoned one
    ds.close()
    ds.close()  # idempotent
    assert_released(before)


def test_garbage_collection_closes_the_pipeline(source: Path) -> None:
    before = snapshot()
    ds = HDF5IterableDataset(source, batch_size=BATCH)  # (not kept by make's list)
    it = iter(DataLoader(ds, batch_size=None))
    next(it)
    del ds, it
    gc.collect()
    assert_released(before)


def test_leaving_the_with_block_closes(source: Path) -> None:
    before = snapshot()
    with make("memory", source) as ds:
        next(iter(DataLoader(ds, batch_size=None)))
    assert_released(before)


# --- errors ------------------------------------------------------------------------------------


def test_the_deprecated_num_workers_must_agree(
    source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dataset's own num_workers= (deprecated: a DeprecationWarning) still works when it
    is the DataLoader's; a worker of a DataLoader with another number refuses to serve (in this
    process, as a worker: through a real worker the error is the same, but torch then takes
    10 s to stop its workers)."""
    with pytest.warns(DeprecationWarning, match="set it on the DataLoader only"):
        ds = make("memory", source, shuffle=True, seed=2, num_workers=2)
    got = epoch(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(got) == len(ds) == 19
    exactly_once(got)
    worker = pickle.loads(pickle.dumps(ds))  # what a spawned worker gets
    info = SimpleNamespace(id=1, num_workers=3)
    monkeypatch.setattr(asynchdf5.torch._dataset, "get_worker_info", lambda: info)
    with pytest.raises(ConfigurationError, match="made with num_workers=2, but DataLoader"):
        next(iter(worker))


@pytest.mark.parametrize("cache_bytes", [None, 2**20])
def test_workers_share_the_budgets(
    source: Path, monkeypatch: pytest.MonkeyPatch, cache_bytes: int | None
) -> None:
    """Each of k workers' layers gets 1/k of a given cache budget (of the default, 1/(k + 1):
    the workers' own memory counts too) and of the batches read ahead, and every worker plans
    with the same chunks."""
    ds = make("hdf5", source, prefetch=8, cache_bytes=cache_bytes)
    chunks = []
    for w in range(4):
        worker = pickle.loads(pickle.dumps(ds))  # what a spawned worker gets
        info = SimpleNamespace(id=w, num_workers=4)
        monkeypatch.setattr(asynchdf5.torch._dataset, "get_worker_info", lambda i=info: i)
        c = worker._this_layer().config
        budget = 2**18 if cache_bytes else asynchdf5._sizing.default_cache_bytes(held=False) // 5
        assert (c.cache_bytes, c.prefetch) == (budget, 2)
        assert len(worker) == [5, 5, 5, 4][w]  # 19 batches of the rank, in runs
        chunks.append(worker._this_layer().state_dict()["fingerprint"]["chunk_rows"])
    assert len(set(chunks)) == 1


def test_a_worker_state_resumes_only_the_same_worker(source: Path) -> None:
    """A worker's state counts batches of its run: another worker (or a dataset without
    workers) refuses it."""
    run = stateful("memory", source, 2)
    it = iter(run)
    for _ in range(3):
        next(it)
    state = run.state_dict()
    (_, worker0), *_ = sorted(state["_snapshot"]["_worker_snapshots"].items())
    layer_state = worker0["dataset_state"]
    assert layer_state["part"] == [0, 2]
    with pytest.raises(ConfigurationError, match="part 0 of 2"):
        make("memory", source, shuffle=True, seed=7).load_state_dict(layer_state)


@pytest.mark.parametrize(("saved", "loaded"), [(2, 0), (0, 2), (2, 3)])
def test_a_loader_state_from_another_worker_count_is_refused_when_loaded(
    source: Path, saved: int, loaded: int
) -> None:
    """torchdata's loader ended in its own AssertionError at the next iteration for 2 workers
    into 0 ('_num_yielded') and 0 into 2 ('_snapshot'), before the dataset saw the state
    (issue 39, item 4): asynchdf5.torch's StatefulDataLoader refuses it when it is loaded."""
    from asynchdf5.torch import StatefulDataLoader as Checked

    def loader(workers: int) -> Checked:
        ds = make("memory", source, shuffle=True, seed=7)
        return Checked(ds, batch_size=None, num_workers=workers)

    first = loader(saved)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    del it, first
    again = loader(loaded)
    with pytest.raises(ConfigurationError, match=f"make the loader with num_workers={saved}"):
        again.load_state_dict(state)
    same = loader(saved)  # the fix the message names resumes: batch 4 comes next
    same.load_state_dict(state)
    reference = [b["indices"].tolist() for b in loader(saved)]
    assert next(iter(same))["indices"].tolist() == reference[4]


def test_a_loader_out_of_order_with_workers_refuses_to_save_a_state(source: Path) -> None:
    """``in_order=False`` with 2 workers: torchdata's state says nothing of which batches it
    handed over, and resumed runs repeated some and lost others (one worker slowed by a
    transformer: 17 of 20 break points of an epoch of 3,000 samples); asynchdf5.torch's
    StatefulDataLoader refuses to save it, and still serves whole epochs out of order."""
    from asynchdf5.torch import StatefulDataLoader as Checked

    loader = Checked(
        make("hdf5", source, shuffle=True, seed=7), batch_size=None, num_workers=2, in_order=False
    )
    it = iter(loader)
    next(it)
    with pytest.raises(ConfigurationError, match="in_order=True"):
        loader.state_dict()
    del it
    check_exactly_once((b["indices"] for b in loader), N)
    one = Checked(make("hdf5", source), batch_size=None, num_workers=1, in_order=False)
    assert one.state_dict() is not None  # one worker hands its batches over in order


def test_with_workers_the_main_process_neither_iterates_nor_saves(source: Path) -> None:
    ds = make("memory", source)
    exactly_once(epoch(DataLoader(ds, batch_size=None, num_workers=2)))
    with pytest.raises(StateError, match="through a DataLoader"):
        iter(ds)
    with pytest.raises(StateError, match="StatefulDataLoader"):
        ds.state_dict()
    with pytest.raises(StateError, match="StatefulDataLoader"):
        ds.load_state_dict({})


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_workers": -1}, "num_workers must be an int >= 0"),
        ({"num_workers": True}, "num_workers must be an int >= 0"),
        ({"indices": 1}, "indices must be True or False"),
        ({"batch_size": 0}, "batch_size"),
        ({"shuffle": True, "world_size": 2, "rank": 0}, "explicit seed"),
    ],
)
def test_bad_properties_fail_at_construction(source: Path, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        make("hdf5", source, **kw)


def test_the_datasets_pass_the_layers_properties_through() -> None:
    """The adapter's keywords are the layer's, typed by the same registry (no list of its own):
    every property reaches the layer, and a keyword that is none is refused as the layer does."""
    import inspect

    from asynchdf5._config import HDF5Properties, Properties

    for cls, props in ((HDF5IterableDataset, HDF5Properties), (MemoryIterableDataset, Properties)):
        keywords = inspect.signature(cls.__init__).parameters["properties"]
        assert keywords.annotation == f"Unpack[{props.__name__}]", cls
        assert vars(asynchdf5.torch)[props.__name__] is props
    ds = MemoryIterableDataset({"x": np.arange(8)}, batch_size=2, prefetch=3, drop_last=True)
    with ds:
        assert ds._this_layer().config.prefetch == 3
        assert ds._this_layer().config.drop_last
    with pytest.raises(TypeError, match="unexpected keyword argument 'chunk_size'"):
        MemoryIterableDataset({"x": np.arange(8)}, batch_size=2, chunk_size=4)  # type: ignore[call-arg]


def test_indices_must_not_shadow_a_top() -> None:
    with pytest.raises(ConfigurationError, match="already a top's name"):
        MemoryIterableDataset({"indices": np.arange(4)}, batch_size=2, indices=True)


# --- device batches ----------------------------------------------------------------------------


def test_device_batches_go_through_dlpack(fake_cupy: FakeCupy) -> None:
    """The stand-in's "device" arrays are host memory: DLPack gives CPU tensors over them."""
    made: list[int] = []

    def record(x: Any) -> Any:
        made.append(x.ctypes.data)
        return x

    data = rows(0, N)
    ds = MemoryIterableDataset(
        data, batch_size=BATCH, device="cuda", indices=True, transformers=[("data", record)]
    )
    with ds:
        batches = epoch(DataLoader(ds, batch_size=None))
    exactly_once(batches)
    assert [b["data"].data_ptr() for b in batches] == made[: len(batches)]


def test_device_batches_need_num_workers_0(
    fake_cupy: FakeCupy, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = MemoryIterableDataset(rows(0, N), batch_size=BATCH, device="cuda")
    worker = pickle.loads(pickle.dumps(ds))  # what a spawned worker gets
    info = SimpleNamespace(id=0, num_workers=2)
    monkeypatch.setattr(asynchdf5.torch._dataset, "get_worker_info", lambda: info)
    with pytest.raises(ConfigurationError, match="device batches need num_workers=0"):
        next(iter(worker))


@pytest.mark.gpu
def test_gpu_batches_are_cuda_tensors(cupy_gpu: Any, torch_cuda: Any, source: Path) -> None:
    host = make("hdf5", source, shuffle=True, seed=11)
    dev = make("hdf5", source, shuffle=True, seed=11, device="cuda")
    with host, dev:
        h = epoch(DataLoader(host, batch_size=None))
        d = epoch(DataLoader(dev, batch_size=None))
    for hb, db in zip(h, d, strict=True):
        assert db["data"].is_cuda and db["label"].is_cuda and not db["indices"].is_cuda
        for key in hb:
            assert torch.equal(db[key].cpu(), hb[key])


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <generator object EpochIterator._bridged"
    ":pytest.PytestUnraisableExceptionWarning"
)
def test_a_ctrl_c_at_any_place_of_a_dataloader_step_leaves_the_dataset_serving() -> None:
    """SIGINT at each place in turn of the caller's side of a DataLoader (``num_workers=0``)
    opening the dataset's layer, taking two batches and being dropped (a ``break``): the next
    epoch through the loader is whole, and the dataset closes with nothing left. (A Ctrl-C in
    the ``finally`` of the layer's ``for`` generator, which the drop closes from its
    finalizer, is printed as "Exception ignored" and lost, as in any finalizer: allowed.)
    An interrupt as the layer's opening returned left it open without the dataset knowing:
    the next epoch's opening failed ("already open"), and close() left its threads running."""
    n, size = 40, 4
    ds = MemoryIterableDataset(rows(0, n), batch_size=size, indices=True)
    loader = DataLoader(ds, batch_size=None)

    def trip() -> None:
        batches = iter(loader)
        next(batches)
        next(batches)
        del batches  # what a break does: the epoch is left

    def whole(_: int) -> None:
        seen = [b["indices"].numpy() for b in loader]
        assert all(len(i) == size for i in seen)
        check_exactly_once(seen, n)
        ds.close()  # the next trip opens the layer again

    before = snapshot()
    files = traced(
        "asynchdf5/torch/_dataset.py",
        "asynchdf5/_iterator.py",
        "asynchdf5/_layer.py",
        "asynchdf5/_sync.py",
        "asynchdf5/_interrupts.py",
    )
    assert sweep(trip, whole, files) > 20
    ds.close()
    assert_released(before, strict=False)
