"""The package internals the benchmarks measure, imported in this one place.

Most benchmarks use only the public API (the layers, ``layer.stats``, the documented properties
and environment variables). A few measure something no public name gives, and import it here so
that a rename inside ``asynchdf5`` breaks this file, not several benchmarks:

- the planner's orders and sizes (:func:`plan_epoch`, :func:`default_block_rows`,
  :func:`first_read`, :func:`chunk_lanes`, :func:`size_cache`, :data:`RAMP_TOP_LANES`): shuffle
  quality is a property of the pure plan, measured without reading any file
  (``shuffle_quality``, ``shuffle_training``);
- the reader's constants (:data:`BLOCK_BYTES`, the default shuffled block; :data:`PIECE_BYTES`,
  the bytes one local read call moves; :data:`N_SLOTS`, the cache's slots): ``block_size``
  replays the raw read path with them to choose the default block and check the layer's figure;
- the file attribute ``pack --shuffle`` writes (:data:`SHUFFLED_ATTR`), which ``out_of_core``
  sets on its shuffled copy of the data.
"""

from __future__ import annotations

from asynchdf5._catalog import SHUFFLED_ATTR
from asynchdf5._config import BLOCK_BYTES, RAMP_TOP_LANES
from asynchdf5._plan import plan_epoch
from asynchdf5._sizing import N_SLOTS, chunk_lanes, default_block_rows, first_read, size_cache
from asynchdf5._sources._local import PIECE_BYTES

__all__ = [
    "BLOCK_BYTES",
    "N_SLOTS",
    "PIECE_BYTES",
    "RAMP_TOP_LANES",
    "SHUFFLED_ATTR",
    "chunk_lanes",
    "default_block_rows",
    "first_read",
    "plan_epoch",
    "size_cache",
]
