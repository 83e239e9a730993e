"""Resume: state_dict() / load_state_dict(), exact and elastic, on every layer class.

An uninterrupted run is the reference: a layer stopped after ``k`` batches of an epoch, saved and
loaded into a fresh layer, must yield exactly the reference's remaining batches (indices and
bytes), then the reference's later epochs. Elastic: every rank of a ``W``-rank run saved at the
same batch count, loaded into ``W'`` ranks: the rest of the epoch covers what the old ranks had
not yet yielded, each sample once, in equal batch counts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asynchdf5._read._mapped
import asynchdf5._sizing
from asynchdf5 import (
    AsyncHDF5DataLayer,
    Batch,
    ConfigurationError,
    HDF5DataLayer,
    MemoryDataLayer,
    StateError,
)

from ._files import rows, write_h5

pytestmark = pytest.mark.anyio

SIZES = (400, 0, 350, 251)
N = sum(SIZES)


def write(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for i, n in enumerate(SIZES):
        paths.append(
            write_h5(
                folder / f"part{i}.h5", start, n, layout="gzip" if i % 2 and n else "contiguous"
            )
        )
        start += n
    return paths


def memory_layer(**kw: Any) -> MemoryDataLayer:
    return MemoryDataLayer(rows(0, N), **kw)


def snapshot(batches: Sequence[Batch]) -> list[tuple[list[int], bytes]]:
    """What a run yielded: each batch's indices and data bytes."""
    return [(b.indices.tolist(), np.ascontiguousarray(b["data"]).tobytes()) for b in batches]


async def run(layer: Any, epochs: int, stop: int | None = None) -> tuple[list[Any], dict[str, Any]]:
    """``epochs`` epochs; with ``stop``, the last one only up to ``stop`` batches. Returns what
    each epoch yielded and the state at the end (while the last iterator is live)."""
    out = []
    state: dict[str, Any] = {}
    async with layer:
        for e in range(epochs):
            it = aiter(layer)
            got: list[Batch] = []
            last = e == epochs - 1
            while True:
                if last and stop is not None and len(got) == stop:
                    state = layer.state_dict()
                    break
                try:
                    got.append(await anext(it))
                except StopAsyncIteration:
                    break
            out.append(snapshot(got))
            if last and stop is None:
                state = layer.state_dict()
    return out, state


KINDS = ["hdf5", "memory", "mmap"]


def make(kind: str, folder: Path, **kw: Any) -> Any:
    kw.setdefault("batch_size", 32)
    if kind == "memory":
        return memory_layer(**kw)
    kw.setdefault("chunk_size", 128)
    if kind == "mmap":  # one contiguous file, rows served from its mapping
        folder.mkdir(parents=True, exist_ok=True)
        return AsyncHDF5DataLayer(write_h5(folder / "one.h5", 0, N), mmap=True, **kw)
    return AsyncHDF5DataLayer(write(folder), **kw)


@pytest.fixture(autouse=True)
def _unmapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mmap=True`` unmaps each chunk once served (as for a data set larger than memory)."""
    monkeypatch.setattr(asynchdf5._read._mapped, "default_keep_bytes", lambda: 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("shuffle", "block_size", "drop_last", "stop"),
    [
        (True, 16, False, 5),
        (True, None, False, 0),
        (True, 16, True, 29),  # the last batch of the epoch
        (False, None, False, 7),
        (True, 1, False, 13),
    ],
)
async def test_resume_is_exact(
    tmp_path: Path,
    kind: str,
    shuffle: bool,
    block_size: int | None,
    drop_last: bool,
    stop: int,
) -> None:
    kw: dict[str, Any] = dict(shuffle=shuffle, seed=7, drop_last=drop_last)
    if kind == "hdf5":
        kw["block_size"] = block_size
    reference, _ = await run(make(kind, tmp_path / "a", **kw), 3)
    head, state = await run(make(kind, tmp_path / "b", **kw), 2, stop=stop)
    assert head[0] == reference[0] and head[1] == reference[1][:stop]
    assert state["epoch"] == 1 and state["batches"] == stop
    state = json.loads(json.dumps(state))  # plain values
    resumed = make(kind, tmp_path / "c", **kw)
    resumed.load_state_dict(state)
    assert len(resumed) == len(reference[1]) - stop
    tail, _ = await run(resumed, 2)
    assert tail[0] == reference[1][stop:]  # the rest of the epoch, batch for batch
    assert tail[1] == reference[2]  # and the next epoch is the reference's


async def test_a_drawn_seed_adopts_the_saved_one(tmp_path: Path) -> None:
    reference, _ = await run(memory_layer(batch_size=50, shuffle=True, seed=3), 2)
    _, state = await run(memory_layer(batch_size=50, shuffle=True, seed=3), 1, stop=4)
    layer = memory_layer(batch_size=50, shuffle=True)  # seed=None: drawn
    layer.load_state_dict(state)
    assert layer.seed == 3
    tail, _ = await run(layer, 2)
    assert tail[0] == reference[0][4:] and tail[1] == reference[1]


async def test_state_between_epochs_and_load_on_an_open_layer(tmp_path: Path) -> None:
    reference, _ = await run(memory_layer(batch_size=40, shuffle=True, seed=9), 4)
    layer = memory_layer(batch_size=40, shuffle=True, seed=9)
    async with layer:
        [b async for b in layer]
        state = layer.state_dict()  # between epochs: epoch 1 from its start
        assert (state["epoch"], state["batches"]) == (1, 0)
        [b async for b in layer]
        [b async for b in layer]
        layer.load_state_dict(state)  # back to epoch 1, on the open layer
        again = snapshot([b async for b in layer])
    assert again == reference[1]


async def test_a_state_of_one_mode_continued_in_the_other(tmp_path: Path) -> None:
    """A state loaded and its epoch iterated in the other mode (an epoch state, then
    ``stream()``; a stream state, then ``async for``): before any batch the state is still
    exactly the one loaded; after some, saving is a StateError (the position cannot be said
    exactly across modes), never a state that replays or skips samples."""
    with anyio.fail_after(30):
        first = memory_layer(batch_size=10, shuffle=True, seed=1)
        async with first:
            it = aiter(first)
            for _ in range(7):
                await anext(it)
            by_epoch = first.state_dict()
            await it.aclose()
        async with memory_layer(batch_size=10, shuffle=True, seed=1) as second:
            stream = aiter(second.stream())
            for _ in range(5):
                await anext(stream)
            by_stream = second.state_dict()
            await stream.aclose()
        assert by_stream["mode"] == "stream"
        for state, other in ((by_epoch, "stream"), (by_stream, "epoch")):
            layer = memory_layer(batch_size=10, shuffle=True, seed=1)
            async with layer:
                layer.load_state_dict(state)
                it = aiter(layer.stream() if other == "stream" else layer)
                again = layer.state_dict()
                keys: tuple[str, ...] = ("mode", "epoch", "batches", "chain")
                keys += ("samples",) if state["mode"] == "stream" else ()
                assert {k: again[k] for k in keys} == {k: state[k] for k in keys}
                await anext(it)
                with pytest.raises(StateError, match=f"iterated in {other} mode"):
                    layer.state_dict()
                await it.aclose()


@pytest.mark.both_backends
async def test_only_batches_handed_over_count(tmp_path: Path) -> None:
    """The pipeline runs ahead by prefetch batches; the state counts what the consumer got."""
    layer = make("hdf5", tmp_path, prefetch=16)
    async with layer:
        it = aiter(layer)
        for _ in range(3):
            await anext(it)
        assert layer.state_dict()["batches"] == 3


def test_sync_bridge_counts_what_the_for_loop_got(tmp_path: Path) -> None:
    """The bridge takes up to 16 ready batches per trip; only those the loop got count."""
    layer = HDF5DataLayer(write(tmp_path), batch_size=10, chunk_size=200, shuffle=True, seed=2)
    with layer:
        for i, _ in enumerate(layer):
            if i == 2:
                state = layer.state_dict()
                break
    assert state["batches"] == 3
    reference = HDF5DataLayer(
        write(tmp_path / "r"), batch_size=10, chunk_size=200, shuffle=True, seed=2
    )
    with reference:
        expected = [b.indices.tolist() for b in reference][3:]
    resumed = HDF5DataLayer(
        write(tmp_path / "s"), batch_size=10, chunk_size=200, shuffle=True, seed=2
    )
    resumed.load_state_dict(state)
    with resumed:
        assert [b.indices.tolist() for b in resumed] == expected


async def test_a_state_saved_before_the_ramp_had_lanes_resumes_as_it_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """States saved before ``ramp_lanes`` existed hold no such entry: their runs read each
    epoch's first chunk in one lane, and the rest of such a run must be what it would have been
    (the layer adopts 1, not today's lanes)."""
    monkeypatch.setattr(asynchdf5._sizing, "RAMP_BYTES", 40 * 16)  # ramps of 40, 80 ... rows
    monkeypatch.setattr(asynchdf5._sizing, "MIN_LANE_BYTES", 4 * 16)  # lanes of 4 rows or more
    kw: dict[str, Any] = dict(shuffle=True, seed=7, block_size=8)
    monkeypatch.setattr(asynchdf5._sizing, "RAMP_LANES", 1)
    reference, _ = await run(make("hdf5", tmp_path / "a", **kw), 3)
    _, state = await run(make("hdf5", tmp_path / "b", **kw), 2, stop=5)
    assert state["fingerprint"].pop("ramp_lanes") == 1
    monkeypatch.setattr(asynchdf5._sizing, "RAMP_LANES", 32)
    today, _ = await run(make("hdf5", tmp_path / "c", **kw), 2)
    assert today[1] != reference[1]  # the lanes change the order of an epoch's start
    resumed = make("hdf5", tmp_path / "d", **kw)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    tail, _ = await run(resumed, 2)
    assert tail[0] == reference[1][5:]
    assert tail[1] == reference[2]


@pytest.mark.parametrize("kind", ["memory", "mmap"])
async def test_stream_resume(tmp_path: Path, kind: str) -> None:
    made = iter("abc")

    def layer() -> Any:
        return make(kind, tmp_path / next(made), batch_size=64, shuffle=True, seed=4)

    async def stream(lay: Any, count: int, state_after: int | None = None) -> tuple[list[Any], Any]:
        got, state = [], None
        async with lay:
            async for b in lay.stream():
                got.append(b)
                if len(got) == state_after:
                    state = lay.state_dict()
                if len(got) == count:
                    break
        return snapshot(got), state

    reference, _ = await stream(layer(), 40)
    _, state = await stream(layer(), 25, state_after=25)
    assert state["mode"] == "stream"
    resumed = layer()
    resumed.load_state_dict(state)
    rest, _ = await stream(resumed, 15)
    assert rest == reference[25:]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"batch_size": 16}, "batch_size"),
        ({"seed": 8}, "seed"),
        ({"shuffle": False}, "shuffle"),
        ({"block_size": 8}, "block_size"),
        ({"files": True}, "the files"),
    ],
)
async def test_a_state_from_other_data_or_properties(
    tmp_path: Path, change: dict[str, Any], words: str
) -> None:
    kw: dict[str, Any] = dict(batch_size=32, shuffle=True, seed=7, chunk_size=128, block_size=16)
    _, state = await run(AsyncHDF5DataLayer(write(tmp_path / "a"), **kw), 1, stop=3)
    paths = write(tmp_path / "b")
    change = dict(change)  # the parametrized dict is shared by both backends' runs
    if change.pop("files", False):
        paths = paths[:2]
    layer = AsyncHDF5DataLayer(paths, **{**kw, **change})
    with pytest.raises(ConfigurationError, match=words):
        layer.load_state_dict(state)


def test_a_state_that_is_not_one() -> None:
    layer = memory_layer(batch_size=8)
    bads: list[object] = [{}, {"format": "other"}, [], None]
    for bad in bads:
        with pytest.raises(ConfigurationError, match="not an asynchdf5 layer state"):
            layer.load_state_dict(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "value"),
    [("ramp_lanes", "32"), ("first_rows", 0), ("block_rows", 2.5), ("chunk_rows", None)],
)
async def test_a_state_with_a_bad_size_fails_to_load(tmp_path: Path, key: str, value: Any) -> None:
    """The sizes a resumed run adopts as saved fail at loading, named, not when planned."""
    kw: dict[str, Any] = dict(batch_size=32, shuffle=True, seed=7, chunk_size=128, block_size=16)
    _, state = await run(AsyncHDF5DataLayer(write(tmp_path / "a"), **kw), 1, stop=3)
    state["fingerprint"][key] = value
    with pytest.raises(ConfigurationError, match=key):
        AsyncHDF5DataLayer(write(tmp_path / "b"), **kw).load_state_dict(state)


async def test_load_while_iterating_is_a_state_error() -> None:
    layer = memory_layer(batch_size=8)
    async with layer:
        it = aiter(layer)
        await anext(it)
        state = layer.state_dict()
        with pytest.raises(StateError, match="iterator is live"):
            layer.load_state_dict(state)
        with pytest.raises(StateError, match="iterator is live"):
            layer.set_epoch(3)


async def test_set_epoch(tmp_path: Path) -> None:
    reference, _ = await run(memory_layer(batch_size=100, shuffle=True, seed=1), 4)
    layer = memory_layer(batch_size=100, shuffle=True, seed=1)
    layer.set_epoch(3)
    got, _ = await run(layer, 1)
    assert got[0] == reference[3]


async def test_len(tmp_path: Path) -> None:
    paths = write(tmp_path)
    assert len(AsyncHDF5DataLayer(paths, batch_size=100)) == 11  # read from the metadata
    assert len(AsyncHDF5DataLayer(paths, batch_size=100, drop_last=True)) == 10
    layers = [AsyncHDF5DataLayer(paths, batch_size=100, rank=r, world_size=3) for r in range(3)]
    assert [len(x) for x in layers] == [4, 4, 4]
    async with layers[0] as layer:
        assert len(layer) == len([b async for b in layer])


# --- elastic resume ----------------------------------------------------------------------------


async def stop_all_ranks(
    world: int, stop: int, **kw: Any
) -> tuple[list[dict[str, Any]], list[int]]:
    """Every rank of a ``world``-rank run: one whole epoch, then ``stop`` batches of the next;
    their states, and the samples yielded in that second epoch."""
    states, seen = [], []
    for rank in range(world):
        (_, second), state = await run(
            memory_layer(rank=rank, world_size=world, **kw), 2, stop=stop
        )
        states.append(state)
        seen += [i for idx, _ in second for i in idx]
    return states, seen


async def finish_epoch(world: int, state: dict[str, Any], **kw: Any) -> tuple[list[int], list[int]]:
    """The rest of the epoch on every rank of a ``world``-rank run loaded from ``state``: the
    samples yielded, and each rank's batch count."""
    seen, counts = [], []
    for rank in range(world):
        layer = memory_layer(rank=rank, world_size=world, **kw)
        layer.load_state_dict(state)
        expected = len(layer)
        (rest,), _ = await run(layer, 1)
        assert len(rest) == expected
        counts.append(len(rest))
        seen += [i for idx, _ in rest for i in idx]
    return seen, counts


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    old=st.integers(1, 4),
    new=st.integers(1, 5),
    stop=st.integers(0, 6),
    batch_size=st.sampled_from([7, 32, 64]),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
async def test_elastic_resume_yields_the_rest_exactly_once(
    old: int, new: int, stop: int, batch_size: int, shuffle: bool, drop_last: bool
) -> None:
    kw: dict[str, Any] = dict(batch_size=batch_size, shuffle=shuffle, seed=11, drop_last=drop_last)
    per_rank = len(memory_layer(rank=0, world_size=old, **kw))
    stop = min(stop, per_rank)
    states, before = await stop_all_ranks(old, stop, **kw)
    try:
        after, counts = await finish_epoch(new, states[-1], **kw)
    except ConfigurationError as exc:
        # Without drop_last, a rest that cannot be split in equal counts (e.g. fewer samples
        # left than ranks) is refused, the same way on every rank.
        assert not drop_last
        assert "cannot be split" in str(exc) or "fewer than world_size" in str(exc)
        return
    assert len(set(counts)) == 1, counts  # equal batch counts on the new ranks
    everything = before + after
    assert len(everything) == len(set(everything)), "a sample was yielded twice"
    if drop_last:
        assert N - len(everything) < max(old, new) * batch_size * 2
    else:
        assert sorted(everything) == list(range(N))


async def test_elastic_then_normal_epochs_and_chains() -> None:
    kw: dict[str, Any] = dict(batch_size=20, shuffle=True, seed=5)
    states, before = await stop_all_ranks(3, 4, **kw)  # 3 ranks, 4 batches of epoch 1
    # 2 ranks take over epoch 1, save after 3 more batches each; then 4 ranks finish it.
    states2, middle = [], []
    for rank in range(2):
        layer = memory_layer(rank=rank, world_size=2, **kw)
        layer.load_state_dict(states[rank])
        (part,), state = await run(layer, 1, stop=3)
        assert state["chain"] == [[3, 4], [2, 3]]
        states2.append(state)
        middle += [i for idx, _ in part for i in idx]
    after, counts = await finish_epoch(4, states2[0], **kw)
    assert len(set(counts)) == 1
    assert sorted(before + middle + after) == list(range(N))
    # Epoch 2 on the 4 ranks is a normal 4-rank epoch.
    layer = memory_layer(rank=1, world_size=4, **kw)
    layer.load_state_dict(states2[0])
    _, _ = await run(layer, 1)
    fresh = memory_layer(rank=1, world_size=4, **kw)
    fresh.set_epoch(2)
    async with layer, fresh:
        assert snapshot([b async for b in layer]) == snapshot([b async for b in fresh])


@pytest.mark.parametrize(("old", "new"), [(4, 1), (4, 2), (1, 3)])
async def test_after_an_elastic_resume_later_epochs_are_a_fresh_runs(
    tmp_path: Path, old: int, new: int
) -> None:
    """Files whose cached chunks are cut by the shares (chunk_size above a rank's share): saved
    by ``old`` ranks mid-epoch 1, resumed on ``new`` ranks. The rest of epoch 1 is exactly-once,
    and epoch 2 is that of a layer started on ``new`` ranks, not one with the saved run's chunks
    (which, from 1 rank to 3, are larger than the new layer's own: its cache holds them)."""
    paths = write(tmp_path / "data")
    kw: dict[str, Any] = dict(batch_size=16, shuffle=True, seed=3, chunk_size=2**20)

    def layer(rank: int, world: int) -> AsyncHDF5DataLayer:
        return AsyncHDF5DataLayer(paths, rank=rank, world_size=world, **kw)

    states, before = [], []
    for rank in range(old):
        (_, part), state = await run(layer(rank, old), 2, stop=5)
        states.append(state)
        before += [i for idx, _ in part for i in idx]
    own = layer(0, new).state_dict()["fingerprint"]["chunk_rows"]
    assert states[0]["fingerprint"]["chunk_rows"] != own  # the old run's chunks: its shares
    after = []
    for rank in range(new):
        resumed = layer(rank, new)
        resumed.load_state_dict(states[rank % old])
        (rest, later), _ = await run(resumed, 2)
        after += [i for idx, _ in rest for i in idx]
        fresh = layer(rank, new)
        fresh.set_epoch(2)
        (expected,), _ = await run(fresh, 1)
        assert later == expected
    assert sorted(before + after) == list(range(N))


@pytest.mark.parametrize("mmap", [False, True], ids=["copied", "mapped"])
async def test_an_elastic_resume_s_larger_chunks_must_fit_the_budget_where_cached(
    tmp_path: Path, mmap: bool
) -> None:
    """Saved by one rank (chunks of the whole data set), resumed on three ranks whose budget
    holds their own chunks but not the saved ones: refused at open, naming the saved chunks,
    where the rows are cached in slots; a mapped file has no slots and opens."""
    paths = [write_h5(tmp_path / "one.h5", 0, 80)]
    kw: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=1, chunk_size=2**20, mmap=mmap)
    (_, _), state = await run(AsyncHDF5DataLayer(paths, **kw), 2, stop=1)
    assert state["fingerprint"]["chunk_rows"] == 80
    row_bytes = 16  # data: 2 float32, label: int64
    layer = AsyncHDF5DataLayer(paths, rank=1, world_size=3, cache_bytes=2 * 27 * row_bytes, **kw)
    layer.load_state_dict(state)
    with anyio.fail_after(30):
        if mmap:
            async with layer:
                assert len([b async for b in layer]) > 0
        else:
            with pytest.raises(ConfigurationError, match="saved run cached chunks of 80"):
                async with layer:
                    pass
