"""The HDF5 layers: :class:`AsyncHDF5DataLayer` and :class:`HDF5DataLayer`, two faces of one
base (:class:`HDF5Layer`: the properties, the source, the opening), as httpx's ``AsyncClient``
and ``Client`` share theirs; neither wraps nor inherits the other.

Opening one builds the catalog of its files (in a worker thread), has the planner check and
size it, allocates the host cache and makes an :class:`~._read.HDF5Reader` over the files'
source: the whole :class:`~._opened.Opened`, built here in that order, in one call.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal

from ._cache import Slot, allocate_slots
from ._catalog import Catalog, build_catalog
from ._codecs import deflate_backend
from ._config import SOURCE_DOC, HDF5Properties, LayerConfig, document
from ._errors import DataLayerError
from ._layer import LayerBase
from ._machine import memory_bytes, memory_room
from ._mix import StreamRows
from ._opened import Opened
from ._process import ProcessReader, check_picklable, payload, ring_slots
from ._read import Choice, HDF5Reader, MappedReader, Reader, choose, fill_threads
from ._schemas import check_schemas
from ._shape import DataShape
from ._sizing import held_rows, shape_of, size_opening
from ._sources import Source, SourceLike, SourceOptions, Streaming
from ._streams import Stream, StreamSpec, combine, parse_streams
from ._thread_call import release_whole, run_sync_whole

if sys.version_info >= (3, 11):
    from typing import Self, Unpack
else:  # pragma: no cover
    from typing_extensions import Self, Unpack

__all__ = ["AsyncHDF5DataLayer", "HDF5DataLayer", "HDF5Layer"]

_log = logging.getLogger("asynchdf5")

#: A source's catalog, and with several streams each one's rows (() for one).
Looked = tuple[Catalog, tuple[StreamRows, ...]]


def _close_source(files: Source, pid: int) -> None:
    """Close ``files`` if this process opened them (a forked copy is never touched)."""
    if os.getpid() == pid:
        files.close()


class HDF5Layer(LayerBase):
    """What the two HDF5 layers share: the keyword properties, the source, and the opening."""

    def __init__(
        self,
        source: SourceLike | Mapping[str, Stream | SourceLike],
        **properties: Unpack[HDF5Properties],
    ) -> None:
        config = LayerConfig.parse(
            properties, streams=isinstance(source, Mapping), caller=type(self).__name__
        )
        self._setup(source, config)

    @classmethod
    def _with_config(
        cls, source: SourceLike | Mapping[str, Stream | SourceLike], config: LayerConfig
    ) -> Self:
        """A layer over ``source`` with exactly ``config`` (checked already: another layer's,
        its drawn seed included), as the helper process of ``process=True`` makes it."""
        layer = cls.__new__(cls)
        layer._setup(source, config)
        return layer

    def _setup(
        self, source: SourceLike | Mapping[str, Stream | SourceLike], config: LayerConfig
    ) -> None:
        # Every remote read (a list file given as a URL, now; the files, at open) goes through
        # this one object, with the layer's options.
        self._reach = SourceOptions.of(config)
        #: Several streams (``source`` a mapping): each one's files, resolved; () for one.
        self._streams: tuple[StreamSpec, ...] = ()
        if isinstance(source, Mapping):
            self._streams = parse_streams(source, self._reach.resolve, config)
            paths = [e for s in self._streams for e in s.entries]
        else:
            paths = self._reach.resolve(source)
        #: The files (absolute paths, or URLs), resolved at construction: with several
        #: streams, every stream's, stream after stream.
        self.paths = paths
        # The source and catalog that len() (or n_samples, state_dict ...) built before an
        # opening, for that opening; the finalizer closes them if none comes.
        self._looked: tuple[Source, Looked, weakref.finalize[[Source, int], HDF5Layer]] | None = (
            None
        )
        if config.process:
            check_picklable(config, self._helper_source())  # before any batch: what cannot go
        super().__init__(config)

    @property
    def stream_names(self) -> tuple[str, ...]:
        """The names of the streams, in the order of ``source`` (``batch.streams`` indexes
        them); ``()`` for a source that is not a mapping of streams."""
        return tuple(s.name for s in self._streams)

    @property
    def streams(self) -> dict[str, Stream]:
        """The streams by name, their sources resolved (the same layer in another process is
        ``HDF5DataLayer(layer.streams, ...)``); ``{}`` for a source that is not a mapping."""
        return {
            s.name: Stream(list(s.entries), weight=s.weight, choose=s.choose, tops=s.tops or None)
            for s in self._streams
        }

    def state_dict(self) -> dict[str, Any]:
        """:meth:`LayerBase.state_dict`; with several streams, also ``"streams"``: where each
        stream's walk stood when the state's epoch began (``{"pass": j, "offset": k}``: its
        ``k``-th sample of pass ``j``). Informational: it follows from the epoch and the
        streams' samples per epoch, which the fingerprint holds and a resume checks."""
        state = super().state_dict()
        shape = self._shape
        if shape is not None and shape.streams:
            at = {s.name: divmod(state["epoch"] * s.count, s.size) for s in shape.streams}
            state["streams"] = {k: {"pass": j, "offset": o} for k, (j, o) in at.items()}
        return state

    def _build_catalog(self, files: Source) -> Looked:
        """The catalog of every file (blocking); with several streams, each stream's checked
        on its own, then against the others (:func:`~._streams.combine`)."""
        tops = self.config.tops
        if not self._streams:
            return build_catalog(files, self.paths, tops, keep=True), ()
        catalogs = []
        for spec in self._streams:
            try:
                catalogs.append(build_catalog(files, spec.entries, spec.tops or tops, keep=True))
            except DataLayerError as exc:
                if exc.args and isinstance(exc.args[0], str):
                    exc.args = (f"stream {spec.name!r}: {exc.args[0]}", *exc.args[1:])
                raise
        catalog, streams = combine(
            self._streams, catalogs, per_stream=self.config.batch_mode == "per_stream"
        )
        check_schemas(streams, process=self.config.process)
        return catalog, streams

    def _source(self) -> Source:
        return self._reach.open(self.paths)

    def _shape_of(self, catalog: Catalog, streams: tuple[StreamRows, ...] = ()) -> DataShape:
        """The data's shape, and how it is cached: as a loaded state says, else as the
        properties and the budget give (:func:`~._sizing.shape_of`)."""
        planner = self._planner
        forced = planner.shape if planner.resume is not None else None
        return shape_of(catalog, streams, self.config, forced)

    def _look(self) -> DataShape:
        """The data's shape, from a catalog built in a worker thread (h5py is never called on
        an event loop's thread, even from here). The catalog and its open source are kept for
        the next opening, which then does not build them again (a process that never opens
        the layer closes them when the layer is collected)."""
        out: list[tuple[Source, Looked] | BaseException] = []

        def look() -> None:
            files = self._source()
            try:
                out.append((files, self._build_catalog(files)))
            except BaseException as exc:
                files.close()
                out.append(exc)

        thread = threading.Thread(target=look, name="asynchdf5-metadata")
        thread.start()
        thread.join()
        (result,) = out
        if isinstance(result, BaseException):
            raise result
        files, found = result
        try:
            shape = self._shape_of(*found)
        except BaseException:
            files.close()
            raise
        if self._looked is not None:  # looked at again (the shape was dropped): the latest
            self._looked[2]()
        self._looked = (files, found, weakref.finalize(self, _close_source, files, os.getpid()))
        return shape

    async def _catalog(self) -> tuple[Source, Looked]:
        """The source and its catalog: the ones :meth:`_look` kept, else built now."""
        looked, self._looked = self._looked, None
        if looked is not None:
            looked[2].detach()
            return looked[0], looked[1]
        files = self._source()
        try:
            # Waited for whole: the files are closed below only once nothing reads them.
            found = await run_sync_whole(self._build_catalog, files)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await release_whole(files.close)
            raise
        return files, found

    async def _open_source(self, epoch: int, portal: BlockingPortal | None, at: float) -> Opened:
        if self.config.process:
            return await self._open_helper(epoch, portal, at)
        files, (catalog, streams) = await self._catalog()
        chosen: Choice | None = None  # holds the file's lease until the mapped reader takes it
        try:
            planner = self._planner
            # Every size fixed once (the order's, the slots', the memory's), then checked and
            # taken by the planner: control goes down, never back to the sizing.
            loaded = planner.shape if planner.resume is not None else None
            sized = size_opening(
                catalog, streams, self.config, loaded=loaded, resume=planner.resume, epoch=epoch
            )
            shape, rows = sized.shape, sized.slot_rows
            planner.opening(shape)
            slots: list[Slot] | None = None
            # Data larger than the memory the process may use is read from the disk every
            # epoch: it is copied (mmap="auto"), and the reader streams it around the page
            # cache. One figure for both decisions: what is left of it beside what the process
            # (or its cgroup) holds already, where that is less.
            room = memory_room()
            memory = memory_bytes() if room is None else min(memory_bytes(), room.free)
            # Waited for whole: the leases it takes are given back on any failure.
            chosen = choice = await run_sync_whole(
                functools.partial(choose, resident=shape.resident),
                catalog,
                self.config.mmap,
                memory,
                release=Choice.close,
            )
            reader: Reader
            if choice.mapped:  # no slots: rows served in place
                leases, choice.leases = choice.leases, []  # the reader's now
                notes = {top: choice.note_of(top) for top in catalog.tops}
                reader = MappedReader(catalog, files, leases, notes)
            elif shape.resident:
                whole = allocate_slots(catalog.tops, shape.n_samples, count=1)[0].arrays
                reader = HDF5Reader(catalog, files, resident=whole, read_threads=fill_threads())
            else:
                if sized.refused is not None:  # an elastic resume's chunks: too large
                    raise sized.refused
                slots = allocate_slots(catalog.tops, rows)
                # Data larger than memory: read from the disk every epoch, around the page cache
                # (Source.fetch); scattered reads wait on the disk, not the CPU: more in flight.
                # Chunks that are long stretches (unshuffled, or data packed shuffled) are read
                # in order, with the kernel's read-ahead, whatever the order of the chunks.
                # The data's bytes: a ragged top's values (its rows' spans are all a slot's
                # row holds of it), so a sparse matrix larger than memory streams as one.
                streaming: Streaming | None = None
                if 0 < memory < catalog.n_samples * catalog.mean_row_bytes:
                    streaming = "in order" if shape.stretches else "scattered"
                reader = HDF5Reader(
                    catalog,
                    files,
                    read_threads=8 if streaming == "scattered" else 2,
                    streaming=streaming,
                )
            # What each top's note says of it alone (the source's verdict is logged once).
            own = dict(choice.about if choice.mapped else reader.read_notes)
            if isinstance(reader, HDF5Reader) and choice.note != "copied: mmap=False":
                notes = dict(reader.read_notes)
                for top in catalog.tops:
                    notes[top] = "; ".join(filter(None, (notes.get(top), choice.note)))
                reader.read_notes = notes
        except BaseException:
            with anyio.CancelScope(shield=True):
                if chosen is not None:
                    chosen.close()
                await release_whole(files.close)
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
        elif choice.slow is not None:
            _log.warning("mmap=True: %s", choice.slow)
        elif not choice.mapped:
            _log.info("not mapped: %s", choice.note)
        for top, path in reader.read_paths.items():
            note = own.get(top)
            if "chunks" in path:
                note = f"deflate decoder: {deflate_backend()}" + (f"; {note}" if note else "")
            _log.info("top %r is read by %s%s", top, path, f" ({note})" if note else "")
            if "h5py" in path:
                _log.warning(
                    "top %r is read through h5py, which holds its process-wide lock and decodes "
                    "on one thread (%s); `asynchdf5 inspect` says why and how to repack it",
                    top,
                    own.get(top) or "see read_notes",
                )
        return await Opened.enter(
            reader, slots, shape, slot_rows=rows, delivery=self._delivery, portal=portal, at=at
        )

    def _helper_source(self) -> object:
        """What the helper process (``process=True``) is given as its ``source``: the streams
        (each one's files resolved), or the files."""
        return self.streams if self._streams else list(self.paths)

    async def _open_helper(self, epoch: int, portal: BlockingPortal | None, at: float) -> Opened:
        """``process=True``: start the helper process, which opens the layer there (a state
        loaded before opening goes with it, so that its cache is sized for that state)."""
        if self._looked is not None:  # the helper builds its own catalog: close this one's files
            looked, self._looked = self._looked, None
            looked[2]()
        planner = self._planner
        state = self._consumer.run_state() if planner.resume is not None else None
        c = self.config
        device = None
        if c.device is not None:  # the helper gathers host batches; this process uploads them
            c = c.on_host()
            device = (self._delivery, c.batch_size)
        blob = payload(self._helper_source(), c, planner.part, state)
        slots = ring_slots(c.prefetch)
        reader, shape = await ProcessReader.start(blob, self._stats, slots, device)
        try:
            check_schemas(shape.streams, process=True)
            rows = held_rows(shape, planner.resume, epoch)  # as the helper's opening sized them
            planner.opening(shape)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await reader.aclose()
            raise
        return await Opened.enter(
            reader, None, shape, slot_rows=rows, delivery=self._delivery, portal=portal, at=at
        )


class AsyncHDF5DataLayer(HDF5Layer):
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


class HDF5DataLayer(HDF5Layer):
    """Shuffled minibatches from HDF5 files, for ordinary ``with`` / ``for`` loops.

    The same keyword properties as :class:`AsyncHDF5DataLayer`; the pipeline runs on an asyncio
    event loop in a background thread. Every call crosses one bridge to that loop; iterating
    takes the batches the pipeline has ready (up to 256) per trip. ``async with`` and
    ``async for`` work too, as on :class:`AsyncHDF5DataLayer`.

    Examples
    --------
    >>> import asynchdf5
    >>> def train(path):
    ...     with asynchdf5.HDF5DataLayer(path, batch_size=32, shuffle=True, seed=0) as layer:
    ...         for epoch in range(3):
    ...             for batch in layer:
    ...                 ...
    """


_SOURCE = "source : str, path, sequence of them, or mapping of str to Stream\n    " + SOURCE_DOC
document(AsyncHDF5DataLayer, hdf5=True, first=_SOURCE)
document(HDF5DataLayer, hdf5=True, first=_SOURCE)
