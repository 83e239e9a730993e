"""``python -m benchmarks.many_files --quick`` runs to the end (so that it never rots) and
writes its results; nothing here depends on how fast it was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_many_files_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "many.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.many_files",
            "--quick",
            "--data-dir",
            str(tmp_path),
            "--output",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["files"] == 500
    assert set(result["results"]) == {
        f"{source}, {how}"
        for source in ("one file", "500 files")
        for how in ("default", "streaming")
    }
    for r in result["results"].values():
        assert r["open_s"] > 0 and r["first_batch_s"] > 0
        assert len(r["samples_per_s"]) == 2
    assert "500 files, streaming" in run.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["many.json"]  # its data removed
