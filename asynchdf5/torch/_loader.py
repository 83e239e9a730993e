"""torchdata's ``StatefulDataLoader``, checking at :meth:`~StatefulDataLoader.load_state_dict`
that the state comes from a loader with as many worker processes, and refusing at
:meth:`~StatefulDataLoader.state_dict` a state that cannot resume exactly.

torchdata keeps a loader's state in two shapes: without workers, the main process's iterator
(``_num_yielded``, the dataset's state); with workers, a snapshot holding one state per worker,
each counting the batches of that worker's run. A state of one shape loaded into a loader of the
other ends in torchdata's ``AssertionError`` at the next ``iter(loader)``, before the dataset is
asked anything (and under Lightning in "Please call iter(combined_loader) first"); between two
worker counts, in the workers. Here both are a :class:`~asynchdf5.ConfigurationError` when the
state is loaded, naming the count to resume with.

With ``in_order=False`` and several workers, torchdata hands batches over as they come and its
state does not say which were handed over (it warns that it gives no guarantee): a run resumed
from it repeats batches and loses others. Its :meth:`~StatefulDataLoader.state_dict` is a
:class:`~asynchdf5.ConfigurationError` here, at the first checkpoint instead of a wrong epoch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._errors import ConfigurationError

try:
    from torchdata.stateful_dataloader import StatefulDataLoader as _TorchdataLoader
except ImportError as exc:  # tested with torchdata hidden from the import system
    raise ImportError(
        "asynchdf5.torch.StatefulDataLoader needs torchdata, which is not installed: "
        'pip install ".[torch]" in the asynchdf5 checkout'
    ) from exc

__all__ = ["StatefulDataLoader", "check_loader_state", "saved_workers"]


def saved_workers(state: Mapping[str, Any]) -> int | None:
    """The ``num_workers`` of the StatefulDataLoader that saved ``state``, or None when it is
    not such a state (an empty one, which torchdata ignores, or another shape)."""
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, Mapping):
        main = snapshot.get("_main_snapshot")
        count = main.get("_num_workers") if isinstance(main, Mapping) else None
        if isinstance(count, int):
            return count
        workers = snapshot.get("_worker_snapshots")
        return len(workers) if isinstance(workers, Mapping) else None
    if "_num_yielded" in state:
        return 0
    return None


def check_loader_state(state: Mapping[str, Any], num_workers: int) -> None:
    """Raise :class:`~asynchdf5.ConfigurationError` unless ``state`` (a StatefulDataLoader's)
    can be loaded into a loader with ``num_workers`` worker processes."""
    saved = saved_workers(state)
    if saved is None or saved == num_workers:
        return
    raise ConfigurationError(
        f"this StatefulDataLoader state was saved by a loader with num_workers={saved}, and is "
        f"loaded into one with num_workers={num_workers}: "
        + (
            "a state without workers is the main process's position, "
            if saved == 0
            else "each worker's state counts the batches of that worker's run, "
        )
        + f"which only a loader with num_workers={saved} resumes; make the loader with "
        f"num_workers={saved} to resume from it"
    )


class StatefulDataLoader(_TorchdataLoader):  # type: ignore[misc]
    """torchdata's ``StatefulDataLoader`` (use it as that one: ``batch_size=None`` for the
    datasets of :mod:`asynchdf5.torch`), whose :meth:`load_state_dict` refuses a state saved
    with another ``num_workers`` with a :class:`~asynchdf5.ConfigurationError` naming the count
    to resume with, where torchdata's ends in an ``AssertionError`` at the next iteration, and
    whose :meth:`state_dict` refuses ``in_order=False`` with several workers (torchdata's state
    then repeats and loses batches)."""

    def state_dict(self) -> dict[str, Any]:
        """torchdata's state of this loader; a :class:`~asynchdf5.ConfigurationError` where it
        could not resume exactly (``in_order=False`` with several workers: see the module)."""
        workers = int(self.num_workers)
        if workers > 1 and not getattr(self, "in_order", True):
            raise ConfigurationError(
                f"a StatefulDataLoader with in_order=False and num_workers={workers} cannot "
                "save a state that resumes exactly: it hands batches over as they come, and its "
                "state does not say which ones it handed over (a resumed run repeats batches and "
                "loses others); make the loader with in_order=True (the default) to save states"
            )
        state: dict[str, Any] = super().state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict`` (from :meth:`state_dict`), checked first (see the class)."""
        check_loader_state(state_dict, int(self.num_workers))
        super().load_state_dict(state_dict)
