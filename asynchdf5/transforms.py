"""Built-in transformers for the ``transformers=`` property of the data layers.

A transformer is any callable that takes one batch of a top, an array of shape
``(rows, *sample_shape)``, and returns an array with the same number of rows. The layer applies
the ``(top, transformer)`` pairs in order, in a worker thread, after gathering each batch.

The built-ins work on NumPy and CuPy arrays alike: the array module is taken from the input, and
CuPy is imported only when a CuPy array arrives, so importing asynchdf5 never imports CuPy.

Scale, SubMean and Normalize return floating point: a floating input keeps its dtype, an integer
or bool input gives ``float32`` (so ``uint8`` images scaled by ``1/255`` are ``float32``, not
``float64``).

Examples
--------
>>> import numpy as np
>>> from asynchdf5 import transforms as T
>>> batch = np.full((2, 2, 2, 3), 255, dtype=np.uint8)   # two 2x2 RGB images, HWC
>>> out = T.Transpose((2, 0, 1))(T.Scale(1 / 255)(batch))
>>> out.shape, out.dtype, float(out.max())
((2, 3, 2, 2), dtype('float32'), 1.0)
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from asynchdf5._errors import ConfigurationError, SchemaError, SourceError
from asynchdf5._ragged import Ragged

__all__ = [
    "Cast",
    "Densify",
    "Normalize",
    "Pad",
    "Scale",
    "SubMean",
    "Transformer",
    "Transpose",
]

Transformer: TypeAlias = Callable[[Any], Any]
"""Any callable from a batch array to an array with the same number of rows."""

_FloatArray: TypeAlias = npt.NDArray[np.float64]


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.startswith("cupy")


def _array_module(x: Any) -> tuple[ModuleType, contextlib.AbstractContextManager[Any]]:
    """The array module of ``x`` and a context that makes ``x``'s device current."""
    if _is_cupy(x):
        import cupy  # optional: imported only when a CuPy array arrives

        # The current CUDA device is per thread: a worker thread defaults to device 0.
        return cupy, x.device
    return np, contextlib.nullcontext()


def _result_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """Floating (and complex) inputs keep their dtype; anything else computes in float32."""
    return dtype if dtype.kind in "fc" else np.dtype(np.float32)


def _describe(value: npt.NDArray[Any]) -> str:
    """Short text for a constant in a repr: the values when tiny, else the shape."""
    if value.size <= 4:
        return repr(value.tolist())
    return f"<array of shape {value.shape}>"


class _Constant:
    """A float constant (a mean, a std) and its copies per array module, device and dtype."""

    def __init__(self, name: str, value: Any) -> None:
        if _is_cupy(value):
            value = value.get()
        try:
            self.host: _FloatArray = np.array(value, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"{name} must be a real array, got {value!r}") from exc
        self.name = name
        # A race between two threads only builds the same copy twice; dict updates are atomic.
        self._copies: dict[tuple[int | None, np.dtype[Any]], Any] = {}

    def like(self, x: Any, dtype: np.dtype[Any], xp: ModuleType) -> Any:
        """The constant in ``x``'s array module and device, as ``dtype``, checked against ``x``."""
        sample_shape = x.shape[1:]
        try:
            fits = (
                self.host.ndim <= len(sample_shape)
                and np.broadcast_shapes(self.host.shape, sample_shape) == sample_shape
            )
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(
                f"{self.name} of shape {self.host.shape} does not broadcast to the sample shape "
                f"{sample_shape} of a batch of shape {x.shape}"
            )
        key = (x.device.id if xp is not np else None, dtype)
        copy = self._copies.get(key)
        if copy is None:
            if xp is np:
                copy = self.host.astype(dtype)
            else:
                copy = xp.asarray(self.host, dtype=dtype)
                # Written on this thread's current stream (a layer's upload stream), but kept
                # for later batches, maybe another layer's on another stream: wait once for it.
                xp.cuda.get_current_stream().synchronize()
            self._copies[key] = copy
        return copy


class Scale:
    """Multiply a batch by a constant factor.

    Parameters
    ----------
    factor : float
        The factor, a finite real number.

    Examples
    --------
    >>> import numpy as np
    >>> Scale(0.5)(np.array([[2, 4]], dtype=np.uint8))
    array([[1., 2.]], dtype=float32)
    """

    def __init__(self, factor: float) -> None:
        try:
            self.factor = float(factor)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"Scale factor must be a real number, got {factor!r}") from exc
        if not math.isfinite(self.factor):
            raise ConfigurationError(f"Scale factor must be finite, got {factor!r}")

    def __call__(self, x: Any) -> Any:
        xp, device = _array_module(x)
        with device:
            # One pass: the ufunc casts on the fly into a fresh array of the result dtype.
            return xp.multiply(x, self.factor, dtype=_result_dtype(x.dtype))

    def __repr__(self) -> str:
        return f"Scale({self.factor:.6g})"


class SubMean:
    """Subtract a mean array from every sample, like Mocha's ``SubMean``.

    Parameters
    ----------
    mean : array_like, optional
        The mean, of the sample shape or broadcastable to it (e.g. one value per channel).
    mean_file : str or os.PathLike, optional
        An HDF5 file holding the mean as a dataset named ``mean``. It is read on the first call,
        not at construction; a missing file raises :class:`~asynchdf5.SourceError` at once.

    Exactly one of ``mean`` and ``mean_file`` must be given.

    Examples
    --------
    >>> import numpy as np
    >>> SubMean(mean=[1.0, 2.0])(np.array([[1, 2], [3, 4]], dtype=np.uint8))
    array([[0., 0.],
           [2., 2.]], dtype=float32)
    """

    def __init__(
        self, mean: npt.ArrayLike | None = None, mean_file: str | os.PathLike[str] | None = None
    ) -> None:
        if (mean is None) == (mean_file is None):
            raise ConfigurationError("SubMean takes exactly one of mean= and mean_file=")
        self._lock = threading.Lock()
        self._mean: _Constant | None = None
        self.mean_file: str | None = None
        if mean_file is not None:
            self.mean_file = os.fspath(mean_file)
            # Only a stat here: construction may run on the event loop thread, and h5py holds a
            # process-wide lock, so the file is read lazily in a worker thread.
            if not os.path.isfile(self.mean_file):
                raise SourceError(f"SubMean mean_file {self.mean_file!r} does not exist")
        else:
            self._mean = _Constant("SubMean mean", mean)

    def _load(self) -> _Constant:
        mean = self._mean
        if mean is not None:
            return mean
        with self._lock:
            if self._mean is None:
                import h5py

                try:
                    with h5py.File(self.mean_file, "r") as f:
                        dataset = f.get("mean")
                        if not isinstance(dataset, h5py.Dataset):
                            raise SchemaError(
                                f"SubMean mean_file {self.mean_file!r} has no dataset 'mean'"
                            )
                        value = dataset[()]
                except OSError as exc:
                    raise SourceError(
                        f"SubMean cannot read mean_file {self.mean_file!r}: {exc}"
                    ) from exc
                try:
                    self._mean = _Constant("SubMean mean", value)
                except ConfigurationError as exc:
                    raise SchemaError(
                        f"dataset 'mean' of SubMean mean_file {self.mean_file!r} is not numeric"
                    ) from exc
            return self._mean

    def __call__(self, x: Any) -> Any:
        mean = self._load()
        xp, device = _array_module(x)
        dtype = _result_dtype(x.dtype)
        with device:
            return xp.subtract(x, mean.like(x, dtype, xp), dtype=dtype)

    def __repr__(self) -> str:
        if self.mean_file is not None:
            return f"SubMean(mean_file={self.mean_file!r})"
        assert self._mean is not None
        return f"SubMean(mean={_describe(self._mean.host)})"


class Normalize:
    """Standardise a batch: ``(x - mean) / std``.

    Parameters
    ----------
    mean, std : array_like
        Of the sample shape or broadcastable to it; ``std`` must be positive everywhere.

    Examples
    --------
    >>> import numpy as np
    >>> Normalize(mean=[1.0, 2.0], std=[2.0, 4.0])(np.array([[3.0, 10.0]]))
    array([[1., 2.]])
    """

    def __init__(self, mean: npt.ArrayLike, std: npt.ArrayLike) -> None:
        self._mean = _Constant("Normalize mean", mean)
        self._std = _Constant("Normalize std", std)
        if not np.all(self._std.host > 0):
            raise ConfigurationError(f"Normalize std must be > 0 everywhere, got {std!r}")
        try:
            np.broadcast_shapes(self._mean.host.shape, self._std.host.shape)
        except ValueError as exc:
            raise ConfigurationError(
                f"Normalize mean of shape {self._mean.host.shape} and std of shape "
                f"{self._std.host.shape} do not broadcast together"
            ) from exc

    def __call__(self, x: Any) -> Any:
        xp, device = _array_module(x)
        dtype = _result_dtype(x.dtype)
        with device:
            out = xp.subtract(x, self._mean.like(x, dtype, xp), dtype=dtype)
            out /= self._std.like(x, dtype, xp)  # in place on the fresh result
            return out

    def __repr__(self) -> str:
        return f"Normalize(mean={_describe(self._mean.host)}, std={_describe(self._std.host)})"


class Cast:
    """Convert a batch to another dtype (no copy when it already has it).

    Parameters
    ----------
    dtype : numpy dtype-like
        The target dtype, anything :class:`numpy.dtype` accepts.

    Examples
    --------
    >>> import numpy as np
    >>> Cast("float16")(np.arange(3)).dtype
    dtype('float16')
    """

    def __init__(self, dtype: npt.DTypeLike) -> None:
        try:
            if dtype is None:  # np.dtype(None) is float64: surely not what was meant
                raise TypeError("None")
            self.dtype = np.dtype(dtype)
        except TypeError as exc:
            raise ConfigurationError(f"Cast dtype {dtype!r} is not a dtype") from exc

    def __call__(self, x: Any) -> Any:
        return x.astype(self.dtype, copy=False)

    def __repr__(self) -> str:
        return f"Cast({str(self.dtype)!r})"


class Transpose:
    """Reorder the sample axes of a batch; the batch axis stays first.

    Parameters
    ----------
    axes : sequence of int
        A permutation of ``range(k)`` for samples with ``k`` axes, as for
        :func:`numpy.transpose` on one sample: HWC to CHW is ``Transpose((2, 0, 1))``.

    The result is C-contiguous.

    Examples
    --------
    >>> import numpy as np
    >>> Transpose((2, 0, 1))(np.zeros((8, 32, 32, 3))).shape
    (8, 3, 32, 32)
    """

    def __init__(self, axes: Sequence[int]) -> None:
        try:
            self.axes = tuple(operator.index(a) for a in axes)
        except TypeError as exc:
            raise ConfigurationError(f"Transpose axes must be integers, got {axes!r}") from exc
        if sorted(self.axes) != list(range(len(self.axes))):
            raise ConfigurationError(
                f"Transpose axes must be a permutation of range({len(self.axes)}), got {axes!r}"
            )

    def __call__(self, x: Any) -> Any:
        if x.ndim - 1 != len(self.axes):
            raise ValueError(
                f"{self!r} needs samples with {len(self.axes)} axes, got a batch of shape "
                f"{x.shape} (sample shape {x.shape[1:]})"
            )
        xp, device = _array_module(x)
        with device:
            return xp.ascontiguousarray(x.transpose(0, *(a + 1 for a in self.axes)))

    def __repr__(self) -> str:
        return f"Transpose({self.axes!r})"


class Pad:
    """A ragged top's batch (:class:`~asynchdf5.Ragged`) as one dense padded array.

    The batch's value becomes the dense array ``(rows, length, *trailing)`` only: a
    transformer gives one value per top, so the lengths do not come with it (no extra key is
    added to the batch). Where the lengths matter, leave the top ragged and call
    :meth:`Ragged.to_padded <asynchdf5.Ragged.to_padded>`, which returns both, or take the
    torch adapter's ``ragged="padded"`` (a padded tensor and its lengths).

    With a ``length``, first in its top's chain and on the host, the layer pads as it gathers:
    each row goes from the cache straight to its place, and the batch is the one this
    transformer would have made (the transformers after it run on it).

    Parameters
    ----------
    pad
        The value past each row's end.
    length : int or None
        The padded length: None pads to the batch's longest row (the shape then varies from
        batch to batch), a number gives every batch that length (longer rows are cut).

    Examples
    --------
    >>> import numpy as np
    >>> from asynchdf5 import Ragged
    >>> Pad(0, length=4)(Ragged(np.arange(5), np.array([0, 2, 5]))).tolist()
    [[0, 1, 0, 0], [2, 3, 4, 0]]
    """

    def __init__(self, pad: Any = 0, length: int | None = None) -> None:
        if length is not None:
            try:
                length = operator.index(length)
            except TypeError as exc:
                raise ConfigurationError(f"Pad length must be an integer, got {length!r}") from exc
            if length < 0:
                raise ConfigurationError(f"Pad length must be >= 0, got {length}")
        self.pad = pad
        self.length = length

    def __call__(self, x: Any) -> Any:
        if not isinstance(x, Ragged):
            raise TypeError(
                f"{self!r} pads a ragged top's batch (an asynchdf5.Ragged), got {type(x).__name__}"
            )
        return x.to_padded(self.pad, self.length)[0]

    def __repr__(self) -> str:
        return f"Pad({self.pad!r}, length={self.length!r})"


class Densify:
    """A sparse-matrix top's batch (a :class:`scipy.sparse.csr_array`) as a dense array of
    shape ``(rows, n_cols)``.

    Examples
    --------
    >>> import numpy as np, scipy.sparse
    >>> Densify()(scipy.sparse.csr_array(np.eye(2, dtype=np.float32))).tolist()
    [[1.0, 0.0], [0.0, 1.0]]
    """

    def __call__(self, x: Any) -> Any:
        to_dense = getattr(x, "toarray", None)
        if to_dense is None:
            raise TypeError(
                f"{self!r} densifies a sparse-matrix top's batch (a scipy.sparse CSR array), "
                f"got {type(x).__name__}"
            )
        return to_dense()

    def __repr__(self) -> str:
        return "Densify()"
