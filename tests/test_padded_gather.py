"""A ragged top padded as it is gathered: a chain that starts a top with ``transforms.Pad`` of a
given length gets exactly the batches the Pad would have made, in one pass (the fused path), and
the padding kernel (``pad_rows``) pads many rows as it pads a few."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import asynchdf5._gather
import asynchdf5._ragged
from asynchdf5 import HDF5DataLayer, Ragged, ReadError, TransformError
from asynchdf5 import transforms as T
from asynchdf5._read._lease import Lease
from asynchdf5._transform import fused_pads

from ._files import check_exactly_once, check_message
from ._helpers import ROOT, run_python

pytestmark = pytest.mark.timeout(60)

LENGTH = 5


def write_tokens(path: Path, start: int, n: int, trailing: tuple[int, ...] = ()) -> Path:
    """``n`` samples from global row ``start``: ``tok`` (ragged, ``data`` + ``indptr``), whose
    row ``g`` holds ``g * 100 + j`` at place ``j`` (0 to 11 places, empty rows and rows longer
    than :data:`LENGTH` among them), and ``label`` (``g``)."""
    g = np.arange(start, start + n, dtype=np.int64)
    lens = (g * 7919) % 12
    place = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    values = np.repeat(g, lens) * 100 + place
    with h5py.File(path, "w") as f:
        f["label"] = g
        grp = f.create_group("tok")
        grp["data"] = values.reshape(-1, *([1] * len(trailing))) * np.ones(trailing, np.int64)
        indptr = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=indptr[1:])
        grp["indptr"] = indptr
    return path


def files_of(folder: Path, sizes: list[int], trailing: tuple[int, ...] = ()) -> list[Path]:
    out, start = [], 0
    for k, n in enumerate(sizes):
        out.append(write_tokens(folder / f"t{k}.h5", start, n, trailing))
        start += n
    return out


def padded_row(g: int, pad: float, trailing: tuple[int, ...] = ()) -> np.ndarray:
    """What Pad(pad, length=LENGTH) makes of sample ``g``'s row."""
    k = min(int(g * 7919 % 12), LENGTH)
    row = np.full((LENGTH, *trailing), pad, np.float64)
    row[:k] = (g * 100 + np.arange(k)).reshape(-1, *([1] * len(trailing)))
    return row


def use_way(monkeypatch: pytest.MonkeyPatch, way: str) -> None:
    """Make ``pad_rows`` pad every piece of an array the one ``way`` (as it would at its
    number of rows), whatever the piece's rows."""
    rows = {"concatenate": 10**9, "windows": 1}[way]
    monkeypatch.setattr(asynchdf5._ragged, "_WINDOW_ROWS", rows)


def epochs(layer: HDF5DataLayer, count: int = 2) -> list[list[Any]]:
    return [list(layer) for _ in range(count)]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(
    ("sizes", "chunk_size", "trailing", "way"),
    [
        ([23, 0, 18, 9], 5, (), "concatenate"),
        ([23, 0, 18, 9], 16, (2,), "concatenate"),
        ([23, 0, 18, 9], 16, (2,), "windows"),
        ([23, 0, 18, 9], 10_000, (), "windows"),
        ([700, 300], 400, (), "concatenate"),
        ([700, 300], 400, (), "windows"),
    ],
)
def test_the_fused_pad_gives_pads_batches_exactly_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shuffle: bool,
    sizes: list[int],
    chunk_size: int,
    trailing: tuple[int, ...],
    way: str,
) -> None:
    """Values, padding, cut rows, empty rows, batches across chunk boundaries, with a
    transformer after the Pad: every batch equal to the Pad's, every sample once per epoch,
    the rows padded (from any number of rows) by one ``np.concatenate`` or by copies
    ``length`` values long and a mask (windows)."""
    use_way(monkeypatch, way)
    files = files_of(tmp_path, sizes, trailing)
    n = sum(sizes)
    with HDF5DataLayer(
        files,
        tops=("tok", "label"),
        batch_size=4,
        shuffle=shuffle,
        seed=1,
        chunk_size=chunk_size,
        transformers=[("tok", T.Pad(-1, length=LENGTH)), ("tok", T.Cast(np.float32))],
    ) as layer:
        delivery: Any = layer._delivery
        assert delivery._padded.keys() == {"tok"} and not delivery.concurrent
        for batches in epochs(layer):
            check_exactly_once([b.indices for b in batches], n)
            for b in batches:
                x = b["tok"]
                assert isinstance(x, np.ndarray) and x.dtype == np.float32
                assert x.shape == (len(b.indices), LENGTH, *trailing)
                np.testing.assert_array_equal(b["label"], b.indices)
                want = [padded_row(g, -1, trailing) for g in b.indices.tolist()]
                np.testing.assert_array_equal(x, np.array(want).reshape(x.shape))
        stats = layer.stats
        assert stats.samples == 2 * n and stats.gather_seconds > 0


def test_a_large_group_is_padded_half_on_the_gathering_helper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a transformer after the Pad (one gathering worker), groups of at least
    PARALLEL_BYTES (here: any) pad their first half of rows on the gathering helper's thread,
    the rest on the worker's: the batches stay the Pad's."""
    files = files_of(tmp_path, [700, 300])
    threads: set[str] = set()
    pad_pieces = asynchdf5._gather._pad_pieces

    def spy(*args: Any) -> None:
        threads.add(threading.current_thread().name)
        pad_pieces(*args)

    monkeypatch.setattr(asynchdf5._gather, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(asynchdf5._gather, "_pad_pieces", spy)
    with HDF5DataLayer(
        files,
        tops=("tok", "label"),
        batch_size=10,
        shuffle=True,
        chunk_size=300,
        transformers=[("tok", T.Pad(-1, length=LENGTH)), ("tok", T.Cast(np.int32))],
    ) as layer:
        batches = list(layer)
    check_exactly_once([b.indices for b in batches], 1000)
    for b in batches:
        want = [padded_row(g, -1) for g in b.indices.tolist()]
        np.testing.assert_array_equal(b["tok"], np.array(want))
    assert any(name.startswith("asynchdf5-gather-helper") for name in threads), threads
    assert len(threads) == 2


def test_the_fused_path_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Pad at the head of a top's chain never pads a gathered Ragged: the rows are gathered
    padded. (Before, the Pad padded each batch's Ragged with ``to_padded``.)"""
    files = files_of(tmp_path, [40, 25])

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("to_padded called: the rows were not gathered padded")

    monkeypatch.setattr(Ragged, "to_padded", refuse)
    with HDF5DataLayer(
        files,
        tops=("tok", "label"),
        batch_size=8,
        shuffle=True,
        chunk_size=16,
        transformers=[("tok", T.Pad(7, length=LENGTH))],
    ) as layer:
        # No user code left in the chain: groups gather on two threads, as with no chain.
        delivery: Any = layer._delivery
        assert delivery.concurrent and not delivery.per_batch
        batches = list(layer)
    check_exactly_once([b.indices for b in batches], 65)
    for b in batches:
        want = [padded_row(g, 7) for g in b.indices.tolist()]
        np.testing.assert_array_equal(b["tok"], np.array(want))


@pytest.mark.parametrize("way", ["concatenate", "windows"])
def test_a_mapped_ragged_top_is_padded_from_its_mapped_heap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """One contiguous file: its heap mapped (``ragged-mmap``), the rows padded straight out of
    it, the Pad's batches; a lease broken before a copy is a ReadError naming top and rows."""
    use_way(monkeypatch, way)
    (path,) = files_of(tmp_path, [500])
    kw: dict[str, Any] = dict(tops=("tok", "label"), batch_size=10, shuffle=True, seed=2)
    pad = [("tok", T.Pad(-1, length=LENGTH))]
    with HDF5DataLayer(path, transformers=pad, **kw) as layer:
        assert layer.stats.read_paths["tok"] == "ragged-mmap"
        batches = list(layer)
    check_exactly_once([b.indices for b in batches], 500)
    for b in batches:
        want = [padded_row(g, -1) for g in b.indices.tolist()]
        np.testing.assert_array_equal(b["tok"], np.array(want))

    def broken(self: Lease) -> None:
        raise ReadError(f"{path}: the lease was broken (a stand-in)")

    monkeypatch.setattr(Lease, "__enter__", broken)
    kw["tops"] = ("tok",)  # the ragged top's copy is the first checked
    with HDF5DataLayer(path, transformers=pad, **kw) as layer, pytest.raises(ReadError) as info:
        list(layer)
    check_message(info.value, "top 'tok', ", "rows ", "the lease was broken")


class MyPad(T.Pad):
    def __call__(self, x: Any) -> Any:
        return super().__call__(x) + 1


def test_only_a_pad_of_a_given_length_at_the_head_of_a_ragged_tops_chain_is_fused() -> None:
    i8, u8 = np.dtype(np.int64), np.dtype(np.uint8)
    keep = T.Cast(np.float32)
    pad = T.Pad(0, length=4)
    chain: list[tuple[str, T.Transformer]] = [("x", keep), ("tok", pad), ("tok", keep)]
    assert fused_pads(chain, {"tok": i8}) == ({"tok": pad}, [("x", keep), ("tok", keep)])
    cases: list[tuple[list[tuple[str, T.Transformer]], dict[str, np.dtype[Any]]]] = [
        ([("tok", T.Pad(0))], {"tok": i8}),  # no length: each batch's own longest row
        ([("tok", MyPad(0, length=4))], {"tok": i8}),  # a subclass may pad otherwise
        ([("tok", keep), ("tok", pad)], {"tok": i8}),  # not the first on its top
        ([("tok", pad)], {}),  # not a (dense) ragged top
        ([("tok", T.Pad(-1, length=4))], {"tok": u8}),  # a pad value the dtype cannot hold
        ([("tok", T.Pad("x", length=4))], {"tok": i8}),
    ]
    for top_chain, ragged in cases:
        assert fused_pads(top_chain, ragged) == ({}, top_chain)
    # Before the tops are known: what may fuse (and so is no user code to keep off two threads).
    assert fused_pads([("tok", T.Pad(-1, length=4))], None)[1] == []
    assert fused_pads([("tok", MyPad(0, length=4))], None)[1] != []


def test_a_pad_that_is_not_fused_still_pads_or_fails_as_before(tmp_path: Path) -> None:
    files = files_of(tmp_path, [30])
    cases: list[tuple[list[tuple[str, T.Transformer]], bool]] = [
        ([("tok", T.Pad(-1))], False),
        ([("tok", MyPad(-1, length=LENGTH))], False),
        ([("tok", T.Pad(-1, length=LENGTH))], True),
    ]
    for transformers, fused in cases:
        with HDF5DataLayer(
            files, tops=("tok", "label"), batch_size=6, transformers=transformers
        ) as layer:
            delivery: Any = layer._delivery
            assert bool(delivery._padded) is fused
            got = list(layer)
        check_exactly_once([b.indices for b in got], 30)
        for b in got:
            x = b["tok"]
            if isinstance(transformers[0][1], MyPad):
                x = x - 1
            want = np.array([padded_row(g, -1) for g in b.indices.tolist()])
            np.testing.assert_array_equal(x[:, :LENGTH], want[:, : x.shape[1]])
    with (
        HDF5DataLayer(
            files,
            tops=("tok", "label"),
            batch_size=6,
            transformers=[("tok", T.Pad("x", length=LENGTH))],
        ) as layer,
        pytest.raises(TransformError, match="Pad"),
    ):
        list(layer)


@pytest.mark.parametrize("rows", [300, 1100])
@pytest.mark.parametrize("length", [None, 0, 40, 200])
@pytest.mark.parametrize("trailing", [(), (3,)])
@pytest.mark.parametrize("dtype", [None, np.float32])
def test_to_padded_of_many_rows_equals_padding_row_by_row(
    rows: int, length: int | None, trailing: tuple[int, ...], dtype: type | None
) -> None:
    """Hundreds of rows and over a thousand (more than one block of masks) pad as row by row,
    whether the dtype is kept or cast: the values cut at ``length``, then the pad value;
    empty rows all pad."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 120, rows)
    lengths[::17] = 0
    values = rng.integers(-1000, 1000, (int(lengths.sum()), *trailing)).astype(np.int32)
    r = Ragged(values, np.concatenate([[0], np.cumsum(lengths)]))
    x, n = r.to_padded(pad=-9, length=length, dtype=dtype)
    size = int(lengths.max()) if length is None else length
    want = np.full((rows, size, *trailing), -9, x.dtype)
    for i in range(rows):
        k = min(int(lengths[i]), size)
        want[i, :k] = r[i][:k]
    assert x.dtype == (values.dtype if dtype is None else np.dtype(dtype))
    np.testing.assert_array_equal(x, want)
    np.testing.assert_array_equal(n, np.minimum(lengths, size))


#: Pads 64 rows of 4 int32 values that end where a page no process may read begins (the
#: values array goes on into it, as a mapped heap goes on into pages not made ready), to 16.
_GUARD_PAGE = """
import ctypes, mmap, sys
import numpy as np
from asynchdf5._ragged import pad_rows

page = mmap.PAGESIZE
m = mmap.mmap(-1, 2 * page)
values = np.frombuffer(m, np.int32)
values[:] = np.arange(len(values))
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
address = values.__array_interface__["data"][0]
assert libc.mprotect(address + page, page, 0) == 0  # PROT_NONE: a read there is a SIGSEGV
n = page // 4
starts = np.arange(n - 4 * 64, n, 4, dtype=np.int64)
cut = np.full(64, 4, np.int64)
out = np.empty((64, 16), np.int32)
pad_rows(values, starts, cut, out, -1, exact=sys.argv[1] == "exact")
want = np.full((64, 16), -1, np.int32)
want[:, :4] = starts[:, None] + np.arange(4)
assert (out == want).all()
print("padded")
"""


def test_padding_many_rows_exactly_reads_no_value_past_them(tmp_path: Path) -> None:
    """``pad_rows(..., exact=True)`` (what the padded gather asks for a mapped file's heap,
    whose pages past the batch's rows were not made ready) reads only the rows' values: rows
    that end where an unreadable page begins are padded; padding by windows reads past them
    (it is what the test's page stands for: there, an I/O error would fault, not raise)."""
    script = tmp_path / "guard.py"
    script.write_text(_GUARD_PAGE)
    assert run_python([script, "exact"], timeout=60).strip() == "padded"
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    by_windows = subprocess.run(
        [sys.executable, str(script), "windows"],
        capture_output=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert by_windows.returncode == -signal.SIGSEGV, by_windows


@pytest.mark.parametrize("mmap", [True, False])
def test_a_mapped_heap_is_padded_exactly_and_a_copied_one_by_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mmap: bool
) -> None:
    """The padded gather pads a mapped heap's rows reading nothing past them
    (:func:`test_padding_many_rows_exactly_reads_no_value_past_them`), a cache slot's by
    windows (its memory is the layer's own), and the batches are the Pad's either way."""
    use_way(monkeypatch, "windows")
    asked: list[bool] = []
    pad_rows = asynchdf5._ragged.pad_rows

    def spy(values: Any, starts: Any, cut: Any, out: Any, pad: Any, exact: bool = False) -> None:
        asked.append(exact)
        pad_rows(values, starts, cut, out, pad, exact=exact)

    monkeypatch.setattr(asynchdf5._gather, "pad_rows", spy)
    (path,) = files_of(tmp_path, [500])
    pad = [("tok", T.Pad(-1, length=LENGTH))]
    kw: dict[str, Any] = dict(tops=("tok", "label"), batch_size=10, shuffle=True, seed=2)
    with HDF5DataLayer(path, transformers=pad, mmap=mmap, **kw) as layer:
        assert layer.stats.read_paths["tok"] == ("ragged-mmap" if mmap else "ragged-pread")
        batches = list(layer)
    check_exactly_once([b.indices for b in batches], 500)
    for b in batches:
        want = [padded_row(g, -1) for g in b.indices.tolist()]
        np.testing.assert_array_equal(b["tok"], np.array(want))
    assert asked and set(asked) == {mmap}
