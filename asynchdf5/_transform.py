"""The transformer chain: each batch's arrays pass through the ``(top, transformer)`` pairs.

Runs where the delivery runs it: on the host after gathering, or on the device after the upload.
A transformer that raises, or returns something other than an array with the batch's rows, is a
:class:`~asynchdf5.TransformError` naming the top, the transformer, the epoch and the rows.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import numpy as np

from ._errors import TransformError
from ._ragged import Ragged
from .transforms import Transformer

__all__ = ["apply_transformers", "describe_transformer"]


def describe_transformer(fn: object) -> str:
    """A short name for ``fn`` in error messages."""
    name = getattr(fn, "__qualname__", None)
    if name is not None and not isinstance(fn, type):
        mod = getattr(fn, "__module__", None)
        return f"{mod}.{name}" if mod and mod != "builtins" else str(name)
    return repr(fn)


def apply_transformers(
    data: MutableMapping[str, Any],
    transformers: Sequence[tuple[str, Transformer]],
    epoch: int,
    indices: np.ndarray,
) -> None:
    """Run the transformer chain in place on ``data``; wrap any failure in TransformError.
    A transformer of a top the batch does not have (a stream's own tops, under
    ``batch_mode="per_stream"``) is not run on it."""
    for top, fn in transformers:
        x = data.get(top)
        if x is None:
            continue
        rows = len(indices)
        where = f"top {top!r}, transformer {describe_transformer(fn)}, epoch {epoch}"
        try:
            y = fn(x)
        except Exception as exc:
            raise TransformError(
                f"{where}: raised {type(exc).__name__}: {exc} (batch of {rows} rows, first "
                f"global index {int(indices[0]) if rows else None})"
            ) from exc
        shape = (len(y),) if isinstance(y, Ragged) else getattr(y, "shape", None)
        if shape is None or len(shape) == 0:
            raise TransformError(f"{where}: returned {type(y).__name__}, not an array of rows")
        if shape[0] != rows:
            raise TransformError(
                f"{where}: returned {shape[0]} rows for a batch of {rows}; a transformer must "
                "keep the number of rows"
            )
        data[top] = y
