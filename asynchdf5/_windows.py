"""``Windows``: fixed-length samples cut from one 1-D dataset (a language model's token stream).

Sample ``i`` of a file is ``tokens[i * stride : i * stride + length]``; a file whose stream has
``n_tokens`` tokens holds ``(n_tokens - length) // stride + 1`` samples (none when it is shorter
than one window). Windows never cross a file boundary: each file's stream is cut on its own, and
a file's last tokens that do not fill a window are not served.

The top is named like any other (``Windows`` *is* the dataset's name, a ``str``, carrying
``length`` and ``stride``), so it passes through the configuration, the state and the helper
process as a name. The catalog gives it ``n`` rows of shape ``(length,)``; the reader reads the
tokens of a run of windows as one contiguous range of the stream (:func:`token_range`) and cuts
the windows out of it in the slot (:func:`expand_in_place`, :func:`cut_windows`), so that
everything above the reader sees fixed rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ._errors import ConfigurationError

__all__ = [
    "Windows",
    "count_windows",
    "cut_windows",
    "expand_in_place",
    "token_range",
    "window_view",
]

#: Bytes of windows moved per copy in :func:`expand_in_place` (numpy copies an overlapping
#: source through a temporary of that size).
_BLOCK_BYTES = 1 << 20


class Windows(str):
    """Fixed-length windows over a 1-D dataset, as a top.

    Parameters
    ----------
    top : str
        The 1-D dataset (a flat token stream, any integer or float dtype), present in every file.
    length : int
        Elements per sample: ``batch[top]`` has shape ``(batch_size, length)``.
    stride : int, optional
        Elements between the starts of consecutive samples (default ``length``: windows side by
        side). ``stride < length`` overlaps them (nanoGPT's ``length = block_size + 1``,
        ``stride = block_size`` gives inputs and shifted targets from one window);
        ``stride > length`` leaves the tokens between windows out.

    Notes
    -----
    Sample ``i`` of a file is ``tokens[i * stride : i * stride + length]``; a file holds
    ``(len(tokens) - length) // stride + 1`` samples, none when its stream is shorter than one
    window. Windows never cross file boundaries. Other tops of the layer need one row per window
    (a :class:`~asynchdf5.SchemaError` says so at open otherwise). The batch's key is ``top``.

    Examples
    --------
    >>> from asynchdf5 import Windows
    >>> w = Windows("tokens", length=1025, stride=1024)
    >>> w, w.length, w.stride
    (Windows('tokens', length=1025, stride=1024), 1025, 1024)
    >>> w == "tokens"
    True
    """

    length: int
    stride: int

    def __new__(cls, top: str, length: int, stride: int | None = None) -> Windows:
        if not isinstance(top, str) or not top:
            raise ConfigurationError(f"Windows needs a dataset name, not {top!r}")
        stride = length if stride is None else stride
        for what, v in (("length", length), ("stride", stride)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ConfigurationError(
                    f"Windows({top!r}): {what} must be a positive integer, not {v!r}"
                )
        self = super().__new__(cls, str(top))
        self.length = int(length)
        self.stride = int(stride)
        return self

    def __repr__(self) -> str:
        return f"Windows({str(self)!r}, length={self.length}, stride={self.stride})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Windows, (str(self), self.length, self.stride))


def count_windows(n_tokens: int, length: int, stride: int) -> int:
    """How many windows of ``length`` every ``stride`` fit in ``n_tokens`` elements."""
    return 0 if n_tokens < length else (n_tokens - length) // stride + 1


def token_range(r0: int, r1: int, length: int, stride: int) -> tuple[int, int]:
    """The stream's elements ``t0:t1`` that windows ``r0:r1`` (``r1 > r0``) are cut from."""
    return r0 * stride, (r1 - 1) * stride + length


def expand_in_place(dest: np.ndarray, stride: int) -> None:
    """Cut windows in place: ``dest`` (``(n, length)``, C-contiguous) holds the stream's
    ``(n - 1) * stride + length`` elements of its windows at the *end* of its buffer (``stride
    <= length``, so they fit); afterwards row ``k`` is the window starting at element
    ``k * stride`` of them.

    Windows are moved forwards, a block at a time: block ``[k0, k1)`` ends at element
    ``k1 * length`` of the buffer, at or before where window ``k1``'s elements start
    (``(n - 1) * (length - stride) + k1 * stride``), so no window is overwritten before it is
    moved; numpy copies a block whose source overlaps its destination through a temporary.
    """
    n, length = dest.shape
    if n == 0 or stride == length:
        return  # the stream's elements are the windows already
    flat = dest.reshape(-1)
    base = (n - 1) * (length - stride)
    item = flat.itemsize
    src = as_strided(flat[base:], shape=(n, length), strides=(stride * item, item))
    block = max(1, _BLOCK_BYTES // max(1, length * item))
    for k0 in range(0, n, block):
        k1 = min(n, k0 + block)
        dest[k0:k1] = src[k0:k1]


def cut_windows(dest: np.ndarray, tokens: np.ndarray, stride: int) -> None:
    """Windows of ``tokens`` (1-D, the elements of ``dest``'s ``n`` windows) into ``dest``
    (``(n, length)``): row ``k`` gets ``tokens[k * stride : k * stride + length]``."""
    n, length = dest.shape
    if n == 0:
        return
    item = tokens.itemsize
    dest[...] = as_strided(tokens, shape=(n, length), strides=(stride * item, item))


def window_view(tokens: np.ndarray, length: int, stride: int) -> np.ndarray:
    """The windows of a 1-D array as a read-only ``(n, length)`` view (no copy)."""
    n = count_windows(len(tokens), length, stride)
    item = tokens.strides[0]
    return as_strided(tokens, shape=(n, length), strides=(stride * item, item), writeable=False)
