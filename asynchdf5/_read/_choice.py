"""Whether a source is served mapped (:mod:`._mapped`) or copied (:mod:`._reader`), and why.

``mmap=False`` copies. ``mmap=True`` maps whatever the mapped reader can serve: files with their
tops stored in them contiguously, uncompressed (or a fixed top in unfiltered chunks of whole
samples, a ragged or sparse top's heaps in unfiltered chunks of whole values, every chunk
written), in this machine's byte order, on Linux 5.14 or newer, at most :func:`max_files` of
them (one, with a ragged or sparse top: its heaps are not spliced across files), with a read
lease where Linux grants one and without one elsewhere.

``mmap="auto"`` (the default) maps only where no ``SIGBUS`` case that a lease can prevent is
left open, and copies everywhere else:

- the file is on a file system known to be local (:data:`LOCAL_FILE_SYSTEMS`, by the
  ``statfs`` magic number: an allow-list, so a network, FUSE or unknown one is copied), since a
  lease is this machine's and writes from another machine do not wait for it;
- the data set fits the memory the process may use (:func:`~.._machine.memory_bytes`): larger,
  it is read from the disk every epoch, and the copying reader streams it;
- a read lease is granted on every file (the file's owner, nobody has it open for writing, a
  lease-break time of at least :data:`~._lease.MIN_BREAK_S`), since without one a truncation is a
  ``SIGBUS``;
- a chunked top whose chunks lie at many *phases* (:data:`MAIN_PHASE`) is mapped only where the
  copying reader would stream the data set (not resident in its cache): a resident copy serves
  each row in one copy from memory, where such a mapped top's rows take two.

What no check can exclude, even then, is listed in :mod:`._lease` and docs/choosing.md.

Every answer is one line for ``layer.stats.read_notes`` and ``asynchdf5 inspect``:
``"mapped: ..."`` or ``"copied: ..."``.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import sys
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .._catalog import Catalog, FileInfo
from .._layout import Layout
from .._machine import memory_bytes
from .._sources._local import LocalFile
from ._lease import Lease
from ._maps import run_starts, supported

__all__ = [
    "LOCAL_FILE_SYSTEMS",
    "MAX_FILES",
    "Choice",
    "choose",
    "chunked_heaps",
    "file_system",
    "max_files",
    "probe",
    "refusal",
    "scattered",
]

#: The most files of a source that are mapped (see :func:`max_files`).
MAX_FILES = 64
#: File systems whose files ``mmap="auto"`` maps (``statfs`` ``f_type``): local disks and memory.
LOCAL_FILE_SYSTEMS = {
    0xEF53: "ext2/ext3/ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x794C7630: "overlay",
    0x2FC12FC1: "zfs",
    0xF2F52010: "f2fs",
    0xCA451A4E: "bcachefs",
    0x3153464A: "jfs",
    0x52654973: "reiserfs",
}
#: Others, named in the reason they are copied.
OTHER_FILE_SYSTEMS = {
    0x6969: "network file system nfs",
    0x517B: "network file system smb",
    0xFF534D42: "network file system cifs",
    0xFE534D42: "network file system smb2",
    0x65735546: "FUSE file system",
    0x00C36400: "network file system ceph",
    0x01021997: "network file system 9p",
    0x5346414F: "network file system afs",
    0x6B414653: "network file system afs",
    0x01161970: "cluster file system gfs2",
    0x7461636F: "cluster file system ocfs2",
    0x0BD00BD0: "network file system lustre",
    0x47504653: "network file system gpfs",
    0x20030528: "network file system orangefs",
    0x73757245: "network file system coda",
    0x564C: "network file system ncp",
}


def file_system(fd: int) -> int | None:
    """The ``statfs`` magic number of the file system that holds ``fd`` (None: not known)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fstatfs = libc.fstatfs
    except (OSError, AttributeError):
        return None
    # struct statfs starts with f_type (a long on the 64-bit ABIs; 120 bytes on x86-64).
    buf = (ctypes.c_long * 32)()
    fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
    fstatfs.restype = ctypes.c_int
    if fstatfs(fd, buf) != 0:
        return None
    return int(buf[0]) & 0xFFFFFFFF


def not_local(magic: int | None) -> str | None:
    """Why a file system of ``statfs`` magic number ``magic`` is not known to be local (None:
    it is; ``magic`` None: statfs could not tell)."""
    if magic is None:
        return "the file system could not be told (statfs)"
    if magic in LOCAL_FILE_SYSTEMS:
        return None
    return OTHER_FILE_SYSTEMS.get(magic, f"file system 0x{magic:x} is not known to be local")


def _local(file: LocalFile) -> str | None:
    """Why ``file`` is not known to be on a local file system (None: it is)."""
    return not_local(file_system(file.fd))


def _fs_name(file: LocalFile) -> str:
    magic = file_system(file.fd)
    if magic is None:
        return "a file system"
    if magic in LOCAL_FILE_SYSTEMS:
        return f"local file system {LOCAL_FILE_SYSTEMS[magic]}"
    return OTHER_FILE_SYSTEMS.get(magic, f"file system 0x{magic:x}")


def max_files() -> int:
    """The most files a source may have to be mapped: each mapped file holds a descriptor for
    its lease beside the source's own, so an eighth of the soft ``RLIMIT_NOFILE``, and at most
    :data:`MAX_FILES` (a lease's thread each, and a lease to check before each gather)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1
    if soft == resource.RLIM_INFINITY:
        return MAX_FILES
    return max(1, min(MAX_FILES, soft // 8))


def refusal(catalog: Catalog) -> str | None:
    """Why the mapped reader cannot serve this catalogued source at all (None: it can)."""
    why = supported()
    if why is not None:
        return why
    files = [f for f in catalog.files if f.nrows > 0]
    bound = max_files()
    if len(files) > bound:
        return (
            f"{len(files):,} files, more than the {bound} mapped at most (a read lease's "
            f"descriptor each: an eighth of RLIMIT_NOFILE, at most {MAX_FILES})"
        )
    if any(len(info.layouts) != len(catalog.tops) for info in files):
        return "the streams' tops differ in dtype or sample shape"  # (:mod:`.._schemas`)
    for top, spec in catalog.tops.items():
        if spec.windows is not None and spec.windows[0] != spec.windows[1]:
            length, stride = spec.windows
            return (
                f"top {top!r} is windows of {length} every {stride} elements, which are not the "
                "rows of its dataset"
            )
    for info in files:
        for top, layout in info.layouts.items():
            where = f"{info.name}: " if len(files) > 1 else ""
            parts = info.ragged.get(top)
            if parts is None:
                row_bytes = catalog.tops[top].row_bytes
                if layout.path == "chunks":
                    why = _unmappable_chunks(where, f"top {top!r}", layout, info, row_bytes)
                else:
                    why = _unmappable(where, f"top {top!r}", layout, info, row_bytes * info.nrows)
                if why is not None:
                    return why
                continue
            if parts.vlen is not None or parts.data is None:
                return f"{where}top {top!r} is a variable-length dataset (read through h5py)"
            if len(files) > 1:
                return (
                    f"top {top!r} has rows of varying length in {len(files)} files: mapped from "
                    "one file only"
                )
            n, spec = int(parts.indptr[-1]), catalog.tops[top]
            if n == 0:  # `indptr` gives its rows no values: no byte of its heaps is read
                continue
            assert spec.ragged is not None
            widths = (spec.dtype.itemsize * math.prod(spec.sample_shape), 0)
            if spec.ragged.index_dtype is not None:
                widths = (widths[0], spec.ragged.index_dtype.itemsize)
            heaps = (("data", parts.data), ("indices", parts.indices))
            for (member, heap), width in zip(heaps, widths, strict=True):
                if heap is None:
                    continue
                name = f"top {top!r} (its {member})"  # a member is no top of its own
                if heap.path == "chunks":
                    why = _unmappable_chunks(where, name, heap, info, width, n, "values")
                else:
                    why = _unmappable(where, name, heap, info, width * n, needs=_HEAP_NEEDS)
                if why is not None:
                    return why
    return None


def _needs(unit: str) -> str:
    """The storage a top is mapped from, ``unit`` what its stored chunks must hold whole (a
    fixed top's samples, a heap's values)."""
    heap = " (the heap of a ragged or sparse top)" if unit == "values" else ""
    return f"contiguous storage or unfiltered chunks of whole {unit}, every chunk written{heap}"


#: The storage a fixed top is mapped from.
_FIXED_NEEDS = _needs("samples")
#: The storage a ragged or sparse top's heap is mapped from: its values are cut by ``indptr``
#: out of one extent, or out of stored chunks of whole values (:class:`._maps.ChunkHeap`).
_HEAP_NEEDS = _needs("values")


def _unmappable(
    where: str, what: str, layout: Layout, info: FileInfo, size: int, needs: str = _FIXED_NEEDS
) -> str | None:
    """Why ``what`` (``top 'name'``, or a ragged top's heap: ``top 'name' (its data)``),
    stored as ``layout`` in file ``info``, cannot be mapped as the ``size`` bytes of its data
    (None: it can). ``needs``: the storage it is mapped from, said when it is not stored so."""
    if size == 0 and layout.path == "pread" and not layout.extents:  # rows of no bytes
        return None
    if layout.path != "pread" or len(layout.extents) != 1:
        how = f"stored {layout.storage}"
        if layout.note:
            how = f"read through h5py ({layout.note})"
        return f"{where}{what} is {how}: mapping needs {needs}"
    if layout.swap:
        return f"{where}{what} is stored in the other byte order"
    (ext,) = layout.extents
    if not isinstance(ext.file, LocalFile):
        return f"{where}{what} is not in a local file"
    if ext.file is not info.file:  # one lease guards one file
        return f"{where}{what} is stored in another file ({ext.file.name}): an external link"
    if size == 0 or ext.start != 0 or ext.size != size:
        return f"{where}{what}: its stored bytes do not hold exactly its rows"
    return None


#: The share of a chunked top's stored chunks that must lie at offsets that differ by whole rows
#: (one *phase*: offset modulo the row's bytes) for it to be mapped when the copying reader would
#: hold the data set resident. Those rows are one array of the mapping, a batch one ``np.take``
#: (one copy a row, as from memory). Chunks at many phases (the chunk index's nodes, or other
#: data, between runs of chunks: the default libver's v1 B-tree, file space alignment) are
#: gathered phase by phase and put in batch order, two copies a row
#: (:class:`._maps.ChunkRows`): slower than a resident copy's epochs (one copy a row, from
#: memory). Streamed, copying takes two copies a row too (read into a cache slot, then gathered),
#: so there such a top is mapped.
MAIN_PHASE = 7 / 8


def _unmappable_chunks(
    where: str,
    what: str,
    layout: Layout,
    info: FileInfo,
    row_bytes: int,
    nrows: int | None = None,
    unit: str = "samples",
) -> str | None:
    """Why ``what`` (as :func:`_unmappable`'s), stored chunked (``layout``) in file ``info``,
    cannot be mapped as ``nrows`` rows of ``row_bytes`` (None: the file's rows; it can): a
    fixed top's samples, or a ragged top's heap's values (``unit``). Only chunks whose bytes
    are exactly whole rows, as stored: a row is then at its chunk's offset plus its place in
    the chunk, never a guess."""
    index = layout.chunks
    assert index is not None
    nrows = info.nrows if nrows is None else nrows
    name = f"{where}{what} is stored {layout.storage}"
    if layout.filters:
        return f"{name}, filtered: mapping needs {_needs(unit)}"
    if index.band != 1 or index.splits_samples:
        # One chunk a run of rows, yet not the samples' shape: wider, padded past each sample.
        how = f"wider than its {unit} (padded)" if index.band == 1 else f"that split its {unit}"
        return f"{name}, chunks {how}: mapping needs chunks of whole {unit}"
    if layout.swap:
        return f"{where}{what} is stored in the other byte order"
    if not isinstance(index.file, LocalFile):
        return f"{where}{what} is not in a local file"
    if index.file is not info.file:  # one lease guards one file
        return f"{where}{what} is stored in another file ({index.file.name}): an external link"
    whole = index.rows * row_bytes
    if row_bytes == 0 or len(index.offsets) * index.rows < nrows or (index.sizes != whole).any():
        return f"{where}{what}: its stored chunks do not hold exactly its rows"
    return None


def scattered(catalog: Catalog) -> tuple[str, str] | None:
    """Where a chunked top of a mappable source has its chunks at many phases (none holding
    :data:`MAIN_PHASE` of them): the top and what that is, for a note (None: nowhere)."""
    files = [f for f in catalog.files if f.nrows > 0]
    for info in files:
        for top, layout in info.layouts.items():
            index = layout.chunks
            if layout.path != "chunks" or index is None or top in info.ragged:
                continue
            row_bytes = catalog.tops[top].row_bytes
            _, counts = np.unique(index.offsets[:, 0] % row_bytes, return_counts=True)
            if counts.max() < MAIN_PHASE * len(index.offsets):
                where = f"{info.name}: " if len(files) > 1 else ""
                share = counts.max() / len(index.offsets)
                return top, (
                    f"{where}top {top!r} is stored {layout.storage}, its chunks at {len(counts)} "
                    f"different offsets modulo its row's {row_bytes} bytes (the most at one: "
                    f"{share:.0%} of them; the chunk index or other data lies between runs of "
                    "chunks)"
                )
    return None


def chunked_heaps(catalog: Catalog) -> dict[str, str]:
    """How the heaps of a mappable source's ragged and sparse tops that are stored in chunks are
    read when mapped, for a note, by top (none stored so: empty). A row's values lie in one run
    of values; the chunks holding them are one span of the file where they are back to back in
    it (:class:`._maps.ChunkHeap`)."""
    said: dict[str, list[str]] = {}
    for info in catalog.files:
        if info.nrows == 0:
            continue
        for top, parts in info.ragged.items():
            members = [
                (member, heap.chunks)
                for member, heap in (("data", parts.data), ("indices", parts.indices))
                if heap is not None
                and heap.path == "chunks"
                and heap.chunks is not None
                and len(heap.chunks.offsets)
            ]
            if not members:
                continue
            runs = []
            for member, index in members:
                # Mapped (refusal found none), its chunks are stored whole: a size each.
                n = int(run_starts(index.offsets[:, 0], int(index.sizes[0, 0])).sum())
                runs.append(f"{member} chunked ({index.rows},) in {n} run{'s' * (n != 1)}")
            said.setdefault(top, []).append(
                f"top {top!r}: {' and '.join(runs)} of chunks back to back in the file"
            )
    return {
        top: f"{'; '.join(runs)}: a row's values copied from the mapped chunks as one span "
        "within a run, cut where a run ends"
        for top, runs in said.items()
    }


@dataclass
class Choice:
    """How a source is served: ``leases`` (one per file with rows) is set when it is mapped
    (each lease taken, or why none was: only with ``mmap=True``); ``common`` says how and why,
    of the whole source, and ``about`` what concerns a single top only; :attr:`note` says it
    all in one line, :meth:`note_of` only what concerns one top (each cause said once, under
    the tops it is a cause for)."""

    mapped: bool
    common: str
    leases: list[Lease | str] = field(default_factory=list)
    #: The property asked for mapping (``mmap=True``) and did not get it: worth a warning.
    refused: bool = False
    #: Mapped as ``mmap=True`` asked, where that reads slowly (a data set larger than the
    #: memory the process may use): why, for a warning; None otherwise.
    slow: str | None = None
    #: What is said of a single top only (how the mapped reader serves it), by top.
    about: dict[str, str] = field(default_factory=dict)

    @property
    def note(self) -> str:
        """How the source is served and why, in one line: ``common``, then ``about``."""
        return "; ".join([self.common, *self.about.values()])

    def note_of(self, top: str) -> str:
        """:attr:`note` as it concerns ``top``: what it says of the source, and of ``top``."""
        return "; ".join(filter(None, (self.common, self.about.get(top))))

    def close(self) -> None:
        """Give back the leases taken (the source will not be mapped after all)."""
        for lease in self.leases:
            if isinstance(lease, Lease):
                lease.close()
        self.leases = []


def choose(
    catalog: Catalog,
    mmap: bool | Literal["auto"],
    memory: int | None = None,
    *,
    resident: bool = True,
) -> Choice:
    """Map or copy ``catalog``'s source, as the ``mmap`` property says (blocking: a few system
    calls a file); ``memory``: what the process may use (None: :func:`~.._machine.memory_bytes`;
    0: not known); ``resident``: whether the copying reader would hold the data set in its
    cache (read once) rather than stream it every epoch. A mapped choice holds the files'
    leases: the mapped reader takes them over, or :meth:`Choice.close` gives them back."""
    if mmap is False:
        return Choice(False, "copied: mmap=False")
    why = refusal(catalog)
    if why is not None:
        return Choice(False, f"copied: {why}", refused=mmap is True)
    files: list[LocalFile] = []
    for info in catalog.files:
        if info.nrows > 0:
            assert isinstance(info.file, LocalFile)
            files.append(info.file)
    with contextlib.ExitStack() as stack:  # open (pinned) while they are looked at and leased
        for file in files:
            stack.enter_context(file.pinned())
        return _choose(catalog, mmap, memory, files, resident)


def _choose(
    catalog: Catalog,
    mmap: bool | Literal["auto"],
    memory: int | None,
    files: list[LocalFile],
    resident: bool,
) -> Choice:
    many = len(files) > 1
    spread = scattered(catalog)

    def of(file: LocalFile) -> str:
        return f" ({file.name})" if many else ""

    # Larger than the memory the process may use: read from the disk every epoch, where the
    # copying reader's streaming reads (direct, read ahead) beat faults on mapped pages.
    size = catalog.n_samples * catalog.mean_row_bytes
    if memory is None:
        memory = memory_bytes()
    larger = (
        f"the data set ({size / 2**30:.1f} GiB) is larger than the memory this process may "
        f"use ({memory / 2**30:.1f} GiB)"
        if 0 < memory < size
        else None
    )
    if mmap == "auto":
        if larger is not None:
            return Choice(False, f"copied: {larger}: streamed from the disk")
        if spread is not None and resident:
            return Choice(
                False,
                f"copied: {spread[1]}: held resident, a row is one copy from memory; mapped, its "
                "rows would be gathered phase by phase, two copies a row",
            )
        for file in files:
            remote = _local(file)
            if remote is not None:
                return Choice(False, f"copied: {remote}{of(file)}")
    choice = Choice(True, "")
    try:
        for file in files:
            lease = Lease.take(file)
            choice.leases.append(lease)
            if isinstance(lease, str) and mmap == "auto":
                choice.close()
                return Choice(False, f"copied: no read lease: {lease}{of(file)}")
    except BaseException:
        choice.close()
        raise
    unguarded = [
        (f, why) for f, why in zip(files, choice.leases, strict=True) if isinstance(why, str)
    ]
    if unguarded:
        file, why = unguarded[0]
        more = f" (and {len(unguarded) - 1} more)" if len(unguarded) > 1 else ""
        choice.common = f"mapped, not guarded by a lease: {why}{of(file)}{more}"
    elif many:
        kinds = ", ".join(sorted({_fs_name(f) for f in files}))
        choice.common = f"mapped: {len(files)} files on {kinds}, read leases held"
    else:
        choice.common = f"mapped: {_fs_name(files[0])}, read lease held"
    if spread is not None:
        top, what = spread
        choice.about[top] = f"{what}: its rows gathered phase by phase, two copies a row"
    for top, how in chunked_heaps(catalog).items():
        choice.about[top] = "; ".join(filter(None, (choice.about.get(top), how)))
    if larger is not None:  # only with mmap=True: "auto" copies it
        choice.slow = (
            f"{larger}: mapped, every batch faults its rows in from the disk a few pages at a "
            'time, at random; mmap="auto" streams it in large reads'
        )
        choice.common += f"; {larger}"
    return choice


def probe(catalog: Catalog, *, resident: bool = True) -> str:
    """What ``mmap="auto"`` would do with ``catalog``'s source, now (the leases taken and
    given back at once): the note of :func:`choose` (``resident``: as there)."""
    choice = choose(catalog, "auto", resident=resident)
    choice.close()
    return choice.note
