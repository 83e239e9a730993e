"""LayerConfig: every property checked once, the same way for every layer; the docs' table."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asynchdf5 import AsyncHDF5DataLayer, ConfigurationError, MemoryDataLayer
from asynchdf5._config import (
    HDF5_PROPERTIES,
    PROPERTIES,
    REQUIRED,
    LayerConfig,
    property_table,
)

DOCS = Path(__file__).parent.parent / "docs" / "properties.md"


def test_docs_table_is_generated_from_the_config() -> None:
    text = DOCS.read_text(encoding="utf-8")
    begin, end = "<!-- properties: begin -->\n", "<!-- properties: end -->\n"
    assert begin in text and end in text
    table = text.split(begin, 1)[1].split(end, 1)[0]
    assert table == property_table(), (
        "docs/properties.md is out of date: `nox -s docs` rewrites it from asynchdf5._config"
    )


def _keywords(cls: type) -> dict[str, object]:
    """The keyword-only parameters of ``cls``'s signature and their defaults."""
    import inspect

    return {
        name: p.default
        for name, p in inspect.signature(cls).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def test_the_layers_take_the_registry_s_properties_with_its_defaults() -> None:
    """One definition: a property added, renamed or defaulted differently in one place fails
    here (signatures), below (LayerConfig) or above (the docs' table)."""
    from asynchdf5 import HDF5DataLayer

    hdf5 = {name: p.default for name, (_, p) in HDF5_PROPERTIES.items()}
    assert list(PROPERTIES) == list(HDF5_PROPERTIES)[: len(PROPERTIES)]
    assert _keywords(AsyncHDF5DataLayer) == hdf5
    assert _keywords(HDF5DataLayer) == hdf5
    memory = {name: hdf5[name] for name in PROPERTIES}
    assert _keywords(MemoryDataLayer) == {**memory, "tops": None}  # every key of data
    for cls in (AsyncHDF5DataLayer, HDF5DataLayer, MemoryDataLayer):
        doc = cls.__doc__ or ""
        documented = [n for n in _keywords(cls) if f"\n    {n} : " in doc]
        assert documented == list(_keywords(cls)), cls


def test_layer_config_holds_every_property_at_its_default() -> None:
    import dataclasses

    derived = {"rank_source", "seed_given"}
    fields = [f.name for f in dataclasses.fields(LayerConfig)]
    assert set(fields) - derived == set(HDF5_PROPERTIES)
    config = LayerConfig.parse({"batch_size": 8})
    drawn = {"seed", "rank", "world_size"}  # drawn or detected when None
    for name, (_, p) in HDF5_PROPERTIES.items():
        if p.default is not REQUIRED and name not in drawn:
            assert getattr(config, name) == p.check(name, p.default), name


def test_a_keyword_that_is_no_property_is_a_type_error(tmp_path: Path) -> None:
    unexpected = r"{}\(\) got an unexpected keyword argument '{}'"
    with pytest.raises(TypeError, match=unexpected.format("AsyncHDF5DataLayer", "shufle")):
        AsyncHDF5DataLayer([tmp_path / "a.h5"], batch_size=8, shufle=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=unexpected.format("MemoryDataLayer", "chunk_size")):
        MemoryDataLayer({"x": np.arange(10)}, batch_size=8, chunk_size=8)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'batch_size'"):
        MemoryDataLayer({"x": np.arange(10)})  # type: ignore[call-arg]


@pytest.mark.parametrize(("typo", "meant"), [("shufle", "shuffle"), ("batchsize", "batch_size")])
def test_a_misspelt_property_names_the_closest(tmp_path: Path, typo: str, meant: str) -> None:
    with pytest.raises(TypeError, match=f"'{typo}'; did you mean '{meant}'\\?"):
        kwargs: dict[str, Any] = {typo: True}
        AsyncHDF5DataLayer([tmp_path / "a.h5"], batch_size=8, **kwargs)


def test_a_property_of_one_subsystem_is_named_in_few_modules() -> None:
    """Defined once (``_config.py``), taken by the HDF5 layer's constructor, used by its
    subsystem: a property of one subsystem spelled in more modules is a second definition."""
    package = Path(__file__).parent.parent / "asynchdf5"
    for name in ("reuse_buffers", "remote_cache_bytes"):
        word = re.compile(rf"\b{name}\b")
        files = [p for p in package.rglob("*.py") if word.search(p.read_text(encoding="utf-8"))]
        assert len(files) <= 3, (name, sorted(str(p.relative_to(package)) for p in files))


def test_parse_gives_a_frozen_config_with_a_seed() -> None:
    config = LayerConfig.parse({"batch_size": 8})
    assert isinstance(config.seed, int)
    assert config.tops == ("data", "label")
    with pytest.raises(AttributeError):
        config.batch_size = 9  # type: ignore[misc]


CASES = [
    ({"batch_size": 0}, "batch_size must be >= 1"),
    ({"batch_size": 8, "rank": 2, "world_size": 2}, "rank=2 is outside"),
    ({"batch_size": 8, "shuffle": True, "world_size": 2}, "needs an explicit seed"),
    ({"batch_size": 8, "reuse_buffers": True}, "set device= too"),
]


@pytest.mark.parametrize(("kw", "words"), CASES)
def test_the_same_message_from_every_layer(kw: dict[str, Any], words: str, tmp_path: Path) -> None:
    messages = []
    for make in (
        lambda: LayerConfig.parse(kw, caller="x"),
        lambda: MemoryDataLayer({"x": np.arange(10)}, **kw),
        lambda: AsyncHDF5DataLayer([tmp_path / "a.h5"], **kw),
    ):
        with pytest.raises(ConfigurationError) as info:
            make()
        messages.append(str(info.value))
    assert words in messages[0]
    assert len(set(messages)) == 1, messages


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_backend_is_deprecated_and_ignored(backend: str, tmp_path: Path) -> None:
    """The sync interface always runs on asyncio now; old code that names it still runs (the
    types leave it out, so a type checker tells too)."""
    old: dict[str, Any] = {"backend": backend}
    for make in (
        lambda: MemoryDataLayer({"x": np.arange(10)}, batch_size=2, **old),
        lambda: AsyncHDF5DataLayer([tmp_path / "a.h5"], batch_size=2, **old),
    ):
        with pytest.warns(DeprecationWarning, match="backend= is deprecated and has no effect"):
            layer = make()
        assert not hasattr(layer.config, "backend")
    with (
        pytest.warns(DeprecationWarning),
        MemoryDataLayer({"x": np.arange(10)}, batch_size=2, **old) as layer,
    ):
        assert sorted(int(i) for b in layer for i in b["x"]) == list(range(10))


def test_chunk_size_smaller_than_a_batch() -> None:
    with pytest.raises(ConfigurationError, match="chunk_size=4 is smaller than batch_size=8"):
        LayerConfig.parse({"batch_size": 8, "chunk_size": 4})


def test_default_blocks_are_large_but_at_least_192_per_chunk() -> None:
    from asynchdf5._config import BLOCK_BYTES, BLOCKS_PER_CHUNK, MIN_BLOCK_BYTES
    from asynchdf5._sizing import default_block_rows

    image = 3 * 32 * 32 + 8
    # 3x32x32 images with the default chunk_size: the 192-blocks floor binds (about 16 MiB).
    assert default_block_rows(image, 2**20) == 2**20 // BLOCKS_PER_CHUNK == 5461
    # Larger chunks: blocks of about BLOCK_BYTES, the read rate's choice.
    assert default_block_rows(image, 2**24) == BLOCK_BYTES // image
    # Rows of 64 float32: small blocks, so a chunk still holds blocks from all over the data.
    assert default_block_rows(264, 2**20) == 5461
    # ... but never under MIN_BLOCK_BYTES, whatever the chunk_size (1,365 rows were 352 KiB).
    assert default_block_rows(264, 2**18) == MIN_BLOCK_BYTES // 264 == 3971
    assert default_block_rows(image, 2**12) == MIN_BLOCK_BYTES // image == 340
    # Never an empty block.
    assert default_block_rows(10**9, 10) == 1


@pytest.mark.anyio
async def test_the_layer_uses_the_default_blocks(tmp_path: Path) -> None:
    import h5py

    from ._files import write_source

    # Rows of 256 KiB: the chunk_size / 192 cap (10 rows) lies between the 1 MiB floor (4 rows)
    # and BLOCK_BYTES (128 rows). The blocks depend on the properties, not on the data's size.
    big = tmp_path / "big.h5"
    with h5py.File(big, "w") as f:
        f["data"] = np.zeros((100, 65536), np.float32)
        f["label"] = np.arange(100)
    async with AsyncHDF5DataLayer(big, batch_size=10, chunk_size=1920, shuffle=True) as layer:
        assert layer.state_dict()["fingerprint"]["block_rows"] == 10  # 1920 // 192
        async for _ in layer:
            pass
    lst, _ = write_source(tmp_path, (3000, 2000))
    # shuffle=False reads chunks in order: no blocks.
    async with AsyncHDF5DataLayer(lst, batch_size=10, chunk_size=1920) as layer:
        assert layer.state_dict()["fingerprint"]["block_rows"] is None


def test_default_blocks_span_a_few_stored_chunks() -> None:
    from asynchdf5._sizing import default_block_rows

    # gzip chunks of 1,024 rows: blocks of 4 of them where the chunk keeps 16 blocks ...
    assert default_block_rows(3080, 2**17, stored_rows=1024) == 4096
    # ... else as many rows as 16 blocks per chunk allow.
    assert default_block_rows(3080, 2**14, stored_rows=1024) == 1024
    # Larger blocks than that are kept.
    assert default_block_rows(3080, 2**20, stored_rows=1024) == 5461


def test_default_blocks_of_remote_objects_are_a_whole_request() -> None:
    from asynchdf5._sizing import default_block_rows

    request = 8 * 2**20
    # Images streamed from an object store with a small chunk_size: 8 MiB blocks, not 1 MiB ...
    assert default_block_rows(3080, 2**16, request_bytes=request) == request // 3080 == 2723
    assert default_block_rows(3080, 2**16) == 2**16 // 192  # (local files: 1 MiB)
    # ... as long as a chunk keeps 16 blocks ...
    assert default_block_rows(3080, 2**14, request_bytes=request) == 2**14 // 16
    # ... and larger blocks are kept.
    assert default_block_rows(3080, 2**20, request_bytes=request) == 5461


@pytest.mark.anyio
async def test_shuffled_compressed_data_is_decoded_about_once(tmp_path: Path) -> None:
    # Each block decodes every stored chunk it touches whole: blocks much shorter than the
    # stored chunks would read and decode the data set many times over in every epoch.
    import h5py

    path = tmp_path / "gzip.h5"
    n = 20_000
    # Rows of 4 KiB in stored chunks of 256 rows (1 MiB): the 1 MiB floor alone would give
    # blocks of 256 rows, each touching two stored chunks.
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=np.ones((n, 1024), np.float32), chunks=(256, 1024))
        f.create_dataset("label", data=np.arange(n), chunks=(256,), compression="gzip")
    read = {}
    for shuffle in (False, True):
        async with AsyncHDF5DataLayer(
            path, batch_size=50, chunk_size=16384, shuffle=shuffle, seed=0
        ) as layer:
            seen = np.concatenate([b.indices async for b in layer])
            read[shuffle] = layer.stats.bytes_read
        assert np.array_equal(np.sort(seen), np.arange(n))
    # Blocks of 1,024 rows over stored chunks of 256 (256-row blocks: about twice the data).
    assert read[True] <= 1.8 * read[False], read
