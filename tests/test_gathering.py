"""The gathering stage: two workers gather whole groups, and the consumer gets them in order.

A group that takes longer than the one queued after it (here: made slow on purpose) must not
change what the consumer sees: the same batches in the same order as when every group takes the
same time, every sample once; and an error in a group ends the epoch after exactly the batches
of the groups before it, even when groups after it were finished first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import asynchdf5._gathering as gathering
from asynchdf5 import AsyncHDF5DataLayer, MemoryDataLayer, ReadError
from asynchdf5._delivery import HostDelivery
from asynchdf5._handoff import Handoff
from asynchdf5._read._lease import Lease

from ._files import N, check_batch, check_epoch, check_message, rows, write_h5, write_source
from .test_faults import rewrite_in_place

pytestmark = pytest.mark.anyio

#: Small batches in groups of two (``group_batches``): an epoch is dozens of groups.
KW: dict[str, Any] = {"batch_size": 4, "shuffle": True, "seed": 11}


@pytest.fixture(autouse=True)
def _small_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HostDelivery, "group_batches", 2)


def _layers(kind: str, tmp_path: Path) -> Callable[[], Any]:
    """New layers of ``kind`` over the same data (written once)."""
    if kind == "hdf5":
        source = write_source(tmp_path)[0]
        return lambda: AsyncHDF5DataLayer(source, chunk_size=16, cache_bytes=2**16, **KW)
    data = rows(0, N)
    return lambda: MemoryDataLayer(data, **KW)


async def _epoch_indices(layer: Any) -> list[np.ndarray]:
    got = []
    with anyio.fail_after(30):
        async for batch in layer:
            check_batch(batch, batch.size)
            got.append(batch.indices.copy())
    return got


class _Overtaken:
    """Wraps ``HostDelivery.make`` so that the first group to start at batch ``at`` or later
    waits, after its gather, until a group after it has been made (then ``fail``s, if given):
    groups finish out of order, for sure, whenever two workers make them."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, want: list[np.ndarray], at: int, fail: bool
    ) -> None:
        self.position = {tuple(b.tolist()): i for i, b in enumerate(want)}
        self.at, self.fail = at, fail
        self.lock = threading.Lock()
        self.target: int | None = None  # the first batch of the group that waits
        self.overtaken = threading.Event()
        self.threads: set[str] = set()
        real = HostDelivery.make

        def make(delivery: HostDelivery, group: Any, stats: Any, helper: Any, emit: Any) -> Any:
            batches, error = real(delivery, group, stats, helper, emit)
            first = self.position[tuple(batches[0].indices.tolist())] if batches else -1
            with self.lock:
                self.threads.add(threading.current_thread().name)
                wait = self.target is None and first >= self.at
                if wait:
                    self.target = first
                elif self.target is not None and first > self.target:
                    self.overtaken.set()
            if wait:
                self.overtaken.wait(10)
                if self.fail:
                    raise RuntimeError("this group failed")
            return batches, error

        monkeypatch.setattr(HostDelivery, "make", make)


async def _plain_then_overtaken(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: bool
) -> tuple[Callable[[], Any], list[np.ndarray], _Overtaken]:
    """A plain epoch's batches, then :class:`_Overtaken` from batch 20 on, for new layers."""
    new = _layers(kind, tmp_path)
    async with new() as plain:
        want = await _epoch_indices(plain)
    return new, want, _Overtaken(monkeypatch, want, at=20, fail=fail)


@pytest.mark.parametrize("kind", ["hdf5", "memory"])
async def test_groups_finished_out_of_order_reach_the_consumer_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    new, want, slowed = await _plain_then_overtaken(kind, tmp_path, monkeypatch, fail=False)
    async with new() as layer:
        got = await _epoch_indices(layer)
    assert slowed.overtaken.is_set(), "no group finished before an earlier one: nothing tested"
    assert slowed.threads == {"asynchdf5-gather", "asynchdf5-gather_1"}
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    np.testing.assert_array_equal(np.sort(np.concatenate(got)), np.arange(N))


@pytest.mark.parametrize("kind", ["hdf5", "memory"])
async def test_a_failed_group_ends_the_epoch_after_exactly_the_groups_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    new, want, failing = await _plain_then_overtaken(kind, tmp_path, monkeypatch, fail=True)
    got: list[np.ndarray] = []
    async with new() as layer:
        with anyio.fail_after(30), pytest.raises(RuntimeError, match="this group failed"):
            async for batch in layer:
                check_batch(batch, batch.size)
                got.append(batch.indices.copy())
    assert failing.overtaken.is_set(), "no group after the failed one was made: nothing tested"
    # Exactly the batches before the failed group, in order; none of those made after it.
    assert failing.target is not None
    assert [g.tolist() for g in got] == [w.tolist() for w in want[: failing.target]]


async def test_an_epoch_with_transformers_is_gathered_on_one_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A transformer is never called from two threads at once: with one, one worker makes the
    # groups (and may hand half of a large group's copying to a helper, not the transformer).
    source = write_source(tmp_path)[0]
    calls: set[str] = set()
    threads: set[str] = set()
    real = HostDelivery.make

    def make(delivery: HostDelivery, group: Any, stats: Any, helper: Any, emit: Any) -> Any:
        threads.add(threading.current_thread().name)
        return real(delivery, group, stats, helper, emit)

    def record(x: np.ndarray) -> np.ndarray:
        calls.add(threading.current_thread().name)
        return x

    monkeypatch.setattr(HostDelivery, "make", make)
    async with AsyncHDF5DataLayer(
        source, chunk_size=16, cache_bytes=2**16, transformers=[("data", record)], **KW
    ) as layer:
        batches = []
        with anyio.fail_after(30):
            async for batch in layer:
                batches.append(batch)
        check_epoch(batches, N, KW["batch_size"], 0)
    assert threads == {"asynchdf5-gather"}
    assert calls == {"asynchdf5-gather"}


@pytest.mark.parametrize("kind", ["hdf5", "memory"])
async def test_one_slow_transformer_call_holds_back_only_the_batches_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # Batch 10's transformer call returns only once the consumer holds batches 1-9: they reach
    # it while the tenth is still being transformed, not with their group (issue 30, item 7).
    # Held back, the call would give up waiting and the test fails. Groups of 256 batches, as
    # by default.
    monkeypatch.setattr(HostDelivery, "group_batches", 256)
    calls = 0
    nine_arrived = threading.Event()
    waited: list[bool] = []

    def slow_tenth(x: np.ndarray) -> np.ndarray:
        nonlocal calls
        calls += 1
        if calls == 10:
            waited.append(nine_arrived.wait(10))
        return x

    if kind == "hdf5":
        source = write_source(tmp_path)[0]
        layer: Any = AsyncHDF5DataLayer(source, transformers=[("data", slow_tenth)], **KW)
    else:
        layer = MemoryDataLayer(rows(0, N), transformers=[("data", slow_tenth)], **KW)
    batches = []
    async with layer:
        with anyio.fail_after(30):
            async for batch in layer:
                batches.append(batch)
                if len(batches) == 9:
                    nine_arrived.set()
    check_epoch(batches, N, KW["batch_size"], 0)
    assert waited == [True]  # the tenth's call saw the first nine arrive


async def test_a_mapped_file_rewritten_while_batches_go_one_by_one_is_a_read_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Batch by batch (a transformer runs), each batch is checked against the file's fingerprint
    # before it goes: after the change, a ReadError, and every batch yielded before it is right.
    monkeypatch.setattr(Lease, "take", classmethod(lambda cls, file: "not in this test"))
    monkeypatch.setattr(HostDelivery, "group_batches", 256)
    path = write_h5(tmp_path / "one.h5", 0, N)
    got: list[Any] = []
    with anyio.fail_after(30), pytest.raises(ReadError) as info:
        async with AsyncHDF5DataLayer(
            path, batch_size=4, shuffle=True, seed=0, mmap=True, transformers=[("data", _paced)]
        ) as layer:
            for _ in range(2):
                async for batch in layer:
                    got.append(batch)
                    if len(got) == 1:
                        rewrite_in_place(path)
    assert 1 <= len(got) < 2 * N // 4
    for batch in got:
        check_batch(batch, 4)
    check_message(info.value, path)


def _paced(x: np.ndarray) -> np.ndarray:
    time.sleep(0.002)  # so that most batches are made after the change, for sure
    return x


async def test_each_batch_handed_over_on_its_own_is_checked_before_it_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The chunks' checks (a mapped file's fingerprint) run before each batch goes, not only
    # once the group is done: the second check fails, so only the first batch is yielded.
    checks = 0

    def verify(pieces: Any) -> None:
        nonlocal checks
        checks += 1
        if checks == 2:
            raise ReadError("the file changed")

    monkeypatch.setattr(gathering, "verify", verify)
    monkeypatch.setattr(HostDelivery, "group_batches", 256)
    got = []
    layer = MemoryDataLayer(rows(0, N), transformers=[("data", _paced)], **KW)
    with anyio.fail_after(30), pytest.raises(ReadError, match="the file changed"):
        async with layer:
            async for batch in layer:
                got.append(batch)
    assert len(got) == 1


async def test_a_consumer_waiting_for_slow_batches_is_woken_by_each_not_polling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Batches handed over one by one that come slower than one per POLL_S (a transformer of
    # 20 ms) wake the waiting consumer each; it does not look again every POLL_S meanwhile,
    # which would wake it about 20 times per batch (a waste where every batch wakes it anyway).
    # Every sample still arrives once, in the same order.
    monkeypatch.setattr(HostDelivery, "group_batches", 256)
    looks: list[float | None] = []  # the poll of each wait that ended with nothing
    get = Handoff.get

    async def counted(self: Handoff[Any], poll: float | None = None) -> Any:
        try:
            return await get(self, poll)
        except anyio.WouldBlock:
            looks.append(poll)
            raise

    monkeypatch.setattr(Handoff, "get", counted)

    def slow(x: np.ndarray) -> np.ndarray:
        time.sleep(0.02)
        return x

    batches = []
    async with MemoryDataLayer(rows(0, 64), transformers=[("data", slow)], **KW) as layer:
        with anyio.fail_after(30):
            async for batch in layer:
                batches.append(batch)
    check_epoch(batches, 64, KW["batch_size"], 0)
    assert len(batches) == 16
    assert looks == []  # never woke to find nothing
