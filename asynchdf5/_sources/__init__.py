"""The source seam: where the bytes of a layer's HDF5 files come from.

:class:`Source` is the protocol (open a file, fetch byte ranges of it, close); ``_local`` keeps
local files behind it. The catalog and the chunk reader above the seam work with any source.
"""

from __future__ import annotations

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
    "resolve_source",
]
