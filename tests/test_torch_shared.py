"""DataLoader workers hand batches to the main process through reused slots of shared memory
(``asynchdf5.torch._shared``), not through torch's fresh shared memory per tensor: the main
process rebuilds them from the slots, the tensors stay right while later batches reuse other
slots, a loop that keeps more batches than there are slots gets plain tensors (nothing waits),
and every epoch is still every sample once, aligned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from asynchdf5._process import Segment
from asynchdf5.torch import HDF5IterableDataset, _shared

from ._files import write_source

pytestmark = [pytest.mark.timeout(60)]


@pytest.mark.parametrize("keep", [False, True])
def test_workers_send_batches_through_slots(tmp_path: Path, keep: bool) -> None:
    source, _ = write_source(tmp_path / "data", (250, 13, 337))
    rebuilt = 0  # batches whose tensors view a slot (torch's own are "shared" storages)
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
                if keep:  # more than the slots: the rest come as plain tensors
                    kept.append(batch)
            assert sorted(seen) == list(range(600))
            for batch in kept:  # still the same bytes after the slots were reused
                assert torch.equal(batch["label"], batch["indices"])
    n = 2 * len(loader)
    if keep:
        assert 0 < rebuilt < n
    else:
        assert rebuilt == n  # every batch through a slot


def test_a_slot_descriptor_crosses_once_and_ended_workers_are_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot's descriptor goes with its first batch only (a descriptor crossing costs a
    connection to the worker); the main process keeps the slot mapped for the later ones, and
    drops the mappings of workers that have ended once new ones send (no memory held for
    every epoch's fresh workers)."""
    source, _ = write_source(tmp_path / "data", (250, 13, 337))
    mapped = 0  # slots mapped in this process: one per descriptor received

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
                assert not batch["label"].is_shared()  # through a slot
                seen += batch["indices"].tolist()
                batches += 1
            assert sorted(seen) == list(range(600))
        assert batches == 3 * 38
        assert mapped <= 3 * 2 * _shared.SLOTS  # not one per batch
        rings = {token for token, _ in _shared._MAPPED}
        assert len(rings) <= 2  # the last epoch's workers' only


def test_a_deep_prefetch_still_finds_slots(tmp_path: Path) -> None:
    """``prefetch_factor=8`` keeps eight batches of each worker in flight: every one still goes
    through a slot (a worker falling back to torch's fresh shared memory is many times slower)."""
    source, _ = write_source(tmp_path / "data", (250, 13, 337))
    with HDF5IterableDataset(source, batch_size=16, shuffle=True, seed=4, indices=True) as ds:
        loader = DataLoader(ds, batch_size=None, num_workers=2, prefetch_factor=8)
        seen: list[int] = []
        for batch in loader:
            assert not batch["label"].is_shared()  # through a slot
            assert torch.equal(batch["label"], batch["indices"])
            seen += batch["indices"].tolist()
        assert sorted(seen) == list(range(600))
