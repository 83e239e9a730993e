"""One of two JAX processes of ``test_jax`` (``python -m tests._jax_two SOURCE PORT ID OUT``):
joins ``jax.distributed`` on localhost, iterates one epoch of its share through
:class:`asynchdf5.jax.Loader` into global arrays over both processes' devices, and writes the
labels of its own rows (its addressable shards) to ``OUT``, one batch a line."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

import asynchdf5.jax as aj


def main(source: str, port: int, pid: int, out: Path) -> None:
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
    assert jax.process_count() == 2 and len(jax.devices()) == 2
    lines = []
    with aj.layer(source, batch_size=4, shuffle=True, seed=1) as lay:
        assert (lay.rank, lay.world_size) == (pid, 2)
        loader = aj.Loader(lay)
        for batch in loader:
            label = batch["label"]
            assert label.shape == (8,)  # 4 rows from each process
            (shard,) = label.addressable_shards
            lines.append(" ".join(str(int(v)) for v in np.asarray(shard.data)))
    out.write_text("\n".join(lines) + "\n")
    jax.distributed.shutdown()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
