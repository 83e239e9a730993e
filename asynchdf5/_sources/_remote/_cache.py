"""``remote_cache``: blocks of remote objects kept on local disk."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
import uuid
from typing import TYPE_CHECKING

from ..._errors import SourceError
from ..._fileio import pread_into

if TYPE_CHECKING:
    from ._files import RemoteFile


class DiskCache:
    """``remote_cache``: blocks of remote objects kept in a local folder, so that later epochs
    read them from local disk.

    A block is ``block`` bytes of one object at a multiple of ``block``, in a file named after
    the object's URL, version and size (an object changed since is never served from a stale
    copy) and the block's index. Files are written under a temporary name and renamed into
    place, so that processes (ranks) sharing the folder never see a partial block; one that
    vanishes while read (evicted by another process) is fetched again. The folder is kept under
    ``max_bytes``: when over, the least recently used blocks (by modification time, touched on
    every hit) are deleted down to 90 %. Each process rescans the folder after writing a tenth
    of the budget, so processes sharing it overshoot by that much each at most.
    """

    SUFFIX = ".blk"

    def __init__(self, folder: str, max_bytes: int | None, block: int) -> None:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise SourceError(f"remote_cache {folder!r} cannot be created: {exc}") from exc
        self.folder = folder
        self.block = block
        self._lock = threading.Lock()
        self._used = self._scan()[0]
        if max_bytes is None:  # the property's default: 90 % of the free space, at open
            max_bytes = self._used + int(0.9 * shutil.disk_usage(folder).free)
        self.max_bytes = max_bytes
        self._written = 0  # since the last scan

    def key(self, file: RemoteFile) -> str | None:
        """The cache key of ``file``'s content (None: it has no version to key on)."""
        if not file.version:
            return None
        ident = json.dumps([file.url, sorted(file.version.items()), file.size, self.block])
        return hashlib.sha256(ident.encode()).hexdigest()[:40]

    def _path(self, key: str, index: int) -> str:
        return os.path.join(self.folder, f"{key}-{index}{self.SUFFIX}")

    def read_into(self, key: str, index: int, view: memoryview) -> bool:
        """Block ``index`` (``len(view)`` bytes) into ``view``; False if it is not cached
        (blocking)."""
        path = self._path(key, index)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False
        try:
            if os.fstat(fd).st_size != len(view):
                return False  # not what this block should be: fetched again, rewritten
            if pread_into(fd, view, 0) < len(view):
                return False
            os.utime(fd)  # recently used
        except OSError:
            return False
        finally:
            os.close(fd)
        return True

    def write(self, key: str, index: int, data: memoryview) -> None:
        """Keep block ``index`` (blocking): written aside, renamed into place, then the folder
        is trimmed if over its budget."""
        if len(data) > self.max_bytes // 2:
            return
        tmp = os.path.join(self.folder, f".tmp-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key, index))
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            return  # a full disk: the block is simply not cached
        with self._lock:
            self._used += len(data)
            self._written += len(data)
            rescan = self._written > self.max_bytes // 10
            over = self._used > self.max_bytes
        if over or rescan:
            self.trim()

    def _scan(self) -> tuple[int, list[tuple[float, int, str]]]:
        entries = []
        total = 0
        with os.scandir(self.folder) as it:
            for e in it:
                if not e.name.endswith(self.SUFFIX):
                    continue
                try:
                    st = e.stat()
                except OSError:
                    continue
                entries.append((st.st_mtime, st.st_size, e.path))
                total += st.st_size
        return total, entries

    def trim(self) -> None:
        """Delete the least recently used blocks until the folder is under 90 % of its budget,
        if it is over (blocking)."""
        total, entries = self._scan()
        if total > self.max_bytes:
            target = self.max_bytes * 9 // 10
            for _, size, path in sorted(entries):
                if total <= target:
                    break
                with contextlib.suppress(OSError):
                    os.remove(path)
                    total -= size
        with self._lock:
            self._used = total
            self._written = 0

    def used(self) -> int:
        """Bytes of blocks in the folder now (blocking)."""
        return self._scan()[0]
