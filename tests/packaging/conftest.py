"""What the packaging tests build from: a copy of the files a wheel is made of.

Building in the checkout reuses its ``build/`` folder, whose stale files end up in the
wheel: a file the package data rules miss would still ship, and the test would pass.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Everything pyproject.toml builds the wheel from.
SOURCES = ["pyproject.toml", "README.md", "host", "conformance"]


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory) -> Path:
    """A fresh folder holding :data:`SOURCES` as they are in the checkout (no build/)."""
    dst = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns(
                "__pycache__", "*.pyc", "*.cwasm"))
        else:
            shutil.copy2(src, dst / name)
    return dst
