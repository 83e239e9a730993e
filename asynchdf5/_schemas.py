"""Streams of different schemas under ``batch_mode="per_stream"``: each stream keeps the dtype
and sample shape of its tops (and may read tops of its own, ``Stream(tops=...)``), and every
batch holds one stream's rows.

All streams' files form one catalog. A top whose dtype or sample shape differs between streams
is held in it once per variant: the variant of the first stream that has it under the top's
own name, each other variant under ``"top@stream"`` (the first stream with that variant): the
*internal* top, with its own array in every cache slot, batch buffer and carry. Each stream
reads only its own variants (its files' layouts are named by them), so a slot's rows of a
stream are filled in that stream's arrays only, and a batch gathers, and is handed over with,
only the arrays of its stream's *schema* (the variants it reads), under the tops' own names.

:func:`split_schemas` names the variants when the catalog is combined; :class:`Schemas` tells
the batcher, chunk by chunk, where the serving order passes from one schema to another, so that
no batch spans two (:class:`~._pipeline.Run`); a group of batches says each one's schema
(``GroupSpec.schemas``), so that batches of alternating streams are still gathered together.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._catalog import Catalog, TopInfo
from ._errors import ConfigurationError, SchemaError
from ._mix import StreamRows
from ._shape import DataShape

__all__ = [
    "Schemas",
    "check_elastic",
    "check_schemas",
    "check_stream",
    "mismatch",
    "run_at",
    "split_schemas",
]


def _variant(t: TopInfo) -> tuple[str, tuple[int, ...]]:
    return t.dtype.str, t.sample_shape


def _schema(c: Catalog) -> list[tuple[str, tuple[str, tuple[int, ...]]]]:
    return [(name, _variant(t)) for name, t in c.tops.items()]


def split_schemas(
    names: Sequence[str], catalogs: Sequence[Catalog]
) -> tuple[dict[str, TopInfo], list[dict[str, str]]] | None:
    """The internal tops of streams ``names`` (their catalogs: ``catalogs``), and each stream's
    tops as ``{top: internal top}``; None when every stream has the same schema (the catalog's
    tops are then the first stream's, under their own names)."""
    first = _schema(catalogs[0])
    if all(_schema(c) == first for c in catalogs[1:]):
        return None
    tops: dict[str, TopInfo] = {}
    seen: dict[tuple[str, tuple[str, tuple[int, ...]]], str] = {}
    maps: list[dict[str, str]] = []
    for name, cat in zip(names, catalogs, strict=True):
        own = {}
        for top, info in cat.tops.items():
            key = (top, _variant(info))
            internal = seen.get(key)
            if internal is None:
                internal = top if top not in tops else f"{top}@{name}"
                if internal in tops:  # a top named like a variant: refuse rather than mix them
                    raise SchemaError(
                        f"stream {name!r}: top {top!r} differs from another stream's, and its "
                        f"name for this stream ({internal!r}) is already a top's"
                    )
                seen[key] = internal
                tops[internal] = TopInfo(internal, info.dtype, info.sample_shape)
            own[top] = internal
        maps.append(own)
    return tops, maps


def mismatch(names: Sequence[str], catalogs: Sequence[Catalog]) -> SchemaError | None:
    """A :class:`SchemaError` naming both streams and the top when two streams' tops differ in
    sample shape or dtype (None: they agree): what every batch mode but ``"per_stream"`` needs,
    since a batch holds rows of every stream."""
    base = catalogs[0]
    for name, cat in zip(names[1:], catalogs[1:], strict=True):
        for top, t in base.tops.items():
            other = cat.tops[top]
            if _variant(other) != _variant(t):
                return SchemaError(
                    f"streams {names[0]!r} and {name!r} disagree on top {top!r}: "
                    f"{names[0]!r} has samples of shape {t.sample_shape} and dtype "
                    f"{t.dtype} ({os.path.basename(base.files[0].name)}), {name!r} of "
                    f"shape {other.sample_shape} and dtype {other.dtype} "
                    f"({os.path.basename(cat.files[0].name)}); mixed streams must agree on "
                    'every top, except under batch_mode="per_stream"'
                )
    return None


@dataclass(frozen=True, eq=False)
class Schemas:
    """The schemas of streams that differ in them (see the module's docstring), for the batcher.

    ``tops[g]``: schema ``g``'s tops, ``{top: internal top}``; ``streams[g]``: the names of
    its streams.
    """

    starts: np.ndarray  # the first global row of every stream but the first
    of_stream: np.ndarray  # each stream's schema
    tops: tuple[dict[str, str], ...]
    streams: tuple[tuple[str, ...], ...]

    @classmethod
    def of(cls, streams: Sequence[StreamRows]) -> Schemas | None:
        """The schemas of ``streams``; None when they share one (every stream reads the
        catalog's tops under their own names)."""
        if not any(s.tops for s in streams):
            return None
        kinds: list[tuple[tuple[str, str], ...]] = []
        of_stream = []
        for s in streams:
            if s.tops not in kinds:
                kinds.append(s.tops)
            of_stream.append(kinds.index(s.tops))
        return cls(
            np.array([s.start for s in streams[1:]], np.int64),
            np.array(of_stream, np.int64),
            tuple(dict(k) for k in kinds),
            tuple(
                tuple(s.name for s, g in zip(streams, of_stream, strict=True) if g == k)
                for k in range(len(kinds))
            ),
        )

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the streams, schema by schema."""
        return tuple(name for names in self.streams for name in names)

    def runs(self, indices: np.ndarray) -> tuple[list[int], list[int]]:
        """Where a serving order whose samples are ``indices`` (global) passes from one schema
        to another: the first position of each run of one schema, and its schema. Blocking
        (a pass over the chunk): run it in a worker thread."""
        if not len(indices):
            return [0], [0]
        labels = self.of_stream[np.searchsorted(self.starts, indices, side="right")]
        cuts = np.flatnonzero(labels[1:] != labels[:-1]) + 1
        firsts = [0, *cuts.tolist()]
        return firsts, labels[firsts].tolist()

    def mixed(self, a: int, b: int) -> SchemaError:
        """The error of a batch that would hold rows of schemas ``a`` and ``b``."""
        return SchemaError(
            f"a batch would hold rows of streams {self.streams[a][0]!r} and "
            f"{self.streams[b][0]!r}, whose tops differ in dtype or sample shape: such streams "
            'are batched one stream at a time (batch_mode="per_stream", epochs iterated '
            "with async for / for, not stream(), and not resumed on another world size)"
        )


def run_at(runs: tuple[list[int], list[int]], pos: int, size: int) -> tuple[int, int]:
    """The end of the run of :meth:`Schemas.runs` that holds position ``pos`` of a chunk of
    ``size`` positions, and its schema."""
    firsts, kinds = runs
    i = bisect.bisect_right(firsts, pos) - 1
    end = firsts[i + 1] if i + 1 < len(firsts) else size
    return end, kinds[i]


def _differing(streams: Sequence[StreamRows]) -> str:
    """The names of ``streams`` (``"'a', 'b'"``) when they differ in schema; "" when they
    share one."""
    return ", ".join(repr(s.name) for s in streams if s.tops)


def check_schemas(streams: Sequence[StreamRows], *, process: bool) -> None:
    """:class:`ConfigurationError` for streams of different schemas where their batches cannot
    go: through a helper process (its shared-memory slots carry one array per top, of one dtype
    and sample shape)."""
    names = _differing(streams)
    if names and process:
        raise ConfigurationError(
            f"streams {names} differ in their tops' dtypes or sample "
            'shapes (batch_mode="per_stream"): process=True cannot carry batches of different '
            "schemas; give the streams one schema, or leave out process=True"
        )


def check_stream(shape: DataShape | None) -> None:
    """:class:`ConfigurationError` for ``stream()`` over streams of different schemas: its
    batches straddle epochs, so one may hold rows of two streams."""
    names = _differing(shape.streams) if shape is not None else ""
    if names:
        raise ConfigurationError(
            f"stream() cannot serve streams {names}: their "
            "tops differ in dtype or sample shape, and a batch of stream() may straddle two "
            "streams; iterate epochs (async for / for over the layer)"
        )


def check_elastic(shape: DataShape | None) -> None:
    """:class:`ConfigurationError` for resuming streams of different schemas on another world
    size: the rest of the resumed epoch is cut into batches in order, so one may hold rows of
    two streams."""
    names = _differing(shape.streams) if shape is not None else ""
    if names:
        raise ConfigurationError(
            f"streams {names} differ in their tops' dtypes or "
            "sample shapes: a state of theirs resumes on the world size that saved it only "
            "(elsewhere the rest of its epoch is cut in order, and a batch may hold two "
            "streams); resume on that world size, or from the start of an epoch (set_epoch)"
        )
