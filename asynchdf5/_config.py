"""The keyword properties: parsed and checked once, into a frozen :class:`LayerConfig`.

Every layer class takes its properties through :meth:`LayerConfig.parse`, so a value is checked
the same way (and a bad one gets the same message) whichever class it is given to. What each
property means is documented in :mod:`._properties`.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._delivery import parse_device
from ._distributed import broadcast_seed, detect, torch_distributed
from ._errors import ConfigurationError
from ._shares import BATCH_MODES
from .transforms import Transformer

__all__ = ["DEFAULT_TOPS", "MAX_EPOCH_BATCHES", "MAX_SAMPLES", "LayerConfig"]

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
#: The ramp of an epoch's first read (``_planner.first_read``) takes each piece from this many
#: places of the first chunk (lanes), so that its first batches mix as a later chunk's do
#: (docs/shuffle.md) ...
RAMP_LANES = 32
#: ... and each piece after the first twice the lanes of the one before, up to this many (a
#: piece twice as large, parts as large: ``_walk.growing_ramp``) ...
RAMP_TOP_LANES = 192
#: ... each lane's part of the first piece at least this big (a read each; and at least a
#: stored chunk decoded whole, or a remote request: see ``_planner.ramp_lanes``).
MIN_LANE_BYTES = 256 * 2**10
#: A chunk drawing from fewer places of the data set than this (its blocks and lanes) mixes
#: class-sorted data noticeably worse than a full permutation (docs/shuffle.md): the layer warns
#: (``_planner.mixing_warning``).
MIN_PLACES = 36
Backend = Literal["asyncio", "trio"]


# --- checks ------------------------------------------------------------------------------------


#: The most samples a batch may hold (``batch_size``), and a stream may choose per epoch
#: (``Stream(choose=...)``): an epoch's positions are int64 and its batches are planned in
#: memory, so a count far beyond any data set would end in a raw NumPy error at the first plan.
MAX_SAMPLES = 2**40
#: The most batches a plan of an epoch of chosen streams may hold: the plan keeps a row of
#: counts per batch (``_shares.epoch_table``), 8 bytes per stream each.
MAX_EPOCH_BATCHES = 2**26


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


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigurationError(f"{name} must be True or False, not {value!r}")
    return bool(value)


def _mmap(value: object) -> bool | Literal["auto"]:
    if isinstance(value, str) and value == "auto":
        return "auto"
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigurationError(f'mmap must be True, False or "auto", not {value!r}')
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


def _transformers(
    value: object, tops: Sequence[str], stream_tops: Sequence[str] = ()
) -> tuple[tuple[str, Transformer], ...]:
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
        if top not in tops and top not in stream_tops:
            also = f" nor of a stream's tops {tuple(stream_tops)!r}" if stream_tops else ""
            raise ConfigurationError(
                f"transformers[{i}] is for top {top!r}, which is not one of "
                f"tops={tuple(tops)!r}{also}"
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


def _batch_mode(value: object) -> str:
    if value not in BATCH_MODES:
        raise ConfigurationError(
            f"batch_mode must be one of {', '.join(map(repr, BATCH_MODES))}, not {value!r}"
        )
    return str(value)


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
    """Every keyword property of a layer, checked (see :data:`~._properties.PROPERTIES` for
    their meaning).

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
    #: ``"auto"``: mapped where no documented ``SIGBUS`` case can reach (``_read._choice``).
    mmap: bool | Literal["auto"] = "auto"
    #: Run the pipeline in one helper process; batches come through shared memory
    #: (``_process``).
    process: bool = False
    #: Where rank and world_size came from: "explicit", or what :func:`detect` found.
    rank_source: str = "explicit"
    #: The seed property was given (not drawn): a state to resume must have the same one.
    seed_given: bool = True
    #: How a batch is made of several streams (see :mod:`._shares`).
    batch_mode: str = "stratified"

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
        mmap: object = "auto",
        batch_mode: object = "stratified",
        process: object = False,
        stream_tops: Sequence[str] = (),
    ) -> LayerConfig:
        """Check every property; raise :class:`ConfigurationError` naming the first bad one."""
        batch = _int("batch_size", batch_size, minimum=1, maximum=MAX_SAMPLES)
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
            transformers=_transformers(transformers, names, stream_tops),
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
            mmap=_mmap(mmap),
            process=_bool("process", process),
            rank_source=source,
            seed_given=given,
            batch_mode=_batch_mode(batch_mode),
        )
