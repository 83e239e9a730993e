"""Source: a source list file, or a sequence of paths, resolved to a list of HDF5 file paths."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Union

from ._errors import ConfigurationError, SourceError

__all__ = ["HDF5_SIGNATURE", "SourceLike", "is_hdf5_file", "resolve_source"]

SourceLike = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]

#: The 8-byte signature an HDF5 file starts with (at offset 0, 512, 1024, 2048, ... when a user
#: block precedes it).
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def is_hdf5_file(path: Path) -> bool:
    """Whether ``path`` starts with the HDF5 signature (at offset 0 or a user-block offset)."""
    with open(path, "rb") as f:
        offset = 0
        size = os.fstat(f.fileno()).st_size
        while offset + 8 <= size:
            f.seek(offset)
            if f.read(8) == HDF5_SIGNATURE:
                return True
            offset = 512 if offset == 0 else offset * 2
    return False


def _read_list_file(path: Path) -> list[Path]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise SourceError(f"source list file {str(path)!r} does not exist") from exc
    except IsADirectoryError as exc:
        raise SourceError(f"source list file {str(path)!r} is a directory") from exc
    except UnicodeDecodeError as exc:
        raise SourceError(
            f"source list file {str(path)!r} is not UTF-8 text (pass a list file naming HDF5 "
            "files, or a sequence of paths)"
        ) from exc
    except OSError as exc:
        raise SourceError(f"cannot read source list file {str(path)!r}: {exc}") from exc
    base = path.parent
    paths = []
    for line in text.splitlines():
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        p = Path(entry).expanduser()
        paths.append(p if p.is_absolute() else base / p)
    if not paths:
        raise SourceError(f"source list file {str(path)!r} names no HDF5 file")
    return paths


def resolve_source(source: SourceLike) -> list[Path]:
    """Resolve ``source`` to the list of HDF5 files it names, in order.

    A ``str`` or path names a source list file (one path per line; blank lines and lines starting
    with ``#`` are ignored; surrounding whitespace is stripped; relative paths are relative to the
    list file's folder). For convenience, a path that is itself an HDF5 file is taken as a
    one-file source. A sequence names the HDF5 files directly.
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(os.fspath(source)).expanduser()
        if path.is_file() and os.access(path, os.R_OK) and is_hdf5_file(path):
            return [path]
        return _read_list_file(path)
    if isinstance(source, (bytes, bytearray)) or not isinstance(source, Sequence):
        raise ConfigurationError(
            f"source must be a path to a source list file or a sequence of HDF5 paths, "
            f"not {type(source).__name__}"
        )
    paths = []
    for item in source:
        if not isinstance(item, (str, os.PathLike)):
            raise ConfigurationError(
                f"source entries must be paths, not {type(item).__name__}: {item!r}"
            )
        paths.append(Path(os.fspath(item)).expanduser())
    if not paths:
        raise SourceError("source is an empty sequence: name at least one HDF5 file")
    return paths
