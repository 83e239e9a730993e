"""The check of rows taken in place from a mapped file: after every gather from one, before the
rows go anywhere, the file must be unchanged (:func:`verify`), and a failed check names the
rows as the copying reader names a read's (:func:`rows_words`).

Mapped, rows are read during the gather, straight from the page cache, so a file changed
meanwhile would be read as changed: the check turns that into a :class:`~asynchdf5.ReadError`
instead of a batch (see :mod:`._read._mapped`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._errors import ReadError
from ._specs import LoadedChunk, Piece

__all__ = ["rows_words", "verify"]


def verify(pieces: Sequence[Piece]) -> None:
    """Run the ``verify`` of every chunk the pieces were gathered from (see
    :attr:`LoadedChunk.verify`): after the gather, before the rows go anywhere."""
    checks = {c.verify: c for c, _, _ in pieces if isinstance(c, LoadedChunk) and c.verify}
    for check, chunk in checks.items():
        try:
            check()
        except ReadError as exc:  # named as the copying reader names a read's rows
            idx = [c.indices[a:b] for c, a, b in pieces if isinstance(c, LoadedChunk)]
            tops = ", ".join(map(repr, chunk.arrays))
            # The check covers every mapped file: the one it names may hold none of the rows.
            raise ReadError(
                f"top {tops}, {rows_words(np.concatenate(idx))}: a mapped file changed while "
                f"they were gathered: {exc}"
            ) from exc


def rows_words(indices: np.ndarray) -> str:
    """Global rows in an error message: ``rows a:b`` when they are that run, else how many and
    the range they lie in."""
    n = len(indices)
    if n == 0:
        return "no rows"
    lo, hi = int(indices.min()), int(indices.max())
    if hi - lo == n - 1 and (n == 1 or bool(np.all(np.diff(indices) == 1))):
        return f"rows {lo}:{hi + 1}"
    return f"{n} rows in {lo}:{hi + 1}"
