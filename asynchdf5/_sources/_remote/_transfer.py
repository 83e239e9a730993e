"""How a remote source moves bytes: its sizes, bounds, retries and timeouts."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Transfer:
    """How a remote source moves bytes (the module's :data:`TRANSFER`, read when a source is
    created)."""

    #: Bytes of one request at most: longer runs are cut into parts fetched concurrently.
    part_bytes: int = 8 * 2**20
    #: Ranges of one object less than this apart are fetched by one request (the gap is dropped):
    #: a request costs a round trip, a few hundred KiB cost less on any link worth streaming from.
    gap_bytes: int = 256 * 2**10
    #: Requests in flight per source.
    requests: int = 16
    #: Bytes held in buffers per source: raw chunks waiting to be decoded, blocks of the remote
    #: cache (bytes bound for the cache slot go straight there).
    bytes_in_flight: int = 128 * 2**20
    #: Tries of one request before it is a ReadError (transient errors only).
    attempts: int = 6
    #: Wait before the first retry (seconds); doubled for each next one, up to ``max_backoff``,
    #: times a random factor in [0.5, 1.5) so that ranks that failed together retry apart.
    backoff: float = 0.2
    max_backoff: float = 5.0
    #: One try of one request, at most (seconds): a stalled connection is a transient error.
    timeout: float = 60.0
    #: h5py's reads (metadata at open, the h5py read path) are fetched in blocks of this size,
    #: the last ``metadata_blocks`` of them kept per open file.
    metadata_block: int = 256 * 2**10
    metadata_blocks: int = 16
    #: remote_cache: objects are cached in blocks of this size.
    cache_block: int = 8 * 2**20

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed try number ``attempt`` (1, 2, ...)."""
        wait = min(self.max_backoff, self.backoff * 2.0 ** (attempt - 1))
        return float(wait * random.uniform(0.5, 1.5))


#: The transfer settings new sources take.
TRANSFER = Transfer()
