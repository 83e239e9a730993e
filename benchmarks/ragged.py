"""Ragged and sparse rows: the layer against a raw read of the same bytes, and a sparse
``.h5ad`` against AnnData's ``AnnLoader`` (``python -m benchmarks run ragged``).

Two files, made once in the data folder: token sequences of 16 to 1024 int32 values (a ragged
group, ``data`` + ``indptr``) with a label each, and a sparse count matrix written by
``anndata`` (``X`` a CSR group, float32 values, int32 column indices) with an ``obs`` column.
Each reader runs in a child process of its own, warm (the file read once before) and, where a
memory cgroup can be made (:mod:`benchmarks.cgroups`), again with the child in a 512 MiB one:

- *raw read*: the values (and column indices) read front to back with ``read_direct`` in
  64 MiB slabs, and ``indptr``: the bytes every reader must move, at the rate nothing beats;
- *asynchdf5*: shuffled epochs of ``Ragged`` (``csr_array``) batches, rows/s and bytes/s (also
  epoch 1 alone, which maps the file's pages and fills fresh buffers, and epochs 2+ alone, the
  gather), and unshuffled ones (the same order as the raw read);
- *NumPy resident* (a limit): the same shuffled batches (the layer's first epoch's order)
  gathered from values read into RAM beforehand by the plain NumPy code a user would write, on
  one thread: the faster of a slice per row joined by ``np.concatenate`` and one flat index of
  every value; what a shuffled gather of these rows costs with no file, cache or pipeline;
- *fixed rows* (a limit): the same layer over rows of one length holding the same bytes per row
  on average (a contiguous dataset: int32 token rows, or float32 rows as wide as a cell's
  values and column indices), shuffled: what the layer's gather does when rows need no spans;
- *AnnLoader*: ``anndata.experimental.AnnLoader`` over the backed file, shuffled, where
  anndata installs (it is in the ``bench`` extra).

Padding, in this process: :meth:`Ragged.to_padded <asynchdf5.Ragged.to_padded>` of 64, 256
and 1,024 token rows (to the longest row, and cut to 512) against ``np.copyto`` of its output
(a reused buffer). And, warm, in child processes: shuffled epochs of the tokens padded to 512
by the layer (``transforms.Pad`` at the head of the chain, gathered padded) against the same
epochs of ``Ragged`` batches the loop pads with ``to_padded(0, 512)``.

Ratios are taken within one run, reader against reader, in the same conditions: each ratio to
the raw read beside the ratio of its limits (NumPy resident, fixed rows) to it.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from benchmarks import cgroups, page_cache
from benchmarks.report import Recorder

LIMIT_MIB = 512
SLAB = 64 * 2**20


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"docs": 2_000, "cells": 2_000, "genes": 200, "epochs": 1, "timeout": 120}
    return {"docs": 200_000, "cells": 100_000, "genes": 2_000, "epochs": 2, "timeout": 900}


def write_tokens(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` token sequences of 16..1024 int32 values (a ragged group) and a label each."""
    if path.exists():
        return path
    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, 1025, n)
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=indptr[1:])
    tmp = path.with_suffix(".tmp")
    with h5py.File(tmp, "w") as f:
        g = f.create_group("tokens")
        data = g.create_dataset("data", (int(indptr[-1]),), np.int32)
        for a in range(0, int(indptr[-1]), SLAB // 4):
            b = min(int(indptr[-1]), a + SLAB // 4)
            data[a:b] = rng.integers(0, 50_000, b - a, dtype=np.int32)
        g["indptr"] = indptr
        f["label"] = rng.integers(0, 10, n)
    tmp.rename(path)
    return path


def write_cells(path: Path, cells: int, genes: int, seed: int = 0) -> Path | str:
    """A sparse ``.h5ad`` written by anndata (5% non-zeros), or why it cannot be."""
    if path.exists():
        return path
    try:
        import anndata
        import pandas as pd
        import scipy.sparse
    except ImportError as exc:
        return f"anndata not installed ({exc})"
    rng = np.random.default_rng(seed)
    x = scipy.sparse.random(
        cells, genes, density=0.05, format="csr", dtype=np.float32, random_state=rng
    )
    obs = pd.DataFrame({"n_counts": np.asarray(x.sum(axis=1)).ravel()})
    obs.index = obs.index.astype(str)
    tmp = path.with_name("tmp-" + path.name)
    anndata.AnnData(X=x, obs=obs).write_h5ad(tmp)
    tmp.rename(path)
    return path


def write_fixed(path: Path, ragged: Path, top: str) -> Path:
    """Rows of one length holding the bytes of ``ragged``'s top per row on average (values and
    column indices), contiguous, with a label: the fixed-row peer of the same bytes."""
    if path.exists():
        return path
    with h5py.File(ragged, "r") as f:
        g = f[top]
        rows = len(g["indptr"]) - 1
        nbytes = sum(g[m].dtype.itemsize * g[m].shape[0] for m in ("data", "indices") if m in g)
    dtype = np.dtype(np.int32) if top == "tokens" else np.dtype(np.float32)
    width = max(1, round(nbytes / max(1, rows) / dtype.itemsize))
    rng = np.random.default_rng(1)
    tmp = path.with_suffix(".tmp")
    with h5py.File(tmp, "w") as f:
        d = f.create_dataset(top, (rows, width), dtype)
        step = max(1, SLAB // (width * dtype.itemsize))
        for a in range(0, rows, step):
            b = min(rows, a + step)
            d[a:b] = rng.integers(0, 50_000, (b - a, width)).astype(dtype)
        f["label"] = rng.integers(0, 10, rows)
    tmp.rename(path)
    return path


# --- the readers, each in a child process ------------------------------------------------------


def _raw(job: dict[str, Any]) -> dict[str, Any]:
    """Every value (and column index) and ``indptr``, front to back in slabs."""
    t0 = time.perf_counter()
    moved = 0
    with h5py.File(job["path"], "r") as f:
        g = f[job["top"]]
        for name in ("data", "indices", "indptr"):
            if name not in g:
                continue
            d = g[name]
            step = max(1, SLAB // d.dtype.itemsize)
            buf = np.empty(min(step, d.shape[0]), d.dtype)
            for a in range(0, d.shape[0], step):
                b = min(d.shape[0], a + step)
                d.read_direct(buf, np.s_[a:b], np.s_[0 : b - a])
                moved += (b - a) * d.dtype.itemsize
    s = time.perf_counter() - t0
    return {"seconds": s, "bytes": moved, "rows": job["rows"]}


def _layer(job: dict[str, Any]) -> dict[str, Any]:
    from asynchdf5 import HDF5DataLayer

    tops = tuple(job["tops"])
    order: list[np.ndarray] = []
    with HDF5DataLayer(
        job["path"], tops=tops, batch_size=job["batch"], shuffle=job["shuffle"], seed=0
    ) as layer:
        times = []
        moved = rows = 0
        for epoch in range(job["epochs"]):
            t0 = time.perf_counter()
            for b in layer:
                v = b[tops[0]]
                if hasattr(v, "indices"):
                    moved += int(v.data.nbytes + v.indices.nbytes)
                elif hasattr(v, "values"):
                    moved += int(v.values.nbytes)
                else:
                    moved += int(v.nbytes)
                rows += len(b.indices)
                if epoch == 0 and job.get("order"):
                    order.append(b.indices.copy())
            times.append(time.perf_counter() - t0)
        paths = dict(layer.stats.read_paths)
    if order:  # the batches the NumPy reader gathers
        np.save(job["order"], np.concatenate(order))
    return {
        "seconds": sum(times),
        "epoch_s": times,
        "bytes": moved,
        "rows": rows,
        "read_paths": paths,
    }


def _numpy(job: dict[str, Any]) -> dict[str, Any]:
    """The layer's first epoch's batches, gathered on one thread by plain NumPy from the values
    (and column indices) read into RAM first: a slice per row joined by ``np.concatenate``, and
    one flat index of every value; the faster way's time (both epochs' worth)."""
    with h5py.File(job["path"], "r") as f:
        g = f[job["top"]]
        heaps = [g[m][()] for m in ("data", "indices") if m in g]
        indptr = np.asarray(g["indptr"][()], np.int64)
    order = np.load(job["order"])
    batches = [order[a : a + job["batch"]] for a in range(0, len(order), job["batch"])]

    def slices(idx: np.ndarray) -> int:
        starts, stops = indptr[idx].tolist(), indptr[idx + 1].tolist()
        out = [np.concatenate([h[a:b] for a, b in zip(starts, stops, strict=True)]) for h in heaps]
        np.cumsum(indptr[idx + 1] - indptr[idx])  # the batch's offsets
        return sum(o.nbytes for o in out)

    def flat(idx: np.ndarray) -> int:
        starts = indptr[idx]
        lengths = indptr[idx + 1] - starts
        ends = np.cumsum(lengths)
        at = np.repeat(starts - (ends - lengths), lengths) + np.arange(int(ends[-1]))
        return sum(h[at].nbytes for h in heaps)

    best: dict[str, float] = {}
    moved = 0
    for name, way in (("slices", slices), ("flat", flat)):
        t0 = time.perf_counter()
        moved = sum(way(idx) for _ in range(job["epochs"]) for idx in batches)
        best[name] = time.perf_counter() - t0
    fastest = min(best, key=lambda k: best[k])
    return {
        "seconds": best[fastest],
        "rows": len(order) * job["epochs"],
        "bytes": moved,
        "way": fastest,
        "ways_s": best,
    }


def _annloader(job: dict[str, Any]) -> dict[str, Any]:
    import anndata
    from anndata.experimental import AnnLoader

    adata = anndata.read_h5ad(job["path"], backed="r")
    loader = AnnLoader(adata, batch_size=job["batch"], shuffle=True)
    t0 = time.perf_counter()
    rows = 0
    deadline = t0 + job["cap_s"]
    for b in loader:
        rows += b.X.shape[0]
        if time.perf_counter() > deadline:  # a capped epoch: its rate is what counts
            break
    return {"seconds": time.perf_counter() - t0, "rows": rows, "bytes": 0}


READERS = {
    "raw": _raw,
    "layer": lambda job: _layer({**job, "shuffle": True}),
    "layer-unshuffled": lambda job: _layer({**job, "shuffle": False}),
    "numpy": _numpy,
    "fixed": lambda job: _layer(
        {**job, "path": job["fixed"], "tops": [job["top"], "label"], "shuffle": True}
    ),
    "annloader": _annloader,
}


def _padding(
    rec: Recorder, tokens: Path, batch: int = 64, reps: int = 30, length: int | None = None
) -> None:
    """``Ragged.to_padded`` on a batch of the token rows (to the longest row's length, or cut
    to ``length``) against ``np.copyto`` of its output's bytes (the memory speed padding aims
    at), in this process, alternating, the best of ``reps`` each."""
    from asynchdf5 import Ragged

    with h5py.File(tokens, "r") as f:
        indptr = f["tokens/indptr"][: batch + 1]
        r = Ragged(f["tokens/data"][: int(indptr[-1])], indptr)
    out, _ = r.to_padded(0, length)
    src, dst = np.ones_like(out), np.empty_like(out)
    best = {"pad": math.inf, "copyto": math.inf}
    for _ in range(reps):
        for name, f in (
            ("pad", lambda: r.to_padded(0, length)),
            ("copyto", lambda: np.copyto(dst, src)),
        ):
            t0 = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t0)
    cutting = "" if length is None else f" cut to {length}"
    rec.figure(f"to_padded, {batch} token rows{cutting}", out.nbytes / best["pad"] / 2**20, "MiB/s")
    rec.figure(
        f"np.copyto of its output's bytes, {batch} rows{cutting}",
        out.nbytes / best["copyto"] / 2**20,
        "MiB/s",
    )
    rec.ratio(
        f"to_padded ÷ np.copyto of its output, {batch} rows{cutting}",
        best["copyto"],
        best["pad"],
    )


#: The length the padded epochs pad (and cut) the token rows to.
PAD_LENGTH = 512


def _layer_padded(job: dict[str, Any]) -> dict[str, Any]:
    """Shuffled epochs of the token rows as ``(batch, PAD_LENGTH)`` arrays: padded by the layer
    (``job["fused"]``: ``transforms.Pad`` first in the chain, gathered padded) or by the loop
    (``Ragged.to_padded`` on each batch)."""
    from asynchdf5 import HDF5DataLayer
    from asynchdf5 import transforms as T

    fused = job["fused"]
    transformers = [(job["top"], T.Pad(0, length=PAD_LENGTH))] if fused else []
    with HDF5DataLayer(
        job["path"],
        tops=tuple(job["tops"]),
        batch_size=job["batch"],
        shuffle=True,
        seed=0,
        transformers=transformers,
    ) as layer:
        times = []
        rows = 0
        for _ in range(job["epochs"]):
            t0 = time.perf_counter()
            for b in layer:
                x = b[job["top"]] if fused else b[job["top"]].to_padded(0, PAD_LENGTH)[0]
                assert x.shape == (len(b.indices), PAD_LENGTH)
                rows += len(b.indices)
            times.append(time.perf_counter() - t0)
    return {"seconds": sum(times), "epoch_s": times, "rows": rows}


READERS["padded-fused"] = lambda job: _layer_padded({**job, "fused": True})
READERS["padded-loop"] = lambda job: _layer_padded({**job, "fused": False})


def _padded_epochs(rec: Recorder, tokens: Path, work: Path, size: dict[str, int]) -> None:
    """The tokens padded to :data:`PAD_LENGTH` by the layer's fused ``Pad`` and by
    ``to_padded`` in the loop, warm, each in a child process, alternating."""
    page_cache.warm(tokens)
    job = {
        "path": str(tokens),
        "top": "tokens",
        "tops": ["tokens", "label"],
        "batch": 64,
        "epochs": size["epochs"],
        "timeout": size["timeout"],
    }
    rates: dict[str, float] = {}
    for reader in ("padded-loop", "padded-fused"):
        r, error = cgroups.run_child(
            "benchmarks.ragged", {**job, "reader": reader}, work, reader, None
        )
        if error is not None:
            rec.note(f"tokens {reader}: {error}")
            continue
        rates[reader] = r["rows"] / r["seconds"]
        rec.figure(f"tokens, {reader} (length {PAD_LENGTH}), warm", rates[reader], "samples/s")
    rec.ratio(
        f"tokens: Pad(0, length={PAD_LENGTH}) fused ÷ to_padded in the loop, warm",
        rates.get("padded-fused"),
        rates.get("padded-loop"),
    )


def bench(rec: Recorder) -> None:
    size = _sizes(rec.quick)
    folder = rec.data_dir / "ragged"
    folder.mkdir(parents=True, exist_ok=True)
    tokens = write_tokens(folder / f"tokens-{size['docs']}.h5", size["docs"])
    cells = write_cells(
        folder / f"cells-{size['cells']}x{size['genes']}.h5ad", size["cells"], size["genes"]
    )
    fixed = {"tokens": write_fixed(folder / f"tokens-{size['docs']}-fixed.h5", tokens, "tokens")}
    if not isinstance(cells, str):
        cells_fixed = folder / f"cells-{size['cells']}x{size['genes']}-fixed.h5"
        fixed["cells"] = write_fixed(cells_fixed, cells, "X")
    rec.param(**size, limit_mib=LIMIT_MIB, load=os.getloadavg()[0])
    for batch, reps in ((64, 30), (256, 20), (1024, 10)):
        _padding(rec, tokens, batch, reps)
        _padding(rec, tokens, batch, reps, PAD_LENGTH)
    work = folder / f"work-{os.getpid()}"
    work.mkdir(exist_ok=True)
    _padded_epochs(rec, tokens, work, size)
    base = {"epochs": size["epochs"], "timeout": size["timeout"], "cap_s": 60}
    sets: list[tuple[str, dict[str, Any], list[str]]] = [
        (
            "tokens",
            {
                **base,
                "path": str(tokens),
                "top": "tokens",
                "tops": ["tokens", "label"],
                "batch": 64,
                "rows": size["docs"],
                "fixed": str(fixed["tokens"]),
            },
            ["raw", "layer", "numpy", "fixed", "layer-unshuffled"],
        ),
    ]
    if isinstance(cells, str):
        rec.note(f"sparse .h5ad: {cells}")
    else:
        sets.append(
            (
                "cells",
                {
                    **base,
                    "path": str(cells),
                    "top": "X",
                    "tops": ["X", "obs/n_counts"],
                    "batch": 256,
                    "rows": size["cells"],
                    "fixed": str(fixed["cells"]),
                },
                ["raw", "layer", "numpy", "fixed", "layer-unshuffled", "annloader"],
            )
        )
    try:
        with cgroups.warm_and_capped(
            f"asynchdf5-ragged-{os.getpid()}", LIMIT_MIB, rec.note
        ) as groups:
            for what, job, readers in sets:
                for label, group in groups:
                    page_cache.warm(job["path"])
                    rates: dict[str, float] = {}
                    firsts: dict[str, float] = {}  # epoch 1 alone, and epochs 2+ alone
                    laters: dict[str, float] = {}
                    byte_rates: dict[str, float] = {}
                    for reader in readers:
                        name = f"{reader}-{what}-{'cg' if group else 'warm'}"
                        order = str(work / f"order-{what}-{label}.npy")
                        job_r = {**job, "reader": reader, "what": what, "order": order}
                        r, error = cgroups.run_child("benchmarks.ragged", job_r, work, name, group)
                        if error is not None:
                            rec.note(f"{what} {reader} ({label}): {error}")
                            continue
                        rows_s = r["rows"] / r["seconds"]
                        if r["bytes"]:
                            byte_rates[reader] = r["bytes"] / r["seconds"]
                        if "read_paths" in r:
                            rec.note(f"{what} {reader} read paths: {r['read_paths']}")
                        if "way" in r:
                            ways = ", ".join(f"{k} {v:.3f} s" for k, v in r["ways_s"].items())
                            rec.note(f"{what} NumPy resident ({label}): {ways}")
                        rates[reader] = rows_s
                        rec.figure(f"{what}, {reader}, {label}", rows_s, "samples/s")
                        epochs = r.get("epoch_s", ())
                        if len(epochs) > 1:  # the first epoch alone (it maps and reads), the rest
                            per_epoch = r["rows"] / len(epochs)
                            firsts[reader] = per_epoch / epochs[0]
                            laters[reader] = per_epoch * (len(epochs) - 1) / sum(epochs[1:])
                            rec.figure(
                                f"{what}, {reader}, {label}, epoch 1", firsts[reader], "samples/s"
                            )
                            rec.figure(
                                f"{what}, {reader}, {label}, epochs 2+", laters[reader], "samples/s"
                            )
                        if reader in byte_rates:
                            rec.figure(
                                f"{what}, {reader}, {label}, values",
                                byte_rates[reader] / 2**20,
                                "MiB/s",
                            )
                    rec.ratio(
                        f"{what}: asynchdf5 ÷ raw read, {label}",
                        rates.get("layer"),
                        rates.get("raw"),
                    )
                    # The limits of the shuffled ratio, in the same run: what a plain NumPy gather
                    # from RAM and the layer's fixed rows of the same bytes reach.
                    rec.ratio(
                        f"{what}: NumPy resident (1 thread) ÷ raw read, {label}",
                        rates.get("numpy"),
                        rates.get("raw"),
                    )
                    rec.ratio(
                        f"{what}: asynchdf5 fixed rows ÷ raw read, {label}",
                        rates.get("fixed"),
                        rates.get("raw"),
                    )
                    rec.ratio(
                        f"{what}: asynchdf5 ÷ NumPy resident (1 thread), {label}",
                        rates.get("layer"),
                        rates.get("numpy"),
                    )
                    # The gather alone (epochs 2+: the file mapped, the buffers reused) and the
                    # first epoch (mapping the file's pages, filling fresh buffers) against the
                    # NumPy gather, which reads nothing and reuses its memory every epoch.
                    rec.ratio(
                        f"{what}: asynchdf5 epochs 2+ ÷ NumPy resident (1 thread), {label}",
                        laters.get("layer"),
                        rates.get("numpy"),
                    )
                    rec.ratio(
                        f"{what}: asynchdf5 epoch 1 ÷ NumPy resident (1 thread), {label}",
                        firsts.get("layer"),
                        rates.get("numpy"),
                    )
                    rec.ratio(
                        f"{what}: asynchdf5 ÷ asynchdf5 fixed rows, {label}",
                        rates.get("layer"),
                        rates.get("fixed"),
                    )
                    rec.ratio(
                        f"{what}: asynchdf5 unshuffled ÷ raw read, {label}",
                        rates.get("layer-unshuffled"),
                        rates.get("raw"),
                    )
                    rec.ratio(
                        f"{what}: asynchdf5 ÷ AnnLoader (backed), {label}",
                        rates.get("layer"),
                        rates.get("annloader"),
                    )
    finally:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()
    rec.note(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    cgroups.child(sys.argv[1], READERS)
