"""``process=True``: the pipeline in one helper process, batches through shared memory.

The layer's own process keeps only the consumer's side (:class:`ProcessReader`,
:class:`RemoteRun`); the helper (:mod:`asynchdf5._serve`) runs the reader, the cache, the
shuffle, the gathering and the transformers, and writes each batch into a slot of shared memory
that the consumer reads in place (:mod:`._wire`).
"""

from __future__ import annotations

from ._errors import IMPORTING_MAIN, check_picklable, error_blob, payload, rebuild
from ._parent import ProcessReader, forget_kept_interrupts, raise_kept_interrupt
from ._runs import RemoteRun
from ._wire import (
    MAX_MESSAGE,
    Segment,
    needed,
    pack,
    parts_of,
    recv,
    ring_slots,
    send,
    stats_of,
    write_batch,
)

__all__ = [
    "IMPORTING_MAIN",
    "MAX_MESSAGE",
    "ProcessReader",
    "RemoteRun",
    "Segment",
    "check_picklable",
    "error_blob",
    "forget_kept_interrupts",
    "needed",
    "pack",
    "parts_of",
    "payload",
    "raise_kept_interrupt",
    "rebuild",
    "recv",
    "ring_slots",
    "send",
    "stats_of",
    "write_batch",
]
