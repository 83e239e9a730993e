"""The keyword properties: parsed and checked once, into a frozen :class:`LayerConfig`.

Every layer class takes its properties through :meth:`LayerConfig.parse`, so a value is checked
the same way (and a bad one gets the same message) whichever class it is given to. The table of
properties in the documentation (``docs/properties.md``) is generated from :data:`PROPERTIES`
(``nox -s docs`` rewrites it with :func:`write_property_table`; a test keeps it current).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._delivery import parse_device
from ._distributed import broadcast_seed, detect, torch_distributed
from ._errors import ConfigurationError
from .transforms import Transformer

__all__ = [
    "DEFAULT_TOPS",
    "PROPERTIES",
    "LayerConfig",
    "Property",
    "document",
    "property_table",
    "write_property_table",
]

_log = logging.getLogger("asynchdf5")

DEFAULT_TOPS = ("data", "label")
#: ``block_size=None``: blocks of about this many bytes of samples (see benchmarks/RESULTS.md).
BLOCK_BYTES = 4 * 2**20
Backend = Literal["asyncio", "trio"]


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
        "resolved when the layer is constructed. See [source](semantics.md#the-source).",
        "hdf5",
    ),
    Property(
        "batch_size",
        "required",
        "Samples per batch. Every batch is full except, with `drop_last=False`, the last of an "
        "epoch.",
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
        f"{BLOCK_BYTES // 2**20} MiB of samples (see [choosing properties](choosing.md) and "
        "[shuffle quality](shuffle.md)).",
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
        "Memory budget of the host cache, in bytes. `None`: a third of the machine's physical "
        "memory. Streaming, the cache is two chunk slots (the one served and the one being read) "
        "of `chunk_size` samples (or of the whole shard, if smaller); when they would not fit, the "
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
        '(`pip install "asynchdf5[cuda12]"`). See {doc}`gpu`.',
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
        "For remote sources (fsspec URLs such as `s3://...`, extra `asynchdf5[remote]`): a dict "
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


# --- checks ------------------------------------------------------------------------------------


def _int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ConfigurationError(f"{name} must be an int, not {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ConfigurationError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigurationError(f"{name} must be True or False, not {value!r}")
    return bool(value)


def _tops(tops: object) -> tuple[str, ...]:
    if isinstance(tops, str):
        tops = (tops,)
    if not isinstance(tops, Sequence) or not all(isinstance(t, str) for t in tops):
        raise ConfigurationError(f"tops must be a sequence of dataset names, not {tops!r}")
    if not tops:
        raise ConfigurationError("tops is empty: name at least one dataset")
    seen: set[str] = set()
    for t in tops:
        if t in seen:
            raise ConfigurationError(f"top {t!r} is listed twice in tops={tuple(tops)!r}")
        seen.add(t)
    return tuple(tops)


def _transformers(value: object, tops: Sequence[str]) -> tuple[tuple[str, Transformer], ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ConfigurationError(
            f"transformers must be a sequence of (top, callable) pairs, not {value!r}"
        )
    out = []
    for i, pair in enumerate(value):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ConfigurationError(
                f"transformers[{i}] must be a (top, callable) pair, not {pair!r}"
            )
        top, fn = pair
        if top not in tops:
            raise ConfigurationError(
                f"transformers[{i}] is for top {top!r}, which is not one of tops={tuple(tops)!r}"
            )
        if not callable(fn):
            raise ConfigurationError(f"transformers[{i}] for top {top!r} is not callable: {fn!r}")
        out.append((str(top), fn))
    return tuple(out)


def _shard(rank: object, world_size: object) -> tuple[int, int, str]:
    """World size, rank and where they came from: explicit values override what the launcher
    says, but must agree with an initialised torch.distributed."""
    world = None if world_size is None else _int("world_size", world_size, minimum=1)
    this = None if rank is None else _int("rank", rank, minimum=0)
    found = detect() if world is None or this is None else None
    if torch_distributed() is not None:  # the group's own answer: explicit values must agree
        group = found or detect()
        for name, mine, theirs in (
            ("rank", this, group.rank),
            ("world_size", world, group.world_size),
        ):
            if mine is not None and mine != theirs:
                raise ConfigurationError(
                    f"{name}={mine} contradicts the initialised torch.distributed group, where it "
                    f"is {theirs}; leave {name}=None to take it from there"
                )
    if world is None:
        assert found is not None
        world = found.world_size
    if this is None:
        assert found is not None
        this = found.rank
    if this >= world:
        raise ConfigurationError(f"rank={this} is outside 0 ... world_size-1 = {world - 1}")
    source = "explicit" if found is None else found.source
    if found is not None:
        _log.info("asynchdf5: rank %d of %d (%s)", this, world, source)
    return world, this, source


def _options(value: object) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigurationError(
            f"storage_options must be a dict of fsspec options, not {type(value).__name__}"
        )
    return dict(value)


def _folder(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigurationError(f"{name} must be a folder path, not {value!r}")
    return os.path.abspath(os.path.expanduser(os.fspath(value)))


def _backend(value: object) -> Backend:
    if value not in ("asyncio", "trio"):
        raise ConfigurationError(f'backend must be "asyncio" or "trio", not {value!r}')
    if value == "trio" and "trio" not in sys.modules:
        try:
            import trio  # noqa: F401
        except ImportError as exc:
            raise ConfigurationError(
                'backend="trio" needs trio, which is not installed (pip install trio)'
            ) from exc
    return "trio" if value == "trio" else "asyncio"


# --- the configuration -------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerConfig:
    """Every keyword property of a layer, checked (see :data:`PROPERTIES` for their meaning).

    ``seed`` is always an int here: a fresh one is drawn when the property is None.
    """

    batch_size: int
    tops: tuple[str, ...]
    shuffle: bool
    chunk_size: int
    transformers: tuple[tuple[str, Transformer], ...]
    seed: int
    drop_last: bool
    rank: int
    world_size: int
    cache_bytes: int | None
    prefetch: int
    device: object
    reuse_buffers: bool
    backend: Backend
    storage_options: Mapping[str, Any] | None = None
    remote_cache: str | None = None
    remote_cache_bytes: int | None = None
    block_size: int | None = None
    #: Where rank and world_size came from: "explicit", or what :func:`detect` found.
    rank_source: str = "explicit"
    #: The seed property was given (not drawn): a state to resume must have the same one.
    seed_given: bool = True

    @classmethod
    def parse(
        cls,
        *,
        batch_size: object,
        tops: object = DEFAULT_TOPS,
        shuffle: object = False,
        chunk_size: object = 2**20,
        transformers: object = (),
        seed: object = None,
        drop_last: object = False,
        rank: object = None,
        world_size: object = None,
        cache_bytes: object = None,
        prefetch: object = 8,
        device: object = None,
        reuse_buffers: object = False,
        backend: object = "asyncio",
        storage_options: object = None,
        remote_cache: object = None,
        remote_cache_bytes: object = None,
        block_size: object = None,
    ) -> LayerConfig:
        """Check every property; raise :class:`ConfigurationError` naming the first bad one."""
        batch = _int("batch_size", batch_size, minimum=1)
        names = _tops(tops)
        chunk = _int("chunk_size", chunk_size, minimum=1)
        if chunk < batch:
            raise ConfigurationError(
                f"chunk_size={chunk} is smaller than batch_size={batch}; a chunk must hold at "
                "least one batch"
            )
        world, this, source = _shard(rank, world_size)
        mixed = _bool("shuffle", shuffle)
        given = seed is not None
        if seed is None:
            if world > 1 and mixed:
                if torch_distributed() is None:
                    raise ConfigurationError(
                        "shuffle=True with world_size > 1 needs an explicit seed, the same on "
                        "every rank, so that the ranks' shards stay disjoint (with an initialised "
                        "torch.distributed, rank 0's seed is broadcast instead)"
                    )
                seed = broadcast_seed(secrets.randbits(63))
            else:
                seed = secrets.randbits(63)
        reuse = _bool("reuse_buffers", reuse_buffers)
        if device is not None:
            parse_device(device)  # a malformed spec fails before CuPy is imported
        elif reuse:
            raise ConfigurationError(
                "reuse_buffers=True applies to device batches; set device= too (host batches "
                "are reused only once you let go of them, without asking)"
            )
        return cls(
            batch_size=batch,
            tops=names,
            shuffle=mixed,
            chunk_size=chunk,
            transformers=_transformers(transformers, names),
            seed=_int("seed", seed, minimum=0),
            drop_last=_bool("drop_last", drop_last),
            rank=this,
            world_size=world,
            cache_bytes=None
            if cache_bytes is None
            else _int("cache_bytes", cache_bytes, minimum=1),
            prefetch=_int("prefetch", prefetch, minimum=1),
            device=device,
            reuse_buffers=reuse,
            backend=_backend(backend),
            storage_options=_options(storage_options),
            remote_cache=_folder("remote_cache", remote_cache),
            remote_cache_bytes=None
            if remote_cache_bytes is None
            else _int("remote_cache_bytes", remote_cache_bytes, minimum=1),
            block_size=None if block_size is None else _int("block_size", block_size, minimum=1),
            rank_source=source,
            seed_given=given,
        )


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
