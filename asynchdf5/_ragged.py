"""The public :class:`Ragged`: a batch of variable-length rows, and the sparse batches' maker.

A ragged top's batch is one :class:`Ragged`: the rows' values concatenated in batch order and
the offsets that cut them apart (the CSR convention: row ``i`` is
``values[offsets[i]:offsets[i + 1]]``). It holds no Python object per row, so a batch of
thousands of short rows costs two arrays, and padding it (:meth:`Ragged.to_padded`,
:func:`padded_rows`) costs a few NumPy calls whatever the rows: one copy of the output's bytes
and one mask over them, no Python step per row. (The layer's padded gather writes into an
array it was given, from values that may lie in chunks: :func:`pad_rows`.) A sparse-matrix
top's batch is a :class:`scipy.sparse.csr_array` made by :func:`csr_batch` from the same three
arrays.
"""

from __future__ import annotations

import functools
import importlib
import math
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from ._blocks import (
    RELEASE_ITEMS,
    ScatteredValues,
    copy_all,
    copy_runs,
    row_bytes,
    value_windows,
)
from ._errors import ConfigurationError

__all__ = [
    "CSR_KINDS",
    "Ragged",
    "check_dense",
    "csr_batch",
    "pad_rows",
    "padded_rows",
    "sparse_module",
]


#: From this many rows on, :func:`pad_rows` pads the rows of an array as :func:`padded_rows`
#: does (a few dozen NumPy calls, whatever the rows); fewer rows cost less as one
#: ``np.concatenate`` of two views per row.
_WINDOW_ROWS = 32


def pad_rows(
    values: np.ndarray | ScatteredValues,
    starts: np.ndarray,
    cut: np.ndarray,
    out: np.ndarray,
    pad: Any,
    exact: bool = False,
) -> None:
    """Write ``values[starts[i] : starts[i] + cut[i]]`` and then ``pad`` up to its end into
    each row ``out[i]`` (``out``: ``(rows, length, *trailing)``, ``cut[i] <= length``),
    whatever ``out`` held before. ``starts`` and ``cut`` are int64; the kernel of the layer's
    padded gather (into the batch's array, from a chunk's heap). ``exact``: read no value but
    the rows' (a mapped file's: its pages outside the rows were not made ready, and a read
    there could fault on an I/O error where making them ready raises a named error).

    Where ``out`` has the values' dtype (and is C-contiguous), many rows of an array go as
    :func:`padded_rows` makes them, a block of rows at a time (each row copied ``size``
    values long, what follows its cut masked: no Python step per row; the values after a row
    are read too, so not where ``exact``), fewer as one ``np.concatenate`` into ``out`` of
    each row's values and padding (views: one C loop copies them all). Values that are no one
    array (a mapped heap in chunks: :class:`~._blocks.ScatteredValues`), and many rows where
    ``exact``, go as runs of values and runs of padding (:func:`~._blocks.copy_runs`). Else a
    slice of values (cast to ``out``'s dtype) and one of padding per row."""
    n, size = out.shape[0], out.shape[1]
    if out.dtype != values.dtype or not out.flags.c_contiguous or values.dtype.hasobject:
        for row, a, k in zip(out, starts.tolist(), cut.tolist(), strict=True):
            row[:k] = values[a : a + k]
            if k < size:
                row[k:] = pad
        return
    many = isinstance(values, np.ndarray) and n >= _WINDOW_ROWS
    if many and not exact:
        assert isinstance(values, np.ndarray)
        _pad_windows(values, starts, cut, out, np.full((), pad, out.dtype))
        return
    flat = out.reshape(n * size, *out.shape[2:])
    fill = np.full((size, *out.shape[2:]), pad, out.dtype)  # the padding's source
    if many or not isinstance(values, np.ndarray):
        at = np.arange(n, dtype=np.int64) * size
        copy_all([values], [flat], starts, at, cut)
        copy_runs([fill], [flat], np.zeros(n, np.int64), at + cut, size - cut)
        return
    parts = []
    for a, k in zip(starts.tolist(), cut.tolist(), strict=True):
        parts.append(values[a : a + k])
        parts.append(fill[k:])
    if parts:
        np.concatenate(parts, axis=0, out=flat)


def _pad_windows(
    values: np.ndarray, starts: np.ndarray, cut: np.ndarray, out: np.ndarray, fill: np.ndarray
) -> None:
    """:func:`pad_rows` of many rows of an array into ``out`` (C-contiguous, the values'
    dtype), by blocks of rows (:func:`_block_rows`: each copied, then masked, while it is in
    the cache)."""
    n, size = out.shape[0], out.shape[1]
    rb = row_bytes(values)
    if size == 0 or rb == 0:
        return
    values = np.ascontiguousarray(values)
    step = _block_rows(n, size * rb)
    for a in range(0, n, step):
        dest = out[a : a + step]
        rows = _windows_at(values, starts[a : a + step], size, rb)
        dest[...] = rows.view(values.dtype).reshape(dest.shape)
        c = cut[a : a + step]
        if int(c.min()) < size:
            _fill_past(dest, c, fill)


#: The most bytes of a mask (or of rows, in :func:`pad_rows`) gathered at a time: a temporary
#: that stays in the cache and under the C allocator's threshold for mapping fresh pages
#: (glibc's starts at 128 KiB): a larger one can be mapped and unmapped at every batch, and a
#: fresh page costs more to fault in than its bytes take to copy.
_MASK_BYTES = 124 * 2**10


def padded_rows(
    values: np.ndarray, starts: np.ndarray, cut: np.ndarray, size: int, fill: np.ndarray
) -> np.ndarray:
    """A new array ``(rows, size, *trailing)`` of ``fill``'s dtype whose row ``i`` holds
    ``values[starts[i] : starts[i] + cut[i]]`` and then ``fill`` (a 0-d array), with no
    Python step per row: one copy of the output's bytes and one pass of a mask over them.

    Each row is first copied whole, ``size`` values from its start (one index over a view of
    ``values`` whose items are the ``size`` values from every value on: the values past the
    row's end come along); the places past each row's cut are then set to ``fill``
    (:func:`_fill_past`). ``values`` holds no Python objects, ``starts`` lie within it (int64)
    and ``cut[i] <= size``. Where the dtype changes, the values past the cuts are zeroed
    before the cast (they may be anything: a NaN cast to an integer warns)."""
    n = len(starts)
    trailing = values.shape[1:]
    shape = (n, size, *trailing)
    rb = row_bytes(values)
    if n == 0 or size == 0 or rb == 0:
        return np.full(shape, fill, fill.dtype)
    values = np.ascontiguousarray(values)
    rows = _windows_at(values, starts, size, rb).view(values.dtype).reshape(shape)
    padded = int(cut.min()) < size
    if rows.dtype == fill.dtype:
        if padded:
            _fill_past(rows, cut, fill)
        return rows
    if padded:
        _fill_past(rows, cut, np.zeros((), rows.dtype))
    out = rows.astype(fill.dtype)
    if padded:
        _fill_past(out, cut, fill)
    return out


def _block_rows(rows: int, row_nbytes: int) -> int:
    """How many of ``rows`` rows of ``row_nbytes`` to copy and mask at a time: what
    :data:`_MASK_BYTES` holds, and never fewer than :data:`~._blocks.RELEASE_ITEMS` where
    there are that many (NumPy lets go of the GIL during an index of more than 500 items: a
    padded gather of thousands of rows runs beside the thread that hands batches out)."""
    step = max(1, _MASK_BYTES // max(1, row_nbytes))
    return max(step, RELEASE_ITEMS) if rows >= RELEASE_ITEMS else step


def _fill_past(out: np.ndarray, cut: np.ndarray, fill: np.ndarray) -> None:
    """Set ``out[i, cut[i]:]`` to ``fill`` (0-d, ``out``'s dtype) for every row ``i`` of
    ``out`` (``(rows, size, *trailing)``, C-contiguous), by the masks of a block of rows
    (:func:`_block_rows`) at a time, each gathered as the rows are (row ``i``'s is the
    ``size`` places from ``size - cut[i]`` of ``size`` ones then ``size`` zeros:
    :func:`_keep_windows`). Values of 1, 2, 4 or 8 bytes are masked as bits: an AND with the
    mask (the places past the cut become zeros), between two XORs with ``fill``'s bits where
    those are not all zero (so that they become ``fill``: ``((x ^ f) & m) ^ f`` is ``x``
    where ``m`` is all ones, else ``f``). Others are set by a masked copy."""
    n, size, trailing = out.shape[0], out.shape[1], out.shape[2:]
    step = _block_rows(n, size * out.itemsize * math.prod(trailing))
    width = out.dtype.itemsize
    if width in (1, 2, 4, 8) and out.dtype.fields is None:
        bits = out.view(f"u{width}")
        keeps = _keep_windows(size, bits.dtype, trailing)
        f = fill.view(bits.dtype)
        xor = bool(f != 0)
        for a in range(0, n, step):
            b = bits[a : a + step]
            if xor:
                np.bitwise_xor(b, f, out=b)
            np.bitwise_and(b, keeps[size - cut[a : a + step]].view(b.dtype).reshape(b.shape), out=b)
            if xor:
                np.bitwise_xor(b, f, out=b)
        return
    gone = np.zeros(2 * size, bool)
    gone[size:] = True  # the places past a row's cut
    masks = value_windows(gone, size, 1)
    for a in range(0, n, step):
        m = masks[size - cut[a : a + step]].view(bool).reshape(-1, size, *[1] * len(trailing))
        np.copyto(out[a : a + step], fill, where=m)


#: The most bytes of mask :func:`_keep_windows` keeps for the next batches.
_KEPT_MASK_BYTES = 2**20


def _keep_windows(size: int, bits: np.dtype[Any], trailing: tuple[int, ...]) -> np.ndarray:
    """The windows (:func:`~._blocks.value_windows`: item ``j`` is the ``size`` values from ``j``)
    over ``size`` values of all ones then ``size`` zeros, in unsigned ``bits`` of ``trailing``
    shape: row ``i``'s mask of the places kept is item ``size - cut[i]``. Small ones are kept
    for the next batches (a ``Pad`` pads every batch to one length), read only."""
    if 2 * size * bits.itemsize * math.prod(trailing) <= _KEPT_MASK_BYTES:
        return _kept_keep_windows(size, bits, trailing)
    return _make_keep_windows(size, bits, trailing)


def _make_keep_windows(size: int, bits: np.dtype[Any], trailing: tuple[int, ...]) -> np.ndarray:
    keep = np.zeros((2 * size, *trailing), bits)
    keep[:size] = ~keep[:size]  # all ones: the places kept
    keep.flags.writeable = False
    return value_windows(keep, size, row_bytes(keep))


_kept_keep_windows = functools.lru_cache(maxsize=8)(_make_keep_windows)


#: Up to this many rows whose ``size`` values pass the end of the values are finished a slice
#: each (a few NumPy calls fewer than copying the end: a batch's last rows, padded to its
#: longest row, usually are one or two).
_END_ROWS = 4


def _windows_at(values: np.ndarray, starts: np.ndarray, size: int, rb: int) -> np.ndarray:
    """The ``size`` values from each of ``starts`` in ``values`` (C-contiguous), as one item
    (bytes) each: where fewer than ``size`` values are left after a start, the ones there,
    then zeros."""
    total = len(values)
    last = total - size  # the last start with size values after it
    if last >= 0 and int(starts.max()) <= last:
        rows: np.ndarray = value_windows(values, size, rb)[starts]
        return rows
    over = np.flatnonzero(starts > last)
    if last >= 0 and len(over) <= _END_ROWS:
        got: np.ndarray = value_windows(values, size, rb)[np.minimum(starts, last)]
        typed = got.view(values.dtype).reshape(len(starts), size, *values.shape[1:])
        for i in over.tolist():
            a = int(starts[i])
            typed[i, : total - a] = values[a:]
            typed[i, total - a :] = 0
        return got
    s0 = int(starts[over].min())
    end = np.zeros((total - s0 + size, *values.shape[1:]), values.dtype)
    end[: total - s0] = values[s0:]
    if last < 0:  # every start
        rows = value_windows(end, size, rb)[starts - s0]
        return rows
    got = value_windows(values, size, rb)[np.minimum(starts, last)]
    got[over] = value_windows(end, size, rb)[starts[over] - s0]
    return got


class Ragged:
    """Rows of varying length, as one array of values and one of offsets.

    Parameters
    ----------
    values : numpy.ndarray
        The rows concatenated in order, shape ``(total, *trailing)``: a row may have a
        trailing shape (atoms x 3 coordinates), the same for every row.
    offsets : numpy.ndarray
        int64, ``len(rows) + 1`` of them, starting at 0, never decreasing, ending at
        ``len(values)``: row ``i`` is ``values[offsets[i]:offsets[i + 1]]``.

    Notes
    -----
    With ``device=``, a ragged top's batch is a ``Ragged`` whose ``values`` and ``offsets``
    are CuPy arrays on the device: ``len``, slicing, :attr:`lengths` and :meth:`to_padded`
    (done on the device) work as on the host; ``r[i]`` reads two offsets back from it.

    Examples
    --------
    >>> import numpy as np
    >>> from asynchdf5 import Ragged
    >>> r = Ragged(np.array([1, 2, 3, 4, 5, 6]), np.array([0, 3, 3, 6]))
    >>> len(r), r[0].tolist(), r[1].tolist(), r.lengths.tolist()
    (3, [1, 2, 3], [], [3, 0, 3])
    >>> x, lengths = r.to_padded(pad=-1)
    >>> x.tolist(), lengths.tolist()
    ([[1, 2, 3], [-1, -1, -1], [4, 5, 6]], [3, 0, 3])
    """

    __slots__ = ("offsets", "values")

    def __init__(self, values: npt.ArrayLike, offsets: npt.ArrayLike) -> None:
        v = np.asarray(values)
        o = np.asarray(offsets)
        if v.ndim == 0:
            raise ValueError("Ragged values must have at least one dimension (the elements)")
        if o.ndim != 1 or len(o) == 0 or o.dtype.kind not in "iu":
            raise ValueError(f"Ragged offsets must be a 1-D integer array of rows + 1, not {o!r}")
        o = o.astype(np.int64, copy=False)
        if o[0] != 0 or o[-1] != len(v) or (len(o) > 1 and bool(np.any(o[1:] < o[:-1]))):
            raise ValueError(
                f"Ragged offsets must start at 0, never decrease and end at len(values)="
                f"{len(v)}; they run {int(o[0])} .. {int(o[-1])}"
            )
        self.values: np.ndarray = v
        self.offsets: np.ndarray = o

    @classmethod
    def _trusted(cls, values: np.ndarray, offsets: np.ndarray) -> Ragged:
        """A Ragged of arrays the layer made itself (the checks above hold by construction)."""
        r = cls.__new__(cls)
        r.values, r.offsets = values, offsets
        return r

    @classmethod
    def from_rows(cls, rows: list[npt.ArrayLike], dtype: npt.DTypeLike | None = None) -> Ragged:
        """A Ragged holding ``rows`` (each an array of the same trailing shape), in order."""
        arrays = [np.asarray(r, dtype) for r in rows]
        offsets = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        if arrays:
            values = np.concatenate(arrays)
        else:
            values = np.empty(0, dtype if dtype is not None else np.float64)
        return cls(values, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int | slice) -> Any:
        """Row ``i`` (a view of :attr:`values`), or the rows of a slice (step 1) as a Ragged
        whose values are a view."""
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise IndexError("a Ragged is sliced with step 1 only")
            stop = max(start, stop)
            o = self.offsets[start : stop + 1]
            return Ragged._trusted(self.values[int(o[0]) : int(o[-1])], o - o[0])
        n = len(self)
        k = int(i)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(f"row {i} of a Ragged of {n} rows")
        return self.values[int(self.offsets[k]) : int(self.offsets[k + 1])]

    @property
    def lengths(self) -> np.ndarray:
        """Each row's length (int64)."""
        lengths: np.ndarray = self.offsets[1:] - self.offsets[:-1]  # NumPy or CuPy alike
        return lengths

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.offsets.nbytes)

    def to_padded(
        self, pad: Any = 0, length: int | None = None, dtype: npt.DTypeLike | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The rows as one dense array ``(rows, length, *trailing)`` and their lengths.

        Parameters
        ----------
        pad
            The value of the positions past a row's end.
        length
            The padded length: None (the longest row's), or a number (longer rows are cut to
            it; the lengths returned are then the cut ones).
        dtype
            The dense array's dtype (default: the values').

        Returns
        -------
        (numpy.ndarray, numpy.ndarray)
            The padded rows and each row's length (int64), in row order: a copy of the
            output's bytes and a mask over them, whatever the rows (:func:`padded_rows`).
        """
        if type(self.values).__module__.startswith("cupy"):  # a device batch (device=)
            from ._ragged_cupy import to_padded_on_device

            return to_padded_on_device(self.values, self.offsets, pad, length, dtype)
        lengths = self.lengths
        n = len(lengths)
        longest = int(lengths.max()) if n else 0
        size = longest if length is None else int(length)
        if size < 0:
            raise ValueError(f"to_padded: length={length} is negative")
        cut = np.minimum(lengths, size) if size < longest else lengths
        fill = np.full((), pad, self.values.dtype if dtype is None else np.dtype(dtype))
        if fill.dtype.hasobject or self.values.dtype.hasobject:  # references: a row at a time
            out = np.empty((n, size, *self.values.shape[1:]), fill.dtype)
            pad_rows(self.values, self.offsets[:-1], cut, out, fill)
            return out, cut
        return padded_rows(self.values, self.offsets[:-1], cut, size, fill), cut

    def __repr__(self) -> str:
        trailing = self.values.shape[1:]
        shape = f", trailing shape {trailing}" if trailing else ""
        return f"Ragged({len(self)} rows, {len(self.values)} values of {self.values.dtype}{shape})"


#: What a user does when scipy cannot be imported (:func:`sparse_module`).
_SCIPY_FIX = (
    "install the 'sparse' extra (pip install \".[sparse]\" in the asynchdf5 checkout), or add "
    "scipy to the environment"
)


def sparse_module(top: str, module: str = "scipy.sparse", fix: str = _SCIPY_FIX) -> ModuleType:
    """``module`` (``scipy.sparse``, the ``sparse`` extra; the device's ``cupyx.scipy.sparse``),
    which sparse-matrix top ``top``'s batches are made of, imported now: the layer calls it at
    open (blocking: a first import takes a fraction of a second), so that no batch waits for the
    import and a missing or broken one is a :class:`~asynchdf5.ConfigurationError` naming the
    top before any batch, saying what to do (``fix``)."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken install failing in its own way
        raise ConfigurationError(
            f"top {top!r} is a sparse matrix (a CSR group), whose batches are {module} "
            f"matrices, and {module} cannot be imported ({type(exc).__name__}: {exc}): {fix}"
        ) from exc


def csr_batch(
    values: np.ndarray,
    indices: np.ndarray,
    offsets: np.ndarray,
    n_cols: int,
    kind: str = "csr_array",
) -> Any:
    """A :class:`scipy.sparse.csr_array` (or the scipy CSR class ``kind`` names: a batch that
    crossed from ``process=True``'s helper is rebuilt as the class it was) of
    ``len(offsets) - 1`` rows and ``n_cols`` columns over the given arrays, not copies of them,
    where ``indices`` and ``offsets`` share one integer dtype that holds ``n_cols`` (scipy
    converts both to a common one otherwise). scipy was imported at open
    (:func:`sparse_module`).

    The arrays are the layer's own, CSR by construction (1-D, as many values as indices,
    offsets from 0 to their end, never decreasing): where they are int32 (AnnData's indices)
    and scipy's constructor is one whose matrices this module knows (:func:`_csr_kind`), the
    matrix is made as the constructor would make it, without its checks, which cost more than
    gathering a batch's bytes; else by the constructor."""
    cls, fixed = _csr_kind(kind)
    shape = (len(offsets) - 1, n_cols)
    data, index = _own_base(values), _own_base(indices)
    if fixed is None or index.dtype != np.int32 or offsets.dtype != np.int32 or data.ndim != 1:
        return cls((data, index, offsets), shape=shape, copy=False)
    m = cls.__new__(cls)
    m.__dict__.update(fixed, _shape=shape, data=data, indices=index, indptr=offsets)
    return m


#: The attributes scipy's ``csr_array`` constructor sets on a matrix of (values, indices,
#: offsets), in the versions :func:`csr_batch` makes matrices for itself.
_CSR_ATTRIBUTES = frozenset({"_shape", "maxprint", "data", "indices", "indptr"})


#: The scipy classes a CSR batch may be (:func:`csr_batch`'s ``kind``).
CSR_KINDS = ("csr_array", "csr_matrix")


@functools.cache
def _csr_kind(kind: str = "csr_array") -> tuple[Any, dict[str, Any] | None]:
    """``scipy.sparse.csr_array`` (or ``kind``, one of :data:`CSR_KINDS`), and the attributes
    that its constructor gives every matrix alike (those not of the arrays or the shape), where
    a matrix it makes of int32 arrays holds exactly :data:`_CSR_ATTRIBUTES` and keeps the
    arrays given; None where it holds other ones (another scipy): :func:`csr_batch` then calls
    the constructor."""
    import scipy.sparse

    if kind not in CSR_KINDS:
        raise ValueError(f"not a CSR class of scipy.sparse: {kind!r}")
    cls = getattr(scipy.sparse, kind)
    arrays = (np.ones(2, np.float32), np.array([0, 1], np.int32), np.array([0, 1, 2], np.int32))
    probe = cls(arrays, shape=(2, 2), copy=False)
    own = vars(probe)
    kept = all(
        isinstance(b := own[k], np.ndarray) and _same(a, b)
        for k, a in zip(("data", "indices", "indptr"), arrays, strict=True)
    )
    if set(own) != _CSR_ATTRIBUTES or not kept or probe.shape != (2, 2):
        return cls, None
    return cls, {k: v for k, v in own.items() if k not in ("_shape", "data", "indices", "indptr")}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``b`` is ``a`` or a view of all of it, as it is (its memory, dtype and shape)."""
    address = a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    return address and a.dtype == b.dtype and a.shape == b.shape and a.strides == b.strides


def _own_base(a: np.ndarray) -> np.ndarray:
    """``a``'s memory as an array whose ``base`` is ``a``'s size. Every scipy CSR constructor
    runs ``prune``, which copies ``data`` and ``indices`` that are views of an array more than
    twice their size (whatever ``copy=False`` says: scipy/scipy#6902), as a batch cut from a
    group's heap is. A view through a memoryview (``a.data``) keeps the memory (and, through the
    memoryview, the heap it belongs to) and stops NumPy's collapse of ``base`` there. A
    strided ``a`` (no one buffer) is returned as it is."""
    if not a.flags.c_contiguous:
        return a
    return np.frombuffer(a.data, a.dtype).reshape(a.shape)


def check_dense(name: str, value: Any, consumer: str) -> None:
    """Raise :class:`~asynchdf5.ConfigurationError` if top ``name``'s batch ``value`` is a
    :class:`Ragged` or a ``scipy.sparse`` matrix, which ``consumer`` (an adapter that takes
    only dense arrays) would otherwise pass on unchanged or fail on with no word of the top.
    The error names the transformer that makes it dense."""
    if isinstance(value, Ragged):
        fix, kind = "transforms.Pad(0, length=...)", "rows of varying length (asynchdf5.Ragged)"
    elif type(value).__module__.startswith(("scipy.sparse", "cupyx.scipy.sparse")):
        fix, kind = "transforms.Densify()", f"a sparse matrix ({type(value).__name__})"
    else:
        return
    raise ConfigurationError(
        f"top {name!r} has {kind}, which {consumer} takes only as dense arrays: add a "
        f"transformer that makes it dense, transformers=[({name!r}, {fix})]"
    )
