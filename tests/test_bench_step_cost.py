"""``python -m benchmarks.step_cost --quick`` runs to the end with every loader, in its own
process as a user runs it (the figures are not checked: timing is not a test's business)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_quick_run(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    out = tmp_path / "step_cost.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.step_cost", "--quick", "--data-dir", str(tmp_path),
         "--steps", "20", "--output", str(out), "--timeout", "120"],
        capture_output=True,
        text=True,
        timeout=230,
        cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    result = json.loads(out.read_text())
    loaders = ["free", "layer", "async", "torch", "dataloader", "shm", "process", "async_process",
               "torch_process"]  # fmt: skip
    assert [r["loader"] for r in result["runs"]] == loaders
    for run in result["runs"]:
        assert "error" not in run, run
        assert run["wall_s"] > 0 and run["median_ratio"] > 0
    table = proc.stdout
    assert "| median step ÷ free |" in table
    for name in loaders:
        assert f"| {name} |" in table
