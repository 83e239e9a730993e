"""What Lightning needs to be told about these datasets.

Lightning warns, for every ``IterableDataset`` that has ``__len__``, that the length "could be
inaccurate if each worker is not configured independently" (``has_len_all_ranks`` in
``lightning.pytorch.utilities.data``, on every ``fit``). For these datasets it is accurate by
construction: each rank's epoch has the same number of batches, and DataLoader workers split
that rank's batch plan among themselves, so ``len()`` is the batches the loader yields whatever
``num_workers``. Lightning has no way to be told so but a warnings filter, and the warning is a
plain ``UserWarning``; so making a dataset installs a filter for that one message, raised from
that one Lightning module, and nothing else (another IterableDataset in the same process loses
the same warning, which says nothing about asynchdf5's).
"""

from __future__ import annotations

import warnings

#: The start of Lightning's message (a regular expression, matched at the message's start).
LEN_WARNING = r"Your `IterableDataset` has `__len__` defined"
#: The modules it is raised from: the ``lightning`` package and the standalone one.
LEN_WARNING_MODULES = r"(lightning\.pytorch|pytorch_lightning)\.utilities\.data"


def quiet_len_warning() -> None:
    """Ignore Lightning's warning about ``__len__`` of an ``IterableDataset`` (see the module's
    docstring). Idempotent: the filter is moved to the front, never duplicated."""
    warnings.filterwarnings(
        "ignore", message=LEN_WARNING, category=UserWarning, module=LEN_WARNING_MODULES
    )
