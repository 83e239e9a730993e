"""``process=True``: the pipeline in a helper process, batches through shared memory (issue 31,
item 3). The same batches, epochs, saved states and errors as in-process; nothing left behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import psutil
import pytest

from asynchdf5 import (
    AsyncHDF5DataLayer,
    ConfigurationError,
    HDF5DataLayer,
    ReadError,
    TransformError,
)
from asynchdf5 import (
    transforms as T,
)

from ._fake_cupy import FakeArray, FakeCupy
from ._files import N, check_epoch, check_exactly_once, write_source
from ._gpu_data import host_copy
from ._helpers import double_sigint_trials
from ._leaks import aassert_released, asnapshot, helper_processes, no_helper_left

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
DEADLINE = 30


def _shm() -> set[str]:
    """The batch slots' names in /dev/shm (where there is no ``memfd_create``, see
    ``_process._wire``); other programs and tests on the machine have theirs."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("asynchdf5-batch")}
    except OSError:  # pragma: no cover - no /dev/shm
        return set()


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return write_source(tmp_path)[0]


def _pairs(batches: list[Any]) -> list[np.ndarray]:
    return [b.indices for b in batches]


class Fails:
    """A transformer that raises on the batch holding sample ``row`` (picklable: top level)."""

    def __init__(self, row: int) -> None:
        self.row = row

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if (x[:, 0] == 10 * self.row).any():  # see _files.rows
            raise ValueError(f"bad row {self.row}")
        return x


@pytest.mark.both_backends  # the hand-off to the consumer's loop
async def test_same_batches_as_in_process_exactly_once_and_aligned(source: Path) -> None:
    kw: dict[str, Any] = {"batch_size": 7, "shuffle": True, "seed": 3, "chunk_size": 32}
    before = await asnapshot()
    shm = _shm()
    with anyio.fail_after(DEADLINE):
        async with AsyncHDF5DataLayer(source, process=True, **kw) as layer:
            async with AsyncHDF5DataLayer(source, **kw) as ref:
                for epoch in range(3):
                    got = [b async for b in layer]
                    want = [b.indices.copy() async for b in ref]
                    check_epoch(got, N, 7, epoch)  # exactly once, data and label aligned
                    for b, w in zip(got, want, strict=True):
                        np.testing.assert_array_equal(b.indices, w)
                    assert layer.epoch == epoch + 1
                stats = layer.stats
                assert stats.batches == len(got) * 3 and stats.samples == 3 * N
                assert stats.bytes_read > 0 and stats.chunks_read > 0  # the helper's counters
                assert set(stats.read_paths) == {"data", "label"}
        del got, b  # a batch keeps its slot's mapping (and descriptor) until it goes
        await aassert_released(before)
    no_helper_left()
    assert _shm() <= shm  # nothing named in /dev/shm


@pytest.mark.both_backends  # the hand-off to the consumer's loop
async def test_batches_kept_by_the_consumer_stay_valid(source: Path) -> None:
    async with AsyncHDF5DataLayer(source, batch_size=5, process=True) as layer:
        with anyio.fail_after(DEADLINE):
            kept = [b async for b in layer]  # every batch held: more than the ring's slots
    check_exactly_once(_pairs(kept), N)
    for b in kept:
        np.testing.assert_array_equal(b["label"], b.indices)


@pytest.mark.both_backends  # the hand-off to the consumer's loop
async def test_stream_and_epoch_ends(source: Path) -> None:
    with anyio.fail_after(DEADLINE):
        async with AsyncHDF5DataLayer(source, batch_size=32, process=True) as layer:
            it = layer.stream()
            seen = []
            async for b in it:
                seen.append(b.indices)
                if sum(map(len, seen)) >= 3 * N:
                    break
            assert layer.epoch >= 2
            assert all(len(i) == 32 for i in seen)


async def test_resume_is_exact(source: Path) -> None:
    kw: dict[str, Any] = {"batch_size": 6, "shuffle": True, "seed": 5, "chunk_size": 32}
    with anyio.fail_after(DEADLINE):
        async with AsyncHDF5DataLayer(source, **kw) as ref:
            [b async for b in ref]
            want = [b.indices.copy() async for b in ref]  # epoch 1
        async with AsyncHDF5DataLayer(source, process=True, **kw) as layer:
            [b async for b in layer]
            k = 0
            async for b in layer:
                np.testing.assert_array_equal(b.indices, want[k])
                k += 1
                if k == 2:
                    state = layer.state_dict()  # the two batches handed over, no more
                    break
        assert state["epoch"] == 1 and state["batches"] == 2
        resumed = AsyncHDF5DataLayer(source, process=True, **kw)
        resumed.load_state_dict(state)
        async with resumed:
            rest = [b.indices async for b in resumed]
        assert [list(r) for r in rest] == [list(w) for w in want[2:]]
        # Between epochs, on the open layer too.
        async with AsyncHDF5DataLayer(source, process=True, **kw) as layer:
            layer.load_state_dict(state)
            rest = [b.indices async for b in layer]
            assert [list(r) for r in rest] == [list(w) for w in want[2:]]
            layer.set_epoch(1)
            again = [b.indices async for b in layer]
            assert [list(r) for r in again] == [list(w) for w in want]


@pytest.mark.both_backends  # the hand-off to the consumer's loop
async def test_errors_come_back_with_their_type(source: Path, tmp_path: Path) -> None:
    layer = AsyncHDF5DataLayer(
        source, batch_size=10, transformers=[("data", Fails(33))], process=True
    )
    with anyio.fail_after(DEADLINE):
        async with layer:
            for epoch in range(2):
                got = []
                with pytest.raises(TransformError, match=r"top 'data'.*bad row 33") as info:
                    async for b in layer:
                        got.append(b.indices)
                assert [len(g) for g in got] == [10, 10, 10]  # those before it, and only they
                # The transformer's own exception is chained, as in-process (issue 39, item 12).
                cause = info.value.__cause__
                assert type(cause) is ValueError and str(cause) == "bad row 33"
                if sys.version_info >= (3, 11):
                    assert "helper process" in "".join(info.value.__notes__)
                    assert "in __call__" in "".join(cause.__notes__)  # where it was raised
                assert layer.epoch == epoch + 1
    missing = AsyncHDF5DataLayer([str(tmp_path / "nope.h5")], batch_size=4, process=True)
    with pytest.raises(type(_in_process_error(missing.paths)), match=r"nope\.h5"):
        async with missing:
            pass
    no_helper_left()


def _in_process_error(paths: list[str]) -> BaseException:
    try:
        with HDF5DataLayer(paths, batch_size=4):
            pass
    except Exception as exc:
        return exc
    raise AssertionError("no error")


@pytest.mark.both_backends  # the hand-off to the consumer's loop
async def test_break_cancel_and_close_leave_nothing(source: Path) -> None:
    before = await asnapshot()
    shm = _shm()
    with anyio.fail_after(DEADLINE):
        async with AsyncHDF5DataLayer(source, batch_size=4, process=True) as layer:
            async for _ in layer:
                break
            check_epoch([b async for b in layer], N, 4, 1)
            with anyio.move_on_after(0.05):
                async for _ in layer:
                    await anyio.sleep(0.01)
            check_epoch([b async for b in layer], N, 4, 3)
        await aassert_released(before)
    no_helper_left()
    assert _shm() <= shm


def test_sync_facade(source: Path) -> None:
    with HDF5DataLayer(source, batch_size=9, shuffle=True, seed=2, process=True) as layer:
        for epoch in range(2):
            check_epoch(list(layer), N, 9, epoch)
        assert layer.stats.batches > 0
    no_helper_left()


def test_an_unpicklable_transformer_is_named_at_construction(source: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"transformers\[1\] for top 'label'"):
        AsyncHDF5DataLayer(
            source,
            batch_size=4,
            transformers=[("data", T.Scale(0.5)), ("label", lambda x: x)],
            process=True,
        )


def test_the_helper_exits_when_the_layer_process_is_killed(source: Path, tmp_path: Path) -> None:
    script = tmp_path / "victim.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys
            from asynchdf5 import HDF5DataLayer
            if __name__ == "__main__":
                with HDF5DataLayer({str(source)!r}, batch_size=4, process=True) as layer:
                    for batch in layer:
                        print("ready", flush=True)
                        sys.stdin.read()  # wait to be killed
            """
        )
    )
    root = Path(__file__).resolve().parent.parent
    env = os.environ | {"PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        helpers = [
            p for p in psutil.Process(proc.pid).children() if "asynchdf5._serve" in p.cmdline()
        ]
        assert len(helpers) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(DEADLINE)
        _, alive = psutil.wait_procs(helpers, timeout=DEADLINE)
        assert not alive
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.stdout.close()


def test_a_helper_that_dies_is_a_read_error(source: Path) -> None:
    with HDF5DataLayer(source, batch_size=4, process=True) as layer:
        (helper,) = helper_processes()
        helper.kill()
        with pytest.raises(ReadError, match="helper process"):
            for _ in layer:
                time.sleep(0.01)
    no_helper_left()


#: The environment variable that marks the processes one test started, and their helpers.
TAG = "ASYNCHDF5_TEST_TAG"


def _tagged_helpers(tag: str) -> set[int]:
    """The helper processes, anywhere on the machine, whose environment carries ``TAG=tag``: a
    killed layer's helper is no child of ours any more, and other tests (other pytest workers)
    run helpers of their own meanwhile. A helper inherits its layer's environment."""
    out = set()
    for p in psutil.process_iter(["cmdline"]):
        if "asynchdf5._serve" not in (p.info["cmdline"] or []):
            continue
        with contextlib.suppress(psutil.Error):
            if p.environ().get(TAG) == tag:
                out.add(p.pid)
    return out


@pytest.mark.timeout(300)  # a loaded machine starts each trial's helper slowly
def test_double_ctrl_c_exits_and_the_helper_goes_too(
    source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = Path(__file__).resolve().parent.parent
    tag = f"{os.getpid()}-{uuid.uuid4().hex}"
    env = os.environ | {"PYTHONPATH": str(root), TAG: tag}
    with monkeypatch.context() as patch:  # the tag reaches a helper: the last check can fail
        patch.setenv(TAG, tag)
        with HDF5DataLayer(source, batch_size=50, process=True):
            assert len(_tagged_helpers(tag)) == 1
    # slow-free: a 30 ms wait in the finalizer that gives a slot back, where a Ctrl-C used to
    # be printed as "Exception ignored" and the loop went on (issue 39, item 7). The runs go
    # side by side, two of each kind, as test_sync's trials do (each starts a helper per trial:
    # most of its time).

    def run(extra: list[str]) -> None:
        args = [source, 3 if extra else 4, 0, "process", *extra]
        trials, _ = double_sigint_trials(args, env, timeout=280)
        assert trials == ["ok"] * (3 if extra else 4), trials

    runs = [extra for extra in ([], ["slow-free"]) for _ in range(2)]
    with ThreadPoolExecutor(len(runs)) as pool:
        for done in [pool.submit(run, extra) for extra in runs]:
            done.result()
    deadline = time.monotonic() + 10
    while _tagged_helpers(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _tagged_helpers(tag)


def test_torch_adapter_with_num_workers_0(source: Path) -> None:
    torch_data = pytest.importorskip("torch.utils.data")
    from asynchdf5.torch import HDF5IterableDataset

    with HDF5IterableDataset(source, batch_size=8, shuffle=True, seed=1, process=True) as ds:
        loader = torch_data.DataLoader(ds, batch_size=None, num_workers=0)
        for _ in range(2):
            labels = [b["label"].numpy().copy() for b in loader]
            check_exactly_once(labels, N)
    no_helper_left()


async def test_device_batches_are_uploaded_in_the_layers_process(
    source: Path, fake_cupy: FakeCupy
) -> None:
    # A transformer that could not be pickled is fine here: with a device it runs in this
    # process, on the device, after the upload.
    kw: dict[str, Any] = {
        "batch_size": 7,
        "shuffle": True,
        "seed": 4,
        "chunk_size": 32,
        "transformers": [("data", lambda x: x * 2)],
        "device": "cuda",
    }
    with anyio.fail_after(DEADLINE):
        async with AsyncHDF5DataLayer(source, process=True, **kw) as layer:
            async with AsyncHDF5DataLayer(source, **kw) as ref:
                for epoch in range(2):
                    got = [b async for b in layer]
                    want = [b async for b in ref]
                    for b, w in zip(got, want, strict=True):
                        assert isinstance(b["data"], FakeArray)
                        np.testing.assert_array_equal(b.indices, w.indices)
                        np.testing.assert_array_equal(host_copy(b["data"]), host_copy(w["data"]))
                        np.testing.assert_array_equal(host_copy(b["label"]), b.indices)
                    assert layer.epoch == epoch + 1
    no_helper_left()


def test_a_script_without_a_main_guard_is_refused_not_repeated(
    source: Path, tmp_path: Path
) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from asynchdf5 import HDF5DataLayer
            with HDF5DataLayer({str(source)!r}, batch_size=4, process=True) as layer:
                print(sum(b.size for b in layer))
            """
        )
    )
    root = Path(__file__).resolve().parent.parent
    env = os.environ | {"PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=DEADLINE
    )
    assert out.returncode == 1
    assert "ConfigurationError" in out.stderr and "__main__" in out.stderr


async def _after_load(layer: AsyncHDF5DataLayer, state: dict[str, Any], mode: str) -> list[Any]:
    """The open ``layer`` loads ``state`` and is iterated at once in ``mode``: the indices of
    its next batches (a stream: three epochs' worth)."""
    layer.load_state_dict(state)
    if mode == "epoch":
        return [b.indices.copy() async for b in layer]
    out: list[Any] = []
    async for b in layer.stream():
        out.append(b.indices.copy())
        if sum(map(len, out)) >= 3 * N:
            break
    return out


@pytest.mark.parametrize(("saved", "then"), [("epoch", "stream"), ("stream", "epoch")])
async def test_a_state_loaded_then_another_mode_resumes_as_in_process(
    source: Path, saved: str, then: str
) -> None:
    """A state loaded in one mode, then iterated in the other at once (a new run in the helper):
    the helper starts from that state, not from the epoch's start."""
    kw: dict[str, Any] = {"batch_size": 6, "shuffle": True, "seed": 5, "chunk_size": 32}
    with anyio.fail_after(DEADLINE):
        async with AsyncHDF5DataLayer(source, **kw) as ref:
            [b async for b in ref]
            it = ref.__aiter__() if saved == "epoch" else ref.stream()
            for _ in range(3):
                await it.__anext__()
            state = ref.state_dict()
            await it.aclose()
        assert state["epoch"] == 1 and state["mode"] == saved
        runs = []
        for process in (False, True):
            async with AsyncHDF5DataLayer(source, process=process, **kw) as layer:
                [b async for b in layer]
                runs.append(await _after_load(layer, state, then))
    want, got = runs
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


async def test_streams_as_in_process(tmp_path: Path) -> None:
    """Several named streams with process=True: the same batches, each row's stream said, and
    the per-stream counts, as in-process; a saved state resumes in the helper."""
    from asynchdf5 import Stream

    from .test_streams import write_streams

    files = write_streams(tmp_path, ((50, 30), (40,)))
    streams = {"a": Stream(files[0], weight=0.6), "b": Stream(files[1], weight=0.4)}
    kw: dict[str, Any] = {"batch_size": 10, "shuffle": True, "seed": 2, "chunk_size": 16}
    runs = []
    with anyio.fail_after(DEADLINE):
        for process in (False, True):
            async with AsyncHDF5DataLayer(streams, process=process, **kw) as layer:
                assert layer.stream_names == ("a", "b")
                got = [
                    (b.indices.copy(), np.array(b.streams)) for _ in range(2) async for b in layer
                ]
                state = layer.state_dict()
                runs.append((got, dict(layer.stats.stream_samples), state["streams"]))
    (want, want_counts, want_at), (got, counts, at) = runs
    assert len(got) == len(want)
    for (gi, gs), (wi, ws) in zip(got, want, strict=True):
        np.testing.assert_array_equal(gi, wi)
        np.testing.assert_array_equal(gs, ws)
    assert counts == want_counts and at == want_at


# --- a native cancel (asyncio's Ctrl-C) while the helper starts or a batch is uploaded ---------


async def test_a_native_cancel_while_the_helper_starts_leaves_no_helper(
    source: Path, anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel lands while the helper is being started (in a worker thread): the helper
    started is killed and reaped before the task ends cancelled, never left running."""
    if anyio_backend != "asyncio":
        pytest.skip("Task.cancel is asyncio's")
    import asynchdf5._process._parent as parent

    loop = asyncio.get_running_loop()
    users: list[asyncio.Task[str]] = []
    started: list[subprocess.Popen[bytes]] = []
    real = parent.spawn

    def spawn(*args: Any) -> subprocess.Popen[bytes]:
        started.append(real(*args))
        loop.call_soon_threadsafe(users[0].cancel)  # lands while this thread runs
        time.sleep(0.05)
        return started[-1]

    monkeypatch.setattr(parent, "spawn", spawn)

    async def user() -> str:
        async with AsyncHDF5DataLayer(source, batch_size=10, process=True):
            pass
        return "the cancellation was lost"

    users.append(loop.create_task(user()))
    try:
        with anyio.fail_after(DEADLINE):
            with pytest.raises(asyncio.CancelledError):
                await users[0]
        assert len(started) == 1
        assert started[0].returncode is not None  # reaped before the task ended
    finally:
        for proc in started:  # (the old code left it running)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    no_helper_left()


async def test_a_native_cancel_while_a_batch_is_uploaded_waits_for_the_upload(
    source: Path, anyio_backend: str, monkeypatch: pytest.MonkeyPatch, fake_cupy: FakeCupy
) -> None:
    """With a device, the helper's host batches are uploaded in a worker thread of this
    process, by the layer's delivery: a cancel that lands meanwhile ends the task only once
    the upload is over, never while it still uses the delivery the close releases."""
    if anyio_backend != "asyncio":
        pytest.skip("Task.cancel is asyncio's")
    import asynchdf5._delivery._cuda as cuda
    import asynchdf5._process._runs as runs

    loop = asyncio.get_running_loop()
    users: list[asyncio.Task[str]] = []
    events: list[str] = []
    upload, close = runs.Uploader.upload, cuda.CudaDelivery.close

    def slow_upload(self: runs.Uploader, items: list[Any]) -> list[Any]:
        if not events:
            loop.call_soon_threadsafe(users[0].cancel)  # lands while this thread runs
            time.sleep(0.5)  # longer than the close of the helper takes
        out = upload(self, items)
        events.append("uploaded")
        return out

    def closing(self: cuda.CudaDelivery) -> None:
        events.append("delivery closed")
        close(self)

    monkeypatch.setattr(runs.Uploader, "upload", slow_upload)
    monkeypatch.setattr(cuda.CudaDelivery, "close", closing)

    async def user() -> str:
        async with AsyncHDF5DataLayer(source, batch_size=10, process=True, device="cuda") as layer:
            async for _batch in layer:
                pass
        await asyncio.sleep(5)
        return "the cancellation was lost"

    users.append(loop.create_task(user()))
    with anyio.fail_after(DEADLINE):
        with pytest.raises(asyncio.CancelledError):
            await users[0]
    assert events[:2] == ["uploaded", "delivery closed"], events
    no_helper_left()


async def test_a_batch_dropped_where_its_reader_holds_its_lock_never_blocks(source: Path) -> None:
    """The garbage collector runs a batch's finalizer (the slot given back) at any allocation,
    in any thread: also in one inside a section of the reader that holds its lock (found by
    the Ctrl-C sweep in tests/test_sync.py: a batch of a traceback's cycle collected inside
    ``ProcessReader._batch``). The old finalizer waited for that lock, and the thread (the
    bridge's loop) blocked for ever. Now the slot comes back at the next ask: the epoch goes on
    whole."""
    with anyio.fail_after(DEADLINE):
        async with AsyncHDF5DataLayer(source, batch_size=10, process=True) as layer:
            opened = layer._consumer.opened
            assert opened is not None
            lock = opened.reader._lock  # type: ignore[union-attr]  # the ProcessReader's
            got: list[Any] = []
            held: list[Any] = []
            async for batch in layer:
                got.append((batch.indices.copy(), batch["label"].copy(), batch.epoch))
                if not held:
                    held.append(batch)
                    del batch

                    def drop() -> None:
                        with lock:  # where the GC could run the finalizer
                            held.clear()

                    dropper = threading.Thread(target=drop, daemon=True)
                    dropper.start()
                    dropper.join(DEADLINE)
                    assert not dropper.is_alive(), "the finalizer blocked on the reader's lock"
    for indices, labels, epoch in got:
        np.testing.assert_array_equal(labels, indices)
        assert epoch == 0
    check_exactly_once([i for i, _, _ in got], N)
