"""Ragged and sparse tops through the device upload (``device=``, issue 41).

A ragged top's batch arrives as an :class:`~asynchdf5.Ragged` of CuPy arrays, a sparse top's as
a ``cupyx.scipy.sparse.csr_matrix``, and after ``Pad`` / ``Densify`` (run on the device, after
the upload) as a dense CuPy array. The checks are shared: run on the stand-in for CuPy
(``_fake_cupy``: the stage's control flow and bookkeeping, not CUDA), and, ``gpu``-marked, on
the real CuPy (skipped without a CUDA GPU).

Every file is written so that a row says which sample it is: row ``g`` of the ragged top
``tok`` holds ``length(g)`` values all equal to ``g`` (empty rows included), ``label`` is
``g``; the sparse top ``X`` is stored beside its dense copy ``dense``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import h5py
import numpy as np
import pytest
import scipy.sparse

from asynchdf5 import (
    AsyncHDF5DataLayer,
    ConfigurationError,
    DeviceError,
    HDF5DataLayer,
    Ragged,
    SchemaError,
    Stream,
)
from asynchdf5 import transforms as T
from asynchdf5._delivery._cuda import CudaDelivery
from asynchdf5._ragged_cupy import to_padded_on_device

from ._fake_cupy import FakeArray, FakeCsrMatrix, FakeCupy, FakePinnedMemory
from ._files import check_exactly_once, check_message

pytestmark = pytest.mark.timeout(120)
DEADLINE = 60  # a first CUDA kernel's compile included
N = 61


def _lengths(g: np.ndarray, longest: int = 7) -> np.ndarray:
    return ((g * 7919) % (longest + 1)).astype(np.int64)  # 0 .. longest: empty rows too


def write_ragged(folder: Path, sizes: Sequence[int], trailing: tuple[int, ...] = ()) -> list[Path]:
    """Files of ``sizes`` samples: ``tok`` (data + indptr), ``label`` and ``len``."""
    paths, start = [], 0
    for k, n in enumerate(sizes):
        g = np.arange(start, start + n, dtype=np.int64)
        lens = _lengths(g)
        path = folder / f"r{k}.h5"
        with h5py.File(path, "w") as f:
            f["label"], f["len"] = g, lens
            grp = f.create_group("tok")
            values = np.repeat(g, lens).reshape(-1, *([1] * len(trailing)))
            grp["data"] = values * np.ones(trailing, np.int64)
            indptr = np.zeros(n + 1, np.int64)
            np.cumsum(lens, out=indptr[1:])
            grp["indptr"] = indptr
        paths.append(path)
        start += n
    return paths


def write_csr(path: Path, n: int = N, cols: int = 9, dtype: Any = np.float32) -> Path:
    """``X`` (CSR group, AnnData's attributes), ``dense`` (the same matrix) and ``label``."""
    m = scipy.sparse.random(n, cols, density=0.3, format="csr", random_state=0, dtype=np.float64)
    m = scipy.sparse.csr_array(m.astype(dtype))
    m.data[:] = np.arange(1, m.nnz + 1)  # no zero stored: every value says where it is
    with h5py.File(path, "w") as f:
        g = f.create_group("X")
        g["data"], g["indices"], g["indptr"] = m.data, m.indices, m.indptr
        g.attrs["shape"], g.attrs["encoding-type"] = m.shape, "csr_matrix"
        f["dense"] = m.toarray()
        f["label"] = np.arange(n)
    return path


async def _epoch(layer: AsyncHDF5DataLayer, keep: Callable[[Any], Any]) -> list[Any]:
    out = []
    with anyio.fail_after(DEADLINE):
        async for b in layer:
            out.append(keep(b))
    return out


async def check_ragged(
    tmp_path: Path,
    array: type,
    to_numpy: Callable[[Any], np.ndarray],
    trailing: tuple[int, ...] = (),
    shuffle: bool = True,
) -> None:
    """A ragged and dense tops in one batch: each batch's ``tok`` a Ragged of device arrays
    (int64 offsets, rows + 1 of them), rows aligned with ``label`` and ``len``, empty rows
    kept, every sample exactly once in each of two epochs, as on the host."""
    paths = write_ragged(tmp_path, [23, 0, 38], trailing)
    kw: dict[str, Any] = dict(tops=("tok", "label", "len"), batch_size=8, shuffle=shuffle, seed=4)

    def keep(b: Any) -> dict[str, Any]:
        tok = b["tok"]
        assert isinstance(tok, Ragged)
        assert isinstance(tok.values, array) and isinstance(tok.offsets, array)
        assert isinstance(b["label"], array) and isinstance(b.indices, np.ndarray)
        return {
            "indices": np.array(b.indices),
            "values": to_numpy(tok.values),
            "offsets": to_numpy(tok.offsets),
            "label": to_numpy(b["label"]),
            "len": to_numpy(b["len"]),
        }

    async with AsyncHDF5DataLayer(paths, **kw) as host_layer:
        host = await _epoch(host_layer, lambda b: (b.indices, b["tok"]))
    async with AsyncHDF5DataLayer(paths, device="cuda", **kw) as layer:
        epochs = [await _epoch(layer, keep) for _ in range(2)]
    for batches in epochs:
        check_exactly_once([b["indices"] for b in batches], N)
        for b in batches:
            rows = len(b["indices"])
            assert b["offsets"].dtype == np.int64 and len(b["offsets"]) == rows + 1
            np.testing.assert_array_equal(b["label"], b["indices"])
            np.testing.assert_array_equal(np.diff(b["offsets"]), b["len"])
            np.testing.assert_array_equal(b["len"], _lengths(b["indices"]))
            want = np.repeat(b["indices"], b["len"])
            assert b["values"].shape == (len(want), *trailing)
            flat = b["values"].reshape(len(want), -1)
            np.testing.assert_array_equal(flat, np.repeat(want[:, None], flat.shape[1], 1))
    for (indices, tok), b in zip(host, epochs[0], strict=True):  # the host's batches
        np.testing.assert_array_equal(indices, b["indices"])
        np.testing.assert_array_equal(tok.values, b["values"])
        np.testing.assert_array_equal(tok.offsets, b["offsets"])


async def check_sparse(tmp_path: Path, matrix: Any, to_numpy: Callable[[Any], np.ndarray]) -> None:
    """A sparse top's batches: CuPy sparse matrices of the batch's rows, in batch order."""
    path = write_csr(tmp_path / "m.h5")
    kw: dict[str, Any] = dict(tops=("X", "dense", "label"), batch_size=8, shuffle=True, seed=1)

    def keep(b: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        x: Any = b["X"]
        assert isinstance(x, matrix) and x.shape == (len(b.indices), 9)
        return np.array(b.indices), to_numpy(x.toarray()), to_numpy(b["dense"]), to_numpy(x.data)

    async with AsyncHDF5DataLayer(path, device="cuda", **kw) as layer:
        batches = await _epoch(layer, keep)
    check_exactly_once([b[0] for b in batches], N)
    for _, x, dense, data in batches:
        np.testing.assert_array_equal(x, dense)
        assert data.dtype == np.float32


async def check_transformed(tmp_path: Path, array: type, to_numpy: Callable[[Any], Any]) -> None:
    """``Pad`` and ``Densify`` run on the device after the upload: dense device arrays with the
    host's values (a given length cuts longer rows; none pads to the batch's longest)."""
    paths = write_ragged(tmp_path, [N], (2,))
    csr = write_csr(tmp_path / "m.h5")
    for length in (None, 3, 9):
        kw: dict[str, Any] = dict(
            tops=("tok", "label"), batch_size=8, shuffle=True, seed=2,
            transformers=[("tok", T.Pad(-1, length=length)), ("tok", T.Cast(np.float32))],
        )  # fmt: skip
        async with AsyncHDF5DataLayer(paths, **kw) as host_layer:
            host = await _epoch(host_layer, lambda b: (b.indices, b["tok"]))
        async with AsyncHDF5DataLayer(paths, device="cuda", **kw) as layer:
            dev = await _epoch(layer, lambda b: (b.indices, b["tok"], to_numpy(b["tok"])))
        for (hi, h), (di, d, d_host) in zip(host, dev, strict=True):
            assert isinstance(d, array)
            np.testing.assert_array_equal(hi, di)
            assert d_host.dtype == np.float32 and d_host.shape == h.shape
            np.testing.assert_array_equal(d_host, h)
    kw = dict(tops=("X", "dense"), batch_size=8, transformers=[("X", T.Densify())])
    async with AsyncHDF5DataLayer(csr, device="cuda", **kw) as layer:
        for x, dense in await _epoch(layer, lambda b: (b["X"], to_numpy(b["dense"]))):
            assert isinstance(x, array)
            np.testing.assert_array_equal(to_numpy(x), dense)


# --- on the stand-in ---------------------------------------------------------------------------


def _get(x: Any) -> np.ndarray:
    return np.array(x.get())


@pytest.mark.anyio
@pytest.mark.parametrize(("trailing", "shuffle"), [((), True), ((), False), ((3,), True)])
async def test_fake_ragged_and_dense_tops_reach_the_device(
    tmp_path: Path, fake_cupy: FakeCupy, trailing: tuple[int, ...], shuffle: bool
) -> None:
    await check_ragged(tmp_path, FakeArray, _get, trailing, shuffle)


@pytest.mark.anyio
async def test_fake_device_batch_keys_follow_the_tops_order(
    tmp_path: Path, fake_cupy: FakeCupy
) -> None:
    tops = ("len", "tok", "label")  # a ragged top between fixed ones
    async with AsyncHDF5DataLayer(
        write_ragged(tmp_path, [N]), tops=tops, batch_size=8, device="cuda"
    ) as layer:
        for keys in await _epoch(layer, lambda b: list(b)):
            assert keys == list(tops)


@pytest.mark.anyio
async def test_fake_sparse_top_is_a_cupy_csr_matrix(tmp_path: Path, fake_cupy: FakeCupy) -> None:
    await check_sparse(tmp_path, FakeCsrMatrix, _get)


def test_fake_sparse_top_without_cupyx_sparse_is_a_named_error_at_open(
    tmp_path: Path, fake_cupy: FakeCupy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cupyx.scipy.sparse is imported at open for a sparse top on the device: where it cannot
    be, opening is a ConfigurationError naming the top (not an error from the first batch)."""
    path = write_csr(tmp_path / "m.h5")
    monkeypatch.setitem(sys.modules, "cupyx.scipy.sparse", None)  # what `import` takes as missing
    with pytest.raises(ConfigurationError) as err:
        HDF5DataLayer(path, tops=("X", "label"), batch_size=8, device="cuda").__enter__()
    check_message(err.value, "top 'X'", "cupyx.scipy.sparse cannot be imported", "device=None")


@pytest.mark.anyio
async def test_fake_pad_and_densify_run_after_the_upload(
    tmp_path: Path, fake_cupy: FakeCupy
) -> None:
    await check_transformed(tmp_path, FakeArray, _get)


@pytest.mark.anyio
async def test_fake_ragged_staging_is_sized_by_the_bound_and_reused(
    tmp_path: Path, fake_cupy: FakeCupy
) -> None:
    """Batches of one size ask for staging of one size (the longest rows' values), whatever
    rows they hold: after the first epoch no page-locked buffer is made any more. (A
    transformer keeps the staging on one thread: with two, how many buffers are lent at once,
    and so kept, depends on their timing.)"""
    paths = write_ragged(tmp_path, [N])
    kw: dict[str, Any] = dict(batch_size=6, shuffle=True, seed=0, device="cuda")
    layer = AsyncHDF5DataLayer(
        paths, tops=("tok", "label"), transformers=[("label", T.Cast(np.int64))], **kw
    )
    async with layer:
        await _epoch(layer, lambda b: None)
        made = FakePinnedMemory.created
        for _ in range(6):
            await _epoch(layer, lambda b: None)
        assert FakePinnedMemory.created == made


@pytest.mark.anyio
async def test_fake_ragged_batches_hold_the_leases_of_their_arrays(
    tmp_path: Path, fake_cupy: FakeCupy
) -> None:
    """The blocks a device Ragged and sparse matrix live in are the batch's (handed to the
    consumer's stream, given back by ``reuse_buffers``), as a dense top's are."""
    paths = write_ragged(tmp_path, [N])
    async with AsyncHDF5DataLayer(paths, tops=("tok", "label"), batch_size=8,
                                  device="cuda") as layer:  # fmt: skip
        with anyio.fail_after(DEADLINE):
            async for b in layer:
                tok = b["tok"]
                ptrs = {lease.mem.ptr for lease in b._data.leases}  # type: ignore[attr-defined]
                assert tok.offsets.data.mem.ptr in ptrs and b["label"].data.mem.ptr in ptrs
                if len(tok.values):
                    assert tok.values.data.mem.ptr in ptrs
    csr = write_csr(tmp_path / "m.h5")
    async with AsyncHDF5DataLayer(csr, tops=("X",), batch_size=8, device="cuda") as layer:
        with anyio.fail_after(DEADLINE):
            async for b in layer:
                ptrs = {lease.mem.ptr for lease in b._data.leases}  # type: ignore[attr-defined]
                x = b["X"]
                assert {a.data.mem.ptr for a in (x.data, x.indices, x.indptr)} <= ptrs


@pytest.mark.anyio
async def test_fake_failed_upload_of_a_ragged_top_is_a_device_error(
    tmp_path: Path, fake_cupy: FakeCupy
) -> None:
    """An upload that fails (here: the offsets' copy) ends the epoch with a DeviceError naming
    the top and the rows, gives the batch's staging back, and the next epoch is whole."""
    paths = write_ragged(tmp_path, [N], (3,))  # values: 24 bytes each; offsets of 4 rows: 40
    fake_cupy.upload_fails = 5 * 8
    layer = AsyncHDF5DataLayer(paths, tops=("tok", "label"), batch_size=4, device="cuda")
    async with layer:
        with pytest.raises(DeviceError) as info:
            await _epoch(layer, lambda b: None)
        check_message(info.value, "the offsets of top 'tok'", "a batch of 4 rows", "CUDA device 0")
        stage = layer._delivery
        assert isinstance(stage, CudaDelivery) and stage._gpu is not None
        # Every buffer lent to a batch comes back: the failed batch's at once, and the batch
        # another gathering thread had in hand when the epoch ended once that thread is done.
        with anyio.fail_after(10):
            while stage._gpu.staging._lent:
                await anyio.sleep(0.005)
        fake_cupy.upload_fails = None
        indices = await _epoch(layer, lambda b: np.array(b.indices))
    check_exactly_once(indices, N)


@pytest.mark.anyio
async def test_fake_sparse_values_cupy_cannot_hold_are_refused_at_open(
    tmp_path: Path, fake_cupy: FakeCupy
) -> None:
    path = write_csr(tmp_path / "m.h5", dtype=np.int32)
    layer = AsyncHDF5DataLayer(path, tops=("X",), batch_size=8, device="cuda")
    with pytest.raises(SchemaError) as info:
        async with layer:
            pass
    check_message(info.value, "'X'", "int32", "float32", "device=None")


@pytest.mark.parametrize("length", [None, 0, 2, 5, 20])
@pytest.mark.parametrize("trailing", [(), (2,)])
def test_fake_to_padded_on_device_matches_the_host(
    fake_cupy: FakeCupy, length: int | None, trailing: tuple[int, ...]
) -> None:
    sizes = [3, 0, 7, 1, 0, 4]
    rows: list[Any] = [np.full((k, *trailing), i, np.int16) for i, k in enumerate(sizes)]
    for r in (Ragged.from_rows(rows), Ragged.from_rows([], np.int16)):
        values, offsets = fake_cupy.asarray(r.values), fake_cupy.asarray(r.offsets)
        x, lengths = Ragged._trusted(values, offsets).to_padded(-2, length, np.float32)
        want_x, want_lengths = r.to_padded(-2, length, np.float32)
        assert isinstance(x, FakeArray) and x.flags.c_contiguous
        assert x.dtype == np.float32 and x.shape == want_x.shape
        np.testing.assert_array_equal(_get(x), want_x)
        np.testing.assert_array_equal(_get(lengths), want_lengths)
    with pytest.raises(ValueError, match="negative"):
        to_padded_on_device(values, offsets, 0, -1, None)


def test_fake_device_ragged_rows_and_slices(fake_cupy: FakeCupy) -> None:
    r = Ragged.from_rows([[1, 2], [], [3, 4, 5]])
    d = Ragged._trusted(fake_cupy.asarray(r.values), fake_cupy.asarray(r.offsets))
    assert len(d) == 3 and _get(d[2]).tolist() == [3, 4, 5] and _get(d[1]).tolist() == []
    tail = d[1:]
    assert _get(tail.values).tolist() == [3, 4, 5] and _get(tail.offsets).tolist() == [0, 0, 3]
    assert _get(d.lengths).tolist() == [2, 0, 3]


@pytest.mark.anyio
@pytest.mark.parametrize("reuse", [False, True])
async def test_fake_ragged_top_in_two_streams_on_the_device(
    tmp_path: Path, fake_cupy: FakeCupy, reuse: bool
) -> None:
    """A ragged top mixed from two streams reaches the device aligned, each sample once; with
    ``reuse_buffers`` (a batch's blocks recycled at the next hand-off) each batch is right
    when it is yielded."""
    a = write_ragged(tmp_path, [20, 9])
    (tmp_path / "b").mkdir()
    b = write_ragged(tmp_path / "b", [29, 13])[1:]  # global rows 29..41: labels say which
    layer = AsyncHDF5DataLayer(
        {"a": Stream(a), "b": Stream(b)}, tops=("tok", "label"), batch_size=4, shuffle=True,
        chunk_size=8, device="cuda", reuse_buffers=reuse,
    )  # fmt: skip

    def keep(batch: Any) -> np.ndarray:
        tok, label = batch["tok"], _get(batch["label"])
        np.testing.assert_array_equal(_get(tok.offsets)[-1], len(tok.values))
        np.testing.assert_array_equal(_get(tok.values), np.repeat(label, _lengths(label)))
        return label

    async with layer:
        labels = await _epoch(layer, keep)
    check_exactly_once(labels, 42)


# --- on a real GPU (skipped without one) -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.anyio
async def test_ragged_and_dense_tops_on_a_real_gpu(tmp_path: Path, cupy_gpu: Any) -> None:
    await check_ragged(tmp_path, cupy_gpu.ndarray, cupy_gpu.asnumpy, (3,))


@pytest.mark.gpu
@pytest.mark.anyio
async def test_sparse_top_on_a_real_gpu(tmp_path: Path, cupy_gpu: Any) -> None:
    import cupyx.scipy.sparse

    await check_sparse(tmp_path, cupyx.scipy.sparse.csr_matrix, cupy_gpu.asnumpy)


@pytest.mark.gpu
@pytest.mark.anyio
async def test_pad_and_densify_on_a_real_gpu(tmp_path: Path, cupy_gpu: Any) -> None:
    await check_transformed(tmp_path, cupy_gpu.ndarray, cupy_gpu.asnumpy)


def test_fake_adapters_that_take_dense_arrays_name_a_device_sparse_batch(
    fake_cupy: FakeCupy,
) -> None:
    """The Keras and JAX adapters take dense arrays only: a device sparse batch is named with
    its fix (``Densify``), as a host one is."""
    from asynchdf5 import ConfigurationError
    from asynchdf5._ragged import check_dense

    a = fake_cupy.asarray(np.ones(2, np.float32))
    x = FakeCsrMatrix((a, fake_cupy.asarray(np.arange(2)), fake_cupy.asarray([0, 1, 2])), (2, 2))
    with pytest.raises(ConfigurationError, match=r"'X'.*Densify"):
        check_dense("X", x, "asynchdf5.jax.Loader")


@pytest.mark.gpu
@pytest.mark.anyio
async def test_torch_adapter_takes_device_ragged_and_sparse_batches(
    tmp_path: Path, cupy_gpu: Any, torch_cuda: Any
) -> None:
    """The torch adapter's forms (padded + lengths, nested, sparse CSR) from device batches:
    CUDA tensors with the host adapter's values."""
    torch = torch_cuda
    from asynchdf5.torch._dataset import as_torch

    paths = write_ragged(tmp_path, [N])
    csr = write_csr(tmp_path / "m.h5")
    kw: dict[str, Any] = dict(batch_size=8, shuffle=True, seed=5)
    async with AsyncHDF5DataLayer(paths, tops=("tok",), **kw) as host_layer:
        host = await _epoch(host_layer, lambda b: as_torch(b["tok"]))
    async with AsyncHDF5DataLayer(paths, tops=("tok",), device="cuda", **kw) as layer:
        dev = await _epoch(layer, lambda b: (as_torch(b["tok"]), as_torch(b["tok"], "nested")))
    for (h_pad, h_len), ((d_pad, d_len), nested) in zip(host, dev, strict=True):
        assert d_pad.is_cuda and nested.is_cuda
        assert torch.equal(d_pad.cpu(), h_pad) and torch.equal(d_len.cpu(), h_len)
    async with AsyncHDF5DataLayer(csr, tops=("X", "dense"), device="cuda", **kw) as layer:
        for x, dense in await _epoch(layer, lambda b: (as_torch(b["X"]), b["dense"].get())):
            assert x.is_cuda and x.layout == torch.sparse_csr
            np.testing.assert_array_equal(x.to_dense().cpu().numpy(), dense)
