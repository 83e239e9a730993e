"""The catalog kept between runs: what h5py said about each local file, so that a source of
many shard files opens again without asking h5py.

Describing a file through h5py costs a millisecond or more; a source of 100,000 shards would
spend minutes on it at every opening. So the catalog of a local source (of at least
:data:`MIN_FILES` files) is kept in a file: beside the source list file that named the files
(``.train.txt.asynchdf5-catalog``), else, where that folder cannot be written or the source is
a sequence of paths, in the user's cache folder (``$XDG_CACHE_HOME/asynchdf5/catalogs``).
``ASYNCHDF5_CATALOG_CACHE=0`` turns it off; set to a folder, it is kept there instead.

An entry is used only for the very file it describes, checked without h5py when the layer
opens the file (which it does anyway): same path, inode, size, modification and change times
(the change time cannot be set back: a file rewritten in place with its size and modification
time restored does not match), and the same first :data:`HEAD_BYTES` bytes (its superblock and,
in small files, its object headers; one read of the page the signature check reads anyway).
A file changed within :data:`RACY_NS` of its description is not kept: its change time could
be repeated by a second change in the same tick of a coarse file-system clock. Only layouts
wholly inside the file are kept (``pread`` and ``chunks``); a file with any other top is
described by h5py every time, as are files whose entry does not match.

The cache file is checked whole (a format line and a digest of its contents) and each entry is
checked for sense against its file (extents and chunks inside it, decodable filters, a plain
numeric dtype) before use; a cache file that fails is ignored and written anew, never read as
a catalog. It holds no pickles. It is written to a temporary file in its folder and renamed
into place, so ranks writing it at once (``torchrun``) leave one whole file. It is trusted as
much as the list file beside it (whoever can write that folder can point the list elsewhere).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._codecs import unsupported_filters
from ._layout import ChunkIndex, Extent, Layout
from ._sources import StoredFile
from ._sources._local import LocalFile

__all__ = ["HEAD_BYTES", "MIN_FILES", "RACY_NS", "VARIABLE", "CatalogCache", "Described", "Kept"]

_log = logging.getLogger("asynchdf5")

#: The environment variable: ``0`` (or ``off``) turns the cache off; a folder keeps it there.
VARIABLE = "ASYNCHDF5_CATALOG_CACHE"
#: Sources of fewer files are described by h5py every time (it costs little).
MIN_FILES = 16
#: Bytes at the start of each file that an entry holds a digest of.
HEAD_BYTES = 4096
#: A file whose change time is less than this before the catalog was begun is not kept.
RACY_NS = 2 * 10**9
#: Cache files kept in the user's cache folder at most (the least recently written go first).
KEEP_IN_USER_CACHE = 64

_MAGIC = b"asynchdf5-catalog 2\n"
_DIGEST = 32  # hex characters of the blake2b digest of the contents
_DTYPE = re.compile(r"[<>|][biufc][0-9]{1,2}")
_MOST = 2**62

#: One top of one file: its dtype as stored, its shape, and its layout.
Described = tuple[np.dtype[Any], tuple[int, ...], Layout]


@dataclass(frozen=True)
class Kept:
    """A file as its entry describes it: each top, and whether the file says its samples were
    written in random order (``pack --shuffle``), which the order of every epoch depends on."""

    tops: dict[str, Described]
    shuffled: bool


#: One top's record, checked: its dtype as stored, its shape, and what makes its layout in a file.
_Template = tuple[np.dtype[Any], tuple[int, ...], Callable[[StoredFile], Layout]]


def _user_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "asynchdf5" / "catalogs"


def _locations(entries: Sequence[str]) -> list[Path]:
    """Where the cache of ``entries`` is read from, in order (written to the first that can
    be); [] when the cache is off."""
    setting = os.environ.get(VARIABLE, "").strip()
    if setting.lower() in ("0", "off", "no", "false"):
        return []
    lists = {getattr(e, "list_file", "") for e in entries}
    list_file = lists.pop() if len(lists) == 1 else ""
    key = f"list\0{list_file}" if list_file else "entries\0" + "\0".join(entries)
    name = hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()
    if setting:
        return [Path(setting).expanduser() / f"{name}.catalog"]
    out = []
    if list_file:
        folder, base = os.path.split(list_file)
        out.append(Path(folder) / f".{base}.asynchdf5-catalog")
    user = _user_folder()
    if user.is_absolute():  # else no home folder to keep it in
        out.append(user / f"{name}.catalog")
    return out


def _load(path: Path) -> dict[str, Any]:
    """The entries of the cache file ``path``; {} where it is missing or fails its checks."""
    try:
        data = path.read_bytes()
    except OSError:
        return {}
    try:
        head = len(_MAGIC) + _DIGEST + 1
        digest = data[len(_MAGIC) : head - 1].decode("ascii")
        body = data[head:]
        if (
            not data.startswith(_MAGIC)
            or data[head - 1 : head] != b"\n"
            or hashlib.blake2b(body, digest_size=_DIGEST // 2).hexdigest() != digest
        ):
            raise ValueError("not a catalog cache file, or its digest does not match")
        entries = json.loads(zlib.decompress(body))
        if not isinstance(entries, dict):
            raise ValueError("no entries")
        return entries
    except (ValueError, UnicodeDecodeError, zlib.error, RecursionError) as exc:
        _log.info("catalog cache %s ignored (%s); it is written anew", path, exc)
        return {}


def _int(x: object, low: int = 0, high: int = _MOST) -> int:
    if type(x) is not int or not low <= x <= high:
        raise ValueError(f"not an integer in [{low}, {high}]: {x!r}")
    return x


def _array(text: object, dtype: type[np.generic], n: int) -> np.ndarray:
    if not isinstance(text, str):
        raise ValueError("not an array")
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    a = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)
    if len(a) != n:
        raise ValueError(f"{len(a)} values, not {n}")
    return a


def _encode(a: np.ndarray, dtype: type[np.generic]) -> str:
    return base64.b64encode(a.astype(np.dtype(dtype).newbyteorder("<")).tobytes()).decode()


def _self_contained(file: StoredFile, layout: Layout) -> bool:
    """Whether ``layout`` is a fast path wholly inside ``file`` (what an entry may hold)."""
    if layout.path == "pread":
        return bool(layout.extents) and all(e.file is file for e in layout.extents)
    return layout.path == "chunks" and layout.chunks is not None and layout.chunks.file is file


def _layout_record(layout: Layout) -> list[Any]:
    if layout.path == "pread":
        return ["pread", [[e.offset, e.start, e.size] for e in layout.extents]]
    c = layout.chunks
    assert c is not None
    return [
        "chunks",
        list(c.shape),
        list(layout.filters),
        _encode(c.offsets.reshape(-1), np.int64),
        _encode(c.sizes.reshape(-1), np.int64),
        _encode(c.masks.reshape(-1), np.uint32),
    ]


def _template(text: object, size: int) -> _Template:
    """One top from its record (a JSON text), every number checked against a file of ``size``
    bytes: its dtype as stored, its shape, and what makes its layout in a file. ValueError (or
    TypeError, IndexError) where anything is off. Shards written alike have the same records:
    each is read and checked once per source (:meth:`CatalogCache.lookup`)."""
    if not isinstance(text, str):
        raise ValueError("not a top")
    record = json.loads(text)
    if not isinstance(record, list) or len(record) != 3:
        raise ValueError("not a top")
    dtype_str, shape_list, layout = record
    if not isinstance(dtype_str, str) or not _DTYPE.fullmatch(dtype_str):
        raise ValueError(f"not a plain numeric dtype: {dtype_str!r}")
    dtype = np.dtype(dtype_str)
    if dtype.kind not in "biufc" or dtype.subdtype is not None or dtype.str != dtype_str:
        raise ValueError(f"not a plain numeric dtype: {dtype_str!r}")
    if not isinstance(shape_list, list) or not 1 <= len(shape_list) <= 32:
        raise ValueError("not a shape")
    shape = tuple(_int(s) for s in shape_list)
    nbytes = dtype.itemsize * math.prod(shape)
    if nbytes <= 0 or nbytes > _MOST:
        raise ValueError(f"{nbytes} bytes of data")
    swap = not dtype.isnative and dtype.itemsize > 1
    if not isinstance(layout, list) or not layout:
        raise ValueError("not a layout")
    if layout[0] == "pread" and len(layout) == 2 and isinstance(layout[1], list):
        spans = []
        at = 0
        for item in layout[1]:
            if not isinstance(item, list) or len(item) != 3:
                raise ValueError("not an extent")
            offset, start, n = (_int(x) for x in item)
            if start != at or n == 0 or offset + n > size:
                raise ValueError("extents do not cover the data inside the file")
            spans.append((offset, start, n))
            at += n
        if at != nbytes:
            raise ValueError("extents do not cover the data")

        def pread(file: StoredFile) -> Layout:
            extents = tuple(Extent(file, o, s, n) for o, s, n in spans)
            return Layout("pread", "contiguous", swap=swap, extents=extents)

        return dtype, shape, pread
    if layout[0] == "chunks" and len(layout) == 6:
        _, chunk_, filters_, offsets_, sizes_, masks_ = layout
        if not isinstance(chunk_, list) or len(chunk_) != len(shape):
            raise ValueError("not a chunk shape")
        chunk = tuple(_int(c, 1) for c in chunk_)
        if not isinstance(filters_, list):
            raise ValueError("not a chunk layout")
        filters = tuple(_int(f, 0, 2**31) for f in filters_)
        if unsupported_filters(filters):
            raise ValueError("filters that cannot be decoded here")
        grid = tuple(-(-n // c) for n, c in zip(shape, chunk, strict=True))
        band = math.prod(grid[1:])
        n = grid[0] * band
        offsets = _array(offsets_, np.int64, n).reshape(grid[0], band)
        sizes = _array(sizes_, np.int64, n).reshape(grid[0], band)
        masks = _array(masks_, np.uint32, n).reshape(grid[0], band)
        if (offsets < 0).any() or (sizes < 0).any() or int((offsets + sizes).max()) > size:
            raise ValueError("chunks outside the file")
        if (masks >> len(filters)).any():
            raise ValueError("filter masks name filters the chunks do not have")
        if not filters and (sizes != dtype.itemsize * math.prod(chunk)).any():
            raise ValueError("unfiltered chunks not stored at their size")
        for a in (offsets, sizes, masks):
            a.setflags(write=False)  # shared by the files whose records are the same
        storage = f"chunked {chunk}"

        def chunks(file: StoredFile) -> Layout:
            index = ChunkIndex(file, chunk[0], offsets, sizes, masks, chunk, shape[1:])
            return Layout("chunks", storage, filters=filters, swap=swap, chunks=index)

        return dtype, shape, chunks
    raise ValueError("not a layout")


class CatalogCache:
    """The kept catalog of one source's local files: looked up file by file while the catalog
    is built, and written back (:meth:`save`) when anything was described anew."""

    def __init__(self, locations: list[Path]) -> None:
        self._locations = locations
        self._loaded = [_load(p) for p in locations]
        self._entries: dict[str, list[Any]] = {}  # what is true now: written by save()
        self._dirty = False
        self._begun = time.time_ns()
        self._templates: dict[tuple[str, int], _Template] = {}

    @classmethod
    def for_entries(cls, entries: Sequence[str]) -> CatalogCache | None:
        """The cache for a local source's ``entries``: None when it is off or the source has
        fewer than :data:`MIN_FILES` files."""
        if len(entries) < MIN_FILES:
            return None
        locations = _locations(entries)
        return cls(locations) if locations else None

    @staticmethod
    def _key(file: LocalFile) -> list[Any]:
        """The checks of an entry (the file pinned): inode, size, modification and change times,
        head digest (the device is left out: a network file system's differs from one machine
        to the next)."""
        fp = file.fingerprint
        head = os.pread(file.fd, min(HEAD_BYTES, fp.size), 0)
        digest = hashlib.blake2b(head, digest_size=16).hexdigest()
        return [fp.ino, fp.size, fp.mtime_ns, fp.ctime_ns, digest]

    def lookup(self, file: StoredFile, tops: Sequence[str]) -> Kept | None:
        """``file`` as its entry describes it, or None: no entry for the file as it is now,
        holding every top, that passes its checks. Blocking (one read of the file, which the
        caller has pinned)."""
        if not isinstance(file, LocalFile):
            return None
        key: list[Any] | None = None
        for loaded in self._loaded:
            entry = loaded.get(file.name)
            if not isinstance(entry, list) or len(entry) != 7 or not isinstance(entry[6], dict):
                continue
            if not isinstance(entry[5], bool):
                continue
            if key is None:
                key = self._key(file)
            if entry[:5] != key or not all(t in entry[6] for t in tops):
                continue
            try:
                found = {}
                for t in tops:
                    text = entry[6][t]
                    made = self._templates.get((text, file.size)) if type(text) is str else None
                    if made is None:
                        made = self._templates[text, file.size] = _template(text, file.size)
                    found[t] = (made[0], made[1], made[2](file))
            except (ValueError, TypeError, IndexError, binascii.Error) as exc:
                _log.info("catalog cache: the entry of %s is ignored (%s)", file.name, exc)
                continue
            self._entries[file.name] = entry
            return Kept(found, entry[5])
        return None

    def record(self, file: StoredFile, described: dict[str, Described], shuffled: bool) -> None:
        """Keep what h5py said of ``file`` (its tops as :func:`_template` reads them back), unless a
        top's layout reaches outside the file or the file changed too recently to tell a
        later change by its times."""
        if not isinstance(file, LocalFile) or file.fingerprint.ctime_ns >= self._begun - RACY_NS:
            return
        if not all(_self_contained(file, layout) for _, _, layout in described.values()):
            return
        tops = {
            t: json.dumps([dtype.str, list(shape), _layout_record(layout)], separators=(",", ":"))
            for t, (dtype, shape, layout) in described.items()
        }
        key = self._key(file)
        for old in (self._entries.get(file.name), *(d.get(file.name) for d in self._loaded)):
            if isinstance(old, list) and len(old) == 7 and old[:6] == [*key, shuffled]:
                if isinstance(old[6], dict):  # the other tops it holds, of other layers
                    tops = {**old[6], **tops}
                break
        self._entries[file.name] = [*key, shuffled, tops]
        self._dirty = True

    def save(self) -> None:
        """Write the entries of this source's files, if any was described anew: to a temporary
        file renamed into place, in the first location that takes it; nothing where none does."""
        if not self._dirty:
            return
        body = zlib.compress(json.dumps(self._entries, separators=(",", ":")).encode(), 1)
        digest = hashlib.blake2b(body, digest_size=_DIGEST // 2).hexdigest().encode()
        data = _MAGIC + digest + b"\n" + body
        for path in self._locations:
            try:
                if path.parent == _user_folder() or not path.parent.exists():
                    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
                try:
                    with os.fdopen(fd, "wb") as out:
                        os.fchmod(out.fileno(), 0o644)  # other users' runs may read it too
                        out.write(data)
                    os.replace(tmp, path)
                except BaseException:
                    os.unlink(tmp)
                    raise
            except OSError as exc:
                _log.debug("catalog cache: cannot write %s (%s)", path, exc)
                continue
            _log.debug("catalog cache: wrote %s (%d files)", path, len(self._entries))
            if path.parent == _user_folder():
                _prune(path.parent)
            self._dirty = False
            return
        where = ", ".join(map(str, self._locations))
        _log.info("catalog cache: no folder to keep it in (%s)", where)


def _prune(folder: Path) -> None:
    """Keep the newest :data:`KEEP_IN_USER_CACHE` cache files of the user's cache folder."""
    try:
        found = [(p.stat().st_mtime_ns, p) for p in folder.glob("*.catalog")]
    except OSError:
        return
    found.sort()
    for _, p in found[: max(0, len(found) - KEEP_IN_USER_CACHE)]:
        with contextlib.suppress(OSError):
            p.unlink()
