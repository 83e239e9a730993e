"""The source seam: where the bytes of a layer's HDF5 files come from.

:class:`Source` is the protocol (open a file, fetch byte ranges of it, close); ``_local`` keeps
local files behind it. The catalog and the chunk reader above the seam work with any source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._base import ByteRange, Source, StoredFile
from ._entries import SourceLike, is_hdf5_file, is_url, resolve_source
from ._local import LocalSource

__all__ = [
    "ByteRange",
    "LocalSource",
    "Source",
    "SourceLike",
    "StoredFile",
    "is_hdf5_file",
    "is_url",
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
    ``remote_cache`` and ``remote_cache_bytes`` properties (remote sources only).
    """
    if any(is_url(e) for e in entries):
        raise NotImplementedError("remote sources (fsspec URLs) are not built yet")
    return LocalSource()
