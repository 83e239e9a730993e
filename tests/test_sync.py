"""The sync facade under Ctrl-C: a second interrupt during the close never leaves a hang.

Each trial is a process iterating ``with HDF5DataLayer(...) as layer: for batch in layer``
(``tests/_double_sigint.py``); it gets two SIGINTs a random 0.2-8 ms apart at a random moment of
the loop, and must exit as an uncaught ``KeyboardInterrupt`` exits (killed by SIGINT) within
its deadline.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import CancelledError, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from anyio.from_thread import BlockingPortal

from asynchdf5 import HDF5DataLayer, MemoryDataLayer, _sync
from asynchdf5._interrupts import interrupts_held
from asynchdf5._sync import Bridge, EnteredOnLoop, call_or_cancel

from ._files import N, check_epoch, write_source
from ._helpers import double_sigint_trials, examples
from ._interrupts import sweep, traced
from ._leaks import assert_released, no_helper_left, snapshot

ROOT = Path(__file__).resolve().parents[1]
RUNNERS = 4  # trial runners side by side: a busy machine is where it hung
#: Trials in the normal run (a multiple of RUNNERS); ``nox -s stress`` runs ten times as many,
#: as many as the deadlines below allow.
TRIALS = min(examples(48), 480) // RUNNERS * RUNNERS


@pytest.mark.timeout(180)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the trials fork and send SIGINT")
def test_a_double_ctrl_c_always_exits(tmp_path: Path) -> None:
    source = write_source(tmp_path)[0]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def runner(i: int) -> tuple[list[str], str]:
        return double_sigint_trials([source, TRIALS // RUNNERS, i], env, timeout=170)

    with ThreadPoolExecutor(RUNNERS) as pool:
        runs = list(pool.map(runner, range(RUNNERS)))
    outcomes = Counter(o for lines, _ in runs for o in lines)
    assert sum(outcomes.values()) == TRIALS
    assert set(outcomes) <= {"ok"}, (outcomes, "".join(err for _, err in runs)[-6000:])


def test_an_interrupt_held_back_comes_once_the_block_ends() -> None:
    went_on = False
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            signal.raise_signal(signal.SIGINT)
            went_on = True
    assert went_on
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.timeout(60)
@pytest.mark.parametrize("during", ["the graceful close", "the stop request"])
def test_a_ctrl_c_at_the_worst_moment_of_the_close_still_ends_the_loop(
    monkeypatch: pytest.MonkeyPatch, during: str
) -> None:
    """The second Ctrl-C of the trials above, placed for sure: it arrives as the close crosses
    the bridge, before the call is queued (the first call: telling the layer to close; or the
    call that stops the loop). The close raises it, and the loop's thread still ends."""
    armed = False
    real_hand = _sync._hand_to_loop
    real_exit = EnteredOnLoop.exit

    def hand_to_loop(call: Any) -> None:
        nonlocal armed
        if armed and during == "the stop request" and call._fn.__name__ == "stop":
            armed = False
            signal.raise_signal(signal.SIGINT)
        real_hand(call)

    def exit(entered: EnteredOnLoop) -> None:
        nonlocal armed
        if armed and during == "the graceful close":
            armed = False
            signal.raise_signal(signal.SIGINT)
        real_exit(entered)

    before = snapshot()
    layer = MemoryDataLayer({"x": np.arange(1000)}, batch_size=10)
    with pytest.raises(KeyboardInterrupt):
        with layer:
            batches = iter(layer)
            for _ in range(3):
                next(batches)
            batches.close()  # type: ignore[attr-defined]  # a generator: left now, not at GC
            monkeypatch.setattr(_sync, "_hand_to_loop", hand_to_loop)
            monkeypatch.setattr(EnteredOnLoop, "exit", exit)
            armed = True
    assert not armed
    assert_released(before, strict=False)


async def _plus_one(x: int) -> int:
    await anyio.sleep(0)
    return x + 1


@pytest.mark.timeout(120)
def test_a_ctrl_c_at_any_instruction_of_a_call_across_the_bridge_leaves_the_loop_serving() -> None:
    """SIGINT raised before each instruction in turn of the caller's side of a ``for`` loop's
    trip across the bridge: whatever it cut short, the loop is not left blocked. A
    ``KeyboardInterrupt`` raised as ``threading.Condition.__enter__`` returned left the lock of
    the future waited on held by the caller, and the loop, setting that future, blocked on it
    for ever (the double Ctrl-C trials' rare hang)."""
    bridge = Bridge()
    blocked = False

    def serves(n: int) -> None:
        nonlocal blocked
        future = asyncio.run_coroutine_threadsafe(_plus_one(1), bridge.portal.loop)
        try:
            future.result(timeout=10)
        except TimeoutError:
            blocked = True
            pytest.fail(f"the loop is blocked after SIGINT at instruction {n}")

    try:
        assert sweep(lambda: call_or_cancel(bridge.portal, _plus_one, 1), serves) > 100
    finally:
        if not blocked:  # a blocked loop never stops: its daemon thread is left behind
            bridge.stop(cancel=True)


@pytest.mark.timeout(240)
def test_a_ctrl_c_at_any_instruction_of_a_with_block_leaves_the_layer_closed() -> None:
    """The same for what ``with layer:`` does across the bridge (start the loop and open the
    layer there, then close it and stop the loop): wherever the interrupt lands, the layer is
    closed once the ``with`` is over and its loop's thread has ended, or (an interrupt as
    ``__exit__`` starts, before any of its code) the layer still holds its bridge, and
    ``close()`` ends it; nothing is left behind. An interrupt as ``Bridge()`` returned left
    its loop running, the layer not holding it."""
    layer = MemoryDataLayer({"x": np.arange(100)}, batch_size=10)

    def trip() -> None:
        with layer:
            pass

    def closed(n: int) -> None:
        if layer._sync is not None:
            layer.close()
        deadline = time.monotonic() + 10
        while _bridge_threads() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not _bridge_threads(), f"the loop's thread runs on after SIGINT at place {n}"

    before = snapshot()
    assert sweep(trip, closed) > 100
    assert_released(before, strict=False)


def _rows(n: int) -> dict[str, np.ndarray]:
    """In memory, the rows of ``tests._files``' sources (that ``check_epoch`` checks)."""
    i = np.arange(n, dtype=np.int64)
    return {"data": np.stack([i * 10, i * 10 + 1], axis=1), "label": i}


#: The files of the code one step of a ``for`` loop, and leaving it, run in the caller's thread
#: (the bridge's own are swept above; here only its entry points).
_STEP_FILES = traced(
    "asynchdf5/_iterator.py",
    "asynchdf5/_sync.py",
    "asynchdf5/_interrupts.py",
    "threading.py",
    "concurrent/futures/_base.py",
    "signal.py",
    "asynchdf5/_consumer.py",
    "asynchdf5/_place.py",
    "asynchdf5/_delivery/__init__.py",
    "asynchdf5/_delivery/_host.py",
    "asynchdf5/_process/_parent.py",
    "contextlib.py",
)


@pytest.mark.timeout(60)
def test_a_ctrl_c_at_any_place_of_a_for_step_leaves_the_layer_serving_whole_epochs() -> None:
    """SIGINT raised at each place in turn of the caller's side of two steps of a ``for`` loop
    and of leaving it early (the batch handed over, the trip across the bridge, the close of
    the iteration): wherever it lands, the next ``for`` on the open layer serves whole epochs,
    and the layer closes with nothing left."""
    n, size = 40, 4
    layer = MemoryDataLayer(_rows(n), batch_size=size)

    last: list[BaseException] = []  # kept, as a notebook keeps the last traceback
    before = snapshot()
    with layer:
        trip = functools.partial(_two_steps_then_leave, layer, last)
        assert sweep(trip, lambda _: _serves_an_epoch(layer, n, size), _STEP_FILES) > 20
    assert layer._sync is None
    assert_released(before, strict=False)


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <finalize object:pytest.PytestUnraisableExceptionWarning"
)
def test_a_ctrl_c_at_any_place_of_a_for_step_of_a_helper_process_leaves_it_serving(
    tmp_path: Path,
) -> None:
    """The same with ``process=True``, where a batch dropped gives its slot back to the helper
    (a finalizer that keeps a Ctrl-C for the loop): SIGINT at each place in turn of two steps
    (the first batch dropped as the second comes), the second batch dropped, and a ``break``;
    the next ``for`` serves whole epochs, and the layer closes with no helper process left.
    (A Ctrl-C at the finalizer's very start, before its ``try``, is printed as "Exception
    ignored" and lost, as in any finalizer: allowed; the GC decides whether a run meets it.)"""
    source = write_source(tmp_path)[0]
    layer = HDF5DataLayer(source, batch_size=10, process=True)

    last: list[BaseException] = []  # kept, as a notebook keeps the last traceback
    trip = functools.partial(_two_steps_then_leave, layer, last)
    before = snapshot()
    with layer:
        # Not weakref.py: a Ctrl-C in weakref.finalize's own frames, before the finalizer's
        # ``try``, leaves it as any finalizer does ("Exception ignored in"), and is lost.
        files = (*_STEP_FILES, *traced(*(f"asynchdf5/_process/{f}" for f in _PROCESS)))
        assert sweep(trip, lambda _: _serves_an_epoch(layer, N, 10), files) > 20
    assert layer._sync is None
    no_helper_left()
    assert_released(before, strict=False)


def _two_steps_then_leave(
    layer: HDF5DataLayer | MemoryDataLayer, last: list[BaseException]
) -> None:
    """Two steps of a ``for`` loop (the first batch dropped as the second comes: with
    ``process=True`` its slot goes back), the second dropped, then the loop left; a
    ``KeyboardInterrupt`` is kept in ``last``, as a notebook keeps the last traceback."""
    try:
        batches = iter(layer)
        batch = next(batches)
        batch = next(batches)
        del batch
        batches.close()  # type: ignore[attr-defined]  # a generator: left now, not at GC
    except KeyboardInterrupt as exc:
        last[:] = [exc]
        raise


def _serves_an_epoch(layer: HDF5DataLayer | MemoryDataLayer, n: int, size: int) -> None:
    """The open layer's next ``for`` serves one whole epoch, and counts it."""
    batches = [b for b in layer]
    check_epoch(batches, n, size, batches[0].epoch)
    assert layer.epoch == batches[0].epoch + 1


#: The helper process's modules that run in the layer's process.
_PROCESS = ("_runs.py", "_wire.py")


def _bridge_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "asynchdf5-asyncio-bridge"]


@pytest.mark.timeout(30)
def test_a_ctrl_c_ends_the_wait_for_a_loop_that_is_stuck() -> None:
    """A loop blocked by a call that never returns cannot stop: the request to stop is queued,
    and a Ctrl-C ends the wait for it (the thread, a daemon, is left to the interpreter's
    exit). The stop used to wait for the loop to answer, with Ctrl-C held back: for ever."""
    bridge = Bridge()
    gate = threading.Event()
    bridge.portal.loop.call_soon_threadsafe(gate.wait)  # the loop is stuck until the gate opens
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    # The deadline: past it the gate opens, and the wait ends without the Ctrl-C's help.
    watchdog = threading.Timer(10, gate.set)
    watchdog.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            bridge.stop(cancel=True)
        assert not gate.is_set(), "the wait for the stuck loop outlived its deadline"
        assert bridge._thread.is_alive()  # still stuck: the wait ended for the Ctrl-C
    finally:
        watchdog.cancel()
        gate.set()
        bridge._thread.join(10)
    assert not bridge._thread.is_alive()  # once free, the loop took the request and stopped


@pytest.mark.timeout(60)
def test_a_ctrl_c_while_the_loop_starts_leaves_no_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = BlockingPortal.__aenter__

    async def interrupted(portal: BlockingPortal) -> BlockingPortal:
        signal.raise_signal(signal.SIGINT)  # the main thread waits for this loop to start
        return await real(portal)

    monkeypatch.setattr(BlockingPortal, "__aenter__", interrupted)
    before = snapshot()
    with pytest.raises(KeyboardInterrupt):
        with MemoryDataLayer({"x": np.arange(100)}, batch_size=10):
            pytest.fail("opened")
    assert_released(before, strict=False)


class Slow:
    """A transformer that takes 20 ms a batch: the ``for`` loop waits on the bridge almost all
    the time (picklable, for ``process=True``)."""

    def __call__(self, x: np.ndarray) -> np.ndarray:
        time.sleep(0.02)
        return x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("process", [False, True], ids=["in-process", "process"])
def test_the_loop_after_a_caught_ctrl_c_serves_whole_epochs(tmp_path: Path, process: bool) -> None:
    """The notebook pattern (issue 39, item 8): Ctrl-C while the ``for`` waits for the first
    batch of an epoch, caught, then the loop again on the open layer. The interrupted call was
    left waiting on the loop for the run's next group, so the next loop's wait on the same run
    raised anyio's BusyResourceError. Now it is cancelled first: the interrupted epoch is
    abandoned as a ``break`` would, and the next ones are whole."""
    source, _ = write_source(tmp_path)
    with HDF5DataLayer(
        source,
        batch_size=10,
        chunk_size=40,
        transformers=[("data", Slow())],
        process=process,
    ) as layer:
        for _ in layer:  # epoch 0, whole: the run goes on into epoch 1
            pass
        threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            while True:  # the interrupt comes while the loop waits on the bridge
                for _ in layer:
                    pass
        # Epoch 1 is served whole next where none of its batches was handed over yet (the
        # interrupt came at its start), else abandoned: the next epochs are whole.
        first = None
        for _ in range(2):
            batches = [b for b in layer]
            epoch = batches[0].epoch
            check_epoch(batches, N, 10, epoch)
            assert layer.epoch == epoch + 1
            first = epoch if first is None else first
        assert first in (1, 2) and layer.epoch == first + 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("process", [False, True], ids=["in-process", "process"])
def test_a_ctrl_c_as_the_loop_asks_for_a_batch_leaves_no_wait_behind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, process: bool
) -> None:
    """The Ctrl-C of the test above, placed for sure at the worst moment of the ``for``'s ask:
    the call that waits for the next batch was handed to the loop, but the interrupt comes
    before the ``for`` holds its future. The call is cancelled still, so the next loop is
    the only one waiting for the run's groups (else anyio's BusyResourceError)."""
    armed = False
    real = _sync._hand_to_loop

    def hand_to_loop(call: Any) -> None:
        nonlocal armed
        real(call)
        if armed:
            armed = False
            signal.raise_signal(signal.SIGINT)

    source, _ = write_source(tmp_path)
    with HDF5DataLayer(
        source, batch_size=10, chunk_size=40, transformers=[("data", Slow())], process=process
    ) as layer:
        for _ in layer:  # epoch 0, whole: the run goes on into epoch 1
            pass
        monkeypatch.setattr(_sync, "_hand_to_loop", hand_to_loop)
        armed = True
        with pytest.raises(KeyboardInterrupt):
            for _ in layer:
                pass
        assert not armed
        batches = [b for b in layer]  # the interrupted epoch whole, or the one after it
        epoch = batches[0].epoch
        check_epoch(batches, N, 10, epoch)
        assert epoch in (1, 2) and layer.epoch == epoch + 1


@pytest.mark.timeout(30)
def test_a_call_across_the_bridge_returns_raises_and_is_cancelled_whole() -> None:
    """``call_or_cancel``'s calls (the ``for`` loop's trips to the loop, each an asyncio task of
    its own): the value or error comes back; a call cancelled before the loop started it never
    runs and is over at once; one cancelled while it waits ends (its ``finally`` has run)."""
    bridge = Bridge()
    try:
        portal = bridge.portal
        ran: list[str] = []

        async def value(x: int) -> int:
            return x + 1

        async def fails() -> None:
            raise ValueError("from the loop")

        async def times_out() -> None:  # the poll's own exception: raised, not waited on
            raise TimeoutError("from the loop")

        async def waits() -> None:
            ran.append("waits")
            try:
                await anyio.sleep_forever()
            finally:
                ran.append("ended")

        assert call_or_cancel(portal, value, 1) == 2
        with pytest.raises(ValueError, match="from the loop"):
            call_or_cancel(portal, fails)
        with pytest.raises(TimeoutError, match="from the loop"):
            call_or_cancel(portal, times_out)

        gate = threading.Event()
        portal.loop.call_soon_threadsafe(gate.wait)  # the loop is busy until the gate opens
        early = _sync._Call(portal, waits, ())
        _sync._hand_to_loop(early)
        early.cancel()
        gate.set()
        assert early.ended.wait(10) and early.result.cancelled()

        late = _sync._Call(portal, waits, ())
        _sync._hand_to_loop(late)
        deadline = time.monotonic() + 10
        while not ran and time.monotonic() < deadline:
            time.sleep(0.001)
        late.cancel()
        assert late.ended.wait(10)
        with pytest.raises(CancelledError):
            late.result.result()
        assert ran == ["waits", "ended"]  # the early call never ran
    finally:
        bridge.stop(cancel=True)


@pytest.mark.timeout(30)
def test_a_ctrl_c_before_the_call_is_handed_to_the_loop_leaves_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interrupt that comes before the hand-off (as the interrupts are being held back, say)
    leaves a call the loop never heard of: it is over at once, not waited for (nothing on the
    loop would ever say it ended; the wait would last ``CANCEL_WAIT_S``, which a double Ctrl-C
    took for a hang)."""
    monkeypatch.setattr(_sync, "CANCEL_WAIT_S", 3600.0)  # a wait, if any, outlasts the timeout

    def interrupted(call: Any) -> None:
        raise KeyboardInterrupt

    bridge = Bridge()
    try:
        ran: list[str] = []

        async def never() -> None:
            ran.append("ran")

        monkeypatch.setattr(_sync, "_hand_to_loop", interrupted)
        with pytest.raises(KeyboardInterrupt):
            call_or_cancel(bridge.portal, never)
        monkeypatch.undo()
        call = _sync._Call(bridge.portal, never, ())
        call.cancel()  # never handed over
        assert call.ended.is_set() and call.result.cancelled()
        assert ran == []
    finally:
        bridge.stop(cancel=True)
