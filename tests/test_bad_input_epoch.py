"""Bad inputs, part 3 (during an epoch, and leaving it early): each raises the right error, names
what is wrong, leaks nothing.

What every part checks, and the data they read: part 1, ``test_bad_input_sources``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from asynchdf5 import (
    AsyncHDF5DataLayer,
    TransformError,
)

from ._files import (
    N,
    check_batch,
    check_epoch,
    check_message,
    check_prefix,
)
from ._helpers import collect_until_error
from ._leaks import aassert_released, asnapshot

# --------------------------------------------------------------------------------------------
# During an epoch: TransformError and ReadError, after only complete batches
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("fail_at", [0, 200])
async def test_transformer_raises(source: tuple[Path, list[Path]], fail_at: int) -> None:
    raised: list[BaseException] = []

    def explode_on_row(x: np.ndarray) -> np.ndarray:
        if x.max() >= fail_at:
            raised.append(KeyError(f"row {fail_at}"))
            raise raised[-1]
        return x

    before = await asnapshot()
    layer = AsyncHDF5DataLayer(
        source[0], batch_size=10, chunk_size=50, transformers=[("label", explode_on_row)]
    )
    async with layer:
        got, err = await collect_until_error(layer, TransformError)
    await aassert_released(before)
    seen = check_prefix(got, 10)
    # Batches are cut per chunk of 50, so every batch of the chunks before the failing row is
    # delivered before the error.
    assert len(seen) == fail_at
    check_message(err, "'label'", "explode_on_row", "KeyError")
    assert err.__cause__ is raised[0]


@pytest.mark.anyio
async def test_transformer_changes_row_count(source: tuple[Path, list[Path]]) -> None:
    def drop_a_row(x: np.ndarray) -> np.ndarray:
        return x[:-1] if x.max() >= 1200 else x  # data are 10 * index: from row 120 on

    before = await asnapshot()
    layer = AsyncHDF5DataLayer(
        source[0], batch_size=10, chunk_size=20, transformers=[("data", drop_a_row)]
    )
    async with layer:
        got, err = await collect_until_error(layer, TransformError)
    await aassert_released(before)
    assert len(check_prefix(got, 10)) == 120
    check_message(err, "'data'", "drop_a_row", "9 rows", "batch of 10")


@pytest.mark.anyio
async def test_transformer_returns_no_array(source: tuple[Path, list[Path]]) -> None:
    def to_list(x: np.ndarray) -> Any:
        return x.tolist()

    layer = AsyncHDF5DataLayer(source[0], batch_size=10, transformers=[("label", to_list)])
    async with layer:
        got, err = await collect_until_error(layer, TransformError)
    assert got == []
    check_message(err, "'label'", "to_list", "list")


# The source for mid-epoch file faults: 3 files of 400 rows, read in chunks of 20 rows. The
# pipeline runs ahead of the consumer by at most a few dozen batches (its item buffer and two
# cache slots), so after the first batch the last file is not read yet.
BIG = (400, 400, 400)


@pytest.mark.anyio
async def test_every_batch_before_a_transform_error_is_delivered(
    source: tuple[Path, list[Path]],
) -> None:
    def explode_on_row_230(x: np.ndarray) -> np.ndarray:
        if x.max() >= 230:
            raise ValueError("row 230")
        return x

    # Chunks of 100 rows: batches 20-29 are gathered in one worker-thread call.
    layer = AsyncHDF5DataLayer(
        source[0], batch_size=10, chunk_size=100, transformers=[("label", explode_on_row_230)]
    )
    async with layer:
        got, _ = await collect_until_error(layer, TransformError)
    assert len(check_prefix(got, 10)) == 230


# --------------------------------------------------------------------------------------------
# Leaving early: break and cancellation
# --------------------------------------------------------------------------------------------


@pytest.mark.both_backends
@pytest.mark.anyio
@pytest.mark.parametrize("shuffle", [False, True])
async def test_break_then_next_epoch_is_whole(
    source: tuple[Path, list[Path]], shuffle: bool
) -> None:
    before = await asnapshot()
    async with AsyncHDF5DataLayer(
        source[0], batch_size=16, chunk_size=64, shuffle=shuffle, seed=5
    ) as layer:
        got = []
        async for b in layer:
            check_batch(b, 16)
            got.append(b)
            if len(got) == 3:
                break
        assert {b.epoch for b in got} == {0}
        epoch1 = [b async for b in layer]
        check_epoch(epoch1, N, 16, 1)
        epoch2 = [b async for b in layer]
        check_epoch(epoch2, N, 16, 2)
        assert layer.epoch == 3
        async for _ in layer:
            break  # and leave `async with` from the middle of an epoch
    await aassert_released(before)


@pytest.mark.both_backends
@pytest.mark.anyio
async def test_break_in_the_last_batch_and_in_the_first(source: tuple[Path, list[Path]]) -> None:
    async with AsyncHDF5DataLayer(source[0], batch_size=100) as layer:
        async for b in layer:
            if b.indices[-1] == N - 1:
                break  # the epoch's last batch: the epoch is over anyway
        async for b in layer:
            assert b.epoch == 1
            break
        check_epoch([b async for b in layer], N, 100, 2)


@pytest.mark.both_backends
@pytest.mark.anyio
async def test_cancel_scope_around_the_loop(source: tuple[Path, list[Path]]) -> None:
    before = await asnapshot()
    async with AsyncHDF5DataLayer(source[0], batch_size=10, chunk_size=30) as layer:
        got = []
        with anyio.CancelScope() as scope:
            async for b in layer:
                got.append(b)
                if len(got) == 2:
                    scope.cancel()
                await anyio.sleep(0)
        assert scope.cancelled_caught
        check_prefix(got, 10)
        check_epoch([b async for b in layer], N, 10, 1)
    await aassert_released(before)


def _slow(x: np.ndarray) -> np.ndarray:
    time.sleep(0.01)
    return x


@pytest.mark.both_backends
@pytest.mark.anyio
@pytest.mark.parametrize("deadline", [0.0, 0.005, 0.05])
async def test_move_on_after_while_waiting_for_a_batch(
    source: tuple[Path, list[Path]], deadline: float
) -> None:
    before = await asnapshot()
    async with AsyncHDF5DataLayer(
        source[0], batch_size=50, chunk_size=50, transformers=[("data", _slow)]
    ) as layer:
        got = []
        with anyio.move_on_after(deadline):
            async for b in layer:
                got.append(b)
        check_prefix(got, 50)
        # Whatever was cut short, the next epoch is whole (or, if nothing was yielded, the
        # same epoch starts over from its first batch).
        epoch = 1 if got else 0
        check_epoch([b async for b in layer], N, 50, epoch)
    await aassert_released(before)


@pytest.mark.both_backends
@pytest.mark.anyio
@pytest.mark.parametrize("deadline", [0.0, 0.003, 0.03])
async def test_move_on_after_around_async_with(
    source: tuple[Path, list[Path]], deadline: float
) -> None:
    before = await asnapshot()
    got = []
    with anyio.move_on_after(deadline):
        async with AsyncHDF5DataLayer(
            source[0], batch_size=50, chunk_size=50, transformers=[("data", _slow)]
        ) as layer:
            for _ in range(100):
                async for b in layer:
                    got.append(b)
    await aassert_released(before)
    for b in got:
        check_batch(b, 50)


@pytest.mark.both_backends
@pytest.mark.anyio
async def test_error_in_the_body_closes_everything(source: tuple[Path, list[Path]]) -> None:
    before = await asnapshot()
    with pytest.raises(RuntimeError, match="user code"):
        async with AsyncHDF5DataLayer(source[0], batch_size=10, chunk_size=20) as layer:
            async for _ in layer:
                raise RuntimeError("user code")
    await aassert_released(before)


@pytest.mark.anyio
async def test_error_in_the_body_is_not_wrapped(source: tuple[Path, list[Path]]) -> None:
    with pytest.raises(RuntimeError, match="user code"):
        async with AsyncHDF5DataLayer(source[0], batch_size=10) as layer:
            async for _ in layer:
                raise RuntimeError("user code")


@pytest.mark.anyio
async def test_uncaught_library_error_leaves_async_with_unwrapped(
    source: tuple[Path, list[Path]],
) -> None:
    def explode(x: np.ndarray) -> np.ndarray:
        raise ValueError("boom")

    with pytest.raises(TransformError, match="explode"):
        async with AsyncHDF5DataLayer(
            source[0], batch_size=10, transformers=[("label", explode)]
        ) as layer:
            async for _ in layer:
                pass
