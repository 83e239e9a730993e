"""A sparse ``.h5ad`` read by asynchdf5 against AnnData's newer loader, ``annbatch``
(``python -m benchmarks run annbatch``).

``annbatch.Loader`` reads zarr v3 stores only (an ``.h5ad``'s CSR group is refused), so its user
first converts the file with ``annbatch.write_sharded`` (its defaults: 64-row chunks, 1 GB
shards, Blosc lz4); the conversion's time is a figure of its own. Then, in one run, each reader
in a child process of its own, warm (the files read once before) and, where a memory cgroup can
be made, again in a 512 MiB one, shuffled batches of 256 cells for two epochs:

- *asynchdf5*: ``HDF5DataLayer`` over the ``.h5ad`` as anndata wrote it (``X`` a CSR group);
- *annbatch*: ``annbatch.Loader(shuffle=True, batch_size=256)`` with its default sampler (chunks
  of 512 contiguous rows, 32 preloaded) over the converted store, on the CPU.

annbatch needs Python >= 3.12; where it does not import, the benchmark is skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from benchmarks import cgroups, page_cache
from benchmarks.ragged import write_cells
from benchmarks.report import Recorder, Skipped

LIMIT_MIB = 512
BATCH = 256


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"cells": 2_000, "genes": 200, "epochs": 1, "timeout": 120}
    return {"cells": 100_000, "genes": 2_000, "epochs": 2, "timeout": 900}


def _timed_epochs(loader: Iterable[Mapping[str, Any]], job: dict[str, Any]) -> list[float]:
    """Seconds of each of ``job["epochs"]`` passes over ``loader``, each checked whole."""
    times = []
    for _ in range(job["epochs"]):
        t0, rows = time.perf_counter(), 0
        for b in loader:
            rows += b["X"].shape[0]
        times.append(time.perf_counter() - t0)
        assert rows == job["cells"], rows
    return times


def _layer(job: dict[str, Any]) -> list[float]:
    from asynchdf5 import HDF5DataLayer

    with HDF5DataLayer(job["h5ad"], tops=("X",), batch_size=BATCH, shuffle=True, seed=0) as layer:
        return _timed_epochs(layer, job)


def _annbatch(job: dict[str, Any]) -> list[float]:
    import annbatch
    import anndata
    import zarr

    group = zarr.open_group(job["zarr"], mode="r")
    loader = annbatch.Loader(batch_size=BATCH, shuffle=True, preload_to_gpu=False)
    loader.add_dataset(anndata.io.sparse_dataset(group["X"]))
    return _timed_epochs(loader, job)


def _convert(h5ad: Path, store: Path) -> float:
    """``annbatch.write_sharded`` of the whole file, timed (once: the store is kept)."""
    import annbatch
    import anndata
    import zarr

    t0 = time.perf_counter()
    tmp = store.with_name("tmp-" + store.name)
    shutil.rmtree(tmp, ignore_errors=True)
    annbatch.write_sharded(zarr.open_group(tmp, mode="w", zarr_format=3), anndata.read_h5ad(h5ad))
    tmp.rename(store)
    return time.perf_counter() - t0


def bench(rec: Recorder) -> None:
    try:
        import annbatch
    except ImportError as exc:
        raise Skipped(f"annbatch does not import ({exc}); it needs Python >= 3.12") from exc
    size = _sizes(rec.quick)
    folder = rec.data_dir / "ragged"
    folder.mkdir(parents=True, exist_ok=True)
    h5ad = write_cells(
        folder / f"cells-{size['cells']}x{size['genes']}.h5ad", size["cells"], size["genes"]
    )
    if isinstance(h5ad, str):
        rec.note(f"sparse .h5ad: {h5ad}")
        return
    store = h5ad.with_suffix(".zarr")
    if not store.exists():
        rec.figure("annbatch.write_sharded of the .h5ad", _convert(h5ad, store), "s")
    rec.param(**size, batch=BATCH, limit_mib=LIMIT_MIB, annbatch=annbatch.__version__)
    rec.note(f"load average at the start: {os.getloadavg()}")
    work = folder / f"annbatch-work-{os.getpid()}"
    work.mkdir(exist_ok=True)
    job = {"h5ad": str(h5ad), "zarr": str(store), **size}
    try:
        with cgroups.warm_and_capped(
            f"asynchdf5-annbatch-{os.getpid()}", LIMIT_MIB, rec.note
        ) as groups:
            for label, group in groups:
                rates: dict[str, float] = {}
                for reader in ("layer", "annbatch"):
                    page_cache.warm(h5ad if reader == "layer" else store)
                    name = f"{reader}-{'cg' if group else 'warm'}"
                    times, error = cgroups.run_child(
                        "benchmarks.annbatch_cells", {**job, "reader": reader}, work, name, group
                    )
                    if error is not None:
                        rec.note(f"{reader} ({label}): {error}")
                        continue
                    rates[reader] = size["cells"] * len(times) / sum(times)
                    rec.figure(f"{reader}, {label}", rates[reader], "samples/s")
                    rec.figure(f"{reader}, {label}, epoch 1", size["cells"] / times[0], "samples/s")
                rec.ratio(
                    f"asynchdf5 ÷ annbatch, {label}", rates.get("layer"), rates.get("annbatch")
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rec.note(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    cgroups.child(sys.argv[1], {"layer": _layer, "annbatch": _annbatch})
