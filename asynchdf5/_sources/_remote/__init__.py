"""Remote objects behind the source seam: fsspec URLs (``s3://``, ``gs://``, ``az://``,
``https://``, ``memory://``, ...).

A :class:`RemoteSource` (``_source``) is composed of a store per protocol (``_stores``,
``_obstore``), one fetcher for every request (``_fetch``) and, with ``remote_cache``, a disk cache
(``_cache``); the objects it opens (``_files``) read through the same fetcher. ``_transfer``
holds the settings and the loop thread, ``_errors`` what stores answer and the secrets kept out
of messages. Modules import one way: source, fetch, files, cache, stores, transfer, errors.

**Where requests run.** Every request runs on an asyncio event loop of the source's own, in a
thread started when it opens its first remote object and joined when it closes. The fsspec
filesystem is created on that loop (``asynchronous=True``, never from fsspec's instance cache),
so its connection pool, retries and sockets belong to the source and end with it: no
process-wide IO thread, no pool shared with another layer. The layer's event loop (asyncio or
trio) never waits for bytes: :meth:`RemoteSource.fetch` hands one coroutine per call to the
source's loop and waits for it in a worker thread. h5py reads metadata (at open) and the h5py read
path through a blocking file object, in worker threads only. Filesystems without an async
implementation (``memory://``, ...) run in a small pool of the source's own. S3 goes through
obstore instead of s3fs where it does the same with the user's settings (``_obstore``): its HTTP
runs in Rust threads, outside the GIL, and the source's loop only awaits each request and copies
its body once.

**How bytes move** (``_fetch``). The ranges of one fetch are grouped by object, ranges closer
than ``gap_bytes`` are coalesced, and the runs are cut into parts of at most ``part_bytes``,
fetched concurrently, at most ``requests`` at a time per source. Bytes bound for the cache slot
are copied there as the HTTP body arrives (one copy); raw chunks to decode land in reused buffers
(``bytes_in_flight`` of them at most) and go to the layer's codec threads.

**Integrity.** Each object's version (its ETag, or what fsspec reports: generation, version id,
modification time) is recorded at open. On S3 every GET is conditional (``If-Match``): an object
changed since is refused by the store itself; elsewhere each fetch ends with one metadata request
per object. An object changed or deleted is a :class:`~asynchdf5.ReadError` naming the URL, the
top and the rows. Transient errors (timeouts, lost connections, 5xx, throttling) are retried with
exponential backoff and jitter, and counted in the reader's ``ReadStats.retries`` (``_errors``
sorts what the stores answer).

**Errors at open** (missing object or bucket, bad credentials) are a
:class:`~asynchdf5.SourceError` naming the URL; no message ever shows a value of
``storage_options`` or a password in a URL.

**remote_cache**: see :class:`DiskCache` (``_cache``).
"""

from __future__ import annotations

from ._cache import DiskCache
from ._files import RemoteFile
from ._source import RemoteSource, read_source_url
from ._transfer import TRANSFER, Transfer

__all__ = [
    "TRANSFER",
    "DiskCache",
    "RemoteFile",
    "RemoteSource",
    "Transfer",
    "read_source_url",
]
