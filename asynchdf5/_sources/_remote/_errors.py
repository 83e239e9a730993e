"""What stores answer, sorted into what asynchdf5 does about it (:func:`classify`), the errors
that name the object (:func:`read_error`, :func:`check_length`, :func:`decode_error`), and
secrets kept out of messages (:class:`Secrets`)."""

from __future__ import annotations

import asyncio
import re
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

from ..._errors import DataLayerError, ReadError

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")

# What the stores say, by error code or HTTP status (S3, GCS, Azure and plain HTTP alike).
_MISSING = {"404", "NoSuchKey", "NoSuchBucket", "NotFound", "BlobNotFound", "ContainerNotFound"}
_DENIED = {
    "401",
    "403",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AuthenticationFailed",
    "AuthorizationFailure",
    "NoCredentialsError",
    "PartialCredentialsError",
}
_CHANGED = {"412", "PreconditionFailed", "ConditionNotMet"}
_THROTTLED = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "RequestTimeout",
    "ServiceUnavailable",
    "InternalError",
    "ServerBusy",
    "OperationTimedOut",
}
# Transient by class name (botocore's and aiohttp's, without importing either here).
_TRANSIENT_CLASSES = {
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ResponseStreamingError",
    "IncompleteReadError",
    "HTTPClientError",
    "ClientConnectionError",
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "ClientOSError",
    "ClientConnectorError",
}


# --- secrets --------------------------------------------------------------------------------


# Options whose values say where, not who: left in messages (a URL's password is still hidden).
_NOT_SECRET = {"endpoint_url", "region_name", "region", "project", "use_ssl", "default_cache_type"}


class Secrets:
    """Hides the values of ``storage_options`` (and passwords in URLs) in text."""

    def __init__(self, options: Mapping[str, Any] | None) -> None:
        self._values: list[str] = sorted(set(self._collect(options or {})), key=len, reverse=True)

    def _collect(self, value: object, key: str = "") -> Iterator[str]:
        if isinstance(value, Mapping):
            for k, v in value.items():
                yield from self._collect(v, str(k))
        elif isinstance(value, (list, tuple, set)):
            for v in value:
                yield from self._collect(v, key)
        elif isinstance(value, (str, bytes)):
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            if key not in _NOT_SECRET and len(text) >= 4:
                yield text

    def __call__(self, text: str) -> str:
        for secret in self._values:
            text = text.replace(secret, "***")
        return _USERINFO.sub(r"\1***@", text)

    def leaks(self, exc: BaseException) -> bool:
        """Whether printing ``exc`` (with its causes) would show a secret."""
        shown = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return self(shown) != shown


def describe(exc: BaseException) -> str:
    """``exc`` in a message: its class, the HTTP status the store answered, its text."""
    # Our retries replace botocore's (turned off), so its count of them only confuses.
    text = str(exc).replace(" (reached max retries: 0)", "").strip()
    status = status_of(exc)[1]
    head = f"{type(exc).__name__} (HTTP {status})" if status else type(exc).__name__
    return f"{head}: {text}" if text else head


# --- errors ---------------------------------------------------------------------------------


def status_of(exc: BaseException) -> tuple[str | None, int | None]:
    """The error code and HTTP status a store answered with, when ``exc`` carries them."""
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):  # botocore's ClientError
        error = response.get("Error") or {}
        meta = response.get("ResponseMetadata") or {}
        code = error.get("Code")
        status = meta.get("HTTPStatusCode")
        return (str(code) if code else None), (int(status) if status else None)
    status = getattr(exc, "status", None) or getattr(exc, "status_code", None)
    code = getattr(exc, "code", None)
    return (str(code) if isinstance(code, str) else None), (
        int(status) if isinstance(status, int) else None
    )


def s3_missing(exc: BaseException, bucket: str) -> str:
    """What S3 said is missing (``exc``, about an object of ``bucket``), for a message: the
    object, or its bucket (whatever the client, s3fs's or obstore's)."""
    if status_of(exc)[0] == "NoSuchBucket":
        return f"does not exist (there is no bucket {bucket!r})"
    return "does not exist"


def s3_empty_range(exc: BaseException) -> bool:
    """Whether S3 refused a ranged GET of an object's first bytes because it has none
    (``InvalidRange``): its size and version then come from a HEAD."""
    return status_of(exc)[0] == "InvalidRange"


def classify(exc: BaseException) -> str:
    """``"missing"``, ``"denied"``, ``"changed"``, ``"transient"`` or ``"other"``."""
    code, status = status_of(exc)
    names = {c.__name__ for c in type(exc).__mro__}
    if code in _CHANGED or status == 412 or isinstance(exc, Changed):
        return "changed"
    if code in _MISSING or status == 404 or isinstance(exc, FileNotFoundError):
        return "missing"
    if (
        code in _DENIED
        or status in (401, 403)
        or names & _DENIED
        or isinstance(exc, PermissionError)
    ):
        return "denied"
    if code in _THROTTLED or status in (408, 429) or (status is not None and status >= 500):
        return "transient"
    if names & _TRANSIENT_CLASSES or isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "transient"
    if isinstance(exc, (ConnectionError, EOFError)):
        return "transient"
    if isinstance(exc, OSError) and not isinstance(
        exc, (IsADirectoryError, NotADirectoryError, FileExistsError)
    ):
        return "transient"  # a socket error (an aiohttp ClientOSError is one too)
    return "other"


def read_error(
    name: str, about: str, exc: BaseException, attempts: int, scrub: Secrets
) -> ReadError:
    """The :class:`~asynchdf5.ReadError` for a request about ``about`` of the object ``name``
    that failed with ``exc`` (after ``attempts`` tries, if transient): the object changed, was
    deleted, or could not be read. Its cause is kept unless printing it would show a secret."""
    what = classify(exc)
    if what == "changed":
        detail = f" ({exc})" if isinstance(exc, Changed) else ""
        msg = f"{name}: {about}: the object was changed after the source was opened{detail}"
    elif what == "missing":
        msg = f"{name}: {about}: the object was deleted after the source was opened"
    elif what == "transient":
        msg = f"{name}: {about}: read failed after {attempts} attempts: {describe(exc)}"
    else:
        msg = f"{name}: {about}: read failed: {describe(exc)}"
    err = ReadError(scrub(msg))
    if not scrub.leaks(exc):
        err.__cause__ = exc
    err.__suppress_context__ = True
    return err


def check_length(name: str, about: str, start: int, stop: int, n: int) -> None:
    """Raise a :class:`~asynchdf5.ReadError` if ``n`` bytes came for ``start:stop``."""
    if n != stop - start:
        raise ReadError(
            f"{name}: {about}: {stop - start} bytes at offset {start} are cut short "
            f"({n} came; the object is shorter than when the source was opened)"
        )


def decode_error(exc: BaseException, name: str, about: str) -> BaseException:
    """What to raise for ``exc`` from a codec thread: our errors as they are, others as a
    :class:`~asynchdf5.ReadError` naming the object and what was read."""
    if isinstance(exc, DataLayerError) or not isinstance(exc, Exception):
        return exc
    err = ReadError(f"{name}: {about}: read failed: {describe(exc)}")
    err.__cause__ = exc
    return err


class Changed(Exception):
    """The store served another version of the object than the one opened."""


class ObjectChanged(ReadError):
    """The object was changed or deleted since the source opened it (found by a check)."""


class ReadFailed(OSError):
    """A read of h5py's file object failed. An ``OSError``, so that the h5py read path takes it
    as a failed read and checks the object, to name the cause (changed, deleted)."""
