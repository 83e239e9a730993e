"""The hand-off from the gather thread to the consumer: every item, in order, from another
thread; a parked consumer wakes for an item, for the end and for its own closing; nothing waits
forever, and the socket pair is released (the autouse leak check counts descriptors)."""

from __future__ import annotations

import random
import threading
import time

import anyio
import pytest

from asynchdf5._handoff import Handoff

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]  # the event loop matters


async def test_items_from_a_thread_arrive_in_order_and_then_the_end() -> None:
    box: Handoff[int] = Handoff()
    n = 5_000
    rng = random.Random(0)
    pauses = {i for i in range(n) if rng.random() < 0.01}  # the consumer parks now and then

    def produce() -> None:
        for i in range(n):
            if i in pauses:
                time.sleep(0.002)
            box.put(i)

    got: list[int] = []
    with anyio.fail_after(30):
        thread = threading.Thread(target=produce)
        thread.start()
        try:
            while len(got) < n:
                got.append(await box.get())
        finally:
            await anyio.to_thread.run_sync(thread.join)
        box.finish()
        with pytest.raises(anyio.EndOfStream):
            await box.get()
    assert got == list(range(n))


async def test_get_nowait_says_why_there_is_nothing() -> None:
    box: Handoff[str] = Handoff()
    with pytest.raises(anyio.WouldBlock):
        box.get_nowait()
    box.put("a")
    box.put("b")
    box.finish()  # what was put before the end is still delivered
    assert box.get_nowait() == "a"
    with anyio.fail_after(5):
        assert await box.get() == "b"
    with pytest.raises(anyio.EndOfStream):
        box.get_nowait()
    box.close()
    with pytest.raises(anyio.ClosedResourceError):
        box.get_nowait()


async def test_a_parked_consumer_wakes_for_an_item_put_from_a_thread() -> None:
    box: Handoff[int] = Handoff()

    def later() -> None:
        time.sleep(0.05)  # the consumer is parked by then
        box.put(7)

    thread = threading.Thread(target=later)
    thread.start()
    try:
        with anyio.fail_after(10):
            assert await box.get() == 7
    finally:
        thread.join()
        box.finish()


@pytest.mark.parametrize("how", ["finish", "close"])
async def test_a_parked_consumer_wakes_for_the_end_and_for_closing(how: str) -> None:
    box: Handoff[int] = Handoff()
    outcome: list[type[BaseException]] = []

    async def consumer() -> None:
        try:
            await box.get()
        except (anyio.EndOfStream, anyio.ClosedResourceError) as exc:
            outcome.append(type(exc))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            await anyio.sleep(0.05)  # parked on the socket
            if how == "finish":
                box.finish()
            else:
                box.close()
                box.put(1)  # dropped: nobody takes it
    if how == "close":
        assert outcome == [anyio.ClosedResourceError]
        box.finish()
    else:
        assert outcome == [anyio.EndOfStream]


async def test_cancelling_a_parked_consumer_loses_nothing() -> None:
    box: Handoff[int] = Handoff()
    with anyio.move_on_after(0.05) as scope:
        await box.get()
    assert scope.cancelled_caught

    def produce() -> None:
        for i in range(3):
            box.put(i)

    thread = threading.Thread(target=produce)
    thread.start()
    thread.join()
    with anyio.fail_after(10):
        assert [await box.get() for _ in range(3)] == [0, 1, 2]
    box.finish()


async def test_a_polling_consumer_is_woken_only_by_urgent_items() -> None:
    box: Handoff[str] = Handoff()
    try:
        with anyio.fail_after(10):
            with pytest.raises(anyio.WouldBlock):  # nothing came within the poll
                await box.get(poll=0.01)
            # An item that may wait does not wake a consumer that polls: it is taken when the
            # consumer looks again.
            threading.Timer(0.05, lambda: box.put("quiet", urgent=False)).start()
            t0 = time.perf_counter()
            assert await box.get(poll=0.5) == "quiet"
            assert time.perf_counter() - t0 >= 0.45
            # An urgent one wakes it at once; a consumer that does not poll, any item does.
            threading.Timer(0.05, lambda: box.put("urgent")).start()
            t0 = time.perf_counter()
            assert await box.get(poll=5.0) == "urgent"
            assert time.perf_counter() - t0 < 4.0
            threading.Timer(0.05, lambda: box.put("quiet", urgent=False)).start()
            assert await box.get() == "quiet"
            assert box.peek() is None
            box.put("next", urgent=False)
            assert box.peek() == "next" and box.get_nowait() == "next"
    finally:
        box.finish()
