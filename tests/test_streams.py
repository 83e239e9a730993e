"""Streams (issue 33): several named sources mixed in one layer, with weights or counts.

Each stream is written with ``_files.write_h5`` at its own global rows (stream after stream, as
the layer concatenates them), so that ``label == index`` checks alignment and the index says
which stream and sample a row is.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import anyio
import numpy as np
import pytest

from asynchdf5 import (
    AsyncHDF5DataLayer,
    ConfigurationError,
    HDF5DataLayer,
    SchemaError,
    Stream,
)
from asynchdf5._mix import StreamRows, plan_mixed

from ._files import check_batch, check_exactly_once, check_message, write_h5
from ._helpers import epochs as collect_epochs

DEADLINE = 30


def write_streams(folder: Path, sizes: Sequence[Sequence[int]]) -> list[list[Path]]:
    """The files of each stream (``sizes[s]``: its files' rows), at consecutive global rows."""
    folder.mkdir(parents=True, exist_ok=True)
    out: list[list[Path]] = []
    start = 0
    for s, files in enumerate(sizes):
        out.append([])
        for f, n in enumerate(files):
            out[-1].append(write_h5(folder / f"s{s}-{f}.h5", start, n))
            start += n
    return out


def bounds(sizes: Sequence[Sequence[int]]) -> np.ndarray:
    return np.cumsum([0, *(sum(f) for f in sizes)])


def stream_of(indices: np.ndarray, edges: np.ndarray) -> np.ndarray:
    return np.searchsorted(edges[1:-1], indices, side="right")


async def epochs(layer: AsyncHDF5DataLayer, n: int) -> list[list[Any]]:
    """``n`` epochs (``_helpers.epochs``), every batch's rows checked."""
    out = await collect_epochs(layer, n)
    for b in (b for batches in out for b in batches):
        check_batch(b, b.size)
    return out


SIZES = ((120, 80), (90,), (33,))  # three streams: 200, 90 and 33 samples


@pytest.mark.anyio
@pytest.mark.parametrize("shuffle", [True, False])
async def test_stratified_batches_hold_each_streams_share(tmp_path: Path, shuffle: bool) -> None:
    files = write_streams(tmp_path, SIZES)
    source = {
        "web": Stream(files[0], weight=0.5),
        "books": Stream(files[1], weight=0.3),
        "code": Stream(files[2], choose=50),
    }
    layer = AsyncHDF5DataLayer(source, batch_size=16, shuffle=shuffle, seed=3, chunk_size=64)
    assert layer.stream_names == ("web", "books", "code")
    (batches,) = await epochs(layer, 1)
    counts = np.array([181, 109, 50])  # the weighted streams' 290 split 0.5 : 0.3; choose
    total = counts.sum()
    edges = bounds(SIZES)
    seen = np.zeros(3, np.int64)
    for b in batches:
        assert b.streams is not None
        np.testing.assert_array_equal(b.streams, stream_of(b.indices, edges))
        got = np.bincount(b.streams, minlength=3)
        share = b.size * counts / total
        assert np.all(got >= np.floor(share) - (b.size != 16)), (got, share)
        assert np.all(got <= np.ceil(share) + (b.size != 16)), (got, share)
        seen += got
    np.testing.assert_array_equal(seen, counts)
    stats = layer.stats.stream_samples
    assert stats == {"web": 181, "books": 109, "code": 50}


@pytest.mark.anyio
async def test_random_batches_hold_the_shares_over_the_epoch(tmp_path: Path) -> None:
    files = write_streams(tmp_path, SIZES)
    source = {"a": files[0], "b": files[1], "c": files[2]}  # equal weights
    layer = AsyncHDF5DataLayer(source, batch_size=10, shuffle=True, seed=1, batch_mode="random")
    (batches,) = await epochs(layer, 1)
    per = np.array([np.bincount(b.streams, minlength=3) for b in batches])
    np.testing.assert_array_equal(per.sum(axis=0), [108, 108, 107])  # 323 in three
    assert len({tuple(row) for row in per[:-1]}) > 1  # batches differ


@pytest.mark.anyio
async def test_natural_shares_give_every_sample_once(tmp_path: Path) -> None:
    files = write_streams(tmp_path, SIZES)
    n = sum(sum(f) for f in SIZES)
    for source in (
        {"a": Stream(files[0]), "b": Stream(files[1]), "c": Stream(files[2])},
        {k: Stream(f, weight=sum(s) / n) for k, f, s in zip("abc", files, SIZES, strict=True)},
    ):
        layer = AsyncHDF5DataLayer(source, batch_size=7, shuffle=True, seed=5, chunk_size=40)
        for batches in await epochs(layer, 2):
            check_exactly_once([b.indices for b in batches], n)


@pytest.mark.anyio
async def test_down_and_upsampled_streams_see_every_sample_before_a_repeat(
    tmp_path: Path,
) -> None:
    sizes = ((100,), (40,))
    files = write_streams(tmp_path, sizes)
    # "big" gives 30 of its 100 a epoch (downsampled), "small" 90 of its 40 (upsampled).
    source = {"big": Stream(files[0], choose=30), "small": Stream(files[1], choose=90)}
    layer = AsyncHDF5DataLayer(source, batch_size=8, shuffle=True, seed=2, chunk_size=32)
    walks: list[list[np.ndarray]] = [[], []]
    for batches in await epochs(layer, 5):
        idx = np.concatenate([b.indices for b in batches])
        for s, (lo, hi) in enumerate([(0, 100), (100, 140)]):
            walks[s].append(idx[(idx >= lo) & (idx < hi)])
    for s, n in enumerate((100, 40)):
        walk = np.concatenate(walks[s])
        assert len(walk) == (150, 450)[s]
        for k in range(len(walk) // n):  # each pass: every sample once
            check_exactly_once([walk[k * n : (k + 1) * n] - (0, 100)[s]], n)


@pytest.mark.anyio
async def test_streams_that_disagree_on_a_top_are_a_schema_error(tmp_path: Path) -> None:
    a = [write_h5(tmp_path / "a.h5", 0, 10)]
    b = [write_h5(tmp_path / "b.h5", 10, 10, shape=(3,))]
    layer = AsyncHDF5DataLayer({"web": a, "books": b}, batch_size=4)
    with anyio.fail_after(DEADLINE), pytest.raises(SchemaError) as info:
        async with layer:
            pass
    check_message(info.value, "'web'", "'books'", "'data'", "(2,)", "(3,)")


@pytest.mark.anyio
async def test_a_stream_missing_a_top_is_named(tmp_path: Path) -> None:
    a = [write_h5(tmp_path / "a.h5", 0, 10)]
    b = [write_h5(tmp_path / "b.h5", 10, 10, label=None)]  # no "label"
    layer = AsyncHDF5DataLayer({"web": a, "books": b}, batch_size=4)
    with anyio.fail_after(DEADLINE), pytest.raises(SchemaError) as info:
        async with layer:
            pass
    check_message(info.value, "stream 'books'", "'label'", "b.h5")


@pytest.mark.anyio
async def test_stream_iteration_over_streams_gives_full_mixed_batches(tmp_path: Path) -> None:
    """``layer.stream()`` (Mocha-style, across epochs): full batches, each row's stream, and
    each stream's walk goes on across the epochs it spans."""
    files = write_streams(tmp_path, ((50,), (13,)))
    source = {"a": Stream(files[0], choose=30), "b": Stream(files[1], choose=20)}
    layer = AsyncHDF5DataLayer(source, batch_size=10, shuffle=True, seed=7, chunk_size=20)
    got = []
    with anyio.fail_after(DEADLINE):
        async with layer:
            async for batch in layer.stream():
                check_batch(batch, 10)
                assert batch.streams is not None
                np.testing.assert_array_equal(batch.streams, batch.indices >= 50)
                got.append(batch.indices)
                if len(got) == 20:  # four epochs of 50
                    break
    idx = np.concatenate(got)
    np.testing.assert_array_equal(np.bincount((idx >= 50).astype(np.int64)), [120, 80])
    a = idx[idx < 50]
    for k in range(2):  # "a": 120 of its 50 over the four epochs, every sample before a repeat
        check_exactly_once([a[50 * k : 50 * (k + 1)]], 50)


BAD = [
    (lambda f: {"a": Stream(f, weight=-1)}, "weight must be a number >= 0"),
    (lambda f: {"a": Stream(f, weight=float("nan"))}, "weight must be a number >= 0"),
    (lambda f: {"a": Stream(f, weight=1, choose=3)}, "not both"),
    (lambda f: {"a": Stream(f, choose=-2)}, r"choose must be an int in 0 \.\.\. 1099511627776"),
    # Out of range (issue 39, item 9): at construction, not as NumPy's error at the first plan.
    (lambda f: {"a": Stream(f, choose=2**70)}, r"choose .* 0 \.\.\. 1099511627776 \(2\*\*40"),
    (lambda f: {"a": Stream(f, choose=2**62)}, r"choose .* 0 \.\.\. 1099511627776 \(2\*\*40"),
    (
        lambda f: {"a": Stream(f, choose=2**40), "b": Stream(f)},
        r"choose \(together 1099511627776 .* more than 67108864 \(2\*\*26\) batches of "
        r"batch_size=4",
    ),
    (lambda f: {"a": Stream(f, weight=0), "b": Stream(f, choose=0)}, "give no sample"),
    (lambda f: {}, "empty mapping"),
    (lambda f: {3: f}, "name must be a non-empty str"),
]


@pytest.mark.parametrize(("make", "words"), BAD)
def test_bad_streams_are_configuration_errors(make: Any, words: str, tmp_path: Path) -> None:
    f = [write_h5(tmp_path / "a.h5", 0, 10)]
    with pytest.raises(ConfigurationError, match=words):
        AsyncHDF5DataLayer(make(f), batch_size=4)
    with pytest.raises(ConfigurationError, match="batch_mode must be one of"):
        AsyncHDF5DataLayer({"a": f}, batch_size=4, batch_mode="per_batch")  # type: ignore[arg-type]


def test_per_stream_batches_come_from_one_stream_on_every_rank(tmp_path: Path) -> None:
    files = write_streams(tmp_path, ((100,), (37,)))
    source = {"a": Stream(files[0], weight=0.5), "b": Stream(files[1], weight=0.5)}
    kw: dict[str, Any] = {"batch_size": 8, "shuffle": True, "seed": 4, "chunk_size": 24}
    ranks = []
    for rank in range(2):
        with run(source, rank, 2, 0, batch_mode="per_stream", **kw) as layer:
            ranks.append([(b.indices, b.streams) for b in layer])
    # 69 and 68 samples: per rank, 4 full batches and a short one of each stream, ...
    assert len(ranks[0]) == len(ranks[1]) == 10
    every = [x for r in ranks for x in r]
    for _, streams in every:
        assert streams is not None and len(set(streams.tolist())) == 1
    idx = np.concatenate([i for i, _ in every])
    np.testing.assert_array_equal(np.bincount((idx >= 100).astype(np.int64)), [69, 68])
    # ... and a resumed rank continues batch for batch.
    with run(source, 1, 2, 0, batch_mode="per_stream", **kw) as layer:
        for k, _ in enumerate(layer):
            if k == 2:
                state = layer.state_dict()
                break
    layer = HDF5DataLayer(source, rank=1, world_size=2, batch_mode="per_stream", **kw)
    layer.load_state_dict(state)
    with layer:
        rest = [b.indices for b in layer]
    for x, (y, _) in zip(rest, ranks[1][3:], strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.timeout(30)
def test_weights_near_the_float_maximum_share_as_any_others(tmp_path: Path) -> None:
    """Two weights of 1e308 (issue 39, item 9): relative, as 1 and 1 are; their sum overflowed."""
    files = write_streams(tmp_path, ((30,), (20,)))
    source = {"a": Stream(files[0], weight=1e308), "b": Stream(files[1], weight=1e308)}
    with HDF5DataLayer(source, batch_size=10, shuffle=True, seed=1) as layer:
        idx = np.concatenate([b.indices for b in layer])
    np.testing.assert_array_equal(np.bincount((idx >= 30).astype(np.int64)), [25, 25])


def run(source: Any, rank: int, world: int, epoch: int, **kw: Any) -> HDF5DataLayer:
    layer = HDF5DataLayer(source, rank=rank, world_size=world, **kw)
    layer.set_epoch(epoch)
    return layer


def test_resume_is_exact_on_the_same_and_on_another_world_size(tmp_path: Path) -> None:
    files = write_streams(tmp_path, ((150,), (40,)))
    source = {"a": Stream(files[0], weight=1), "b": Stream(files[1], weight=1)}
    kw: dict[str, Any] = {"batch_size": 6, "shuffle": True, "seed": 4, "chunk_size": 24}
    whole: list[list[np.ndarray]] = []
    states = []
    for rank in range(2):
        with run(source, rank, 2, 1, **kw) as layer:
            whole.append([b.indices for b in layer])
        with run(source, rank, 2, 1, **kw) as layer:
            for k, _ in enumerate(layer):
                if k == 4:
                    states.append(layer.state_dict())
                    break
    assert len(whole[0]) == len(whole[1])
    assert states[0]["streams"] == {"a": {"pass": 0, "offset": 95}, "b": {"pass": 2, "offset": 15}}
    # The same world size: the rest of each rank's epoch, batch for batch.
    for rank in range(2):
        layer = HDF5DataLayer(source, rank=rank, world_size=2, **kw)
        layer.load_state_dict(states[rank])
        assert len(layer) == len(whole[rank]) - 5
        with layer:
            rest = [b.indices for b in layer]
        for x, y in zip(rest, whole[rank][5:], strict=True):
            np.testing.assert_array_equal(x, y)
    # Three ranks: the rest of the epoch, each remaining sample as often as it was due.
    due = np.concatenate([i for r in range(2) for i in whole[r][5:]])
    rests = []
    for rank in range(3):
        layer = HDF5DataLayer(source, rank=rank, world_size=3, **kw)
        layer.load_state_dict(states[rank % 2])
        with layer:
            rests.append([b.indices for b in layer])
    assert len({len(r) for r in rests}) == 1
    got = np.concatenate([i for r in rests for i in r])
    np.testing.assert_array_equal(np.sort(got), np.sort(due))


def test_a_stream_of_weight_0_gives_nothing(tmp_path: Path) -> None:
    files = write_streams(tmp_path, ((30,), (20,)))
    source = {"a": Stream(files[0]), "b": Stream(files[1], weight=0)}
    with HDF5DataLayer(source, batch_size=7, shuffle=True, seed=1) as layer:
        check_exactly_once([b.indices for b in layer], 30)
        assert layer.stats.stream_samples == {"a": 30}


def test_a_state_from_other_streams_is_refused(tmp_path: Path) -> None:
    files = write_streams(tmp_path, ((50,), (20,)))
    one = HDF5DataLayer({"a": files[0], "b": files[1]}, batch_size=5, seed=1)
    other = HDF5DataLayer({"a": Stream(files[0]), "b": Stream(files[1])}, batch_size=5, seed=1)
    with pytest.raises(ConfigurationError, match="the streams"):
        other.load_state_dict(one.state_dict())


@pytest.mark.both_backends
@pytest.mark.anyio
async def test_a_tiny_stream_beside_a_huge_one_does_not_hang(tmp_path: Path) -> None:
    files = write_streams(tmp_path, ((4000, 3000),))
    tiny = [write_h5(tmp_path / "tiny.h5", 7000, 1)]
    modes: tuple[Literal["stratified", "random", "per_stream"], ...] = (
        "stratified",
        "random",
        "per_stream",
    )
    for mode in modes:
        layer = AsyncHDF5DataLayer(
            {"huge": files[0], "tiny": Stream(tiny, weight=0.05)},
            batch_size=64,
            shuffle=True,
            seed=0,
            chunk_size=256,
            cache_bytes=4 * 256 * 16,
            batch_mode=mode,
        )
        (batches,) = await epochs(layer, 1)
        idx = np.concatenate([b.indices for b in batches])
        assert (idx == 7000).sum() == 333  # 7001 * 0.05 / 1.05, rounded
        assert len(np.unique(idx[idx < 7000])) == 7001 - 333


def test_the_planner_keeps_each_rank_s_windows_and_chunks_consistent() -> None:
    streams = [StreamRows("a", 0, 100, 60), StreamRows("b", 100, 7, 61)]
    for world in (1, 2, 3):
        served = []
        for rank in range(world):
            plan = plan_mixed(
                streams, epoch=3, batch_size=5, chunk_size=11, shuffle=True, seed=9,
                rank=rank, world_size=world, first_rows=2, block_size=3,
            )  # fmt: skip
            assert plan.n_batches == plan_mixed(
                streams, epoch=3, batch_size=5, chunk_size=11, shuffle=True, seed=9,
                rank=0, world_size=world, first_rows=2, block_size=3,
            ).n_batches  # fmt: skip
            served += [c.served_indices(c.order()) for c in plan.chunks]
        idx = np.concatenate(served)
        assert len(idx) == 121
        assert (idx < 100).sum() == 60


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_over_streams_resumes_mid_epoch(tmp_path: Path, workers: int) -> None:
    """The torch adapter with two streams: rows say their stream, ``len()`` counts the mixed
    epoch, and a state taken after batch 3 continues with batch 4 (DataLoader workers too)."""
    pytest.importorskip("torch")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from asynchdf5.torch import HDF5IterableDataset

    files = write_streams(tmp_path, ((120,), (30,)))
    source = {"a": Stream(files[0], weight=0.5), "b": Stream(files[1], weight=0.5)}

    def loader() -> StatefulDataLoader:
        ds = HDF5IterableDataset(source, batch_size=10, shuffle=True, seed=2, indices=True)
        return StatefulDataLoader(ds, batch_size=None, num_workers=workers)

    whole = [{k: v.numpy() for k, v in b.items()} for b in loader()]
    assert len(whole) == len(loader()) == 15
    for b in whole:
        np.testing.assert_array_equal(b["streams"], (b["indices"] >= 120).astype(np.int64))
        np.testing.assert_array_equal(np.bincount(b["streams"], minlength=2), [5, 5])
    first = loader()
    for i, _ in enumerate(first):
        if i == 3:
            state = first.state_dict()
            break
    del first
    again = loader()
    again.load_state_dict(state)
    rest = [b["indices"].numpy() for b in again]
    assert len(rest) == len(whole) - 4
    for x, y in zip(rest, whole[4:], strict=True):
        np.testing.assert_array_equal(x, y["indices"])
