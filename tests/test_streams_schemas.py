"""Streams of different schemas (issue 33): under ``batch_mode="per_stream"`` each stream keeps
its tops' dtypes and sample shapes, and every batch holds one stream's rows, with its arrays.

Each stream is written with ``_files.write_h5`` at its own global rows, its ``data`` of its own
sample shape (and, for one, its ``label`` of its own dtype), so that a batch's values are
checked against the files from its ``indices``: rows of every top belong to the same samples.
"""

from __future__ import annotations

import gc
import itertools
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from asynchdf5 import (
    AsyncHDF5DataLayer,
    Batch,
    ConfigurationError,
    HDF5DataLayer,
    SchemaError,
    Stream,
)
from asynchdf5._delivery import HostDelivery
from asynchdf5._delivery._cuda import CudaDelivery
from asynchdf5._mix import StreamRows
from asynchdf5._schemas import Schemas, run_at
from asynchdf5._specs import GroupSpec

from ._files import check_exactly_once, check_message, rows, write_h5
from ._helpers import epochs

DEADLINE = 30

#: Each stream: its files' rows, its data's sample shape, its label's dtype.
SCHEMAS: tuple[tuple[tuple[int, ...], tuple[int, ...], str], ...] = (
    ((70, 50), (2,), "int64"),
    ((45,), (3, 4), "int64"),
    ((21,), (5,), "int32"),
)


def write_schemas(
    folder: Path, schemas: Any = SCHEMAS
) -> tuple[list[list[Path]], dict[int, tuple[tuple[int, ...], str]], np.ndarray]:
    """The files of each stream, each stream's (shape, label dtype), and the streams' first
    global rows (and the total at the end)."""
    folder.mkdir(parents=True, exist_ok=True)
    files: list[list[Path]] = []
    start = 0
    edges = [0]
    for s, (sizes, shape, dtype) in enumerate(schemas):
        files.append([])
        for f, n in enumerate(sizes):
            label = rows(start, n)["label"].astype(dtype)
            files[-1].append(write_h5(folder / f"s{s}-{f}.h5", start, n, shape=shape, label=label))
            start += n
        edges.append(start)
    kinds = {s: (shape, dtype) for s, (_, shape, dtype) in enumerate(schemas)}
    return files, kinds, np.array(edges)


def check(batch: Batch, kinds: dict[int, tuple[tuple[int, ...], str]], edges: np.ndarray) -> int:
    """``batch`` is one stream's rows with that stream's arrays and the files' values; its
    stream."""
    assert batch.streams is not None
    (s,) = {int(x) for x in batch.streams.tolist()}
    assert ((batch.indices >= edges[s]) & (batch.indices < edges[s + 1])).all()
    shape, dtype = kinds[s]
    assert sorted(batch.keys()) == ["data", "label"]
    assert batch["data"].shape == (batch.size, *shape)
    assert batch["label"].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(batch["label"], batch.indices)
    want = rows(0, int(edges[-1]), shape)["data"][batch.indices]
    np.testing.assert_array_equal(batch["data"], want)
    return s


def source_of(files: list[list[Path]], **shares: dict[str, Any]) -> dict[str, Stream]:
    names = ("web", "images", "small")
    return {n: Stream(f, **shares.get(n, {})) for n, f in zip(names, files, strict=True)}


@pytest.mark.anyio
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("chunk_size", [16, 1000])
async def test_each_batch_is_one_streams_rows_with_its_schema(
    tmp_path: Path, shuffle: bool, chunk_size: int
) -> None:
    files, kinds, edges = write_schemas(tmp_path)
    layer = AsyncHDF5DataLayer(
        source_of(files),
        batch_size=8,
        shuffle=shuffle,
        seed=5,
        chunk_size=chunk_size,
        batch_mode="per_stream",
    )
    (batches,) = await epochs(layer, 1)
    seen: dict[int, list[np.ndarray]] = {s: [] for s in kinds}
    for b in batches:
        seen[check(b, kinds, edges)].append(b.indices)
    for s in kinds:  # natural shares: each stream's samples exactly once
        got = np.concatenate(seen[s]) - edges[s]
        check_exactly_once([got], int(edges[s + 1] - edges[s]))
    assert layer.stats.stream_samples == {"web": 120, "images": 45, "small": 21}
    assert len(batches) == 15 + 6 + 3


@pytest.mark.anyio
async def test_down_and_upsampled_streams_of_different_schemas(tmp_path: Path) -> None:
    files, kinds, edges = write_schemas(tmp_path)
    source = source_of(files, web={"choose": 40}, images={"choose": 90}, small={"choose": 21})
    layer = AsyncHDF5DataLayer(
        source, batch_size=8, shuffle=True, seed=2, chunk_size=32, batch_mode="per_stream"
    )
    runs = await epochs(layer, 3)
    web: list[int] = []
    for e, batches in enumerate(runs):
        counts = dict.fromkeys(kinds, 0)
        images: list[int] = []
        for b in batches:
            s = check(b, kinds, edges)
            counts[s] += b.size
            if s == 0:
                web += b.indices.tolist()
            if s == 1:
                images += b.indices.tolist()
        assert counts == {0: 40, 1: 90, 2: 21}, e
        # Upsampled twice: every sample of "images" twice, one pass after the other.
        assert sorted(images) == sorted(2 * list(range(int(edges[1]), int(edges[2]))))
    # Downsampled to a third: three epochs walk through "web" once, no sample twice.
    assert sorted(web) == list(range(120))


@pytest.mark.anyio
async def test_transformers_apply_to_every_streams_batches(tmp_path: Path) -> None:
    files, kinds, edges = write_schemas(tmp_path)
    layer = AsyncHDF5DataLayer(
        source_of(files),
        batch_size=8,
        shuffle=True,
        seed=1,
        batch_mode="per_stream",
        transformers=[("data", lambda x: x * 2)],
    )
    (batches,) = await epochs(layer, 1)
    for b in batches:
        shape, _ = kinds[int(b.streams[0])]  # type: ignore[index]
        assert b["data"].shape[1:] == shape
        want = 2 * rows(0, int(edges[-1]), shape)["data"][b.indices]
        np.testing.assert_array_equal(b["data"], want)


@pytest.mark.anyio
@pytest.mark.parametrize("at", [1, 9, 17])
async def test_a_resume_mid_epoch_gives_the_same_rest(tmp_path: Path, at: int) -> None:
    files, kinds, edges = write_schemas(tmp_path)
    source = source_of(files, web={"choose": 50}, small={"choose": 40})
    props: dict[str, Any] = dict(
        batch_size=6, shuffle=True, seed=4, chunk_size=20, batch_mode="per_stream"
    )
    layer = AsyncHDF5DataLayer(source, **props)
    with anyio.fail_after(DEADLINE):
        async with layer:
            whole = [b async for b in layer]
            nxt = [b async for b in layer]  # the epoch after it
            layer.set_epoch(0)
            i = 0
            async for _ in layer:
                if i == at:
                    state = layer.state_dict()
                    break
                i += 1
        again = AsyncHDF5DataLayer(source, **props)
        again.load_state_dict(state)
        async with again:
            rest = [b async for b in again]
            after = [b async for b in again]
    assert len(rest) == len(whole) - at - 1
    for a, b in zip(whole[at + 1 :], rest, strict=True):
        check(b, kinds, edges)
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_array_equal(a["data"], b["data"])
    assert [b.indices.tolist() for b in after] == [b.indices.tolist() for b in nxt]


def test_the_sync_facade_serves_streams_of_different_schemas(tmp_path: Path) -> None:
    files, kinds, edges = write_schemas(tmp_path)
    with HDF5DataLayer(
        source_of(files), batch_size=7, shuffle=True, seed=0, batch_mode="per_stream"
    ) as layer:
        for _ in range(2):
            n = 0
            for b in layer:
                check(b, kinds, edges)
                n += b.size
            assert n == int(edges[-1])
        assert len(layer) == 18 + 7 + 3


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["stratified", "random"])
async def test_streams_of_different_schemas_mix_only_per_stream(tmp_path: Path, mode: str) -> None:
    files, _, _ = write_schemas(tmp_path)
    layer = AsyncHDF5DataLayer(source_of(files), batch_size=8, batch_mode=mode)  # type: ignore[arg-type]
    with anyio.fail_after(DEADLINE), pytest.raises(SchemaError) as info:
        async with layer:
            pass
    check_message(info.value, "'web'", "'images'", "'data'", "(2,)", "(3, 4)", "per_stream")


@pytest.mark.anyio
async def test_what_cannot_serve_different_schemas_is_refused_by_name(tmp_path: Path) -> None:
    files, _, _ = write_schemas(tmp_path)
    source = source_of(files)
    with pytest.raises(ConfigurationError) as info:
        len(HDF5DataLayer(source, batch_size=8, batch_mode="per_stream", process=True))
    check_message(info.value, "'images'", "process=True")
    layer = AsyncHDF5DataLayer(source, batch_size=8, batch_mode="per_stream")
    with anyio.fail_after(DEADLINE):
        async with layer:
            with pytest.raises(ConfigurationError) as info:
                async for _ in layer.stream():
                    pass
            check_message(info.value, "stream()", "'web'", "'images'")
            first = [b async for b in layer]  # the layer still serves its epochs
            assert sum(b.size for b in first) == 186
            state = layer.state_dict()
    other = AsyncHDF5DataLayer(source, batch_size=8, batch_mode="per_stream", rank=0, world_size=2)
    with pytest.raises(ConfigurationError) as info:
        other.load_state_dict(state)
    check_message(info.value, "'web'", "world size")
    del other, info  # (its traceback holds the layer) the files it looked at close with it
    gc.collect()


@pytest.mark.anyio
@pytest.mark.parametrize("transformed", [False, True])
async def test_a_device_takes_each_streams_own_arrays(
    tmp_path: Path, fake_cupy: Any, transformed: bool
) -> None:
    """With ``device=`` (here the CuPy stand-in) a batch of one stream is staged and uploaded
    with that stream's arrays only, under the tops' own names: the same batches as on the host
    (with a transformer on the data top, on two threads or one)."""
    files, kinds, edges = write_schemas(tmp_path)
    kw: dict[str, Any] = dict(batch_size=8, batch_mode="per_stream", shuffle=True, seed=4)
    if transformed:
        kw["transformers"] = [("data", lambda x: x * 2)]
    host = await epochs(AsyncHDF5DataLayer(source_of(files), **kw), 2)
    dev = await epochs(AsyncHDF5DataLayer(source_of(files), device="cuda", **kw), 2)
    for h_epoch, d_epoch in zip(host, dev, strict=True):
        assert len(d_epoch) == len(h_epoch)
        for h, d in zip(h_epoch, d_epoch, strict=True):
            np.testing.assert_array_equal(d.indices, h.indices)
            assert d.streams is not None and h.streams is not None
            np.testing.assert_array_equal(d.streams, h.streams)
            assert sorted(d.keys()) == sorted(h.keys())
            for top in h:
                got = np.asarray(d[top].get())
                assert got.dtype == h[top].dtype and got.shape == h[top].shape
                np.testing.assert_array_equal(got, h[top])
            if not transformed:
                check(h, kinds, edges)


@pytest.mark.anyio
async def test_mapped_files_of_different_schemas_are_copied(tmp_path: Path) -> None:
    files, kinds, edges = write_schemas(tmp_path)
    layer = AsyncHDF5DataLayer(source_of(files), batch_size=8, batch_mode="per_stream", mmap=True)
    (batches,) = await epochs(layer, 1)
    for b in batches:
        check(b, kinds, edges)
    assert "mmap" not in layer.stats.read_paths.values()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_the_torch_adapter_hands_over_each_streams_schema(tmp_path: Path, workers: int) -> None:
    pytest.importorskip("torch")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from asynchdf5.torch import HDF5IterableDataset

    files, kinds, edges = write_schemas(tmp_path)
    ds = HDF5IterableDataset(
        source_of(files), batch_size=8, shuffle=True, seed=2, indices=True, batch_mode="per_stream"
    )
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=workers)
    got = []
    for b in loader:
        s = int(b["streams"][0])
        assert (b["streams"] == s).all()
        shape, dtype = kinds[s]
        assert tuple(b["data"].shape[1:]) == shape
        assert str(b["label"].dtype) == f"torch.{dtype}"
        np.testing.assert_array_equal(b["label"].numpy(), b["indices"].numpy())
        got.append(b["indices"].numpy())
    check_exactly_once(got, int(edges[-1]))


def write_captions(folder: Path, start: int, n: int) -> Path:
    """A stream's file of its own tops: ``data`` and ``caption`` (int16), no ``label``."""
    idx = rows(start, n)["label"]
    return write_h5(folder / "captions.h5", start, n, label=None, caption=idx.astype(np.int16))


@pytest.mark.anyio
@pytest.mark.parametrize("shuffle", [True, False])
async def test_a_stream_of_its_own_tops(tmp_path: Path, shuffle: bool) -> None:
    files, _, edges = write_schemas(tmp_path)
    captions = write_captions(tmp_path, int(edges[-1]), 30)
    source = {
        **source_of(files),
        "captions": Stream([captions], choose=40, tops=("caption", "data")),
    }
    layer = AsyncHDF5DataLayer(
        source,
        batch_size=8,
        shuffle=shuffle,
        seed=3,
        chunk_size=24,
        batch_mode="per_stream",
        transformers=[("caption", lambda x: x + 1000), ("label", lambda x: -x)],
    )
    (batches,) = await epochs(layer, 1)
    counts = dict.fromkeys(range(4), 0)
    for b in batches:
        assert b.streams is not None
        s = int(b.streams[0])
        assert (b.streams == s).all()
        counts[s] += b.size
        if s == 3:  # its own tops, in its order; the label's transformer does not apply
            assert list(b.keys()) == ["caption", "data"]
            assert b["caption"].dtype == np.int16
            np.testing.assert_array_equal(b["caption"], b.indices + 1000)
            np.testing.assert_array_equal(
                b["data"], rows(0, int(edges[-1]) + 30)["data"][b.indices]
            )
        else:
            assert list(b.keys()) == ["data", "label"]
            np.testing.assert_array_equal(b["label"], -b.indices)
    assert counts == {0: 120, 1: 45, 2: 21, 3: 40}


def test_a_streams_own_tops_are_checked(tmp_path: Path) -> None:
    files, _, edges = write_schemas(tmp_path)
    captions = write_captions(tmp_path, int(edges[-1]), 30)
    own = Stream([captions], tops=("caption", "data"))
    with pytest.raises(ConfigurationError) as info:  # a batch would hold both schemas
        HDF5DataLayer({"web": files[0], "captions": own}, batch_size=8)
    check_message(info.value, "'captions'", "per_stream", "'stratified'")
    with pytest.raises(ConfigurationError) as info:  # no stream has the top
        HDF5DataLayer(
            {"web": files[0], "captions": own},
            batch_size=8,
            batch_mode="per_stream",
            transformers=[("nope", lambda x: x)],
        )
    check_message(info.value, "transformers[0]", "'nope'", "'caption'")
    with pytest.raises(ConfigurationError) as info:  # the layer's tops, which no stream reads
        HDF5DataLayer(
            {"captions": own},
            batch_size=8,
            batch_mode="per_stream",
            transformers=[("label", lambda x: x)],
        )
    check_message(info.value, "transformers[0]", "'label'", "no stream reads")
    with pytest.raises(ConfigurationError):
        Stream([captions], tops=("data", "data"))
    bad = Stream([files[0][0]], tops=("data", "caption"))  # the file has no "caption"
    with pytest.raises(SchemaError) as schema:
        len(HDF5DataLayer({"web": bad, "captions": own}, batch_size=8, batch_mode="per_stream"))
    check_message(schema.value, "stream 'web'", "'caption'")


def test_schemas_name_each_variant_and_find_where_a_serving_order_changes() -> None:
    streams = [
        StreamRows("a", 0, 10, 10, (("data", "data"), ("label", "label"))),
        StreamRows("b", 10, 5, 5, (("data", "data@b"), ("label", "label"))),
        StreamRows("c", 15, 5, 5, (("data", "data"), ("label", "label"))),  # a's schema
    ]
    schemas = Schemas.of(streams)
    assert schemas is not None
    assert schemas.tops == (
        {"data": "data", "label": "label"},
        {"data": "data@b", "label": "label"},
    )
    assert schemas.streams == (("a", "c"), ("b",))
    runs = schemas.runs(np.array([0, 16, 3, 11, 12, 19, 10]))
    assert runs == ([0, 3, 5, 6], [0, 1, 0, 1])
    assert run_at(runs, 4, 7) == (5, 1)
    assert run_at(runs, 6, 7) == (7, 1)
    check_message(schemas.mixed(0, 1), "'a'", "'b'", "per_stream")
    assert Schemas.of([StreamRows("a", 0, 10, 10), StreamRows("b", 10, 5, 5)]) is None


@pytest.mark.anyio
async def test_each_variant_is_read_and_reported(tmp_path: Path) -> None:
    files, _, _ = write_schemas(tmp_path)
    layer = AsyncHDF5DataLayer(source_of(files), batch_size=8, batch_mode="per_stream")
    await epochs(layer, 1)
    assert sorted(layer.stats.read_paths) == [
        "data",
        "data@images",
        "data@small",
        "label",
        "label@small",
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("device", [None, "cuda"])
@pytest.mark.parametrize("shuffle", [False, True])
async def test_batches_of_different_schemas_are_gathered_in_groups(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake_cupy: Any,
    device: str | None,
    shuffle: bool,
) -> None:
    """The streams' batches interleave, so nearly every batch has another schema than the one
    before: they are still gathered many to a group (per-group work is what limits small
    batches), each batch with its own stream's arrays."""
    files, kinds, edges = write_schemas(
        tmp_path, (((400,), (2,), "int64"), ((300,), (3,), "int32"))
    )
    delivery = CudaDelivery if device else HostDelivery
    groups: list[int] = []
    make = delivery.make

    def spy(self: Any, group: GroupSpec, *args: Any, **kwargs: Any) -> Any:
        groups.append(len(group.sizes))
        return make(self, group, *args, **kwargs)

    monkeypatch.setattr(delivery, "make", spy)
    layer = AsyncHDF5DataLayer(
        {"a": Stream(files[0]), "b": Stream(files[1])},  # natural shares
        batch_size=4,
        shuffle=shuffle,
        seed=6,
        batch_mode="per_stream",
        device=device,
    )
    (batches,) = await epochs(layer, 1)
    assert len(batches) == 175
    streams = [int(b.streams[0]) for b in batches]  # type: ignore[index]
    assert sum(a != b for a, b in itertools.pairwise(streams)) > 50  # they interleave
    epoch = list(itertools.accumulate(groups)).index(175) + 1  # (then the next one's, prefetched)
    assert epoch <= 20, groups
    got: list[np.ndarray] = []
    for b in batches:
        if device:
            b = Batch({k: np.asarray(v.get()) for k, v in b.items()}, b.indices, b.epoch)
            b.streams = np.full(b.size, streams[len(got)])
        check(b, kinds, edges)
        got.append(b.indices)
    check_exactly_once(got, 700)


@pytest.mark.timeout(30)
def test_a_layers_streams_name_only_their_own_tops(tmp_path: Path) -> None:
    """``layer.streams`` (the same streams for another layer) gives ``tops`` only to a stream
    that named its own: the others read the tops of whichever layer they are given to."""
    files, _, edges = write_schemas(tmp_path)
    captions = write_captions(tmp_path, int(edges[-1]), 30)
    source = {
        "web": Stream(files[0], weight=0.5),
        "captions": Stream([captions], tops=("caption",)),
    }
    layer = HDF5DataLayer(source, batch_size=8, batch_mode="per_stream")
    streams = layer.streams
    assert streams["web"] == Stream([str(p) for p in files[0]], weight=0.5)
    assert streams["captions"].tops == ("caption",)
    with HDF5DataLayer({"web": streams["web"]}, batch_size=8, tops=("label",)) as other:
        got = [b for b in other]
    assert {tuple(b.keys()) for b in got} == {("label",)}
    check_exactly_once([b["label"] for b in got], 120)
