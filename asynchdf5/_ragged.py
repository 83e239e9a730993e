"""The public :class:`Ragged`: a batch of variable-length rows, and the sparse batches' maker.

A ragged top's batch is one :class:`Ragged`: the rows' values concatenated in batch order and
the offsets that cut them apart (the CSR convention: row ``i`` is
``values[offsets[i]:offsets[i + 1]]``). It holds no Python object per row, so a batch of
thousands of short rows costs two arrays, and padding it (:meth:`Ragged.to_padded`) writes
each output byte once for long rows (:func:`pad_rows`, also the kernel of the layer's padded
gather) or is one mask over short ones. A sparse-matrix
top's batch is a :class:`scipy.sparse.csr_array` made by :func:`csr_batch` from the same three
arrays.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from ._blocks import ScatteredValues, copy_from, copy_runs
from ._errors import ConfigurationError

__all__ = ["Ragged", "check_dense", "csr_batch", "pad_rows", "sparse_module"]


#: Rows of at least this many values on average are padded a run per row (each byte of the
#: output written once); shorter ones with one mask over all places.
_ROW_VALUES = 32
#: From this many rows on, :func:`pad_rows` copies the rows and their padding as runs, in
#: blocks (:func:`~._blocks.copy_runs`: a few dozen NumPy calls, whatever the rows); fewer rows
#: cost less as one ``np.concatenate`` of two views per row.
_RUNS_ROWS = 1024


def pad_rows(
    values: np.ndarray | ScatteredValues,
    starts: np.ndarray,
    cut: np.ndarray,
    out: np.ndarray,
    pad: Any,
) -> None:
    """Write ``values[starts[i] : starts[i] + cut[i]]`` and then ``pad`` up to its end into
    each row ``out[i]`` (``out``: ``(rows, length, *trailing)``, ``cut[i] <= length``): each
    byte of ``out`` written once, whatever it held before. ``starts`` and ``cut`` are int64.

    Where ``out`` has the values' dtype (and is C-contiguous), many rows go as runs of values
    and runs of padding (:func:`~._blocks.copy_runs`), fewer as one ``np.concatenate`` into
    ``out`` of each row's values and padding (views: one C loop copies them all). Else a slice
    of values (cast to ``out``'s dtype) and one of padding per row. Values that are no one
    array (a mapped heap in chunks: :class:`~._blocks.ScatteredValues`) always go as runs."""
    n, size = out.shape[0], out.shape[1]
    if out.dtype != values.dtype or not out.flags.c_contiguous:
        for row, a, k in zip(out, starts.tolist(), cut.tolist(), strict=True):
            row[:k] = values[a : a + k]
            if k < size:
                row[k:] = pad
        return
    flat = out.reshape(n * size, *out.shape[2:])
    fill = np.full((size, *out.shape[2:]), pad, out.dtype)  # the padding's source
    if n >= _RUNS_ROWS or not isinstance(values, np.ndarray):
        at = np.arange(n, dtype=np.int64) * size
        copy_from(values, flat, starts, at, cut)
        copy_runs([fill], [flat], np.zeros(n, np.int64), at + cut, size - cut)
        return
    parts = []
    for a, k in zip(starts.tolist(), cut.tolist(), strict=True):
        parts.append(values[a : a + k])
        parts.append(fill[k:])
    if parts:
        np.concatenate(parts, axis=0, out=flat)


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
            The padded rows and each row's length (int64), in row order. Each byte of the
            output is written once for rows of 32 values or more on average (a run of values
            and one of padding per row); shorter rows are filled, then masked in, vectorised.
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
        shape = (n, size, *self.values.shape[1:])
        out_dtype = self.values.dtype if dtype is None else np.dtype(dtype)
        if n and len(self.values) >= _ROW_VALUES * n:
            # Long rows: a run of values and one of padding per row, each byte of the output
            # written once (a Python step per row costs what ~_ROW_VALUES values do).
            out = np.empty(shape, out_dtype)
            pad_rows(self.values, self.offsets[:-1], cut, out, pad)
            return out, cut
        # Short rows: the padding, then the values kept (those whose place within their row is
        # below ``size``) put where a mask of the rows' places says, in one vectorised pass.
        out = np.full(shape, pad, dtype=out_dtype)
        mask = np.arange(size) < cut[:, None]
        if size >= longest:
            out[mask] = self.values
            return out, cut
        place = np.arange(len(self.values)) - np.repeat(self.offsets[:-1], lengths)
        out[mask] = self.values[place < size]
        return out, cut

    def __repr__(self) -> str:
        trailing = self.values.shape[1:]
        shape = f", trailing shape {trailing}" if trailing else ""
        return f"Ragged({len(self)} rows, {len(self.values)} values of {self.values.dtype}{shape})"


def sparse_module(top: str) -> ModuleType:
    """``scipy.sparse`` (the ``sparse`` extra), which sparse-matrix top ``top``'s batches are
    made of, imported now: the layer calls it at open (blocking: its first import takes a
    fraction of a second), so that no batch waits for the import and a missing or broken scipy
    is a :class:`~asynchdf5.ConfigurationError` naming the top before any batch."""
    try:
        return importlib.import_module("scipy.sparse")
    except Exception as exc:  # ImportError, or a broken install failing in its own way
        raise ConfigurationError(
            f"top {top!r} is a sparse matrix (a CSR group), whose batches are scipy.sparse "
            f"arrays, and scipy cannot be imported ({type(exc).__name__}: {exc}): install the "
            "'sparse' extra (pip install \".[sparse]\" in the asynchdf5 checkout), or add "
            "scipy to the environment"
        ) from exc


def csr_batch(values: np.ndarray, indices: np.ndarray, offsets: np.ndarray, n_cols: int) -> Any:
    """A :class:`scipy.sparse.csr_array` of ``len(offsets) - 1`` rows and ``n_cols`` columns
    over the given arrays, not copies of them, where ``indices`` and ``offsets`` share one
    integer dtype that holds ``n_cols`` (scipy converts both to a common one otherwise). scipy
    was imported at open (:func:`sparse_module`).

    The arrays are the layer's own, CSR by construction (1-D, as many values as indices,
    offsets from 0 to their end, never decreasing): where they are int32 (AnnData's indices)
    and scipy's constructor is one whose matrices this module knows (:func:`_csr_kind`), the
    matrix is made as the constructor would make it, without its checks, which cost more than
    gathering a batch's bytes; else by the constructor."""
    cls, fixed = _csr_kind()
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


@functools.cache
def _csr_kind() -> tuple[Any, dict[str, Any] | None]:
    """``scipy.sparse.csr_array``, and the attributes that its constructor gives every matrix
    alike (those not of the arrays or the shape), where a matrix it makes of int32 arrays holds
    exactly :data:`_CSR_ATTRIBUTES` and keeps the arrays given; None where it holds other ones
    (another scipy): :func:`csr_batch` then calls the constructor."""
    import scipy.sparse

    cls = scipy.sparse.csr_array
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
