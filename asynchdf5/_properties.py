"""The documentation of the keyword properties: :data:`PROPERTIES`, one entry per property.

The table of properties in the documentation (``docs/properties.md``) is generated from it
(``nox -s docs`` rewrites it with :func:`write_property_table`; a test keeps it current), and so
is the ``Parameters`` section of each layer's docstring (:func:`document`).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from typing import Literal

from ._config import BLOCK_BYTES, BLOCKS_PER_CHUNK, MIN_BLOCK_BYTES

__all__ = [
    "PROPERTIES",
    "Property",
    "document",
    "property_table",
    "write_property_table",
]


@dataclass(frozen=True)
class Property:
    """One keyword property, as the documentation lists it."""

    name: str
    default: str  # as shown in the docs
    doc: str
    #: Which layers take it: "all", or "hdf5" (not MemoryDataLayer).
    layers: Literal["all", "hdf5"] = "all"


PROPERTIES: tuple[Property, ...] = (
    Property(
        "source",
        "required",
        "The HDF5 files: the path of a *source list* file (one HDF5 path per line; blank lines and "
        "lines starting with `#` are ignored; relative paths are relative to the list file's "
        "folder), the path of one HDF5 file, or a sequence of HDF5 paths. Relative paths are "
        "resolved when the layer is constructed. See [source](semantics.md#the-source). Or "
        "several named *streams* mixed: a mapping of names to "
        "{class}`~asynchdf5.Stream` (`Stream(source, weight=...)` or `choose=` samples per "
        "epoch) or to plain sources (equal weights). See [mixing](mixing.md).",
        "hdf5",
    ),
    Property(
        "batch_size",
        "required",
        "Samples per batch, at most 2**40. Every batch is full except, with "
        "`drop_last=False`, the last of an epoch.",
    ),
    Property(
        "tops",
        '`("data", "label")`',
        "Names of the datasets to read from every file (group paths allowed, e.g. "
        '`"images/train"`); they are also the keys of every batch, in this order.',
    ),
    Property(
        "shuffle",
        "`False`",
        "`False`: batches in source order. `True`: each epoch draws a new order: the samples are "
        "cut into blocks of `block_size` contiguous samples, the blocks are permuted, each cached "
        "chunk is filled from the next blocks (drawn from all over the data set) and its samples "
        "are permuted. See [shuffle](semantics.md#shuffle).",
    ),
    Property(
        "chunk_size",
        "`2**20`",
        "Samples per chunk: the unit read from disk and held in the host cache. Larger chunks "
        "shuffle more globally and read in larger requests; smaller ones need less memory and "
        "start faster.",
        "hdf5",
    ),
    Property(
        "block_size",
        "`None`",
        "With `shuffle=True`: samples per contiguous block read from disk (the CorgiPile idea: "
        "block-wise random reads into the cache, then a shuffle within it). Smaller blocks mix "
        "better, larger ones read faster. `None`: blocks of about "
        f"{BLOCK_BYTES // 2**20} MiB of samples, but at most `chunk_size / {BLOCKS_PER_CHUNK}` "
        f"and at least {MIN_BLOCK_BYTES // 2**20} MiB; for data stored in chunks that are "
        "decoded whole (compressed), at least 4 of them; for remote objects, at least one whole "
        "request (8 MiB), as long as a chunk holds 16 blocks "
        "(see [choosing properties](choosing.md) and [shuffle quality](shuffle.md)).",
        "hdf5",
    ),
    Property(
        "transformers",
        "`()`",
        "`(top, callable)` pairs, applied in order to each batch's array of that top, in a worker "
        "thread. A callable takes an array of shape `(rows, *sample_shape)` and returns one with "
        "the same number of rows. Built-ins: {mod}`asynchdf5.transforms`.",
    ),
    Property(
        "seed",
        "`None`",
        "Seed of the shuffle. The same seed gives the same batches on every run; each epoch draws "
        "its own order from the seed and the epoch number. `None` draws a fresh seed (with an "
        "initialised `torch.distributed`, rank 0's, broadcast to every rank). Otherwise required "
        "with `shuffle=True` and `world_size > 1`, so that all ranks agree on the epoch's order.",
    ),
    Property(
        "drop_last",
        "`False`",
        "Leave out the last, partial batch of each epoch (and only it). Does not apply to "
        "`stream()`, whose batches are always full.",
    ),
    Property(
        "rank",
        "`None`",
        "This process's shard, `0 <= rank < world_size`, for data-parallel training. `None`: "
        "detected, from an initialised `torch.distributed`, else torchrun's `RANK`, else Open "
        "MPI's, PMI's or Slurm's variables, else 0. `layer.rank` says what was chosen.",
    ),
    Property(
        "world_size",
        "`None`",
        "Number of shards. The shards of an epoch are disjoint, cover every sample together, and "
        "give every rank the same number of batches. See [shards](semantics.md#shards). `None`: "
        "detected like `rank` (else 1); an explicit value that contradicts an initialised "
        "`torch.distributed` is a {class}`~asynchdf5.ConfigurationError`.",
    ),
    Property(
        "cache_bytes",
        "`None`",
        "Memory budget of the host cache, in bytes. `None`: a third of the room the process "
        "has when the layer opens: the machine's physical memory, or the container's memory "
        "limit (cgroup) where that is smaller, less what is held under it already (the "
        "process's anonymous memory, or its cgroup's), rounded down to three significant bits; "
        "where that third cannot hold a batch per slot and the batch buffers, opening is a "
        "{class}`~asynchdf5.ConfigurationError` naming the limit, rather than a process the "
        "kernel kills for memory mid-epoch. The batch buffers come on top of the cache, in "
        "groups of batches of at most a sixteenth of its size (and 8 MiB). Streaming, "
        "the cache is two chunk slots (the one served and the one being read) of `chunk_size` "
        "samples (or of the whole shard, if smaller); when they would not fit, the "
        "chunk size shrinks to fit, with a {class}`~asynchdf5.CacheBudgetWarning`; a budget that "
        "cannot hold one batch per slot is a {class}`~asynchdf5.ConfigurationError` at "
        "`async with`. When the whole data set is one chunk (at most `chunk_size` samples) and "
        "fits the budget, it is kept *resident*: read once, in the first epoch, and served from "
        "memory after that (`layer.stats.resident`).",
        "hdf5",
    ),
    Property(
        "prefetch",
        "`8`",
        "Batches gathered (and transformed) ahead of the consumer.",
    ),
    Property(
        "device",
        "`None`",
        'Where batches are delivered. `None`: NumPy arrays in host memory. `"cuda"`, '
        '`"cuda:N"`, an `int` or a `cupy.cuda.Device`: CuPy arrays on that GPU, uploaded from '
        "pinned memory on a separate CUDA stream. Needs CuPy "
        '(`pip install ".[cuda12]"` in the asynchdf5 checkout). See {doc}`gpu`.',
    ),
    Property(
        "reuse_buffers",
        "`False`",
        "With a `device` only: let the next batch reuse a batch's device memory as soon as it is "
        "asked for, even if the old batch is still held (device memory stays bounded whatever you "
        "keep; you promise to be done with each batch by then). Host batches never need it: their "
        "buffers are reused only once nothing refers to them.",
    ),
    Property(
        "storage_options",
        "`None`",
        "For remote sources (fsspec URLs such as `s3://...`, the `remote` extra): a dict "
        "of options passed to fsspec, e.g. credentials, `endpoint_url`, or `anon=True`. See "
        "[remote sources](remote.md).",
        "hdf5",
    ),
    Property(
        "remote_cache",
        "`None`",
        "For remote sources: a local folder where fetched bytes are kept, so that later epochs "
        "read them from local disk; `None` streams every epoch from the remote store.",
        "hdf5",
    ),
    Property(
        "remote_cache_bytes",
        "`None`",
        "For remote sources with a `remote_cache`: the most bytes kept there (least recently "
        "used first out); `None`: up to 90% of the folder's free space when the layer opens.",
        "hdf5",
    ),
    Property(
        "mmap",
        '`"auto"`',
        "Serve the rows of a local file straight from the operating system's page cache (the "
        "file memory-mapped) instead of copying each chunk into the host cache: one copy of "
        'every byte less, the same batches. `"auto"` maps where it is safe and copies '
        "elsewhere: files whose tops are stored in them contiguously, uncompressed, in this "
        "machine's byte order, on Linux 5.14 or newer, on a local file system (not NFS, SMB, "
        "FUSE or another network file system), no larger than the memory the process may use, "
        "on each of which the layer gets a read lease "
        "(the file's owner, nobody writing it), at most 64 files (and an eighth of "
        "`ulimit -n`). `True` maps whatever it can, "
        "without the file system check and without a lease where none is granted, and warns "
        "where it cannot; `False` always copies. `layer.stats.read_paths` says `mmap` for a "
        "mapped top, and `layer.stats.read_notes` says which and why (`asynchdf5 inspect` too). "
        "While a mapped layer is open, another program's truncation or open for writing waits "
        "for the gathers in flight, then the run ends with a {class}`~asynchdf5.ReadError`. "
        "What no check can exclude ends the process with `SIGBUS` instead: see "
        "[choosing](choosing.md#mmap-one-copy-less).",
        "hdf5",
    ),
    Property(
        "batch_mode",
        '`"stratified"`',
        'With several streams: how a batch is made of them. `"stratified"`: every batch '
        "holds each stream's share, rounded down or up so that each stream's count over the "
        'epoch is exact. `"random"`: the shares hold over the epoch, batches vary. '
        '`"per_stream"`: every batch from one stream (each stream\'s samples cut into batches '
        "as one source's are). Unused with one source. See [mixing](mixing.md).",
        "hdf5",
    ),
    Property(
        "process",
        "`False`",
        "`True`: run the pipeline (reading, cache, shuffle, gathering and the transformers) in "
        "one helper process, and hand each batch over through shared memory (no pickling: the "
        "batch's arrays view a slot of it). Your training step then shares neither the GIL nor "
        "the interpreter with the loader's threads, which is what a step that holds the GIL "
        "(kernel launches, optimizer bookkeeping in Python) needs. It costs a fresh Python "
        "process at `async with` (the first batch comes that much later), the memory of a "
        "second process, a copy of each batch into shared memory, and picklable transformers "
        "and options (checked at construction: a {class}`~asynchdf5.ConfigurationError` names "
        "the one that is not); the helper imports your main module as `multiprocessing`'s "
        '`spawn` does, so guard a script with `if __name__ == "__main__":`. Epochs, '
        "`stream()`, several streams, `state_dict()`, errors (the same type and message) and "
        "`stats` are as without it; a batch stays valid as long as you hold it. With a "
        "`device`, the helper gathers host batches and this process uploads them and runs the "
        "transformers on the device (they need not be picklable then). POSIX systems only. "
        "Off by default, as measured: it takes the loader off the step's GIL, but its "
        "start-up, the extra copy and the hand-over of each batch cost more than the GIL waits "
        "it removes unless the step holds the GIL and a core is free for the helper (see "
        "[choosing](choosing.md#a-helper-process-for-a-step-that-holds-the-gil)).",
        "hdf5",
    ),
    Property(
        "backend",
        '`"asyncio"`',
        "The anyio backend of the event loop that runs the pipeline when the layer is used with "
        '`with` / `for` (the sync interface): `"asyncio"` or `"trio"`. Unused with `async with`, '
        "which runs on the caller's event loop.",
    ),
)


def property_table(layers: Literal["all", "hdf5"] = "hdf5") -> str:
    """The Markdown table of the properties that ``layers`` take (``"hdf5"``: all of them)."""
    rows = ["| property | default | meaning |", "| --- | --- | --- |"]
    for p in PROPERTIES:
        if layers == "hdf5" or p.layers == "all":
            rows.append(f"| `{p.name}` | {p.default} | {p.doc} |")
    return "\n".join(rows) + "\n"


_MARKDOWN = re.compile(r"\{(\w+)\}`([^`]+)`|\[([^\]]+)\]\(([\w-]+)\.md[^)]*\)|`([^`]+)`")


def _rst(markdown: str) -> str:
    """A property's Markdown doc as reStructuredText for a numpydoc docstring."""

    def convert(m: re.Match[str]) -> str:
        role, target, link, page, code = m.groups()
        if role is not None:
            return f":{role}:`{target}`"
        if link is not None:
            return f":doc:`{link} <{page}>`"
        return f"``{code}``"

    return _MARKDOWN.sub(convert, markdown)


def document(cls: type, layers: Literal["all", "hdf5"], first: str = "") -> None:
    """Put a numpydoc ``Parameters`` section, made from :data:`PROPERTIES`, into ``cls``'s
    docstring (before its ``Examples``): ``first`` documents parameters before the properties."""
    lines = ["Parameters", "----------"]
    if first:
        lines += first.strip("\n").split("\n")
    for p in PROPERTIES:
        if layers == "hdf5" or p.layers == "all":
            default = "required" if p.default == "required" else f"default {_rst(p.default)}"
            lines.append(f"{p.name} : {default}")
            lines += textwrap.wrap(_rst(p.doc), 88, initial_indent="    ", subsequent_indent="    ")
    section = "\n".join("    " + line if line else "" for line in lines) + "\n\n"
    doc = cls.__doc__ or ""
    at = doc.find("    Examples\n    --------")
    cls.__doc__ = doc[:at] + section + doc[at:] if at >= 0 else doc + "\n" + section


def write_property_table(path: str) -> None:
    """Rewrite the generated table between the markers of ``path`` (``nox -s docs`` does)."""
    begin, end = "<!-- properties: begin -->\n", "<!-- properties: end -->\n"
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + begin + property_table() + end + tail)
