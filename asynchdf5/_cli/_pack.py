"""``asynchdf5 pack``: write training files that load fast, and their source lists.

Inputs: an image folder (one subfolder per class), ``.npy`` or ``.npz`` files, CSV or Parquet
tables, or HDF5 files to repack (see :mod:`._pack_inputs`, :mod:`._pack_images`). The samples
are split (``--val``), shuffled (``--shuffle``, ``--seed``), cut into files of
``--samples-per-file`` samples, written in layouts the layer reads on its fast paths (see
:mod:`._pack_write`), and named by ``train.txt`` (and ``val.txt``) in the output folder, which
is what a layer's ``source`` takes.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .. import __version__
from .._catalog import SHUFFLED_ATTR
from .._config import DEFAULT_TOPS
from .._errors import DataLayerError
from .._sources import is_hdf5_file, resolve_source
from ._pack_images import ImageInput
from ._pack_inputs import Index, Input, hdf5_input, npy_input, npz_input, table_input
from ._pack_ragged import (
    H5AD_SUFFIX,
    has_list_columns,
    pack_h5ad,
    pack_ragged_table,
    pack_vlen,
    vlen_tops,
)
from ._pack_write import (
    Compression,
    FileWriter,
    PackError,
    commit_text,
    temporary_prefix,
)
from ._util import Bar, checkpoints, mib, plural, progress_bar

__all__ = ["FILE_BYTES", "open_input", "pack", "split"]

#: Default size of an output file (``--samples-per-file`` is derived from it).
FILE_BYTES = 2**30
_HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5")
_TABLE_SUFFIXES = (".csv", ".parquet", ".pq")


# --- which input -------------------------------------------------------------------------------


def _kind(inputs: Sequence[Path]) -> str:
    for p in inputs:
        if not p.exists():
            raise PackError(f"input {str(p)!r} does not exist")
    if len(inputs) == 1 and inputs[0].is_dir():
        return "images"
    if any(p.is_dir() for p in inputs):
        raise PackError("an image folder is packed on its own: give one folder, then OUT_DIR")
    suffixes = {p.suffix.lower() for p in inputs}
    if suffixes == {".npy"}:
        return "npy"
    if suffixes == {".npz"}:
        return "npz"
    if suffixes <= set(_TABLE_SUFFIXES):
        return "table"
    if all(p.suffix.lower() in _HDF5_SUFFIXES or is_hdf5_file(p) for p in inputs):
        return "hdf5"
    if len(inputs) == 1 and inputs[0].suffix.lower() == ".txt":
        return "hdf5"  # a source list naming HDF5 files
    raise PackError(
        "cannot tell what to pack from "
        + ", ".join(str(p) for p in inputs)
        + ": give an image folder, .npy or .npz files, .csv or .parquet tables, or HDF5 files "
        "(or a source list of them), all of one kind"
    )


def _only(args: argparse.Namespace, kind: str, allowed: dict[str, str]) -> None:
    """Refuse options that do not apply to this kind of input."""
    for option, kinds in allowed.items():
        value = getattr(args, option)
        if value not in (None, False) and kind not in kinds.split():
            flag = "--" + option.replace("_", "-")
            raise PackError(f"{flag} does not apply to {kind} inputs")


def open_input(args: argparse.Namespace, out: Path) -> Input:
    inputs: list[Path] = args.inputs
    kind = _kind(inputs)
    _only(
        args,
        kind,
        {
            "size": "images",
            "labels": "npy",
            "columns": "table",
            "label_column": "table",
            "tops": "hdf5",
        },
    )
    if kind == "images":
        if args.size is not None and len(args.size) > 2:
            raise PackError("--size takes HEIGHT [WIDTH]")
        size = None if args.size is None else (args.size[0], args.size[-1])
        return ImageInput(inputs[0], size, args.channels, args.resize, args.workers)
    if kind == "npy":
        return npy_input(inputs, args.labels or [])
    if kind == "npz":
        return npz_input(inputs)
    if kind == "table":
        try:
            dtype = np.dtype(args.dtype)
        except TypeError as exc:
            raise PackError(f"--dtype {args.dtype}: not a NumPy dtype") from exc
        return table_input(inputs, args.columns, args.label_column, dtype)
    source: Path | list[Path] = inputs[0] if len(inputs) == 1 else inputs
    return hdf5_input(source, args.tops or list(DEFAULT_TOPS), out)


# --- the plan ----------------------------------------------------------------------------------


def split(
    n: int, labels: Index | None, val: float, rng: np.random.Generator
) -> tuple[Index, Index]:
    """The items of the training and validation sets (sorted). With labels, ``val`` of each
    class goes to validation (stratified); without, ``val`` of all items, at random."""
    if val == 0:
        return np.arange(n, dtype=np.int64), np.empty(0, np.int64)
    if labels is None:
        chosen = rng.choice(n, round(val * n), replace=False)
    else:
        by_class = np.argsort(labels, kind="stable")
        _, counts = np.unique(labels[by_class], return_counts=True)
        parts = []
        start = 0
        for count in counts:
            members = by_class[start : start + count]
            parts.append(rng.choice(members, round(val * count), replace=False))
            start += count
        chosen = np.concatenate(parts)
    held = np.zeros(n, bool)
    held[chosen] = True
    return np.flatnonzero(~held).astype(np.int64), np.flatnonzero(held).astype(np.int64)


_OUTPUT = re.compile(r"(train|val)(-\d{5}\.h5|\.txt)")


def _check_out(out: Path, overwrite: bool) -> list[Path]:
    """Create ``out``; the outputs of an earlier pack there (refused unless ``overwrite``)."""
    out.mkdir(parents=True, exist_ok=True)
    old = sorted(p for p in out.iterdir() if _OUTPUT.fullmatch(p.name))
    if old and not overwrite:
        raise PackError(
            f"{out} already holds packed files ({old[0].name}, ...); pass --overwrite to "
            "replace them, or choose another folder"
        )
    return old


def _pack_split(
    inp: Input,
    name: str,
    order: Index,
    out: Path,
    per_file: int,
    compression: Compression,
    on_error: str,
    bar: Bar,
    check: Callable[[], None],
    shuffled: bool = False,
) -> tuple[list[str], int, list[tuple[str, str]]]:
    """Write one split's files; their names, the samples written, what was skipped.
    ``shuffled``: ``order`` is a random permutation, which each file says (its
    ``SHUFFLED_ATTR`` attribute: the layer then reads it in long sequential stretches)."""
    cuts = [*range(per_file, len(order), per_file), len(order)]
    attrs: dict[str, Any] = {"packed_by": f"asynchdf5 {__version__} pack", **inp.attrs}
    if shuffled:
        attrs[SHUFFLED_ATTR] = True
    if inp.classes is not None:
        attrs["classes"] = np.array(inp.classes, dtype=h5py.string_dtype())
    names: list[str] = []
    written = 0
    skipped: list[tuple[str, str]] = []
    blocks = inp.blocks(order, cuts)
    try:
        pos = 0
        for cut in cuts:
            with FileWriter(out, inp.specs, cut - pos, compression, attrs) as writer:
                while pos < cut:
                    block = next(blocks)
                    for what, why in block.skipped:
                        if on_error == "stop":
                            raise PackError(
                                f"{what}: cannot read it ({why}); the pack stopped (no source "
                                "list written); --on-error skip leaves such inputs out"
                            )
                        bar.write(f"skipped {what}: {why}")
                    skipped += block.skipped
                    writer.append(block.rows)
                    pos += block.planned
                    bar.update(block.planned)
                    check()
                if writer.appended:  # else every input of the file was skipped: no file
                    final = out / f"{name}-{len(names):05d}.h5"
                    written += writer.commit(final)
                    names.append(final.name)
                check()
    finally:
        blocks.close()  # stops the image decoders' work in flight
    return names, written, skipped


def _not_rows(args: argparse.Namespace, out: Path) -> tuple[int, set[str]] | None:
    """Pack inputs whose samples are not fixed rows (:mod:`._pack_ragged`): ``.h5ad`` files
    (unless ``--tops`` asks for some of their datasets as rows) and tables with list columns.
    Returns the status and the names written; None for every other input."""
    inputs: list[Path] = args.inputs
    for p in inputs:
        if not p.exists():
            raise PackError(f"input {str(p)!r} does not exist")
    suffixes = {p.suffix.lower() for p in inputs}
    if suffixes == {H5AD_SUFFIX} and args.tops is None:
        status = pack_h5ad(args, out)
    elif suffixes <= set(_TABLE_SUFFIXES) and has_list_columns(inputs):
        status = pack_ragged_table(args, out, split, FILE_BYTES)
    elif args.tops and _kind(inputs) == "hdf5":
        try:
            entries = resolve_source(inputs[0] if len(inputs) == 1 else list(inputs))
        except DataLayerError as exc:
            raise PackError(str(exc)) from exc
        if not entries or not vlen_tops([Path(entries[0])], args.tops):
            return None
        status = pack_vlen(args, out, split, FILE_BYTES, entries)
    else:
        return None
    lists = [out / f"{name}.txt" for name in ("train", "val") if (out / f"{name}.txt").exists()]
    return status, {p.name for p in lists} | {n for p in lists for n in p.read_text().split()}


def pack(args: argparse.Namespace) -> int:
    out: Path = args.out_dir
    compression = Compression(args.compression, args.level)
    old = _check_out(out, args.overwrite)
    for p in old:  # the old lists go first: no list ever names old and new files together
        if p.suffix == ".txt":
            p.unlink()
    special = _not_rows(args, out)
    if special is not None:
        status, keep = special
        for p in old:
            if p.name not in keep:
                p.unlink(missing_ok=True)
        return status
    started = time.perf_counter()
    inp = open_input(args, out)
    try:
        row_bytes = sum(s.row_bytes for s in inp.specs.values())
        per_file = args.samples_per_file or max(1, FILE_BYTES // max(1, row_bytes))
        rng = np.random.default_rng(args.seed)
        train, val = split(inp.n, inp.labels, args.val, rng)
        if len(train) == 0:
            raise PackError(f"{inp.n} samples leave none for training with --val {args.val}")
        if args.shuffle:
            train, val = rng.permutation(train), rng.permutation(val)
        print(
            f"packing {plural(inp.n, 'sample')} of {row_bytes:,} bytes from {inp.description} "
            f"into {out}: " + ", ".join(f"{k} {v.dtype}{v.shape}" for k, v in inp.specs.items()),
            flush=True,
        )
        for missing in compression.decoders_missing():
            print(
                f"note: no decoder for {missing} outside h5py is installed here: the layer will "
                'read these files through h5py (pip install ".[codecs]" in the asynchdf5 checkout)',
                file=sys.stderr,
            )
        done: dict[str, tuple[list[str], int]] = {}
        skipped: list[tuple[str, str]] = []
        with progress_bar(inp.n, "packing", "sample") as bar, checkpoints() as check:
            for name, order in (("train", train), ("val", val)):
                if len(order) == 0:
                    continue
                files, rows, lost = _pack_split(
                    inp, name, order, out, per_file, compression, args.on_error, bar, check,
                    shuffled=args.shuffle,
                )  # fmt: skip
                skipped += lost
                if rows:
                    commit_text(out / f"{name}.txt", "\n".join(files) + "\n")
                    done[name] = (files, rows)
    finally:
        inp.close()
        # Whatever was being written when the pack stopped (an error, Ctrl-C) is not kept.
        for tmp in out.glob(f"{temporary_prefix()}*"):
            tmp.unlink(missing_ok=True)
    if not done:
        raise PackError(f"no sample of {inp.description} could be read")
    keep = {f for files, _ in done.values() for f in files} | {f"{n}.txt" for n in done}
    for p in old:
        if p.name not in keep:
            p.unlink(missing_ok=True)
    return _summary(inp, out, done, skipped, compression, time.perf_counter() - started)


def _summary(
    inp: Input,
    out: Path,
    done: dict[str, tuple[list[str], int]],
    skipped: list[tuple[str, str]],
    compression: Compression,
    seconds: float,
) -> int:
    stored = sum((out / f).stat().st_size for files, _ in done.values() for f in files)
    parts = [
        f"{name} {plural(rows, 'sample')} in {plural(len(files), 'file')} ({out / name}.txt)"
        for name, (files, rows) in done.items()
    ]
    print(f"wrote {'; '.join(parts)}: {mib(stored)} in {seconds:.1f} s")
    layouts = []
    for top, spec in inp.specs.items():
        options = compression.options(spec)
        layouts.append(f"{top}: " + (f"chunked, {compression.name}" if options else "contiguous"))
    print("layouts: " + "; ".join(layouts))
    if inp.classes is not None:
        shown = ", ".join(inp.classes[:10]) + (", ..." if len(inp.classes) > 10 else "")
        print(f"classes ({len(inp.classes)}, the files' `classes` attribute): {shown}")
    if skipped:
        print(f"skipped {plural(len(skipped), 'input')} that could not be read (listed above)")
    print(f"next: asynchdf5 inspect {out / 'train.txt'}  |  asynchdf5 bench {out / 'train.txt'}")
    return 0
