"""The shuffle's mixing promise (docs/shuffle.md): on class-sorted data, the mean per-batch label
entropy of a shuffled epoch is at least 0.95 of a full permutation's, at every row width and when
the cache had to shrink to a small memory budget (the chunks then take their rows from lanes).

The narrow rows and the shrunk cache run the whole pipeline on real files; the wide rows (a data
set of them is hundreds of GB) run the planner with the sizes the layer computes for them.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import anyio
import h5py
import numpy as np
import pytest

from asynchdf5 import AsyncHDF5DataLayer, CacheBudgetWarning
from asynchdf5._cache import size_cache
from asynchdf5._plan import plan_epoch
from asynchdf5._planner import chunk_lanes, default_block_rows, first_read

CLASSES = 10
BATCH = 256
PROMISE = 0.95


def entropy(labels: np.ndarray) -> float:
    """Mean label entropy of the full batches of ``labels`` (in order), divided by log 10."""
    nb = len(labels) // BATCH
    counts = np.zeros((nb, CLASSES))
    rows = np.repeat(np.arange(nb), BATCH)
    np.add.at(counts, (rows, labels[: nb * BATCH]), 1)
    p = counts / BATCH
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
    return float(h.mean() / math.log(CLASSES))


def against_permutation(labels: np.ndarray, n: int) -> float:
    """``labels``' entropy divided by that of a random permutation of the same data set."""
    perm = np.random.default_rng(0).permutation(n) * CLASSES // n
    return entropy(labels) / entropy(perm)


def write_sorted(path: Path, n: int, width: int) -> Path:
    """``n`` samples of ``uint8[width]`` data and an int64 label, sorted by class."""
    with h5py.File(path, "w") as f:
        f.create_dataset("data", shape=(n, width), dtype=np.uint8)  # zeros: only labels matter
        f.create_dataset("label", data=np.arange(n, dtype=np.int64) * CLASSES // n)
    return path


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("n", "width", "props"),
    [
        pytest.param(2_000_000, 1, {}, id="9-byte rows"),
        pytest.param(600_000, 56, {"chunk_size": 2**18}, id="64-byte rows"),
        pytest.param(40_000, 3072, {"cache_bytes": 2 * 3000 * 3080}, id="3KB-rows-small-cache"),
    ],
)
async def test_a_shuffled_epoch_mixes_class_sorted_rows(
    tmp_path: Path, n: int, width: int, props: dict[str, Any]
) -> None:
    source = [str(write_sorted(tmp_path / "sorted.h5", n, width))]
    with warnings.catch_warnings():
        # The small cache warns that its chunks shrink: that is the case under test.
        warnings.simplefilter("ignore", CacheBudgetWarning)
        layer = AsyncHDF5DataLayer(source, batch_size=BATCH, shuffle=True, seed=1, **props)
        labels = []
        with anyio.fail_after(120):
            async with layer:
                async for batch in layer:
                    labels.append(np.asarray(batch["label"]).copy())
    got = np.concatenate(labels)
    assert np.array_equal(np.sort(got), np.arange(n) * CLASSES // n)  # every sample once
    assert against_permutation(got, n) >= PROMISE


@pytest.mark.parametrize(
    ("row_bytes", "budget"),
    [
        pytest.param(3080, 8 * 2**30, id="3KB rows, 8 GiB"),
        pytest.param(3080, 512 * 2**20 // 3, id="3KB rows, a third of 512 MiB"),
        pytest.param(150 * 2**10 + 8, 8 * 2**30, id="150KB rows, 8 GiB"),
        pytest.param(150 * 2**10 + 8, 512 * 2**20 // 3, id="150KB rows, a third of 512 MiB"),
    ],
)
def test_the_planned_order_of_wide_rows_mixes(row_bytes: int, budget: int) -> None:
    """The sizes :meth:`AsyncHDF5DataLayer._shape_of` computes for a local contiguous file,
    from the default properties and the cache budget."""
    n, chunk_size = 2_000_000, 2**20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheBudgetWarning)
        cache = size_cache(
            n, row_bytes, batch_size=BATCH, world_size=1, chunk_size=chunk_size, cache_bytes=budget
        )
    block = default_block_rows(row_bytes, chunk_size)
    first, ramp = first_read(BATCH, row_bytes, shuffle=True)
    plan = plan_epoch(
        n,
        epoch=0,
        batch_size=BATCH,
        chunk_size=cache.chunk_rows,
        shuffle=True,
        seed=1,
        first_rows=first,
        block_size=block,
        ramp_lanes=ramp,
        chunk_lanes=chunk_lanes(cache.chunk_rows, block, row_bytes),
    )
    assert max(c.rows for c in plan.chunks) <= cache.chunk_rows  # each fits its slot
    order = np.concatenate([c.served_indices(c.order()) for c in plan.chunks])
    assert np.array_equal(np.sort(order), np.arange(n))
    assert against_permutation(order * CLASSES // n, n) >= PROMISE
    # Reads stay large where the rows are wide: every stretch of a chunk is >= 256 KiB.
    pieces = [b - a for c in plan.chunks[1:] for a, b in c.ranges]
    assert np.median(pieces) * row_bytes >= 256 * 2**10


def test_a_cache_too_small_to_mix_says_so_and_how_much_would(tmp_path: Path) -> None:
    """Chunks of 40 rows of 3 KB draw from fewer than 36 places: the layer warns, naming the
    cache that would mix; 36 lane parts of 256 KiB in each of two slots do not warn."""
    source = [str(write_sorted(tmp_path / "sorted.h5", 20_000, 3072))]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "chunk_size=", CacheBudgetWarning)  # they shrink
        with pytest.warns(CacheBudgetWarning, match=r"draw from \d+ places.*at least 18 MiB"):
            len(AsyncHDF5DataLayer(source, shuffle=True, batch_size=8, cache_bytes=2 * 40 * 3080))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all, beyond the shrunk chunks'
        warnings.filterwarnings("ignore", "chunk_size=", CacheBudgetWarning)
        len(AsyncHDF5DataLayer(source, shuffle=True, batch_size=8, cache_bytes=18 * 2**20))
