"""layer.stats: where each stage's time went, and the bottleneck in words; the asynchdf5 logger."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

from asynchdf5 import AsyncHDF5DataLayer, MemoryDataLayer
from asynchdf5._stats import LayerStats, StageStats

from ._files import write_source

pytestmark = pytest.mark.anyio


async def test_a_slow_consumer_is_the_bottleneck(tmp_path: Path) -> None:
    lst, _ = write_source(tmp_path, (2000, 2000))
    async with AsyncHDF5DataLayer(lst, batch_size=100, chunk_size=1000) as layer:
        # The steps begin once the first group is gathered: the pipeline's start (reading the
        # first chunk) is latency, not a bottleneck, and on a loaded machine it takes longer
        # than the tenth of the steps that the consumer may wait in all.
        with anyio.fail_after(30):
            while layer.stats.stages["gather"].busy_seconds == 0:
                await anyio.sleep(0.001)
        started = layer.stats.stages
        async for _ in layer:
            await anyio.sleep(0.01)  # the training step
        stats = layer.stats
    consumer = stats.stages["consumer"]
    assert consumer.busy_seconds >= 40 * 0.01
    assert consumer.starved_seconds < consumer.busy_seconds
    # While the consumer stepped, the reader waited for free slots, and the gather thread
    # waited for the consumer to take groups more than for chunks.
    read = _since(started["read"], stats.stages["read"])
    assert read.blocked_seconds > 0
    gather = _since(started["gather"], stats.stages["gather"])
    assert gather.blocked_seconds > gather.starved_seconds
    assert stats.bottleneck().startswith("your training step")


def _since(before: StageStats, after: StageStats) -> StageStats:
    """A stage's seconds from ``before`` to ``after`` (two snapshots of the same layer)."""
    return StageStats(
        after.busy_seconds - before.busy_seconds,
        after.starved_seconds - before.starved_seconds,
        after.blocked_seconds - before.blocked_seconds,
    )


async def test_a_slow_transformer_is_the_bottleneck() -> None:
    def slow(x: np.ndarray) -> np.ndarray:
        time.sleep(0.005)
        return x

    layer = MemoryDataLayer({"x": np.arange(2000)}, batch_size=50, transformers=[("x", slow)])
    async with layer:
        async for _ in layer:
            pass
        stats = layer.stats
    gather = stats.stages["gather"]
    assert gather.busy_seconds >= 40 * 0.005
    assert stats.stages["consumer"].starved_seconds > stats.stages["consumer"].busy_seconds
    assert stats.bottleneck().startswith("gathering and transforming")
    assert stats.transform_seconds >= 40 * 0.005
    assert stats.transform_seconds <= gather.busy_seconds


def _stats(read: StageStats, gather: StageStats, consumer: StageStats) -> LayerStats:
    return LayerStats(
        read_seconds=read.busy_seconds,
        gather_seconds=gather.busy_seconds,
        transform_seconds=0.0,
        consumer_wait_seconds=consumer.starved_seconds,
        bytes_read=1 << 30,
        chunks_read=10,
        batches=1000,
        samples=100_000,
        first_batch_seconds=0.01,
        chunk_rows=10_000,
        resident=False,
        stages={"read": read, "gather": gather, "consumer": consumer},
    )


def test_the_bottleneck_agrees_with_the_stages_busy_seconds() -> None:
    # The reader three times busier than the gather thread, which was starved less than it was
    # busy (chunks came in, just slowly): once named "gathering and transforming" (issue 30).
    consumer = StageStats(busy_seconds=0.2, starved_seconds=3.0, blocked_seconds=0.0)
    stats = _stats(StageStats(3.0, 0.1, 0.2), StageStats(1.0, 0.8, 0.1), consumer)
    assert stats.bottleneck().startswith("reading: the reader was busy 3 s, gathering")
    stats = _stats(StageStats(1.0, 0.1, 0.2), StageStats(3.0, 0.0, 0.1), consumer)
    assert stats.bottleneck().startswith("gathering and transforming: 3 s")
    assert stats.bottleneck().endswith("reading 1 s")


async def test_without_transformers_no_time_is_counted_as_transforming() -> None:
    # Cutting a group into batch views is gathering; only the transformers' calls count here.
    async with MemoryDataLayer({"x": np.arange(20_000)}, batch_size=8) as layer:
        async for _ in layer:
            pass
        stats = layer.stats
    assert stats.transform_seconds == 0.0
    assert stats.gather_seconds > 0.0


def test_the_sync_interface_counts_the_for_loops_steps(tmp_path: Path) -> None:
    layer = MemoryDataLayer({"x": np.arange(500)}, batch_size=50)
    with layer:
        for _ in layer:
            time.sleep(0.01)
        stats = layer.stats
    assert stats.stages["consumer"].busy_seconds >= 10 * 0.01


async def test_logging(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lst, _ = write_source(tmp_path, (300, 300), layout="scaleoffset")
    with caplog.at_level(logging.DEBUG, logger="asynchdf5"):
        async with AsyncHDF5DataLayer(lst, batch_size=50, chunk_size=200) as layer:
            async for _ in layer:
                pass
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert any(lvl == "INFO" and "opened 2 file(s), 600 samples" in m for lvl, m in messages)
    assert any(lvl == "INFO" and "top 'label' is read by" in m for lvl, m in messages)
    assert any(lvl == "WARNING" and "top 'data' is read through h5py" in m for lvl, m in messages)
    assert any(lvl == "DEBUG" and "chunk 0:" in m for lvl, m in messages)


async def test_silent_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A library's logger has no handler of its own: nothing reaches stderr unless asked."""
    lst, _ = write_source(tmp_path, (100,))
    assert not logging.getLogger("asynchdf5").handlers
    async with AsyncHDF5DataLayer(lst, batch_size=50) as layer:
        async for _ in layer:
            pass
    assert capsys.readouterr().err == ""
