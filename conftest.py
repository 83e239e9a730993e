"""The documentation's code examples run as tests (sybil): every Python block of README.md and
docs/*.md, in a temporary folder that holds a small ``train.txt`` data set (uint8 3x32x32
images and int64 labels in two HDF5 files), with stand-ins for the user's own training step.

A block that needs a CUDA GPU says so (``<!-- skip: next if(no_gpu, reason=...) -->``) and runs
where one is usable. The pages of the optional clients (Lightning, Keras, JAX) start those
libraries: they are marked ``integration`` and run in ``nox -s integration``, beside the clients'
tests.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser


def _gpu_usable() -> bool:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def _setup(namespace: dict[str, Any]) -> None:
    from asynchdf5._cli._sample import write_dataset

    folder = Path(tempfile.mkdtemp(prefix="asynchdf5-docs-"))
    write_dataset(folder, 2048, 2, 0)  # folder/train.txt
    namespace["_cwd"], namespace["_folder"] = os.getcwd(), folder
    os.chdir(folder)

    def step(*arrays: Any) -> None:
        """The user's training step: here, it only looks at the batch."""
        assert len({len(a) for a in arrays}) == 1

    namespace.update(
        step=step,
        train_step=lambda batch: step(*batch.values()),
        mean=np.full((3, 32, 32), 127.0),
        no_gpu=not _gpu_usable(),
        # Pages about optional clients skip their examples where the client is not installed.
        no_lightning=not _installed("lightning", "torchdata"),
        no_keras=not _installed("keras", "jax"),  # the page runs Keras on JAX
        no_jax=not _installed("jax"),
        no_anndata=not _installed("anndata", "scipy"),
    )


#: The pages about the optional clients, which run in ``nox -s integration``.
CLIENT_PAGES = frozenset({"lightning.md", "keras.md", "jax.md"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the examples of the clients' pages ``integration``."""
    for item in items:
        if item.path.name in CLIENT_PAGES and item.path.parent.name == "docs":
            item.add_marker(pytest.mark.integration)


def _teardown(namespace: dict[str, Any]) -> None:
    os.chdir(namespace["_cwd"])
    shutil.rmtree(namespace["_folder"], ignore_errors=True)


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md", "docs/*.md"],
    setup=_setup,
    teardown=_teardown,
).pytest()
