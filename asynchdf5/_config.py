"""The keyword properties: each one defined once, parsed and checked once into a frozen
:class:`LayerConfig`.

A property's name, type, default, check and documentation are one entry of :class:`Properties`
(those every layer takes) or :class:`HDF5Properties` (those only the HDF5 layers take): a
``TypedDict`` field annotated with its :class:`Property`. Everything else is derived from them:
the layers' keywords (``**properties: Unpack[HDF5Properties]``, which type checkers and IDEs
expand into flat keywords, and a runtime signature with the defaults, :func:`document`), the
``Parameters`` section of their docstrings, :meth:`LayerConfig.parse`, the torch adapter's
pass-through, and the table in ``docs/properties.md`` (:func:`write_property_table`, which
``nox -s docs`` runs; a test keeps it current and checks :class:`LayerConfig` against them).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import os
import re
import secrets
import sys
import textwrap
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np

from ._delivery import parse_device
from ._distributed import broadcast_seed, detect, torch_distributed
from ._errors import ConfigurationError
from ._shares import BATCH_MODES
from .transforms import Transformer

if sys.version_info >= (3, 11):
    from typing import Required, TypedDict
else:  # pragma: no cover
    from typing_extensions import Required, TypedDict

__all__ = [
    "DEFAULT_TOPS",
    "HDF5_PROPERTIES",
    "MAX_EPOCH_BATCHES",
    "MAX_SAMPLES",
    "PROPERTIES",
    "HDF5Properties",
    "LayerConfig",
    "Properties",
    "Property",
    "document",
    "property_table",
    "write_property_table",
]

_log = logging.getLogger("asynchdf5")

DEFAULT_TOPS = ("data", "label")
#: ``block_size=None``: blocks of about this many bytes of samples, big enough to read near a
#: sequential cold read's rate (docs/shuffle.md) ...
BLOCK_BYTES = 32 * 2**20
#: ... but at least this many blocks per chunk, so that small rows still mix (docs/shuffle.md).
BLOCKS_PER_CHUNK = 192
#: ... and never smaller than this: every block is a read request and a piece to gather, whose
#: cost per block slows a streaming epoch of smaller blocks, even from the page cache ...
MIN_BLOCK_BYTES = 2**20
#: A block decodes every stored (HDF5) chunk it touches whole: blocks of compressed data span at
#: least this many stored chunks, so that an epoch decodes at most ~1/this more than its data ...
STORED_CHUNKS_PER_BLOCK = 4
#: ... while a cached chunk still holds at least this many blocks.
MIN_BLOCKS_PER_CHUNK = 16
#: The ramp of an epoch's first read (``_sizing.first_read``) takes each piece from this many
#: places of the first chunk (lanes), so that its first batches mix as a later chunk's do
#: (docs/shuffle.md) ...
RAMP_LANES = 32
#: ... and each piece after the first twice the lanes of the one before, up to this many (a
#: piece twice as large, parts as large: ``_walk.growing_ramp``) ...
RAMP_TOP_LANES = 192
#: ... each lane's part of the first piece at least this big (a read each; and at least a
#: stored chunk decoded whole, or a remote request: see ``_sizing.ramp_lanes``).
MIN_LANE_BYTES = 256 * 2**10
#: A chunk drawing from fewer places of the data set than this (its blocks and lanes) mixes
#: class-sorted data noticeably worse than a full permutation (docs/shuffle.md): the layer warns
#: (``_sizing.mixing_warning``).
MIN_PLACES = 36

#: The most samples a batch may hold (``batch_size``), and a stream may choose per epoch
#: (``Stream(choose=...)``): an epoch's positions are int64 and its batches are planned in
#: memory, so a count far beyond any data set would end in a raw NumPy error at the first plan.
MAX_SAMPLES = 2**40
#: The most batches a plan of an epoch of chosen streams may hold: the plan keeps a row of
#: counts per batch (``_shares.epoch_table``), 8 bytes per stream each.
MAX_EPOCH_BATCHES = 2**26


# --- checks of one value -----------------------------------------------------------------------

#: A property's check: its name and the given value in, the parsed value out (or a
#: :class:`ConfigurationError` naming the property).
Check = Callable[[str, object], Any]


def _int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ConfigurationError(f"{name} must be an int, not {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ConfigurationError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigurationError(
            f"{name} must be <= {maximum} (2**{maximum.bit_length() - 1}), got {value}"
        )
    return int(value)


def _count(minimum: int, maximum: int | None = None) -> Check:
    """An int from ``minimum`` to ``maximum``."""
    return lambda name, value: _int(name, value, minimum=minimum, maximum=maximum)


def _optional(check: Check) -> Check:
    """``None``, or what ``check`` accepts."""
    return lambda name, value: None if value is None else check(name, value)


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigurationError(f"{name} must be True or False, not {value!r}")
    return bool(value)


def _mmap(name: str, value: object) -> bool | Literal["auto"]:
    if isinstance(value, str) and value == "auto":
        return "auto"
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigurationError(f'{name} must be True, False or "auto", not {value!r}')
    return bool(value)


def _tops(name: str, tops: object) -> tuple[str, ...]:
    if isinstance(tops, str):
        tops = (tops,)
    if not isinstance(tops, Sequence) or not all(isinstance(t, str) for t in tops):
        raise ConfigurationError(f"{name} must be a sequence of dataset names, not {tops!r}")
    if not tops:
        raise ConfigurationError(f"{name} is empty: name at least one dataset")
    seen: set[str] = set()
    for t in tops:
        if t in seen:
            raise ConfigurationError(f"top {t!r} is listed twice in {name}={tuple(tops)!r}")
        seen.add(t)
    return tuple(tops)


def _transformers(name: str, value: object) -> tuple[tuple[str, Transformer], ...]:
    """(top, callable) pairs; whether each top is one of the tops, :meth:`LayerConfig.parse`
    checks."""
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ConfigurationError(
            f"{name} must be a sequence of (top, callable) pairs, not {value!r}"
        )
    out = []
    for i, pair in enumerate(value):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ConfigurationError(f"{name}[{i}] must be a (top, callable) pair, not {pair!r}")
        top, fn = pair
        if not callable(fn):
            raise ConfigurationError(f"{name}[{i}] for top {top!r} is not callable: {fn!r}")
        out.append((top, fn))
    return tuple(out)


def _device(name: str, value: object) -> object:
    if value is not None:
        parse_device(value)  # a malformed spec fails before CuPy is imported
    return value


def _options(name: str, value: object) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigurationError(
            f"{name} must be a dict of fsspec options, not {type(value).__name__}"
        )
    return dict(value)


def _folder(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigurationError(f"{name} must be a folder path, not {value!r}")
    return os.path.abspath(os.path.expanduser(os.fspath(value)))


def _batch_mode(name: str, value: object) -> str:
    if value not in BATCH_MODES:
        raise ConfigurationError(
            f"{name} must be one of {', '.join(map(repr, BATCH_MODES))}, not {value!r}"
        )
    return str(value)


# --- the properties ----------------------------------------------------------------------------

#: The default of a property that must be given.
REQUIRED: Any = inspect.Parameter.empty


@dataclass(frozen=True)
class Property:
    """What a property's annotation holds beside its type: its default, its check of one value
    (checks across properties are :meth:`LayerConfig.parse`'s) and its documentation
    (Markdown, as ``docs/properties.md`` shows it)."""

    default: Any
    check: Check
    doc: str
    #: The default as the documentation shows it ("": as Python writes it).
    shown: str = ""

    def shown_default(self) -> str:
        if self.default is REQUIRED:
            return "required"
        if self.shown:
            return f"`{self.shown}`"
        return f"`{_literal(self.default)}`"


def _literal(value: object) -> str:
    """``value`` as the docs write it (strings in double quotes)."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_literal, value)) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


#: The documentation of the HDF5 layers' ``source`` (a parameter, not a property).
SOURCE_DOC = (
    "The HDF5 files: the path of a *source list* file (one HDF5 path per line; blank lines and "
    "lines starting with `#` are ignored; relative paths are relative to the list file's "
    "folder), the path of one HDF5 file, or a sequence of HDF5 paths. Relative paths are "
    "resolved when the layer is constructed. See [source](semantics.md#the-source). Or "
    "several named *streams* mixed: a mapping of names to "
    "{class}`~asynchdf5.Stream` (`Stream(source, weight=...)` or `choose=` samples per "
    "epoch) or to plain sources (equal weights). See [mixing](mixing.md)."
)


class Properties(TypedDict, total=False):
    """The keyword properties every layer takes (:class:`~asynchdf5.MemoryDataLayer` only
    these), each annotated with its type and its :class:`Property`."""

    batch_size: Required[
        Annotated[
            int,
            Property(
                REQUIRED,
                _count(1, MAX_SAMPLES),
                "Samples per batch, at most 2**40. Every batch is full except, with "
                "`drop_last=False`, the last of an epoch.",
            ),
        ]
    ]
    tops: Annotated[
        Sequence[str],
        Property(
            DEFAULT_TOPS,
            _tops,
            "Names of the datasets to read from every file (group paths allowed, e.g. "
            '`"images/train"`); they are also the keys of every batch, in this order.',
        ),
    ]
    shuffle: Annotated[
        bool,
        Property(
            False,
            _bool,
            "`False`: batches in source order. `True`: each epoch draws a new order: the samples "
            "are cut into blocks of `block_size` contiguous samples, the blocks are permuted, each "
            "cached chunk is filled from the next blocks (drawn from all over the data set) and "
            "its samples are permuted. See [shuffle](semantics.md#shuffle).",
        ),
    ]
    transformers: Annotated[
        Sequence[tuple[str, Transformer]],
        Property(
            (),
            _transformers,
            "`(top, callable)` pairs, applied in order to each batch's array of that top, in a "
            "worker thread. A callable takes an array of shape `(rows, *sample_shape)` and returns "
            "one with the same number of rows. Built-ins: {mod}`asynchdf5.transforms`.",
        ),
    ]
    seed: Annotated[
        int | None,
        Property(
            None,
            _optional(_count(0)),
            "Seed of the shuffle. The same seed gives the same batches on every run; each epoch "
            "draws its own order from the seed and the epoch number. `None` draws a fresh seed "
            "(with an initialised `torch.distributed`, rank 0's, broadcast to every rank). "
            "Otherwise required with `shuffle=True` and `world_size > 1`, so that all ranks agree "
            "on the epoch's order.",
        ),
    ]
    drop_last: Annotated[
        bool,
        Property(
            False,
            _bool,
            "Leave out the last, partial batch of each epoch (and only it). Does not apply to "
            "`stream()`, whose batches are always full.",
        ),
    ]
    rank: Annotated[
        int | None,
        Property(
            None,
            _optional(_count(0)),
            "This process's shard, `0 <= rank < world_size`, for data-parallel training. `None`: "
            "detected, from an initialised `torch.distributed`, else torchrun's `RANK`, else Open "
            "MPI's, PMI's or Slurm's variables, else 0. `layer.rank` says what was chosen.",
        ),
    ]
    world_size: Annotated[
        int | None,
        Property(
            None,
            _optional(_count(1)),
            "Number of shards. The shards of an epoch are disjoint, cover every sample together, "
            "and give every rank the same number of batches. See [shards](semantics.md#shards). "
            "`None`: detected like `rank` (else 1); an explicit value that contradicts an "
            "initialised `torch.distributed` is a {class}`~asynchdf5.ConfigurationError`.",
        ),
    ]
    prefetch: Annotated[
        int,
        Property(
            8,
            _count(1),
            "Batches gathered (and transformed) ahead of the consumer.",
        ),
    ]
    device: Annotated[
        object,
        Property(
            None,
            _device,
            'Where batches are delivered. `None`: NumPy arrays in host memory. `"cuda"`, '
            '`"cuda:N"`, an `int` or a `cupy.cuda.Device`: CuPy arrays on that GPU, uploaded from '
            "pinned memory on a separate CUDA stream. Needs CuPy "
            '(`pip install ".[cuda12]"` in the asynchdf5 checkout). See {doc}`gpu`.',
        ),
    ]
    reuse_buffers: Annotated[
        bool,
        Property(
            False,
            _bool,
            "With a `device` only: let the next batch reuse a batch's device memory as soon as it "
            "is asked for, even if the old batch is still held (device memory stays bounded "
            "whatever you keep; you promise to be done with each batch by then). Host batches "
            "never need it: their buffers are reused only once nothing refers to them.",
        ),
    ]


class HDF5Properties(Properties, total=False):
    """The keyword properties of the HDF5 layers: :class:`Properties` and these."""

    chunk_size: Annotated[
        int,
        Property(
            2**20,
            _count(1),
            "Samples per chunk: the unit read from disk and held in the host cache. Larger chunks "
            "shuffle more globally and read in larger requests; smaller ones need less memory and "
            "start faster.",
            shown="2**20",
        ),
    ]
    block_size: Annotated[
        int | None,
        Property(
            None,
            _optional(_count(1)),
            "With `shuffle=True`: samples per contiguous block read from disk (the CorgiPile idea: "
            "block-wise random reads into the cache, then a shuffle within it). Smaller blocks mix "
            "better, larger ones read faster. `None`: blocks of about "
            f"{BLOCK_BYTES // 2**20} MiB of samples, but at most `chunk_size / {BLOCKS_PER_CHUNK}` "
            f"and at least {MIN_BLOCK_BYTES // 2**20} MiB; for data stored in chunks that are "
            "decoded whole (compressed), at least 4 of them; for remote objects, at least one "
            "whole request (8 MiB), as long as a chunk holds 16 blocks "
            "(see [choosing properties](choosing.md) and [shuffle quality](shuffle.md)).",
        ),
    ]
    cache_bytes: Annotated[
        int | None,
        Property(
            None,
            _optional(_count(1)),
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
            "chunk size shrinks to fit, with a {class}`~asynchdf5.CacheBudgetWarning`; a budget "
            "that cannot hold one batch per slot is a {class}`~asynchdf5.ConfigurationError` at "
            "`async with`. When the whole data set is one chunk (at most `chunk_size` samples) and "
            "fits the budget, it is kept *resident*: read once, in the first epoch, and served "
            "from memory after that (`layer.stats.resident`).",
        ),
    ]
    storage_options: Annotated[
        Mapping[str, Any] | None,
        Property(
            None,
            _options,
            "For remote sources (fsspec URLs such as `s3://...`, the `remote` extra): a dict "
            "of options passed to fsspec, e.g. credentials, `endpoint_url`, or `anon=True`. See "
            "[remote sources](remote.md).",
        ),
    ]
    remote_cache: Annotated[
        str | os.PathLike[str] | None,
        Property(
            None,
            _folder,
            "For remote sources: a local folder where fetched bytes are kept, so that later epochs "
            "read them from local disk; `None` streams every epoch from the remote store.",
        ),
    ]
    remote_cache_bytes: Annotated[
        int | None,
        Property(
            None,
            _optional(_count(1)),
            "For remote sources with a `remote_cache`: the most bytes kept there (least recently "
            "used first out); `None`: up to 90% of the folder's free space when the layer opens.",
        ),
    ]
    mmap: Annotated[
        bool | Literal["auto"],
        Property(
            "auto",
            _mmap,
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
            "where it cannot and where the data set is larger than the memory the process may "
            "use (its batches then fault their rows in from the disk a few pages at a time); "
            "`False` always copies. `layer.stats.read_paths` says `mmap` for a "
            "mapped top, and `layer.stats.read_notes` says which and why (`asynchdf5 inspect` "
            "too). While a mapped layer is open, another program's truncation or open for writing "
            "waits for the gathers in flight, then the run ends with a "
            "{class}`~asynchdf5.ReadError`. What no check can exclude ends the process with "
            "`SIGBUS` instead: see [choosing](choosing.md#mmap-one-copy-less).",
        ),
    ]
    batch_mode: Annotated[
        Literal["stratified", "random", "per_stream"],
        Property(
            "stratified",
            _batch_mode,
            'With several streams: how a batch is made of them. `"stratified"`: every batch '
            "holds each stream's share, rounded down or up so that each stream's count over the "
            'epoch is exact. `"random"`: the shares hold over the epoch, batches vary. '
            '`"per_stream"`: every batch from one stream (each stream\'s samples cut into batches '
            "as one source's are). Unused with one source. See [mixing](mixing.md).",
        ),
    ]
    process: Annotated[
        bool,
        Property(
            False,
            _bool,
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
        ),
    ]


def _registry(properties: type) -> dict[str, tuple[Any, Property]]:
    """Each field of a properties ``TypedDict``: its type and its :class:`Property`."""
    out = {}
    for name, hint in typing.get_type_hints(properties, include_extras=True).items():
        if typing.get_origin(hint) is Required:
            (hint,) = typing.get_args(hint)
        kind, meta = typing.get_args(hint)[0], hint.__metadata__
        (prop,) = (m for m in meta if isinstance(m, Property))
        out[name] = (kind, prop)
    return out


#: Every layer's properties, in the order they are documented: name -> (type, Property).
PROPERTIES = _registry(Properties)
#: The HDF5 layers' properties: :data:`PROPERTIES`, then their own.
HDF5_PROPERTIES = _registry(HDF5Properties)


# --- the configuration -------------------------------------------------------------------------


def _shard(world: int | None, this: int | None) -> tuple[int, int, str]:
    """World size, rank and where they came from: explicit values override what the launcher
    says, but must agree with an initialised torch.distributed."""
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


@dataclass(frozen=True)
class LayerConfig:
    """Every keyword property of a layer, checked (:data:`HDF5_PROPERTIES` says what each
    means; a test keeps these fields and that registry alike).

    ``seed``, ``rank`` and ``world_size`` are always ints here: drawn or detected when the
    property is None.
    """

    batch_size: int
    tops: tuple[str, ...]
    shuffle: bool
    transformers: tuple[tuple[str, Transformer], ...]
    seed: int
    drop_last: bool
    rank: int
    world_size: int
    prefetch: int
    device: object
    reuse_buffers: bool
    chunk_size: int
    block_size: int | None
    cache_bytes: int | None
    storage_options: Mapping[str, Any] | None
    remote_cache: str | None
    remote_cache_bytes: int | None
    #: ``"auto"``: mapped where no documented ``SIGBUS`` case can reach (``_read._choice``).
    mmap: bool | Literal["auto"]
    batch_mode: str
    #: Run the pipeline in one helper process; batches come through shared memory
    #: (``_process``).
    process: bool
    #: Where rank and world_size came from: "explicit", or what :func:`detect` found.
    rank_source: str = "explicit"
    #: The seed property was given (not drawn): a state to resume must have the same one.
    seed_given: bool = True

    @classmethod
    def parse(
        cls,
        properties: Mapping[str, object],
        *,
        hdf5: bool = True,
        streams: bool = False,
        caller: str = "LayerConfig.parse",
    ) -> LayerConfig:
        """Check every property (those of :data:`HDF5_PROPERTIES`, or with ``hdf5=False`` of
        :data:`PROPERTIES`, the rest at their defaults); raise :class:`ConfigurationError`
        naming the first bad one, and ``TypeError`` (as Python does) for a keyword that is none
        of them or a missing ``batch_size``. ``streams``: the source is a mapping of streams,
        whose own tops a transformer may name: the streams check the transformers' tops
        (:func:`~._streams.parse_streams`), once each stream's tops are known."""
        takes = HDF5_PROPERTIES if hdf5 else PROPERTIES
        if "backend" in properties:
            warnings.warn(
                "backend= is deprecated and has no effect: with `with` / `for` the pipeline "
                "runs on asyncio in a background thread, and with `async with` on the caller's "
                "event loop (asyncio or trio); leave it out",
                DeprecationWarning,
                stacklevel=3,
            )
            properties = {k: v for k, v in properties.items() if k != "backend"}
        for name in properties:
            if name not in takes:
                close = difflib.get_close_matches(name, list(takes), n=1, cutoff=0.75)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}{hint}")
        v: dict[str, Any] = {}
        for name, (_, prop) in HDF5_PROPERTIES.items():
            if name not in properties and prop.default is REQUIRED:
                raise TypeError(f"{caller}() missing 1 required keyword-only argument: {name!r}")
            v[name] = prop.check(name, properties.get(name, prop.default))
        # --- across properties
        batch = v["batch_size"]
        if hdf5 and v["chunk_size"] < batch:
            raise ConfigurationError(
                f"chunk_size={v['chunk_size']} is smaller than batch_size={batch}; a chunk must "
                "hold at least one batch"
            )
        v["world_size"], v["rank"], source = _shard(v["world_size"], v["rank"])
        given = v["seed"] is not None
        if not given:
            seed = secrets.randbits(63)
            if v["world_size"] > 1 and v["shuffle"]:
                if torch_distributed() is None:
                    raise ConfigurationError(
                        "shuffle=True with world_size > 1 needs an explicit seed, the same on "
                        "every rank, so that the ranks' shards stay disjoint (with an initialised "
                        "torch.distributed, rank 0's seed is broadcast instead)"
                    )
                seed = broadcast_seed(seed)
            v["seed"] = _int("seed", seed, minimum=0)
        if v["reuse_buffers"] and v["device"] is None:
            raise ConfigurationError(
                "reuse_buffers=True applies to device batches; set device= too (host batches "
                "are reused only once you let go of them, without asking)"
            )
        tops = v["tops"]
        for i, (top, _) in enumerate(() if streams else v["transformers"]):
            if top not in tops:
                raise ConfigurationError(
                    f"transformers[{i}] is for top {top!r}, which is not one of "
                    f"tops={tuple(tops)!r}"
                )
        return cls(**v, rank_source=source, seed_given=given)

    def on_host(self) -> LayerConfig:
        """This configuration with host batches, untransformed: what the helper process of
        ``process=True`` runs when this process uploads and transforms them."""
        return dataclasses.replace(self, device=None, transformers=(), reuse_buffers=False)


# --- the documentation -------------------------------------------------------------------------


def property_table() -> str:
    """The Markdown tables of the properties: every layer's, then the HDF5 layers' own."""
    head = "| property | default | meaning |\n| --- | --- | --- |\n"
    every: list[str] = []
    hdf5 = [f"| `source` | required | {SOURCE_DOC} |"]
    for name, (_, p) in HDF5_PROPERTIES.items():
        (every if name in PROPERTIES else hdf5).append(
            f"| `{name}` | {p.shown_default()} | {p.doc} |"
        )
    return (
        "Every layer's:\n\n" + head + "\n".join(every) + "\n\n"
        "The HDF5 layers' only:\n\n" + head + "\n".join(hdf5) + "\n"
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


def document(
    cls: type,
    hdf5: bool,
    first: str = "",
    defaults: Mapping[str, object] | None = None,
) -> None:
    """Derive ``cls``'s keywords from the registry: a runtime signature of its ``__init__`` (its
    own parameters, then each property as a flat keyword with its type and default, for
    ``help()``, IDEs that inspect objects, and Sphinx), and a numpydoc ``Parameters`` section
    in its docstring (before its ``Examples``). ``first`` documents the parameters before the
    properties; ``defaults`` overrides a default as this class applies it. The signature goes
    on the ``__init__`` that ``cls`` has, its own or inherited (a class that shares it with
    another shares the signature too)."""
    takes = HDF5_PROPERTIES if hdf5 else PROPERTIES
    shown = dict(defaults or {})
    target: Any = typing.cast(Any, cls).__init__  # its own or inherited: a plain function
    own = [
        p
        for p in inspect.signature(target).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD and p.name not in HDF5_PROPERTIES
    ]
    keywords = [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=shown.get(name, p.default),
            annotation=kind | None if shown.get(name, p.default) is None else kind,
        )
        for name, (kind, p) in takes.items()
    ]
    target.__signature__ = inspect.Signature([*own, *keywords])
    lines = ["Parameters", "----------"]
    for line in first.strip("\n").split("\n") if first else ():
        indent = "    " if line.startswith("    ") else ""
        lines += textwrap.wrap(
            _rst(line.strip()), 92, initial_indent=indent, subsequent_indent=indent
        )
    for name, (_, p) in takes.items():
        if name in shown:
            default = f"default {_rst(f'`{_literal(shown[name])}`')}"
        else:
            default = "required" if p.default is REQUIRED else f"default {_rst(p.shown_default())}"
        lines.append(f"{name} : {default}")
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
