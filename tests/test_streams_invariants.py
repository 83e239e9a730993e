"""The whole pipeline with several streams, over configurations hypothesis draws (issue 33).

Streams of real HDF5 files (contiguous or chunked), their shares drawn (natural, ``weight=``,
``choose=``), with batch modes, batch and chunk sizes, cache budgets, blocks, first-read ramps
and their lanes, shuffle, seeds, ``drop_last`` and world sizes drawn too; every example runs
two epochs on every rank under a deadline (a stage waiting on itself fails here instead of
freezing the run). Checked:

* every rank yields the same number of batches, every row aligned (``label == index``), and
  ``batch.streams`` says each row's stream;
* each stream gives its exact count per epoch (with ``drop_last``, the epoch is cut as one
  source's is and no stream gives more than its count);
* over the two epochs, each stream's samples appear ``floor(2 * count / size)`` times or once
  more (its walk: every sample before any repeats), and once per epoch at its natural share;
* ``"stratified"``: every full batch holds each stream's share rounded down or up;
  ``"per_stream"``: every batch holds one stream, and with ``schemas`` drawn (streams whose
  data differ in sample shape and labels in dtype) that stream's arrays.

The normal run draws a few dozen examples; ``nox -s stress`` more
(``ASYNCHDF5_STRESS_EXAMPLES``).
"""

from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import anyio
import h5py
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asynchdf5 import AsyncHDF5DataLayer, CacheBudgetWarning, Stream
from asynchdf5._streams import StreamSpec, stream_counts

from ._files import ROW_BYTES, ramp, rows, split_refused
from ._helpers import EXAMPLE_DEADLINE, examples, pipeline_examples

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]  # the event loop matters

EXAMPLES = max(10, examples(100) // 4)


@dataclass(frozen=True)
class Case:
    sizes: tuple[tuple[int, ...], ...]  # each stream's files' rows
    shares: tuple[tuple[str, float], ...]  # ("natural", 0), ("weight", w) or ("choose", n)
    mode: str
    chunked: bool
    batch_size: int
    chunk_size: int
    shuffle: bool
    seed: int
    drop_last: bool
    world_size: int
    cache_rows: int | None
    block_size: int | None
    ramp_rows: int | None = None  # rows of the first ramp step (None: the default ramp)
    schemas: bool = False  # per_stream: stream s's data of shape (2 + s,), odd ones' labels int32

    def shape(self, s: int) -> tuple[int, ...]:
        return (2 + s,) if self.schemas else (2,)

    def label(self, s: int) -> str:
        return "int32" if self.schemas and s % 2 else "int64"

    def row_bytes(self) -> int:
        """Bytes of a row in the cache: every variant of every top (``_schemas``)."""
        if not self.schemas:
            return ROW_BYTES
        k = len(self.sizes)
        labels = {self.label(s) for s in range(k)}
        return sum(4 * self.shape(s)[0] for s in range(k)) + sum(
            np.dtype(t).itemsize for t in labels
        )

    def counts(self) -> tuple[int, ...]:
        specs = [
            StreamSpec(
                str(s),
                (),
                v if kind == "weight" else None,
                int(v) if kind == "choose" else None,
            )
            for s, (kind, v) in enumerate(self.shares)
        ]
        return stream_counts(specs, [sum(f) for f in self.sizes])


@st.composite
def cases(draw: st.DrawFn, schemas: bool = False) -> Case:
    """A configuration; ``schemas``: always per_stream over streams of different schemas."""
    k = draw(st.integers(2 if schemas else 1, 3))
    sizes = tuple(
        tuple(draw(st.lists(st.integers(1, 150), min_size=1, max_size=2))) for _ in range(k)
    )
    shares = tuple(
        draw(
            st.one_of(
                st.just(("natural", 0.0)),
                st.floats(0.05, 4.0).map(lambda w: ("weight", w)),
                st.integers(0, 300).map(lambda n: ("choose", float(n))),
            )
        )
        for _ in range(k)
    )
    batch_size = draw(st.integers(1, 24))
    chunk_size = draw(st.integers(batch_size, 4 * batch_size + 30))
    mode = (
        "per_stream" if schemas else draw(st.sampled_from(["stratified", "random", "per_stream"]))
    )
    return Case(
        sizes=sizes,
        shares=shares,
        mode=mode,
        schemas=schemas or (mode == "per_stream" and k > 1 and draw(st.booleans())),
        chunked=draw(st.booleans()),
        batch_size=batch_size,
        chunk_size=chunk_size,
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32)),
        drop_last=draw(st.booleans()),
        world_size=draw(st.integers(1, 3)),
        cache_rows=draw(st.one_of(st.none(), st.integers(batch_size, chunk_size + 9))),
        block_size=draw(st.one_of(st.none(), st.integers(1, 2 * chunk_size))),
        ramp_rows=draw(st.one_of(st.none(), st.integers(1, 3 * batch_size))),
    )


def refused(case: Case) -> bool:
    """Configurations refused at construction or open (their tests are elsewhere)."""
    try:
        counts = case.counts()
    except Exception:
        return True

    def bad(n: int) -> bool:
        return split_refused(n, case.batch_size, case.world_size, case.drop_last)

    if case.mode == "per_stream":  # each stream is cut into batches as one source is
        return any(bad(n) for n in counts if n)
    return bad(sum(counts))


def write(folder: Path, case: Case) -> list[list[Path]]:
    out: list[list[Path]] = []
    start = 0
    for s, files in enumerate(case.sizes):
        out.append([])
        for f, n in enumerate(files):
            path = folder / f"s{s}-{f}.h5"
            with h5py.File(path, "w") as h5:
                for name, arr in rows(start, n, case.shape(s)).items():
                    arr = arr.astype(case.label(s)) if name == "label" else arr
                    chunks = (max(1, min(n, 7)), *arr.shape[1:]) if case.chunked else None
                    h5.create_dataset(name, data=arr, chunks=chunks)
            out[-1].append(path)
            start += n
    return out


def make_layer(case: Case, files: list[list[Path]], rank: int) -> AsyncHDF5DataLayer:
    source: dict[str, Stream] = {}
    for s, (kind, v) in enumerate(case.shares):
        if kind == "weight":
            source[f"s{s}"] = Stream(files[s], weight=v)
        elif kind == "choose":
            source[f"s{s}"] = Stream(files[s], choose=int(v))
        else:
            source[f"s{s}"] = Stream(files[s])
    return AsyncHDF5DataLayer(
        source,
        batch_size=case.batch_size,
        chunk_size=case.chunk_size,
        shuffle=case.shuffle,
        seed=case.seed,
        drop_last=case.drop_last,
        rank=rank,
        world_size=case.world_size,
        cache_bytes=None if case.cache_rows is None else 2 * case.cache_rows * case.row_bytes(),
        block_size=case.block_size,
        batch_mode=case.mode,  # type: ignore[arg-type]
    )


async def check_case(case: Case) -> None:
    counts = np.array(case.counts())
    sizes = np.array([sum(f) for f in case.sizes])
    edges = np.concatenate(([0], np.cumsum(sizes)))
    total, b, w = int(counts.sum()), case.batch_size, case.world_size
    lane_rows = 1 + case.seed % 5  # 1 to 5 rows: one lane to 32
    with tempfile.TemporaryDirectory() as tmp, ramp(case.ramp_rows, lane_rows):
        files = write(Path(tmp), case)
        ranks = []
        for rank in range(w):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CacheBudgetWarning)
                async with make_layer(case, files, rank) as layer:
                    epochs = []
                    for _ in range(2):
                        epochs.append([bt async for bt in layer])
                    ranks.append(epochs)
    both = []
    for epoch in range(2):
        per_rank = [r[epoch] for r in ranks]
        assert len({len(batches) for batches in per_rank}) == 1, "unequal batch counts"
        batches = [bt for batches in per_rank for bt in batches]
        idx = np.concatenate([bt.indices for bt in batches])
        streams = np.concatenate([bt.streams for bt in batches])
        np.testing.assert_array_equal(streams, np.searchsorted(edges[1:-1], idx, side="right"))
        for bt in batches:
            np.testing.assert_array_equal(bt["label"], bt.indices)
            np.testing.assert_array_equal(bt["data"][:, 0], bt.indices * 10)
            if case.mode == "per_stream":
                assert bt.streams is not None and len(set(bt.streams.tolist())) == 1
                s = int(bt.streams[0])
                assert bt["data"].shape[1:] == case.shape(s)
                assert bt["label"].dtype == np.dtype(case.label(s))
            if case.mode == "stratified" and bt.size == b:
                assert bt.streams is not None
                got = np.bincount(bt.streams, minlength=len(counts))
                share = b * counts / total
                assert np.all((np.floor(share) <= got) & (got <= np.ceil(share))), (got, share)
        got = np.bincount(streams, minlength=len(counts))
        if case.drop_last and case.mode == "per_stream":
            np.testing.assert_array_equal(got, (counts // (w * b)) * w * b)
        elif case.drop_last:
            assert len(idx) == (total // (w * b)) * w * b
            assert np.all(got <= counts)
        else:
            np.testing.assert_array_equal(got, counts)
            for k in np.flatnonzero(counts == sizes).tolist():  # natural share: exactly once
                seen = np.sort(idx[streams == k])
                np.testing.assert_array_equal(seen, np.arange(edges[k], edges[k + 1]))
        both.append(idx)
    if not case.drop_last:
        idx = np.concatenate(both)
        for s in range(len(counts)):
            times = np.bincount(idx[(idx >= edges[s]) & (idx < edges[s + 1])] - edges[s])
            times = np.pad(times, (0, int(sizes[s]) - len(times)))
            low = 2 * int(counts[s]) // int(sizes[s])
            assert times.min() >= low and times.max() <= low + 1, (s, times.min(), times.max())


@pipeline_examples(EXAMPLES)
@given(case=cases())
async def test_mixed_streams_never_hang_and_give_exact_counts(case: Case) -> None:
    if refused(case):
        return
    with anyio.fail_after(EXAMPLE_DEADLINE):
        await check_case(case)


@pipeline_examples(EXAMPLES // 2)
@given(case=cases(schemas=True))
async def test_per_stream_batches_keep_each_streams_schema(case: Case) -> None:
    """Streams of different schemas, always (the test above draws them now and then)."""
    if refused(case):
        return
    with anyio.fail_after(EXAMPLE_DEADLINE):
        await check_case(case)
