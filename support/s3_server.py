"""A real S3 API for the remote-source tests and benchmarks: moto's server in a subprocess of its
own, behind a small WSGI middleware that injects faults. It lives in ``support/``, beside both:
the tests do not import the benchmarks, nor the benchmarks the tests.

Why a subprocess: the server's threads and sockets stay out of the test process, whose leak check
counts threads and file descriptors after every test; and killing it is a real server crash.

The middleware (``_Faults``) answers ``/_faults`` itself: ``POST`` a JSON object to change what it
does, ``GET`` to read its counters. It can

* add a latency to every request (``latency``: seconds slept before the request is handled, in
  the request's own server thread, so concurrent requests wait concurrently: a round trip);
* fail the next requests that match (``fail``: ``{"status": 503, "count": 2, "method": "GET",
  "match": "part1"}``) with an S3 error document (503 ``SlowDown``, 500 ``InternalError``);
* stall them (``stall``: ``{"seconds": 5, "count": 1, ...}``) before they are handled, noticing a
  client that hangs up meanwhile (counted as ``abandoned``);
* serve ranged GETs of stored objects without copying the whole object (``--fast-ranges``):
  moto reads an object whole for every ranged GET, which makes a large object's ranged reads
  O(object size) each; the benchmarks need O(range), the tests do not use it.

Counters: requests per method, ``get_bytes`` (body bytes of GET responses), ``stalled`` (requests
a stall rule took), ``abandoned``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

#: moto accepts any credentials unless its IAM authentication is switched on.
KEY_ID = "AKIATESTINGKEY000001"
SECRET = "testing-secret-not-a-real-one"
REGION = "us-east-1"

_ERRORS = {500: "InternalError", 503: "SlowDown", 412: "PreconditionFailed", 404: "NoSuchKey"}

Environ = dict[str, Any]
StartResponse = Callable[..., Any]


# --- the server side (runs in the subprocess) ----------------------------------------------------


class _Faults:
    """WSGI middleware in front of moto's application (see the module docstring)."""

    def __init__(self, app: Callable[[Environ, StartResponse], Iterable[bytes]], fast: bool):
        self.app = app
        self.fast = fast
        self.lock = threading.Lock()
        self.latency = 0.0
        self.rules: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter()

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/_faults":
            return self._control(environ, start_response)
        method = environ["REQUEST_METHOD"]
        target = path + ("?" + environ["QUERY_STRING"] if environ.get("QUERY_STRING") else "")
        with self.lock:
            self.counts[method] += 1
            latency = self.latency
            fail = self._take("fail", method, target)
            stall = self._take("stall", method, target)
            if stall is not None:
                self.counts["stalled"] += 1
        if latency:
            time.sleep(latency)
        if stall is not None and not self._stall(environ, float(stall["seconds"])):
            with self.lock:
                self.counts["abandoned"] += 1
            start_response("499 Client Closed Request", [("Content-Length", "0")])
            return [b""]
        if fail is not None:
            return self._error(start_response, int(fail.get("status", 503)))
        if self.fast and method == "GET" and "HTTP_RANGE" in environ:
            served = self._fast_range(environ, start_response)
            if served is not None:
                return served

        def counting(status: str, headers: list[tuple[str, str]], *exc: Any) -> Any:
            if method == "GET":
                for k, v in headers:
                    if k.lower() == "content-length":
                        with self.lock:
                            self.counts["get_bytes"] += int(v)
            return start_response(status, headers, *exc)

        return self.app(environ, counting)

    def _take(self, kind: str, method: str, target: str) -> dict[str, Any] | None:
        for rule in self.rules:
            if rule["kind"] != kind or rule["count"] <= 0:
                continue
            if rule.get("method", method) != method or rule.get("match", "") not in target:
                continue
            rule["count"] -= 1
            return rule
        return None

    @staticmethod
    def _stall(environ: Environ, seconds: float) -> bool:
        """Wait ``seconds``; False as soon as the client hangs up."""
        sock: socket.socket | None = environ.get("werkzeug.socket")
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if sock is None:
                time.sleep(left)
                break
            readable, _, _ = select.select([sock], [], [], min(left, 0.02))
            if readable:
                try:
                    if sock.recv(1, socket.MSG_PEEK) == b"":
                        return False
                except OSError:
                    return False
                time.sleep(min(left, 0.02))  # data from the client (a pipelined request)
        return True

    @staticmethod
    def _error(start_response: StartResponse, status: int) -> Iterable[bytes]:
        code = _ERRORS.get(status, "InternalError")
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>injected by the test server</Message>"
            "<RequestId>0</RequestId></Error>"
        ).encode()
        reason = {500: "Internal Server Error", 503: "Slow Down"}.get(status, "Error")
        start_response(
            f"{status} {reason}",
            [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
        )
        return [body]

    def _fast_range(
        self, environ: Environ, start_response: StartResponse
    ) -> Iterable[bytes] | None:
        """A ranged GET of a stored object, read from moto's store without copying the object
        (None: leave the request to moto, which answers errors and special cases)."""
        from moto.core.models import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        if environ.get("QUERY_STRING"):
            return None
        spec = environ["HTTP_RANGE"]
        if not spec.startswith("bytes=") or "," in spec:
            return None
        first, _, last = spec[len("bytes=") :].partition("-")
        if not first:
            return None
        bucket, _, key_name = environ["PATH_INFO"].lstrip("/").partition("/")
        backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
        try:
            key = backend.get_object(bucket, urllib.parse.unquote(key_name))
        except Exception:
            return None
        if key is None:
            return None
        match = environ.get("HTTP_IF_MATCH")
        if match is not None and match.strip('"') != key.etag.strip('"'):
            return self._error(start_response, 412)
        size = key.size
        start = int(first)
        stop = min(size, int(last) + 1 if last else size)
        if start >= stop:
            return None
        with key.lock:
            key._value_buffer.seek(start)
            data = key._value_buffer.read(stop - start)
        with self.lock:
            self.counts["get_bytes"] += len(data)
        start_response(
            "206 Partial Content",
            [
                ("Content-Type", "binary/octet-stream"),
                ("Content-Length", str(len(data))),
                ("Content-Range", f"bytes {start}-{stop - 1}/{size}"),
                ("ETag", key.etag),
                ("Last-Modified", key.last_modified_RFC1123),
                ("Accept-Ranges", "bytes"),
            ],
        )
        return [data]

    def _control(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        if environ["REQUEST_METHOD"] == "POST":
            n = int(environ.get("CONTENT_LENGTH") or 0)
            config = json.loads(environ["wsgi.input"].read(n) or b"{}")
            with self.lock:
                if "latency" in config:
                    self.latency = float(config["latency"])
                for kind in ("fail", "stall"):
                    if kind in config:
                        self.rules.append({"count": 1, **config[kind], "kind": kind})
                if config.get("clear"):
                    self.rules.clear()
                    self.latency = 0.0
                if config.get("reset_counts"):
                    self.counts.clear()
        with self.lock:
            body = json.dumps(dict(self.counts)).encode()
        start_response(
            "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        )
        return [body]


def serve(port: int, fast: bool, faults: dict[str, Any]) -> None:
    """Run moto's S3 server with the fault middleware on ``port`` (0: a free one), ``faults``
    already in place; print the port on the first line of stdout."""
    import logging

    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = _Faults(DomainDispatcherApplication(create_backend_app), fast)
    for kind in ("fail", "stall"):
        if kind in faults:
            app.rules.append({"count": 1, **faults[kind], "kind": kind})
    server = make_server("127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler)
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


# --- the test side ------------------------------------------------------------------------------


@contextlib.contextmanager
def _open(req: urllib.request.Request) -> Iterator[Any]:
    """``urlopen``, whose error response is closed too (its socket would outlive the test)."""
    try:
        resp = urllib.request.urlopen(req, timeout=10)
    except urllib.error.HTTPError as exc:
        exc.close()
        raise
    with resp:
        yield resp


class S3Server:
    """A moto S3 server in a subprocess (see the module docstring), started by :meth:`start`."""

    def __init__(self, *, fast_ranges: bool = False, log: Path | None = None) -> None:
        self.fast_ranges = fast_ranges
        self.log = log
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server process's id, while it runs."""
        return self._proc.pid if self._proc is not None else None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int | None = None, faults: Mapping[str, Any] | None = None) -> S3Server:
        """Start the server (on ``port``, by default the one it had, else a free one), with
        ``faults`` (as for :meth:`faults`) in place from its first request."""
        port = self.port if port is None else port
        args = [
            sys.executable,
            "-m",
            "support.s3_server",
            str(port),
            json.dumps(dict(faults or {})),
        ]
        if self.fast_ranges:
            args.append("--fast-ranges")
        root = Path(__file__).resolve().parent.parent
        env = {**os.environ, "PYTHONPATH": str(root), "MOTO_ALLOW_NONEXISTENT_REGION": "1"}
        for attempt in range(20):  # a port just let go of may take a moment to be free again
            with contextlib.ExitStack() as stack:
                err = stack.enter_context(open(self.log, "ab")) if self.log else None
                proc = subprocess.Popen(
                    args,
                    stdout=subprocess.PIPE,
                    stderr=err if err is not None else subprocess.DEVNULL,
                    cwd=root,
                    env=env,
                )
            assert proc.stdout is not None
            with proc.stdout:
                line = proc.stdout.readline().decode()
            if line.startswith("PORT "):
                self.port = int(line.split()[1])
                self._proc = proc
                return self
            proc.wait()
            if attempt == 19 or port == 0:
                raise RuntimeError(f"the S3 server did not start (exit code {proc.returncode})")
            time.sleep(0.25)
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Kill the server (its objects are lost)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    def __enter__(self) -> S3Server:
        return self if self._proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """What a layer needs to reach this server."""
        return {"key": KEY_ID, "secret": SECRET, "endpoint_url": self.endpoint, **extra}

    # --- faults and counters ----------------------------------------------------------------

    def _post(self, config: Mapping[str, Any]) -> dict[str, int]:
        req = urllib.request.Request(
            self.endpoint + "/_faults", data=json.dumps(config).encode(), method="POST"
        )
        with _open(req) as resp:
            counts: dict[str, int] = json.loads(resp.read())
        return counts

    def faults(self, **config: Any) -> None:
        """Change the faults: ``latency=``, ``fail={...}``, ``stall={...}``, ``clear=True``."""
        self._post(config)

    def counts(self, *, reset: bool = False) -> dict[str, int]:
        """The counters since the last reset (GET, HEAD, ..., get_bytes, stalled, abandoned)."""
        return self._post({"reset_counts": True} if reset else {})

    def reset_auth(self, count: float) -> None:
        """moto's IAM authentication: on after ``count`` more requests (``inf``: off)."""
        req = urllib.request.Request(
            self.endpoint + "/moto-api/reset-auth",
            data=str(count).encode(),
            headers={"Content-Type": "text/plain"},  # else Flask takes the body for a form
            method="POST",
        )
        with _open(req) as resp:
            resp.read()

    # --- the S3 API, through boto3 ----------------------------------------------------------

    @contextlib.contextmanager
    def client(self, service: str = "s3", **kw: Any) -> Iterator[Any]:
        """A boto3 client of this server, closed afterwards (its sockets with it)."""
        import boto3  # type: ignore[import-untyped]

        kw.setdefault("aws_access_key_id", KEY_ID)
        kw.setdefault("aws_secret_access_key", SECRET)
        client = boto3.client(service, endpoint_url=self.endpoint, region_name=REGION, **kw)
        try:
            yield client
        finally:
            client.close()

    def upload(self, bucket: str, objects: Mapping[str, Path | bytes]) -> None:
        """Create ``bucket`` if needed, and put each object (a file's bytes, or bytes)."""
        with self.client() as s3:
            with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
                s3.create_bucket(Bucket=bucket)
            for key, value in objects.items():
                body = value.read_bytes() if isinstance(value, Path) else value
                s3.put_object(Bucket=bucket, Key=key, Body=body)

    def delete(self, bucket: str, key: str) -> None:
        with self.client() as s3:
            s3.delete_object(Bucket=bucket, Key=key)


if __name__ == "__main__":
    serve(int(sys.argv[1]), "--fast-ranges" in sys.argv[3:], json.loads(sys.argv[2]))
