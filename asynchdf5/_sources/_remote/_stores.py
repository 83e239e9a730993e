"""Stores: what a remote source reads objects through (:class:`Store`), and its fsspec kinds (any
filesystem; S3 through s3fs). The obstore kind is in :mod:`._obstore`; the source picks one per
protocol (:func:`._source.make_store`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any, Protocol, TypeVar

from ._errors import Changed, s3_empty_range, s3_missing

T = TypeVar("T")


_VERSION_KEYS = (
    "ETag",
    "etag",
    "e_tag",
    "generation",
    "VersionId",
    "version_id",
    "md5Hash",
    "crc32c",
    "content_md5",
    "LastModified",
    "last_modified",
    "mtime",
    "updated",
    "modified",
    "created",
)


def version_of(info: Mapping[str, Any]) -> dict[str, str]:
    """What identifies an object's content in fsspec's ``info()``: ETags, generations,
    modification times."""
    return {k: str(info[k]) for k in _VERSION_KEYS if info.get(k) not in (None, "")}


class Store(Protocol):
    """The objects of one protocol (``s3``, ``gs``, ``memory``, ...) with the source's
    ``storage_options``, used on the source's loop only. Three kinds are behind it: any fsspec
    filesystem (:class:`FsspecStore`), S3 through s3fs's client (:class:`S3Store`), and S3
    through obstore (:class:`~._obstore.ObstoreS3`); the source picks one per protocol."""

    #: Whether :meth:`get` and :meth:`stream` themselves refuse another version than the one
    #: opened (``If-Match``); if not, each fetch is checked afterwards by one metadata request
    #: per object.
    conditional: bool

    async def head(self, url: str) -> tuple[int, dict[str, str]]:
        """The object's size and version."""
        ...

    async def first(self, url: str, n: int) -> tuple[int, dict[str, str], bytes]:
        """The object's size, version and first ``n`` bytes (fewer if it is shorter)."""
        ...

    async def get(self, url: str, start: int, stop: int, version: Mapping[str, str]) -> bytes:
        """Bytes ``start:stop`` of the object (``version``: what it was at open)."""
        ...

    async def stream(
        self,
        url: str,
        start: int,
        stop: int,
        version: Mapping[str, str],
        put: Callable[[int, memoryview], None],
    ) -> int:
        """Bytes ``start:stop`` handed to ``put(offset, piece)`` as they arrive; returns how
        many came."""
        ...

    def missing_what(self, url: str, exc: BaseException) -> str:
        """What is missing, for a message (the object, or its bucket)."""
        ...

    async def close(self) -> None:
        """Close the store's connections."""
        ...


class FsspecStore:
    """Any fsspec filesystem: reads with ``_cat_file`` (or ``cat_file`` on a thread of
    ``pool``); each fetch is checked afterwards by one metadata request per object."""

    conditional = False

    def __init__(self, fs: Any, pool: Executor) -> None:
        self.fs = fs
        self.pool = pool
        self.is_async = bool(getattr(fs, "async_impl", False))

    async def _blocking(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, functools.partial(fn, *args, **kw)
        )

    def _path(self, url: str) -> str:
        return str(self.fs._strip_protocol(url))

    async def head(self, url: str) -> tuple[int, dict[str, str]]:
        path = self._path(url)
        if self.is_async:
            info = await self.fs._info(path)
        else:
            info = await self._blocking(self.fs.info, path)
        if info.get("type") == "directory":
            raise IsADirectoryError(f"{url} is a directory")
        return int(info["size"]), version_of(info)

    async def first(self, url: str, n: int) -> tuple[int, dict[str, str], bytes]:
        size, version = await self.head(url)
        return size, version, await self.get(url, 0, min(n, size), version)

    async def get(self, url: str, start: int, stop: int, version: Mapping[str, str]) -> bytes:
        if stop <= start:
            return b""
        path = self._path(url)
        if self.is_async:
            data = await self.fs._cat_file(path, start=start, end=stop)
        else:
            data = await self._blocking(self.fs.cat_file, path, start=start, end=stop)
        return bytes(data)

    async def stream(
        self,
        url: str,
        start: int,
        stop: int,
        version: Mapping[str, str],
        put: Callable[[int, memoryview], None],
    ) -> int:
        data = await self.get(url, start, stop, version)  # in one piece
        put(0, memoryview(data))
        return len(data)

    def missing_what(self, url: str, exc: BaseException) -> str:
        return "does not exist"

    async def close(self) -> None:
        # The HTTP session of an async filesystem.
        session = getattr(self.fs, "_session", None)
        if session is not None and hasattr(session, "close"):
            closed = session.close()
            if asyncio.iscoroutine(closed):
                await closed


class S3Store:
    """S3 through s3fs's aiobotocore client, called directly: every GET is conditional
    (``If-Match`` the ETag recorded at open), errors keep their S3 code, and retries are ours
    (counted), not botocore's."""

    conditional = True

    def __init__(self, fs: Any) -> None:
        self.fs = fs  # an s3fs filesystem, asynchronous

    async def _client(self, bucket: str) -> Any:
        await self.fs.set_session()
        return await self.fs.get_s3(bucket)

    def _split(self, url: str) -> tuple[str, str, dict[str, str]]:
        bucket, key, version_id = self.fs.split_path(url)
        return bucket, key, ({"VersionId": version_id} if version_id else {})

    @staticmethod
    async def _body(resp: Mapping[str, Any]) -> bytes:
        body = resp["Body"]
        try:
            return bytes(await body.read())
        finally:
            body.close()

    async def head(self, url: str) -> tuple[int, dict[str, str]]:
        bucket, key, kw = self._split(url)
        out = await (await self._client(bucket)).head_object(Bucket=bucket, Key=key, **kw)
        return int(out["ContentLength"]), {"ETag": str(out.get("ETag", ""))}

    async def first(self, url: str, n: int) -> tuple[int, dict[str, str], bytes]:
        # One request for the size, the ETag and the first block (the superblock and more).
        bucket, key, kw = self._split(url)
        s3 = await self._client(bucket)
        try:
            resp = await s3.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{n - 1}", **kw)
        except Exception as exc:
            if not s3_empty_range(exc):
                raise
            size, version = await self.head(url)  # an empty object
            return size, version, b""
        data = await self._body(resp)
        crange = str(resp.get("ContentRange") or "")
        size = int(crange.rsplit("/", 1)[1]) if "/" in crange else int(resp["ContentLength"])
        return size, {"ETag": str(resp.get("ETag", ""))}, data

    async def _ranged(
        self, url: str, start: int, stop: int, version: Mapping[str, str]
    ) -> dict[str, Any]:
        """The response to a GET of bytes ``start:stop`` of the version seen at open; its body
        not yet read. A store that ignores If-Match still says which version it served."""
        bucket, key, kw = self._split(url)
        etag = version.get("ETag")
        if etag:
            kw["IfMatch"] = etag
        s3 = await self._client(bucket)
        resp: dict[str, Any] = await s3.get_object(
            Bucket=bucket, Key=key, Range=f"bytes={start}-{stop - 1}", **kw
        )
        if etag and resp.get("ETag") and resp["ETag"] != etag:
            resp["Body"].close()
            raise Changed(f"ETag {etag} -> {resp['ETag']}")
        return resp

    async def get(self, url: str, start: int, stop: int, version: Mapping[str, str]) -> bytes:
        if stop <= start:
            return b""
        return await self._body(await self._ranged(url, start, stop, version))

    async def stream(
        self,
        url: str,
        start: int,
        stop: int,
        version: Mapping[str, str],
        put: Callable[[int, memoryview], None],
    ) -> int:
        # The body's pieces as aiohttp receives them, each copied once (into the cache slot):
        # reading it whole would first join them into one more copy.
        if stop <= start:
            return 0
        body = (await self._ranged(url, start, stop, version))["Body"]
        content = getattr(getattr(body, "raw_stream", None), "content", None)
        n = 0
        try:
            if content is None or not hasattr(content, "readany"):  # another HTTP backend
                data = await body.read()
                put(0, memoryview(data))
                return len(data)
            while piece := await content.readany():
                put(n, memoryview(piece))
                n += len(piece)
        finally:
            body.close()
        return n

    def missing_what(self, url: str, exc: BaseException) -> str:
        return s3_missing(exc, self._split(url)[0])

    async def close(self) -> None:
        creator = getattr(self.fs, "_s3creator", None)
        self.fs._s3 = None
        if creator is not None:
            self.fs._s3creator = None
            await creator.__aexit__(None, None, None)
