"""The read paths give exactly what h5py gives, for every storage layout and filter pipeline."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import h5py
import numpy as np
import pytest

from asynchdf5 import AsyncHDF5DataLayer
from asynchdf5._codecs import unsupported_filters

pytestmark = pytest.mark.anyio

N = 3000


def _plugin(name: str) -> dict[str, Any]:
    hdf5plugin = pytest.importorskip("hdf5plugin")
    return dict(getattr(hdf5plugin, name)())


def _zfp() -> dict[str, Any]:
    hdf5plugin = pytest.importorskip("hdf5plugin")
    return dict(hdf5plugin.Zfp(reversible=True))


def _lz4_blocks(nbytes: int) -> dict[str, Any]:
    hdf5plugin = pytest.importorskip("hdf5plugin")
    return dict(hdf5plugin.LZ4(nbytes=nbytes))


LAYOUTS: dict[str, tuple[str, Any]] = {
    # name: (expected read path of "data", dataset keyword arguments or a factory)
    "contiguous": ("mmap", {}),  # the default, mmap="auto", maps a local contiguous file
    "contiguous-big-endian": ("pread", {"dtype": ">f4"}),
    "gzip-big-endian": ("chunks", {"chunks": (256, 3, 4), "compression": "gzip", "dtype": ">f4"}),
    "chunked": ("mmap", {"chunks": (256, 3, 4)}),  # chunks of whole samples: mapped too
    "chunked-big-endian": ("chunks", {"chunks": (256, 3, 4), "dtype": ">f4"}),
    "gzip": ("chunks", {"chunks": (256, 3, 4), "compression": "gzip"}),
    "gzip-shuffle": ("chunks", {"chunks": (200, 3, 4), "compression": "gzip", "shuffle": True}),
    "gzip-shuffle-fletcher32": (
        "chunks",
        {"chunks": (256, 3, 4), "compression": "gzip", "shuffle": True, "fletcher32": True},
    ),
    "lzf": ("chunks", {"chunks": (256, 3, 4), "compression": "lzf"}),
    "zstd": ("chunks", lambda: {"chunks": (256, 3, 4), **_plugin("Zstd")}),
    "blosc": ("chunks", lambda: {"chunks": (256, 3, 4), **_plugin("Blosc")}),
    "lz4": ("chunks", lambda: {"chunks": (256, 3, 4), **_plugin("LZ4")}),
    # Blocks of 1000 bytes in each 12 KiB chunk, the last one short.
    "lz4, small blocks, shuffle": (
        "chunks",
        lambda: {"chunks": (256, 3, 4), "shuffle": True, **_lz4_blocks(1000)},
    ),
    "bzip2": ("chunks", lambda: {"chunks": (256, 3, 4), **_plugin("BZip2")}),
    "zfp (no GIL-free decoder)": ("h5py", lambda: {"chunks": (256, 3, 4), **_zfp()}),
    "chunks split samples": ("chunks", {"chunks": (256, 3, 2), "compression": "gzip"}),
    # Bands of chunks cut at every edge: rows (3000 % 313), and both sample axes.
    "split, edge chunks": ("chunks", {"chunks": (313, 2, 3)}),
    "split, edge chunks, gzip+shuffle": (
        "chunks",
        {"chunks": (313, 2, 3), "compression": "gzip", "shuffle": True},
    ),
    "split, edge chunks, lzf": ("chunks", {"chunks": (313, 1, 3), "compression": "lzf"}),
    "split, big-endian, fletcher32": (
        "chunks",
        {"chunks": (100, 3, 1), "fletcher32": True, "dtype": ">f4"},
    ),
    "chunked, chunks written in reverse (not adjacent)": ("mmap", "reverse"),
    # 4 KiB of other data after each chunk: the chunks at many phases (offsets modulo the
    # row's 48 bytes), so copied when resident (mapped, each row would take two copies, against
    # one from memory); streamed, mapped (STREAMED).
    "chunked, other data between chunks (not adjacent)": ("chunks", "interleaved"),
    "split + scaleoffset (no decoder)": ("h5py", {"chunks": (256, 3, 2), "scaleoffset": 0}),
    "compact": ("h5py", "compact"),
    "unwritten chunks (fill value)": ("h5py", "sparse"),
}
#: The read path of a layout streamed (chunks of 700 samples), where it is not the resident one.
STREAMED = {"chunked, other data between chunks (not adjacent)": "mmap"}


def _write(path: Path, how: Any, data: np.ndarray) -> np.ndarray:
    """Write ``data`` as the top "data" stored as ``how``; returns what h5py should read back."""
    if how == "compact":
        data = data[:1000]  # compact storage holds < 64 KiB
    with h5py.File(path, "w") as f:
        f["label"] = np.arange(len(data))
        if how == "compact":
            space = h5py.h5s.create_simple(data.shape)
            plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            plist.set_layout(h5py.h5d.COMPACT)
            tid = h5py.h5t.py_create(data.dtype)
            h5py.h5d.create(f.id, b"data", tid, space, plist).write(
                h5py.h5s.ALL, h5py.h5s.ALL, data
            )
        elif how in ("reverse", "interleaved"):
            d = f.create_dataset("data", data.shape, data.dtype, chunks=(128, 3, 4))
            other = f.create_dataset("other", (0,), np.uint8, chunks=(4096,), maxshape=(None,))
            order = range(0, len(data), 128)
            for r in reversed(order) if how == "reverse" else order:
                d[r : r + 128] = data[r : r + 128]
                if how == "interleaved":  # a chunk of another dataset after each one
                    other.resize((other.shape[0] + 4096,))
                    other[-4096:] = 1
                    f.flush()  # placed now, not when the chunk cache is flushed
        elif how == "sparse":
            d = f.create_dataset("data", data.shape, data.dtype, chunks=(256, 3, 4), fillvalue=7)
            d[:1000] = data[:1000]  # later chunks are never written
            data[1000:] = 7
        else:
            kw = how() if callable(how) else dict(how)
            dtype = kw.pop("dtype", data.dtype)
            f.create_dataset("data", data=data.astype(dtype), **kw)
    return data


@pytest.mark.parametrize("name", list(LAYOUTS))
async def test_read_path_and_values_match_h5py(tmp_path: Path, name: str) -> None:
    path_expected, how = LAYOUTS[name]
    if name == "lzf" and unsupported_filters([32000]):
        path_expected = "h5py"  # python-lzf not installed
    rng = np.random.default_rng(0)
    data = rng.integers(0, 50, (N, 3, 4)).astype(np.float32).cumsum(axis=0)  # compressible
    path = tmp_path / "f.h5"
    data = _write(path, how, data)
    n = len(data)
    with h5py.File(path, "r") as f:
        reference = f["data"][()]
    np.testing.assert_array_equal(reference, data)
    # Streaming (chunks of 700 samples, read into cache slots) and resident (read once).
    for chunk_size in (700, None):
        kw: dict[str, Any] = {} if chunk_size is None else {"chunk_size": chunk_size}
        layer = AsyncHDF5DataLayer(path, batch_size=128, shuffle=True, seed=4, **kw)
        async with layer:
            seen = np.zeros(n, np.int64)
            async for batch in layer:
                assert batch["data"].dtype == np.float32
                np.testing.assert_array_equal(batch["data"], reference[batch.indices])
                np.testing.assert_array_equal(batch["label"], batch.indices)
                np.add.at(seen, batch.indices, 1)
            assert (seen == 1).all()  # exactly once
            streamed = STREAMED.get(name, path_expected) if chunk_size else path_expected
            assert layer.stats.read_paths["data"] == streamed
        if path_expected == "h5py":
            assert layer.stats.read_notes["data"]


@pytest.mark.parametrize(
    "kw",
    [
        {"chunks": (20, 40, 50), "compression": "lzf"},
        {"chunks": (20, 40, 7), "compression": "gzip"},  # bands of chunks splitting samples
    ],
    ids=["lzf", "split-gzip"],
)
async def test_a_resident_first_epoch_decodes_each_stored_chunk_once(
    tmp_path: Path, kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read once into memory, a shuffled first epoch decodes each stored chunk once, though its
    ramp's chunks draw blocks that cut across stored chunks (each chunk of the plan reads the
    whole stored chunks its rows are in); every batch still holds what h5py reads."""
    from asynchdf5._codecs import ChunkDecoder

    if kw.get("compression") == "lzf" and unsupported_filters([32000]):
        pytest.skip("no LZF decoder outside h5py")
    n = 6000  # rows of 8000 bytes: the ramp reads about 1000, then 2000, then the rest
    rng = np.random.default_rng(1)
    data = rng.integers(0, 9, (n, 40, 50)).astype(np.float32).cumsum(axis=2)
    path = tmp_path / "f.h5"
    _write(path, kw, data)
    with h5py.File(path, "r") as f:
        stored = f["data"].id.get_num_chunks()
    decoded = [0]
    elements, decode_into = ChunkDecoder.elements, ChunkDecoder.decode_into

    def counted(self: ChunkDecoder, *args: Any) -> Any:  # each chunk decoded, once
        decoded[0] += 1
        return elements(self, *args)

    def counted_into(self: ChunkDecoder, *args: Any) -> bool:  # or decoded in place
        done = decode_into(self, *args)
        decoded[0] += done
        return done

    monkeypatch.setattr(ChunkDecoder, "elements", counted)
    monkeypatch.setattr(ChunkDecoder, "decode_into", counted_into)
    await _one_resident_epoch_of_chunks(path, data, seed=3)
    assert decoded[0] == stored


async def _one_resident_epoch_of_chunks(path: Path, data: np.ndarray, seed: int) -> None:
    """One shuffled epoch in blocks of 70 rows (most cut a stored chunk of 20 rows), read by the
    chunk path: every batch equal to ``data``'s rows, every sample exactly once."""
    layer = AsyncHDF5DataLayer(path, batch_size=64, shuffle=True, seed=seed, block_size=70)
    with anyio.fail_after(60):
        async with layer:
            seen = np.zeros(len(data), np.int64)
            async for batch in layer:
                np.testing.assert_array_equal(batch["data"], data[batch.indices])
                np.add.at(seen, batch.indices, 1)
            assert (seen == 1).all()
            assert layer.stats.read_paths["data"] == "chunks"


async def test_chunked_files_with_different_chunking_across_files(tmp_path: Path) -> None:
    data = np.arange(2 * N * 12, dtype=np.int16).reshape(2 * N, 3, 4)
    paths = []
    for i, kw in enumerate([{"chunks": (100, 3, 4), "compression": "gzip"}, {}]):
        p = tmp_path / f"{i}.h5"
        with h5py.File(p, "w") as f:
            f.create_dataset("data", data=data[i * N : (i + 1) * N], **kw)
            f["label"] = np.arange(i * N, (i + 1) * N)
        paths.append(p)
    async with AsyncHDF5DataLayer(paths, batch_size=100, chunk_size=1000) as layer:
        got = np.concatenate([b["data"] async for b in layer])
        assert layer.stats.read_paths["data"] == "chunks+pread"
    np.testing.assert_array_equal(got, data)


# --- the chunks path's requests, planned from the catalog --------------------------------------


def _plan(path: Path, needs: list[tuple[int, int]]) -> tuple[list[Any], list[np.ndarray], Any]:
    """The byte ranges the reader plans for rows ``needs`` of top "data", run by hand (pread,
    then the decode step), with the destinations they filled."""
    from asynchdf5._codecs import ChunkDecoder
    from asynchdf5._read._chunked import Need, chunk_reads

    catalog = _catalog(path)
    layout = catalog.files[0].layouts["data"]
    assert layout.path == "chunks" and layout.chunks is not None
    info = catalog.tops["data"]
    shape = layout.chunks.shape
    decoder = ChunkDecoder(
        layout.filters, info.dtype.itemsize, info.dtype.itemsize * int(np.prod(shape)), shape
    )
    dests = [np.full((b - a, *info.sample_shape), -1, info.dtype) for a, b in needs]
    plan = [Need(a, b, d) for (a, b), d in zip(needs, dests, strict=True)]
    ranges = chunk_reads(layout, plan, decoder, "top 'data'", 2**30)
    _serve(path, ranges)
    return ranges, dests, layout


def _catalog(path: Path) -> Any:
    """The catalog of ``path``'s ``data`` and ``label``, built as the layer builds it."""
    from asynchdf5._catalog import build_catalog
    from asynchdf5._sources import LocalSource

    source = LocalSource()
    try:
        return build_catalog(source, [str(path)], ["data", "label"])
    finally:
        source.close()


def _serve(path: Path, ranges: list[Any]) -> None:
    """Each planned read served from the file: its bytes copied ``into`` its buffer, and handed
    to its ``then`` step (decoding), as the reader does."""
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        for r in ranges:
            raw = os.pread(fd, r.size, r.offset)
            if r.into is not None:
                r.into[:] = raw
            if r.then is not None:
                r.then(r.into if r.into is not None else raw)
    finally:
        os.close(fd)


def _values(n: int, sample: tuple[int, ...]) -> np.ndarray:
    return np.arange(n * int(np.prod(sample)), dtype=np.float32).reshape(n, *sample)


@pytest.mark.parametrize("how", ["plain", "reverse", "interleaved"])
def test_unfiltered_chunks_adjacent_in_the_file_are_one_request(tmp_path: Path, how: str) -> None:
    data = _values(N, (3, 4))
    path = tmp_path / "c.h5"
    _write(path, {"chunks": (128, 3, 4)} if how == "plain" else how, data)
    needs = [(5, 1000), (1000, 1001), (2900, N)]  # partial chunks at both ends, the last one
    ranges, dests, _ = _plan(path, needs)
    assert all(r.into is not None and r.then is None for r in ranges)  # straight into the slot
    chunks_touched = [len(range(a // 128, (b - 1) // 128 + 1)) for a, b in needs]
    assert len(ranges) == (len(needs) if how == "plain" else sum(chunks_touched))
    for (a, b), d in zip(needs, dests, strict=True):
        np.testing.assert_array_equal(d, data[a:b])


@pytest.mark.parametrize(
    "kw",
    [
        {"chunks": (313, 2, 3), "compression": "gzip", "shuffle": True},
        {"chunks": (313, 1, 4), "compression": "lzf"},
        {"chunks": (313, 2, 3)},
        {"chunks": (100, 3, 4), "compression": "gzip", "fletcher32": True},
    ],
    ids=["gzip-shuffle-split", "lzf-split", "uncompressed-split", "gzip-fletcher32"],
)
def test_each_stored_chunk_is_read_and_decoded_once(tmp_path: Path, kw: dict[str, Any]) -> None:
    """Needs that share stored chunks (a shuffled chunk's blocks do) decode each chunk once, and
    a band's chunks, written one after the other, are read as one request."""
    if kw.get("compression") == "lzf" and unsupported_filters([32000]):
        pytest.skip("no LZF decoder outside h5py")
    data = _values(N, (3, 4))
    path = tmp_path / "c.h5"
    _write(path, kw, data)
    needs = [(0, 7), (7, 300), (650, 640 + 313), (2999, N), (1500, 1510)]
    ranges, dests, layout = _plan(path, needs)
    index = layout.chunks
    assert index is not None
    decoded = [item for r in ranges for item in r.then.items]
    row_chunks = {k for a, b in needs for k in range(a // index.rows, (b - 1) // index.rows + 1)}
    assert len(decoded) == len(row_chunks) * index.band  # each chunk once
    assert len({at for r in ranges for at in [r.offset]}) == len(ranges)
    assert len(ranges) <= len(row_chunks)  # a band (or more) per request
    for (a, b), d in zip(needs, dests, strict=True):
        np.testing.assert_array_equal(d, data[a:b])


def test_a_run_of_chunks_ends_where_a_band_starts(tmp_path: Path) -> None:
    """Chunks that split the samples are read in runs that end where a band starts (each band
    whole in one run, so that one thread writes, and faults in, a band's rows), wherever a run
    fills up after a band began and the band's chunks are adjacent in the file; and still every
    row comes out right."""
    from asynchdf5._codecs import ChunkDecoder
    from asynchdf5._read._chunked import ChunkRun, Need, chunk_reads

    data = _values(N, (3, 4))
    path = tmp_path / "c.h5"
    _write(path, {"chunks": (100, 1, 2), "compression": "gzip"}, data)  # bands of 6 chunks
    layout = _catalog(path).files[0].layouts["data"]
    index = layout.chunks
    assert index is not None and index.band == 6
    decoder = ChunkDecoder(layout.filters, 4, 4 * 100 * 2, (100, 1, 2))
    dest = np.full_like(data, -1)
    # Room for two and a half of the largest bands: most runs fill in a band's middle.
    run_bytes = int(index.sizes.sum(axis=1).max() * 5 // 2)
    ranges = chunk_reads(layout, [Need(0, N, dest)], decoder, "top 'data'", 2**30, run_bytes)
    runs = [r.then for r in ranges]
    starts: list[set[int]] = []  # where each run's chunks are in the file
    for r, run in zip(ranges, runs, strict=True):
        assert isinstance(run, ChunkRun)
        starts.append({r.offset + it[0] for it in run.items})
    whole = 0
    for k in range(index.offsets.shape[0]):
        o, z = index.offsets[k], index.sizes[k]
        if (o[1:] != o[:-1] + z[:-1]).any():
            continue  # HDF5 put something between its chunks: no one request holds them
        whole += 1
        band = {int(x) for x in o}
        holders = [i for i, at in enumerate(starts) if band & at]
        assert len(holders) == 1, (k, holders)  # the band is whole in one run
    assert whole > index.offsets.shape[0] // 2
    assert len(ranges) > index.offsets.shape[0] // 3  # runs were cut by their size
    _serve(path, ranges)
    np.testing.assert_array_equal(dest, data)


def test_lz4_chunks_decode_as_the_filter_wrote_them_and_nothing_else() -> None:
    """HDF5's LZ4 filter (hdf5plugin's): a chunk of blocks, each compressed or, where that saved
    nothing, stored raw, decodes to exactly what h5py reads; a chunk cut short, a block past the
    chunk's end, bytes after the last block or a header naming another size are refused."""
    from asynchdf5._codecs import _imagecodecs_lz4

    into = _imagecodecs_lz4()
    if into is None:
        pytest.skip("imagecodecs is not installed")
    rng = np.random.default_rng(0)
    # Blocks of 4,000 bytes: noise (stored raw) then runs (compressed), the last block short.
    data = np.concatenate([rng.integers(0, 255, 9_000), np.arange(21_500) // 97]).astype(np.uint8)
    with h5py.File("mem.h5", "w", driver="core", backing_store=False) as f:
        d = f.create_dataset("x", data=data, chunks=(data.size,), **_lz4_blocks(4_000))
        _, raw = d.id.read_direct_chunk((0,))
        reference = d[()]
    blocks = []
    at = 12
    while at < len(raw):
        size = int.from_bytes(raw[at : at + 4], "big")
        blocks.append(size)
        at += 4 + size
    assert len(blocks) == 8 and blocks[:2] == [4_000, 4_000] and blocks[-1] < 1_500  # raw, packed
    out = np.zeros(data.size, np.uint8)
    into(raw, out)
    np.testing.assert_array_equal(out, reference)
    bad = {
        "cut short": raw[:-10],
        "block past the end": raw[: 12 + 4] + raw[12 + 4 : 12 + 4 + 100],
        "bytes after the last block": raw + b"\0\0",
        "another size": (data.size + 1).to_bytes(8, "big") + raw[8:],
        "no header": raw[:7],
    }
    for what, chunk in bad.items():
        with pytest.raises(ValueError, match="lz4"):
            into(chunk, np.zeros(data.size, np.uint8))
            pytest.fail(what)


@pytest.mark.parametrize("name", ["Blosc", "Zstd"])
def test_blosc_and_zstd_decode_with_the_default_install(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hdf5plugin's Blosc and Zstd chunks decode outside h5py without numcodecs (the ``codecs``
    extra): imagecodecs, a dependency, decodes them straight into the destination, exactly as
    h5py reads them, and refuses a chunk cut short or one of another size."""
    from asynchdf5._codecs import ChunkDecoder

    hdf5plugin = pytest.importorskip("hdf5plugin")
    monkeypatch.setitem(sys.modules, "numcodecs", None)  # import numcodecs: ImportError
    data = (np.arange(64 * 50, dtype=np.float32) // 3).reshape(64, 50)
    with h5py.File("mem.h5", "w", driver="core", backing_store=False) as f:
        d = f.create_dataset("x", data=data, chunks=(64, 50), **getattr(hdf5plugin, name)())
        filters = [int(d.id.get_create_plist().get_filter(i)[0]) for i in range(len(d._filters))]
        mask, raw = d.id.read_direct_chunk((0, 0))
    assert unsupported_filters(filters) == []
    decoder = ChunkDecoder(filters, 4, data.nbytes, data.shape)
    out = np.full(data.nbytes, 0xAB, np.uint8)
    assert decoder.decode_into(raw, mask, out)
    np.testing.assert_array_equal(out.view(np.float32).reshape(data.shape), data)
    with pytest.raises(ValueError):
        decoder.elements(raw[: len(raw) // 2], mask)
    with pytest.raises(ValueError):  # a chunk of another size than the dataset's chunks
        ChunkDecoder(filters, 4, data.nbytes + 8, (data.size + 2,)).elements(raw, mask)


@pytest.mark.parametrize("which", ["imagecodecs", "h5py"])
def test_each_lzf_decoder_gives_what_h5pys_filter_wrote(which: str) -> None:
    """Each LZF decoder outside h5py (imagecodecs' liblzf, h5py's own called through ctypes),
    each releasing the GIL, decodes exactly what h5py's filter wrote, into a given buffer, and
    refuses data that does not decode to exactly the chunk's size."""
    from asynchdf5._codecs import _h5py_lzf, _imagecodecs_lzf

    into = _imagecodecs_lzf() if which == "imagecodecs" else _h5py_lzf()
    if into is None:
        pytest.skip(f"no LZF decoder from {which} here")
    data = np.arange(50_000, dtype=np.int32) // 7
    with h5py.File("mem.h5", "w", driver="core", backing_store=False) as f:
        d = f.create_dataset("x", data=data, chunks=(50_000,), compression="lzf")
        _, raw = d.id.read_direct_chunk((0,))
    assert len(raw) < data.nbytes  # really compressed
    out = np.zeros(data.nbytes, np.uint8)
    into(raw, out)
    np.testing.assert_array_equal(out.view(np.int32), data)
    with pytest.raises(ValueError, match="LZF"):
        into(raw[: len(raw) // 2], out)
    with pytest.raises(ValueError, match="LZF"):  # more bytes than the chunk holds
        into(raw, np.zeros(data.nbytes - 4, np.uint8))
    with pytest.raises(ValueError, match="LZF"):  # fewer
        into(raw, np.zeros(data.nbytes + 4, np.uint8))


@pytest.mark.parametrize(
    ("kw", "direct"),
    [
        ({"compression": "gzip"}, True),
        ({"compression": "lzf"}, True),
        ({"compression": "gzip", "fletcher32": True}, True),
        ({"compression": "gzip", "shuffle": True}, False),  # the shuffle is undone by a copy
        ({"fletcher32": True}, False),  # nothing decompresses: the copy is all there is
    ],
    ids=["gzip", "lzf", "gzip-fletcher32", "gzip-shuffle", "fletcher32"],
)
def test_decoding_into_the_destination_gives_what_h5py_reads(
    kw: dict[str, Any], direct: bool
) -> None:
    """:meth:`ChunkDecoder.decode_into` writes exactly the chunk's bytes where the pipeline's
    last step decompresses, and writes nothing where it cannot (then :meth:`elements`), nor for
    a chunk stored with its filters skipped (its filter mask)."""
    from asynchdf5._codecs import ChunkDecoder

    if kw.get("compression") == "lzf" and unsupported_filters([32000]):
        pytest.skip("no LZF decoder outside h5py")
    data = (np.arange(64 * 50, dtype=np.float32) // 3).reshape(64, 50)
    with h5py.File("mem.h5", "w", driver="core", backing_store=False) as f:
        d = f.create_dataset("x", data=data, chunks=(64, 50), **kw)
        filters = [int(d.id.get_create_plist().get_filter(i)[0]) for i in range(len(d._filters))]
        mask, raw = d.id.read_direct_chunk((0, 0))
    decoder = ChunkDecoder(filters, 4, data.nbytes, data.shape)
    out = np.full(data.nbytes, 0xAB, np.uint8)
    assert decoder.decode_into(raw, mask, out) is direct
    if direct:
        np.testing.assert_array_equal(out.view(np.float32).reshape(data.shape), data)
    else:
        assert (out == 0xAB).all()
    np.testing.assert_array_equal(decoder.decode(raw, mask).view(np.float32), data.ravel())
    got = decoder.elements(raw, mask)
    assert got.shape == (*data.shape, 4)
    np.testing.assert_array_equal(np.ascontiguousarray(got).view(np.float32)[..., 0], data)
    # As the local source hands raw bytes over: a view into a larger buffer, reused.
    held = bytearray(7) + raw + bytearray(5)
    got = decoder.elements(memoryview(held)[7 : 7 + len(raw)], mask)
    np.testing.assert_array_equal(np.ascontiguousarray(got).view(np.float32)[..., 0], data)
    with pytest.raises(ValueError):  # a chunk cut short does not decode to its size
        decoder.elements(raw[: len(raw) // 2], mask)
    # Every filter skipped (an optional filter that did not shrink the chunk, as HDF5 stores
    # it): the stored bytes are the data, copied, never decoded.
    every = (1 << len(filters)) - 1
    out[:] = 0xAB
    assert not decoder.decode_into(data.tobytes(), every, out)
    assert (out == 0xAB).all()
    got = decoder.elements(data.tobytes(), every)
    np.testing.assert_array_equal(got.reshape(-1).view(np.float32), data.ravel())


def test_populating_fresh_memory_keeps_what_is_there() -> None:
    """:func:`populate` (the resident reader's advice before a read into fresh pages) faults
    pages in and changes no byte, whatever the buffer's alignment; a read-only buffer is left
    alone."""
    import mmap

    from asynchdf5._pages import populate

    m = mmap.mmap(-1, 5 * mmap.PAGESIZE)
    a = np.frombuffer(m, np.uint8)
    a[: mmap.PAGESIZE + 10] = 7  # a page written, and part of the next
    view = memoryview(m)[mmap.PAGESIZE + 5 : 4 * mmap.PAGESIZE - 3]
    populate(view)
    assert (a[: mmap.PAGESIZE + 10] == 7).all() and (a[mmap.PAGESIZE + 10 :] == 0).all()
    populate(memoryview(b"read-only"))
    del view, a
    m.close()


def test_a_bands_rows_are_faulted_in_by_its_first_chunk_in_the_file(tmp_path: Path) -> None:
    """Read once into fresh memory, each band's rows are faulted in at once by the band's chunk
    stored first in the file (decoded first), whichever of the band it is: a band's other
    chunks, wherever they lie (HDF5 writes them as its chunk cache empties), then write pages
    already there instead of faulting them in one at a time. And every row comes out right."""
    from asynchdf5._codecs import ChunkDecoder
    from asynchdf5._read._chunked import ChunkRun, Need, chunk_reads

    rows, n = 50, 400
    data = _values(n, (6,))
    path = tmp_path / "c.h5"
    with h5py.File(path, "w") as f:
        f["label"] = np.arange(n)
        d = f.create_dataset("data", (n, 6), np.float32, chunks=(rows, 2), compression="gzip")
        for j in (2, 0, 1):  # the last chunk of each band stored first, the first one next
            d[:, 2 * j : 2 * j + 2] = data[:, 2 * j : 2 * j + 2]
            f.flush()
    layout = _catalog(path).files[0].layouts["data"]
    index = layout.chunks
    assert index is not None and index.band == 3
    first = index.offsets.argmin(axis=1)
    assert (first != 0).all()  # a band's first chunk in the file is not its first tile
    dest = np.zeros((n, 6), np.float32)  # calloc'd: pages never written
    decoder = ChunkDecoder(layout.filters, 4, 4 * rows * 2, (rows, 2))
    needs = [Need(30, 170, dest[30:170]), Need(220, n, dest[220:n])]
    ranges = chunk_reads(layout, needs, decoder, "top 'data'", 2**30, fresh=True)
    faulting: dict[int, list[tuple[int, int]]] = {}
    for r in ranges:
        assert isinstance(r.then, ChunkRun)
        for _, _, _, stored, _ in r.then.items:
            if stored.fresh:
                assert stored.k not in faulting  # once per band
                assert stored.offset == index.offsets[stored.k].min()  # first in the file
                faulting[stored.k] = [
                    ((f.ctypes.data - dest.ctypes.data) // 24, len(f)) for f in stored.fresh
                ]
    # Every band a need touches, its rows of each need (all of each sample).
    assert faulting == {
        0: [(30, 20)],
        1: [(50, 50)],
        2: [(100, 50)],
        3: [(150, 20)],
        4: [(220, 30)],
        5: [(250, 50)],
        6: [(300, 50)],
        7: [(350, 50)],
    }
    _serve(path, ranges)
    np.testing.assert_array_equal(dest[30:170], data[30:170])
    np.testing.assert_array_equal(dest[220:], data[220:])
    assert not dest[:30].any() and not dest[170:220].any()  # nothing else written


async def test_a_resident_ramps_next_piece_is_read_while_the_one_before_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read once into memory, the next piece of an epoch's ramp is planned and read while the
    piece before it is still being read (the decoding threads are not left idle between
    them): here the first piece's read waits until the second's has begun (on one read at a
    time it would wait forever). Rows shared by both pieces' stored chunks are read by one of
    them and awaited by the other: each stored chunk is decoded once, and every batch holds
    what h5py reads, each sample once."""
    from asynchdf5._codecs import ChunkDecoder
    from asynchdf5._read._reader import HDF5Reader

    n = 6000  # rows of 8000 bytes: the ramp reads about 1000, then 2000, then the rest
    rng = np.random.default_rng(2)
    data = rng.integers(0, 9, (n, 40, 50)).astype(np.float32).cumsum(axis=2)
    path = tmp_path / "f.h5"
    _write(path, {"chunks": (20, 40, 7), "compression": "gzip"}, data)
    with h5py.File(path, "r") as f:
        stored = f["data"].id.get_num_chunks()
    decoded = [0]
    elements = ChunkDecoder.elements

    def counted(self: ChunkDecoder, *args: Any) -> Any:
        decoded[0] += 1
        return elements(self, *args)

    fill = HDF5Reader.fill
    fills = [0]
    second = anyio.Event()

    async def overlapping(self: HDF5Reader, *args: Any) -> int:
        fills[0] += 1
        if fills[0] == 1:
            await second.wait()  # the first piece's read, until the second's begins
        else:
            second.set()
        return await fill(self, *args)

    monkeypatch.setattr(ChunkDecoder, "elements", counted)
    monkeypatch.setattr(HDF5Reader, "fill", overlapping)
    await _one_resident_epoch_of_chunks(path, data, seed=5)
    assert fills[0] >= 3 and second.is_set()
    assert decoded[0] == stored
