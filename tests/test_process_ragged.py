"""``process=True`` over ragged and sparse tops (issue 41): the helper process gathers them, each
batch crosses the shared memory as its arrays, and this process gets the same
:class:`~asynchdf5.Ragged` and scipy CSR batches as the in-process layer, batch by batch.

Every file here says which sample a row is: row ``g`` of the ragged tops ``tok`` and ``seq``
holds ``length(g)`` values all equal to ``g`` (``seq``'s of trailing shape ``(2,)``; empty rows
among them, and one row of :data:`LONG_VALUES`), and row ``g`` of the sparse tops ``X`` and
``Y`` holds ``g % 4`` values ``g + 1`` in columns 0, 2, 4 (empty rows too); one file holds no
rows at all.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import h5py
import numpy as np
import pytest
import scipy.sparse

from asynchdf5 import AsyncHDF5DataLayer, HDF5DataLayer, Ragged
from asynchdf5 import transforms as T
from asynchdf5._ragged_tops import RaggedInfo, RowLengths

from ._fake_cupy import FakeArray, FakeCsrMatrix, FakeCupy
from ._files import check_exactly_once
from ._gpu_data import host_copy
from ._leaks import aassert_released, asnapshot, no_helper_left

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]
DEADLINE = 60
SIZES = (23, 0, 38)  # a file of no rows among them
N = sum(SIZES)
COLS = 9
LONG_ROW, LONG_VALUES = 5, 3000  # a row far longer than the others (0 to 7 values)
TOPS = ("tok", "X", "label", "len")
#: Small chunks and a short ring (4 slots): batches kept by the consumer soon hold all but one
#: slot, so later ones are copied out of theirs.
KW: dict[str, Any] = {"batch_size": 4, "shuffle": True, "seed": 7, "chunk_size": 16, "prefetch": 2}


def tok_lengths(g: np.ndarray) -> np.ndarray:
    lens = ((g * 7919) % 8).astype(np.int64)
    lens[g == LONG_ROW] = LONG_VALUES
    return lens


def dense_rows(g: np.ndarray) -> np.ndarray:
    """The sparse tops' rows ``g``, dense."""
    out = np.zeros((len(g), COLS), np.float32)
    for i, k in enumerate(g.tolist()):
        out[i, [0, 2, 4][: k % 4]] = k + 1
    return out


def write_files(folder: Path) -> list[Path]:
    paths, start = [], 0
    for k, n in enumerate(SIZES):
        g = np.arange(start, start + n, dtype=np.int64)
        lens = tok_lengths(g)
        indptr = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=indptr[1:])
        m = scipy.sparse.csr_array(dense_rows(g))
        path = folder / f"m{k}.h5"
        with h5py.File(path, "w") as f:
            f["label"], f["len"] = g, lens
            for name, trailing in (("tok", ()), ("seq", (2,))):  # ragged groups: data + indptr
                grp = f.create_group(name)
                values = np.repeat(g, lens).reshape(-1, *[1] * len(trailing))
                grp["data"], grp["indptr"] = values * np.ones(trailing, np.int64), indptr
            for name in ("X", "Y"):  # a CSR group as AnnData writes one
                grp = f.create_group(name)
                grp["data"] = m.data
                grp["indices"] = m.indices.astype(np.int32)
                grp["indptr"] = m.indptr.astype(np.int64)
                grp.attrs["encoding-type"], grp.attrs["shape"] = "csr_matrix", (n, COLS)
        paths.append(path)
        start += n
    return paths


def check_batch(b: Any, x: str = "X") -> None:
    """``tok`` and sparse ``x`` hold the rows of ``b.indices``, aligned with ``label``, ``len``."""
    g = b.indices
    np.testing.assert_array_equal(b["label"], g)
    tok = b["tok"]
    assert isinstance(tok, Ragged) and tok.offsets.dtype == np.int64
    np.testing.assert_array_equal(tok.lengths, b["len"])
    np.testing.assert_array_equal(tok.lengths, tok_lengths(g))
    np.testing.assert_array_equal(tok.values, np.repeat(g, tok.lengths))
    m = b[x]
    assert type(m) is scipy.sparse.csr_array and m.shape == (len(g), COLS)
    np.testing.assert_array_equal(m.toarray(), dense_rows(g))


def check_same(got: Any, want: Any) -> None:
    """Two batches are the same: keys in order, indices, and each top's value (its type, its
    arrays' dtypes and shapes, their values)."""
    assert list(got) == list(want)
    np.testing.assert_array_equal(got.indices, want.indices)
    assert got.epoch == want.epoch
    for top in want:
        g, w = got[top], want[top]
        assert type(g) is type(w), top
        if isinstance(w, Ragged):
            pairs = [(g.values, w.values), (g.offsets, w.offsets)]
        elif scipy.sparse.issparse(w):
            assert g.shape == w.shape
            pairs = [(g.data, w.data), (g.indices, w.indices), (g.indptr, w.indptr)]
        else:
            pairs = [(g, w)]
        for a, b in pairs:
            assert a.dtype == b.dtype and a.shape == b.shape, top
            np.testing.assert_array_equal(a, b)


def _copied(b: Any) -> bool:
    """Whether batch ``b`` was copied out of its slot (its arrays own their memory)."""
    return b["label"].base is None


async def test_ragged_and_sparse_tops_as_in_process(tmp_path: Path) -> None:
    """Two epochs and a stream over ragged, sparse and fixed tops: the in-process layer's
    batches, every sample once an epoch, the rows of every top from the same samples. Batches
    kept across two epochs (past the ring: later ones copied out of their slots, for real) stay
    right while the helper writes many more; once let go of, their slots come back (the stream's
    batches are views of slots again, none copied); nothing is left behind."""
    files = write_files(tmp_path)
    before = await asnapshot()
    with anyio.fail_after(DEADLINE):
        async with AsyncHDF5DataLayer(files, tops=TOPS, process=True, **KW) as layer:
            async with AsyncHDF5DataLayer(files, tops=TOPS, **KW) as ref:
                kept = []
                for epoch in range(2):
                    got = [b async for b in layer]  # every batch held
                    want = [b async for b in ref]
                    check_exactly_once([b.indices for b in got], N)
                    for b, w in zip(got, want, strict=True):
                        check_batch(b)
                        check_same(b, w)
                    assert layer.epoch == epoch + 1
                    kept += got
                copies = [b for b in kept if _copied(b)]
                assert copies and len(copies) < len(kept)  # both ways of handing one over
                for b in copies:  # a real copy: nothing of it in a slot the helper reuses
                    assert b["tok"].values.base is None and b["tok"].offsets.base is None
                for b in kept:  # unchanged, the helper having written many batches since
                    check_batch(b)
                n_kept = len(kept)
                del kept, got, want, copies, b, w
                seen = 0
                async with _zip(layer.stream(), ref.stream()) as pairs:
                    async for b, w in pairs:
                        check_batch(b)
                        check_same(b, w)
                        assert not _copied(b)  # every slot came back: a view of one
                        seen += b.size
                        if seen >= 2 * N:
                            break
                assert layer.epoch >= 3
                stats = layer.stats
                assert stats.read_paths["tok"].startswith("ragged-")
                assert stats.read_paths["X"].startswith("sparse-")
                assert stats.bytes_read > 0 and stats.batches == n_kept + seen // 4
        del b, w
        await aassert_released(before)
    no_helper_left()


@contextlib.asynccontextmanager
async def _zip(a: Any, b: Any) -> AsyncIterator[AsyncGenerator[tuple[Any, Any]]]:
    """The pairs of two async iterators, both closed at the end."""

    async def pairs() -> AsyncGenerator[tuple[Any, Any]]:
        async for x in a:
            yield x, await b.__anext__()

    gen = pairs()
    try:
        yield gen
    finally:
        await gen.aclose()
        await a.aclose()
        await b.aclose()


def test_resume_mid_epoch_and_transformers(tmp_path: Path) -> None:
    """A state saved mid-epoch and loaded into a new layer: the rest of the epoch is the
    in-process layer's. Transformers run in the helper on the ragged and sparse tops (a fused
    ``Pad`` that cuts the long row, ``Densify``, a user transformer returning a Ragged, one
    returning a ``csr_matrix``) and their batches are the in-process layer's: a CSR batch keeps
    its class."""
    files = write_files(tmp_path)
    tops = ("tok", "seq", "X", "Y", "label", "len")
    kw: dict[str, Any] = dict(
        tops=tops,
        transformers=[
            ("tok", T.Pad(-1, length=6)),
            ("seq", Twice()),
            ("X", T.Densify()),
            ("Y", AsMatrix()),
        ],
        **KW,
    )
    with HDF5DataLayer(files, **kw) as ref:
        want = list(ref)
    with HDF5DataLayer(files, process=True, **kw) as layer:
        head = []
        for b in layer:
            head.append(b)
            if len(head) == 5:
                state = layer.state_dict()  # mid-epoch: the next batch is the 6th
                break
    with HDF5DataLayer(files, process=True, **kw) as again:  # a new helper, from the state
        again.load_state_dict(state)
        rest = list(again)
        assert again.epoch == 1
    got = head + rest
    assert len(got) == len(want)
    for b, w in zip(got, want, strict=True):
        check_same(b, w)
        assert type(b["Y"]) is scipy.sparse.csr_matrix
        tok, g = b["tok"], b.indices
        assert tok.shape == (len(g), 6)
        for i, k in enumerate(tok_lengths(g).tolist()):
            assert (tok[i, : min(k, 6)] == g[i]).all() and (tok[i, min(k, 6) :] == -1).all()
        seq = b["seq"]  # rows of a trailing shape
        assert seq.values.shape == (int(tok_lengths(g).sum()), 2)
        rows = np.repeat(g, tok_lengths(g))[:, None] * np.ones(2, np.int64)
        np.testing.assert_array_equal(seq.values, 2 * rows)
        np.testing.assert_array_equal(b["X"], dense_rows(g))
        np.testing.assert_array_equal(b["Y"].toarray(), 2 * dense_rows(g))
    check_exactly_once([b.indices for b in got], N)
    no_helper_left()


class Twice:
    """A user transformer on a ragged top: a new Ragged of twice the values (picklable)."""

    def __call__(self, r: Ragged) -> Ragged:
        return Ragged(r.values * 2, r.offsets)


class AsMatrix:
    """A user transformer on a sparse top: twice the matrix, as a ``scipy.sparse.csr_matrix``."""

    def __call__(self, m: Any) -> Any:
        return scipy.sparse.csr_matrix(m * 2)


def test_torch_adapter_padded_and_csr(tmp_path: Path) -> None:
    """The torch dataset over ``process=True``: a ragged top (transformed in the helper) as a
    padded tensor and its lengths, a sparse top as a ``torch.sparse_csr_tensor``."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from asynchdf5.torch import HDF5IterableDataset

    files = write_files(tmp_path)
    kw = dict(KW, transformers=[("tok", Twice())])
    with HDF5IterableDataset(files, tops=TOPS, process=True, ragged="padded", **kw) as ds:
        seen = []
        for d in DataLoader(ds, batch_size=None, num_workers=0):
            g = d["label"].numpy()
            padded, lengths = d["tok"]
            lens = tok_lengths(g)
            np.testing.assert_array_equal(lengths.numpy(), lens)
            assert padded.shape == (len(g), int(lens.max()))
            for i, k in enumerate(lens.tolist()):
                assert (padded[i, :k] == 2 * g[i]).all() and (padded[i, k:] == 0).all()
            x = d["X"]
            assert x.layout == torch.sparse_csr
            np.testing.assert_array_equal(x.to_dense().numpy(), dense_rows(g))
            seen.append(g)
        check_exactly_once(seen, N)
    no_helper_left()


async def test_device_uploads_the_helpers_ragged_and_sparse_batches(
    tmp_path: Path, fake_cupy: FakeCupy
) -> None:
    """``device=`` with ``process=True``: the helper gathers host batches, this process
    uploads them: a Ragged of device arrays and a device CSR matrix, as the in-process device
    layer's, batch by batch."""
    files = write_files(tmp_path)
    kw: dict[str, Any] = dict(tops=("tok", "X", "label"), device="cuda", **KW)

    def host(b: Any) -> dict[str, Any]:
        tok, x = b["tok"], b["X"]
        assert isinstance(tok, Ragged) and isinstance(tok.values, FakeArray)
        assert isinstance(x, FakeCsrMatrix)
        return {
            "indices": np.array(b.indices),
            "values": host_copy(tok.values),
            "offsets": host_copy(tok.offsets),
            "data": host_copy(x.data),
            "columns": host_copy(x.indices),
            "indptr": host_copy(x.indptr),
            "label": host_copy(b["label"]),
        }

    with anyio.fail_after(DEADLINE):
        async with AsyncHDF5DataLayer(files, process=True, **kw) as layer:
            got = [host(b) async for b in layer]
        async with AsyncHDF5DataLayer(files, **kw) as ref:
            want = [host(b) async for b in ref]
    assert len(got) == len(want)
    for b, w in zip(got, want, strict=True):
        for key, a in w.items():
            assert b[key].dtype == a.dtype, key
            np.testing.assert_array_equal(b[key], a)
        g = b["indices"]
        np.testing.assert_array_equal(b["label"], g)
        np.testing.assert_array_equal(np.diff(b["offsets"]), tok_lengths(g))
        np.testing.assert_array_equal(b["values"], np.repeat(g, tok_lengths(g)))
        m = scipy.sparse.csr_array((b["data"], b["columns"], b["indptr"]), shape=(len(g), COLS))
        np.testing.assert_array_equal(m.toarray(), dense_rows(g))
    check_exactly_once([b["indices"] for b in got], N)
    no_helper_left()


def test_what_the_layers_process_keeps_of_a_ragged_top() -> None:
    """``RaggedInfo.for_batches(rows)``, which the helper sends: a few bytes whatever the rows,
    the kind, columns and index dtypes kept (the batches' index dtype the whole top's, not one
    row's), and the heap bound of any batch of up to ``rows`` rows (a device's staging)."""
    lens = np.array([5, 0, 9, 2, 2**31 - 3, 1], np.int64)  # int64 batches: the non-zeros
    indptr = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=indptr[1:])
    info = RaggedInfo("sparse", 11, np.dtype(np.int32), lengths=RowLengths([(len(lens), indptr)]))
    kept = pickle.loads(pickle.dumps(info.for_batches(3)))
    assert len(pickle.dumps(kept)) < 2000
    assert (kept.kind, kept.n_cols, kept.index_dtype, kept.sparse) == ("sparse", 11, np.int32, True)
    for rows in (1, 2, 3):
        assert kept.heap_rows(rows) == info.heap_rows(3) == 2**31 - 3 + 9 + 5
    one = pickle.loads(pickle.dumps(info.for_batches(1)))  # its bound alone fits int32
    assert one.heap_rows(1) == 2**31 - 3
    assert info.batch_index_dtype == one.batch_index_dtype == np.int64


def test_a_batch_no_shared_memory_carries_is_a_transform_error(tmp_path: Path) -> None:
    """A transformer's output of another sparse format: a TransformError naming the top."""
    from asynchdf5 import TransformError

    files = write_files(tmp_path)
    layer = HDF5DataLayer(files, tops=TOPS, transformers=[("X", ToCsc())], process=True, **KW)
    with layer, pytest.raises(TransformError, match=r"top 'X'.*csc_array.*process=True"):
        for _ in layer:
            pass
    no_helper_left()


class ToCsc:
    def __call__(self, m: Any) -> Any:
        return scipy.sparse.csc_array(m)


def test_a_control_message_of_any_size_crosses() -> None:
    """A control message longer than the socket carries as one (its send buffer: 208 KiB by
    default on Linux; and longer than :data:`MAX_MESSAGE`, the receiver's buffer) arrives
    whole, with the descriptor sent beside it; a short one as before; nothing left open."""
    from asynchdf5._process._wire import MAX_MESSAGE, recv, send, socket_pair

    ours, theirs = socket_pair()
    r, w = os.pipe()
    buf = bytearray(MAX_MESSAGE)
    try:
        fds = _fd_count()
        long = ("open", "x" * (2 << 20), list(range(1000)))
        send(ours, long, w)
        got, fd = recv(theirs, buf, block=True)
        assert got == long and fd is not None
        os.write(fd, b"!")  # the pipe's own write end
        os.close(fd)
        assert os.read(r, 1) == b"!"
        send(ours, ("free", (1, 2)))
        assert recv(theirs, buf, block=True) == (("free", (1, 2)), None)
        assert _fd_count() == fds
    finally:
        for s in (ours, theirs):
            s.close()
        os.close(r)
        os.close(w)


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_layer_of_many_ragged_tops(tmp_path: Path) -> None:
    """So many ragged tops that the helper's messages are long: the tops it found at open
    (~270 KB, more than the socket carries as one) and each batch's layout (~70 KB, more than
    :data:`MAX_MESSAGE`: through shared memory, beside a new slot's descriptor): the
    in-process layer's batches, not a helper gone for a message too long."""
    n, tops = 6, 900
    names = [f"a_ragged_top_of_a_longish_name_{k:04d}" for k in range(tops)]
    path = tmp_path / "many.h5"
    with h5py.File(path, "w") as f:
        f["label"] = np.arange(n)
        for k, name in enumerate(names):
            grp = f.create_group(name)
            grp["data"] = np.arange(2 * n, dtype=np.int32) + k
            grp["indptr"] = np.arange(0, 2 * n + 1, 2, dtype=np.int64)
    kw: dict[str, Any] = dict(tops=(*names, "label"), batch_size=2, shuffle=True, seed=1)
    with HDF5DataLayer(path, **kw) as ref:
        want = list(ref)
    with HDF5DataLayer(path, process=True, **kw) as layer:
        got = list(layer)
    assert len(got) == len(want) == n // 2
    for b, w in zip(got, want, strict=True):
        check_same(b, w)
    no_helper_left()


def _columns(g: np.ndarray) -> np.ndarray:
    """The sparse tops' column indices of rows ``g``, concatenated."""
    return np.concatenate([[0, 2, 4][: k % 4] for k in g.tolist()] + [[]]).astype(np.int32)


def _kept_parts(b: Any) -> list[tuple[str, Any, np.ndarray]]:
    """Parts of batch ``b`` a consumer may keep alone, each as a view of its slot (or a tensor
    over one), with the values it must keep holding: a Ragged's values, a row of it, its
    offsets, a CSR matrix's column indices and values, and torch tensors over them (from
    ``torch.from_numpy`` and the torch adapter's jagged and CSR forms)."""
    torch = pytest.importorskip("torch")
    from asynchdf5.torch._dataset import as_torch

    g = np.array(b.indices)
    tok, x = b["tok"], b["X"]
    lens = tok_lengths(g)
    i = int(np.argmax(lens))  # the batch's longest row (the long one, where it is there)
    values = np.repeat(g, lens)
    assert values.size == 0 or np.shares_memory(tok.values, tok.values.base)  # a view
    return [
        ("values", tok.values, values),
        ("row", tok[i], np.full(lens[i], g[i])),
        ("offsets", tok.offsets, np.r_[0, np.cumsum(lens)]),
        ("indices", x.indices, _columns(g)),
        ("data", x.data, np.repeat(g + 1, g % 4).astype(np.float32)),
        ("from_numpy", torch.from_numpy(tok.values), values),
        ("nested", as_torch(tok, "nested"), values),
        ("sparse_csr", as_torch(x), np.repeat(g + 1, g % 4).astype(np.float32)),
    ]


def _host(kept: Any) -> np.ndarray:
    """A kept part's values, as NumPy (a jagged or CSR tensor's through its ``values()``)."""
    if isinstance(kept, np.ndarray):
        return kept
    if kept.is_nested or kept.is_sparse_csr:
        kept = kept.values()
    return np.asarray(kept.numpy())


def test_a_part_kept_alone_keeps_its_slot_while_others_are_reused(tmp_path: Path) -> None:
    """A consumer keeps one part of a batch alone (see :func:`_kept_parts`) and lets go of the
    rest: its slot stays the consumer's as long as the part lives, while the helper fills the
    other slots over and over (every batch a view of a slot, none copied; the long row makes
    slots grow meanwhile), so the part's values stay right; once it goes, its slot comes
    back. Two parts are kept at a time, of batches far apart, and one past the layer's end."""
    files = write_files(tmp_path)
    kw = dict(KW, prefetch=5)  # 5 slots: two kept, the one handed over, two for the helper
    lives = 25  # batches a part outlives its own by (the helper writes 5 slots over 5 times)
    kept: list[tuple[int, str, Any, np.ndarray]] = []
    picked, checked = 0, []
    with HDF5DataLayer(files, tops=TOPS, process=True, **kw) as layer:
        for j, b in enumerate(layer.stream()):
            assert not _copied(b), j  # a view of a slot: the kept parts hold two at most
            check_batch(b)
            for born, name, part, want in kept:
                np.testing.assert_array_equal(_host(part), want, err_msg=f"{name} of {born}")
            if kept and j - kept[0][0] >= lives:
                checked.append(kept.pop(0)[1])
            parts = _kept_parts(b)
            if j % 13 == 0 and len(kept) < 2 and picked < len(parts):
                kept.append((j, *parts[picked]))
                picked += 1
            del b, parts
            if picked == 8 and len(kept) == 1:
                break
        assert layer.epoch >= 4  # the long row, in a batch of its own slot, four times
    assert len(checked) == 7
    for born, name, part, want in kept:  # past the layer's end: its memory is the part's
        np.testing.assert_array_equal(_host(part), want, err_msg=f"{name} of {born}")
    no_helper_left()


def _crossed(value: Any, rows: int, copy: bool) -> Any:
    """``value`` as the layer's process gets it: taken apart into a slot by the helper, and
    rebuilt over the slot (or, ``copy``, out of it)."""
    from asynchdf5._process._wire import Segment, needed, parts_of, write_batch

    data = {"top": parts_of("top", value)}
    segment, fd = Segment.create(needed(data, rows))
    os.close(fd)
    layout = write_batch(segment, data, np.arange(rows, dtype=np.int64))
    got, indices = segment.views(layout, None if copy else (lambda: None), copy=copy)
    np.testing.assert_array_equal(indices, np.arange(rows))
    return got["top"]


def _arrays(value: Any) -> list[np.ndarray]:
    if isinstance(value, Ragged):
        return [value.values, value.offsets]
    return [value.data, value.indices, value.indptr]


@pytest.mark.parametrize("copy", [False, True])
def test_a_batch_crosses_the_slot_as_it_was(copy: bool) -> None:
    """A Ragged (values of every kind of dtype, trailing shapes, rows all empty, one row) and a
    scipy CSR matrix (csr_array or csr_matrix, int32 or int64 indices, unsorted and duplicate
    columns, no non-zeros) arrive as they were sent: the same class, shape, and arrays of the
    same dtypes, shapes and values (scipy's ``csr_matrix`` would narrow int64 indices)."""
    rng = np.random.default_rng(5)
    sent: list[Any] = []
    dtypes: tuple[Any, ...] = (np.bool_, np.int8, np.float16, np.complex128, ">i4", np.uint64)
    for dtype, trailing, lengths in itertools.product(
        dtypes, [(), (3,), (2, 0)], [[0, 0, 0], [9], [0, 4, 0, 1]]
    ):
        values = rng.integers(0, 99, (sum(lengths), *trailing)).astype(dtype)
        sent.append(Ragged(values, np.r_[0, np.cumsum(lengths)]))
    dense = rng.integers(0, 2, (6, 7)) * rng.integers(1, 9, (6, 7))
    for kind, index, dtype in itertools.product(
        ("csr_array", "csr_matrix"), (np.int32, np.int64), (np.float32, np.bool_, np.int8)
    ):
        for d in (dense, np.zeros((3, 4))):
            m = getattr(scipy.sparse, kind)(d.astype(dtype))
            m.indices, m.indptr = m.indices.astype(index), m.indptr.astype(index)
            sent.append(m)
        columns = np.array([3, 1, 1, 0], index)  # unsorted, with a duplicate
        arrays: tuple[Any, ...] = (np.arange(1, 5).astype(dtype), columns, np.r_[0, 3, 4])
        m = getattr(scipy.sparse, kind)(arrays, shape=(2, 5))  # (indices of one dtype below)
        m.indices, m.indptr = m.indices.astype(index), m.indptr.astype(index)
        sent.append(m)
    for value in sent:
        got = _crossed(value, len(value) if isinstance(value, Ragged) else value.shape[0], copy)
        assert type(got) is type(value)
        if not isinstance(value, Ragged):
            assert got.shape == value.shape
        for g, w in zip(_arrays(got), _arrays(value), strict=True):
            assert (g.dtype, g.shape) == (w.dtype, w.shape), (type(value).__name__, w.dtype)
            np.testing.assert_array_equal(g, w)


def test_a_csr_matrix_of_int64_indices_keeps_them(tmp_path: Path) -> None:
    """A sparse top stored with int64 indices, made a ``csr_matrix`` by a transformer in the
    helper: its batches keep int64 indices and offsets, as in-process (scipy's constructor
    would narrow them to int32, copies of the slot's)."""
    path = tmp_path / "wide.h5"
    m = scipy.sparse.csr_array(dense_rows(np.arange(10)))
    with h5py.File(path, "w") as f:
        grp = f.create_group("X")
        grp["data"], grp["indices"], grp["indptr"] = m.data, m.indices.astype(np.int64), m.indptr
        grp.attrs["encoding-type"], grp.attrs["shape"] = "csr_matrix", m.shape
    kw: dict[str, Any] = dict(tops=("X",), transformers=[("X", AsMatrix())], batch_size=4)
    with HDF5DataLayer(path, **kw) as ref:
        want = list(ref)
    with HDF5DataLayer(path, process=True, **kw) as layer:
        got = list(layer)
    assert want and want[0]["X"].indices.dtype == np.int64
    for b, w in zip(got, want, strict=True):
        check_same(b, w)
    no_helper_left()


def test_a_helper_killed_mid_epoch_is_a_read_error(tmp_path: Path) -> None:
    """The helper killed (SIGKILL) mid-epoch while the consumer holds batches of ragged and
    sparse tops in their slots: the next batch is a ReadError naming the helper, not a hang,
    and the batches held stay right (their memory is this process's mapping)."""
    from asynchdf5 import ReadError

    from ._leaks import helper_processes

    files = write_files(tmp_path)
    held = []
    with HDF5DataLayer(files, tops=TOPS, process=True, **KW) as layer:
        with pytest.raises(ReadError, match="helper process"):
            for b in layer:
                held.append(b)
                if len(held) == 2:
                    (helper,) = helper_processes()
                    helper.kill()
                    helper.wait(10)
        assert 2 <= len(held) < N // 4
    assert not any(_copied(b) for b in held[:2])
    for b in held:
        check_batch(b)
    no_helper_left()
