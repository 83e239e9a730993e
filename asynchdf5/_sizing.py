"""The sizes an HDF5 layer fixes from its catalog: the cache's chunks and the order's shape.

:func:`cache_plan` fits the cache's chunks to the memory budget (:func:`~._cache.size_cache`);
:func:`shape_of` takes the order's blocks, first read and lanes from the planner's heuristics
(:func:`~._planner.order_of`), or from a loaded state, into the one
:class:`~._shape.DataShape` that every plan and saved state agrees on. Pure (no I/O): kept apart
from the layer's lifecycle so that every size an opening fixes is decided in one place.
"""

from __future__ import annotations

import os
import warnings

from ._cache import N_SLOTS, CacheBudgetWarning, CachePlan, heap_bytes, size_cache
from ._catalog import Catalog
from ._config import LayerConfig
from ._errors import ConfigurationError
from ._machine import memory_room
from ._mix import StreamRows
from ._pipeline import MIN_GROUP_BYTES, RING_GROUPS
from ._planner import order_of
from ._shape import DataShape

__all__ = ["cache_plan", "shape_of"]


def request_bytes(catalog: Catalog) -> int:
    """The bytes a read request of the source's files should move at least (0: any)."""
    return max((f.file.request_bytes for f in catalog.files), default=0)


def stored_rows(catalog: Catalog) -> int:
    """Rows of the largest stored chunk that the reader decodes whole (0: none)."""
    return max(
        (
            layout.chunks.rows
            for f in catalog.files
            for name, layout in f.layouts.items()
            if layout.chunks is not None
            and name not in f.ragged  # a ragged top's stored chunks hold values, not rows
            # Unfiltered whole-sample chunks are read row by row, as contiguous data is.
            and (layout.filters or layout.chunks.splits_samples)
        ),
        default=0,
    )


def stored_shuffled(catalog: Catalog) -> bool:
    """Whether every file with rows says its samples were written in a random order."""
    return all(f.shuffled for f in catalog.files if f.nrows)


def cache_plan(catalog: Catalog, config: LayerConfig, rows: int | None) -> CachePlan:
    """The cache for ``catalog`` under ``config``'s budget; ``rows``: chunks of that many rows
    (a loaded state's), else as the properties and the budget give
    (:class:`~._errors.ConfigurationError` when the budget cannot hold them)."""
    c = config
    plan = size_cache(
        catalog.n_samples,
        catalog.row_bytes,
        batch_size=c.batch_size,
        world_size=c.world_size,
        chunk_size=c.chunk_size,
        cache_bytes=c.cache_bytes,
        rows=rows,
        heaps=heap_bytes(catalog.tops),
    )
    if c.cache_bytes is None and c.world_size == 1:  # (ranks: see default_cache_bytes)
        check_room(plan.budget, min(c.batch_size, catalog.n_samples) * catalog.row_bytes)
    return plan


def check_room(budget: int, batch_bytes: int) -> None:
    """:class:`ConfigurationError` when the default cache ``budget`` (a third of the room this
    process has: :func:`~._cache.default_cache_bytes`) cannot hold the least the pipeline needs
    (two cache slots of a batch, and its ring of batch buffers): then the rest of the process
    would not have room either, and the kernel would kill it for memory mid-epoch. Named at
    open instead, with the limit and what to set."""
    least = N_SLOTS * batch_bytes + RING_GROUPS * max(MIN_GROUP_BYTES, batch_bytes)
    room = memory_room()
    if budget >= least or room is None:
        return
    raise ConfigurationError(
        f"{room} leaves {room.free / 2**20:.1f} MiB: too little for the layer's cache and "
        f"batch buffers (at least {least / 2**20:.1f} MiB, and by default no more than a third "
        "of the room, so that the rest of the process has its share): free memory before "
        "opening the layer or raise the limit, or size the cache yourself with cache_bytes= "
        "(lowering batch_size shrinks both)"
    )


def shape_of(
    catalog: Catalog,
    streams: tuple[StreamRows, ...],
    config: LayerConfig,
    forced: DataShape | None,
) -> DataShape:
    """The data's shape, and how it is cached: as ``forced`` (a loaded state's) says, else as
    the properties and the budget give. A cache the budget shrank warns
    (:class:`~._cache.CacheBudgetWarning`) when the order's heuristics say what that costs."""
    n, row_bytes = catalog.n_samples, catalog.row_bytes
    cache = cache_plan(catalog, config, forced.chunk_rows if forced is not None else None)
    if forced is not None:
        block, first, lanes = forced.block_rows, forced.first_rows, forced.ramp_lanes
        laned, top, once = forced.chunk_lanes, forced.ramp_top_lanes, forced.ramp_once
        even = forced.even_chunks
    else:
        stored, request = stored_rows(catalog), request_bytes(catalog)
        order = order_of(
            config,
            catalog.mean_row_bytes,  # ragged tops: their values too
            cache.chunk_rows,
            stored,
            request,
            stored_shuffled(catalog),
        )
        block, first = order.block_rows, order.first_rows
        lanes, laned, top = order.ramp_lanes, order.chunk_lanes, order.ramp_top_lanes
        once, even = cache.resident, True
        # Warned of when the budget shrank the cache, not when the properties asked for it.
        if order.warning is not None and cache.shrunk:
            warnings.warn(order.warning, CacheBudgetWarning, stacklevel=3)
    return DataShape(
        n_samples=n,
        row_bytes=row_bytes,
        files=tuple((os.path.basename(f.name), f.nrows) for f in catalog.files),
        tops=tuple((t.name, t.dtype.str, tuple(t.sample_shape)) for t in catalog.tops.values()),
        chunk_rows=cache.chunk_rows,
        block_rows=block,
        first_rows=first,
        resident=cache.resident,
        ramp_lanes=lanes,
        chunk_lanes=laned,
        ramp_top_lanes=top,
        ramp_once=once,
        even_chunks=even,
        streams=streams,
        categories=tuple(catalog.categories.items()),
    )
