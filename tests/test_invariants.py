"""The pipeline's invariants, end to end, over every configuration hypothesis can think of.

Real HDF5 files in a temporary folder (contiguous, chunked and gzip layouts) and in-memory
arrays, every stage (catalog, plan, reader, cache, batcher, gatherer, transformers, hand-off), on
asyncio and trio. Each example runs under a deadline, so a configuration that makes a stage wait
on itself fails here instead of freezing the run (the hang of issue 9 was never seen because no
test could fail by waiting).

Checked for every example, on every rank:

* every epoch yields every sample exactly once (with ``drop_last``: each at most once, and only
  the last partial batch of each rank is left out), and every rank yields the same number of
  batches;
* the rows of every top in a batch belong to the batch's samples (``label == index``,
  ``data == 10 * index``);
* ``stream()`` yields full batches only, which cover each rank's share once per epoch;
* the same seed gives the same batches, read with ``mmap=True`` and without.

The normal test run draws a few dozen examples per backend; ``nox -s stress`` draws thousands
(``ASYNCHDF5_STRESS_EXAMPLES``).
"""

from __future__ import annotations

import dataclasses
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import h5py
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import asynchdf5._read._mapped
from asynchdf5 import AsyncHDF5DataLayer, Batch, CacheBudgetWarning, MemoryDataLayer
from asynchdf5._plan import shard_share

from ._files import ROW_BYTES, ramp, split_refused
from ._helpers import EXAMPLE_DEADLINE, examples, pipeline_examples

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]  # the event loop matters

#: Examples per backend in the normal run, and in ``nox -s stress``.
EXAMPLES = examples(30)
SAMPLE_SHAPE = (2,)  # with an int64 label: rows of ROW_BYTES


@dataclass(frozen=True)
class Case:
    """One configuration of the whole pipeline."""

    kind: str  # "hdf5" or "memory"
    sizes: tuple[int, ...]  # rows per file
    layout: str  # "contiguous", "chunked" or "gzip"
    batch_size: int
    chunk_size: int
    shuffle: bool
    seed: int
    drop_last: bool
    world_size: int
    ramp_rows: int | None  # rows of the first ramp step (None: the default ramp)
    cache_rows: int | None  # cache budget in rows per slot (None: the default budget)
    block_size: int | None  # samples per shuffled block (None: the default, in bytes)
    stream_batches: int  # batches to take from stream() per rank
    mmap: str = "no"  # "no", "kept" (mmap=True) or "dropped" (mmap=True, pages unmapped)

    @property
    def n(self) -> int:
        return sum(self.sizes)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    batch_size = draw(st.integers(1, 48))
    # chunk_size from one batch to beyond the whole data set, often just off a multiple.
    chunk_size = draw(
        st.one_of(
            st.integers(batch_size, 4 * batch_size + 7),
            st.integers(1, 6).map(lambda k: k * batch_size),
            st.integers(batch_size, 700),
        )
    )
    unit = draw(st.sampled_from([batch_size, chunk_size, 1]))

    def size() -> st.SearchStrategy[int]:
        near = st.tuples(st.integers(0, 5), st.integers(-2, 2)).map(
            lambda t: max(0, t[0] * unit + t[1])
        )
        return st.one_of(near, st.integers(0, 400))

    mmap = draw(st.sampled_from(["no", "kept", "dropped"]))
    if mmap != "no" and draw(st.integers(0, 3)):
        # Mostly where mmap=True applies: one file with rows, stored contiguously (files
        # without rows beside it do not count); else it reads as usual.
        rows = draw(size().filter(lambda n: n > 0))
        sizes = [0] * draw(st.integers(0, 1)) + [rows] + [0] * draw(st.integers(0, 1))
        kind, layout = "hdf5", "contiguous"
    else:
        sizes = draw(st.lists(size(), min_size=1, max_size=4).filter(lambda s: sum(s) > 0))
        kind = draw(st.sampled_from(["hdf5", "hdf5", "hdf5", "memory"]))
        layout = draw(st.sampled_from(["contiguous", "chunked", "gzip"]))
    return Case(
        kind=kind,
        sizes=tuple(sizes),
        layout=layout,
        batch_size=batch_size,
        chunk_size=chunk_size,
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32)),
        drop_last=draw(st.booleans()),
        world_size=draw(st.integers(1, 4)),
        ramp_rows=draw(st.one_of(st.none(), st.integers(1, 3 * batch_size))),
        cache_rows=draw(st.one_of(st.none(), st.none(), st.integers(batch_size, chunk_size + 9))),
        block_size=draw(st.one_of(st.none(), st.integers(1, 2 * chunk_size))),
        stream_batches=draw(st.integers(1, 40)),
        mmap=mmap,
    )


def write(folder: Path, case: Case) -> list[Path]:
    paths, start = [], 0
    for i, n in enumerate(case.sizes):
        path = folder / f"part{i}.h5"
        idx = np.arange(start, start + n, dtype=np.int64)
        data = np.repeat((idx * 10).astype(np.float32)[:, None], SAMPLE_SHAPE[0], axis=1)
        kw: dict[str, Any] = {}
        if case.layout != "contiguous" and n > 0:
            kw["chunks"] = (max(1, min(n, 1 + case.seed % 37)), *SAMPLE_SHAPE)
            if case.layout == "gzip":
                kw["compression"] = "gzip"
        with h5py.File(path, "w") as f:
            f.create_dataset("data", data=data, **kw)
            f.create_dataset("label", data=idx, **({"chunks": (kw["chunks"][0],)} if kw else {}))
        paths.append(path)
        start += n
    return paths


def refused(case: Case) -> bool:
    """Whether the configuration is refused at open (the bad-input tests cover those)."""
    return split_refused(case.n, case.batch_size, case.world_size, case.drop_last)


@contextmanager
def mapping(mode: str) -> Iterator[None]:
    """``"dropped"``: every data set counts as larger than memory, so that ``mmap=True``
    unmaps each chunk's pages once it is served."""
    saved = asynchdf5._read._mapped.default_keep_bytes
    if mode == "dropped":
        asynchdf5._read._mapped.default_keep_bytes = lambda: 0
    try:
        yield
    finally:
        asynchdf5._read._mapped.default_keep_bytes = saved


def make_layer(case: Case, paths: list[Path], rank: int) -> Any:
    kw: dict[str, Any] = dict(
        batch_size=case.batch_size,
        shuffle=case.shuffle,
        seed=case.seed,
        drop_last=case.drop_last,
        rank=rank,
        world_size=case.world_size,
        prefetch=1 + case.seed % 9,
    )
    if case.kind == "memory":
        idx = np.arange(case.n, dtype=np.int64)
        data = np.repeat((idx * 10).astype(np.float32)[:, None], SAMPLE_SHAPE[0], axis=1)
        return MemoryDataLayer({"data": data, "label": idx}, **kw)
    if case.cache_rows is not None:
        kw["cache_bytes"] = 2 * case.cache_rows * ROW_BYTES
    return AsyncHDF5DataLayer(
        paths,
        chunk_size=case.chunk_size,
        block_size=case.block_size,
        mmap=case.mmap != "no",  # applies to one contiguous file; the others read as usual
        **kw,
    )


def aligned(batch: Batch, case: Case) -> np.ndarray:
    assert 0 < len(batch.indices) <= case.batch_size
    np.testing.assert_array_equal(batch["label"], batch.indices)
    np.testing.assert_array_equal(batch["data"][:, 0], batch.indices * 10)
    np.testing.assert_array_equal(batch["data"][:, -1], batch.indices * 10)
    return np.array(batch.indices, copy=True)


async def run_rank(
    case: Case, paths: list[Path], rank: int
) -> tuple[list[list[np.ndarray]], list[Batch]]:
    """Two epochs, then ``stream_batches`` batches of stream(), of one rank."""
    layer = make_layer(case, paths, rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheBudgetWarning)  # the small budgets shrink chunks
        async with layer:
            epochs = []
            for _ in range(2):
                epochs.append([aligned(b, case) async for b in layer])
            streamed: list[Batch] = []
            async for batch in layer.stream():
                aligned(batch, case)
                assert len(batch.indices) == case.batch_size  # always full, whatever drop_last
                streamed.append(batch)
                if len(streamed) == case.stream_batches:
                    break
    return epochs, streamed


async def check_case(case: Case) -> None:
    lane_rows = 1 + case.seed % 5  # 1 to 5 rows: one lane to 32
    with tempfile.TemporaryDirectory() as tmp, ramp(case.ramp_rows, lane_rows), mapping(case.mmap):
        paths = write(Path(tmp), case) if case.kind == "hdf5" else []
        ranks = [await run_rank(case, paths, r) for r in range(case.world_size)]
        n, w, b = case.n, case.world_size, case.batch_size
        for epoch in range(2):
            per_rank = [ranks[r][0][epoch] for r in range(w)]
            assert len({len(batches) for batches in per_rank}) == 1, "unequal batch counts"
            idx = np.concatenate([i for batches in per_rank for i in batches])
            assert len(np.unique(idx)) == len(idx), "a sample was yielded twice"
            if case.drop_last:
                assert len(idx) == (n // (w * b)) * w * b
            else:
                np.testing.assert_array_equal(np.sort(idx), np.arange(n))
        # stream(): each rank's share once per epoch, starting at epoch 2 (two were iterated).
        first_windows = []
        for r in range(w):
            share = shard_share(n, b, r, w)[1]
            streamed = np.concatenate([bt.indices for bt in ranks[r][1]])
            for k in range(len(streamed) // share):
                window = streamed[k * share : (k + 1) * share]
                assert len(np.unique(window)) == share, "stream repeated a sample in an epoch"
            if len(streamed) >= share:
                first_windows.append(streamed[:share])
            assert ranks[r][1][0].epoch == 2
        if len(first_windows) == w:
            np.testing.assert_array_equal(np.sort(np.concatenate(first_windows)), np.arange(n))
        # The same seed gives the same batches (rank 0, first epoch), read the other way too
        # (mmap=True for a case that copied, and the converse).
        other = dataclasses.replace(case, mmap="no" if case.mmap != "no" else "kept")
        again = await run_rank(other, paths, 0)
        for x, y in zip(again[0][0], ranks[0][0][0], strict=True):
            np.testing.assert_array_equal(x, y)


@pipeline_examples(EXAMPLES)
@given(case=cases())
async def test_whole_pipeline_never_hangs_and_yields_each_sample_once(case: Case) -> None:
    if refused(case):
        return
    with anyio.fail_after(EXAMPLE_DEADLINE):
        await check_case(case)


KNOWN_HANGS = [
    # (sizes, chunk_size, batch_size, seed, shuffle): found by the stress trial of issue 9.
    ((4278,), 128, 96, 7, True),
    ((4278,), 128, 96, 0, True),
    ((5000,), 128, 96, 1, True),
    ((1000,), 333, 33, 0, True),
    ((1000,), 333, 33, 3, True),
    ((1000,), 333, 33, 0, False),
]


@pytest.mark.parametrize(("sizes", "chunk_size", "batch_size", "seed", "shuffle"), KNOWN_HANGS)
async def test_known_hangs(
    sizes: tuple[int, ...], chunk_size: int, batch_size: int, seed: int, shuffle: bool
) -> None:
    case = Case(
        kind="hdf5",
        sizes=sizes,
        layout="contiguous",
        batch_size=batch_size,
        chunk_size=chunk_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=False,
        world_size=1,
        ramp_rows=None,
        cache_rows=None,
        block_size=None,
        stream_batches=3 * sum(sizes) // batch_size,
    )
    with anyio.fail_after(EXAMPLE_DEADLINE):
        await check_case(case)
