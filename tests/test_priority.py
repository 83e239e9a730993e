"""With ``ASYNCHDF5_NICE``, the pipeline's bulk-work threads run below the consumer's priority
(Linux), and only they do: the threads of anyio's pool, which the application shares, are never
changed. By default nothing is."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from asynchdf5 import AsyncHDF5DataLayer, ConfigurationError

from ._files import N, check_epoch, write_source

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="thread priorities are set on Linux only"
    ),
]


def nice_of(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def priorities() -> dict[str, set[int]]:
    """The nice values of the live threads, by kind (pools name theirs ``<kind>_<i>``)."""
    out: dict[str, set[int]] = {}
    for t in threading.enumerate():
        if t.native_id is not None and t.is_alive():
            kind = t.name.rsplit("_", 1)[0] if t.name.startswith("asynchdf5-") else t.name
            out.setdefault(kind, set()).add(nice_of(t.native_id))
    return out


async def epoch_priorities(layer: AsyncHDF5DataLayer) -> dict[str, set[int]]:
    """One whole epoch of ``layer`` (checked), and the nice values seen at each batch."""
    seen: dict[str, set[int]] = {}
    batches = []
    async for batch in layer:
        batches.append(batch)
        for kind, values in priorities().items():
            seen.setdefault(kind, set()).update(values)
    check_epoch(batches, N, 10, 0)
    return seen


@pytest.mark.parametrize(("setting", "steps"), [(None, 0), ("0", 0), ("3", 3), ("10", 10)])
@pytest.mark.parametrize(
    ("layout", "kinds"),
    [
        ("contiguous", {"asynchdf5-read", "asynchdf5-gather"}),
        ("gzip", {"asynchdf5-read", "asynchdf5-decode", "asynchdf5-gather"}),
    ],
)
async def test_pipeline_threads_run_as_many_steps_below_the_consumer_as_set(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    setting: str | None,
    steps: int,
    layout: str,
    kinds: set[str],
) -> None:
    if setting is None:
        monkeypatch.delenv("ASYNCHDF5_NICE", raising=False)
    else:
        monkeypatch.setenv("ASYNCHDF5_NICE", setting)
    base = nice_of(os.getpid())
    assert nice_of(threading.get_native_id()) == base  # the consumer: the main thread
    source = write_source(tmp_path, layout=layout)[0]
    with anyio.fail_after(30):
        async with AsyncHDF5DataLayer(
            source, batch_size=10, chunk_size=40, shuffle=True, mmap=False
        ) as layer:
            seen = await epoch_priorities(layer)
            # anyio's worker threads (which waited for the reads) are as they were.
            in_worker = await anyio.to_thread.run_sync(lambda: nice_of(threading.get_native_id()))
    assert in_worker == base
    ours = {k: v for k, v in seen.items() if k.startswith("asynchdf5-")}
    assert kinds <= set(ours), seen
    want = min(19, base + steps)
    assert all(v == {want} for v in ours.values()), (want, ours)
    assert seen.get("AnyIO worker thread", {base}) == {base}, seen
    assert seen["MainThread"] == {base}


@pytest.mark.parametrize("value", ["high", "-1", "20", "2.5"])
async def test_a_bad_nice_setting_fails_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("ASYNCHDF5_NICE", value)
    source = write_source(tmp_path)[0]
    layer = AsyncHDF5DataLayer(source, batch_size=10)
    with anyio.fail_after(30), pytest.raises(ConfigurationError, match="ASYNCHDF5_NICE"):
        async with layer:
            pass
    monkeypatch.delenv("ASYNCHDF5_NICE")
    with anyio.fail_after(30):
        async with layer:  # the layer is closed, and opens once the setting is right
            check_epoch([b async for b in layer], N, 10, 0)


async def test_the_gather_thread_keeps_the_consumers_priority_when_it_runs_user_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Transformers run in the gather thread: a thread pool one of them starts there (a
    # library's first parallel call) would inherit a lowered priority and slow the consumer's
    # own use of it. Only the reads are lowered then.
    monkeypatch.setenv("ASYNCHDF5_NICE", "10")
    base = nice_of(os.getpid())
    source = write_source(tmp_path)[0]
    with anyio.fail_after(30):
        async with AsyncHDF5DataLayer(
            source,
            batch_size=10,
            chunk_size=40,
            transformers=[("data", lambda a: a * 1)],
            mmap=False,
        ) as layer:
            seen = await epoch_priorities(layer)
    assert seen["asynchdf5-gather"] == {base}, seen
    assert seen["asynchdf5-read"] == {min(19, base + 10)}, seen
