"""The source seam: where the bytes of a layer's HDF5 files come from.

:class:`Source` is the protocol (open a file, fetch byte ranges of it, close); ``_local`` keeps
local files behind it, ``_remote`` fsspec URLs. The catalog and the chunk reader above the seam
work with any source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._base import ByteRange, Source, StoredFile, Streaming, is_url
from ._entries import SourceLike, is_hdf5_file, name_entry, resolve_source
from ._local import LocalSource
from ._remote import RemoteSource

if TYPE_CHECKING:  # a type only: the configuration sits above the sources
    from .._config import LayerConfig

__all__ = [
    "ByteRange",
    "LocalSource",
    "RemoteSource",
    "Source",
    "SourceLike",
    "SourceOptions",
    "StoredFile",
    "Streaming",
    "is_hdf5_file",
    "is_url",
    "name_entry",
    "open_source",
    "resolve_source",
]


def open_source(
    entries: Sequence[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    cache: str | None = None,
    cache_bytes: int | None = None,
) -> Source:
    """The source for ``entries`` (absolute paths, or URLs): local files, or remote objects.

    ``storage_options``, ``cache`` and ``cache_bytes`` are the layer's ``storage_options``,
    ``remote_cache`` and ``remote_cache_bytes`` properties (remote sources only). Any URL among
    the entries makes it a :class:`RemoteSource`, which reads the local paths (and ``file://``
    URLs) among them as local files. Cheap: nothing is opened, nothing imported (fsspec comes
    with the first remote open, in a worker thread).
    """
    if any(is_url(e) for e in entries):
        return RemoteSource(storage_options, cache=cache, cache_bytes=cache_bytes)
    return LocalSource()


@dataclass(frozen=True)
class SourceOptions:
    """How a layer reaches its files: its ``storage_options``, ``remote_cache`` and
    ``remote_cache_bytes`` properties, in one object through which the layer both resolves its
    source (a list file given as a URL is read at construction) and opens its files, so that
    every remote read, of the list or of an HDF5 object, takes the same options."""

    storage_options: Mapping[str, Any] | None = None
    cache: str | None = None
    cache_bytes: int | None = None

    @classmethod
    def of(cls, config: LayerConfig) -> SourceOptions:
        """A layer's options, from its configuration."""
        return cls(config.storage_options, config.remote_cache, config.remote_cache_bytes)

    def resolve(self, source: SourceLike) -> list[str]:
        """:func:`resolve_source` with these options."""
        return resolve_source(source, storage_options=self.storage_options)

    def open(self, entries: Sequence[str]) -> Source:
        """:func:`open_source` with these options."""
        return open_source(
            entries,
            storage_options=self.storage_options,
            cache=self.cache,
            cache_bytes=self.cache_bytes,
        )
