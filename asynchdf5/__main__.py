"""``python -m asynchdf5``: the command line (see :mod:`asynchdf5._cli`)."""

from __future__ import annotations

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
