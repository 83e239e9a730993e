"""Subprocess entry point of one measurement: ``python -m benchmarks._worker JOB.json RESULT.json``.

A module of its own so that :mod:`benchmarks.measure` is imported under its real name (not as
``__main__``), and the classes the measurements use are the ones the runner checks for.
"""

from __future__ import annotations

import sys

from benchmarks.measure import main

sys.exit(main(sys.argv[1:]))
