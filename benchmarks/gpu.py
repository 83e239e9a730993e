"""GPU delivery benchmark: ``python -m benchmarks run gpu [--quick]``.

Measures, on in-memory synthetic images (uint8) and labels, so the disk plays no part:

* **throughput** (samples/s and host-to-device GB/s) of

  - ``host``: ``MemoryDataLayer(device=None)``, NumPy batches (the reference: same config),
  - ``device``: ``MemoryDataLayer(device="cuda")``, CuPy batches (pinned staging, own stream),
  - (a) ``cupy.asarray``: the host layer, then ``cupy.asarray(batch[top])`` per batch from
    pageable memory,
  - (b) ``torch``: PyTorch ``DataLoader`` (a batch sampler, ``pin_memory=True``, worker
    processes), then ``.cuda(non_blocking=True)``; skipped when torch has no CUDA,
  - (c) the pinned-copy limit: one big ``cudaMemcpyAsync`` from page-locked memory;

* **training-loop stall**: each loop runs a simulated step, a GPU matmul loop sized to take
  ``--step-factor`` times as long as loading one batch, and the GPU's idle time before each
  step (CUDA events: end of the previous step to the start of this one, on the training stream)
  says whether it waited for data. The host stays at most two steps ahead of the GPU, as a
  training loop that reads its loss now and then does.

Targets (the issue's): ``device`` throughput >= 0.9 x ``host``; the GPU waits for data in fewer
than 5 % of steps. Without CuPy or a GPU the script says so and exits 0.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import numpy as np

from asynchdf5 import MemoryDataLayer
from asynchdf5 import transforms as T
from benchmarks.report import Recorder, Skipped

#: A step "waited" when the GPU sat idle before it for longer than this (or 1 % of the step).
WAIT_THRESHOLD_S = 50e-6


@dataclass
class Row:
    """One line of the report."""

    name: str
    samples_per_s: float = math.nan
    gb_per_s: float = math.nan
    steps: int = 0
    waited_fraction: float = math.nan
    mean_idle_ms: float = math.nan
    step_ms: float = math.nan
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Config:
    samples: int
    shape: tuple[int, ...]
    batch_size: int
    shuffle: bool
    prefetch: int
    seconds: float
    steps: int
    step_factor: float
    workers: int
    scale: bool

    @property
    def sample_bytes(self) -> int:
        return int(np.prod(self.shape)) + 8  # uint8 data + int64 label


def _data(cfg: Config) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(cfg.samples, *cfg.shape), dtype=np.uint8)
    return {"data": data, "label": np.arange(cfg.samples, dtype=np.int64)}


def _layer(cfg: Config, arrays: dict[str, np.ndarray], device: str | None) -> MemoryDataLayer:
    transformers = [("data", T.Scale(1 / 255))] if cfg.scale else []
    return MemoryDataLayer(
        arrays,
        batch_size=cfg.batch_size,
        shuffle=cfg.shuffle,
        seed=0,
        prefetch=cfg.prefetch,
        transformers=transformers,
        device=device,
    )


def _rate(cfg: Config, name: str, batches: int, seconds: float, note: str = "") -> Row:
    sps = batches * cfg.batch_size / seconds
    return Row(name, sps, sps * cfg.sample_bytes / 1e9, note=note)


# -- throughput -------------------------------------------------------------------------------


async def _layer_throughput(
    cfg: Config,
    layer: MemoryDataLayer,
    per_batch: Callable[[Any], None],
    finish: Callable[[], None],
) -> tuple[int, float, Any]:
    """Batches consumed in ``cfg.seconds`` after a warm-up, the seconds it took, and the
    device stage's memory (None on the host)."""
    warmup = 3 * cfg.prefetch
    count, t0 = 0, 0.0
    async with layer:
        async for batch in layer.stream():
            per_batch(batch)
            count += 1
            if count == warmup:
                finish()
                t0 = time.perf_counter()
            elif count > warmup and time.perf_counter() - t0 > cfg.seconds:
                break
        finish()  # the last copies are part of the work
        seconds = time.perf_counter() - t0
        # Private until the layer reports it (LayerStats): the stage's memory, before close.
        stats = getattr(getattr(layer, "_delivery", None), "memory_stats", None)
    return count - warmup, seconds, stats


def throughput_rows(cfg: Config, arrays: dict[str, np.ndarray], cp: Any) -> list[Row]:
    sync = cp.cuda.get_current_stream().synchronize
    rows = []

    host = _layer(cfg, arrays, None)
    n, s, _ = anyio.run(_layer_throughput, cfg, host, lambda b: None, lambda: None)
    rows.append(_rate(cfg, "host (device=None)", n, s, "reference"))

    device = _layer(cfg, arrays, "cuda")
    n, s, stats = anyio.run(_layer_throughput, cfg, device, lambda b: None, sync)
    row = _rate(
        cfg, 'device="cuda"', n, s, f"{n * cfg.batch_size / s / rows[0].samples_per_s:.2f} x host"
    )
    if stats is not None:
        row.extra = asdict(stats)
        peak, pinned = stats.device_bytes_peak / 2**20, stats.pinned_bytes / 2**20
        row.note += f"; device peak {peak:.0f} MiB, pinned staging {pinned:.0f} MiB"
    rows.append(row)

    kept: list[Any] = []  # keeps the last batch alive, as a training step would

    def upload(batch: Any) -> None:
        kept[:] = [cp.asarray(batch[top]) for top in batch]

    n, s, _ = anyio.run(_layer_throughput, cfg, _layer(cfg, arrays, None), upload, sync)
    rows.append(_rate(cfg, "(a) host layer + cupy.asarray", n, s, "pageable, per batch"))

    rows.append(_torch_throughput(cfg, arrays))
    rows.append(_pinned_limit(cfg, cp))
    return rows


def _torch_loader(cfg: Config, arrays: dict[str, np.ndarray]) -> Any:
    import torch
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

    dataset: Any = torch.utils.data.Dataset  # generic in torch's stubs, Any without them

    class Batches(dataset):  # type: ignore[misc]
        """``dataset[list of indices]``: one fancy-index gather per top (the fast pattern)."""

        def __len__(self) -> int:
            return cfg.samples

        def __getitem__(self, idx: list[int]) -> tuple[Any, Any]:
            rows = np.asarray(idx)
            return (
                torch.from_numpy(np.take(arrays["data"], rows, axis=0)),
                torch.from_numpy(np.take(arrays["label"], rows, axis=0)),
            )

    order = (
        RandomSampler(range(cfg.samples)) if cfg.shuffle else SequentialSampler(range(cfg.samples))
    )
    return DataLoader(
        Batches(),
        batch_size=None,
        sampler=BatchSampler(order, cfg.batch_size, drop_last=False),
        num_workers=cfg.workers,
        pin_memory=True,
        persistent_workers=cfg.workers > 0,
        prefetch_factor=max(2, cfg.prefetch // max(1, cfg.workers)) if cfg.workers else None,
    )


def _torch_batches(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def _torch_or_none() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _torch_throughput(cfg: Config, arrays: dict[str, np.ndarray]) -> Row:
    name = f"(b) torch DataLoader pin_memory, {cfg.workers} workers"
    torch = _torch_or_none()
    if torch is None:
        return Row(name, note="skipped: torch with CUDA is not installed")
    batches = _torch_batches(_torch_loader(cfg, arrays))
    warmup = 3 * cfg.prefetch
    kept = []
    for _ in range(warmup):
        kept = [t.cuda(non_blocking=True) for t in next(batches)]
    torch.cuda.synchronize()
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < cfg.seconds:
        kept = [t.cuda(non_blocking=True) for t in next(batches)]
        if cfg.scale:
            kept[0] = kept[0].float().mul_(1 / 255)
        count += 1
    torch.cuda.synchronize()
    return _rate(cfg, name, count, time.perf_counter() - t0, ".cuda(non_blocking=True)")


def _pinned_limit(cfg: Config, cp: Any) -> Row:
    import cupyx

    nbytes = min(1 << 30, max(64 << 20, 16 * cfg.batch_size * cfg.sample_bytes))
    host = cupyx.empty_pinned((nbytes,), np.uint8)
    host[:] = 1
    dev = cp.empty(nbytes, np.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(2):  # warm-up
        dev.data.copy_from_host_async(host.ctypes.data, nbytes, stream)
    reps = 5
    start.record(stream)
    for _ in range(reps):
        dev.data.copy_from_host_async(host.ctypes.data, nbytes, stream)
    end.record(stream)
    end.synchronize()
    seconds = cp.cuda.get_elapsed_time(start, end) / 1e3
    gbs = reps * nbytes / seconds / 1e9
    row = Row("(c) pinned-copy limit", gbs * 1e9 / cfg.sample_bytes, gbs)
    row.note = f"one {nbytes >> 20} MiB cudaMemcpyAsync"
    return row


# -- training-loop stall ----------------------------------------------------------------------


@dataclass
class Step:
    """A simulated training step: ``k`` square matmuls on the current stream."""

    cp: Any
    k: int
    n: int = 2048

    def __post_init__(self) -> None:
        cp = self.cp
        self.a = cp.random.default_rng(0).random((self.n, self.n), dtype=np.float32)
        self.c = cp.empty_like(self.a)
        self.acc = cp.zeros((), np.float32)

    def __call__(self, x: Any) -> None:
        self.acc += x.sum(dtype=np.float32)  # use the batch
        for _ in range(self.k):
            self.cp.matmul(self.a, self.a, out=self.c)


def calibrate(cp: Any, target_s: float) -> Step:
    step = Step(cp, 20)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    step(cp.zeros(1, np.uint8))  # warm-up (cuBLAS handle, kernels)
    start.record()
    step(cp.zeros(1, np.uint8))
    end.record()
    end.synchronize()
    per_matmul = cp.cuda.get_elapsed_time(start, end) / 1e3 / step.k
    step.k = max(1, math.ceil(target_s / per_matmul))
    return step


def _stall_row(
    name: str, starts: list[Any], ends: list[Any], elapsed: Callable[[Any, Any], float]
) -> Row:
    idle = [elapsed(ends[i - 1], starts[i]) / 1e3 for i in range(1, len(starts))]
    busy = [elapsed(starts[i], ends[i]) / 1e3 for i in range(len(starts))]
    step_s = float(np.median(busy))
    threshold = max(WAIT_THRESHOLD_S, 0.01 * step_s)
    waited = sum(t > threshold for t in idle) / max(1, len(idle))
    return Row(
        name,
        steps=len(starts),
        waited_fraction=waited,
        mean_idle_ms=float(np.mean(idle)) * 1e3,
        step_ms=step_s * 1e3,
        note=f"waited = idle > {threshold * 1e6:.0f} µs",
    )


async def _layer_stall(
    cfg: Config, layer: MemoryDataLayer, step: Step, upload: Callable[[Any], Any]
) -> tuple[list[Any], list[Any]]:
    cp = step.cp
    starts: list[Any] = []
    ends: list[Any] = []
    async with layer:
        async for batch in layer.stream():
            x = upload(batch["data"])  # device batches: already there (ready on this stream)
            starts.append(cp.cuda.get_current_stream().record(cp.cuda.Event()))
            step(x)
            ends.append(cp.cuda.get_current_stream().record(cp.cuda.Event()))
            if len(ends) > 2:  # at most two steps ahead; never block the event loop on the GPU
                await anyio.to_thread.run_sync(ends[-3].synchronize)
            if len(ends) == cfg.steps:
                break
        ends[-1].synchronize()
    return starts[cfg.prefetch :], ends[cfg.prefetch :]


def _torch_stall(cfg: Config, arrays: dict[str, np.ndarray], target_s: float) -> Row:
    name = "(b) torch DataLoader + .cuda(non_blocking=True)"
    torch = _torch_or_none()
    if torch is None:
        return Row(name, note="skipped: torch with CUDA is not installed")
    a = torch.rand((2048, 2048), device="cuda")
    c = torch.empty_like(a)

    def step(x: Any, k: int) -> None:
        x.sum(dtype=torch.float32)
        for _ in range(k):
            torch.matmul(a, a, out=c)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    step(torch.zeros(1, device="cuda"), 20)
    start.record()
    step(torch.zeros(1, device="cuda"), 20)
    end.record()
    end.synchronize()
    k = max(1, math.ceil(target_s / (start.elapsed_time(end) / 1e3 / 20)))
    batches = _torch_batches(_torch_loader(cfg, arrays))
    starts: list[Any] = []
    ends: list[Any] = []
    for _ in range(cfg.steps):
        x = next(batches)[0].cuda(non_blocking=True)
        starts.append(torch.cuda.Event(enable_timing=True))
        starts[-1].record()
        step(x, k)
        ends.append(torch.cuda.Event(enable_timing=True))
        ends[-1].record()
        if len(ends) > 2:
            ends[-3].synchronize()
    ends[-1].synchronize()
    skip = cfg.prefetch
    return _stall_row(name, starts[skip:], ends[skip:], lambda s, e: s.elapsed_time(e))


def stall_rows(cfg: Config, arrays: dict[str, np.ndarray], cp: Any, load_s: float) -> list[Row]:
    target = cfg.step_factor * load_s
    step = calibrate(cp, target)
    elapsed = cp.cuda.get_elapsed_time
    rows = []
    for name, device, upload in (
        ('device="cuda"', "cuda", lambda x: x),
        ("(a) host layer + cupy.asarray", None, cp.asarray),
    ):
        layer = _layer(cfg, arrays, device)
        starts, ends = anyio.run(_layer_stall, cfg, layer, step, upload)
        rows.append(_stall_row(name, starts, ends, elapsed))
    rows.append(_torch_stall(cfg, arrays, target))
    for row in rows:
        row.extra["target_step_ms"] = target * 1e3
    return rows


def bench(rec: Recorder) -> None:
    """Throughput of each delivery and the training-loop stall; skipped, with the reason, where
    CuPy or a CUDA GPU is missing. Targets: device ÷ host throughput ≥ 0.9, the GPU waiting for
    data before < 5 % of steps."""
    try:
        import cupy as cp

        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no CuPy, no driver, no GPU
        raise Skipped(f"needs CuPy and a CUDA GPU ({type(exc).__name__}: {exc})") from exc
    if count == 0:
        raise Skipped("no CUDA GPU")
    quick = rec.quick
    cfg = Config(
        samples=4096 if quick else 32768, shape=(3, 128, 128), batch_size=256, shuffle=True,
        prefetch=8, seconds=1.0 if quick else 5.0, steps=60 if quick else 300, step_factor=1.5,
        workers=4, scale=False,
    )  # fmt: skip
    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    rec.param(device=name.decode() if isinstance(name, bytes) else str(name), **asdict(cfg))
    arrays = _data(cfg)
    rows = throughput_rows(cfg, arrays, cp)
    for r in rows:
        rec.figure(f"{r.name}: throughput", r.samples_per_s, "samples/s")
        rec.figure(f"{r.name}: host to device", r.gb_per_s, "GB/s")
        if r.note:
            rec.note(f"{r.name}: {r.note}")
    rec.ratio("device ÷ host throughput", rows[1].samples_per_s, rows[0].samples_per_s)
    load_s = cfg.batch_size / max(rows[0].samples_per_s, rows[1].samples_per_s)
    for r in stall_rows(cfg, arrays, cp, load_s):
        rec.figure(f"{r.name}: step", r.step_ms, "ms")
        rec.figure(f"{r.name}: mean GPU idle before a step", r.mean_idle_ms, "ms")
        rec.note(f"{r.name}: the GPU waited for data before {100 * r.waited_fraction:.1f} % of "
                 f"{r.steps} steps {r.note}")  # fmt: skip
