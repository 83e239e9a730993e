"""Which shard is this process's: rank and world size, found the way launchers tell them.

In order, the first that answers wins (launchers nest: torchrun inside a Slurm job sets both
``WORLD_SIZE`` and ``SLURM_NTASKS``, with different values, so a later source that disagrees is
not an error):

1. an initialised ``torch.distributed`` (only looked at when the program imported torch);
2. ``RANK`` / ``WORLD_SIZE`` (torchrun, Lightning, accelerate);
3. ``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE`` (Open MPI);
4. ``PMI_RANK`` / ``PMI_SIZE`` (MPICH, Intel MPI);
5. ``SLURM_PROCID`` / ``SLURM_NTASKS`` (Slurm's srun);
6. otherwise rank 0 of 1.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from ._errors import ConfigurationError

__all__ = ["ENVIRONMENT", "Detected", "broadcast_seed", "detect", "torch_distributed"]

#: (rank variable, world size variable, who sets them), in the order they are looked at.
ENVIRONMENT = (
    ("RANK", "WORLD_SIZE", "RANK/WORLD_SIZE (torchrun)"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI"),
    ("PMI_RANK", "PMI_SIZE", "PMI (MPICH, Intel MPI)"),
    ("SLURM_PROCID", "SLURM_NTASKS", "Slurm"),
)


@dataclass(frozen=True)
class Detected:
    """A rank and world size, and where they came from."""

    rank: int
    world_size: int
    source: str


def torch_distributed() -> Any:
    """``torch.distributed`` when the program imported torch and initialised it, else None."""
    if "torch" not in sys.modules:  # never import torch (seconds, gigabytes) just to look
        return None
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - a torch build without it
        return None
    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def _int(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigurationError(
            f"the environment variable {name}={text!r} is not an integer (it tells asynchdf5 "
            "this process's rank or the world size; pass rank= and world_size= to override)"
        ) from None


def detect() -> Detected:
    """This process's rank and world size (see the module docstring for the order)."""
    dist = torch_distributed()
    if dist is not None:
        return Detected(int(dist.get_rank()), int(dist.get_world_size()), "torch.distributed")
    for rank_var, size_var, who in ENVIRONMENT:
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return Detected(_int(rank_var, rank), _int(size_var, size), who)
    return Detected(0, 1, "default")


def broadcast_seed(seed: int) -> int:
    """Rank 0's ``seed``, on every rank of the initialised ``torch.distributed`` group.

    A collective: every rank must call it (constructing its layer) at the same point.
    """
    dist = torch_distributed()
    assert dist is not None
    box = [seed]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])
