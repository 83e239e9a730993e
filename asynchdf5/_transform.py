"""The transformer chain: each batch's arrays pass through the ``(top, transformer)`` pairs.

Runs where the delivery runs it: on the host after gathering, or on the device after the upload.
A transformer that raises, or returns something other than an array with the batch's rows, is a
:class:`~asynchdf5.TransformError` naming the top, the transformer, the epoch and the rows.

A chain that starts a ragged top with :class:`~asynchdf5.transforms.Pad` of a given length tells
the host delivery to gather that top padded (:func:`fused_pads`): the batch is the one the Pad
would make, made in one pass instead of gathered and then copied again.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

from ._errors import TransformError
from ._ragged import Ragged
from .transforms import Pad, Transformer

__all__ = ["apply_transformers", "describe_transformer", "fused_pads"]


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


def fused_pads(
    transformers: Sequence[tuple[str, Transformer]], ragged: Mapping[str, np.dtype[Any]] | None
) -> tuple[dict[str, Pad], list[tuple[str, Transformer]]]:
    """The tops to gather padded, and the chain left to run on the batches.

    ``ragged``: the (not sparse) ragged tops and their values' dtypes; None: any top, as if
    every top were one and took every pad value (what may fuse, before the tops are known). A
    top whose first transformer is a :class:`~asynchdf5.transforms.Pad` (that class itself: a
    subclass may pad differently) with a ``length`` is gathered straight into that Pad's output
    (:func:`~._gather.gather_padded`) and the Pad leaves the chain; the chain's other pairs
    stay, in order. A Pad whose value does not convert to the top's dtype stays in the chain,
    which then fails on it as it would have."""
    pads: dict[str, Pad] = {}
    chain: list[tuple[str, Transformer]] = []
    seen: set[str] = set()
    for top, fn in transformers:
        first = top not in seen
        seen.add(top)
        pad = fn if first and type(fn) is Pad and fn.length is not None else None
        known = ragged is None or (top in ragged and _holds(ragged[top], pad))
        if pad is not None and known:
            pads[top] = pad
            continue
        chain.append((top, fn))
    return pads, chain


def _holds(dtype: np.dtype[Any], pad: Pad | None) -> bool:
    """Whether ``pad``'s value converts to ``dtype`` (as a padded array is filled with it)."""
    if pad is None:
        return False
    try:
        np.full(1, pad.pad, dtype)
    except (TypeError, ValueError, OverflowError):
        return False
    return True
