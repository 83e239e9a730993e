"""Which CUDA device ``device=`` names: checked at construction without importing CuPy
(:func:`parse_device`), and found when the CUDA delivery is made (:func:`resolve_device`), each
refusal a :class:`~asynchdf5.ConfigurationError` that says what is accepted or missing.
"""

from __future__ import annotations

import re
from types import ModuleType

import numpy as np

from .._errors import ConfigurationError

__all__ = ["INSTALL_HINT", "parse_device", "resolve_device"]

INSTALL_HINT = (
    'install CuPy with pip install ".[cuda12]" (CUDA 12) or '
    'pip install ".[cuda13]" (CUDA 13), in the asynchdf5 checkout'
)
_ACCEPTED = "None (NumPy batches), 'cuda', 'cuda:N', an int N >= 0 or a cupy.cuda.Device"
_CUDA = re.compile(r"cuda(?::([0-9]+))?")


def parse_device(device: object) -> int | None:
    """The CUDA device index that ``device`` names, checked without importing CuPy.

    Returns None for ``"cuda"``, the current device (known once CuPy is imported).
    Raises :class:`~asynchdf5.ConfigurationError` for anything that is not a device spec.
    """
    if isinstance(device, (bool, np.bool_)):
        raise ConfigurationError(f"device={device!r} is a bool, not a device; use {_ACCEPTED}")
    if isinstance(device, (int, np.integer)):
        if device < 0:
            raise ConfigurationError(f"device={device!r}: a CUDA device index must be >= 0")
        return int(device)
    if isinstance(device, str):
        match = _CUDA.fullmatch(device)
        if match is None:
            raise ConfigurationError(f"device={device!r} is not a CUDA device; use {_ACCEPTED}")
        return None if match.group(1) is None else int(match.group(1))
    index = getattr(device, "id", None)  # a cupy.cuda.Device: CuPy is imported already
    if type(device).__module__.startswith("cupy") and isinstance(index, int):
        return index
    raise ConfigurationError(f"device={device!r} is not a CUDA device; use {_ACCEPTED}")


def resolve_device(device: object) -> tuple[ModuleType, int]:
    """CuPy and the index of the device that ``device`` names, which must exist.

    Touches no device memory: the CUDA calls here create no context.
    """
    index = parse_device(device)
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken install failing in its own way
        raise ConfigurationError(
            f"device={device!r} needs CuPy, which cannot be imported "
            f"({type(exc).__name__}: {exc}); {INSTALL_HINT}"
        ) from exc
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
        if index is None and count > 0:
            index = int(cupy.cuda.runtime.getDevice())
    except Exception as exc:  # CUDARuntimeError: no driver, driver too old, no device
        raise ConfigurationError(
            f"device={device!r}: CuPy finds no usable CUDA GPU ({type(exc).__name__}: {exc}). "
            "Use device=None for NumPy batches, or check the NVIDIA driver and that the CuPy "
            f"package matches its CUDA version ({INSTALL_HINT})"
        ) from exc
    if count == 0 or index is None:
        raise ConfigurationError(f"device={device!r}: this machine has no CUDA GPU")
    if index >= count:
        raise ConfigurationError(
            f"device={device!r}: there is no CUDA device {index}; this machine has {count} "
            f"(0 … {count - 1})"
        )
    return cupy, index
