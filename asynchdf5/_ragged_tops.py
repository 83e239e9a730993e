"""Ragged and sparse tops: how a file stores rows of varying length, checked at open.

Three stored forms are tops whose rows vary in length (:func:`find_form`):

- a **ragged group**: a group with ``data`` and ``indptr`` (the CSR convention of scipy and
  AnnData, without ``indices``): row ``i`` is ``data[indptr[i]:indptr[i + 1]]``; ``data`` may
  have a trailing shape (atoms x 3);
- a **sparse-matrix group**: the same with ``indices`` (one column per value) and a ``shape``
  attribute (AnnData's ``encoding-type: csr_matrix``, h5sparse's ``h5sparse_shape``); its
  batches are :class:`scipy.sparse.csr_array` of ``shape[1]`` columns;
- an **h5py variable-length numeric dataset** (``h5py.vlen_dtype(np.int32)``): the same rows,
  whose values HDF5 keeps in a heap only h5py can read.

Whatever the form, the catalog keeps each file's ``indptr`` in memory (read at open, as stored
when int32 or int64: 4 or 8 bytes a row), so that a chunk's rows are one contiguous range of
``data`` (and ``indices``) found without a read, and read in one piece by the fast paths as any
dataset's rows are. Anything else about such a group (a member missing, ``indptr`` decreasing
or not ending at ``len(data)``, a CSC matrix, a string heap) is a :class:`SchemaError` at open,
never a batch.

Inside the pipeline a ragged top is two things per cache slot (:func:`heap_keys`): its *spans*
(an int64 ``(rows, 2)`` array: where each row's values start and stop in the slot's heap; in
place, a view of the file's ``indptr``, taken in int64 by the gather) and its *heaps* (the
values, and a sparse top's column indices, one contiguous array each).
"""

from __future__ import annotations

import functools
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import h5py
import numpy as np

from ._errors import ReadError, SchemaError
from ._layout import Layout

__all__ = [
    "CSR_MEMBERS",
    "HEAP",
    "INDICES",
    "RaggedForm",
    "RaggedInfo",
    "RaggedParts",
    "RowLengths",
    "find_form",
    "group_top",
    "group_top_words",
    "heap_keys",
    "is_heap",
    "kind_words",
    "member_of_csr",
]

#: The members of a stored CSR group (scipy, AnnData, h5sparse).
CSR_MEMBERS = ("data", "indices", "indptr")

#: Marks the internal names of a ragged top's heaps among a slot's arrays: a top's name never
#: holds it (HDF5 names are text).
HEAP = "\0values"
INDICES = "\0indices"

Kind = Literal["ragged", "sparse"]

#: Rows of ``indptr`` checked or measured at a time: no array of a row's size is made at open
#: besides ``indptr`` itself.
_BLOCK_ROWS = 1 << 20
#: Blocks of starts whose stretches are bounded at a time (:meth:`RowLengths.most_in_stretch`).
_PIECE = 1 << 16


def heap_keys(top: str, sparse: bool) -> tuple[str, ...]:
    """The internal names of ``top``'s heaps: its values, and a sparse top's column indices."""
    return (top + HEAP, top + INDICES) if sparse else (top + HEAP,)


def kind_words(kind: str | None, n_cols: int = 0) -> str:
    """How a top is stored, in words, for messages: ``kind`` None is a dataset of fixed rows."""
    if kind is None:
        return "a dataset of fixed rows"
    return kind + (f" of {n_cols} columns" if kind == "sparse" else "")


def is_heap(name: str) -> bool:
    """Whether ``name`` is a heap's internal name (not a top's)."""
    return "\0" in name


class RowLengths:
    """The lengths of a ragged top's rows over every file, summarised for sizing the cache:
    each question is answered without a pass over the rows, however many times it is asked
    (the cache sizing's search asks ~20 times at open).

    Built once per layer from each file's ``indptr`` in global order (a file without the top,
    another stream's, ``None``: its rows hold no values). It keeps those ``indptr`` arrays,
    which the catalog holds anyway (no copy), and a histogram of the lengths (one entry per
    distinct length): no array of a row's size of its own.

    - :meth:`longest`: the values the ``k`` longest rows hold (O(log distinct lengths));
    - :meth:`file_base`: the values the files before a file hold;
    - :meth:`before`: the values before global rows (the prefix sums in global order, read off
      the files' ``indptr``);
    - :meth:`most_in_stretch`: the most values ``k`` contiguous rows hold on the ring of all
      rows (a shuffled epoch's rotation wraps), found by bounding blocks of starts and
      halving only the blocks that may still hold it.
    """

    def __init__(self, files: Sequence[tuple[int, np.ndarray | None]] = ()) -> None:
        self._indptr = [ip for _, ip in files]
        nrows = np.array([n for n, _ in files], np.int64)
        self._starts = np.zeros(len(files) + 1, np.int64)
        np.cumsum(nrows, out=self._starts[1:])
        held = [0 if ip is None else int(ip[-1]) for ip in self._indptr]
        self._bases = np.zeros(len(files) + 1, np.int64)
        np.cumsum(held, out=self._bases[1:])
        #: Rows over all files (those without the top count, holding nothing).
        self.n = int(self._starts[-1])
        #: Each file's first global row (and, last, ``n``).
        self.starts = self._starts
        #: Values over all rows.
        self.total = int(self._bases[-1])
        # The one file that holds every row: its indptr answers `before` as is.
        self._one = self._indptr[0] if len(files) == 1 else None
        held_by = [ip for ip in self._indptr if ip is not None]
        #: Rows of the files that hold the top (the ones the longest rows are drawn from).
        self.n_held = sum(len(ip) - 1 for ip in held_by)
        sizes, counts = _histogram(held_by, self.n_held)
        #: The rows' lengths' standard deviation (of the files that hold the top), from the
        #: histogram: np.std's answer but for its rounding (its sum of squares is another).
        self.spread = 0.0
        if self.n_held:
            deviations = (sizes - self.total / self.n_held) ** 2
            self.spread = float(np.sqrt(np.dot(deviations, counts) / self.n_held))
        # Longest first: each distinct length, and the rows and values down to it.
        self._sizes, self._counts, self._held = sizes, np.cumsum(counts), np.cumsum(sizes * counts)

    def file_base(self, file: int) -> int:
        """Values the files before file ``file`` (in global order) hold: where its values start
        among all of them."""
        return int(self._bases[file])

    def longest(self, k: int) -> int:
        """Values the ``k`` longest rows hold together (all rows: ``k`` past their number)."""
        k = min(k, self.n_held)
        if k <= 0:
            return 0
        g = int(np.searchsorted(self._counts, k))  # the first length group reaching k rows
        before = int(self._counts[g - 1]) if g else 0
        held = int(self._held[g - 1]) if g else 0
        return held + (k - before) * int(self._sizes[g])

    def before(self, rows: np.ndarray) -> np.ndarray:
        """Values before each of the global ``rows`` (``0 <= rows <= n``), int64."""
        rows = np.asarray(rows, np.int64)
        if not self._indptr:
            return np.zeros(rows.shape, np.int64)
        if self._one is not None:
            return np.asarray(self._one[rows], np.int64)
        f = np.clip(np.searchsorted(self._starts, rows, side="right") - 1, 0, len(self._indptr) - 1)
        out = self._bases[f]  # a new array; a file without the top: its base throughout
        order = np.argsort(f, kind="stable")
        ordered = f[order]
        cuts = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
        for group in np.split(order, cuts) if len(order) else ():
            ip = self._indptr[int(f[group[0]])]
            if ip is not None:
                file = int(f[group[0]])
                out[group] += ip[rows[group] - self._starts[file]]
        return out

    def _on_ring(self, rows: np.ndarray) -> np.ndarray:
        """:meth:`before` on the ring: rows ``n..2n`` are the first ones again, after all."""
        wrap = rows > self.n
        out = self.before(np.where(wrap, rows - self.n, rows))
        out[wrap] += self.total
        return out

    def most_in_stretch(self, k: int, above: int = -1, enough: int | None = None) -> int:
        """The most values ``k`` contiguous rows hold (``0 < k < n``) on the ring.

        Exact where it matters to a caller that takes ``min(enough, max(result, above))``:
        a stretch that holds no more than ``above`` is not looked for, and the search stops at
        one that holds ``enough``. Starts are taken in blocks: the rows from a block's first
        start to its last start's end bound every stretch that starts in it (lengths are never
        negative), so a block whose bound is no more than the best stretch found (or
        ``above``) is dropped, and the others halved, each half's first stretch counted."""
        n = self.n
        size = 1 << min(12, max(0, (k // 16).bit_length() - 1))  # blocks of <= k/16 starts
        best, kept = -1, []
        # Every block's first stretch and bound, a piece of blocks at a time (no array of so
        # many blocks at once); a block is dropped against the best found so far, which only
        # grows: what it is dropped against is never more than the final best.
        for first in range(0, n, size * _PIECE):
            starts = np.arange(first, min(n, first + size * _PIECE), size, dtype=np.int64)
            at = self._on_ring(starts)
            best = max(best, int(np.max(self._on_ring(starts + k) - at)))
            if size == 1:
                continue
            if enough is not None and best >= enough:
                return best
            bound = self._on_ring(np.minimum(starts + size, n) - 1 + k) - at
            kept.append(starts[bound > max(best, above)])
        starts = np.concatenate(kept) if kept else np.zeros(0, np.int64)
        while size > 1 and len(starts):
            size //= 2
            halves = starts + size
            halves = halves[halves < n]
            if len(halves):
                best = max(best, int(np.max(self._on_ring(halves + k) - self._on_ring(halves))))
            both = np.empty(len(starts) + len(halves), np.int64)  # in order, interleaved
            both[0::2], both[1::2] = starts, halves
            starts = both
            if size == 1 or (enough is not None and best >= enough):
                break
            bound = self._on_ring(np.minimum(starts + size, n) - 1 + k) - self._on_ring(starts)
            starts = starts[bound > max(best, above)]
        return best


def _histogram(indptrs: Sequence[np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows' distinct lengths, longest first, and how many rows have each: one pass over
    ``indptrs`` in blocks of :data:`_BLOCK_ROWS` rows. Lengths up to about ``n`` (and no more
    than :data:`_BLOCK_ROWS`: no array of a row's size) are counted in a histogram (no sort);
    the few longer ones (fewer than the values over that limit) are sorted."""
    limit = min(2 * n + 2**16, _BLOCK_ROWS)
    counts = np.zeros(0, np.int64)
    beyond = []
    buf = np.empty(min(n, _BLOCK_ROWS), np.int64)
    for ip in indptrs:
        for a in range(0, len(ip) - 1, _BLOCK_ROWS):
            b = min(len(ip) - 1, a + _BLOCK_ROWS)
            x = np.subtract(ip[a + 1 : b + 1], ip[a:b], out=buf[: b - a])
            if int(x.max()) > limit:
                beyond.append(x[x > limit])
                x = x[x <= limit]
            block = np.bincount(x)
            if len(block) > len(counts):
                counts = np.r_[counts, np.zeros(len(block) - len(counts), np.int64)]
            counts[: len(block)] += block
    sizes = np.flatnonzero(counts)[::-1].astype(np.int64)
    counts = counts[sizes]
    if beyond:
        long, many = np.unique(np.concatenate(beyond), return_counts=True)
        sizes = np.r_[long[::-1].astype(np.int64), sizes]
        counts = np.r_[many[::-1].astype(np.int64), counts]
    return sizes, counts


@dataclass(frozen=True, eq=False)
class RaggedInfo:
    """What every file of a ragged top shares: its kind, a sparse top's columns and index
    dtype, and (over all files, set by the catalog) its rows' lengths (:class:`RowLengths`):
    what a batch's values (:meth:`heap_rows`) and a cache slot's heap (:meth:`slot_values`)
    are bounded by, and what a chunk of rows holds (:meth:`chunk_values`).
    """

    kind: Kind
    n_cols: int = 0
    index_dtype: np.dtype[Any] | None = None
    vlen: bool = False
    lengths: RowLengths = field(default_factory=RowLengths)
    #: The files' names in global order (set by the catalog with ``lengths``): where a row is.
    files: tuple[str, ...] = ()
    #: :meth:`slot_values` asked before, by rows (the cache sizing asks the same ones again).
    _slots: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    @property
    def sparse(self) -> bool:
        return self.kind == "sparse"

    @functools.cached_property
    def batch_index_dtype(self) -> np.dtype[Any]:
        """A sparse top's batches' ``indices`` and ``indptr`` dtype, the one scipy keeps as is:
        int32 where the stored indices fit int32 (AnnData's are int32) and so do the columns and
        every non-zero of the top (:attr:`RowLengths.total`), else int64. scipy upcasts both
        arrays to a common dtype; int32 offsets over int32 indices make it copy neither."""
        limit = np.iinfo(np.int32).max
        if (
            self.index_dtype is not None
            and np.can_cast(self.index_dtype, np.int32)
            and self.n_cols <= limit
            and self.lengths.total <= limit
        ):
            return np.dtype(np.int32)
        return np.dtype(np.int64)

    def for_batches(self, rows: int) -> RaggedInfo:
        """What a ``process=True`` layer's own process keeps of this top, sent by its helper
        process (which holds the files' ``indptr``), in a few bytes: the kind, the columns and
        index dtypes (:attr:`batch_index_dtype` as here), and lengths of one row holding the
        values ``rows`` rows hold at most, so that :meth:`heap_rows` answers, for any batch of
        up to ``rows`` rows, the bound a device's staging is sized by. Nothing else of its
        lengths is known there (nothing else is asked there)."""
        bound = self.heap_rows(rows)
        one = RowLengths([(1, np.array([0, bound], np.int64))])
        info = RaggedInfo(self.kind, self.n_cols, self.index_dtype, self.vlen, one)
        vars(info)["batch_index_dtype"] = self.batch_index_dtype  # the whole top's, not one row's
        return info

    def heap_rows(self, rows: int) -> int:
        """Values ``rows`` rows hold at most, whichever they are (the ``rows`` longest)."""
        return self.lengths.longest(rows)

    def slot_values(self, rows: int) -> int:
        """Values a cache slot's heap is sized for, for chunks of ``rows`` rows: the most that
        ``rows`` contiguous rows hold (a chunk of one stretch, on the ring of a shuffled
        epoch's rotation too), or what a chunk drawn from all over the data holds, its mean
        and four standard deviations (``rows`` lengths summed), whichever is more; never more
        than the ``rows`` longest rows hold (:meth:`heap_rows`).

        A bound of the chunks the order makes, not of every set of rows: a chunk that holds
        more (blocks of long rows drawn together) grows its slot's heap when it is read
        (:func:`~._cache.fit_heaps`), so that the chunks, sized in bytes by what they hold, are
        not shrunk for rows no chunk holds."""
        known = self._slots.get(rows)
        if known is None:
            known = self._slots[rows] = self._slot_values(rows)
        return known

    def _slot_values(self, rows: int) -> int:
        worst = self.heap_rows(rows)
        if rows <= 0 or rows >= self.lengths.n:
            return worst
        drawn = rows * self.mean_values + 4.0 * self.lengths.spread * rows**0.5
        floor = int(np.ceil(drawn))
        if floor >= worst:  # the stretches cannot change the answer
            return worst
        window = self.lengths.most_in_stretch(rows, above=floor, enough=worst)
        return min(worst, max(window, floor))

    def chunk_values(self, ranges: Sequence[tuple[int, int]]) -> int:
        """Values the rows of global ``ranges`` hold (a chunk's, from :meth:`RowLengths.before`)."""
        if not ranges:
            return 0
        bounds = np.asarray(ranges, np.int64)
        return int(np.sum(self.lengths.before(bounds[:, 1]) - self.lengths.before(bounds[:, 0])))

    def check_columns(
        self, top: str, indices: np.ndarray, offsets: np.ndarray, rows: np.ndarray
    ) -> None:
        """:class:`~._errors.ReadError` unless every column index of a sparse top's gathered
        rows (``indices``, cut by ``offsets``; ``rows`` their global indices) lies in
        ``0:n_cols``. The stored ``indices`` are values, not read at open: one out of range
        makes a matrix that scipy's ``toarray`` (and cuSPARSE, torch) writes outside of, so
        each batch's are checked before it is made (one pass over them, unsigned: a negative
        index is a huge one)."""
        if not len(indices):
            return
        unsigned = indices.view(np.dtype(f"u{indices.dtype.itemsize}"))
        # Past the signed maximum, a negative index seen unsigned may be below n_cols.
        signed = indices.dtype.kind == "i" and self.n_cols > np.iinfo(indices.dtype).max
        if int(unsigned.max()) < self.n_cols and not (signed and int(indices.min()) < 0):
            return
        bad = (unsigned >= self.n_cols) | (indices < 0) if signed else unsigned >= self.n_cols
        at = int(np.argmax(bad))
        row = int(rows[int(np.searchsorted(offsets, at, side="right")) - 1])
        starts = self.lengths.starts
        f = int(np.searchsorted(starts, row, side="right")) - 1
        where = f"{self.files[f]}: " if 0 <= f < len(self.files) else ""
        raise ReadError(
            f"{where}top {top!r}, row {row - int(starts[f]) if f >= 0 else row} (global index "
            f"{row}): column index {int(indices[at])} is outside the sparse matrix's "
            f"{self.n_cols} columns (its 'shape' attribute): the file's 'indices' or 'shape' "
            "is wrong"
        )

    @property
    def mean_values(self) -> float:
        """Values per row, on average (the batches' size in bytes, for grouping them)."""
        n = self.lengths.n_held
        return float(self.lengths.total) / n if n else 0.0


@dataclass(frozen=True, eq=False)
class RaggedParts:
    """A ragged top in one file: ``indptr`` (int32 or int64, rows + 1, from 0) and where the values
    (and a sparse top's indices) are: the layouts of ``data`` and ``indices``, or the
    variable-length dataset that h5py reads (``vlen``)."""

    indptr: np.ndarray
    data: Layout | None = None
    indices: Layout | None = None
    vlen: Layout | None = None

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.indptr)


@dataclass(frozen=True)
class RaggedForm:
    """A ragged top found in a file (before its layouts are described): the datasets that
    hold it, its ``indptr``, and what a sample is (the values' dtype and trailing shape)."""

    kind: Kind
    indptr: np.ndarray
    dtype: np.dtype[Any]
    sample_shape: tuple[int, ...]
    data: h5py.Dataset | None = None
    indices: h5py.Dataset | None = None
    vlen: h5py.Dataset | None = None
    n_cols: int = 0

    @property
    def nrows(self) -> int:
        return len(self.indptr) - 1


_ROUTE = (
    "a ragged top is a group with 'data' and 'indptr' (row i is data[indptr[i]:indptr[i+1]]), "
    "a sparse-matrix top one with 'data', 'indices', 'indptr' and a 'shape' attribute (CSR), "
    "a categorical top one with 'codes' and 'categories'; or name a dataset (an h5py "
    "variable-length numeric one is a ragged top too)"
)


def group_top(obj: object) -> str | None:
    """What a group named as a top is read as, by its members alone (the form's checks come
    when it is opened): ``"categorical"``, ``"sparse"`` (CSR), ``"ragged"``; None for any
    other object."""
    if not isinstance(obj, h5py.Group):
        return None
    keys = set(obj.keys())
    said = _attr_text(obj, "encoding-type")
    if said == "categorical" or (not said and keys == {"codes", "categories"}):
        return "categorical"
    if {"data", "indptr"} <= keys:
        return "sparse" if "indices" in keys else "ragged"
    return None


_GROUP_WORDS = {"categorical": "categorical", "sparse": "sparse CSR", "ragged": "ragged"}


def group_top_words(obj: object) -> str | None:
    """What a group is read as when named as a top, in words (``"sparse CSR"``, ``"ragged"``,
    ``"categorical"``); None for a group of no such form, or anything else."""
    form = group_top(obj)
    return None if form is None else _GROUP_WORDS[form]


def _numbers(dt: np.dtype[Any]) -> bool:
    """Whether a dataset or field of dtype ``dt`` holds numbers (a sub-array's base counts)."""
    return dt.base.kind in "biufc"


def _member_tops(top: str, group: h5py.Group, at_most: int = 12) -> list[str]:
    """The members of ``group`` that are tops, in words: groups of a top's form, datasets of
    numbers (of one or more dimensions) and a compound dataset's fields of numbers (an AnnData
    ``obs`` or ``obsm``, a pandas table's group). Strings and other groups are left out. Each
    is named as ``tops`` takes it, however ``top`` was written (``"/obs"``, ``"obs/"``)."""
    found: list[str] = []
    named = posixpath.normpath(top).strip("/")
    for key in group:
        try:
            member = group.get(key)
        except (KeyError, OSError, TypeError, ValueError):  # a dangling or external link
            continue
        path = f"{named}/{key}" if named else key
        words = group_top_words(member)
        if words is not None:
            found.append(f"{path!r} ({words})")
        elif isinstance(member, h5py.Dataset) and member.ndim:
            fields = member.dtype.fields
            if fields is not None:
                found += [repr(f"{path}/{f}") for f, (dt, *_) in fields.items() if _numbers(dt)]
            elif (base := h5py.check_vlen_dtype(member.dtype)) is not None:
                if _numbers(np.dtype(base)):
                    found.append(f"{path!r} (ragged)")
            elif _numbers(member.dtype):
                found.append(repr(path))
    return found if len(found) <= at_most else [*found[:at_most], f"... ({len(found)} in all)"]


def _attr_text(obj: Any, name: str) -> str:
    value = obj.attrs.get(name)
    if isinstance(value, bytes):
        return value.decode()
    return str(value) if value is not None else ""


def _numeric(where: str, top: str, what: str, dt: np.dtype[Any]) -> np.dtype[Any]:
    if dt.kind not in "biufc" or dt.names is not None or dt.subdtype is not None:
        raise SchemaError(
            f"{where}: top {top!r}: {what} has dtype {dt}; only bool, integer, float and "
            "complex values are supported"
        )
    native: np.dtype[Any] = np.dtype(dt.newbyteorder("=").str)
    return native


#: The dtypes an ``indptr`` is kept in as read (native order); others are read as int64.
_KEPT_INDPTR = (np.dtype(np.int32), np.dtype(np.int64))


def _indptr(where: str, top: str, dset: Any, n_values: int) -> np.ndarray:
    """``indptr`` read whole and checked: 1-D integers from 0, never decreasing, ending at the
    number of values. An int32 one (AnnData's, scipy's below 2**31 values) is kept as it is,
    4 bytes a row: its values are a file's own, and sums over files are made in int64 by those
    who make them. Blocking (h5py)."""
    if not isinstance(dset, h5py.Dataset) or dset.ndim != 1 or dset.dtype.kind not in "iu":
        raise SchemaError(f"{where}: top {top!r}: 'indptr' must be a 1-D integer dataset")
    indptr: np.ndarray = dset[()]
    if indptr.dtype not in _KEPT_INDPTR:  # int32 and int64 are kept as stored: no copy
        indptr = indptr.astype(np.int64)
    if len(indptr) == 0:
        raise SchemaError(f"{where}: top {top!r}: 'indptr' is empty; it needs rows + 1 entries")
    if indptr[0] != 0:
        raise SchemaError(f"{where}: top {top!r}: 'indptr' starts at {int(indptr[0])}, not 0")
    for a in range(0, len(indptr) - 1, _BLOCK_ROWS):  # in blocks: no array of a row's size
        b = min(len(indptr) - 1, a + _BLOCK_ROWS)
        down = np.flatnonzero(indptr[a + 1 : b + 1] < indptr[a:b])
        if len(down):
            i = a + int(down[0])
            raise SchemaError(
                f"{where}: top {top!r}: 'indptr' decreases at row {i} "
                f"({int(indptr[i])} then {int(indptr[i + 1])}); it must never decrease"
            )
    if indptr[-1] != n_values:
        raise SchemaError(
            f"{where}: top {top!r}: 'indptr' ends at {int(indptr[-1])}, but 'data' holds "
            f"{n_values} values; it must end at len(data)"
        )
    return indptr


def _group_form(where: str, top: str, group: h5py.Group) -> RaggedForm:
    encoding = _attr_text(group, "encoding-type")
    if encoding == "csc_matrix" or _attr_text(group, "h5sparse_format") == "csc":
        field, _, key = top.strip("/").partition("/")
        held = f"adata.{field}[{key!r}]" if key and "/" not in key else "adata.X"
        raise SchemaError(
            f"{where}: top {top!r} is a CSC sparse matrix (columns compressed): its rows are "
            f"not contiguous, so it cannot be read row by row; store it as CSR (AnnData: "
            f"`{held} = {held}.tocsr()` before writing; scipy: `.tocsr()`), or let "
            "`asynchdf5 pack FILE OUT_DIR` rewrite the file with it as CSR"
        )
    names = set(group.keys())
    if "data" not in names or "indptr" not in names:
        have = ", ".join(sorted(names)) or "nothing"
        kind = f" (encoding-type {encoding!r})" if encoding else ""
        members = _member_tops(top, group)
        tops = f". Its members that are tops: {', '.join(members)}" if members else ""
        raise SchemaError(
            f"{where}: top {top!r} is a group{kind} holding {have}, which is neither form a "
            f"group top may take: {_ROUTE}{tops}"
        )
    data = group["data"]
    if not isinstance(data, h5py.Dataset) or data.shape is None or len(data.shape) == 0:
        raise SchemaError(f"{where}: top {top!r}: 'data' must be a dataset of at least 1-D")
    if h5py.check_vlen_dtype(data.dtype) is not None:
        raise SchemaError(f"{where}: top {top!r}: 'data' holds variable-length values")
    dtype = _numeric(where, top, "'data'", data.dtype)
    indptr = _indptr(where, top, group["indptr"], int(data.shape[0]))
    trailing = tuple(int(s) for s in data.shape[1:])
    if "indices" not in names:
        return RaggedForm("ragged", indptr, dtype, trailing, data=data)
    indices = group["indices"]
    if (
        not isinstance(indices, h5py.Dataset)
        or indices.ndim != 1
        or indices.dtype.kind not in "iu"
        or indices.shape[0] != data.shape[0]
    ):
        raise SchemaError(
            f"{where}: top {top!r}: 'indices' must be a 1-D integer dataset as long as 'data' "
            f"({data.shape[0]} values)"
        )
    if trailing:
        raise SchemaError(
            f"{where}: top {top!r}: a sparse matrix's 'data' must be 1-D, not {data.shape}"
        )
    shape = group.attrs.get("shape")
    if shape is None:
        shape = group.attrs.get("h5sparse_shape")
    if shape is None:
        raise SchemaError(
            f"{where}: top {top!r} has 'data', 'indices' and 'indptr' but no 'shape' attribute "
            "(rows, columns): the number of columns of its sparse matrix is unknown"
        )
    dims = np.atleast_1d(shape)
    if len(dims) != 2 or dims.dtype.kind not in "iuf" or (dims != np.floor(dims)).any():
        raise SchemaError(
            f"{where}: top {top!r}: its 'shape' attribute is "
            f"{tuple(np.atleast_1d(shape).tolist())}, not two integers "
            "(rows, columns): the number of columns of its sparse matrix is unknown"
        )
    n_rows, n_cols = (int(s) for s in np.atleast_1d(shape))
    if n_rows != len(indptr) - 1:
        raise SchemaError(
            f"{where}: top {top!r}: its 'shape' says {n_rows} rows, 'indptr' has {len(indptr) - 1}"
        )
    return RaggedForm("sparse", indptr, dtype, (), data=data, indices=indices, n_cols=n_cols)


def _vlen_form(where: str, top: str, dset: h5py.Dataset, base: Any) -> RaggedForm:
    if h5py.check_string_dtype(dset.dtype) is not None or np.dtype(base).kind in "SUO":
        raise SchemaError(
            f"{where}: top {top!r} holds variable-length strings; not supported: tokenize them "
            "into a ragged group of integers ('data' + 'indptr', or an h5py variable-length "
            "integer dataset), or store class codes"
        )
    dtype = _numeric(where, top, "its variable-length rows", np.dtype(base))
    if dset.ndim != 1:
        raise SchemaError(
            f"{where}: top {top!r} is a variable-length dataset of shape {dset.shape}; only "
            "1-D ones (one row per sample) are supported"
        )
    # The rows' lengths are known only from the rows: read once, here, through h5py, a block
    # at a time, so that a data set larger than memory opens in bounded memory.
    n = len(dset)
    indptr = np.zeros(n + 1, np.int64)
    at, step = 0, _VLEN_FIRST_ROWS
    while at < n:
        rows = dset[at : at + step]
        lengths = np.fromiter((len(r) for r in rows), np.int64, count=len(rows))
        np.cumsum(lengths, out=indptr[at + 1 : at + 1 + len(rows)])
        indptr[at + 1 : at + 1 + len(rows)] += indptr[at]
        at += len(rows)
        held = int(lengths.sum()) * dtype.itemsize
        # At most twice the rows: what the next rows hold is known only once read (after a
        # block of empty rows, a block sized by its bytes alone would be every row at once).
        grown = min(_VLEN_MOST_ROWS, 2 * len(rows))
        step = max(1, min(grown, len(rows) * _VLEN_BLOCK_BYTES // max(held, 1)))
    return RaggedForm("ragged", indptr, dtype, (), vlen=dset)


#: Reading a variable-length dataset's lengths at open: rows of the first block, then as many as
#: the block before held about :data:`_VLEN_BLOCK_BYTES` of values in, at most twice its rows
#: (and at most :data:`_VLEN_MOST_ROWS`).
_VLEN_FIRST_ROWS = 256
_VLEN_BLOCK_BYTES = 4 << 20
_VLEN_MOST_ROWS = 1 << 16


def find_form(where: str, h5: h5py.File, top: str) -> RaggedForm | None:
    """The ragged form of ``top`` in file ``where``: a group (:class:`SchemaError` unless it is
    a ragged or sparse one) or a variable-length dataset; None for anything else (a dataset of
    fixed rows, or nothing: the dataset checks say what). Blocking (h5py; reads ``indptr``)."""
    try:
        obj = h5.get(top)
    except (KeyError, OSError, TypeError):
        return None
    if isinstance(obj, h5py.Group):
        return _group_form(where, top, obj)
    if isinstance(obj, h5py.Dataset) and obj.dtype.names is None:
        base = h5py.check_vlen_dtype(obj.dtype)
        text = h5py.check_string_dtype(obj.dtype)
        # Fixed-length strings (`S5`) are fixed rows, not ragged: the dataset checks refuse them.
        if base is not None or (text is not None and text.length is None):
            return _vlen_form(where, top, obj, base if base is not None else obj.dtype)
    return None


def member_of_csr(where: str, h5: h5py.File, top: str) -> None:
    """:class:`SchemaError` when ``top`` names a member of a CSR group (``X/data``): taken as a
    top of its own, its values would be shuffled one by one, apart from their rows."""
    parent, _, leaf = top.rstrip("/").rpartition("/")
    if leaf not in CSR_MEMBERS or not parent:
        return
    try:
        group = h5.get(parent)
    except (KeyError, OSError, TypeError):
        return
    members = set(group.keys()) if isinstance(group, h5py.Group) else set()
    if {"data", "indptr"} <= members:
        # A group without `indices` is a ragged top, not a sparse matrix: say which it is.
        kind = "CSR group" if "indices" in members else "ragged group"
        raise SchemaError(
            f"{where}: top {top!r} is the {leaf!r} member of the {kind} {parent!r}, whose "
            f"rows are cut from 'data' by 'indptr'; name the group as the top: "
            f"tops=({posixpath.normpath(parent).lstrip('/')!r}, ...)"
        )
