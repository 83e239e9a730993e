"""rank and world_size detected the way launchers tell them (asynchdf5._distributed).

The environment cases set the variables launchers set; the torch.distributed cases initialise a
real one-process gloo group in this process (a real multi-process group runs in
tests/test_torchrun.py, under torchrun).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import numpy as np
import pytest

from asynchdf5 import ConfigurationError, MemoryDataLayer
from asynchdf5._distributed import ENVIRONMENT, detect

DATA = {"x": np.arange(100)}
ALL = [name for rank, size, _ in ENVIRONMENT for name in (rank, size)]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher variable from the machine running the tests leaks into these."""
    for name in ALL:
        monkeypatch.delenv(name, raising=False)


def test_default_is_rank_0_of_1() -> None:
    layer = MemoryDataLayer(DATA, batch_size=10)
    assert (layer.rank, layer.world_size) == (0, 1)
    assert layer.config.rank_source == "default"


@pytest.mark.parametrize(("rank_var", "size_var", "who"), ENVIRONMENT)
def test_each_launcher(
    monkeypatch: pytest.MonkeyPatch, rank_var: str, size_var: str, who: str
) -> None:
    monkeypatch.setenv(rank_var, "2")
    monkeypatch.setenv(size_var, "4")
    layer = MemoryDataLayer(DATA, batch_size=10, shuffle=True, seed=1)
    assert (layer.rank, layer.world_size) == (2, 4)
    assert layer.config.rank_source == who


def test_the_first_source_wins_when_launchers_nest(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun inside a Slurm job: WORLD_SIZE and SLURM_NTASKS differ; torchrun's is meant."""
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert detect().rank == 5 and detect().world_size == 8


def test_explicit_values_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    layer = MemoryDataLayer(DATA, batch_size=10, rank=0, world_size=1)
    assert (layer.rank, layer.world_size) == (0, 1)
    one = MemoryDataLayer(DATA, batch_size=10, world_size=8)  # rank still from RANK
    assert (one.rank, one.world_size) == (3, 8)


def test_a_bad_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigurationError, match="RANK='zero'"):
        MemoryDataLayer(DATA, batch_size=10)


def test_shuffle_on_several_ranks_needs_a_seed_without_torch_distributed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigurationError, match="explicit seed"):
        MemoryDataLayer(DATA, batch_size=10, shuffle=True)


def test_the_choice_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    with caplog.at_level(logging.INFO, logger="asynchdf5"):
        MemoryDataLayer(DATA, batch_size=10)
    assert "rank 1 of 3 (Open MPI)" in caplog.text


@pytest.fixture
def torch_group() -> Iterator[object]:
    """A real torch.distributed group of one process (gloo, over a local TCP store)."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


# torch.distributed keeps two pipes open after destroy_process_group(), for the rest of the
# process (torch's own; nothing of asynchdf5's): the leak check would count them.
@pytest.mark.leaks_ok
def test_torch_distributed_comes_first(
    monkeypatch: pytest.MonkeyPatch, torch_group: object
) -> None:
    monkeypatch.setenv("RANK", "3")  # torchrun's variables, disagreeing: the group wins
    monkeypatch.setenv("WORLD_SIZE", "4")
    layer = MemoryDataLayer(DATA, batch_size=10, shuffle=True)  # seed broadcast: no error
    assert (layer.rank, layer.world_size) == (0, 1)
    assert layer.config.rank_source == "torch.distributed"
    with pytest.raises(ConfigurationError, match=r"contradicts the initialised torch\.distributed"):
        MemoryDataLayer(DATA, batch_size=10, rank=1, world_size=2)
    with pytest.raises(ConfigurationError, match="world_size=2 contradicts"):
        MemoryDataLayer(DATA, batch_size=10, world_size=2)
