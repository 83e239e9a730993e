"""The HDF5 layers: :class:`AsyncHDF5DataLayer` and its sync face :class:`HDF5DataLayer`.

Opening one builds the catalog of its files (in a worker thread), sizes the host cache for it,
and hands the pipeline an :class:`~._read.HDF5Reader` over the files' source.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import anyio
import anyio.to_thread

from ._cache import CacheBudgetWarning, CachePlan, Slot, allocate_slots, size_cache
from ._catalog import Catalog, build_catalog
from ._codecs import deflate_backend
from ._config import DEFAULT_TOPS, LayerConfig
from ._layer import LayerBase
from ._machine import memory_bytes
from ._process import ProcessReader, check_picklable, payload, ring_slots
from ._properties import document
from ._read import Choice, HDF5Reader, MappedReader, Reader, choose
from ._shape import DataShape, chunk_lanes, default_block_rows, first_read, mixing_warning
from ._sources import Source, SourceLike, SourceOptions, Streaming
from .transforms import Transformer

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

__all__ = ["AsyncHDF5DataLayer", "HDF5DataLayer"]

_log = logging.getLogger("asynchdf5")


def _request_bytes(catalog: Catalog) -> int:
    """The bytes a read request of the source's files should move at least (0: any)."""
    return max((f.file.request_bytes for f in catalog.files), default=0)


def _stored_rows(catalog: Catalog) -> int:
    """Rows of the largest stored chunk that the reader decodes whole (0: none)."""
    return max(
        (
            layout.chunks.rows
            for f in catalog.files
            for layout in f.layouts.values()
            if layout.chunks is not None
        ),
        default=0,
    )


class AsyncHDF5DataLayer(LayerBase):
    """Shuffled minibatches from HDF5 files, for ``async for`` in a training coroutine.

    A background pipeline reads large chunks of the source into a host cache, cuts them into
    batches in a worker thread, runs the transformers and hands the batches to ``async for``.
    Works on asyncio and trio (through anyio); ``with`` and ``for`` work too, on an event loop
    in a background thread (see :class:`HDF5DataLayer`). The keyword properties are documented
    in the user guide's property table.

    Examples
    --------
    >>> import anyio, asynchdf5
    >>> async def main(path):
    ...     async with asynchdf5.AsyncHDF5DataLayer(path, batch_size=32) as layer:
    ...         async for batch in layer:
    ...             ...
    """

    def __init__(
        self,
        source: SourceLike,
        *,
        batch_size: int,
        tops: Sequence[str] = DEFAULT_TOPS,
        shuffle: bool = False,
        chunk_size: int = 2**20,
        transformers: Sequence[tuple[str, Transformer]] = (),
        seed: int | None = None,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        cache_bytes: int | None = None,
        prefetch: int = 8,
        device: object = None,
        reuse_buffers: bool = False,
        backend: Literal["asyncio", "trio"] = "asyncio",
        storage_options: Mapping[str, Any] | None = None,
        remote_cache: str | os.PathLike[str] | None = None,
        remote_cache_bytes: int | None = None,
        block_size: int | None = None,
        mmap: bool | Literal["auto"] = "auto",
        process: bool = False,
    ) -> None:
        config = LayerConfig.parse(
            batch_size=batch_size,
            tops=tops,
            shuffle=shuffle,
            chunk_size=chunk_size,
            transformers=transformers,
            seed=seed,
            drop_last=drop_last,
            rank=rank,
            world_size=world_size,
            cache_bytes=cache_bytes,
            prefetch=prefetch,
            device=device,
            reuse_buffers=reuse_buffers,
            backend=backend,
            storage_options=storage_options,
            remote_cache=remote_cache,
            remote_cache_bytes=remote_cache_bytes,
            block_size=block_size,
            mmap=mmap,
            process=process,
        )
        # Every remote read (a list file given as a URL, now; the files, at open) goes through
        # this one object, with the layer's options.
        self._reach = SourceOptions(
            config.storage_options, config.remote_cache, config.remote_cache_bytes
        )
        #: The files (absolute paths, or URLs), resolved at construction.
        self.paths = self._reach.resolve(source)
        if config.process:
            check_picklable(config, self.paths)  # before any batch, naming what cannot go
        super().__init__(config)

    def _source(self) -> Source:
        return self._reach.open(self.paths)

    def _shape_of(self, catalog: Catalog) -> DataShape:
        """The data's shape, and how it is cached: as a loaded state says, else as the
        properties and the budget give."""
        c = self.config
        n, row_bytes = catalog.n_samples, catalog.row_bytes
        forced = self._shape if self._resume is not None else None
        cache = self._size_cache(catalog, forced.chunk_rows if forced is not None else None)
        if forced is not None:
            block, first, lanes = forced.block_rows, forced.first_rows, forced.ramp_lanes
            laned = forced.chunk_lanes
        else:
            stored, request = _stored_rows(catalog), _request_bytes(catalog)
            block = (
                (c.block_size or default_block_rows(row_bytes, c.chunk_size, stored, request))
                if c.shuffle
                else None
            )
            first, lanes = first_read(c.batch_size, row_bytes, c.shuffle, stored, request)
            # Lanes with the default blocks only: a block_size given is the order asked for.
            laned = (
                chunk_lanes(cache.chunk_rows, block, row_bytes, stored, request)
                if c.block_size is None
                else 1
            )
            why = mixing_warning(cache.chunk_rows, block, laned, row_bytes, stored, request)
            if why is not None and cache.shrunk:  # the budget's doing, not the properties'
                warnings.warn(why, CacheBudgetWarning, stacklevel=2)
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
        )

    def _size_cache(self, catalog: Catalog, rows: int | None) -> CachePlan:
        c = self.config
        return size_cache(
            catalog.n_samples,
            catalog.row_bytes,
            batch_size=c.batch_size,
            world_size=c.world_size,
            chunk_size=c.chunk_size,
            cache_bytes=c.cache_bytes,
            rows=rows,
        )

    def _look(self) -> DataShape:
        # A worker thread: h5py is never called on an event loop's thread, even from here.
        out: list[DataShape | BaseException] = []

        def look() -> None:
            files = self._source()
            try:
                out.append(self._shape_of(build_catalog(files, self.paths, self.config.tops)))
            except BaseException as exc:
                out.append(exc)
            finally:
                files.close()

        thread = threading.Thread(target=look, name="asynchdf5-metadata")
        thread.start()
        thread.join()
        (result,) = out
        if isinstance(result, BaseException):
            raise result
        return result

    async def _open_reader(self) -> tuple[Reader | ProcessReader, list[Slot] | None, DataShape]:
        if self.config.process:
            return await self._open_helper()
        files = self._source()
        chosen: Choice | None = None  # holds the file's lease until the mapped reader takes it
        try:
            catalog = await anyio.to_thread.run_sync(
                build_catalog, files, self.paths, self.config.tops
            )
            shape = self._shape_of(catalog)
            slots: list[Slot] | None = None
            # Data larger than the memory the process may use is read from the disk every
            # epoch: it is copied (mmap="auto"), and the reader streams it around the page
            # cache. One figure for both decisions.
            memory = memory_bytes()
            chosen = choice = await anyio.to_thread.run_sync(
                choose, catalog, self.config.mmap, memory
            )
            reader: Reader
            if choice.mapped:  # no slots: rows served in place
                leases, choice.leases = choice.leases, []  # the reader's now
                reader = MappedReader(catalog, files, leases, choice.note)
            elif shape.resident:
                whole = allocate_slots(catalog.tops, shape.n_samples, count=1)[0].arrays
                reader = HDF5Reader(catalog, files, resident=whole)
            else:
                rows = self._cache_rows(shape)  # an elastically resumed epoch's may be larger
                if rows > shape.chunk_rows:
                    self._size_cache(catalog, rows)  # the budget must hold them
                slots = allocate_slots(catalog.tops, rows)
                # Data larger than memory: read from the disk every epoch, around the page cache
                # (Source.fetch); scattered reads wait on the disk, not the CPU: more in flight.
                streaming: Streaming | None = None
                if 0 < memory < shape.n_samples * shape.row_bytes:
                    streaming = "scattered" if self.config.shuffle else "in order"
                reader = HDF5Reader(
                    catalog,
                    files,
                    read_threads=8 if streaming == "scattered" else 2,
                    streaming=streaming,
                )
            if isinstance(reader, HDF5Reader) and choice.note != "copied: mmap=False":
                notes = dict(reader.read_notes)
                for top in catalog.tops:
                    notes[top] = "; ".join(filter(None, (notes.get(top), choice.note)))
                reader.read_notes = notes
        except BaseException:
            with anyio.CancelScope(shield=True):
                if chosen is not None:
                    chosen.close()
                await anyio.to_thread.run_sync(files.close)
            raise
        c = self.config
        slot_bytes = 2 * shape.chunk_rows * shape.row_bytes
        _log.info(
            "opened %d file(s), %d samples of %d bytes, tops %s; rank %d of %d; cache: %s",
            len(catalog.files),
            shape.n_samples,
            shape.row_bytes,
            ", ".join(f"{t.name} {t.dtype}{t.sample_shape}" for t in catalog.tops.values()),
            c.rank,
            c.world_size,
            f"none: the file is mapped ({choice.note}), rows served from the page cache"
            if isinstance(reader, MappedReader)
            else "resident (read once)"
            if shape.resident
            else f"2 slots of {shape.chunk_rows} samples ({slot_bytes} bytes)",
        )
        if choice.refused:
            why = choice.note.split(": ", 1)[-1]
            _log.warning("mmap=True does not apply: %s; reading through the cache", why)
        elif not choice.mapped:
            _log.info("not mapped: %s", choice.note)
        for top, path in reader.read_paths.items():
            note = reader.read_notes.get(top)
            if "chunks" in path:
                note = f"deflate decoder: {deflate_backend()}" + (f"; {note}" if note else "")
            _log.info("top %r is read by %s%s", top, path, f" ({note})" if note else "")
            if "h5py" in path:
                _log.warning(
                    "top %r is read through h5py, which holds its process-wide lock and decodes "
                    "on one thread (%s); `asynchdf5 inspect` says why and how to repack it",
                    top,
                    reader.read_notes.get(top, "see read_notes"),
                )
        return reader, slots, shape

    async def _open_helper(self) -> tuple[ProcessReader, None, DataShape]:
        """``process=True``: start the helper process, which opens the layer there (a state
        loaded before opening goes with it, so that its cache is sized for that state)."""
        state = self.state_dict() if self._resume is not None else None
        c = self.config
        device = None
        if c.device is not None:  # the helper gathers host batches; this process uploads them
            c = dataclasses.replace(c, device=None, transformers=(), reuse_buffers=False)
            device = (self._delivery, c.batch_size)
        blob = payload(self.paths, c, self._part, state)
        slots = ring_slots(c.prefetch)
        reader, shape = await ProcessReader.start(blob, self.state_dict, self._stats, slots, device)
        return reader, None, shape


class HDF5DataLayer(AsyncHDF5DataLayer):
    """Shuffled minibatches from HDF5 files, for ordinary ``with`` / ``for`` loops.

    The same keyword properties as :class:`AsyncHDF5DataLayer` (``backend`` picks the event loop
    the pipeline runs on, in a background thread). Every call crosses one bridge to that loop;
    iterating takes the batches the pipeline has ready (up to 256) per trip.

    Examples
    --------
    >>> import asynchdf5
    >>> def train(path):
    ...     with asynchdf5.HDF5DataLayer(path, batch_size=32, shuffle=True, seed=0) as layer:
    ...         for epoch in range(3):
    ...             for batch in layer:
    ...                 ...
    """

    @property
    def layer(self) -> Self:
        """The layer itself (kept from when the sync facade wrapped an async layer)."""
        return self


document(AsyncHDF5DataLayer, "hdf5")
document(HDF5DataLayer, "hdf5")
