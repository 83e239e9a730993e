"""The out-of-core benchmark runs at its ``--quick`` size and reports every reader (no timing
is asserted: benchmarks never are)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.out_of_core import READERS

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quick_run_reports_every_reader(tmp_path: Path) -> None:
    out = tmp_path / "ooc.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.out_of_core",
            "--quick",
            "--data-dir",
            str(tmp_path),
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(out.read_text())
    assert set(figures["readers"]) == set(READERS)
    for name, r in figures["readers"].items():
        assert r["rate"] > 0, name
        assert r["cpu_s"] >= 0, name
        assert r["resident_before"] is None or 0 <= r["resident_before"] <= 1, name
    for name in ("layer_unshuffled", "layer_shuffled"):
        passes = figures["readers"][name]["passes"]
        assert len(passes) == 2, name
        assert all(0 <= p["mixing"]["ratio"] <= 1.5 for p in passes), name
    assert "| reader |" in proc.stdout
    # Every cgroup the run made is gone ("cgroup v1 /sys/fs/cgroup/memory/NAME, limit ...").
    for name, r in figures["readers"].items():
        if r["cgroup"].startswith("cgroup v"):
            assert not Path(r["cgroup"].split()[2].rstrip(",")).exists(), name


def test_no_memory_controller_is_a_reason_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import cgroups

    monkeypatch.setattr(cgroups, "V1_ROOT", tmp_path / "v1")
    monkeypatch.setattr(cgroups, "V2_ROOT", tmp_path / "v2")
    made = cgroups.make("asynchdf5-ooc-test", 2**20)
    assert isinstance(made, str)
    assert "no memory cgroup" in made
