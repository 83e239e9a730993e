"""LayerConfig: every property checked once, the same way for every layer; the docs' table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asynchdf5 import AsyncHDF5DataLayer, ConfigurationError, MemoryDataLayer
from asynchdf5._config import LayerConfig
from asynchdf5._properties import PROPERTIES, property_table

DOCS = Path(__file__).parent.parent / "docs" / "properties.md"


def test_docs_table_is_generated_from_the_config() -> None:
    text = DOCS.read_text(encoding="utf-8")
    begin, end = "<!-- properties: begin -->\n", "<!-- properties: end -->\n"
    assert begin in text and end in text
    table = text.split(begin, 1)[1].split(end, 1)[0]
    assert table == property_table(), (
        "docs/properties.md is out of date: `nox -s docs` rewrites it from asynchdf5._properties"
    )


def test_every_keyword_of_the_layers_is_documented() -> None:
    import inspect

    documented = {p.name for p in PROPERTIES}
    hdf5 = set(inspect.signature(AsyncHDF5DataLayer).parameters)
    memory = set(inspect.signature(MemoryDataLayer).parameters) - {"data"}
    assert hdf5 == documented
    assert memory <= documented
    assert {p.name for p in PROPERTIES if p.layers == "all"} == memory


def test_parse_gives_a_frozen_config_with_a_seed() -> None:
    config = LayerConfig.parse(batch_size=8)
    assert isinstance(config.seed, int)
    assert config.tops == ("data", "label")
    with pytest.raises(AttributeError):
        config.batch_size = 9  # type: ignore[misc]


CASES = [
    ({"batch_size": 0}, "batch_size must be >= 1"),
    ({"batch_size": 8, "backend": "curio"}, 'backend must be "asyncio" or "trio"'),
    ({"batch_size": 8, "rank": 2, "world_size": 2}, "rank=2 is outside"),
    ({"batch_size": 8, "shuffle": True, "world_size": 2}, "needs an explicit seed"),
    ({"batch_size": 8, "reuse_buffers": True}, "set device= too"),
]


@pytest.mark.parametrize(("kw", "words"), CASES)
def test_the_same_message_from_every_layer(kw: dict[str, Any], words: str, tmp_path: Path) -> None:
    messages = []
    for make in (
        lambda: LayerConfig.parse(**kw),
        lambda: MemoryDataLayer({"x": np.arange(10)}, **kw),
        lambda: AsyncHDF5DataLayer([tmp_path / "a.h5"], **kw),
    ):
        with pytest.raises(ConfigurationError) as info:
            make()
        messages.append(str(info.value))
    assert words in messages[0]
    assert len(set(messages)) == 1, messages


def test_chunk_size_smaller_than_a_batch() -> None:
    with pytest.raises(ConfigurationError, match="chunk_size=4 is smaller than batch_size=8"):
        LayerConfig.parse(batch_size=8, chunk_size=4)
