"""``Windows``: fixed-length samples cut from a 1-D token stream (issue 41, item 1).

Each file's stream holds distinct values (its own offset plus the position), so a window's
values say which file and element it was cut from: every batch is checked against the windows
cut here with numpy, at the batch's global indices (exactly once, rows of all tops from the
same samples), on every read path and at the edges (a stream shorter than one window, a last
window ending exactly at the stream's end, stride below, at and above length).
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import anyio
import h5py
import numpy as np
import pytest

from asynchdf5 import (
    AsyncHDF5DataLayer,
    Batch,
    ConfigurationError,
    HDF5DataLayer,
    MemoryDataLayer,
    SchemaError,
    SourceError,
    Stream,
    Windows,
)
from asynchdf5._windows import count_windows, window_view

from ._fake_cupy import FakeArray, FakeCupy
from ._files import check_exactly_once, check_message
from ._helpers import DEADLINE, run_main

#: Elements of each file's stream: one shorter than most windows, one empty.
LENGTHS = (103, 2, 0, 64, 57)


def _stream(f: int, n: int) -> np.ndarray:
    return (np.arange(n) + 1000 * (f + 1)).astype(np.int32)


def _write(
    folder: Path,
    lengths: Sequence[int] = LENGTHS,
    *,
    storage: str = "contiguous",
    dtype: str = "<i4",
    label: tuple[int, int] | None = None,
) -> list[Path]:
    """One file per stream length; ``label=(length, stride)`` adds a ``label`` top with one row
    per window (the window's first value)."""
    paths = []
    for f, n in enumerate(lengths):
        p = folder / f"t{f}.h5"
        kw: dict[str, Any] = {}
        if storage == "chunked":
            kw = {"chunks": (min(7, n),)} if n else {}
        elif storage == "gzip":
            kw = {"chunks": (min(9, n),), "compression": "gzip", "shuffle": True} if n else {}
        elif storage == "compact":  # read through h5py
            kw = {"compact": True}
        with h5py.File(p, "w") as h:
            data = _stream(f, n).astype(dtype)
            if storage == "compact":
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                dcpl.set_layout(h5py.h5d.COMPACT)
                space = h5py.h5s.create_simple((n,))
                tid = h5py.h5t.py_create(np.dtype(dtype))
                ds = h5py.h5d.create(h.id, b"tokens", tid, space, dcpl=dcpl)
                if n:
                    ds.write(h5py.h5s.ALL, h5py.h5s.ALL, np.ascontiguousarray(data))
            else:
                h.create_dataset("tokens", data=data, **kw)
            if label is not None:
                length, stride = label
                h["label"] = window_view(_stream(f, n), length, stride)[:, 0].astype(np.int64)
        paths.append(p)
    return paths


def _expected(lengths: Sequence[int], length: int, stride: int) -> np.ndarray:
    """Every window of every file, in global order (windows never cross files)."""
    parts = [window_view(_stream(f, n), length, stride) for f, n in enumerate(lengths)]
    return np.concatenate([p.reshape(-1, length) for p in parts])


def _check(batches: list[dict[str, np.ndarray]], want: np.ndarray) -> None:
    idx = check_exactly_once([b["indices"] for b in batches], len(want))
    got = np.concatenate([b["tokens"] for b in batches])
    np.testing.assert_array_equal(got, want[idx])


def _epoch(layer: Iterable[Batch], extra: Sequence[str] = ()) -> list[dict[str, np.ndarray]]:
    out = []
    for b in layer:
        out.append({"indices": np.array(b.indices), "tokens": np.array(b["tokens"])})
        for t in extra:
            out[-1][t] = np.array(b[t])
    return out


@pytest.mark.timeout(DEADLINE * 2)
@pytest.mark.parametrize(
    ("length", "stride"), [(5, 4), (4, 4), (3, 5), (7, 1), (57, 57), (64, 7), (1, 1)]
)
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_window_of_every_file_exactly_once(
    tmp_path: Path, length: int, stride: int, shuffle: bool
) -> None:
    paths = _write(tmp_path)
    want = _expected(LENGTHS, length, stride)
    # the last window of the 57-element file ends at its end exactly when (57 - L) % S == 0
    with HDF5DataLayer(
        paths,
        tops=(Windows("tokens", length=length, stride=stride),),
        batch_size=6,
        shuffle=shuffle,
        seed=3,
        chunk_size=11,
        block_size=4,
    ) as layer:
        assert len(layer) == -(-len(want) // 6)
        for _ in range(2):
            batches = _epoch(layer)
            assert all(b["tokens"].shape[1:] == (length,) for b in batches)
            _check(batches, want)
        assert layer.stats.read_paths["tokens"]


@pytest.mark.timeout(DEADLINE * 2)
@pytest.mark.parametrize("storage", ["chunked", "gzip", "compact"])
@pytest.mark.parametrize(("length", "stride"), [(9, 8), (5, 11), (8, 8)])
def test_windows_on_every_read_path(tmp_path: Path, storage: str, length: int, stride: int) -> None:
    paths = _write(tmp_path, storage=storage, dtype=">i4")  # swapped after a fast read
    want = _expected(LENGTHS, length, stride)
    top = Windows("tokens", length=length, stride=stride)
    with HDF5DataLayer(
        paths, tops=(top,), batch_size=5, shuffle=True, seed=1, chunk_size=7, block_size=3
    ) as layer:
        batches = _epoch(layer)
        path = layer.stats.read_paths["tokens"]
    _check(batches, want)
    assert path == {"chunked": "chunks", "gzip": "chunks", "compact": "h5py"}[storage]


@pytest.mark.timeout(DEADLINE * 2)
def test_mapped_windows_are_the_stream_cut(tmp_path: Path) -> None:
    """Overlapping windows are not the dataset's rows: never mapped as rows."""
    lengths = (100, 40)
    paths = _write(tmp_path, lengths)
    for length, stride in ((10, 10), (10, 9)):
        want = _expected(lengths, length, stride)
        with HDF5DataLayer(
            paths, tops=(Windows("tokens", length, stride),), batch_size=4, mmap="auto"
        ) as layer:
            _check(_epoch(layer), want)


@pytest.mark.timeout(DEADLINE * 2)
def test_other_tops_have_one_row_per_window(tmp_path: Path) -> None:
    length, stride = 6, 4
    paths = _write(tmp_path, label=(length, stride))
    want = _expected(LENGTHS, length, stride)
    with HDF5DataLayer(
        paths, tops=(Windows("tokens", length, stride), "label"), batch_size=7, shuffle=True
    ) as layer:
        batches = _epoch(layer, ("label",))
    _check(batches, want)
    for b in batches:  # rows of both tops are the same samples
        np.testing.assert_array_equal(b["label"], b["tokens"][:, 0])
    with pytest.raises(SchemaError, match=r"cuts 2 windows from 103 elements.*one row per window"):
        with HDF5DataLayer(paths, tops=(Windows("tokens", 51, 50), "label"), batch_size=7):
            pass


def test_bad_windows_are_named_errors(tmp_path: Path) -> None:
    for bad in ({"length": 0}, {"length": 3, "stride": -1}, {"length": 2.5}, {"length": True}):
        with pytest.raises(ConfigurationError, match=r"Windows\('tokens'\)"):
            Windows("tokens", **bad)
    paths = _write(tmp_path, (3, 4))
    with pytest.raises(SourceError, match="hold no samples"):  # every stream below one window
        with HDF5DataLayer(paths, tops=(Windows("tokens", 5),), batch_size=2):
            pass
    with h5py.File(tmp_path / "2d.h5", "w") as h:
        h["tokens"] = np.zeros((4, 4), np.int32)
    with pytest.raises(SchemaError, match=r"1-D dataset.*shape \(4, 4\)"):
        with HDF5DataLayer(tmp_path / "2d.h5", tops=(Windows("tokens", 2),), batch_size=2):
            pass
    with pytest.raises(ConfigurationError, match="listed twice"):
        HDF5DataLayer(paths, tops=(Windows("tokens", 2), "tokens"), batch_size=2)


def test_windows_is_a_name() -> None:
    w = Windows("tokens", length=1025, stride=1024)
    assert w == "tokens" and isinstance(w, str) and {str(w): 1}[w] == 1
    back = pickle.loads(pickle.dumps(w))
    assert (type(back), back.length, back.stride) == (Windows, 1025, 1024)
    assert Windows("t", 3).stride == 3
    assert count_windows(10, 10, 3) == 1 and count_windows(9, 10, 1) == 0
    assert count_windows(12, 4, 4) == 3 and count_windows(11, 4, 4) == 2


@pytest.mark.timeout(DEADLINE * 3)
def test_shards_resume_and_the_helper_process(tmp_path: Path) -> None:
    length, stride = 8, 5
    paths = _write(tmp_path)
    want = _expected(LENGTHS, length, stride)
    kw: dict[str, Any] = {
        "tops": (Windows("tokens", length, stride),),
        "batch_size": 3,
        "shuffle": True,
        "seed": 11,
        "chunk_size": 8,
    }
    # Shards: equal batch counts, together every window once.
    shards = []
    for rank in range(2):
        with HDF5DataLayer(paths, rank=rank, world_size=2, **kw) as layer:
            shards.append(_epoch(layer))
    assert len(shards[0]) == len(shards[1])
    _check(shards[0] + shards[1], want)
    # Exact resume: the batches after a saved state are the ones that would have come.
    with HDF5DataLayer(paths, **kw) as layer:
        whole = _epoch(layer)
    with HDF5DataLayer(paths, **kw) as layer:
        it = iter(layer)  # kept live: a closed iteration would count its epoch as done
        for _ in range(4):
            next(it)
        state = layer.state_dict()
    with HDF5DataLayer(paths, **kw) as layer:
        layer.load_state_dict(state)
        rest = _epoch(layer)
    assert len(rest) == len(whole) - 4
    for a, b in zip(rest, whole[4:], strict=True):
        np.testing.assert_array_equal(a["indices"], b["indices"])
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
    # Elastic: the rest of the epoch on two ranks covers the windows not yet served, once.
    rest2 = []
    for rank in range(2):
        with HDF5DataLayer(paths, rank=rank, world_size=2, **kw) as layer:
            layer.load_state_dict(state)
            rest2 += _epoch(layer)
    served = np.concatenate([b["indices"] for b in whole[:4]])
    left = np.concatenate([b["indices"] for b in rest2])
    assert sorted([*served.tolist(), *left.tolist()]) == list(range(len(want)))
    np.testing.assert_array_equal(np.concatenate([b["tokens"] for b in rest2]), want[left])
    # The helper process takes the Windows top across (pickled as itself).
    with HDF5DataLayer(paths, process=True, **kw) as layer:
        _check(_epoch(layer), want)


@pytest.mark.timeout(DEADLINE * 2)
def test_stream_streams_and_stats(tmp_path: Path) -> None:
    length, stride = 4, 3
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _write(tmp_path / "a", (40, 31))
    b = _write(tmp_path / "b", (50,))
    top = Windows("tokens", length, stride)
    want_a = _expected((40, 31), length, stride)
    with HDF5DataLayer(
        {"a": Stream(a), "b": Stream(b)}, tops=(top,), batch_size=4, shuffle=True, seed=2
    ) as layer:
        rows = 0
        for batch in layer:
            tokens = np.array(batch["tokens"])
            assert tokens.shape[1:] == (length,)
            # each window is a run of consecutive values of one stream
            assert (tokens - tokens[:, :1] == np.arange(length)).all()
            rows += len(tokens)
        assert rows == len(want_a) + count_windows(50, length, stride)
        stats = layer.stats
        assert stats.samples == rows and stats.stream_samples["b"] > 0
        assert stats.bytes_read > 0 and stats.read_paths["tokens"]
    with HDF5DataLayer(a, tops=(top,), batch_size=5, shuffle=True, seed=2) as layer:
        for batch in itertools.islice(layer.stream(), 3 * len(layer)):
            assert np.array(batch["tokens"]).shape == (5, length)
            np.testing.assert_array_equal(np.array(batch["tokens"]), want_a[batch.indices])


@pytest.mark.anyio
async def test_async_layer(tmp_path: Path) -> None:
    length, stride = 9, 4
    paths = _write(tmp_path)
    want = _expected(LENGTHS, length, stride)
    layer = AsyncHDF5DataLayer(
        paths, tops=(Windows("tokens", length, stride),), batch_size=8, shuffle=True, seed=0
    )
    with anyio.fail_after(DEADLINE):
        async with layer:
            batches = [
                {"indices": np.array(b.indices), "tokens": np.array(b["tokens"])}
                async for b in layer
            ]
    _check(batches, want)


@pytest.mark.timeout(DEADLINE * 2)
def test_torch_adapter(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from asynchdf5.torch import HDF5IterableDataset

    length, stride = 6, 6
    paths = _write(tmp_path)
    want = _expected(LENGTHS, length, stride)
    ds = HDF5IterableDataset(
        paths,
        tops=(Windows("tokens", length, stride),),
        batch_size=4,
        shuffle=True,
        seed=5,
        indices=True,
    )
    try:
        batches = [
            {"indices": b["indices"].numpy(), "tokens": b["tokens"].numpy()}
            for b in DataLoader(ds, batch_size=None)
        ]
    finally:
        ds.close()
    assert isinstance(torch.from_numpy(batches[0]["tokens"]), torch.Tensor)
    _check(batches, want)


@pytest.mark.timeout(DEADLINE)
def test_memory_layer_cuts_windows_too() -> None:
    tokens = _stream(0, 50)
    want = window_view(tokens, 7, 3)
    with MemoryDataLayer(
        {"tokens": tokens}, tops=(Windows("tokens", 7, 3),), batch_size=4, shuffle=True
    ) as layer:
        _check(_epoch(layer), want)
    with pytest.raises(SchemaError, match="1-D array"):
        MemoryDataLayer({"tokens": want}, tops=(Windows("tokens", 2),), batch_size=4)


@pytest.mark.timeout(DEADLINE * 2)
def test_a_kept_catalog_cuts_the_same_windows(tmp_path: Path) -> None:
    """The catalog kept beside a list file holds the dataset's shape: a second run counts the
    same windows from it (and another Windows of the same dataset its own)."""
    paths = _write(tmp_path)
    listed = tmp_path / "list.txt"
    listed.write_text("".join(f"{p.name}\n" for p in paths))
    for length, stride in ((6, 5), (6, 5), (9, 2)):
        want = _expected(LENGTHS, length, stride)
        top = Windows("tokens", length, stride)
        with HDF5DataLayer(listed, tops=(top,), batch_size=5, shuffle=True) as layer:
            _check(_epoch(layer), want)
    # The same dataset as plain rows: its elements, one per sample.
    with HDF5DataLayer(listed, tops=("tokens",), batch_size=50) as layer:
        assert layer.n_samples == sum(LENGTHS)


def test_expand_in_place_over_many_blocks() -> None:
    """Windows moved forwards a block at a time (more than one block here) land as cut."""
    from asynchdf5._windows import _BLOCK_BYTES, expand_in_place

    length, stride = 300, 299
    n = 3 * _BLOCK_BYTES // (length * 4) + 7
    stream = np.arange((n - 1) * stride + length, dtype=np.int32)
    dest = np.zeros((n, length), np.int32)
    dest.reshape(-1)[n * length - len(stream) :] = stream
    expand_in_place(dest, stride)
    np.testing.assert_array_equal(dest, window_view(stream, length, stride))


async def _check_on_device(
    tmp_path: Path, length: int, stride: int, array: type, to_numpy: Callable[[Any], np.ndarray]
) -> None:
    """Every window exactly once through ``device="cuda"``, each batch's value an ``array``."""
    paths = _write(tmp_path)
    want = _expected(LENGTHS, length, stride)
    layer = AsyncHDF5DataLayer(
        paths, tops=(Windows("tokens", length, stride),), batch_size=8, shuffle=True,
        device="cuda",
    )  # fmt: skip
    batches = []
    with anyio.fail_after(DEADLINE):
        async with layer:
            async for b in layer:
                assert isinstance(b["tokens"], array)
                batches.append({"indices": np.array(b.indices), "tokens": to_numpy(b["tokens"])})
    _check(batches, want)


@pytest.mark.anyio
async def test_windows_reach_a_device(tmp_path: Path, fake_cupy: FakeCupy) -> None:
    """The device upload (CuPy's stand-in: the control flow, not CUDA): windows are rows to it."""
    await _check_on_device(tmp_path, 7, 6, FakeArray, lambda a: a.get())


@pytest.mark.timeout(DEADLINE)
def test_transformers_see_windows(tmp_path: Path) -> None:
    length, stride = 5, 3
    paths = _write(tmp_path)
    want = _expected(LENGTHS, length, stride)

    def shifted(x: np.ndarray) -> np.ndarray:
        assert x.shape[1:] == (length,)
        steps: np.ndarray = x[:, 1:] - x[:, :-1]  # the stream's steps: ones within a window
        return steps

    with HDF5DataLayer(
        paths,
        tops=(Windows("tokens", length, stride),),
        batch_size=6,
        shuffle=True,
        transformers=[("tokens", shifted)],
    ) as layer:
        rows = 0
        for b in layer:
            assert (np.array(b["tokens"]) == 1).all() and b["tokens"].shape[1:] == (length - 1,)
            rows += len(b.indices)
    assert rows == len(want)


@pytest.mark.gpu
@pytest.mark.anyio
async def test_windows_on_a_real_gpu(tmp_path: Path, cupy_gpu: Any) -> None:
    """The same windows, uploaded by the real CuPy (skipped without a CUDA GPU)."""
    await _check_on_device(tmp_path, 9, 8, cupy_gpu.ndarray, cupy_gpu.asnumpy)


@pytest.mark.timeout(DEADLINE)
def test_a_stream_of_windows_beside_a_stream_of_rows(tmp_path: Path) -> None:
    """A stream's own tops may cut windows where another stream stores rows of that shape."""
    (tmp_path / "a").mkdir()
    a = _write(tmp_path / "a", (1000,))
    rows = tmp_path / "rows.h5"
    with h5py.File(rows, "w") as f:
        f["tokens"] = np.arange(30 * 9, dtype=np.int32).reshape(30, 9) + 10**6
    source = {
        "cut": Stream(a, tops=(Windows("tokens", 9, 8),)),
        "rows": Stream([rows], tops=("tokens",)),
    }
    with HDF5DataLayer(source, tops=("tokens",), batch_size=4, shuffle=True) as layer:
        got = [np.array(b["tokens"]) for b in layer]
    t = np.concatenate(got)
    assert len(t) == count_windows(1000, 9, 8) + 30
    assert (np.diff(t, axis=1) == 1).all()  # each row a run of the stream or a stored row
    assert (t[:, 0] >= 10**6).sum() == 30


@pytest.mark.timeout(DEADLINE)
@pytest.mark.parametrize("memory", [False, True])
def test_a_state_resumes_only_the_windows_it_was_saved_with(tmp_path: Path, memory: bool) -> None:
    """Strides 4 and 5 cut as many windows of 4 from a stream of 10 (the same sample count and
    shape): the fingerprint's windows tell the states apart. Another stride, or another length,
    is refused by a ConfigurationError naming the windows; the same windows resume."""
    paths = _write(tmp_path, (10, 10))

    def layer(length: int, stride: int) -> Any:
        kw: dict[str, Any] = dict(tops=(Windows("tokens", length, stride),), batch_size=1)
        if memory:
            return MemoryDataLayer({"tokens": _stream(0, 10)}, shuffle=True, seed=3, **kw)
        return HDF5DataLayer(paths, shuffle=True, seed=3, **kw)

    with layer(4, 4) as saved:
        whole = len(saved)
        it = iter(saved)  # kept live: a closed iteration would count its epoch as done
        next(it)
        state = saved.state_dict()
    for length, stride in ((4, 5), (3, 4)):
        with layer(length, stride) as other:
            assert len(other) == whole  # as many windows: only the windows differ
            with pytest.raises(ConfigurationError) as info:
                other.load_state_dict(state)
            check_message(info.value, "windows", f"'tokens', {length}, {stride}")
    with layer(4, 4) as same:
        same.load_state_dict(state)
        assert len(_epoch(same)) == whole - 1


def test_inspect_says_the_stream_is_read_in_elements(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``inspect --windows``: the read path is the stream's, whose rows are elements (not the
    windows, the samples), and the form says how a chunk's windows become rows of the cache."""
    p = tmp_path / "c.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("tokens", data=np.arange(10_000, dtype=np.uint16), chunks=(1000,),
                         compression="gzip")  # fmt: skip
    status, text, _ = run_main(["inspect", p, "--windows", "tokens:1025:1024"], capsys)
    assert status == 0
    assert "whole elements per chunk (1,000 elements, " in text
    assert "chunk shape (1000,) is 1,000 elements " in text
    assert "samples per chunk" not in text and "1,000 samples" not in text
    assert "the read path below is the stream's" in text
    assert "1025/1024 times the stream's bytes" in text
