"""Using a layer in a state that does not allow it is a StateError, never a backend's internal
error, a hang, or a silently truncated epoch (issue 9, section 3)."""

from __future__ import annotations

import asyncio
import itertools
import mmap
import random
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np
import pytest

from asynchdf5 import (
    AsyncHDF5DataLayer,
    Batch,
    DataLayerError,
    HDF5DataLayer,
    MemoryDataLayer,
    StateError,
    TransformError,
)
from asynchdf5 import transforms as T
from asynchdf5._process import ProcessReader

from ._files import N, check_epoch, write_source

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]  # the event loop matters


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return write_source(tmp_path)[0]


def test_state_error_is_a_data_layer_error_and_a_runtime_error() -> None:
    assert issubclass(StateError, DataLayerError) and issubclass(StateError, RuntimeError)


async def test_open_twice_in_the_same_task(source: Path) -> None:
    layer = AsyncHDF5DataLayer(source, batch_size=10)
    async with layer:
        with pytest.raises(StateError, match="already open"):
            await layer.__aenter__()
        check_epoch([b async for b in layer], N, 10, 0)  # still usable


async def test_open_while_another_task_has_it_open(source: Path) -> None:
    layer = AsyncHDF5DataLayer(source, batch_size=10)
    errors: list[BaseException] = []

    async def second() -> None:
        try:
            async with layer:
                pass
        except StateError as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with layer, anyio.create_task_group() as tg:
            tg.start_soon(second)
    assert len(errors) == 1 and "already open" in str(errors[0])


async def test_two_tasks_opening_at_once(source: Path) -> None:
    """One opens it, the other gets a StateError (not asyncio's RuntimeError or trio's
    TrioInternalError from a task group entered twice)."""
    layer = AsyncHDF5DataLayer(source, batch_size=10)
    outcomes: list[str] = []
    opened = anyio.Event()
    done = anyio.Event()

    async def user() -> None:
        try:
            async with layer:
                outcomes.append("opened")
                opened.set()
                await done.wait()
        except StateError:
            outcomes.append("StateError")
            done.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(user)
            tg.start_soon(user)
    assert sorted(outcomes) == ["StateError", "opened"]


async def test_iterate_when_not_open(source: Path) -> None:
    layer = AsyncHDF5DataLayer(source, batch_size=10)
    with pytest.raises(StateError, match="not open"):
        async for _ in layer:
            pass
    with pytest.raises(StateError, match="not open"):
        async for _ in layer.stream():
            pass
    assert layer.n_samples == N  # read from the files' metadata, without opening the layer


def test_sync_iterate_when_not_open(source: Path) -> None:
    layer = HDF5DataLayer(source, batch_size=10)
    with pytest.raises(StateError, match="not open"):
        next(iter(layer))


async def test_second_consumer_while_an_epoch_is_iterated(source: Path) -> None:
    """The first consumer's epoch is not truncated: the second gets a StateError instead."""
    async with AsyncHDF5DataLayer(source, batch_size=10, shuffle=True, seed=1) as layer:
        first = aiter(layer)
        got = [await anext(first) for _ in range(3)]
        with pytest.raises(StateError, match="another iterator"):
            async for _ in layer:
                pass
        with pytest.raises(StateError, match="another iterator"):
            async for _ in layer.stream():
                pass
        got += [b async for b in first]  # the first goes on to the end of its epoch
        check_epoch(got, N, 10, 0)


async def test_two_tasks_iterating_at_once(source: Path) -> None:
    layer = AsyncHDF5DataLayer(source, batch_size=10)
    results: dict[str, list[Batch] | BaseException] = {}
    started = anyio.Event()

    async def consume(name: str) -> None:
        got: list[Batch] = []
        try:
            async for b in layer:
                got.append(b)
                started.set()
                await anyio.sleep(0.001)
            results[name] = got
        except StateError as exc:
            results[name] = exc

    async def second() -> None:
        await started.wait()
        await consume("second")

    with anyio.fail_after(20):
        async with layer, anyio.create_task_group() as tg:
            tg.start_soon(consume, "first")
            tg.start_soon(second)
    assert isinstance(results["second"], StateError)
    first = results["first"]
    assert isinstance(first, list)
    check_epoch(first, N, 10, 0)


async def test_an_iterator_closed_early_lets_the_next_one_start(source: Path) -> None:
    async with AsyncHDF5DataLayer(source, batch_size=10) as layer:
        it = aiter(layer)
        await anext(it)
        await it.aclose()  # held, but closed: not a consumer any more
        batches = [b async for b in layer]
        check_epoch(batches, N, 10, 1)  # the epoch left early is over
        with pytest.raises(StopAsyncIteration):
            await anext(it)


async def test_iterator_after_close(source: Path) -> None:
    layer = AsyncHDF5DataLayer(source, batch_size=10)
    async with layer:
        it = aiter(layer)
        await anext(it)
        stream = layer.stream()
    with pytest.raises(StateError, match="closed"):
        await anext(it)
    with pytest.raises(StateError, match="not open"):
        await anext(stream)
    async with layer:  # reopened: the old iterator stays over, a new one works
        with pytest.raises(StopAsyncIteration):
            await anext(it)
        assert len([b async for b in layer]) == N // 10


async def test_iterator_waiting_when_the_layer_closes(source: Path) -> None:
    """A consumer task waiting for a batch while another task closes the layer's scope gets a
    StateError or a cancellation, never a hang."""
    layer = MemoryDataLayer({"x": np.arange(100)}, batch_size=10, transformers=[("x", lambda x: x)])
    with anyio.fail_after(10):
        async with layer:
            it = aiter(layer)
            await anext(it)
        with pytest.raises(StateError):
            await anext(it)


async def test_sync_iteration_of_a_layer_opened_with_async_with(source: Path) -> None:
    async with HDF5DataLayer(source, batch_size=10) as layer:
        with pytest.raises(StateError, match="async for"):
            next(iter(layer))


async def test_async_with_on_a_layer_open_with_with(source: Path) -> None:
    layer = HDF5DataLayer(source, batch_size=10)
    with layer:
        with pytest.raises(StateError, match="already open"):
            async with layer:
                pass
        assert len(list(layer)) == N // 10


def test_with_twice(source: Path) -> None:
    layer = HDF5DataLayer(source, batch_size=10)
    with layer:
        with pytest.raises(StateError, match="already open"):
            layer.__enter__()
        assert len(list(layer)) == N // 10
    with layer:  # and again, after closing
        assert len(list(layer)) == N // 10


async def test_close_from_another_task(source: Path) -> None:
    layer = AsyncHDF5DataLayer(source, batch_size=10)
    errors: list[BaseException] = []

    async def closer() -> None:
        try:
            await layer.aclose()
        except StateError as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with layer:
            async with anyio.create_task_group() as tg:
                tg.start_soon(closer)
            assert len([b async for b in layer]) == N // 10
    assert len(errors) == 1 and "task that opened it" in str(errors[0])


def test_memory_layer_works_with_with_and_for() -> None:
    layer = MemoryDataLayer({"x": np.arange(95), "y": np.arange(95) * 2}, batch_size=10)
    with layer:
        for epoch in range(2):
            batches = list(layer)
            assert [len(b.indices) for b in batches] == [10] * 9 + [5]
            assert {b.epoch for b in batches} == {epoch}
            for b in batches:
                np.testing.assert_array_equal(b["y"], b["x"] * 2)
        streamed = [b for _, b in zip(range(12), layer.stream(), strict=False)]
        assert all(len(b.indices) == 10 for b in streamed)


def _hold_the_loop(seconds: float) -> None:
    """A training step that never awaits: busy for ``seconds``, holding the event loop."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _consume_beside(
    other: Callable[[], Coroutine[Any, Any, None]],
    n: int,
    step_s: float,
    on_batch: Callable[[], None],
) -> None:
    """Take every batch of an epoch over ``n`` rows (batches of 50), calling ``on_batch`` and
    holding the loop ``step_s`` for each, while ``other`` runs in a task (cancelled when the
    epoch ends)."""
    x = np.arange(n, dtype=np.int64)
    with anyio.fail_after(60):
        async with (
            anyio.create_task_group() as tg,
            MemoryDataLayer(data={"x": x}, batch_size=50) as layer,
        ):
            tg.start_soon(other)
            await anyio.sleep(0.05)  # the pipeline fills its queue of groups
            async for _ in layer:
                on_batch()
                _hold_the_loop(step_s)
            tg.cancel_scope.cancel()


async def test_a_consumer_that_never_awaits_still_lets_other_tasks_run() -> None:
    # Batches are handed over in groups without a trip through the event loop; a consumer whose
    # step never awaits must still let the loop run other tasks (heartbeats, a data-parallel
    # all-reduce, an HTTP health check) about every millisecond, not once per group of batches.
    batches = [0]
    seen: list[int] = []  # the consumer's batch count each time the other task ran

    async def other_task() -> None:
        while True:
            seen.append(batches[0])
            await anyio.lowlevel.checkpoint()

    def counted() -> None:
        batches[0] += 1

    await _consume_beside(other_task, 20_000, 0.0002, counted)  # steps of 0.2 ms
    assert batches[0] == 400
    # About 5 steps per millisecond; before, a whole group of 64 batches went by unseen.
    most = max(b - a for a, b in itertools.pairwise(seen))
    assert most <= 20, most


async def test_a_task_whose_timer_came_due_in_a_step_runs_before_the_next_step() -> None:
    # A heartbeat or a watchdog sleeps: its timer comes due during the consumer's step, so it
    # is not ready yet when the iterator lets the loop run. Letting it run once queued it behind
    # the consumer on asyncio (and at random on trio): it waited for a second step.
    events: list[str] = []

    async def ticker() -> None:
        while True:
            await anyio.sleep(0.0005)
            events.append("T")

    # Steps of 3 ms: the ticker's timer comes due in each.
    await _consume_beside(ticker, 2_000, 0.003, lambda: events.append("B"))
    order = "".join(events)
    assert order.count("B") == 40
    assert "BB" not in order, order


async def test_the_pause_lets_due_tasks_run_first_though_the_process_was_descheduled() -> None:
    # On a loaded machine the process can be descheduled between the consumer's reading of the
    # clock and its pause (issue 39, item 5): measured against that old reading, the loop's
    # clock looked more than twice as fast, as a virtual clock's would, so the pause skipped
    # the timer that lets a task whose timer came due run first. Held here on purpose.
    from asynchdf5._pace import Pace

    events: list[str] = []

    async def ticker(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        task_status.started()
        await anyio.sleep(0.0005)  # armed before the step below
        events.append("T")

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(ticker)
            pace = Pace()
            pace.mark()
            _hold_the_loop(0.003)  # the consumer's step: the ticker's timer comes due
            now = time.perf_counter()
            _hold_the_loop(0.01)  # descheduled between the reading and the pause
            await pace.pause(now)
            events.append("P")
    assert events == ["T", "P"]


@pytest.mark.parametrize("autojump", [None, 0.0])
def test_the_pause_never_waits_for_a_loop_clock_that_stands_still(
    autojump: float | None, tmp_path: Path
) -> None:
    # Test suites run trio on a virtual clock (pytest-trio's `mock_clock`, `autojump_clock`):
    # without autojump it moves only when the test moves it. A pause that waited for a timer
    # on that clock never returned: the first step of 1 ms or more hung the iteration (review
    # 14, D1). The loop's own deadlines are on that clock too, so a thread watches instead.
    import threading

    from trio.testing import MockClock

    source = write_source(tmp_path)[0]
    got: list[Batch] = []
    errors: list[BaseException] = []

    async def main() -> None:
        async with AsyncHDF5DataLayer(source, batch_size=10, chunk_size=40, shuffle=True) as layer:
            async for batch in layer:
                got.append(batch)
                _hold_the_loop(0.002)

    def run() -> None:
        clock = MockClock() if autojump is None else MockClock(autojump_threshold=autojump)
        try:
            anyio.run(main, backend="trio", backend_options={"clock": clock})
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"hung after {len(got)} batches"
    assert not errors, errors
    check_epoch(got, N, 10, 0)


async def test_a_failed_run_is_over_before_the_next_one_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run an error ended may still have threads reading into the cache slots: the next
    iteration's run starts only once it is done (it would read into the same slots)."""
    from asynchdf5._consumer import Consumer

    runs: list[Any] = []
    seen: list[list[bool]] = []
    start_run = Consumer.start_run

    def recording(self: Consumer, mode: Any) -> Any:
        seen.append([r.done.is_set() for r in runs])
        runs.append(start_run(self, mode))
        return runs[-1]

    monkeypatch.setattr(Consumer, "start_run", recording)
    calls = itertools.count()

    def flaky(x: np.ndarray) -> np.ndarray:
        if next(calls) == 3:
            raise ValueError("the fourth batch")
        return x

    lst, _ = write_source(tmp_path, (2000, 2000))
    layer = AsyncHDF5DataLayer(lst, batch_size=100, chunk_size=500, transformers=[("data", flaky)])
    with anyio.fail_after(30):
        async with layer:
            with pytest.raises(TransformError):
                async for _ in layer:
                    pass
            got = [b async for b in layer]  # at once: no await between the failure and this
    assert sum(b.size for b in got) == 4000
    assert seen == [[], [True]]


def _pages_in_memory(a: np.ndarray) -> int:
    """How many of the pages under ``a`` are in memory (bit 63 of ``/proc/self/pagemap``)."""
    page = mmap.PAGESIZE
    start = a.__array_interface__["data"][0] // page
    stop = -(-(a.__array_interface__["data"][0] + a.nbytes) // page)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start * 8)
        entries = np.frombuffer(f.read((stop - start) * 8), np.uint64)
    return int(np.count_nonzero(entries >> np.uint64(63)))


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs /proc/self/pagemap")
@pytest.mark.parametrize("chunk_size", [40, 2**20], ids=["streaming", "resident"])
async def test_the_cache_is_given_back_in_a_worker_thread_on_close(
    source: Path, chunk_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unmapping a large cache blocks the thread that does it for tens of milliseconds (30 ms for
    two 196 MiB slots here): a layer's close gives the pages back in a worker thread, not on
    the event loop's. And it gives them back even while something still refers to the arrays
    (on asyncio the cancelled pipeline tasks' tracebacks do, until the garbage collector runs):
    this test holds them."""
    import asynchdf5._cache
    import asynchdf5._pages
    import asynchdf5._read._reader

    threads: list[int] = []
    real = asynchdf5._pages.free_arrays

    def free_arrays(arrays: Any) -> None:
        threads.append(threading.get_ident())
        real(arrays)

    # Where each caller looks the name up: the slots' (`_cache.free_slots`), the resident
    # arrays' (`HDF5Reader.close`).
    monkeypatch.setattr(asynchdf5._cache, "free_arrays", free_arrays)
    monkeypatch.setattr(asynchdf5._read._reader, "free_arrays", free_arrays)
    async with AsyncHDF5DataLayer(
        source, batch_size=10, chunk_size=chunk_size, shuffle=True, mmap=False
    ) as layer:
        opened = layer._consumer.opened
        assert opened is not None
        if chunk_size == 40:
            assert opened.slots
            held = [a for s in opened.slots for a in s.arrays.values()]
        else:
            reader = opened.reader
            assert not isinstance(reader, ProcessReader)  # process=False: the reader is here
            assert not opened.slots and reader.own_arrays
            held = [a for a in reader.own_arrays.values() if isinstance(a, np.ndarray)]
            assert len(held) == len(reader.own_arrays)  # resident: the copying reader's arrays
        del opened
        with anyio.fail_after(10):
            check_epoch([b async for b in layer], N, 10, 0)
        assert all(_pages_in_memory(a) for a in held)  # the epoch filled them
    assert threads and threading.get_ident() not in threads
    assert [_pages_in_memory(a) for a in held] == [0] * len(held)


async def test_closing_a_memory_layer_leaves_the_callers_mapped_arrays_alone() -> None:
    """Only the cache the layer allocated is given back at close: a caller's arrays, even on an
    anonymous mapping like the cache's, keep their contents."""
    buf = mmap.mmap(-1, N * 8, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = np.frombuffer(buf, np.int64)
    data[:] = np.arange(N)
    with anyio.fail_after(10):
        async with MemoryDataLayer({"data": data}, batch_size=10, shuffle=True) as layer:
            got = np.sort(np.concatenate([b["data"] async for b in layer]))
    assert np.array_equal(got, np.arange(N))
    assert np.array_equal(data, np.arange(N))


async def test_len_before_opening_builds_the_catalog_once(
    source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``len()`` before ``async with`` (as a DataLoader does) looks at the files; the opening
    then takes that catalog instead of opening and describing every file again."""
    import asynchdf5._hdf5
    from asynchdf5._catalog import build_catalog as real

    built: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(asynchdf5._hdf5, "build_catalog", counting)
    layer = AsyncHDF5DataLayer(source, batch_size=10)
    assert len(layer) == N // 10
    with anyio.fail_after(20):
        async with layer:
            check_epoch([b async for b in layer], N, 10, 0)
        assert len(built) == 1
        async with layer:  # a later opening builds its own (the first one's files are closed)
            check_epoch([b async for b in layer], N, 10, 1)
    assert len(built) == 2


def test_a_catalog_looked_at_and_never_opened_is_closed_with_its_layer(source: Path) -> None:
    """The files the catalog holds open for the next opening are closed when the layer is
    collected, if it never opens (the leak check after the test sees no descriptor left)."""
    import gc

    layer = AsyncHDF5DataLayer(source, batch_size=10)
    assert layer.n_samples == N
    del layer
    gc.collect()


async def test_the_pipeline_plans_its_epochs_off_the_event_loop(
    source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A laned plan of a large data set takes up to about a second: the pipeline plans each
    epoch in a worker thread, never on the event loop's thread."""
    import asynchdf5._planner
    from asynchdf5._plan import plan_epoch as real

    threads: list[int] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(asynchdf5._planner, "plan_epoch", recording)
    with anyio.fail_after(20):
        async with AsyncHDF5DataLayer(source, batch_size=10, shuffle=True, seed=1) as layer:
            for epoch in range(3):
                check_epoch([b async for b in layer], N, 10, epoch)
            async for _ in layer.stream():
                break
    assert threads and threading.get_ident() not in threads


# --- a cancellation from outside always leaves async with ----------------------------------------


async def _cancelled_from_outside(
    source: Path, cancel: Callable[[float], None], delay: float
) -> str:
    """Iterate (with a transformer: the gathering then polls) until ``cancel(delay)`` lands
    (scheduled once the layer is open)."""
    layer = AsyncHDF5DataLayer(
        source, batch_size=10, shuffle=True, transformers=[("data", T.Scale(0.5))]
    )
    async with layer:
        cancel(delay)
        for _ in range(10_000):
            async for _batch in layer:
                await anyio.sleep(0)
    return "the code after async with ran"


async def _tally_native_cancels(
    seconds: float, start: Callable[[], Coroutine[Any, Any, str]]
) -> dict[str, int]:
    """Run ``start()`` as a task of its own, again and again for ``seconds``, and count how each
    run ended: its return value, or ``"cancelled"``."""
    loop = asyncio.get_running_loop()
    outcomes: dict[str, int] = {}
    with anyio.fail_after(30):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            task = loop.create_task(start())
            try:
                outcome = await task
            except asyncio.CancelledError:
                outcome = "cancelled"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


async def test_a_native_task_cancel_always_leaves_async_with(
    source: Path, anyio_backend: str
) -> None:
    """asyncio's runner cancels its main task on Ctrl-C: that cancellation is never the layer's
    to swallow, wherever it lands once open (mid-epoch, beside the gathering's poll, closing).
    A race: many cancels at random points, for a few seconds."""
    if anyio_backend != "asyncio":
        pytest.skip("Task.cancel is asyncio's")
    loop = asyncio.get_running_loop()
    rng = random.Random(0)

    def cancel(delay: float) -> None:
        me = asyncio.current_task()
        assert me is not None
        loop.call_later(delay, me.cancel)

    outcomes = await _tally_native_cancels(
        3, lambda: _cancelled_from_outside(source, cancel, rng.uniform(0, 0.05))
    )
    assert set(outcomes) == {"cancelled"}, outcomes


async def test_an_outer_cancel_scope_always_leaves_async_with(source: Path) -> None:
    """An outer scope's cancellation is that scope's, never the layer's: the code after the
    block never runs."""
    rng = random.Random(1)
    outcomes: dict[str, int] = {}
    with anyio.fail_after(30):
        end = time.monotonic() + 1
        while time.monotonic() < end:
            outcome = "cancelled"
            with anyio.CancelScope() as scope:

                def cancel(delay: float, scope: anyio.CancelScope = scope) -> None:
                    async def later() -> None:
                        await anyio.sleep(delay)
                        scope.cancel()

                    tg.start_soon(later)

                async with anyio.create_task_group() as tg:
                    outcome = await _cancelled_from_outside(source, cancel, rng.uniform(0, 0.05))
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert set(outcomes) == {"cancelled"}, outcomes


async def test_a_native_task_cancel_while_closing_is_never_lost(
    source: Path, anyio_backend: str
) -> None:
    """The body leaves after a few batches and the cancel lands around the close (waiting
    for the run, releasing the reader and the cache): it still ends the task. After the block
    the task sleeps past the cancel's time (asyncio's timers fire in order): a cancel that
    was swallowed lets that sleep end."""
    if anyio_backend != "asyncio":
        pytest.skip("Task.cancel is asyncio's")
    loop = asyncio.get_running_loop()
    rng = random.Random(2)

    async def user(batches: int, delay: float) -> str:
        me = asyncio.current_task()
        assert me is not None
        layer = AsyncHDF5DataLayer(
            source, batch_size=10, shuffle=True, transformers=[("data", T.Scale(0.5))]
        )
        async with layer:
            handle = loop.call_later(delay, me.cancel)
            taken = 0
            async for _batch in layer:
                taken += 1
                if taken >= batches:
                    break
        await asyncio.sleep(max(0.0, handle.when() - loop.time()) + 0.01)
        return "the cancellation was lost"

    outcomes = await _tally_native_cancels(
        1.5, lambda: user(rng.randint(1, 3), rng.uniform(0, 0.005))
    )
    assert set(outcomes) == {"cancelled"}, outcomes


async def test_a_native_task_cancel_while_opening_leaves_nothing_behind(
    source: Path, anyio_backend: str
) -> None:
    """A native cancel that lands while the layer opens (a worker thread builds the catalog,
    maps the files) leaves the thread's work whole and releases it: no lease thread, no open
    file (the leak check after the test), and the cancellation goes on."""
    if anyio_backend != "asyncio":
        pytest.skip("Task.cancel is asyncio's")
    loop = asyncio.get_running_loop()
    rng = random.Random(3)

    async def user(delay: float) -> str:
        me = asyncio.current_task()
        assert me is not None
        loop.call_later(delay, me.cancel)
        async with AsyncHDF5DataLayer(source, batch_size=10, mmap=True) as layer:
            for _ in range(10_000):
                async for _batch in layer:
                    await anyio.sleep(0)
        return "the code after async with ran"

    outcomes = await _tally_native_cancels(2, lambda: user(rng.uniform(0, 0.01)))
    assert set(outcomes) == {"cancelled"}, outcomes


@pytest.mark.parametrize("release", ["reader", "mapped reader", "cache"])
async def test_a_native_task_cancel_while_releasing_waits_for_the_release(
    source: Path, anyio_backend: str, monkeypatch: pytest.MonkeyPatch, release: str
) -> None:
    """A native cancel that lands while the close releases the reader's files (copied or
    mapped) or the cache's slots, each in a worker thread: the task ends cancelled only once
    the release is over, never with its files still being closed or its memory still being
    freed behind it."""
    if anyio_backend != "asyncio":
        pytest.skip("Task.cancel is asyncio's")
    import asynchdf5._opened
    import asynchdf5._read._mapped
    import asynchdf5._read._reader

    loop = asyncio.get_running_loop()
    users: list[asyncio.Task[str]] = []
    over: list[str] = []
    owner, name = {
        "reader": (asynchdf5._read._reader.HDF5Reader, "close"),
        "mapped reader": (asynchdf5._read._mapped.MappedReader, "close"),
        "cache": (asynchdf5._opened, "free_slots"),
    }[release]
    real = getattr(owner, name)

    def slow(*args: Any) -> None:
        loop.call_soon_threadsafe(users[0].cancel)  # lands while this release runs
        time.sleep(0.05)
        real(*args)
        over.append(release)

    monkeypatch.setattr(owner, name, slow)

    async def user() -> str:
        layer = AsyncHDF5DataLayer(
            source, batch_size=10, chunk_size=40, mmap=release == "mapped reader"
        )
        async with layer:
            async for _batch in layer:
                break
        await asyncio.sleep(5)
        return "the cancellation was lost"

    users.append(loop.create_task(user()))
    with anyio.fail_after(30):
        with pytest.raises(asyncio.CancelledError):
            await users[0]
    assert over == [release]  # over before the task ended
