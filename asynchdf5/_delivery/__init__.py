"""The delivery seam: where batches go, and the last work done on them on the way.

A :class:`Delivery` turns the batches the batcher cut into the arrays the consumer receives:
host NumPy arrays (:class:`HostDelivery`), or CuPy arrays uploaded from pinned memory on the
layer's own CUDA stream (:class:`CudaDelivery`). It runs the transformer chain where the arrays
are, and hands each batch over in the consumer's thread. Nothing above this seam knows which.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Protocol

from .._batch import Batch
from .._catalog import TopInfo
from .._specs import GroupSpec
from .._stats import GatherStats
from ._cuda import CudaDelivery, DeviceMemoryStats
from ._device import INSTALL_HINT, parse_device
from ._host import BatchBuffers, BatchMemory, HostDelivery, line_offset

if TYPE_CHECKING:  # a type only: the configuration imports this package (parse_device)
    from .._config import LayerConfig

__all__ = [
    "INSTALL_HINT",
    "BatchBuffers",
    "BatchMemory",
    "CudaDelivery",
    "Delivery",
    "DeviceMemoryStats",
    "HostDelivery",
    "line_offset",
    "make_delivery",
    "parse_device",
]


class Delivery(Protocol):
    """Where batches go (host memory, a CUDA device)."""

    #: The most batches gathered in one go, and handed to the consumer as one group.
    group_batches: int

    @property
    def runs_user_code(self) -> bool:
        """Whether :meth:`make` runs code that is not asynchdf5's (transformers, a device
        library): the gather thread then keeps the consumer's priority, since thread pools such
        code starts from it would inherit a lowered one (:mod:`asynchdf5._priority`)."""
        ...

    @property
    def concurrent(self) -> bool:
        """Whether :meth:`make` may run on two threads at once, for two groups (else one thread
        makes every group, and may hand part of its copying to the ``helper`` it is given)."""
        ...

    @property
    def per_batch(self) -> bool:
        """Whether each batch goes to the consumer as soon as :meth:`make` has it, rather than
        with its group: where transformers run, so that one slow call does not hold back the
        batches made before it (without them, a group's batches are ready together)."""
        ...

    def check(self, tops: Mapping[str, TopInfo]) -> None:
        """Raise :class:`~asynchdf5.SchemaError` for a top this delivery cannot carry, or
        :class:`~asynchdf5.ConfigurationError` where what its batches are made of cannot be
        imported (at open, before any batch; blocking: it may import a library, so the
        opening calls it in a worker thread)."""
        ...

    def start(
        self,
        tops: Mapping[str, TopInfo],
        group_rows: int,
        depth: int,
        offsets: Mapping[str, int] | None = None,
    ) -> None:
        """Prepare for a run: groups of up to ``group_rows`` rows, about ``depth`` groups in
        flight at once (idempotent). ``offsets``: per top, where the rows to gather start within
        a cache line (batch buffers that match them copy faster)."""
        ...

    def make(
        self,
        group: GroupSpec,
        stats: GatherStats,
        helper: Executor | None,
        emit: Callable[[Batch], None] | None = None,
    ) -> tuple[list[Batch], Exception | None]:
        """Gather, transform (and upload) the batches of ``group`` (blocking: a worker thread).
        Returns the complete batches and the error that stopped it, if one did: the batches
        before an error are still delivered, and only they. ``helper``: a second thread to
        gather on. ``emit``: called with each batch, in order, as soon as it is complete; the
        returned list then leaves it out, and nothing here keeps it, so that once the consumer
        drops it its buffers come back; an error ``emit`` raises ends ``make`` there."""
        ...

    def hand_off(self, batch: Batch) -> None:
        """In the consumer's thread, right before ``batch`` is yielded."""
        ...

    def memory(self) -> dict[str, int]:
        """Device memory held (the device fields of :class:`~asynchdf5.LayerStats`)."""
        ...

    def close(self) -> None:
        """Release what the delivery holds (blocking)."""
        ...


def make_delivery(config: LayerConfig) -> Delivery:
    """The delivery for the layer's ``device`` (None: host). A device is resolved now (CuPy
    imported, the GPU checked), so a layer fails at construction when it cannot deliver
    there."""
    if config.device is None:
        return HostDelivery(config.transformers)
    return CudaDelivery.for_layer(config)
