"""Every benchmark runs at its ``--quick`` size, so that none rots: one subprocess runs them
all (``python -m benchmarks run all --quick``) under a deadline, and each must have written a
well-formed result file. Nothing here depends on how fast anything was.

That run takes about a minute, as long as a quarter of the rest of the suite: its tests are
marked ``quick_benchmarks``, left out of ``nox -s tests`` and run by ``nox -s bench_check``,
which CI runs after it (``.ci/run``). The other tests here run in both."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.registry import BENCHMARKS
from benchmarks.report import KEYS, markdown

ROOT = Path(__file__).resolve().parent.parent
#: Benchmarks that may skip here, with their reason recorded: no CUDA GPU; annbatch needs
#: Python >= 3.12.
MAY_SKIP = {"gpu", "annbatch"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "all", "--quick",
         "--out", str(out), "--data-dir", str(tmp / "data")],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc.stdout


@pytest.mark.slow
@pytest.mark.quick_benchmarks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_quick_result_is_well_formed(quick_run: tuple[Path, str], name: str) -> None:
    out, stdout = quick_run
    doc: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    assert set(KEYS) <= set(doc), sorted(set(KEYS) - set(doc))
    assert doc["benchmark"] == name and doc["quick"] is True and doc["error"] is None
    assert doc["command"][:4] == ["python", "-m", "benchmarks", "run"]
    for fact in ("cpu", "logical_cpus", "ram_gib", "load_average", "git", "python", "versions"):
        assert doc["machine"][fact] not in (None, ""), fact
    assert f"## {name}" in stdout
    if doc["skipped"]:
        assert name in MAY_SKIP, doc["skipped"]
        return
    assert doc["figures"], doc["notes"]
    # A measurement that fails inside a benchmark is a note (the others still run): none may.
    failures = [n for n in doc["notes"] if "Error" in n or "failed" in n.lower()]
    assert not failures, failures
    for f in doc["figures"]:
        assert set(f) == {"name", "value", "unit"}, f
        assert isinstance(f["value"], float) and math.isfinite(f["value"]) and f["value"] > 0, f
        assert f["name"] and f["unit"], f


def test_list_names_every_benchmark() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "list"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=True,
    )  # fmt: skip
    assert [line.split()[0] for line in proc.stdout.splitlines()] == list(BENCHMARKS)


def test_unknown_name_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "no-such-benchmark", "--quick"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode != 0 and "no-such-benchmark" in proc.stderr


def test_report_renders_result_files(tmp_path: Path) -> None:
    doc = {
        "benchmark": "x", "command": ["python", "-m", "benchmarks", "run", "x"], "quick": False,
        "started": "2026-01-01 00:00 UTC", "wall_s": 1.0, "params": {"n": 1}, "notes": ["n"],
        "machine": {"cpu": "c", "logical_cpus": 2, "usable_cpus": 2, "ram_gib": 1.0,
                    "load_average": [0.1, 0.2, 0.3], "git": "abc", "versions": {}},
        "figures": [{"name": "rate", "value": 1234.5, "unit": "samples/s"}],
        "skipped": None, "error": None,
    }  # fmt: skip
    (tmp_path / "x.json").write_text(json.dumps(doc))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "report", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=True,
    )  # fmt: skip
    assert proc.stdout.strip() == markdown([doc]).strip()
    assert "| rate | 1,234 | samples/s |" in proc.stdout


def test_no_memory_controller_is_a_reason_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import cgroups

    monkeypatch.setattr(cgroups, "V1_ROOT", tmp_path / "v1")
    monkeypatch.setattr(cgroups, "V2_ROOT", tmp_path / "v2")
    made = cgroups.make("asynchdf5-ooc-test", 2**20)
    assert isinstance(made, str)
    assert "no memory cgroup" in made


def test_step_cost_interleaves_every_loader_step_with_a_free_one() -> None:
    """``step-cost`` takes the loader's steps and as many free ones in alternating blocks
    (ABBA), each step once, so that both kinds see the machine's drift alike."""
    from benchmarks.step_cost import drive, round_ratios, rounds
    from benchmarks.step_cost_loaders import free_batches

    assert list(rounds(60, 25)) == [(0, 25, True), (25, 25, False), (50, 10, True)]
    clock, free = drive(free_batches(), 11, 100, 4)
    for c in (clock, free):
        assert (c.step_s > 0).all() and c.wall_s > 0 and c.block_cpu_s > 0
    assert len(round_ratios(clock, free, 11, 4)) == 3


def test_step_cost_compares_steps_taken_on_the_same_cpu() -> None:
    """The same-CPU ratio compares each CPU's loader steps with the free steps on that CPU only
    (virtual CPUs may run at different speeds), weighted by the loader's steps there, and
    leaves out a CPU where either kind has too few steps and steps that moved."""
    import sys

    import numpy as np

    from benchmarks.step_clock import Clock, current_cpu

    if sys.platform.startswith("linux"):
        assert current_cpu() >= 0
    loader, free = Clock(40), Clock(40)
    # CPU 0 runs at half CPU 1's speed; the loader's steps cost nothing beyond the free ones'.
    loader.cpu[:] = [0] * 30 + [1] * 10
    free.cpu[:] = [0] * 10 + [1] * 25 + [-1] * 5
    loader.step_s[:] = np.where(loader.cpu == 0, 2.0, 1.0)
    free.step_s[:] = np.where(free.cpu == 0, 2.0, 1.0)
    assert float(np.median(loader.step_s)) / float(np.median(free.step_s)) == 2.0
    assert loader.same_cpu_ratio(free) == 1.0
    loader.step_s[loader.cpu == 1] = 1.5  # 1.5 x on CPU 1: a quarter of the loader's steps
    assert loader.same_cpu_ratio(free) == 0.75 * 1.0 + 0.25 * 1.5
    free.cpu[:12] = -1  # CPU 0 left with 8 free steps: compared on CPU 1 only
    assert loader.same_cpu_ratio(free) == 1.5
    free.cpu[:] = -1
    assert np.isnan(loader.same_cpu_ratio(free))
