"""JAX: a layer's batches as global ``jax.Array``\\ s, each process reading its own share.

:class:`Loader` iterates an open sync layer and hands over every batch as a dict of global
``jax.Array``\\ s laid out with the user's sharding (``jax.make_array_from_process_local_data``),
put on the devices ahead of the training step. :func:`layer` makes an
:class:`~asynchdf5.HDF5DataLayer` whose shard is this JAX process's (``jax.process_index()`` of
``jax.process_count()``) and whose batches all have one shape (``drop_last=True``), so a
``jit``-compiled step compiles once. Install with ``pip install ".[jax]"`` (in the asynchdf5
checkout); ``import asynchdf5`` never imports JAX.

How it works, for whoever carries it on:

* **Two stages of prefetch**, as grain's ``device_put`` does: the layer's own pipeline reads,
  gathers and transforms host batches ahead (its ``prefetch``); the loader keeps ``prefetch``
  batches already handed to JAX (transfers are asynchronous: dispatched, not awaited), so the
  step never waits for a copy to the device.
* **Exact state with batches ahead**: the layer counts the batches handed to the loader, which
  is ahead of the step; so the loader takes the layer's state when it takes each batch, and
  :meth:`Loader.state_dict` is the state of the last batch it *yielded*.
* **Dtypes**: with ``jax_enable_x64`` off (JAX's default) a 64-bit top would be narrowed by JAX
  without a word; the loader narrows it itself and says so once per top with a
  :class:`NarrowingWarning`. Turn x64 on to keep them.
* **Host memory**: on the CPU backend JAX may alias a batch's NumPy memory; the array it keeps
  refers to that memory, and the layer reuses a batch buffer only once nothing refers to it.
"""

from __future__ import annotations

import sys
import warnings
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

try:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
except ImportError as exc:  # pragma: no cover - tested where JAX is missing
    raise ImportError(
        'asynchdf5.jax needs JAX, which is not installed: pip install ".[jax]" '
        "in the asynchdf5 checkout"
    ) from exc

from ._config import HDF5Properties
from ._errors import ConfigurationError, StateError
from ._hdf5 import HDF5DataLayer
from ._layer import LayerBase
from ._ragged import check_dense
from ._sources import SourceLike

#: ``jax.make_array_from_process_local_data`` takes a pytree of arrays (one call for all of a
#: batch's tops) from JAX 0.7.1 on; before, one call per top.
_PUT_TAKES_TREES = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit()) >= (0, 7, 1)

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover
    from typing_extensions import Unpack

__all__ = ["Loader", "NarrowingWarning", "batch_sharding", "layer"]


class NarrowingWarning(UserWarning):
    """A top's 64-bit dtype is narrowed to 32 bits because JAX's ``jax_enable_x64`` is off."""


def layer(source: SourceLike, **properties: Unpack[HDF5Properties]) -> HDF5DataLayer:
    """An :class:`~asynchdf5.HDF5DataLayer` for JAX: this process's share, fixed batch shapes.

    ``rank`` and ``world_size`` default to ``jax.process_index()`` and ``jax.process_count()``
    (call ``jax.distributed.initialize()`` first, where there are several processes), and
    ``drop_last`` to ``True`` (every batch has ``batch_size`` rows: one compilation of a
    ``jit``-ed step). Other properties are the layer's; ``shuffle=True`` needs a ``seed``
    shared by every process.
    """
    properties.setdefault("rank", jax.process_index())
    properties.setdefault("world_size", jax.process_count())
    properties.setdefault("drop_last", True)
    return HDF5DataLayer(source, **properties)


def batch_sharding(devices: Any = None) -> NamedSharding:
    """Batches split along their first axis over ``devices`` (all of JAX's, by default)."""
    mesh = Mesh(np.asarray(devices if devices is not None else jax.devices()), ("batch",))
    return NamedSharding(mesh, PartitionSpec("batch"))  # type: ignore[no-untyped-call]


class Loader:
    """A layer's batches as dicts of global ``jax.Array``, put on the devices ahead.

    Each ``iter(loader)`` is one epoch of the layer. Every process makes its loader over its
    own layer (see :func:`layer`) with the same ``sharding``; a batch's global array has
    ``batch_size * world_size`` rows, this process's being its layer's batch.

    Parameters
    ----------
    layer : HDF5DataLayer or MemoryDataLayer
        An open sync layer (``with layer:``), whose ``rank`` and ``world_size`` are this JAX
        process's.
    sharding : jax.sharding.Sharding, optional
        How every top's global array is laid out (the same for all tops); by default split
        along the batch axis over all devices.
    prefetch : int
        Batches kept on their way to the devices ahead of the one yielded (>= 1).

    Raises
    ------
    ConfigurationError
        The layer's shard is not this process's, or ``prefetch < 1``; at the first batch, a
        ragged or sparse top that no transformer made dense (a global ``jax.Array`` is dense
        and, under ``jit``, of one shape: ``transforms.Pad(0, length=n)`` or
        ``transforms.Densify()``).
    """

    def __init__(self, layer: LayerBase, sharding: Any = None, *, prefetch: int = 2) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigurationError(f"prefetch must be an int >= 1, not {prefetch!r}")
        rank, world = jax.process_index(), jax.process_count()
        if (layer.rank, layer.world_size) != (rank, world):
            raise ConfigurationError(
                f"the layer reads shard {layer.rank} of {layer.world_size}, but this is JAX "
                f"process {rank} of {world}: make it with asynchdf5.jax.layer(...), or pass "
                "rank=jax.process_index(), world_size=jax.process_count()"
            )
        self.layer = layer
        self.sharding = sharding if sharding is not None else batch_sharding()
        self.prefetch = prefetch
        self._state: dict[str, Any] | None = None  # after the last batch yielded
        self._warned: set[str] = set()
        self._kept: dict[np.dtype[Any], np.dtype[Any]] = {}  # dtype -> what JAX keeps of it
        self._live = False

    def __len__(self) -> int:
        """Batches of the next epoch (every process has as many)."""
        return len(self.layer)

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        """One epoch of global arrays, ``prefetch`` of them on their way ahead."""
        if self._live:
            raise StateError("this loader is already iterating an epoch")
        self._state, self._live = None, True
        ahead: deque[tuple[dict[str, jax.Array], dict[str, Any]]] = deque()
        batches = iter(self.layer)
        try:
            for batch in batches:
                ahead.append((self._put(batch), self.layer.state_dict()))
                if len(ahead) > self.prefetch:
                    arrays, self._state = ahead.popleft()
                    yield arrays
            while ahead:
                arrays, self._state = ahead.popleft()
                yield arrays
            self._state = None  # the epoch is over: the layer's state says so
        finally:
            self._live = False
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def _put(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """The batch's tops as global arrays, in one ``make_array_from_process_local_data``
        call for all of them (in one process, one batched ``device_put``: JAX's dispatch per
        call is most of what this costs the training thread)."""
        world = jax.process_count()
        local, shapes = {}, {}
        for name, array in batch.items():
            check_dense(name, array, "asynchdf5.jax.Loader")
            a = np.asarray(array)
            kept = self._kept.get(a.dtype)
            if kept is None:
                kept = self._kept[a.dtype] = jax.dtypes.canonicalize_dtype(jnp.dtype(a.dtype))
            if kept != a.dtype:
                if name not in self._warned:
                    self._warned.add(name)
                    warnings.warn(
                        f"top {name!r} is {a.dtype}, which JAX narrows to {kept} with "
                        "jax_enable_x64 off: jax.config.update('jax_enable_x64', True) keeps it",
                        NarrowingWarning,
                        stacklevel=3,
                    )
                a = a.astype(kept)
            local[name] = a
            shapes[name] = (a.shape[0] * world, *a.shape[1:])
        put = jax.make_array_from_process_local_data  # untyped in JAX
        if _PUT_TAKES_TREES:
            out: dict[str, jax.Array] = put(self.sharding, local, shapes)  # type: ignore[no-untyped-call]
            return out
        return {n: put(self.sharding, a, shapes[n]) for n, a in local.items()}  # type: ignore[no-untyped-call]

    def state_dict(self) -> dict[str, Any]:
        """Where the training loop is: the layer's state after the last batch yielded (never
        those put on the devices ahead); plain values, JSON-ready (save it beside the model's
        with Orbax's ``JsonSave``)."""
        if self._state is not None:
            return self._state
        return self.layer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the next batch yielded is the one after the saved one."""
        if self._live:
            raise StateError("load_state_dict during an epoch: finish or leave it first")
        self._state = None
        self.layer.load_state_dict(state)
