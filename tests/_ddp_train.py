"""The DDP training script that ``tests/test_torchrun.py`` runs under ``torchrun`` (gloo, CPU).

Every rank trains a tiny linear model with ``DistributedDataParallel`` (one all-reduce per
batch: unequal batch counts would hang) on an :class:`~asynchdf5.torch.HDF5IterableDataset`
whose rank and world size are detected from the initialised process group, and writes what it
saw into ``--out``:

* ``rank{r}-epoch{e}.json``: the indices of every batch of epoch ``e`` (from the resumed
  position on, in a resumed run), rewritten at each checkpoint and at the end of the epoch;
* ``state-rank{r}.json``: the dataset's state, every ``--save-every`` batches (a checkpoint);
* ``rank{r}-done.json``: the seed, rank, world size and a checksum of the model at the end.

``--crash-epoch E --crash-after K``: every rank exits at once (``os._exit``) after batch ``K``
of epoch ``E``, behind a barrier (so all have written their last checkpoint), like a job that
dies between checkpoints. ``--resume DIR``: rank ``r`` of the new run loads
``DIR/state-rank{r % n}.json`` (``n`` the number of saved states; any rank's state is good for
an elastic resume, since all were saved at the same batch count).

``--stream NAME=LIST:WEIGHT`` (repeated): mix these streams instead of ``--source`` (issue 33).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from asynchdf5 import Stream
from asynchdf5.torch import HDF5IterableDataset


def write_json(path: Path, value: Any) -> None:
    """Atomically: a crash never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--source", default=None)
    p.add_argument("--stream", action="append", default=[], help="NAME=LIST:WEIGHT")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--epochs", type=int, required=True, help="train until this epoch")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--crash-epoch", type=int, default=-1)
    p.add_argument("--crash-after", type=int, default=-1)
    p.add_argument("--resume", type=Path, default=None)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # rank and world_size: detected from the process group; seed=None: rank 0's, broadcast.
    source: Any = args.source
    if args.stream:
        source = {}
        for spec in args.stream:
            name, rest = spec.split("=", 1)
            path, weight = rest.rsplit(":", 1)
            source[name] = Stream(path, weight=float(weight))
    ds = HDF5IterableDataset(
        source, batch_size=args.batch_size, shuffle=True, seed=args.seed, indices=True
    )
    assert (ds.rank, ds.world_size) == (rank, world)
    done = 0  # batches of the current epoch before this run (a resumed one)
    if args.resume is not None:
        saved = sorted(args.resume.glob("state-rank*.json"))
        state = json.loads((args.resume / f"state-rank{rank % len(saved)}.json").read_text())
        ds.load_state_dict(state)
        done = state["batches"]
    loader = DataLoader(ds, batch_size=None)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    while ds.epoch < args.epochs:
        epoch = ds.epoch
        seen: list[list[int]] = []
        for batch in loader:
            x, y, idx = batch["data"], batch["label"], batch["indices"]
            assert ("streams" in batch) == bool(args.stream)
            # Alignment: row i of a file holds label i and data [10 i, 10 i + 1].
            assert torch.equal(y, idx)
            assert torch.equal(x[:, 0], (idx * 10).float()) and torch.equal(x[:, 1], x[:, 0] + 1)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x * 1e-3).squeeze(1), y.float() * 1e-2)
            loss.backward()  # type: ignore[no-untyped-call]  # DDP's all-reduce
            opt.step()
            seen.append(idx.tolist())
            done += 1
            if done % args.save_every == 0:
                write_json(out / f"state-rank{rank}.json", ds.state_dict())
                write_json(out / f"rank{rank}-epoch{epoch}.json", seen)
            if (epoch, done) == (args.crash_epoch, args.crash_after):
                dist.barrier()
                os._exit(3)
        write_json(out / f"rank{rank}-epoch{epoch}.json", seen)
        done = 0

    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    write_json(
        out / f"rank{rank}-done.json",
        {"seed": ds.seed, "rank": rank, "world_size": world, "checksum": checksum},
    )
    ds.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
