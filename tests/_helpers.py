"""Helpers that tests of several modules share and that are not data: collecting an epoch (up
to the error that ends it), the examples a property test draws (and how a whole-pipeline one
is bounded), the command line run in-process, and a layer that must fail to open."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest
from hypothesis import HealthCheck, settings

from asynchdf5 import AsyncHDF5DataLayer, Batch, DataLayerError
from asynchdf5._cli import main

from ._leaks import aassert_released, asnapshot

#: Seconds an epoch collected here may take before the test fails instead of hanging.
DEADLINE = 30

E = TypeVar("E", bound=DataLayerError)
F = TypeVar("F", bound=Callable[..., Any])


def examples(default: int) -> int:
    """The examples a property test draws: ``default`` (a few dozen) in the normal run, and
    ``ASYNCHDF5_STRESS_EXAMPLES`` where that is set (``nox -s stress``: thousands)."""
    return int(os.environ.get("ASYNCHDF5_STRESS_EXAMPLES", default))


#: Seconds one example of a whole-pipeline property test may take (each test bounds its
#: examples with it): generous for a loaded CI machine, and far below "forever".
EXAMPLE_DEADLINE = float(os.environ.get("ASYNCHDF5_EXAMPLE_DEADLINE", "30"))


def pipeline_examples(n: int) -> Callable[[F], F]:
    """Mark a property test of the whole pipeline: ``n`` examples, none with hypothesis'
    deadline or pytest-timeout's (the test bounds each example by :data:`EXAMPLE_DEADLINE`
    instead: the examples add up), and without the health checks that a function-scoped
    fixture and slow examples trip."""

    def mark(test: F) -> F:
        drawn = settings(
            max_examples=n,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )(test)
        timed: F = pytest.mark.timeout(0)(drawn)
        return timed

    return mark


async def epoch_until_error(
    layer: Any, on_batch: Callable[[int], None] = lambda n: None, deadline: float = DEADLINE
) -> tuple[list[Batch], DataLayerError | None]:
    """One epoch of the open ``layer``, under ``deadline``: the batches, and the library error
    that ended it (None: none). ``on_batch(n)`` runs after the ``n``-th batch."""
    got: list[Batch] = []
    try:
        with anyio.fail_after(deadline):
            async for b in layer:
                got.append(b)
                on_batch(len(got))
    except DataLayerError as exc:
        return got, exc
    return got, None


async def collect_until_error(
    layer: Any, exc_type: type[E], on_batch: Callable[[int], None] = lambda n: None
) -> tuple[list[Batch], E]:
    """One epoch of the open ``layer``, which must end with ``exc_type``: the batches before
    it, and the error."""
    got, err = await epoch_until_error(layer, on_batch)
    assert isinstance(err, exc_type), f"expected {exc_type.__name__}, got {err!r}"
    return got, err


async def one_epoch(layer: Any, deadline: float = DEADLINE) -> list[Batch]:
    """One whole epoch of the open ``layer`` (an error ends the test)."""
    got, err = await epoch_until_error(layer, deadline=deadline)
    assert err is None, err
    return got


async def epochs(
    layer: Any, n: int = 1, keep: bool = True, deadline: float = DEADLINE
) -> list[list[Batch]]:
    """Open ``layer`` and collect ``n`` epochs, all under ``deadline`` (``keep=False``: drop
    each batch once taken, and return empty epochs)."""
    out: list[list[Batch]] = []
    with anyio.fail_after(deadline):
        async with layer:
            for _ in range(n):
                batches = []
                async for b in layer:
                    if keep:
                        batches.append(b)
                out.append(batches)
    return out


ROOT = Path(__file__).resolve().parent.parent


def double_sigint_trials(
    args: Sequence[object], env: dict[str, str], timeout: float
) -> tuple[list[str], str]:
    """Run ``tests/_double_sigint.py ARGS`` (its trials of a double Ctrl-C): each trial's outcome
    (``ok`` where the child exited as an uncaught ``KeyboardInterrupt`` ends a script) and its
    stderr. The test fails with what the trials said so far where they outlast ``timeout``
    (the exception carries it as bytes, which pytest would not show), or the script fails. The
    script runs in a session of its own, killed whole on a timeout: its trial children too."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "_double_sigint.py"), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        said, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        said, err = kill_session(proc)
        raise AssertionError(f"trials {args} ran out of time: {said!r}\n{err[-3000:]}") from None
    finally:
        if proc.poll() is None:
            kill_session(proc)
    assert proc.returncode == 0, err[-3000:]
    return said.split(), err


def kill_session(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Kill ``proc`` (started with ``start_new_session=True``) with every process of its
    session, its children included; what it printed (stdout, stderr: "" where not piped)."""
    os.killpg(proc.pid, signal.SIGKILL)
    out, err = proc.communicate()
    return out or "", err or ""


#: What a process prints when PyTorch (2.13, the gloo backend) aborts it at interpreter exit,
#: after the script's last statement. A gloo worker thread frees its last all-reduce of a
#: backward pass a moment after completing it; that work holds the Python context
#: ``torch.autograd`` stashes, and where the interpreter has begun to finalize by then, taking
#: the GIL to release it ends the thread through a noexcept destructor (core dumps: in
#: ``ProcessGroupGloo::runLoop``, ``~AsyncAllreduceWork``, ``SafePyObject``, ``take_gil``).
#: A 20-line DDP script that never imports asynchdf5 did it in 2 of 16 runs on two loaded
#: cores (docs/pytorch.md's example, whose last all-reduce is further from its exit, in 1 of
#: about 300); no statement after the last step prevents it (the group's threads outlive
#: ``destroy_process_group``). A run that ends so runs once more.
TORCH_EXIT_ABORT = "terminate called without an active exception"


def pytorch_aborted_at_exit(returncode: int, output: str) -> bool:
    """Whether a run failed with :data:`TORCH_EXIT_ABORT` in ``output``, its stdout and stderr."""
    return returncode != 0 and TORCH_EXIT_ABORT in output


def run_python(
    args: Sequence[object], timeout: float, *, torch_ddp: bool = False, **env: str
) -> str:
    """``python ARGS`` in a process of its own, from the repository root with it on the import
    path and ``env`` added to this environment; its stdout once it exited 0 (else the test
    fails with its output). ``torch_ddp``: once more where PyTorch aborted it at exit
    (:data:`TORCH_EXIT_ABORT`)."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    for _ in range(2 if torch_ddp else 1):
        run = subprocess.run(
            [sys.executable, *(str(a) for a in args)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": path, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if not pytorch_aborted_at_exit(run.returncode, run.stdout + run.stderr):
            break
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


_PEAK_FROM_NOW = """
def _kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from the resident size now
_before = _kib("VmRSS:")
"""


def peak_growth(setup: str, body: str, args: Sequence[object], timeout: float) -> int:
    """Bytes by which the peak resident size of a fresh Python process grows while it runs
    ``body`` (after ``setup``, its imports; ``sys.argv[1:]`` are ``args``). Linux only: the
    peak is reset through ``/proc/self/clear_refs``; the figure is the last word printed."""
    code = f"{setup}\n{_PEAK_FROM_NOW}\n{body}\nprint((_kib('VmHWM:') - _before) * 1024)\n"
    return int(run_python(["-c", code, *args], timeout=timeout).split()[-1])


def run_main(args: Sequence[object], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``asynchdf5 ARGS`` in this process: its exit status, and what it wrote to stdout and
    stderr."""
    status = main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


async def open_must_fail(layer: AsyncHDF5DataLayer, exc_type: type[DataLayerError]) -> Any:
    """Open ``layer``, expecting ``exc_type`` before the body runs; check nothing is left."""
    before = await asnapshot()
    with pytest.raises(exc_type) as info:
        async with layer:
            pytest.fail("the layer opened")
    await aassert_released(before)
    return info.value
