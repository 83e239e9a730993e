"""S3 through obstore, whose HTTP client (Rust) runs outside the GIL.

With s3fs, every request and every piece of a body is Python on the source's loop: botocore's
request handling, aiohttp's protocol. A consumer that keeps the GIL busy (a training step in
Python, the pipeline's own threads) then starves the network thread, and the reads slow down
many times over. obstore does the HTTP in its own threads; the source's loop only awaits each
request and copies its body once.

It is used instead of s3fs only where nothing s3fs would have done is lost
(:func:`obstore_settings`): every ``storage_options`` key is one translated here, the
credentials are given (in the options or the environment) or ``anon``, the region or endpoint is
known, and no ``AWS_*`` setting or ``~/.aws`` file is in play that s3fs (botocore) would read and
obstore would not. Otherwise s3fs reads. ``ASYNCHDF5_S3_CLIENT`` chooses: ``auto`` (the default),
``obstore`` (an error if the options cannot be translated; files in ``~/.aws`` are then not read),
or ``s3fs``.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._errors import Changed, s3_empty_range, s3_missing
from ._transfer import Transfer

if TYPE_CHECKING:
    from obstore import GetOptions

#: The variable that chooses the S3 client.
CLIENT_VARIABLE = "ASYNCHDF5_S3_CLIENT"

# storage_options keys that only tune fsspec's own file objects and listings (unused here).
_FSSPEC_ONLY = {
    "default_block_size",
    "default_fill_cache",
    "default_cache_type",
    "skip_instance_cache",
    "use_listings_cache",
    "listings_expiry_time",
    "max_paths",
}
# AWS_* variables translated here (botocore and obstore would read them alike: we pass them).
_ENV_TRANSLATED = {
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
}


class NotTranslated(Exception):
    """The options or the environment ask for something only s3fs does (the message says what)."""


def obstore_settings(
    options: Mapping[str, Any],
    transfer: Transfer,
    environ: Mapping[str, str] | None = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """The keyword arguments of ``obstore.store.S3Store`` (less the bucket) that do what s3fs
    would do with ``options`` and the environment; :class:`NotTranslated` where that is not
    sure. Not ``strict`` (the user chose obstore): other ``AWS_*`` variables and ``~/.aws``
    files are not looked at."""
    env = os.environ if environ is None else environ
    opts = dict(options)
    for k in _FSSPEC_ONLY:
        opts.pop(k, None)
    client_kwargs = dict(opts.pop("client_kwargs", None) or {})
    endpoint = opts.pop("endpoint_url", None) or client_kwargs.pop("endpoint_url", None)
    region = client_kwargs.pop("region_name", None)
    key = opts.pop("key", None) or opts.pop("username", None)
    secret = opts.pop("secret", None) or opts.pop("password", None)
    token = opts.pop("token", None)
    anon = bool(opts.pop("anon", False))
    unknown = sorted(opts) + [f"client_kwargs[{k!r}]" for k in sorted(client_kwargs)]
    if unknown:
        raise NotTranslated(f"storage_options {', '.join(map(str, unknown))}")
    others = sorted(
        k for k in env if k.startswith("AWS_") and k not in _ENV_TRANSLATED and env[k] != ""
    )
    endpoint = endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    plain_http = str(endpoint or "").startswith("http://")
    if others == ["AWS_CA_BUNDLE"] and plain_http:
        others = []  # certificates do not matter without TLS
    if others and strict:
        raise NotTranslated(f"the environment's {', '.join(others)}")
    home = Path(env.get("HOME") or Path.home())
    aws_files = [p for p in (home / ".aws/config", home / ".aws/credentials") if p.exists()]
    if aws_files and strict:
        raise NotTranslated(f"{aws_files[0]} (botocore reads it)")
    if not anon and key is None and secret is None:
        key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
        token = token or env.get("AWS_SESSION_TOKEN")
    if not anon and not (key and secret):
        raise NotTranslated("credentials found by botocore's chain (instance role, SSO, ...)")
    region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region is None:
        if endpoint is None:
            raise NotTranslated("no region: s3fs asks each bucket for its own")
        region = "us-east-1"  # what botocore signs with for an endpoint of no region
    config: dict[str, Any] = {"aws_region": str(region)}
    if endpoint:
        # obstore also reads AWS_ENDPOINT_URL_S3 itself, and prefers it to ``aws_endpoint``:
        # the endpoint chosen here goes in both, so that the environment cannot override it.
        config["aws_endpoint"] = config["aws_endpoint_url_s3"] = str(endpoint)
    settings: dict[str, Any] = {"config": config}
    if anon:
        config["aws_skip_signature"] = True
    else:
        # A provider, not config keys: obstore would add the environment's AWS_SESSION_TOKEN to
        # keys given in its config; these credentials are signed with as they are.
        settings["credential_provider"] = Credentials(str(key), str(secret), token and str(token))
    # Our retries and timeouts govern (counted, bounded once): obstore's would only add to them.
    limit = f"{int(transfer.timeout) + 5}s"
    settings["client_options"] = {"allow_http": plain_http, "timeout": limit}
    settings["retry_config"] = {
        "max_retries": 0,
        "retry_timeout": dt.timedelta(seconds=transfer.timeout + 5),
    }
    return settings


class Credentials:
    """Static S3 credentials for obstore's ``credential_provider`` (asked once: they never
    expire). Its ``repr`` shows no value."""

    __slots__ = ("_value",)

    def __init__(self, key: str, secret: str, token: str | None) -> None:
        self._value = {"access_key_id": key, "secret_access_key": secret, "token": token}

    def __call__(self) -> dict[str, Any]:
        return {**self._value, "expires_at": None}

    def __repr__(self) -> str:
        return "Credentials(...)"


# --- errors -----------------------------------------------------------------------------------

_STATUS = re.compile(r"non-2xx status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]+)</Code>")
_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_TOOK = re.compile(r" in [0-9.]+[a-zµ]*s\b")


class StoreError(Exception):
    """What obstore raised, with the HTTP status and S3 error code it carries (as
    :func:`~._errors.status_of` reads them)."""

    def __init__(self, text: str, status: int | None, code: str | None) -> None:
        super().__init__(text)
        self.status = status
        self.code = code


class StoreConnectionError(StoreError, ConnectionError):
    """A request that got no HTTP answer: a lost or refused connection, a timeout."""


class StoreNotFound(StoreError, FileNotFoundError):
    """HTTP 404: no such object or bucket."""


def translate(exc: BaseException) -> BaseException:
    """obstore's error as one that :func:`~._errors.classify` sorts (its text shortened)."""
    if not isinstance(exc, Exception) or isinstance(exc, (StoreError, Changed)):
        return exc
    text = str(exc)
    head = text.split("\n\nDebug source", 1)[0].strip()
    m = _STATUS.search(head)
    status = int(m.group(1)) if m else None
    code = m.group(1) if (m := _CODE.search(head)) else None
    said = m.group(1) if (m := _MESSAGE.search(head)) else None
    if status is not None:  # "... GET <url> in 1.2ms - Server returned non-2xx ...: <xml>"
        head = _TOOK.sub("", head.split(" - Server returned", 1)[0])
        if code:
            head += f": {code}" + (f": {said}" if said else "")
    cls: type[StoreError] = StoreError
    if status == 404 or isinstance(exc, FileNotFoundError):
        cls = StoreNotFound
    elif status is None and "HTTP error" in head:
        cls = StoreConnectionError
    err = cls(head, status, code)
    err.__cause__ = exc
    return err


# --- the store --------------------------------------------------------------------------------


class ObstoreS3:
    """S3 through obstore (one ``S3Store`` per bucket): a :class:`~._stores.Store` with the same
    behaviour as :class:`~._stores.S3Store`: every GET conditional on the ETag recorded at open,
    errors kept with their status and S3 code, no retries of its own."""

    conditional = True

    def __init__(self, settings: Mapping[str, Any]) -> None:
        import obstore  # noqa: F401 - fails here, at the choice, not at the first request

        self._settings = dict(settings)
        self._buckets: dict[str, Any] = {}

    @staticmethod
    def _split(url: str) -> tuple[str, str]:
        """``s3://bucket/key`` as (bucket, key)."""
        bucket, _, key = url.split("://", 1)[1].partition("/")
        return bucket, key

    @staticmethod
    def _version(meta: Mapping[str, Any]) -> dict[str, str]:
        return {"ETag": str(meta.get("e_tag") or "")}

    def _where(self, url: str) -> tuple[Any, str]:
        bucket, key = self._split(url)
        store = self._buckets.get(bucket)
        if store is None:
            from obstore.store import S3Store as ObS3Store

            store = ObS3Store(bucket, **self._settings)
            self._buckets[bucket] = store
        return store, key

    async def _get(self, url: str, start: int, stop: int, etag: str | None) -> Any:
        """The body of bytes ``start:stop`` (obstore's ``Bytes``), refused if not ``etag``."""
        import obstore

        store, key = self._where(url)
        options: GetOptions = {"range": (start, stop)}
        if etag:
            options["if_match"] = etag
        try:
            resp = await obstore.get_async(store, key, options=options)
            data = await resp.bytes_async()
        except Exception as exc:
            raise translate(exc) from None
        served = resp.meta.get("e_tag")
        if etag and served and served != etag:  # a store that ignores If-Match
            raise Changed(f"ETag {etag} -> {served}")
        return data, resp.meta

    async def head(self, url: str) -> tuple[int, dict[str, str]]:
        import obstore

        store, key = self._where(url)
        try:
            meta = await obstore.head_async(store, key)
        except Exception as exc:
            raise translate(exc) from None
        return int(meta["size"]), self._version(meta)

    async def first(self, url: str, n: int) -> tuple[int, dict[str, str], bytes]:
        try:
            data, meta = await self._get(url, 0, n, None)
        except StoreError as exc:
            if not s3_empty_range(exc):
                raise
            size, version = await self.head(url)  # an empty object
            return size, version, b""
        return int(meta["size"]), self._version(meta), bytes(data)

    async def get(self, url: str, start: int, stop: int, version: Mapping[str, str]) -> bytes:
        if stop <= start:
            return b""
        data, _ = await self._get(url, start, stop, version.get("ETag"))
        return bytes(data)

    async def stream(
        self,
        url: str,
        start: int,
        stop: int,
        version: Mapping[str, str],
        put: Callable[[int, memoryview], None],
    ) -> int:
        # The body arrives whole, outside the GIL, and is copied once.
        if stop <= start:
            return 0
        data, _ = await self._get(url, start, stop, version.get("ETag"))
        view = memoryview(data)
        put(0, view)
        return len(view)

    def missing_what(self, url: str, exc: BaseException) -> str:
        return s3_missing(exc, self._split(url)[0])

    async def close(self) -> None:
        self._buckets.clear()  # their clients and connections go with them
