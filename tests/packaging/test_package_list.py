"""Every package folder ships: pyproject lists packages by hand (``epick`` is ``host/``),
and a new folder missing from the list left ``epick.flow`` out of the wheel, so ``epick
serve`` from a ``pip install`` failed on import (the wheel test caught it, 12 min into
``make test``). This check takes a millisecond."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {"epick." + ".".join(p.parent.relative_to(ROOT / "host").parts)
             for p in (ROOT / "host").rglob("__init__.py") if p.parent != ROOT / "host"}
    found |= {"epick", "epick.conformance"}
    assert found - listed == set(), "add these to [tool.setuptools] packages"
