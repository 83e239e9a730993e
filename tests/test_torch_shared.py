"""DataLoader workers hand batches to the main process through shared memory
(``asynchdf5.torch._shared``), not through torch's fresh shared memory per tensor: a worker's
layer gathers batches into shared memory and the main process rebuilds them there (a batch
outside it, such as a transformer's fresh output, is copied into a slot first), the tensors
stay right while later batches reuse the memory, a loop that keeps more batches than the pool
and the slots hold gets plain tensors (nothing waits), and every epoch is still every sample
once, aligned."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from asynchdf5._delivery import HostDelivery
from asynchdf5._process import Segment
from asynchdf5.torch import HDF5IterableDataset, _shared

from ._files import write_source

pytestmark = [pytest.mark.timeout(60)]


@pytest.mark.parametrize("keep", [False, True])
def test_workers_send_batches_through_shared_memory(tmp_path: Path, keep: bool) -> None:
    source, _ = write_source(tmp_path / "data", (250, 13, 337))
    rebuilt = 0  # batches whose tensors view our memory (torch's own are "shared" storages)
    with HDF5IterableDataset(source, batch_size=16, shuffle=True, seed=4, indices=True) as ds:
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        for _ in range(2):
            kept: list[dict[str, torch.Tensor]] = []
            seen: list[int] = []
            for batch in loader:
                assert torch.equal(batch["label"], batch["indices"])
                assert torch.equal(batch["data"][:, 0], batch["indices"].float() * 10)
                seen += batch["indices"].tolist()
                rebuilt += not batch["label"].is_shared()
                if keep:
                    kept.append(batch)
            assert sorted(seen) == list(range(600))
            for batch in kept:  # still the same bytes after the memory was reused
                assert torch.equal(batch["label"], batch["indices"])
                assert torch.equal(batch["data"][:, 0], batch["indices"].float() * 10)
    assert rebuilt == 2 * len(loader)  # every batch through our shared memory


def test_a_loop_keeping_every_batch_gets_tensors_once_the_memory_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One batch a group, no groups held beyond the layer's and two slots: a loop that keeps
    every batch holds the pool, then the slots; the batches after come as plain tensors, and
    every batch kept is still right (nothing reused under it)."""
    monkeypatch.setattr(HostDelivery, "group_batches", 1)
    monkeypatch.setattr(_shared.Ring, "held", 0)
    monkeypatch.setattr(_shared, "SLOTS", 2)
    source, _ = write_source(tmp_path / "data", (250, 13, 337))
    rebuilt = 0
    with HDF5IterableDataset(source, batch_size=16, shuffle=True, seed=4, indices=True) as ds:
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        kept = list(loader)
        for batch in kept:
            assert torch.equal(batch["label"], batch["indices"])
            assert torch.equal(batch["data"][:, 0], batch["indices"].float() * 10)
            rebuilt += not batch["label"].is_shared()
        assert sorted(torch.cat([b["indices"] for b in kept]).tolist()) == list(range(600))
    assert 0 < rebuilt < len(kept)


@pytest.mark.parametrize("fresh", [False, True])
def test_batches_cross_from_the_memory_they_were_gathered_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: bool
) -> None:
    """Without slots, a batch gathered into the pool's shared memory still crosses there (it
    is never copied); one whose transformer made new arrays needs a slot, and without one
    comes as plain tensors."""
    monkeypatch.setattr(_shared, "SLOTS", 0)
    source, _ = write_source(tmp_path / "data", (250, 13, 337))

    def same(x: np.ndarray) -> np.ndarray:
        return x

    def new(x: np.ndarray) -> np.ndarray:
        return np.array(x)

    transformers = [("data", new if fresh else same)]
    with HDF5IterableDataset(
        source, batch_size=16, shuffle=True, seed=4, indices=True, transformers=transformers
    ) as ds:
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        seen: list[int] = []
        for batch in loader:
            assert batch["label"].is_shared() == fresh
            assert torch.equal(batch["data"][:, 0], batch["indices"].float() * 10)
            seen += batch["indices"].tolist()
        assert sorted(seen) == list(range(600))


def test_a_slot_descriptor_crosses_once_and_ended_workers_are_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment's descriptor goes with its first batch only (a descriptor crossing costs a
    connection to the worker); the main process keeps the segment mapped for the later ones,
    and drops the mappings of workers that have ended once new ones send (no memory held for
    every epoch's fresh workers)."""
    source, _ = write_source(tmp_path / "data", (250, 13, 337))
    mapped = 0  # segments mapped in this process: one per descriptor received

    class Counted(Segment):
        def __init__(self, fd: int, size: int) -> None:
            nonlocal mapped
            mapped += 1  # in the workers too, on their own copy of the count
            super().__init__(fd, size)

    monkeypatch.setattr(_shared, "Segment", Counted)
    with HDF5IterableDataset(source, batch_size=16, shuffle=True, seed=4, indices=True) as ds:
        loader = DataLoader(ds, batch_size=None, num_workers=2)  # fresh workers every epoch
        batches = 0
        for _ in range(3):
            seen: list[int] = []
            for batch in loader:
                assert torch.equal(batch["label"], batch["indices"])
                assert not batch["label"].is_shared()  # through our shared memory
                seen += batch["indices"].tolist()
                batches += 1
            assert sorted(seen) == list(range(600))
        assert batches == 3 * 38
        assert mapped <= 3 * 2 * _shared.SLOTS  # not one per batch
        rings = {token for token, _ in _shared._MAPPED}
        assert len(rings) <= 2  # the last epoch's workers' only


def test_a_deep_prefetch_still_finds_shared_memory(tmp_path: Path) -> None:
    """``prefetch_factor=8`` keeps eight batches of each worker in flight: every one still goes
    through our shared memory (a worker falling back to torch's fresh shared memory is many
    times slower)."""
    source, _ = write_source(tmp_path / "data", (250, 13, 337))
    with HDF5IterableDataset(source, batch_size=16, shuffle=True, seed=4, indices=True) as ds:
        loader = DataLoader(ds, batch_size=None, num_workers=2, prefetch_factor=8)
        seen: list[int] = []
        for batch in loader:
            assert not batch["label"].is_shared()  # through our shared memory
            assert torch.equal(batch["label"], batch["indices"])
            seen += batch["indices"].tolist()
        assert sorted(seen) == list(range(600))
