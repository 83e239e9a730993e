"""The GPU benchmark's training-loop stall: does the GPU wait for data before a step?

Each loop runs a simulated step (a GPU matmul loop sized to take ``step_factor`` times as long as
loading one batch, :func:`calibrate`) and measures the GPU's idle time before each step with CUDA
events, for the device layer, the host layer with ``cupy.asarray``, and a PyTorch ``DataLoader``
(:func:`stall_rows`). Kept apart from the throughput measurement: it times the GPU, not the
loader.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from asynchdf5 import MemoryDataLayer
from benchmarks.gpu_setup import Config, Row, make_layer, torch_batches, torch_loader, torch_or_none

__all__ = ["Step", "calibrate", "stall_rows"]

#: A step "waited" when the GPU sat idle before it for longer than this (or 1 % of the step).
WAIT_THRESHOLD_S = 50e-6


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
    torch = torch_or_none()
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
    batches = torch_batches(torch_loader(cfg, arrays))
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
        layer = make_layer(cfg, arrays, device)
        starts, ends = anyio.run(_layer_stall, cfg, layer, step, upload)
        rows.append(_stall_row(name, starts, ends, elapsed))
    rows.append(_torch_stall(cfg, arrays, target))
    for row in rows:
        row.extra["target_step_ms"] = target * 1e3
    return rows
