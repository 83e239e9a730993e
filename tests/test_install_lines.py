"""Every install line works as written (issue 39, item 1): asynchdf5 is installed from a
checkout, not from PyPI, so a line that installs it names the checkout (``pip install .`` or
``".[extra]"``, run at its root) and only extras that pyproject.toml defines. Scanned: the docs,
README.md and the package's own strings (its messages and docstrings)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).parent.parent
#: ``pip install`` and what follows, to the end of the line, a backtick or a closing bracket.
_LINE = re.compile(r"pip install\s+([^`\n)#]*)")


def _files() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "asynchdf5").rglob("*.py")),
    ]


def _requirements(text: str) -> list[str]:
    """The requirements of every ``pip install`` in ``text`` (options left out)."""
    out: list[str] = []
    for m in _LINE.finditer(text):
        for word in m.group(1).split():
            w = word.strip("\"',;:")
            if w in ("in", "(", "or", "&&", "|") or not w:
                break
            if not w.startswith("-"):
                out.append(w)
    return out


def _problems(reqs: list[str], extras: set[str]) -> list[str]:
    bad = []
    for req in reqs:
        name, _, rest = req.partition("[")
        asked = {e.strip() for e in rest.rstrip("]").split(",") if e.strip()}
        if name == "asynchdf5" or name.startswith("asynchdf5 "):
            bad.append(f"{req!r}: asynchdf5 is not on PyPI; install the checkout ('.[...]')")
        elif name in (".", "./") and asked - extras:
            bad.append(f"{req!r}: no extra {sorted(asked - extras)} in pyproject.toml")
    return bad


def test_every_install_line_installs_from_a_checkout_with_extras_that_exist() -> None:
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    found: dict[str, list[str]] = {}
    bad: list[str] = []
    for path in _files():
        reqs = _requirements(path.read_text(encoding="utf-8"))
        found[str(path.relative_to(ROOT))] = reqs
        bad += [f"{path.relative_to(ROOT)}: {p}" for p in _problems(reqs, extras)]
    assert not bad, "\n".join(bad)
    # The scan sees the lines it is meant to check.
    assert ".[torch]" in found["asynchdf5/torch/__init__.py"], found
    assert ".[pack]" in found["docs/packing.md"], found


def test_the_checker_refuses_what_fails() -> None:
    extras = {"torch", "pack"}
    reqs = _requirements('pip install "asynchdf5[torch]" and pip install ".[nope]"')
    assert len(_problems(reqs, extras)) == 2
    assert _problems(_requirements('$ python -m pip install -e ".[torch,pack]"'), extras) == []


def test_the_torch_extra_installs_torchdata() -> None:
    # StatefulDataLoader (docs/pytorch.md) comes from torchdata.
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["torch"]
    assert any(re.match(r"torchdata\b", r) for r in extra), extra
    assert "torchdata" in (ROOT / "docs" / "pytorch.md").read_text()
