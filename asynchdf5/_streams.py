"""Streams: several named sources mixed in one layer.

``source={"web": Stream("web.txt", weight=0.7), "books": Stream("books.txt", weight=0.3)}``:
each stream is a source as ``source=`` takes one (a list file, an HDF5 file, a sequence of
paths, URLs), with its share of every epoch. Here: the public :class:`Stream`, the checks made
when a layer is constructed (:func:`parse_streams`), the samples each stream gives per epoch
(:func:`stream_counts`) and the one catalog of every stream's files (:func:`combine`). The plan
is :mod:`._mix`'s; the consumer labels each batch's rows with their stream.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._catalog import Catalog, FileInfo, same_categories
from ._config import MAX_EPOCH_BATCHES, MAX_SAMPLES, LayerConfig
from ._errors import ConfigurationError, DataLayerError, SchemaError
from ._mix import StreamRows
from ._ragged_tops import kind_words
from ._schemas import mismatch, split_schemas
from ._sources import SourceLike

__all__ = [
    "Stream",
    "StreamSpec",
    "combine",
    "parse_streams",
    "stream_counts",
]


@dataclass(frozen=True)
class Stream:
    """One named source among several mixed in a layer (``source={name: Stream(...)}``).

    Parameters
    ----------
    source
        What ``source=`` takes: a source list file, an HDF5 file, or a sequence of paths or
        URLs (read with the layer's ``storage_options``).
    weight
        The stream's share of the samples per epoch, relative to the other weighted streams:
        together they give as many samples per epoch as they hold, split in proportion to
        their weights. A stream's share below its size is *downsampled* (it walks through its
        own permutation over several epochs), above it *upsampled* (it repeats whole
        permutations, then part of one).
    choose
        Instead of ``weight``: exactly this many samples per epoch (at most 2**40).
    tops
        The stream's own tops (only with ``batch_mode="per_stream"``, where each batch holds
        one stream's rows); None: the layer's ``tops``.

    With neither ``weight`` nor ``choose``, the stream gives its natural share: each of its
    samples once per epoch.

    Examples
    --------
    >>> from asynchdf5 import Stream
    >>> Stream(["a.h5", "b.h5"], weight=0.25)
    Stream(source=['a.h5', 'b.h5'], weight=0.25, choose=None, tops=None)
    """

    source: SourceLike
    weight: float | None = None
    choose: int | None = None
    tops: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if self.weight is not None and self.choose is not None:
            raise ConfigurationError(
                f"a stream takes weight= or choose=, not both (weight={self.weight!r}, "
                f"choose={self.choose!r})"
            )
        w = self.weight
        if w is not None and (
            isinstance(w, (bool, np.bool_))
            or not isinstance(w, (int, float, np.integer, np.floating))
            or not math.isfinite(float(w))
            or w < 0
        ):
            raise ConfigurationError(f"a stream's weight must be a number >= 0, not {w!r}")
        c = self.choose
        if c is not None and (
            isinstance(c, (bool, np.bool_))
            or not isinstance(c, (int, np.integer))
            or not 0 <= c <= MAX_SAMPLES
        ):
            raise ConfigurationError(
                f"a stream's choose must be an int in 0 ... {MAX_SAMPLES} (2**40 samples per "
                f"epoch), not {c!r}"
            )
        t = self.tops
        if t is not None:
            if (
                isinstance(t, str)
                or not isinstance(t, Sequence)
                or not t
                or not all(isinstance(x, str) for x in t)
                or len(set(t)) != len(t)
            ):
                raise ConfigurationError(
                    f"a stream's tops must be a non-empty sequence of distinct dataset names, "
                    f"not {t!r}"
                )
            object.__setattr__(self, "tops", tuple(t))


@dataclass(frozen=True)
class StreamSpec:
    """A stream as a layer holds it once constructed: its entries resolved."""

    name: str
    entries: tuple[str, ...]
    weight: float | None
    choose: int | None
    tops: tuple[str, ...] = ()  # its own tops (``Stream(tops=...)``); (): the layer's


def parse_streams(
    source: Mapping[Any, Any],
    resolve: Callable[[SourceLike], list[str]],
    config: LayerConfig,
) -> tuple[StreamSpec, ...]:
    """Check a mapping of streams and resolve each one's source (``resolve``: the layer's).

    A value that is not a :class:`Stream` is a source given weight 1 (a plain mapping of
    names to sources mixes them with equal weights). :class:`ConfigurationError` when there is
    no stream, a name is not a non-empty ``str``, the streams give no sample per epoch, a
    stream names its own tops outside ``batch_mode="per_stream"``, or a transformer is for a
    top that no stream reads.
    """
    if not source:
        raise ConfigurationError("source is an empty mapping: name at least one stream")
    out = []
    for name, value in source.items():
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"a stream's name must be a non-empty str, not {name!r}")
        stream = value if isinstance(value, Stream) else Stream(value, weight=1.0)
        try:
            entries = resolve(stream.source)
        except DataLayerError as exc:
            _prefix(exc, name)
            raise
        w = None if stream.weight is None else float(stream.weight)
        c = None if stream.choose is None else int(stream.choose)
        tops = () if stream.tops is None else tuple(stream.tops)
        if tops and tops != config.tops and config.batch_mode != "per_stream":
            raise ConfigurationError(
                f"stream {name!r} has tops {tops!r}, not the layer's {config.tops!r}: streams "
                f'of their own tops need batch_mode="per_stream" (not {config.batch_mode!r}), '
                "where each batch holds one stream's rows"
            )
        out.append(StreamSpec(name, tuple(entries), w, c, tops))
    if all(s.weight == 0 or s.choose == 0 for s in out):
        raise ConfigurationError(
            "every stream's weight (or choose) is 0: the streams give no sample per epoch"
        )
    chosen = sum(s.choose or 0 for s in out)
    if chosen // config.batch_size > MAX_EPOCH_BATCHES:
        raise ConfigurationError(
            f"the streams' choose (together {chosen} samples per epoch) make more than "
            f"{MAX_EPOCH_BATCHES} (2**26) batches of batch_size={config.batch_size} per epoch, "
            "each planned in memory: lower choose or raise batch_size"
        )
    read = {t for s in out for t in s.tops or config.tops}
    for i, (top, _) in enumerate(config.transformers):
        if top not in read:
            raise ConfigurationError(
                f"transformers[{i}] is for top {top!r}, which no stream reads (the streams' "
                f"tops: {sorted(read)!r})"
            )
    return tuple(out)


def _prefix(exc: BaseException, name: str) -> None:
    if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith("stream "):
        exc.args = (f"stream {name!r}: {exc.args[0]}", *exc.args[1:])


def stream_counts(specs: Sequence[StreamSpec], sizes: Sequence[int]) -> tuple[int, ...]:
    """The samples each stream gives per epoch: ``choose``; its size when it has neither
    ``choose`` nor ``weight``; and the weighted streams share their sizes' sum in proportion to
    their weights (largest remainder, so that the sum is exact: a weight of ``size / total``
    gives exactly ``size``)."""
    counts = [
        s.choose if s.choose is not None else 0 if s.weight is not None else n
        for s, n in zip(specs, sizes, strict=True)
    ]
    weighted = [i for i, s in enumerate(specs) if s.weight is not None]
    pool = sum(sizes[i] for i in weighted)
    weights = [specs[i].weight or 0.0 for i in weighted]
    # Relative to the largest: weights near the float maximum share as any others do.
    top = max(weights, default=0.0)
    weights = [w / top if top > 0 else 0.0 for w in weights]
    total = math.fsum(weights)
    if weighted and total > 0:  # (weights all 0: those streams give nothing)
        quotas = [pool * w / total for w in weights]
        got = [math.floor(q) for q in quotas]
        order = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - got[i]), i))
        for i in order[: pool - sum(got)]:
            got[i] += 1
        for i, n in zip(weighted, got, strict=True):
            counts[i] = n
    if sum(counts) == 0:
        raise ConfigurationError("the streams give no sample per epoch (every share is 0)")
    return tuple(counts)


def _same_kinds(names: Sequence[str], catalogs: Sequence[Catalog]) -> None:
    """:class:`SchemaError` when a top is ragged (or sparse) in one stream and not in another:
    their batches could not be one value."""
    first: dict[str, tuple[str, str]] = {}
    for name, cat in zip(names, catalogs, strict=True):
        for top, info in cat.tops.items():
            r = info.ragged
            kind = kind_words(None if r is None else r.kind, 0 if r is None else r.n_cols)
            seen = first.setdefault(top, (name, kind))
            if seen[1] != kind:
                raise SchemaError(
                    f"top {top!r} is {kind} in stream {name!r} but {seen[1]} in stream "
                    f"{seen[0]!r}; a top must be stored alike in every stream"
                )


def combine(
    specs: Sequence[StreamSpec], catalogs: Sequence[Catalog], *, per_stream: bool = False
) -> tuple[Catalog, tuple[StreamRows, ...]]:
    """One catalog of every stream's files, stream after stream, and the rows of each.

    Streams whose tops differ in sample shape or dtype: under ``per_stream`` (every batch
    holds one stream's rows), each keeps its own (:func:`~._schemas.split_schemas`: the
    catalog holds each variant of a top, and each file names its own); else a
    :class:`SchemaError` naming both streams and the top (every batch holds rows of every
    stream).
    """
    names = [s.name for s in specs]
    _same_kinds(names, catalogs)
    split = split_schemas(names, catalogs) if per_stream else None
    if split is not None and any(t.ragged for c in catalogs for t in c.tops.values()):
        raise ConfigurationError(
            'streams whose tops differ in dtype or sample shape (batch_mode="per_stream") '
            "cannot have ragged or sparse tops yet; give the streams one schema"
        )
    if split is None and (error := mismatch(names, catalogs)) is not None:
        raise error
    files = []
    rows = []
    start = 0
    firsts: list[FileInfo] = []  # each stream's first file with rows: their categories agree
    for spec, cat in zip(specs, catalogs, strict=True):
        first = cat.files[0]
        same_categories(first, firsts, f"stream {spec.name!r}: ")
        firsts.append(first)
    for k, (spec, cat) in enumerate(zip(specs, catalogs, strict=True)):
        own = None if split is None else split[1][k]
        for f in cat.files:
            layouts = f.layouts if own is None else {own[t]: v for t, v in f.layouts.items()}
            files.append(dataclasses.replace(f, start=f.start + start, layouts=layouts))
        rows.append((spec.name, start, cat.n_samples))
        start += cat.n_samples
    counts = stream_counts(specs, [n for _, _, n in rows])
    streams = tuple(
        StreamRows(name, a, n, c, () if split is None else tuple(split[1][k].items()))
        for k, ((name, a, n), c) in enumerate(zip(rows, counts, strict=True))
    )
    tops = dict(catalogs[0].tops) if split is None else split[0]
    categories = {t: c for cat in catalogs for t, c in cat.categories.items()}
    return Catalog(files, tops, categories), streams
