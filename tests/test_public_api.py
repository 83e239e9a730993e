"""The public names: ``__all__`` is sorted and complete, and importing never pulls in CuPy."""

from __future__ import annotations

import subprocess
import sys
import types

import asynchdf5
from asynchdf5 import transforms


def _public(module: types.ModuleType) -> set[str]:
    return {
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and not isinstance(obj, types.ModuleType)
        and getattr(obj, "__module__", module.__name__).startswith("asynchdf5")
    }


def test_all_is_sorted_and_complete() -> None:
    assert asynchdf5.__all__ == sorted(asynchdf5.__all__)
    assert set(asynchdf5.__all__) == _public(asynchdf5) | {"transforms"}
    assert transforms.__all__ == sorted(transforms.__all__)
    for name in asynchdf5.__all__:
        assert getattr(asynchdf5, name) is not None


def test_errors_form_one_family() -> None:
    errors = ("ConfigurationError", "SourceError", "SchemaError", "ReadError", "TransformError")
    for name in (*errors, "DeviceError", "StateError"):
        assert issubclass(getattr(asynchdf5, name), asynchdf5.DataLayerError)
    assert issubclass(asynchdf5.ConfigurationError, ValueError)
    assert issubclass(asynchdf5.StateError, RuntimeError)


def test_public_classes_say_where_users_find_them() -> None:
    """``asynchdf5.ReadError`` in reprs and tracebacks, not ``asynchdf5._errors.ReadError``."""
    for name in asynchdf5.__all__:
        obj = getattr(asynchdf5, name)
        if isinstance(obj, type):
            assert obj.__module__ == "asynchdf5", name
            assert repr(obj) == f"<class 'asynchdf5.{name}'>"
    layer = asynchdf5.MemoryDataLayer({"x": [1, 2, 3]}, batch_size=2)
    assert repr(layer).startswith("<asynchdf5.MemoryDataLayer object")
    assert repr(layer.stream()).startswith("<asynchdf5.EpochIterator")


def test_the_sync_and_async_layers_take_the_same_properties() -> None:
    """One typed signature: HDF5DataLayer is AsyncHDF5DataLayer's sync face."""
    import inspect

    sync = inspect.signature(asynchdf5.HDF5DataLayer)
    both = inspect.signature(asynchdf5.AsyncHDF5DataLayer)
    assert sync == both
    assert "batch_size" in both.parameters and "backend" not in both.parameters  # deprecated


def test_import_does_not_import_cupy() -> None:
    code = "import sys, asynchdf5, asynchdf5.transforms; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
