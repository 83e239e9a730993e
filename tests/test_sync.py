"""The sync facade under Ctrl-C: a second interrupt during the close never leaves a hang.

Each trial is a process iterating ``with HDF5DataLayer(...) as layer: for batch in layer``
(``tests/_double_sigint.py``); it gets two SIGINTs a random 0.2-8 ms apart at a random moment of
the loop, and must exit as an uncaught ``KeyboardInterrupt`` exits (killed by SIGINT) within
its deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ._files import write_source

ROOT = Path(__file__).resolve().parents[1]
TRIALS = 160
RUNNERS = 4  # trial runners side by side, half on each backend: a busy machine is where it hung


@pytest.mark.timeout(180)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the trials fork and send SIGINT")
def test_a_double_ctrl_c_always_exits(tmp_path: Path) -> None:
    source = write_source(tmp_path)[0]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def runner(i: int) -> list[str]:
        backend = ("asyncio", "trio")[i % 2]
        args = [source, backend, TRIALS // RUNNERS, i]
        out = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "_double_sigint.py"), *map(str, args)],
            capture_output=True,
            text=True,
            env=env,
            timeout=170,
            check=False,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return [f"{backend}: {line}" for line in out.stdout.split()]

    with ThreadPoolExecutor(RUNNERS) as pool:
        outcomes = Counter(o for lines in pool.map(runner, range(RUNNERS)) for o in lines)
    assert sum(outcomes.values()) == TRIALS
    assert set(outcomes) <= {"asyncio: ok", "trio: ok"}, outcomes
