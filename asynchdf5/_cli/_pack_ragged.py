"""``asynchdf5 pack`` for samples that are not fixed rows: Parquet tables with list columns, HDF5
files with h5py variable-length datasets, and AnnData ``.h5ad`` files.

* A table with list columns (a document's tokens, a clip's frames, a molecule's atoms): each
  list column becomes a *ragged* top, a group of ``data`` (the rows' values concatenated; a
  column of fixed-size lists gives ``data`` a trailing shape) and ``indptr`` (int64, ``n + 1``
  offsets from 0: row ``r`` is ``data[indptr[r]:indptr[r + 1]]``); each numeric column a
  dataset of rows; each string column a categorical group (``codes`` + ``categories``, as
  AnnData writes them; the categories of the whole table, so every file has the same). Rows
  are split (``--val``), shuffled (``--shuffle``) and cut into files as other inputs are.
* HDF5 files whose ``--tops`` include an h5py variable-length numeric dataset: each such top
  becomes a ragged group as above, the others (numbers or vectors) rows; split, shuffled and
  cut into files as a table is, and written as the table would be. In bounded memory: every
  top is streamed, a block of rows at a time, into scratch files in the output folder (the
  values and int64 offsets of a ragged top, the rows of the others; removed at the end, also
  on an error), and each output file is gathered from them a block at a time. Parquet tables
  are packed the same way, read one row group's column at a time.
* An ``.h5ad`` file is rewritten object by object, as AnnData reads it back: every numeric
  dataset contiguous and unfiltered (the layer's direct-read path; a sparse ``X`` stays a CSR
  group of contiguous ``data``, ``indices``, ``indptr``, where a chunk's rows are one range of
  each), a CSC matrix turned into CSR (its rows are the samples), the rest (strings,
  categoricals' names, attributes) copied as it is. One output file per input file.

Every file is written under a temporary name and renamed when complete; ``train.txt`` (and
``val.txt``) name them, as for other inputs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .. import __version__
from .._catalog import ENCODING_ATTR, SHUFFLED_ATTR
from .._fileio import pread_into
from ._pack_inputs import _pyarrow, refuse_group_top
from ._pack_write import PackError, commit_file, commit_text, temporary_prefix
from ._util import mib, plural

__all__ = [
    "H5AD_SUFFIX",
    "has_list_columns",
    "pack_h5ad",
    "pack_ragged_table",
    "pack_vlen",
    "vlen_tops",
]

H5AD_SUFFIX = ".h5ad"
#: Bytes of a dataset copied at a time when an ``.h5ad`` is rewritten.
_COPY_BYTES = 64 * 2**20
#: The attributes AnnData gives a categorical group (what :func:`~.._catalog.categorical` reads).
_CATEGORICAL_ATTRS = {ENCODING_ATTR: "categorical", "encoding-version": "0.2.0", "ordered": False}


# --- tables with list columns ------------------------------------------------------------------


def has_list_columns(paths: Sequence[Path]) -> bool:
    """Whether the first table (Parquet: its schema only) has a list column."""
    first = paths[0]
    if first.suffix.lower() == ".csv":
        return False  # CSV has no lists
    pa = _pyarrow()
    try:
        schema = importlib.import_module("pyarrow.parquet").read_schema(first)
    except (OSError, pa.ArrowException) as exc:
        raise PackError(f"{first}: cannot read the table: {exc}") from exc
    return any(_is_list(pa, f.type) for f in schema)


def _is_list(pa: Any, t: Any) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t))


def _columns(pa: Any, schema: Any, path: Path, args: argparse.Namespace) -> list[str]:
    """The columns to pack: those named (``--columns``, ``--label-column``), else every list
    and numeric column."""
    named = list(args.columns or [])
    if args.label_column and args.label_column not in named:
        named.append(args.label_column)
    if named:
        for c in named:
            if c not in schema.names:
                raise PackError(f"{path}: no column {c!r}; the table has {schema.names}")
        return named
    numeric = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean)
    return [f.name for f in schema if _is_list(pa, f.type) or any(test(f.type) for test in numeric)]


def _ragged(pa: Any, col: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``data`` and ``indptr`` of a list column (one chunk)."""
    offsets = np.asarray(col.offsets, dtype=np.int64)
    values = col.flatten()  # the rows' values, the slice's own
    indptr = offsets - offsets[0]
    if pa.types.is_fixed_size_list(values.type):  # rows of fixed-size records: a trailing shape
        size = values.type.list_size
        inner = np.asarray(values.flatten().to_numpy(zero_copy_only=False))
        data = inner.reshape(len(values), size)
    elif _is_list(pa, values.type):
        raise PackError(
            f"column {name!r} holds lists of lists of varying length; only lists of numbers or "
            "of fixed-size lists (a trailing shape) become ragged tops"
        )
    else:
        data = np.asarray(values.to_numpy(zero_copy_only=False))
    if data.dtype.kind not in "biuf":
        raise PackError(f"column {name!r} holds lists of {values.type}, not numbers")
    return data, indptr


def _plain(pa: Any, col: Any) -> Any:
    """A dictionary-encoded column as its values."""
    return col.cast(col.type.value_type) if pa.types.is_dictionary(col.type) else col


def _is_string(pa: Any, t: Any) -> bool:
    t = t.value_type if pa.types.is_dictionary(t) else t
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


def _column_pieces(
    pa: Any, tables: Sequence[tuple[Path, Any]], columns: Sequence[str]
) -> Iterator[tuple[int, int, Any]]:
    """Every table's rows of ``columns``, in order, one row group's column at a time (what
    pyarrow decodes at once, so what bounds the memory this takes): ``(j, at, array)``, a
    piece of column ``columns[j]`` whose first row is row ``at`` of the tables."""
    start = 0
    for path, pf in tables:
        for i in range(pf.metadata.num_row_groups):
            for j, c in enumerate(columns):
                try:
                    col = pf.read_row_group(i, columns=[c], use_threads=False).column(0)
                except (OSError, pa.ArrowException) as exc:
                    raise PackError(f"{path}: cannot read the table: {exc}") from exc
                at = start
                for piece in col.chunks:
                    yield j, at, piece
                    at += len(piece)
                del col
            start += pf.metadata.row_group(i).num_rows


def _categories(
    pa: Any, tables: Sequence[tuple[Path, Any]], columns: Sequence[str], schema: Any
) -> dict[str, np.ndarray]:
    """The sorted categories of each string column, over every table (a pass over those
    columns alone)."""
    strings = [c for c in columns if _is_string(pa, schema.field(c).type)]
    found: dict[str, np.ndarray] = {c: np.array([], dtype=str) for c in strings}
    for j, _, piece in _column_pieces(pa, tables, strings):
        values = np.asarray(_plain(pa, piece).to_numpy(zero_copy_only=False)).astype(str)
        found[strings[j]] = np.union1d(found[strings[j]], np.unique(values))
    return found


def _stage_piece(
    pa: Any,
    c: str,
    j: int,
    piece: Any,
    categories: dict[str, np.ndarray],
    staged: dict[str, _Staged],
    handles: dict[str, tuple[Any, Any]],
    out: Path,
    files: contextlib.ExitStack,
    at: int,
) -> None:
    """Append a piece of column ``c`` (its ``j``-th; rows ``at`` on of the tables) to its
    scratch files, making them at its first piece."""
    col = _plain(pa, piece)
    if col.null_count:
        raise PackError(
            f"column {c!r} has missing values ({col.null_count} in the {len(col)} rows from "
            f"row {at}); fill or drop them first"
        )
    indptr = None
    if pa.types.is_fixed_size_list(col.type):  # rows of one shape
        inner = np.asarray(col.flatten().to_numpy(zero_copy_only=False))
        values = inner.reshape(len(col), col.type.list_size)
    elif _is_list(pa, col.type):
        values, indptr = _ragged(pa, col, c)
    elif c in categories:
        text = np.asarray(col.to_numpy(zero_copy_only=False)).astype(str)
        values = np.searchsorted(categories[c], text).astype(np.int32)
    else:
        values = np.asarray(col.to_numpy(zero_copy_only=False))
        if values.dtype.kind not in "biuf":
            raise PackError(f"column {c!r} holds {col.type} values: not packed")
    s = staged.get(c)
    if s is None:
        shape = tuple(int(k) for k in values.shape[1:])
        s = staged[c] = _Staged(
            c, indptr is not None, values.dtype, shape, out / f"{temporary_prefix()}stage-{j}",
            categories=categories.get(c),
        )  # fmt: skip
        handles[c] = s.open(files)
    value_file, ptr_file = handles[c]
    value_file.write(np.ascontiguousarray(values, s.dtype).data)
    s.arrow_bytes += int(piece.nbytes)
    if indptr is not None:
        ptr_file.write((s.n_values + indptr[1:]).data)
        s.n_values += int(indptr[-1])


def pack_ragged_table(args: argparse.Namespace, out: Path, split: Any, file_bytes: int) -> int:
    """Pack Parquet tables with list columns into ragged tops (see the module's docstring), in
    memory bounded by a row group's column (what pyarrow decodes at once), not by the tables:
    they are read one row group's column at a time into scratch files in ``out`` (removed at
    the end, also on an error), from which each output file is gathered a block of rows at a
    time, as :func:`pack_vlen` does."""
    pa = _pyarrow()
    pq = importlib.import_module("pyarrow.parquet")
    inputs: list[Path] = args.inputs
    if args.compression != "none":
        raise PackError(
            "--compression does not apply to tables with list columns: ragged tops are written "
            "contiguous (the rows of a chunk are then one read)"
        )
    tables = []
    for p in inputs:
        try:
            tables.append((p, pq.ParquetFile(p)))
        except (OSError, pa.ArrowException) as exc:
            raise PackError(f"{p}: cannot read the table: {exc}") from exc
    schema = tables[0][1].schema_arrow
    columns = _columns(pa, schema, inputs[0], args)
    for p, pf in tables[1:]:
        other = pf.schema_arrow
        for c in columns:
            if c not in other.names or not other.field(c).type.equals(schema.field(c).type):
                have = other.field(c).type if c in other.names else "no such column"
                raise PackError(
                    f"the tables do not share the columns {columns}: {p}: column {c!r} is "
                    f"{have}, {inputs[0]}'s {schema.field(c).type}"
                )
    maps: dict[str, tuple[_Scratch, _Scratch | None]] = {}
    try:
        categories = _categories(pa, tables, columns, schema)
        staged: dict[str, _Staged] = {}
        handles: dict[str, tuple[Any, Any]] = {}
        with contextlib.ExitStack() as files:
            for j, at, piece in _column_pieces(pa, tables, columns):
                _stage_piece(pa, columns[j], j, piece, categories, staged, handles, out, files, at)
        n = sum(pf.metadata.num_rows for _, pf in tables)
        if not staged:
            raise PackError(f"{', '.join(map(str, inputs))}: the tables have no rows")
        described = ", ".join(map(str, inputs))
        _write_from_stage(args, out, split, file_bytes, staged, columns, n, described, maps)
    finally:
        _close_scratch(maps, out)
    return 0


def _write_packed(
    args: argparse.Namespace,
    out: Path,
    split: Any,
    file_bytes: int,
    n: int,
    total: int,
    described: str,
    tops: list[str],
    kinds: list[str],
    write: Callable[[Path, np.ndarray, dict[str, Any]], None],
) -> None:
    """Split ``n`` samples (``--val``), shuffle them (``--shuffle``), cut them into files of
    about ``file_bytes`` (``total`` bytes in all), each written by ``write(tmp, rows, attrs)``
    under a temporary name and renamed when complete, then the source lists naming them;
    ``kinds`` says what each of the ``tops`` becomes."""
    rng = np.random.default_rng(args.seed)
    train, val = split(n, None, args.val, rng)
    if len(train) == 0:
        raise PackError(f"{n} samples leave none for training with --val {args.val}")
    if args.shuffle:
        train, val = rng.permutation(train), rng.permutation(val)
    per_file = args.samples_per_file or max(1, n * file_bytes // max(1, total))
    print(
        f"packing {plural(n, 'sample')} ({mib(total)}) from {described} "
        f"into {out}: {', '.join(kinds)}",
        flush=True,
    )
    attrs: dict[str, Any] = {"packed_by": f"asynchdf5 {__version__} pack"}
    if args.shuffle:
        attrs[SHUFFLED_ATTR] = True
    written: list[str] = []
    try:
        for name, order in (("train", train), ("val", val)):
            if len(order) == 0:
                continue
            files = []
            for k, a in enumerate(range(0, len(order), per_file)):
                final = out / f"{name}-{k:05d}.h5"
                tmp = out / f"{temporary_prefix()}{final.name}"
                write(tmp, np.asarray(order[a : a + per_file], np.int64), attrs)
                commit_file(tmp, final)
                files.append(final.name)
            commit_text(out / f"{name}.txt", "\n".join(files) + "\n")
            written.append(f"{name} {plural(len(order), 'sample')} in {plural(len(files), 'file')}")
    finally:
        for tmp in out.glob(f"{temporary_prefix()}*"):
            tmp.unlink(missing_ok=True)
    print(f"wrote {'; '.join(written)}")
    print(f"next: asynchdf5 inspect {out / 'train.txt'} --tops {' '.join(tops)}")


# --- HDF5 files with variable-length datasets ---------------------------------------------------


def vlen_tops(paths: Sequence[Path], tops: Sequence[str]) -> bool:
    """Whether a top of the first file is an h5py variable-length numeric dataset."""
    try:
        with h5py.File(paths[0], "r") as f:
            for t in tops:
                d = f.get(t)
                if isinstance(d, h5py.Dataset) and h5py.check_vlen_dtype(d.dtype) is not None:
                    return h5py.check_string_dtype(d.dtype) is None
    except OSError:
        return False  # the row path says what is wrong with the file
    return False


#: Values (or rows) read, staged or gathered at a time: the packing process holds a few such
#: blocks, whatever the size of the data set.
_BLOCK_BYTES = 2 << 20
#: Rows of a variable-length dataset read in its first block (then as many as hold about
#: :data:`_BLOCK_BYTES` of values, at most :data:`_MOST_ROWS`).
_FIRST_ROWS = 256
_MOST_ROWS = 1 << 16


@dataclass
class _Staged:
    """A top copied, in input order, into scratch files in the output folder: a ragged top's
    values and int64 ``indptr`` (``n + 1`` offsets from 0), or a fixed top's rows."""

    name: str
    ragged: bool
    dtype: np.dtype[Any]
    shape: tuple[int, ...]  # of a row (a fixed top), of each value (a ragged top)
    base: Path  # the scratch files' path but their suffix
    n_values: int = 0
    #: What the rows take as Arrow columns (how the files are sized).
    arrow_bytes: int = 0
    #: A categorical top's names (its staged rows are int32 codes into them).
    categories: np.ndarray | None = None

    @property
    def row_bytes(self) -> int:
        return self.dtype.itemsize * int(np.prod(self.shape, dtype=np.int64))

    @property
    def values(self) -> Path:
        return self.base.with_suffix(".values")

    @property
    def indptr(self) -> Path | None:
        return self.base.with_suffix(".indptr") if self.ragged else None

    def open(self, files: contextlib.ExitStack) -> tuple[Any, Any]:
        """The scratch files, created for appending (closed by ``files``): the values', and a
        ragged top's offsets' (its first offset, 0, written)."""
        values = files.enter_context(open(self.values, "wb"))  # noqa: SIM115 - ``files`` closes
        ptr = None
        if self.indptr is not None:
            ptr = files.enter_context(open(self.indptr, "wb"))  # noqa: SIM115 - as above
            ptr.write(np.zeros(1, np.int64).data)
        return values, ptr


def _vlen_top(entry: str, f: h5py.File, top: str) -> tuple[h5py.Dataset, bool, np.dtype[Any]]:
    """Dataset ``top`` of ``f``, whether it is variable-length, and its (values') dtype in
    native byte order; a PackError for what is packed neither as ragged nor as rows."""
    refuse_group_top(entry, f, top)
    d = f.get(top)
    if not isinstance(d, h5py.Dataset):
        raise PackError(f"{entry}: no dataset {top!r} (choose the tops with --tops)")
    base = h5py.check_vlen_dtype(d.dtype)
    if base is not None:
        if h5py.check_string_dtype(d.dtype) is not None or np.dtype(base).kind not in "biuf":
            raise PackError(f"{entry}: top {top!r} holds variable-length {base}, not numbers")
        if d.ndim != 1:
            raise PackError(
                f"{entry}: top {top!r} is a variable-length dataset of shape {d.shape}; only "
                "1-D ones (one row per sample) are packed"
            )
        return d, True, np.dtype(base).newbyteorder("=")
    if d.dtype.kind not in "biuf" or d.ndim not in (1, 2):
        raise PackError(
            f"{entry}: top {top!r} has rows of shape {d.shape[1:]} and dtype "
            f"{d.dtype}; beside variable-length tops, numbers or vectors are packed"
        )
    return d, False, d.dtype.newbyteorder("=")


def _arrow_bytes(s: _Staged, rows: int, values: int) -> int:
    """Bytes of one file's rows of ``s`` as the Arrow column the in-memory path made of them
    (offsets of 32 bits below 2**31 values; booleans a bit each), so files are cut as before."""
    if s.ragged:
        width = 4 if values < 2**31 else 8
        return width * (rows + 1) + values * s.dtype.itemsize
    items = rows * int(np.prod(s.shape, dtype=np.int64))
    return (items + 7) // 8 if s.dtype.kind == "b" else items * s.dtype.itemsize


def _stage_file(
    entry: str,
    f: h5py.File,
    tops: Sequence[str],
    staged: dict[str, _Staged],
    handles: dict[str, tuple[Any, Any]],
) -> int:
    """Append file ``f``'s rows of every top to its scratch files; its row count."""
    found = {t: _vlen_top(entry, f, t) for t in tops}
    counts = {t: len(d) for t, (d, _, _) in found.items()}
    if len(set(counts.values())) > 1:
        raise PackError(f"{entry}: the tops have different row counts ({counts})")
    for t, (d, ragged, dtype) in found.items():
        s = staged[t]
        shape = () if ragged else tuple(int(k) for k in d.shape[1:])
        if (ragged, dtype, shape) != (s.ragged, s.dtype, s.shape):
            was = f"variable-length {s.dtype}" if s.ragged else f"{s.dtype} rows of {s.shape}"
            now = f"variable-length {dtype}" if ragged else f"{dtype} rows of {shape}"
            raise PackError(
                f"the files' tops differ in type: {entry}: top {t!r} holds {now}, the first "
                f"file's {was}"
            )
        values, indptr = handles[t]
        n = len(d)
        if not ragged:
            step = max(1, _BLOCK_BYTES // max(1, s.row_bytes))
            for a in range(0, n, step):
                values.write(np.ascontiguousarray(d[a : a + step], dtype).data)
            s.arrow_bytes += _arrow_bytes(s, n, 0)
            continue
        first = s.n_values
        at, step = 0, _FIRST_ROWS
        while at < n:
            rows = d[at : at + step]
            lengths = np.fromiter((len(r) for r in rows), np.int64, count=len(rows))
            if lengths.sum():
                block = np.concatenate([np.asarray(r, dtype) for r in rows if len(r)])
                values.write(np.ascontiguousarray(block).data)
            ends = s.n_values + np.cumsum(lengths)
            indptr.write(ends.data)
            s.n_values = int(ends[-1]) if len(ends) else s.n_values
            at += len(rows)
            held = int(lengths.sum()) * dtype.itemsize
            step = max(1, min(_MOST_ROWS, step * _BLOCK_BYTES // max(held, 1)))
        s.arrow_bytes += _arrow_bytes(s, n, s.n_values - first)
    return next(iter(counts.values()), 0)


class _Scratch:
    """A scratch file read back by ranges of items (rows of ``shape``) with ``pread``, not
    mapped: where the page cache holds large folios (ext4 now), a mapping makes each folio
    touched resident in the process, the whole file after a few blocks of random rows."""

    def __init__(self, path: Path, dtype: np.dtype[Any], shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = dtype, shape
        self.item = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        self._fd = os.open(path, os.O_RDONLY)

    def take(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Items ``starts[i]`` to ``starts[i] + lengths[i]`` for each ``i``, concatenated in
        that order: read in file order, ranges that follow each other in one read."""
        ends = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=ends[1:])
        buf = np.empty((int(ends[-1]), *self.shape), self.dtype)
        if len(buf) == 0:
            return buf
        some = np.flatnonzero(lengths)
        order = some[np.argsort(starts[some], kind="stable")]
        first, count = starts[order], lengths[order]
        at = np.zeros(len(order) + 1, np.int64)  # where each range lies in ``buf``
        np.cumsum(count, out=at[1:])
        cut = np.flatnonzero(first[1:] != first[:-1] + count[:-1]) + 1
        raw = buf.reshape(-1).view(np.uint8).data
        for a, b in zip(np.r_[0, cut], np.r_[cut, len(order)], strict=True):
            self._read(raw[at[a] * self.item : at[b] * self.item], int(first[a]) * self.item)
        where = np.zeros(len(lengths), np.int64)
        where[order] = at[:-1]
        pos = np.repeat(where - ends[:-1], lengths) + np.arange(len(buf), dtype=np.int64)
        out: np.ndarray = buf[pos]
        return out

    def _read(self, view: memoryview, offset: int) -> None:
        got = pread_into(self._fd, view, offset)
        if got < len(view):
            raise PackError(f"a scratch file of pack ended early (at byte {offset + got})")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _blocks(ends: np.ndarray, item_bytes: int) -> Iterator[tuple[int, int]]:
    """Ranges ``[a, b)`` of rows holding about :data:`_BLOCK_BYTES` each (``ends``: the
    rows' ``n + 1`` value offsets from 0), at least one row and at most :data:`_MOST_ROWS`."""
    n, a = len(ends) - 1, 0
    per = max(1, _BLOCK_BYTES // max(1, item_bytes))
    while a < n:
        b = int(np.searchsorted(ends, ends[a] + per, side="right")) - 1
        b = min(max(b, a + 1), a + _MOST_ROWS, n)
        yield a, b
        a = b


def _write_staged_file(
    path: Path,
    index: np.ndarray,
    staged: Sequence[_Staged],
    maps: dict[str, tuple[_Scratch, _Scratch | None]],
    attrs: dict[str, Any],
) -> None:
    """Rows ``index`` (in that order) of the staged tops as one file, a block at a time: a
    ragged top as a group of contiguous ``data`` and ``indptr``, a categorical one as a group of
    ``codes`` and ``categories`` (as AnnData writes them), a fixed top as rows."""
    with h5py.File(path, "w") as f:
        f.attrs.update(attrs)
        for s in staged:
            values, indptr = maps[s.name]
            if indptr is None:
                where: h5py.Group = f
                name = s.name
                if s.categories is not None:
                    where, name = f.create_group(s.name), "codes"
                    where.attrs.update(_CATEGORICAL_ATTRS)
                rows = where.create_dataset(name, shape=(len(index), *s.shape), dtype=s.dtype)
                for a, b in _blocks(np.arange(len(index) + 1, dtype=np.int64), s.row_bytes):
                    rows[a:b] = values.take(index[a:b], np.ones(b - a, np.int64))
                if s.categories is not None:
                    names = s.categories.astype(object)
                    where.create_dataset("categories", data=names, dtype=h5py.string_dtype())
                continue
            bounds = indptr.take(index, np.full(len(index), 2, np.int64)).reshape(-1, 2)
            starts, lengths = bounds[:, 0], bounds[:, 1] - bounds[:, 0]
            ends = np.zeros(len(index) + 1, np.int64)
            np.cumsum(lengths, out=ends[1:])
            g = f.create_group(s.name)
            data = g.create_dataset("data", shape=(int(ends[-1]), *s.shape), dtype=s.dtype)
            for a, b in _blocks(ends, s.row_bytes):
                if ends[b] > ends[a]:
                    data[ends[a] : ends[b]] = values.take(starts[a:b], lengths[a:b])
            g.create_dataset("indptr", data=ends)


def _stage(
    entries: Sequence[str], tops: Sequence[str], out: Path, prefix: str
) -> tuple[dict[str, _Staged], int]:
    """Every file's rows of ``tops``, in order, appended to scratch files in ``out`` (named
    from ``prefix``; the caller removes them); the tops as staged and the number of rows."""
    staged: dict[str, _Staged] = {}
    handles: dict[str, tuple[Any, Any]] = {}
    n = 0
    with contextlib.ExitStack() as files:
        for entry in entries:
            try:
                f = files.enter_context(h5py.File(entry, "r"))
            except OSError as exc:
                raise PackError(f"{entry}: cannot read it as an HDF5 file: {exc}") from exc
            for j, t in enumerate(tops if not staged else ()):
                d, ragged, dtype = _vlen_top(entry, f, t)
                shape = () if ragged else tuple(int(x) for x in d.shape[1:])
                staged[t] = _Staged(t, ragged, dtype, shape, out / f"{prefix}stage-{j}")
                handles[t] = staged[t].open(files)
            n += _stage_file(entry, f, tops, staged, handles)
            f.close()
    return staged, n


def pack_vlen(
    args: argparse.Namespace, out: Path, split: Any, file_bytes: int, entries: Sequence[str]
) -> int:
    """Pack HDF5 files whose ``--tops`` include h5py variable-length numeric datasets: those
    as ragged groups (``data`` + ``indptr``, read as contiguous ranges instead of one heap
    object per row), the others as rows. In bounded memory: every top is first streamed, a
    block at a time, into scratch files in ``out`` (removed at the end, also on an error),
    from which each output file's rows are gathered, a block at a time."""
    if args.compression != "none":
        raise PackError(
            "--compression does not apply to variable-length tops: ragged tops are written "
            "contiguous (the rows of a chunk are then one read)"
        )
    tops: list[str] = list(args.tops)
    maps: dict[str, tuple[_Scratch, _Scratch | None]] = {}
    try:
        staged, n = _stage(entries, tops, out, temporary_prefix())
        described = f"{len(entries)} HDF5 files"
        _write_from_stage(args, out, split, file_bytes, staged, tops, n, described, maps)
    finally:
        _close_scratch(maps, out)
    return 0


def _write_from_stage(
    args: argparse.Namespace,
    out: Path,
    split: Any,
    file_bytes: int,
    staged: dict[str, _Staged],
    tops: Sequence[str],
    n: int,
    described: str,
    maps: dict[str, tuple[_Scratch, _Scratch | None]],
) -> None:
    """Write the output files and source lists from the staged ``tops`` (``n`` rows), each
    file's rows gathered from the scratch files, opened into ``maps`` (the caller closes them
    with :func:`_close_scratch`)."""
    for s in staged.values():
        offsets = None if s.indptr is None else _Scratch(s.indptr, np.dtype(np.int64), ())
        maps[s.name] = (_Scratch(s.values, s.dtype, s.shape), offsets)
    order = [staged[t] for t in tops]

    def write(tmp: Path, rows: np.ndarray, attrs: dict[str, Any]) -> None:
        _write_staged_file(tmp, rows, order, maps, attrs)

    kinds = [
        f"{t} ragged" if s.ragged else f"{t} categorical" if s.categories is not None else t
        for t, s in zip(tops, order, strict=True)
    ]
    total = sum(s.arrow_bytes for s in staged.values())
    _write_packed(args, out, split, file_bytes, n, total, described, list(tops), kinds, write)


def _close_scratch(maps: dict[str, tuple[_Scratch, _Scratch | None]], out: Path) -> None:
    """Close the scratch files and remove them (and any other temporary file of ``out``)."""
    for pair in maps.values():
        for m in pair:
            if m is not None:
                m.close()
    for tmp in out.glob(f"{temporary_prefix()}*"):
        tmp.unlink(missing_ok=True)


# --- .h5ad -------------------------------------------------------------------------------------


def _enc(obj: Any) -> object:
    said = obj.attrs.get(ENCODING_ATTR)
    return said.decode() if isinstance(said, bytes) else said


def _copy_contiguous(src: h5py.Dataset, parent: h5py.Group, name: str) -> None:
    """``src`` as a contiguous, unfiltered dataset ``name`` of ``parent``, in slabs."""
    dst = parent.create_dataset(name, shape=src.shape, dtype=src.dtype)
    dst.attrs.update(src.attrs)
    if src.size == 0:
        return
    if src.ndim == 0:
        dst[()] = src[()]
        return
    row = max(1, src.dtype.itemsize * int(np.prod(src.shape[1:], dtype=np.int64)))
    step = max(1, _COPY_BYTES // row)
    for a in range(0, int(src.shape[0]), step):
        dst[a : a + step] = src[a : a + step]


def _csc_to_csr(src: h5py.Group, parent: h5py.Group, name: str, where: str) -> None:
    """A CSC matrix group as a CSR one (its rows, the samples, each one range): in memory."""
    try:
        sparse = importlib.import_module("scipy.sparse")
    except ImportError as exc:
        raise PackError(f"{where}: a CSC matrix is turned into CSR with scipy: install it") from exc
    shape = tuple(int(n) for n in src.attrs["shape"])
    m = sparse.csc_matrix((src["data"][()], src["indices"][()], src["indptr"][()]), shape=shape)
    csr = m.tocsr()
    csr.sort_indices()
    g = parent.create_group(name)
    g.attrs.update({k: v for k, v in src.attrs.items()})
    g.attrs[ENCODING_ATTR] = "csr_matrix"
    g.create_dataset("data", data=csr.data)
    g.create_dataset("indices", data=csr.indices)
    g.create_dataset("indptr", data=csr.indptr.astype(np.int64))


def _rewrite(src: h5py.Group, dst: h5py.Group, where: str) -> None:
    dst.attrs.update(src.attrs)
    for name, obj in src.items():
        if isinstance(obj, h5py.Group):
            if _enc(obj) == "csc_matrix" and {"data", "indices", "indptr"} <= set(obj.keys()):
                _csc_to_csr(obj, dst, name, f"{where}/{name}")
                continue
            _rewrite(obj, dst.create_group(name), f"{where}/{name}")
        elif isinstance(obj, h5py.Dataset) and obj.dtype.kind in "biufc" and obj.shape:
            _copy_contiguous(obj, dst, name)
        else:  # strings, references, scalars: as they are
            src.copy(obj, dst, name=name)


def pack_h5ad(args: argparse.Namespace, out: Path) -> int:
    """Rewrite ``.h5ad`` files in the form the layer reads fastest (see the module's
    docstring), one output file per input, named by ``train.txt``."""
    for flag, value, default in (
        ("--shuffle", args.shuffle, False),
        ("--val", args.val, 0.0),
        ("--samples-per-file", args.samples_per_file, None),
        ("--compression", args.compression, "none"),
        ("--columns", args.columns, None),
        ("--label-column", args.label_column, None),
        ("--tops", args.tops, None),
    ):
        if value != default:
            raise PackError(
                f"{flag} does not apply to .h5ad inputs: each file is rewritten as it is, with "
                "its layouts made fast (shuffle when reading: the layer's shuffle=True)"
            )
    names = []
    try:
        for k, path in enumerate(args.inputs):
            final = out / f"train-{k:05d}.h5"
            tmp = out / f"{temporary_prefix()}{final.name}"
            try:
                with h5py.File(path, "r") as src, h5py.File(tmp, "w") as dst:
                    _rewrite(src, dst, str(path))
                    dst.attrs["packed_by"] = f"asynchdf5 {__version__} pack"
            except OSError as exc:
                raise PackError(f"{path}: cannot rewrite it: {exc}") from exc
            commit_file(tmp, final)
            names.append(final.name)
            print(f"{path} -> {final} ({mib(final.stat().st_size)})", flush=True)
    finally:
        for tmp in out.glob(f"{temporary_prefix()}*"):
            tmp.unlink(missing_ok=True)
    commit_text(out / "train.txt", "\n".join(names) + "\n")
    print(f"wrote {plural(len(names), 'file')} ({out / 'train.txt'})")
    print(f"next: asynchdf5 inspect {out / 'train.txt'} --tops X obs/<column>")
    return 0
