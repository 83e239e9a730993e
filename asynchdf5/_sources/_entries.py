"""The source property: a source list file, an HDF5 file, or a sequence of them, resolved to the
entries (absolute paths, or URLs) that a source opens.

Resolved when a layer is constructed, so a later ``os.chdir`` changes nothing. A source list file
may itself be a URL (read through fsspec, with the layer's ``storage_options``, at
construction); the relative entries of a remote list are relative to the list's URL.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

from .._errors import ConfigurationError, SourceError
from ._base import HDF5_SIGNATURE, file_url_path, is_url, name_entry, signature_offsets
from ._remote import read_source_url

__all__ = [
    "HDF5_SUFFIXES",
    "Entry",
    "SourceLike",
    "is_hdf5_file",
    "join_url",
    "name_entry",
    "resolve_source",
]

SourceLike = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]


class Entry(str):
    """A resolved entry (a path or URL, as a ``str``) that remembers where the source named it:
    ``where`` is ``"train.txt, line 3"`` for a list file's line, ``"source[2]"`` for an item of
    a sequence. It travels with the entry (copies, pickles), so that an error about the file,
    wherever it is raised, can say which line to fix (:func:`name_entry`). ``list_file``: the
    absolute path of the local list file that named it ("" otherwise), beside which the catalog
    of its files is kept (:mod:`asynchdf5._catalog_cache`)."""

    where: str
    list_file: str

    def __new__(cls, value: str, where: str, list_file: str = "") -> Entry:
        entry = super().__new__(cls, value)
        entry.where = where
        entry.list_file = list_file
        return entry

    def __reduce__(self) -> tuple[type[Entry], tuple[str, str, str]]:
        return Entry, (str(self), self.where, self.list_file)


def is_hdf5_file(path: Path) -> bool:
    """Whether ``path`` starts with the HDF5 signature (at offset 0 or a user-block offset)."""
    with open(path, "rb") as f:
        for offset in signature_offsets(os.fstat(f.fileno()).st_size):
            f.seek(offset)
            if f.read(8) == HDF5_SIGNATURE:
                return True
    return False


def _local(entry: str | os.PathLike[str], base: Path | None = None) -> str:
    """``entry`` as an absolute path (relative to ``base``, else to the working directory)."""
    # os.path, not pathlib: a list of 100,000 shards is resolved at construction.
    path = os.path.expanduser(os.fspath(entry))
    if not os.path.isabs(path):
        path = os.path.join(base if base is not None else os.getcwd(), path)
    return os.path.normpath(path)


def _parse_list(
    data: bytes, shown: str, resolve: Callable[[str], str], list_file: str = ""
) -> list[str]:
    """The entries of a source list file's ``data``, each resolved by ``resolve`` (URLs as they
    are), and remembering its line of the list (named by its file name: the entry's own path
    says where it is) and, for a local list, ``list_file``."""
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the first path.
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SourceError(
            f"source {shown!r} is neither an HDF5 file nor a source list file (it is not "
            "UTF-8 text); pass a list file naming HDF5 files, an HDF5 file, or a sequence of paths"
        ) from exc
    list_name = posixpath.basename(shown.split("?", 1)[0].rstrip("/")) or shown
    entries: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):  # "\n", "\r\n" and "\r" alike
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        where = f"{list_name}, line {number}"
        entries.append(Entry(entry if is_url(entry) else resolve(entry), where, list_file))
    if not entries:
        raise SourceError(f"source list file {shown!r} names no HDF5 file")
    return entries


def _read_list_file(path: Path) -> list[str]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SourceError(f"cannot read source list file {str(path)!r}: {exc}") from exc
    return _parse_list(data, str(path), lambda entry: _local(entry, path.parent), str(path))


def join_url(base: str, entry: str) -> str:
    """``entry`` (a relative path, or one from the root) resolved against the URL ``base``, as a
    link in a web page is: ``a/b.h5`` beside ``base``, ``/a/b.h5`` from its bucket or host."""
    scheme, _, rest = base.partition("://")
    host, _, path = rest.partition("/")
    if entry.startswith("/"):
        joined = posixpath.normpath(entry)
    else:
        joined = posixpath.normpath(posixpath.join("/" + posixpath.dirname(path), entry))
    if joined.startswith("//"):  # normpath keeps a leading "//"
        joined = "/" + joined.lstrip("/")
    return f"{scheme}://{host}{joined}"


#: A URL whose path ends so names an HDF5 file: kept as it is, checked when the layer opens
#: (no request at construction). Any other URL is read now: a source list file, or HDF5.
HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5", ".nc", ".nc4")


def _resolve_url(url: str, storage_options: Mapping[str, Any] | None) -> list[str]:
    """A source given as one URL: an HDF5 object, or a source list file (read now)."""
    path = file_url_path(url)
    if path is not None:  # a local file: local paths, relative to its folder
        return resolve_source(path)
    if url.split("?", 1)[0].lower().endswith(HDF5_SUFFIXES):
        return [url]
    data = read_source_url(url, storage_options)
    if data is None:
        return [url]
    return _parse_list(data, url, lambda entry: join_url(url, entry))


def resolve_source(
    source: SourceLike, *, storage_options: Mapping[str, Any] | None = None
) -> list[str]:
    """Resolve ``source`` to the entries it names, in order: absolute paths, or URLs.

    A ``str`` or path is a source list file (one path or URL per line; blank lines and lines
    starting with ``#`` are ignored; surrounding whitespace is stripped; relative paths are
    relative to the list file's folder), or an HDF5 file (a one-file source). Either may be a
    URL: one ending in an HDF5 suffix (``.h5``, ``.hdf5``, ...) is kept as it is, any other is
    read now through fsspec with ``storage_options`` (the relative entries of a remote list file
    are relative to its URL; a ``file://`` URL is a local path). A sequence names the files
    directly (relative paths: relative to the working directory now).
    """
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if is_url(text):
            return _resolve_url(text, storage_options)
        path = Path(_local(text))
        if not path.exists():
            raise SourceError(
                f"source {text!r} does not exist (it should be an HDF5 file, or a text file "
                "listing HDF5 files)"
            )
        if path.is_dir():
            raise SourceError(
                f"source {text!r} is a directory; pass a source list file, an HDF5 file or a "
                "sequence of HDF5 paths"
            )
        if not os.access(path, os.R_OK):
            raise SourceError(f"source {text!r} is not readable (permission denied)")
        if is_hdf5_file(path):
            return [str(path)]
        return _read_list_file(path)
    if isinstance(source, (bytes, bytearray)) or not isinstance(source, Sequence):
        raise ConfigurationError(
            f"source must be a path to a source list file or an HDF5 file, or a sequence of HDF5 "
            f"paths, not {type(source).__name__}"
        )
    entries: list[str] = []
    for i, item in enumerate(source):
        if not isinstance(item, (str, os.PathLike)):
            raise ConfigurationError(
                f"source entries must be paths, not {type(item).__name__}: {item!r}"
            )
        text = os.fspath(item)
        # An entry resolved before (a layer's paths, handed to a DataLoader's workers) keeps
        # where its list named it.
        where = getattr(item, "where", None) or f"source[{i}]"
        listed = getattr(item, "list_file", "")
        entries.append(Entry(text if is_url(text) else _local(text), where, listed))
    if not entries:
        raise SourceError("source is an empty sequence: name at least one HDF5 file")
    return entries
