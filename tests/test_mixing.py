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

from asynchdf5 import AsyncHDF5DataLayer, CacheBudgetWarning, HDF5DataLayer
from asynchdf5._catalog import SHUFFLED_ATTR
from asynchdf5._config import MIN_PLACES, LayerConfig
from asynchdf5._plan import plan_epoch
from asynchdf5._sizing import chunk_lanes, default_block_rows, first_read, order_of, size_cache
from asynchdf5._walk import growing_ramp, ramp_sizes

from ._helpers import run_main

CLASSES = 10
BATCH = 256
PROMISE = 0.95


def entropy(labels: np.ndarray) -> float:
    """Mean label entropy of the full batches of ``labels`` (in order), divided by log 10."""
    return float(batch_entropies(labels).mean())


def batch_entropies(labels: np.ndarray) -> np.ndarray:
    """Label entropy of each full batch of ``labels`` (in order), divided by log 10."""
    nb = len(labels) // BATCH
    counts = np.zeros((nb, CLASSES))
    rows = np.repeat(np.arange(nb), BATCH)
    np.add.at(counts, (rows, labels[: nb * BATCH]), 1)
    p = counts / BATCH
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
    return np.asarray(h / math.log(CLASSES))


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


# --- the start of every epoch -------------------------------------------------------------------
#
# Every window of WINDOW batches of every epoch mixes to the promise, the first (an epoch's ramp,
# read in growing pieces) included; and a resident data set's epochs after the first are uniform
# permutations from their first batch: samples stored close together share a batch no more often
# than in a permutation (with the ramp, each piece was permuted within itself only: they shared
# one 2-3 times as often, in every epoch).

WINDOW = 100
NEAR = 512  # samples stored fewer rows apart than this are "close"


def window_entropies(order: np.ndarray, n: int) -> np.ndarray:
    """The mean label entropy of each window of WINDOW full batches of ``order`` (global indices
    of class-sorted data), divided by a random permutation's."""
    return label_windows(order * CLASSES // n, n)


def label_windows(labels: np.ndarray, n: int) -> np.ndarray:
    """The same of an epoch's ``labels`` (in serving order) of a data set of ``n`` samples."""
    each = batch_entropies(labels)
    perm = np.random.default_rng(0).permutation(n) * CLASSES // n
    sums = np.concatenate(([0.0], np.cumsum(each)))
    windows = (sums[WINDOW:] - sums[:-WINDOW]) / WINDOW  # every window, the first included
    return np.asarray(windows / entropy(perm))


def close_pairs(order: np.ndarray, n: int) -> float:
    """How often two samples stored fewer than NEAR rows apart share a batch of ``order``,
    divided by how often they would in a uniform permutation."""
    batches = len(order) // BATCH
    s = np.sort(order[: batches * BATCH].reshape(batches, BATCH), axis=1)
    # Pairs (i, j), i < j, of a batch with s[j] - s[i] < NEAR: for each i, the j before the
    # first element at or past s[i] + NEAR (searched row by row, offset to one sorted array).
    flat = (s + np.arange(batches)[:, None] * (2 * n + 2 * NEAR)).ravel()
    ahead = np.searchsorted(flat, flat + NEAR) - np.arange(1, batches * BATCH + 1)
    count = int(ahead.sum())
    pairs = batches * BATCH * (BATCH - 1) / 2
    return count / (pairs * (2 * NEAR - 1) / n)  # a pair is close with probability ~ that


def write_stored(path: Path, n: int, width: int, layout: str) -> Path:
    """``n`` class-sorted samples of ``uint8[width]`` and an int64 label, the data stored
    ``layout``: contiguous, or in chunks of ``"chunked:ROWS"`` or ``"gzip:ROWS"`` rows."""
    kind, _, rows = layout.partition(":")
    stored: dict[str, Any] = {}
    if kind != "contiguous":
        stored["chunks"] = (int(rows), width)
    if kind == "gzip":
        stored["compression"] = "gzip"
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=np.zeros((n, width), np.uint8), **stored)
        f.create_dataset("label", data=np.arange(n, dtype=np.int64) * CLASSES // n)
    return path


async def epochs_of(source: list[str], epochs: int, **props: Any) -> tuple[list[np.ndarray], bool]:
    """The global indices of ``epochs`` shuffled epochs, and whether the data was resident."""
    layer = AsyncHDF5DataLayer(source, batch_size=BATCH, shuffle=True, seed=3, **props)
    out = []
    with anyio.fail_after(120):
        async with layer:
            for _ in range(epochs):
                got = [np.asarray(b.indices).copy() async for b in layer]
                out.append(np.concatenate(got))
            resident = layer.stats.resident
    return out, resident


#: (n, width): rows of 64 bytes and of 1 KiB with their label, enough of them that the first
#: chunk is read as a ramp (8 MiB first, or 32 stored chunks) and an epoch has several windows.
NARROW, WIDE = (300_000, 56), (80_000, 1016)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the order is the planner's
@pytest.mark.parametrize("layout", ["contiguous", "chunked:64", "gzip:1024"])
@pytest.mark.parametrize(("n", "width"), [NARROW, WIDE], ids=["64B rows", "1KiB rows"])
async def test_a_resident_data_set_mixes_from_the_first_batch_of_every_epoch(
    tmp_path: Path, layout: str, n: int, width: int
) -> None:
    """Epoch 0 reads the data (its ramp's windows mix to the promise; with gzip chunks of 1,024
    rows of 1 KiB, its first pieces drew from 8 places: 0.79-0.88); epochs 1 and 2 are served
    from memory, as uniform permutations (close samples shared a batch 2.3-3.4x as often)."""
    source = [str(write_stored(tmp_path / "sorted.h5", n, width, layout))]
    orders, resident = await epochs_of(source, 3)
    assert resident
    for epoch, order in enumerate(orders):
        assert np.array_equal(np.sort(order), np.arange(n))  # every sample once
        assert window_entropies(order, n).min() >= PROMISE, epoch
        if epoch:
            assert close_pairs(order, n) < 1.2, epoch


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the order is the planner's
@pytest.mark.parametrize(
    ("layout", "n", "width", "chunk_size"),
    [
        pytest.param("contiguous", *NARROW, 280_000, id="64B rows-contiguous"),
        pytest.param("contiguous", *WIDE, 20_000, id="1KiB rows-contiguous"),
        pytest.param("chunked:64", *WIDE, 20_000, id="1KiB rows-chunked"),
        pytest.param("gzip:64", *WIDE, 20_000, id="1KiB rows-gzip"),
    ],
)
async def test_every_window_of_a_streaming_epoch_mixes(
    tmp_path: Path, layout: str, n: int, width: int, chunk_size: int
) -> None:
    """Streaming (chunks smaller than the data set), every epoch's first chunk is a ramp: its
    windows mix to the promise. (Narrow rows in stored chunks are left out: their blocks are
    at least 1 MiB and 4 stored chunks, so chunks large enough for a ramp at this size draw
    from fewer than 36 places, below the promise.)"""
    source = [str(write_stored(tmp_path / "sorted.h5", n, width, layout))]
    orders, resident = await epochs_of(source, 2, chunk_size=chunk_size)
    assert not resident
    for epoch, order in enumerate(orders):
        assert np.array_equal(np.sort(order), np.arange(n))
        assert window_entropies(order, n).min() >= PROMISE, epoch


def plan_as_the_layer(
    n: int, epoch: int, order_: Any, chunk_size: int = 2**20, **extra: Any
) -> Any:
    """Epoch ``epoch`` of ``n`` rows in chunks of ``chunk_size``, shuffled with seed 1, in the
    order ``order_`` (:func:`order_of`) sizes, as the layer plans it."""
    return plan_epoch(
        n,
        epoch=epoch,
        batch_size=BATCH,
        chunk_size=chunk_size,
        shuffle=True,
        seed=1,
        first_rows=order_.first_rows,
        block_size=order_.block_rows,
        ramp_lanes=order_.ramp_lanes,
        chunk_lanes=order_.chunk_lanes,
        ramp_top_lanes=order_.ramp_top_lanes,
        **extra,
    )


@pytest.mark.parametrize("stored_rows", [0, 1024], ids=["contiguous", "gzip chunks of 1024"])
def test_the_ramp_of_a_large_streaming_epoch_mixes(stored_rows: int) -> None:
    """2,000,000 rows of 1 KiB in chunks of 2**20, as the layer plans them: the ramp's pieces
    draw from more places as they grow, sampled evenly over the rows the chunk holds (with 32
    lanes in every piece, windows of its first 400 batches fell to 0.91-0.95; with gzip
    chunks of 1,024 rows, 8 lanes, to 0.67-0.80)."""
    n, row_bytes = 2_000_000, 1024
    order_ = order_of(
        LayerConfig.parse({"batch_size": BATCH, "shuffle": True, "seed": 1}),
        row_bytes,
        2**20,
        stored_rows,
    )
    for epoch in range(3):
        plan = plan_as_the_layer(n, epoch, order_)
        order = np.concatenate([c.served_indices(c.order()) for c in plan.chunks])
        assert np.array_equal(np.sort(order), np.arange(n))
        assert window_entropies(order, n).min() >= PROMISE, epoch


@pytest.mark.parametrize("chunk_rows", [2206, 600, 20_000])
def test_value_chunks_lengthen_lane_parts_while_a_chunk_keeps_its_places(chunk_rows: int) -> None:
    """The ragged benchmark's gzipped sparse ``.h5ad`` out of core, as the layer plans it:
    50,000 cells of 9,083 bytes, ``X``'s stored chunks of 27,683 values spanning 25 cells
    (``value_rows``), an ``obs`` column's 2. Lane parts span a few of them (a stored chunk at a
    part's edge is decoded by both parts) while a chunk keeps MIN_PLACES lanes: in chunks of
    2,206 cells (its 128 MiB cgroup) 36 lanes of 61 cells instead of 78 of 28 (1.9 decodes a
    stored chunk an epoch); never fewer lanes than without them, nor a warning more. Every
    window of an epoch mixes to the promise where no warning says otherwise."""
    n, row_bytes = 50_000, 9083
    config = LayerConfig.parse({"batch_size": BATCH, "shuffle": True, "seed": 1})
    plain = order_of(config, row_bytes, chunk_rows, 2)
    order_ = order_of(config, row_bytes, chunk_rows, 2, value_rows=25)
    assert order_.block_rows == plain.block_rows
    assert order_.chunk_lanes >= min(plain.chunk_lanes, MIN_PLACES)
    assert order_.warning is None or plain.warning is not None
    if chunk_rows == 2206:
        assert (plain.chunk_lanes, order_.chunk_lanes) == (78, MIN_PLACES)
    for epoch in range(2):
        plan = plan_as_the_layer(n, epoch, order_, chunk_rows)
        order = np.concatenate([c.served_indices(c.order()) for c in plan.chunks])
        assert np.array_equal(np.sort(order), np.arange(n))
        if order_.warning is None:
            assert window_entropies(order, n).min() >= PROMISE, epoch


@pytest.mark.parametrize("epoch", range(2))
def test_the_last_chunk_of_a_streaming_epoch_mixes(epoch: int) -> None:
    """2**20 + 5,000 rows of 3,080 bytes in chunks of 2**20 (192 blocks, no lanes), as the layer
    plans them: the share is cut into two chunks of equal sizes. Cut into a full chunk and a
    remainder, the remainder was one block: about 20 batches of one class."""
    n, row_bytes = 2**20 + 5_000, 3080
    config = LayerConfig.parse({"batch_size": BATCH, "shuffle": True, "seed": 1})
    order_ = order_of(config, row_bytes, 2**20)
    assert order_.chunk_lanes == 1
    for even in (False, True):
        plan = plan_as_the_layer(n, epoch, order_, even_chunks=even)
        order = np.concatenate([c.served_indices(c.order()) for c in plan.chunks])
        assert np.array_equal(np.sort(order), np.arange(n))
        assert max(c.rows for c in plan.chunks) <= 2**20
        worst = window_entropies(order, n).min()
        assert worst >= PROMISE if even else worst < PROMISE, (even, worst)


@pytest.mark.parametrize("seed", range(40))
def test_a_growing_ramp_takes_every_row_once_from_more_places_each_piece(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, first = int(rng.integers(1, 50_000)), int(rng.integers(1, 2_000))
    lanes, top = int(rng.integers(1, 64)), int(rng.integers(1, 400))
    pieces = growing_ramp(0, rows, first, lanes, top)
    parts = sorted(p for piece in pieces for p in piece)
    assert [a for a, _ in parts] == [0, *(b for _, b in parts[:-1])]  # every row once, in order
    assert parts[-1][1] == rows and all(a < b for a, b in parts)
    assert [sum(b - a for a, b in piece) for piece in pieces] == ramp_sizes(rows, first)
    places = [len(piece) for piece in pieces]
    for k in range(1, len(pieces) - 1):  # the last piece takes what is left of every lane
        assert places[k] >= min(places[k - 1], max(1, top // 2)), places


# --- data packed shuffled -----------------------------------------------------------------------


def pack_sorted(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> Path:
    """60,000 class-sorted samples of ``uint8[56]`` packed by ``asynchdf5 pack`` into 4 files;
    the data's first byte is the class."""
    n = 60_000
    tmp_path.mkdir(exist_ok=True)
    labels = np.arange(n) * CLASSES // n
    data = np.zeros((n, 56), np.uint8)
    data[:, 0] = labels
    np.save(tmp_path / "data.npy", data)
    np.save(tmp_path / "labels.npy", labels)
    out = tmp_path / "out"
    status, _, err = run_main(
        ["pack", tmp_path / "data.npy", out, "--labels", tmp_path / "labels.npy",
         "--samples-per-file", 15_000, *flags],
        capsys,
    )  # fmt: skip
    assert status == 0, err
    return out / "train.txt"


def test_pack_shuffle_says_so_in_every_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flags, said in (((), None), (("--shuffle",), True)):
        source = pack_sorted(tmp_path / str(said), capsys, *flags)
        for name in source.read_text().split():
            with h5py.File(source.parent / name, "r") as f:
                assert f.attrs.get(SHUFFLED_ATTR) == said


def test_data_packed_shuffled_is_read_in_long_stretches_and_mixes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every file packed with ``--shuffle``: each chunk (and each piece of a ramp) is one
    stretch of rows (two where it wraps the ring or crosses a file), and batches of the
    class-sorted data mix as a permutation's; a file without the attribute among them brings
    back the blocks and lanes of the default order. Every sample once, and an exact resume."""
    source = str(pack_sorted(tmp_path, capsys, "--shuffle"))
    props: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "seed": 5, "chunk_size": 8192}
    with HDF5DataLayer(source, **props) as layer:
        plan = layer._planner.plan(0)  # the order the layer serves: planned, not read
        batches = [(np.asarray(b["label"]).copy(), np.asarray(b["data"][:, 0])) for b in layer]
    labels = [label for label, _ in batches]
    assert all(np.array_equal(label, first) for label, first in batches)  # rows aligned
    files = 4
    assert max(len(c.ranges) for c in plan.chunks) <= 2
    assert sum(len(c.ranges) for c in plan.chunks) <= len(plan.chunks) + files
    got = np.concatenate(labels)
    assert np.array_equal(np.sort(got), np.arange(60_000) * CLASSES // 60_000)
    perm = np.random.default_rng(0).permutation(60_000) * CLASSES // 60_000
    each = batch_entropies(got) / entropy(perm)
    assert each[: len(each) // WINDOW * WINDOW].reshape(-1, WINDOW).mean(axis=1).min() >= PROMISE

    # Exact resume in the middle of an epoch: the same batches as the run that saved it.
    with HDF5DataLayer(source, **props) as layer:
        it = iter(layer)
        for _ in range(50):
            next(it)
        state = layer.state_dict()
        rest = [np.asarray(b.indices).copy() for b in it]
    with HDF5DataLayer(source, **props) as layer:
        layer.load_state_dict(state)
        again = [np.asarray(b.indices).copy() for b in layer]
    assert len(again) == len(rest)
    assert all(np.array_equal(a, b) for a, b in zip(again, rest, strict=True))

    # One file without the attribute: the default order's blocks and lanes.
    first = tmp_path / "out" / Path(source).read_text().split()[0]
    with h5py.File(first, "r+") as f:
        del f.attrs[SHUFFLED_ATTR]
    with HDF5DataLayer(source, **props) as layer:
        assert max(len(c.ranges) for c in layer._planner.plan(0).chunks) > 2


def write_sorted_cells(path: Path, n: int) -> Path:
    """``n`` cells written by the real ``anndata`` package, gzipped: X sparse (CSR, about 100
    non-zeros a cell), ``obs/cell_type`` categorical and sorted (the CLASSES types in
    contiguous runs, as atlases often are), ``obs/n_counts`` a float32 column. anndata stores
    the obs columns in stored chunks of thousands of rows of a few bytes each."""
    ad = pytest.importorskip("anndata")
    pd = pytest.importorskip("pandas")
    sparse = pytest.importorskip("scipy.sparse")
    rng = np.random.default_rng(0)
    x = sparse.random(n, 200, density=0.5, format="csr", dtype=np.float32, random_state=rng)
    types = np.arange(n) * CLASSES // n
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical.from_codes(types, categories=[f"t{c}" for c in range(10)]),
            "n_counts": np.asarray(x.sum(axis=1), dtype=np.float32).ravel(),
        },
        index=[f"c{i}" for i in range(n)],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anndata's warnings about its own future
        ad.AnnData(X=x, obs=obs).write_h5ad(path, compression="gzip")
    return path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tops", [("X", "obs/cell_type"), ("X", "obs/cell_type", "obs/n_counts")])
def test_gzipped_cells_sorted_by_type_mix_in_a_small_cache(
    tmp_path: Path, tops: tuple[str, ...]
) -> None:
    """anndata gzips each obs column in chunks of thousands of rows; a few bytes each, they
    cost little to decode again, so they must not stretch the blocks: counted in their own
    rows they made blocks of tens of thousands of cells, and a small cache's chunks each one
    stretch of the file (the worst window of 100 batches of epochs 1-3 at 0.28-0.29 of a
    permutation's entropy). Every window mixes to the promise, with a margin."""
    n = 40_000
    path = write_sorted_cells(tmp_path / "cells.h5ad", n)
    labels = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheBudgetWarning)  # the cache is small on purpose
        layer = HDF5DataLayer(
            str(path), tops=tops, batch_size=BATCH, shuffle=True, seed=3, cache_bytes=8 * 2**20
        )
        with layer:
            for _ in range(4):
                got = [np.asarray(b["obs/cell_type"]).astype(np.int64) for b in layer]
                labels.append(np.concatenate(got))
    for epoch, lab in enumerate(labels[1:], 1):
        assert np.array_equal(np.bincount(lab), np.bincount(np.arange(n) * CLASSES // n))
        assert label_windows(lab, n).min() >= PROMISE - 0.02, epoch
