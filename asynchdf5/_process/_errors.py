"""What a layer sends its helper process at start (:func:`payload`), checked at construction
(:func:`check_picklable`), and how the helper's errors come back with their type
(:func:`error_blob`, :func:`rebuild`)."""

from __future__ import annotations

import importlib
import multiprocessing.spawn
import pickle
import sys
import traceback
from typing import TYPE_CHECKING, Any

from .._errors import ConfigurationError, DataLayerError

if TYPE_CHECKING:
    from .._config import LayerConfig

__all__ = ["IMPORTING_MAIN", "check_picklable", "error_blob", "payload", "rebuild"]

#: Set in a helper process while it imports the layer's main module (as ``spawn`` does): a
#: layer made with ``process=True`` meanwhile is a script without a ``__main__`` guard, which
#: would start helpers without end.
IMPORTING_MAIN: list[bool] = []


def check_picklable(config: LayerConfig, source: object) -> None:
    """Raise :class:`ConfigurationError` naming what of the layer's properties cannot be sent
    to its helper process (``process=True``): a transformer (host batches only: with a device
    they run in this process), the source (its files, or its streams) or an option."""
    if IMPORTING_MAIN:
        raise ConfigurationError(
            "a layer with process=True was made while its helper process imported your main "
            "module: put the code that makes and iterates layers under `if __name__ == "
            '"__main__":` (the helper imports the main module, as multiprocessing\'s spawn does)'
        )
    # With a device the transformers run there, in this process: they never travel.
    transformers = config.transformers if config.device is None else ()
    for i, (top, fn) in enumerate(transformers):
        try:
            pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise ConfigurationError(
                f"process=True runs the transformers in a helper process, and transformers[{i}] "
                f"for top {top!r} ({fn!r}) cannot be pickled to get there ({exc}): define it at "
                "the top level of a module (not a lambda, nor a function or class defined "
                "inside another), or use process=False"
            ) from exc
    for what, value in (("source", source), ("storage_options", config.storage_options)):
        try:
            pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise ConfigurationError(
                f"process=True sends the {what} to a helper process, and it cannot be pickled: "
                f"{exc}"
            ) from exc


def payload(
    source: object,
    config: LayerConfig,
    part: tuple[int, int] | None,
    state: dict[str, Any] | None,
) -> bytes:
    """What the helper reads at start: how to import the main module as ``spawn`` does (so that
    transformers defined there unpickle), then the layer's source (its files, or its streams:
    see :meth:`~asynchdf5.AsyncHDF5DataLayer.streams`) and properties."""
    prep = multiprocessing.spawn.get_preparation_data("asynchdf5-helper")
    prep.pop("authkey", None)  # nothing of multiprocessing's runs there
    layer = pickle.dumps((source, config, part, state), protocol=pickle.HIGHEST_PROTOCOL)
    return pickle.dumps((prep, layer), protocol=pickle.HIGHEST_PROTOCOL)


def error_blob(exc: BaseException) -> tuple[Any, ...]:
    """``exc`` as the helper sends it: pickled if it can be, else its type's name and message;
    with the helper's traceback, then its cause's blob (``raise ... from``; None: no cause),
    which pickling would drop."""
    where = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    cause = None if exc.__cause__ is None else error_blob(exc.__cause__)
    try:
        return ("pickled", pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL), where, cause)
    except Exception:
        kind = type(exc)
        return ("named", f"{kind.__module__}:{kind.__qualname__}", str(exc), where, cause)


def rebuild(blob: tuple[Any, ...]) -> BaseException:
    """The helper's exception, in this process: the same type and message where the type can be
    made again here (else a :class:`DataLayerError` naming it); the helper's traceback is in
    its notes, and its cause (``__cause__``: a transformer's exception under a
    :class:`~asynchdf5.TransformError`) is rebuilt the same way."""
    where, cause = blob[-2], blob[-1]
    exc: BaseException | None = None
    if blob[0] == "pickled":
        try:
            exc = pickle.loads(blob[1])
        except Exception:
            exc = None
    else:
        module, _, name = blob[1].partition(":")
        try:
            kind: Any = importlib.import_module(module)
            for part in name.split("."):
                kind = getattr(kind, part)
            exc = kind(blob[2])
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = DataLayerError(f"the layer's helper process failed: {where.strip()}")
    if sys.version_info >= (3, 11):
        exc.add_note("In the layer's helper process (process=True):\n" + where.rstrip())
    if cause is not None:
        exc.__cause__ = rebuild(cause)
    return exc
